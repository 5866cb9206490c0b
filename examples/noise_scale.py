"""How much to accumulate? Measure the gradient noise scale and follow it.

Trains one classifier from the same initial weights three ways, all with
micro-batches of `--batch_size` samples and the same optimizer and
learning rate, on data made here (no downloads). Each epoch is a fresh
draw of `--epoch_samples` samples (no sample is seen twice, the regime the
noise scale describes), the same draws for every run:

  small    `AccumModel(accum_steps=--small_steps)`: a small batch, many
           updates
  large    `AccumModel(accum_steps=--large_steps)`: a large batch, few
           updates
  warmup   starts like `small`; `AccumStepsWarmup` sets accum_steps to
           `--factor * B_simple / batch_size` (clipped to
           [--small_steps, --large_steps]) as the measured noise scale grows

Every run measures the simple gradient noise scale `B_simple` (in samples)
with `AccumModel(noise_scale=...)`. Per epoch the table shows each run's
validation loss, its measured `B_simple` and (warm-up) its accum_steps; at
the end, the samples and optimizer updates each run needed to first reach
`--target_loss` on the validation set (checked at epoch ends).

McCandlish et al. (2018) predict that a batch of about `B_simple` samples
is where larger batches stop saving updates; the warm-up aims at that.
Whether it pays off here is what the table says.

    python examples/noise_scale.py
    python examples/noise_scale.py --factor=4 --target_loss=0.9
"""

import os

from absl import app
from absl import flags

_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Micro-batch size.")
_SMALL_STEPS = flags.DEFINE_integer(
    "small_steps",
    2,
    "accum_steps of the small-batch run (>= 2: the noise "
    "scale needs two micro-batches per window).",
)
_LARGE_STEPS = flags.DEFINE_integer(
    "large_steps",
    32,
    "accum_steps of the large-batch run, and the warm-up's upper bound.",
)
_FACTOR = flags.DEFINE_float(
    "factor", 1.0, "The warm-up's target batch, in units of B_simple."
)
_EPOCHS = flags.DEFINE_integer("epochs", 12, "Epochs per run.")
_EPOCH_SAMPLES = flags.DEFINE_integer(
    "epoch_samples", 4096, "Fresh training samples per epoch."
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    0.05,
    "SGD learning rate (with momentum 0.9), the same for every run.",
)
_BETA = flags.DEFINE_float(
    "beta", 0.9, "Decay of the noise scale's moving averages, per window."
)
_TARGET_LOSS = flags.DEFINE_float(
    "target_loss",
    None,
    "Validation loss to reach; default: the best loss the worst run reached.",
)
_WIDTH = flags.DEFINE_integer("width", 64, "Hidden width.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

_FEATURES = 32
_CLASSES = 8
_RUNS = ("small", "large", "warmup")


def make_data(samples, seed):
    """Labels from a random teacher network, with label noise.

    Returns `(x, y)` training data of `samples` rows and 2048 validation
    rows.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples + 2048, _FEATURES)).astype("float32")
    hidden = np.tanh(x @ rng.normal(size=(_FEATURES, 64)) / 3.0)
    logits = hidden @ rng.normal(size=(64, _CLASSES)) * 1.5
    y = np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)
    y = y.astype("int32")
    return (x[:samples], y[:samples]), (x[samples:], y[samples:])


def build(width, seed, **kwargs):
    import tensorflow as tf

    from accum_model import AccumModel

    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((_FEATURES,))
    h = tf.keras.layers.Dense(width, activation="relu")(inputs)
    h = tf.keras.layers.Dense(width, activation="relu")(h)
    outputs = tf.keras.layers.Dense(_CLASSES)(h)
    return AccumModel(inputs=inputs, outputs=outputs, **kwargs)


def train(run, data, initial_weights):
    """Trains one run; returns its per-epoch rows."""
    import tensorflow as tf

    import accum_model

    (x, y), validation = data
    size = _EPOCH_SAMPLES.value
    steps = _LARGE_STEPS.value if run == "large" else _SMALL_STEPS.value
    model = build(
        _WIDTH.value,
        _SEED.value,
        accum_steps=steps,
        noise_scale=accum_model.NoiseScale(beta=_BETA.value),
    )
    model.set_weights(initial_weights)
    model.compile(
        optimizer=tf.keras.optimizers.SGD(_LEARNING_RATE.value, momentum=0.9),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = []
    if run == "warmup":
        # One callback for every epoch: it counts windows across fits.
        callbacks.append(
            accum_model.AccumStepsWarmup(
                factor=_FACTOR.value,
                min_accum_steps=_SMALL_STEPS.value,
                max_accum_steps=_LARGE_STEPS.value,
                warmup_windows=20,
                cooldown_windows=20,
                verbose=0,
            )
        )
    rows = []
    for epoch in range(_EPOCHS.value):
        rows_slice = slice(epoch * size, (epoch + 1) * size)
        history = model.fit(
            x[rows_slice],
            y[rows_slice],
            batch_size=_BATCH_SIZE.value,
            validation_data=validation,
            validation_batch_size=len(validation[0]),
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        rows.append(
            dict(
                samples=(epoch + 1) * size,
                updates=int(model.optimizer.iterations),
                val_loss=history.history["val_loss"][-1],
                b_simple=history.history["gradient_noise_scale"][-1],
                accum_steps=model.accum_steps,
            )
        )
    return rows


def first_reaching(rows, target):
    for row in rows:
        if row["val_loss"] <= target:
            return row
    return None


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    data = make_data(_EPOCH_SAMPLES.value * _EPOCHS.value, _SEED.value)
    initial = build(_WIDTH.value, _SEED.value).get_weights()
    results = {}
    for run in _RUNS:
        tf.keras.utils.set_random_seed(_SEED.value)  # the same shuffles
        results[run] = train(run, data, initial)

    micro = _BATCH_SIZE.value
    print(
        f"\nMicro-batch {micro}; small = {micro * _SMALL_STEPS.value}, "
        f"large = {micro * _LARGE_STEPS.value} samples per update; "
        "B_simple in samples.\n"
    )
    header = (
        "epoch  "
        + "  ".join(f"{run + ' val_loss':>16} {'B_simple':>9}" for run in _RUNS)
        + f" {'warmup N':>9}"
    )
    print(header)
    for epoch in range(_EPOCHS.value):
        cells = []
        for run in _RUNS:
            row = results[run][epoch]
            cells.append(f"{row['val_loss']:>16.4f} {row['b_simple']:>9.1f}")
        n = results["warmup"][epoch]["accum_steps"]
        print(f"{epoch + 1:>5}  " + "  ".join(cells) + f" {n:>9d}")

    target = _TARGET_LOSS.value
    if target is None:
        target = max(
            min(row["val_loss"] for row in rows) for rows in results.values()
        )
    print(f"\nTo reach validation loss {target:.4f}:")
    print(f"{'run':<8} {'samples':>9} {'updates':>9}")
    for run in _RUNS:
        row = first_reaching(results[run], target)
        if row is None:
            print(f"{run:<8} {'never':>9} {'never':>9}")
        else:
            print(f"{run:<8} {row['samples']:>9d} {row['updates']:>9d}")


if __name__ == "__main__":
    app.run(main)
