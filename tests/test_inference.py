"""`evaluate` and `predict` of batches in slices (`micro_batch_size`).

The ground truth is plain `keras.Model.evaluate` and `predict` at the same
batch size, with the same weights: the loss and metrics, and the outputs
row for row.
"""

import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import accum_model
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

AccumModel = accum_model.AccumModel
# Batches of 32, 32, 32 and a short last one of 4.
ROWS = 100
BATCH = 32


def _classifier(cls, **kwargs):
    model = tu.mlp(cls, in_dim=6, out_dim=3, hidden=8, seed=0, **kwargs)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _tagger(cls, **kwargs):
    """A per-token classifier of padded sequences (a masked loss)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    model = cls(inputs, keras.layers.Dense(5)(h), **kwargs)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _sequences():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=ROWS)
    x = np.zeros((ROWS, 8), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.integers(1, 20, size=n)
    return x, (x * 7 + 3) % 5


class EvaluateTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("uneven", 7),
        ("one_row", 1),
        ("larger_than_batch", 64),
    )
    def test_loss_and_metrics_of_the_whole_batch(self, size):
        x, y = tu.classification_data(ROWS, in_dim=6)
        expected = _classifier(keras.Model).evaluate(
            x, y, batch_size=BATCH, verbose=0
        )
        model = _classifier(AccumModel, micro_batch_size=size)
        actual = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(actual, expected, rtol=1e-6)

    def test_sample_weights(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        weights = np.random.default_rng(1).uniform(0, 2, ROWS)
        expected = _classifier(keras.Model).evaluate(
            x, y, sample_weight=weights, batch_size=BATCH, verbose=0
        )
        actual = _classifier(AccumModel, micro_batch_size=7).evaluate(
            x, y, sample_weight=weights, batch_size=BATCH, verbose=0
        )
        np.testing.assert_allclose(actual, expected, rtol=1e-6)

    def test_per_token_loss(self):
        # Slices of unequal numbers of tokens: weighted by their tokens.
        x, y = _sequences()
        expected = _tagger(keras.Model).evaluate(
            x, y, batch_size=BATCH, verbose=0
        )
        actual = _tagger(AccumModel, micro_batch_size=5).evaluate(
            x, y, batch_size=BATCH, verbose=0
        )
        # tf_keras' compiled loss logs each slice itself, by samples.
        if tu.TF_KERAS:
            actual, expected = actual[1:], expected[1:]
        np.testing.assert_allclose(actual, expected, rtol=1e-6)

    def test_unknown_length_dataset(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda a, b: True)
            .batch(BATCH)
        )
        expected = _classifier(keras.Model).evaluate(dataset, verbose=0)
        actual = _classifier(AccumModel, micro_batch_size=7).evaluate(
            dataset, verbose=0
        )
        np.testing.assert_allclose(actual, expected, rtol=1e-6)

    def test_fit_validation_with_its_own_batch_size(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        histories = []
        for cls, kwargs in (
            (keras.Model, {}),
            (AccumModel, {"micro_batch_size": 7}),
        ):
            history = _classifier(cls, **kwargs).fit(
                x,
                y,
                batch_size=BATCH,
                epochs=2,
                shuffle=False,
                verbose=0,
                validation_data=(x, y),
                validation_batch_size=50,
            )
            histories.append(history.history)
        for key in ("val_loss", "val_accuracy"):
            np.testing.assert_allclose(
                histories[1][key], histories[0][key], rtol=1e-5, err_msg=key
            )


class PredictTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("uneven", 7, {}),
        ("divides", 8, {}),
        ("xla", 7, {"jit_compile": True}),
    )
    def test_outputs_row_for_row(self, size, compile_kwargs):
        if tu.TF_KERAS and compile_kwargs:
            self.skipTest("tf_keras' XLA predict: as Keras 3's, not again.")
        x, _ = tu.classification_data(ROWS, in_dim=6)
        plain = tu.mlp(keras.Model, in_dim=6, out_dim=3, hidden=8, seed=0)
        model = tu.mlp(
            AccumModel,
            in_dim=6,
            out_dim=3,
            hidden=8,
            seed=0,
            micro_batch_size=size,
        )
        model.compile(loss="mse", **compile_kwargs)
        expected = plain.predict(x, batch_size=BATCH, verbose=0)
        actual = model.predict(x, batch_size=BATCH, verbose=0)
        self.assertEqual(actual.shape, expected.shape)
        np.testing.assert_allclose(actual, expected, atol=1e-6)

    def test_several_outputs(self):
        x, _ = tu.classification_data(ROWS, in_dim=6)

        def model(cls, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            h = keras.layers.Dense(8, activation="tanh")(inputs)
            outputs = {
                "a": keras.layers.Dense(3)(h),
                "b": keras.layers.Dense(1)(h),
            }
            return cls(inputs, outputs, **kwargs)

        expected = model(keras.Model).predict(x, batch_size=BATCH, verbose=0)
        actual = model(AccumModel, micro_batch_size=7).predict(
            x, batch_size=BATCH, verbose=0
        )
        for key in ("a", "b"):
            np.testing.assert_allclose(actual[key], expected[key], atol=1e-6)

    def test_sequences(self):
        x, _ = _sequences()
        expected = _tagger(keras.Model).predict(x, batch_size=BATCH, verbose=0)
        actual = _tagger(AccumModel, micro_batch_size=5).predict(
            x, batch_size=BATCH, verbose=0
        )
        np.testing.assert_allclose(actual, expected, atol=1e-6)


class AutoTest(parameterized.TestCase):
    """`"auto"` without a limit: the whole batch fits."""

    def test_evaluate_and_predict(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        plain = _classifier(keras.Model)
        model = _classifier(AccumModel, micro_batch_size="auto")
        np.testing.assert_allclose(
            model.evaluate(x, y, batch_size=BATCH, verbose=0),
            plain.evaluate(x, y, batch_size=BATCH, verbose=0),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            model.predict(x, batch_size=BATCH, verbose=0),
            plain.predict(x, batch_size=BATCH, verbose=0),
            atol=1e-6,
        )


if __name__ == "__main__":
    absltest.main()
