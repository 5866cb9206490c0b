"""How far AccumModel and Keras' built-in option land from the large batch.

For each scenario, trains the same small model from the same weights three
ways on data made here:

  truth     plain `tf.keras.Model` with the large batch (micro-batch * N)
  accum     `AccumModel(accum_steps=N)` with the micro-batch
  builtin   plain `tf.keras.Model` with the micro-batch and
            `optimizer(gradient_accumulation_steps=N)`

and prints max |w - w_truth| over all weights at the end of training.

    python benchmarks/compare_builtin.py
"""

import json

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

from accum_model import AccumModel

keras = tf.keras

_JSON = flags.DEFINE_string("json", None, "Also write the results here.")


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(4, 3))).astype("float32")
    return x, y


def _model(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return cls(inputs=inputs, outputs=keras.layers.Dense(3)(h), **kwargs)


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.2, 1, 0.7)


# name: (samples, micro-batch, N, epochs, optimizer factory(**kw))
SCENARIOS = {
    "equal micro-batches, SGD": (
        16,
        2,
        4,
        1,
        lambda **kw: keras.optimizers.SGD(0.1, **kw),
    ),
    "short last micro-batch (22 = 5x4 + 2, N=2)": (
        22,
        4,
        2,
        1,
        lambda **kw: keras.optimizers.SGD(0.1, **kw),
    ),
    "partial window at epoch end (11 micro-batches, N=4), 2 epochs": (
        22,
        2,
        4,
        2,
        lambda **kw: keras.optimizers.SGD(0.1, **kw),
    ),
    "learning-rate schedule (ExponentialDecay)": (
        16,
        2,
        4,
        2,
        lambda **kw: keras.optimizers.SGD(_schedule(), **kw),
    ),
    "Adam with EMA (use_ema=True)": (
        16,
        2,
        4,
        2,
        lambda **kw: keras.optimizers.Adam(
            0.05, use_ema=True, ema_momentum=0.5, **kw
        ),
    ),
    "AdamW, weight decay 0.1": (
        16,
        2,
        4,
        2,
        lambda **kw: keras.optimizers.AdamW(0.05, weight_decay=0.1, **kw),
    ),
}


def _fit(model, optimizer, x, y, batch_size, epochs):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return model.get_weights()


def _diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def run_all():
    results = {}
    for name, (n, micro, steps, epochs, make_opt) in SCENARIOS.items():
        x, y = _data(n)
        truth = _fit(
            _model(keras.Model), make_opt(), x, y, micro * steps, epochs
        )
        accum = _fit(
            _model(AccumModel, accum_steps=steps),
            make_opt(),
            x,
            y,
            micro,
            epochs,
        )
        builtin = _fit(
            _model(keras.Model),
            make_opt(gradient_accumulation_steps=steps),
            x,
            y,
            micro,
            epochs,
        )
        results[name] = {
            "accum": _diff(accum, truth),
            "builtin": _diff(builtin, truth),
        }
    return results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    results = run_all()
    width = max(len(name) for name in results)
    print(f"{'scenario'.ljust(width)}  AccumModel  Keras built-in")
    print(f"{'-' * width}  ----------  --------------")
    for name, r in results.items():
        print(f"{name.ljust(width)}  {r['accum']:10.1e}  {r['builtin']:14.1e}")
    print("\n(max |w - w_large_batch| after training; float32)")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
