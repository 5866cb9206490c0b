"""Trains a model with large activations per row, in its own process.

Run by `tests/test_auto.py` under a CPU memory limit
(`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=<n>`, read once
at start-up, hence a process of its own), so that a step too large for the
limit raises a real `tf.errors.ResourceExhaustedError`.

    python tests/memory_worker.py OUT_DIR RUN [RUN ...]

Each RUN is `NAME=MODE:LENGTHS[:extras][:validation]`, trained in turn in
this process:
MODE `plain` (a `keras.Model`), `auto`, an int (`micro_batch_size`),
ints joined by `/` (`micro_batch_size` per batch, one `fit` each), or
`accum` (`accum_steps=2` at the whole batch); LENGTHS the sequence length
of each batch (`8,8,64,64`); `extras` adds Dropout,
`AccumBatchNormalization` (Keras 3) and the noise scale; `validation`
validates on a batch of 128 steps at the whole batch size. Writes
`OUT_DIR/NAME.npz`: the weights, and `result` (JSON): the optimizer's
iterations, the loss history, the size each batch ran with, the noise
scale, the peak memory, the warnings about `micro_batch_size`, and the
message of an out-of-memory error that ended `fit`.
"""

import json
import os
import sys
import warnings

import numpy as np
import tensorflow as tf

import accum_model
from accum_model._keras import LEGACY
from accum_model._keras import keras

BATCH = 256
FEATURES = 16
WIDTH = 512


def data(lengths, seed=0):
    """One batch of BATCH rows per entry of `lengths`, that many steps long."""
    rng = np.random.default_rng(seed)
    batches = []
    for length in lengths:
        x = rng.normal(size=(BATCH, length, FEATURES)).astype("float32")
        y = rng.integers(0, 10, size=(BATCH,)).astype("int32")
        batches.append((x, y))
    return batches


def model(cls, extras=False, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, FEATURES))
    h = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    if extras:
        h = keras.layers.Dropout(0.25)(h)
        if not LEGACY:
            h = accum_model.AccumBatchNormalization()(h)
    h = keras.layers.Dense(WIDTH, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(10)(h)
    if extras and cls is not keras.Model:
        kwargs["noise_scale"] = True
    m = cls(inputs, outputs, **kwargs)
    m.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def dataset(batches, batch_size):
    def generate():
        for x, y in batches:
            for i in range(0, BATCH, batch_size):
                yield x[i : i + batch_size], y[i : i + batch_size]

    return tf.data.Dataset.from_generator(
        generate,
        output_signature=(
            tf.TensorSpec((None, None, FEATURES), tf.float32),
            tf.TensorSpec((None,), tf.int32),
        ),
    )


class _SizesRun(keras.callbacks.Callback):
    """Records the slice size each batch ran with (`"auto"`'s logs)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def on_train_batch_end(self, batch, logs=None):
        if logs and "micro_batch_size" in logs:
            self.sizes.append(int(logs["micro_batch_size"]))


def train(mode, lengths, extras, validation=False):
    """Trains one run; returns `(result, weights)`."""
    batches = data(lengths)
    batch_size = BATCH
    if mode == "plain":
        m = model(keras.Model, extras)
    elif mode == "accum":
        m = model(accum_model.AccumModel, extras, accum_steps=2)
    elif mode == "auto":
        m = model(accum_model.AccumModel, extras, micro_batch_size="auto")
    else:
        sizes = [int(n) for n in mode.split("/")]
        m = model(accum_model.AccumModel, extras, micro_batch_size=sizes[0])
    # One `fit` per part: all batches, or one batch per size.
    parts = [batches]
    if "/" in mode:
        parts = [[b] for b in batches]
    result = {"error": "", "history": {}}
    sizes_run = _SizesRun()
    tf.config.experimental.reset_memory_stats("CPU:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, part in enumerate(parts):
                if "/" in mode:
                    m.micro_batch_size = sizes[i]
                history = m.fit(
                    dataset(part, batch_size),
                    epochs=1,
                    verbose=0,
                    callbacks=[sizes_run],
                    validation_data=(
                        dataset(data([128]), batch_size) if validation else None
                    ),
                )
                for k, vs in history.history.items():
                    result["history"].setdefault(k, []).extend(
                        float(v) for v in vs
                    )
        except tf.errors.ResourceExhaustedError as error:
            result["error"] = error.message
    result["sizes"] = sizes_run.sizes
    result["warnings"] = [
        str(w.message) for w in caught if "micro_batch_size" in str(w.message)
    ]
    result["iterations"] = int(m.optimizer.iterations)
    result["micro_batch_size"] = getattr(m, "micro_batch_size", None)
    result["noise_scale"] = getattr(m, "gradient_noise_scale", None)
    result["peak_mib"] = (
        tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    )
    weights = [np.asarray(w) for w in m.weights]
    return result, weights


def main(argv):
    out = argv[1]
    for spec in argv[2:]:
        name, rest = spec.split("=", 1)
        mode, lengths, *options = rest.split(":")
        lengths = [int(n) for n in lengths.split(",")]
        result, weights = train(
            mode, lengths, "extras" in options, "validation" in options
        )
        np.savez(
            os.path.join(out, f"{name}.npz"),
            result=json.dumps(result),
            **{f"w{i}": w for i, w in enumerate(weights)},
        )


if __name__ == "__main__":
    main(sys.argv)
