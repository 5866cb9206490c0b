"""`fit(batch_size=256)` on a device that fits less: `micro_batch_size="auto"`.

Trains one model, from the same weights, with the batch you mean (256 rows
of long sequences), each run in its own process:

- plain fit with no memory limit: the reference;
- plain fit under the limit: it runs out of memory;
- `micro_batch_size="auto"` under the limit: the first batch runs out of
  memory whole, the model halves the slice and runs the same batch again,
  until it fits, then trains on;
- `accum_steps=4` at a quarter of the batch under the limit, for comparison
  (Keras then counts quarter batches).

The limit is real: TensorFlow's CPU allocator capped with
`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB`, so a step that
needs more raises `tf.errors.ResourceExhaustedError`. On this allocator each
out-of-memory error costs about 10 s (it waits for memory to be freed).

    python examples/fit_any_batch.py
    python examples/fit_any_batch.py --memory_limit_mib=40 --length=96
"""

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peak_memory  # noqa: E402

_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "The batch you mean.")
_SAMPLES = flags.DEFINE_integer("samples", 1024, "Training samples.")
_LENGTH = flags.DEFINE_integer("length", 64, "Sequence length.")
_WIDTH = flags.DEFINE_integer("width", 512, "Width of the per-step layers.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Epochs.")
_RUNS = flags.DEFINE_list(
    "runs",
    ["large", "auto", "accum"],
    "Runs under the limit besides the reference: large, auto, accum.",
)
_MEMORY_LIMIT = flags.DEFINE_integer(
    "memory_limit_mib",
    70,
    "The CPU allocator's limit, in MiB, for the runs under a limit.",
)


def run_one(run, config, queue):
    """Trains one run in this (fresh) process; puts its results on `queue`."""
    if config["limit"]:
        os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(config["limit"])
        # TensorFlow's oneDNN matrix multiply crashes (SIGSEGV) when its
        # output's allocation fails, where the other kernels raise.
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    peak_memory.prepare_process("cpu")
    import numpy as np
    import tensorflow as tf

    import accum_model

    keras = tf.keras

    rng = np.random.default_rng(0)
    features = 16
    x = rng.normal(size=(config["samples"], config["length"], features))
    x = x.astype("float32")
    y = (x[:, :, 0].mean(axis=1) > 0).astype("int32")

    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, features))
    h = keras.layers.Dense(config["width"], activation="relu")(inputs)
    h = keras.layers.Dense(config["width"], activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(2)(h)
    batch_size = config["batch_size"]
    if run == "auto":
        model = accum_model.AccumModel(inputs, outputs, micro_batch_size="auto")
    elif run == "accum":
        model = accum_model.AccumModel(inputs, outputs, accum_steps=4)
        batch_size //= 4
    else:
        model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tf.config.experimental.reset_memory_stats("CPU:0")
    result = {"error": None, "loss": None}
    try:
        history = model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=config["epochs"],
            shuffle=False,
            verbose=0,
        )
        result["loss"] = history.history["loss"][-1]
    except tf.errors.ResourceExhaustedError:
        result["error"] = "out of memory"
    result["updates"] = int(model.optimizer.iterations)
    result["micro_batch_size"] = getattr(model, "micro_batch_size", None)
    result["peak_mib"] = (
        tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    )
    result["weights"] = [np.asarray(w) for w in model.get_weights()]
    queue.put(result)


def main(argv):
    del argv
    import numpy as np

    config = {
        "batch_size": _BATCH_SIZE.value,
        "samples": _SAMPLES.value,
        "length": _LENGTH.value,
        "width": _WIDTH.value,
        "epochs": _EPOCHS.value,
    }
    limit = _MEMORY_LIMIT.value
    names = {
        "large": "large",
        "auto": 'micro_batch_size="auto"',
        "accum": "accum_steps=4",
    }
    runs = [("large, no limit", "large", None)] + [
        (names[run], run, limit) for run in _RUNS.value
    ]
    results = {}
    for name, run, run_limit in runs:
        print(f"training: {name} ...", flush=True)
        results[name] = peak_memory.run_in_process(
            run_one, run, dict(config, limit=run_limit)
        )
    reference = results["large, no limit"]["weights"]

    columns = [
        ("run", 24),
        ("limit", 8),
        ("batch/update", 12),
        ("micro-batch", 11),
        ("updates", 7),
        ("train loss", 13),
        ("max |w - w_large|", 17),
        ("peak", 9),
    ]
    print()
    print("  ".join(f"{name:<{width}}" for name, width in columns))
    print("  ".join("-" * width for _, width in columns))
    for name, run, run_limit in runs:
        r = results[name]
        limit_cell = f"{run_limit} MiB" if run_limit else "none"
        micro = r["micro_batch_size"]
        if run == "accum":
            micro = config["batch_size"] // 4
        elif micro is None:
            micro = config["batch_size"]
        if r["error"]:
            loss = distance = r["error"]
        else:
            loss = f"{r['loss']:.4f}"
            distance = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(r["weights"], reference)
            )
            distance = f"{distance:.2e}"
        cells = [
            name,
            limit_cell,
            config["batch_size"],
            micro,
            r["updates"],
            loss,
            distance,
            f"{r['peak_mib']:.1f} MiB",
        ]
        print(
            "  ".join(
                f"{str(cell):<{width}}"
                for cell, (_, width) in zip(cells, columns)
            ).rstrip()
        )
    auto = results.get('micro_batch_size="auto"')
    if auto is not None and auto["error"] is None:
        print(
            f'\nmicro_batch_size="auto" chose {auto["micro_batch_size"]} '
            f"rows per slice and trained as the batch of "
            f"{config['batch_size']}."
        )


if __name__ == "__main__":
    app.run(main)
