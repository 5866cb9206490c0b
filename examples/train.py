"""Small batch, small batch accumulated, and the large batch, side by side.

Trains the same classifier from the same initial weights four ways on data
made here (no downloads):

  small      plain `tf.keras.Model`, batch `--batch_size`
  accum      `AccumModel(accum_steps=N)`, batch `--batch_size`
  large      plain `tf.keras.Model`, batch `--batch_size * N`
  large_xla  the same large batch compiled with XLA: only the order of float
             sums differs, which shows how far float32 rounding alone moves
             the weights over this many updates (the noise floor)

and prints a table: the accumulated run ends on the large batch's weights
(within that noise floor) while its training memory is that of the small
batch.
Each run happens in a fresh process so that its peak memory is its own.

    python examples/train.py --accum_steps=8 --batch_size=32
"""

import sys

import peak_memory
from absl import app
from absl import flags

_ACCUM_STEPS = flags.DEFINE_integer(
    "accum_steps", 16, "Micro-batches per optimizer update."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 128, "Micro-batch size.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_SAMPLES = flags.DEFINE_integer(
    "samples", 20000, "Training samples (need not divide the batch sizes)."
)
_WIDTH = flags.DEFINE_integer(
    "width", 512, "Hidden width; activations dominate memory at large batch."
)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer",
    "momentum",
    ["sgd", "momentum", "adam"],
    "Optimizer. Adam turns float32 rounding noise on near-zero gradients into "
    "full-size steps, so its runs drift apart visibly over many updates even "
    "between two large-batch runs that only sum in another order.",
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

_FEATURES = 64
_CLASSES = 10
_RUNS = ("small", "accum", "large", "large_xla")


def make_data(samples, seed):
    """A synthetic classification task: labels from a random teacher."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples + 1000, _FEATURES)).astype("float32")
    teacher = rng.normal(size=(_FEATURES, _CLASSES))
    y = np.argmax(
        np.tanh(x @ teacher) + 0.5 * rng.normal(size=(len(x), _CLASSES)), axis=1
    ).astype("int32")
    return (x[:samples], y[:samples]), (x[samples:], y[samples:])


def build(model_cls, width, seed, **kwargs):
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((_FEATURES,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    outputs = keras.layers.Dense(_CLASSES)(h)
    return model_cls(inputs=inputs, outputs=outputs, **kwargs)


def run_one(run, config, queue):
    """Trains one configuration; puts (weights, history, peak bytes)."""
    peak_memory.prepare_process()
    import numpy as np
    import tensorflow as tf

    from accum_model import AccumModel

    keras = tf.keras
    (x, y), (xv, yv) = make_data(config["samples"], config["seed"])
    steps = config["accum_steps"]
    if run == "accum":
        model = build(
            AccumModel, config["width"], config["seed"], accum_steps=steps
        )
    else:
        model = build(keras.Model, config["width"], config["seed"])
    batch = config["batch_size"] * (steps if run.startswith("large") else 1)
    optimizers = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(1e-3),
    }
    model.compile(
        optimizer=optimizers[config["optimizer"]](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=run == "large_xla",
    )
    device = peak_memory.memory_device(tf)
    tf.config.experimental.reset_memory_stats(device)
    history = model.fit(
        x,
        y,
        batch_size=batch,
        epochs=config["epochs"],
        shuffle=False,
        validation_data=(xv, yv),
        verbose=2 if config["verbose"] else 0,
    )
    # TensorFlow's own allocator: tensors alive at once during training.
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    queue.put(
        (
            [np.asarray(w) for w in model.get_weights()],
            {k: [float(v) for v in vs] for k, vs in history.history.items()},
            int(model.optimizer.iterations),
            peak,
            device,
        )
    )


def compare(
    accum_steps,
    batch_size,
    epochs,
    samples,
    width,
    optimizer,
    seed,
    verbose=False,
):
    """Runs the four configurations, each in its own process.

    Returns:
        A dict run -> {"weights", "history", "updates", "peak_bytes",
        "device"}.
    """
    config = dict(
        accum_steps=accum_steps,
        batch_size=batch_size,
        epochs=epochs,
        samples=samples,
        width=width,
        optimizer=optimizer,
        seed=seed,
        verbose=verbose,
    )
    results = {}
    for run in _RUNS:
        weights, history, updates, peak, device = peak_memory.run_in_process(
            run_one, run, config
        )
        results[run] = dict(
            weights=weights,
            history=history,
            updates=updates,
            peak_bytes=peak,
            device=device,
        )
    return results


def max_diff(a, b):
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def report(results, accum_steps, batch_size):
    """Formats the comparison table and the verdict."""
    large = results["large"]["weights"]
    memory = f"peak {results['large']['device']} memory"
    rows = [
        (
            "run",
            "batch/update",
            "updates",
            "train loss",
            "val acc",
            "max |w - w_large|",
            memory,
        )
    ]
    sizes = {
        "small": batch_size,
        "accum": batch_size * accum_steps,
        "large": batch_size * accum_steps,
        "large_xla": batch_size * accum_steps,
    }
    labels = {
        "small": f"small (B={batch_size})",
        "accum": f"accum (B={batch_size}, N={accum_steps})",
        "large": f"large (B={batch_size * accum_steps})",
        "large_xla": "large, XLA sum order",
    }
    for run in _RUNS:
        r = results[run]
        rows.append(
            (
                labels[run],
                str(sizes[run]),
                str(r["updates"]),
                f"{r['history']['loss'][-1]:.4f}",
                f"{r['history']['val_accuracy'][-1]:.4f}",
                f"{max_diff(r['weights'], large):.2e}",
                f"{r['peak_bytes'] / 2**20:.1f} MiB",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    diff = max_diff(results["accum"]["weights"], large)
    noise = max_diff(results["large_xla"]["weights"], large)
    matches = diff <= max(1e-5, 2 * noise)
    small_diff = max_diff(results["small"]["weights"], large)
    lines.append("")
    lines.append(
        f"accum {'matches' if matches else 'DOES NOT match'} the large batch: "
        f"max |diff| {diff:.1e}, against {noise:.1e} between two large-batch "
        f"runs that only sum in another order, and {small_diff:.1e} for the "
        "small batch alone."
    )
    if results["large"]["peak_bytes"] > 0:  # tiny runs may report none
        ratio = results["accum"]["peak_bytes"] / results["large"]["peak_bytes"]
        lines.append(
            f"Memory: accum peaks at {ratio:.0%} of the large batch's "
            "(activations of one micro-batch, plus one float32 copy of the "
            "weights for the accumulators)."
        )
    return "\n".join(lines), matches


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    print(
        f"Training {len(_RUNS)} ways for {_EPOCHS.value} epochs on "
        f"{_SAMPLES.value} synthetic samples (each run in its own process)...",
        flush=True,
    )
    results = compare(
        _ACCUM_STEPS.value,
        _BATCH_SIZE.value,
        _EPOCHS.value,
        _SAMPLES.value,
        _WIDTH.value,
        _OPTIMIZER.value,
        _SEED.value,
        verbose=True,
    )
    table, matches = report(results, _ACCUM_STEPS.value, _BATCH_SIZE.value)
    print()
    print(table)
    if not matches:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
