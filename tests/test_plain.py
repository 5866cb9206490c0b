"""`save_plain` and the configs of accumulating models, read by Keras alone."""

import os

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import accumulate
from accum_model.keras._adapter import keras
from tests import testing_utils as tu


def _sequential():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


_MODELS = {
    "sequential": lambda: accumulate(_sequential(), 4, epoch_end="carry"),
    "functional": lambda: accumulate(tu.mlp(keras.Model), 4, epoch_end="carry"),
    "accum_model": lambda: tu.mlp(AccumModel, accum_steps=4, epoch_end="carry"),
}
_PLAIN_CLASS = {
    "sequential": "Sequential",
    "functional": "Functional",
    "accum_model": "Functional",
}


class SavePlainTest(tf.test.TestCase, parameterized.TestCase):
    def _trained_mid_window(self, kind):
        model = _MODELS[kind]()
        x, y = tu.regression_data(10)
        tu.train(model, x, y, 2, 1, "adam")
        # 5 micro-batches, N=4, carried: one update and a window of 1.
        self.assertEqual(int(model.gradient_accumulator.micro_step), 1)
        return model

    def _assert_keras_alone_loads(self, kinds, save):
        """Files `save(model, kind)` wrote load in Keras alone, as the plain
        class of their kind, predicting what the model predicted."""
        x, _ = tu.regression_data(3, seed=5)
        expected = {}
        for kind in kinds:
            model = self._trained_mid_window(kind)
            path = save(model, kind)
            expected[path] = (_PLAIN_CLASS[kind], model.predict(x, verbose=0))
        loaded = tu.load_without_accum_model(list(expected), x)
        for path, (class_name, predictions) in expected.items():
            self.assertEqual(loaded[path][0], class_name, path)
            self.assertAllClose(loaded[path][1], predictions, atol=1e-6)

    def test_keras_alone_loads_it(self):
        def save_plain(model, kind):
            path = os.path.join(self.get_temp_dir(), f"{kind}.keras")
            accum_model.save_plain(model, path)
            return path

        self._assert_keras_alone_loads(sorted(_MODELS), save_plain)

    @parameterized.named_parameters((k, k) for k in sorted(_MODELS))
    def test_model_keeps_accumulating_and_its_window(self, kind):
        model = self._trained_mid_window(kind)
        cls = type(model)
        window = [
            np.array(v) for v in model.gradient_accumulator.state_variables
        ]
        path = os.path.join(self.get_temp_dir(), f"{kind}.keras")
        accum_model.save_plain(model, path)
        self.assertIs(type(model), cls)
        for before, v in zip(
            window, model.gradient_accumulator.state_variables
        ):
            self.assertAllEqual(before, v)
        # A plain load in this process: the plain class, the same weights,
        # and no window (nothing accumulating to restore it into).
        loaded = keras.models.load_model(path)
        self.assertNotIsInstance(loaded, AccumModel)
        tu.assert_same_trajectory(
            self, [model.get_weights()], [loaded.get_weights()], atol=0
        )
        # A file with the window loads back mid-window.
        self.assertEqual(
            int(
                keras.models.load_model(
                    self._saved(model, kind)
                ).gradient_accumulator.micro_step
            ),
            1,
        )

    def _saved(self, model, kind):
        path = os.path.join(self.get_temp_dir(), f"{kind}-window.keras")
        model.save(path)
        return path

    def test_model_save_of_accumulate_loads_plain_in_keras_alone(self):
        # Deliberate (issue 32): `accumulate` keeps the model's own Keras
        # class in the file, which Keras alone finds by its module, and
        # drops the accumulation settings and the window. An `AccumModel`
        # file names `accum_model`'s class, so Keras alone refuses it.
        self._assert_keras_alone_loads(
            ("functional", "sequential"), self._saved
        )
        path = self._saved(self._trained_mid_window("accum_model"), "accum")
        # The end of Keras' message: the config of the class it cannot find.
        with self.assertRaisesRegex(AssertionError, "accum_model>AccumModel"):
            tu.load_without_accum_model(
                [path], tu.regression_data(3, seed=5)[0]
            )

    def test_refuses_what_has_no_plain_class(self):
        with self.assertRaisesRegex(TypeError, "of type Sequential"):
            accum_model.save_plain(_sequential(), "unused.keras")

        class Net(AccumModel):
            def __init__(self):
                super().__init__(accum_steps=2)
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        with self.assertRaisesRegex(ValueError, "subclassed `AccumModel`"):
            accum_model.save_plain(Net(), "unused.keras")


class PlainConfigTest(tf.test.TestCase, parameterized.TestCase):
    """Keras' own `from_config` rebuilds an accumulating model, plainly."""

    @parameterized.named_parameters(
        ("sequential", "sequential", keras.Sequential),
        ("functional", "functional", keras.Model),
        ("accum_model", "accum_model", keras.Model),
    )
    def test_keras_from_config(self, kind, keras_class):
        model = _MODELS[kind]()
        rebuilt = keras_class.from_config(model.get_config())
        self.assertNotIsInstance(rebuilt, AccumModel)
        self.assertEqual(
            [w.shape for w in rebuilt.weights], [w.shape for w in model.weights]
        )
        # The model's own class still rebuilds it accumulating.
        again = type(model).from_config(model.get_config())
        self.assertIsInstance(again, AccumModel)
        self.assertEqual((again.accum_steps, again.epoch_end), (4, "carry"))
