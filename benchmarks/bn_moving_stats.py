"""Moving statistics under accumulation: plain BN, AccumBN, large batch.

Trains one epoch of a model whose BatchNormalization sits on the input (so
its activations do not depend on the weights) three ways from the same
weights, and prints how far each BN's moving mean and variance land from the
large batch's:

  large batch 64                    `BatchNormalization`, batch 64
  8 x 8, BatchNormalization         `AccumModel(accum_steps=8)`, batch 8
  8 x 8, AccumBatchNormalization    the same with `AccumBatchNormalization`

    python benchmarks/bn_moving_stats.py        # Keras 3 only
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402

import accum_model  # noqa: E402

keras = tf.keras


def make(cls, bn_cls, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    h = bn_cls(name="bn")(inputs)  # momentum 0.99, the Keras default
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, "relu")(h))
    model = cls(inputs, outputs, **kwargs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 3.0, (256, 4)).astype("float32")
    x[:, 1] *= 0.1
    y = rng.normal(size=(256, 1)).astype("float32")
    runs = {
        "large batch 64 (BatchNormalization)": (
            make(keras.Model, keras.layers.BatchNormalization),
            64,
        ),
        "8 x 8, BatchNormalization": (
            make(
                accum_model.AccumModel,
                keras.layers.BatchNormalization,
                accum_steps=8,
            ),
            8,
        ),
        "8 x 8, AccumBatchNormalization": (
            make(
                accum_model.AccumModel,
                accum_model.AccumBatchNormalization,
                accum_steps=8,
            ),
            8,
        ),
    }
    with warnings.catch_warnings():
        # AccumModel warns about the plain BatchNormalization: the point here.
        warnings.simplefilter("ignore")
        for model, batch_size in runs.values():
            model.fit(
                x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
            )
    reference = runs["large batch 64 (BatchNormalization)"][0].get_layer("bn")
    for name, (model, _) in runs.items():
        bn = model.get_layer("bn")
        mean_err = np.abs(
            bn.moving_mean.numpy() - reference.moving_mean.numpy()
        )
        var_err = np.abs(
            bn.moving_variance.numpy() - reference.moving_variance.numpy()
        )
        print(
            f"{name:38s} updates={int(model.optimizer.iterations)} "
            f"moving_mean={np.round(bn.moving_mean.numpy(), 4)} "
            f"max|diff| mean={mean_err.max():.2e} var={var_err.max():.2e}"
        )


if __name__ == "__main__":
    app.run(main)
