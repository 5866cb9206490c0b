"""Peak memory of one way of training a model whose weights dominate.

Run by `tests/test_split.py` in a process of its own (a peak is per
process; the CPU's BFC allocator, which keeps one, is chosen at start-up):

    python tests/weight_memory_worker.py MODE EFFECTIVE_BATCH SLICES

MODE: `plain` (`fit` at the effective batch E), `accum`
(`accum_steps=SLICES` at E / SLICES) or `split` (`micro_batch_size=E /
SLICES` at E). Trains one update to warm up, then one more; prints JSON:
the allocator's peak over the second (bytes) and the model's weight bytes.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import accum_model  # noqa: E402

WIDTH = 1024
DEPTH = 3


def main(mode, effective, slices):
    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * effective, WIDTH)).astype("float32")
    y = rng.integers(0, 10, (2 * effective,)).astype("int32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    batch = effective
    if mode == "accum":
        accum_model.accumulate(model, slices)
        batch = effective // slices
    elif mode == "split":
        accum_model.accumulate(model, micro_batch_size=effective // slices)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    fit = dict(batch_size=batch, verbose=0, shuffle=False)
    model.fit(x[:effective], y[:effective], **fit)
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(x[effective:], y[effective:], **fit)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    print(json.dumps({"peak": peak, "weight_bytes": weights}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
