"""A larger batch without retuning: linear scaling against AdaScale SGD.

Trains one classifier from the same initial weights, on data made here (no
downloads), every sample seen at most once:

  base        batch `--base_batch`, SGD with momentum at the tuned
              `--learning_rate` and a step schedule (x0.1 at 50% and 75% of
              `--base_updates`), for `--base_updates` updates
  linear xN   batch `N * base_batch` (`accum_steps=N`), learning rate
              `N * --learning_rate`, the schedule compressed to
              `base_updates / N` updates (the linear scaling rule)
  adascale xN batch `N * base_batch`, `AdaScale(base_batch)` on the base
              learning rate and schedule: each update's rate is `r` times
              the schedule at `tau`, and training stops when `tau` (the sum
              of the gains) reaches `--base_updates`

for each N of `--scales`. The table shows, per run, the optimizer updates
and training samples it took to first reach `--target_loss` on the
validation set (checked every `--eval_samples` samples; by default the
base run's final validation loss plus 1%), its updates and samples in all,
its mean gain and its final validation loss.

    python examples/adascale.py
    python examples/adascale.py --scales=2,8 --base_updates=2000
"""

import os

from absl import app
from absl import flags

_BASE_BATCH = flags.DEFINE_integer(
    "base_batch", 16, "The batch the learning rate was tuned for."
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    0.025,
    "The base batch's SGD learning rate. The default is the best final "
    "validation loss of the base run among 0.00625, 0.0125, 0.025, 0.05 and "
    "0.1 (the other defaults, seed 0).",
)
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
_BASE_UPDATES = flags.DEFINE_integer(
    "base_updates", 1200, "Updates of the base run (the schedule's length)."
)
_SCALES = flags.DEFINE_list(
    "scales", ["4", "16", "64"], "Batch scales N (accum_steps of base batches)."
)
_EVAL_SAMPLES = flags.DEFINE_integer(
    "eval_samples",
    2048,
    "Training samples between validation checks (a multiple of every "
    "scaled batch).",
)
_TARGET_LOSS = flags.DEFINE_float(
    "target_loss",
    None,
    "Validation loss to reach; default: the base run's final loss + 1%.",
)
_WIDTH = flags.DEFINE_integer("width", 32, "Hidden width.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

_FEATURES = 16
_CLASSES = 4
_VALIDATION = 2048


def make_data(samples, seed):
    """Labels from a random teacher network, with label noise.

    The teacher and the validation rows depend on `seed` only, and the
    training rows are a prefix of one stream: runs that need fewer samples
    see the same first ones.

    Returns:
        `(x, y)` training data of `samples` rows, and `_VALIDATION`
        validation rows.
    """
    import numpy as np

    teacher = np.random.default_rng(seed)
    w1 = teacher.normal(size=(_FEATURES, 32))
    w2 = teacher.normal(size=(32, _CLASSES))

    def draw(rows, stream):
        x = np.random.default_rng([seed, stream, 0]).normal(
            size=(rows, _FEATURES)
        )
        logits = np.tanh(x @ w1 / 2.0) @ w2 * 2.0
        noise = np.random.default_rng([seed, stream, 1]).gumbel(
            size=logits.shape
        )
        y = np.argmax(logits + noise, axis=1)
        return x.astype("float32"), y.astype("int32")

    return draw(samples, 1), draw(_VALIDATION, 2)


def build(width, seed, **kwargs):
    import tensorflow as tf

    from accum_model import AccumModel

    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((_FEATURES,))
    h = tf.keras.layers.Dense(width, activation="relu")(inputs)
    outputs = tf.keras.layers.Dense(_CLASSES)(h)
    return AccumModel(inputs=inputs, outputs=outputs, **kwargs)


def step_schedule(learning_rate, updates):
    """The base schedule: x0.1 at half and at three quarters of `updates`."""
    import tensorflow as tf

    return tf.keras.optimizers.schedules.PiecewiseConstantDecay(
        [0.5 * updates, 0.75 * updates],
        [learning_rate, learning_rate * 0.1, learning_rate * 0.01],
    )


def train(kind, scale, data, initial_weights, settings):
    """Trains one run.

    Args:
        kind: `"base"`, `"linear"` or `"adascale"`.
        scale: Int N, the batch in base batches (1 for `"base"`).
        data: What `make_data` returned.
        initial_weights: The weights every run starts from.
        settings: Dict of `base_batch`, `learning_rate`, `momentum`,
            `base_updates`, `eval_samples`, `width`, `seed`.

    Returns:
        A list of `(samples, updates, val_loss, tau)` per validation check,
        the first at 0 samples.
    """
    import tensorflow as tf

    import accum_model

    (x, y), (x_val, y_val) = data
    base, updates = settings["base_batch"], settings["base_updates"]
    kwargs = dict(accum_steps=scale)
    lr, length = settings["learning_rate"], updates
    if kind == "linear":
        lr, length = lr * scale, updates / scale
    if kind == "adascale":
        kwargs["adascale"] = accum_model.AdaScale(base_batch=base)
    model = build(settings["width"], settings["seed"], **kwargs)
    model.set_weights(initial_weights)
    model.compile(
        optimizer=tf.keras.optimizers.SGD(
            step_schedule(lr, length), momentum=settings["momentum"]
        ),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def done():
        if kind == "adascale":
            return model.adascale_tau >= updates
        return int(model.optimizer.iterations) >= length

    class StopAtTau(tf.keras.callbacks.Callback):
        # Tau moves only when a window closes, so the stop leaves no
        # window open.
        def on_train_batch_end(self, batch, logs=None):
            if kind == "adascale" and logs["adascale_tau"] >= updates:
                self.model.stop_training = True

    def evaluate(samples):
        loss = model.evaluate(x_val, y_val, batch_size=_VALIDATION, verbose=0)
        tau = model.adascale_tau if kind == "adascale" else None
        return samples, int(model.optimizer.iterations), loss, tau

    rows = [evaluate(0)]
    chunk = settings["eval_samples"]
    samples = 0
    while not done():
        if kind != "adascale":
            # The last chunk holds the updates left, no more.
            left = (length - int(model.optimizer.iterations)) * base * scale
            take = min(chunk, int(left))
        else:
            take = chunk
        if samples + take > len(x):
            raise ValueError(
                f"The run {kind} x{scale} needs more than {len(x)} samples."
            )
        part = slice(samples, samples + take)
        before = int(model.optimizer.iterations)
        model.fit(
            x[part],
            y[part],
            batch_size=base,
            shuffle=False,
            verbose=0,
            callbacks=[StopAtTau()],
        )
        # Each update took `scale` micro-batches of the base batch.
        samples += (int(model.optimizer.iterations) - before) * base * scale
        rows.append(evaluate(samples))
    return rows


def first_reaching(rows, target):
    for row in rows:
        if row[2] <= target:
            return row
    return None


def run_all(settings, scales):
    """Trains every run; returns `{name: rows}` in the table's order."""
    import tensorflow as tf

    longest = max(scales)
    # AdaScale at gain 1 would take `scale` times the base's samples.
    samples = settings["base_updates"] * settings["base_batch"] * longest
    data = make_data(samples, settings["seed"])
    initial = build(settings["width"], settings["seed"]).get_weights()
    results = {}
    runs = [("base", 1)]
    for scale in scales:
        runs += [("linear", scale), ("adascale", scale)]
    for kind, scale in runs:
        tf.keras.utils.set_random_seed(settings["seed"])
        name = "base" if kind == "base" else f"{kind} x{scale}"
        results[name] = train(kind, scale, data, initial, settings)
    return results


def print_table(results, target):
    print(f"\nTo reach validation loss {target:.4f}, and at the end:")
    print(
        f"{'run':<14} {'updates':>8} {'samples':>8}   {'updates':>8} "
        f"{'samples':>8} {'mean gain':>9} {'final loss':>10}"
    )
    for name, rows in results.items():
        first = first_reaching(rows, target)
        reached = (
            f"{'never':>8} {'never':>8}"
            if first is None
            else f"{first[1]:>8d} {first[0]:>8d}"
        )
        samples, updates, loss, tau = rows[-1]
        gain = "" if tau is None else f"{tau / updates:>9.2f}"
        print(
            f"{name:<14} {reached}   {updates:>8d} {samples:>8d} "
            f"{gain:>9} {loss:>10.4f}"
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = dict(
        base_batch=_BASE_BATCH.value,
        learning_rate=_LEARNING_RATE.value,
        momentum=_MOMENTUM.value,
        base_updates=_BASE_UPDATES.value,
        eval_samples=_EVAL_SAMPLES.value,
        width=_WIDTH.value,
        seed=_SEED.value,
    )
    scales = [int(s) for s in _SCALES.value]
    results = run_all(settings, scales)
    target = _TARGET_LOSS.value
    if target is None:
        target = results["base"][-1][2] * 1.01
    print_table(results, target)


if __name__ == "__main__":
    app.run(main)
