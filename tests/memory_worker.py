"""Trains a model with large activations per row, in its own process.

Run by `tests/test_auto.py` under a CPU memory limit
(`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=<n>`, read once
at start-up, hence a process of its own), so that a step too large for the
limit raises a real `tf.errors.ResourceExhaustedError`; the references run
in the test's own process, without a limit.

    python tests/memory_worker.py OUT_DIR [--replicas=2] RUN [RUN ...]

`--replicas=2` splits the CPU into two logical devices and trains every run
under a `MirroredStrategy` over them. Each RUN is
`NAME=MODE:LENGTHS[:OPTION...]`, trained in turn in this process: MODE
`plain` (a `keras.Model`), `auto`, `accum` (`accum_steps` at the whole
batch), ints joined by `/` (`micro_batch_size` per batch, one `fit`
each, the window carried between them), or `same=NAME` (the sizes run
NAME of this process used, so); LENGTHS the sequence length of each
batch (`8,64`). OPTIONs: `bn` (`AccumBatchNormalization`, Keras 3, and the
noise scale), `dropout`, `window` (`accum_steps=2`), `mixed`
(`mixed_float16`), `validation` (a validation batch of 128 steps at the
whole batch size), `evaluate` (`evaluate` instead of `fit`). Writes
`OUT_DIR/NAME.npz`: the weights, and `result` (JSON): the optimizer's
iterations, the logged history, the size each batch ran with, how many
variables had added rows beyond the batch's when each retry began, the
noise scale, the peak memory, the warnings about `micro_batch_size`, and
the message of an out-of-memory error that ended `fit`.
"""

import json
import os
import sys
import warnings

import numpy as np
import tensorflow as tf

import accum_model
from accum_model.keras._adapter import LEGACY
from accum_model.keras._adapter import keras
from accum_model.model import _attempts

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


def model(cls, options=(), **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, FEATURES))
    h = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    if "dropout" in options:
        h = keras.layers.Dropout(0.25)(h)
    if "bn" in options and not LEGACY:
        h = accum_model.AccumBatchNormalization()(h)
    h = keras.layers.Dense(WIDTH, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(10, dtype="float32")(h)
    if cls is not keras.Model:
        if "bn" in options:
            kwargs["noise_scale"] = True
        if "window" in options:
            kwargs["accum_steps"] = 2
    m = cls(inputs, outputs, **kwargs)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    if "mixed" in options:
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    m.compile(
        optimizer=optimizer,
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
    """Records the slice size each batch ran with."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def on_train_batch_end(self, batch, logs=None):
        size = getattr(self.model, "micro_batch_size", None)
        if isinstance(size, int):
            self.sizes.append(size)


class _PartialAdditions:
    """Records, at each retry, how many variables had added rows beyond
    those whose slices were all in: what the retry must not add again."""

    def __init__(self):
        self.counts = []
        self._restore = _attempts.AttemptState.restore
        counts = self.counts
        original = self._restore

        def restore(state, before):
            accumulator = state._model.gradient_accumulator
            if accumulator is not None:
                done = float(accumulator.batch_rows())
                counts.append(
                    sum(
                        int(part.numpy()) > done
                        for v in accumulator._engine.rows_added
                        for part in getattr(v, "values", (v,))
                    )
                )
            return original(state, before)

        _attempts.AttemptState.restore = restore

    def close(self):
        _attempts.AttemptState.restore = self._restore


_STRATEGY = []


def strategy():
    """The strategy of this process's runs (`--replicas`): one for all, so
    that their collectives' keys never meet."""
    if not _STRATEGY:
        if len(tf.config.list_logical_devices("CPU")) > 1:
            _STRATEGY.append(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]))
        else:
            _STRATEGY.append(tf.distribute.get_strategy())
    return _STRATEGY[0]


def train(mode, lengths, options=()):
    """Trains one run; returns `(result, weights)`."""
    policy = keras.mixed_precision.global_policy()
    if "mixed" in options:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy().scope():
            return _train(mode, lengths, options)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _train(mode, lengths, options):
    batches = data(lengths)
    batch_size = BATCH
    sizes = []
    if mode == "plain":
        m = model(keras.Model, options)
    elif mode == "accum":
        m = model(accum_model.AccumModel, options, accum_steps=1)
    elif mode == "auto":
        m = model(accum_model.AccumModel, options, micro_batch_size="auto")
    else:
        sizes = [int(n) for n in mode.split("/")]
        # One `fit` per batch: the window goes on from one to the next.
        m = model(
            accum_model.AccumModel,
            options,
            micro_batch_size=sizes[0],
            epoch_end="carry",
        )
    parts = [[b] for b in batches] if sizes else [batches]
    result = {"error": "", "history": {}}
    sizes_run = _SizesRun()
    partial = _PartialAdditions()
    tf.config.experimental.reset_memory_stats("CPU:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, part in enumerate(parts):
                if sizes:
                    m.micro_batch_size = sizes[i]
                if "evaluate" in options:
                    m.evaluate(dataset(part, batch_size), verbose=0)
                    continue
                history = m.fit(
                    dataset(part, batch_size),
                    epochs=1,
                    verbose=0,
                    callbacks=[sizes_run],
                    validation_data=(
                        dataset(data([128]), batch_size)
                        if "validation" in options
                        else None
                    ),
                )
                for k, vs in history.history.items():
                    result["history"].setdefault(k, []).extend(
                        float(v) for v in vs
                    )
        except tf.errors.ResourceExhaustedError as error:
            result["error"] = error.message
    partial.close()
    result["partial_additions"] = partial.counts
    result["sizes"] = sizes_run.sizes
    result["warnings"] = [
        str(w.message) for w in caught if "micro_batch_size" in str(w.message)
    ]
    result["iterations"] = int(m.optimizer.iterations.numpy())
    result["micro_batch_size"] = getattr(m, "micro_batch_size", None)
    result["noise_scale"] = getattr(m, "gradient_noise_scale", None)
    result["peak_mib"] = (
        tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    )
    weights = [np.asarray(w) for w in m.weights]
    return result, weights


def main(argv):
    out = argv[1]
    runs = argv[2:]
    if runs and runs[0].startswith("--replicas="):
        replicas = int(runs.pop(0).split("=")[1])
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    sizes = {}
    for spec in runs:
        name, rest = spec.split("=", 1)
        mode, lengths, *options = rest.split(":")
        if mode.startswith("same="):
            # The sizes an earlier run of this process used, per batch.
            mode = "/".join(str(n) for n in sizes[mode[len("same=") :]])
        lengths = [int(n) for n in lengths.split(",")]
        result, weights = train(mode, lengths, options)
        sizes[name] = result["sizes"]
        np.savez(
            os.path.join(out, f"{name}.npz"),
            result=json.dumps(result),
            **{f"w{i}": w for i, w in enumerate(weights)},
        )


if __name__ == "__main__":
    main(sys.argv)
