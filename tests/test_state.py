"""`_state`: the window's state by name, and files that outlive a release.

The checked-in fixtures (tests/fixtures/window_state.py wrote them, each
release its own) were saved mid-window with the noise scale, AdaScale and
AccumBatchNormalization on. Loaded into a model built from the current
code, each must continue to the weights of the uninterrupted run, trained
here from the same initial weights on the same data.
"""

import os

import h5py
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import _state
from accum_model._keras import keras
from tests import testing_utils as tu
from tests.fixtures import window_state as fixture

_FIXTURES = os.path.dirname(os.path.abspath(fixture.__file__))
_FILES = [
    (f"{prefix}_{kind}", prefix, kind)
    for prefix in sorted(fixture.FIXTURES)
    for kind in ("keras", "weights_h5")
]


def _path(prefix, name):
    return os.path.join(_FIXTURES, f"{prefix}_{name}")


def _data(prefix):
    with np.load(_path(prefix, "data.npz")) as data:
        return data["x"], data["y"]


def _readings(model):
    return {
        "weights": [w.numpy() for w in model.weights],
        "iterations": int(model.optimizer.iterations),
        "noise_scale": model.gradient_noise_scale,
        "tau": model.adascale_tau,
        "micro_step": int(model.gradient_accumulator.micro_step),
    }


@tu.skip_unless_available("keras_3")
class FixtureTest(tf.test.TestCase, parameterized.TestCase):
    def _uninterrupted(self, prefix):
        model = fixture.build_model()
        model.build((None, 3))
        model.load_weights(_path(prefix, "initial.weights.h5"))
        x, y = _data(prefix)
        fixture.fit(model, x, y)
        return _readings(model)

    def _restored(self, prefix, kind):
        if kind == "keras":
            return keras.models.load_model(_path(prefix, "mid_window.keras"))
        model = fixture.build_model()
        model.build((None, 3))
        model.load_weights(_path(prefix, "mid_window.weights.h5"))
        return model

    def _assert_same(self, expected, actual):
        self.assertEqual(actual["iterations"], expected["iterations"])
        self.assertEqual(actual["micro_step"], expected["micro_step"])
        self.assertLen(actual["weights"], len(expected["weights"]))
        for a, b in zip(expected["weights"], actual["weights"]):
            self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)
        self.assertAllClose(
            actual["noise_scale"], expected["noise_scale"], rtol=1e-5
        )
        self.assertAllClose(actual["tau"], expected["tau"], rtol=1e-6)

    @parameterized.named_parameters(_FILES)
    def test_continues_to_the_uninterrupted_run(self, prefix, kind):
        expected = self._uninterrupted(prefix)
        model = self._restored(prefix, kind)
        engine = model.gradient_accumulator
        self.assertEqual(
            int(engine.micro_step),
            fixture.SAVED_AFTER % fixture.ACCUM_STEPS,
        )
        x, y = _data(prefix)
        n = fixture.SAVED_AFTER * fixture.BATCH_SIZE
        fixture.fit(model, x[n:], y[n:])
        self.assertEqual(
            expected["iterations"], fixture.TOTAL // fixture.ACCUM_STEPS
        )
        self._assert_same(expected, _readings(model))

    def test_layers_named_otherwise_load_by_index(self):
        # Keras names layers by a counter that differs between sessions;
        # the state's model items load by index, checked by shape and by
        # the variable's own name.
        expected = self._uninterrupted("named")
        renamed = fixture.build_model()
        for layer in renamed.layers:
            layer._name = f"{layer.name}_elsewhere"  # As a session would.
        renamed.build((None, 3))
        renamed.load_weights(_path("named", "mid_window.weights.h5"))
        x, y = _data("named")
        n = fixture.SAVED_AFTER * fixture.BATCH_SIZE
        fixture.fit(renamed, x[n:], y[n:])
        self._assert_same(expected, _readings(renamed))

    def _edited_copy(self, edit):
        path = os.path.join(self.get_temp_dir(), "edited.weights.h5")
        with open(_path("named", "mid_window.weights.h5"), "rb") as src:
            with open(path, "wb") as dst:
                dst.write(src.read())
        with h5py.File(path, "a") as f:
            edit(f["_accum_state"]["vars"])
        return path

    def _loads_nothing(self, path, message):
        model = fixture.build_model()
        model.build((None, 3))
        x, y = _data("named")
        fixture.fit(model, x[:4], y[:4])
        engine = model.gradient_accumulator
        before = [v.numpy() for v in engine.state.variables]
        with self.assertRaisesRegex(ValueError, message):
            model.load_weights(path)
        for a, v in zip(before, engine.state.variables):
            self.assertAllEqual(a, v)

    def test_missing_entry_is_named_and_nothing_loads(self):
        def drop(group):
            del group["noise_scale.windows"]

        self._loads_nothing(
            self._edited_copy(drop), r"lacks the entry 'noise_scale\.windows'"
        )

    def test_unknown_entry_is_named_and_nothing_loads(self):
        def add(group):
            group["engine.from_the_future"] = np.int64(3)

        self._loads_nothing(
            self._edited_copy(add), r"does not know: \['engine\.from_the_"
        )

    def test_other_shape_is_named(self):
        def reshape(group):
            del group["batchnorm.0000.norm.mean"]
            group["batchnorm.0000.norm.mean"] = np.zeros(5, np.float32)

        self._loads_nothing(
            self._edited_copy(reshape), r"'batchnorm\.0000\.norm\.mean' has"
        )

    def test_a_model_without_the_features_refuses_the_file(self):
        x, y = _data("named")
        model = tu.mlp(
            accum_model.AccumModel,
            in_dim=3,
            out_dim=2,
            hidden=4,
            accum_steps=fixture.ACCUM_STEPS,
        )
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x[:4], y[:4], batch_size=4, verbose=0)
        path = _path("named", "mid_window.weights.h5")
        # Keras' own weights load first and fail on the other layers; the
        # state alone is what is checked here.
        with h5py.File(path, "r") as f:
            store = {k: np.array(v) for k, v in f["_accum_state/vars"].items()}
        with self.assertRaisesRegex(ValueError, "lacks the entry|not know"):
            model.gradient_accumulator.state.load(store)


class WindowStateTest(tf.test.TestCase):
    def test_declared_once(self):
        state = _state.WindowState()
        state.declare("engine/micro_step", _state.ENGINE[1])
        with self.assertRaisesRegex(ValueError, "declared twice"):
            state.declare("engine/micro_step", _state.ENGINE[1])

    @tu.skip_unless_available("keras_3")
    def test_every_variable_of_the_engine_is_in_its_state(self):
        # No state hides outside the declaration: whatever tf.Module finds
        # tracked by the engine is a variable of `state`.
        model = fixture.build_model()
        x, y = _data("named")
        fixture.fit(model, x[:8], y[:8])
        engine = model.gradient_accumulator
        declared = {id(v) for v in engine.state.variables}
        tracked = {id(v) for v in engine.variables}
        self.assertEqual(tracked, declared)
        # Noise scale, AdaScale, BatchNorm and per-variable entries.
        names = engine.state.names()
        for prefix in ("engine/", "noise_scale/", "adascale/", "batchnorm/"):
            self.assertTrue(any(n.startswith(prefix) for n in names), prefix)

    def test_round_trip_by_name_whatever_the_order(self):
        def make(order):
            state = _state.WindowState()
            for name in order:
                entry = _state.Entry(
                    name, tf.float32, _state.FIRST, _state.LIFETIME
                )
                state.declare(name, entry)
            return state

        a = make(["a/x", "a/y"])
        a.get("a/x").assign(1.0)
        a.get("a/y").assign(2.0)
        store = {}
        a.save(store)
        b = make(["a/y", "a/x"])
        b.load(store)
        self.assertEqual(float(b.get("a/x")), 1.0)
        self.assertEqual(float(b.get("a/y")), 2.0)

    def test_settings_are_not_saved(self):
        state = _state.WindowState()
        state.declare_group("engine", _state.ENGINE)
        store = {}
        state.save(store)
        self.assertNotIn("engine.accum_steps", store)
        self.assertIn("engine.micro_step", store)

    def test_position_layout_of_another_length_is_refused(self):
        state = _state.WindowState()
        state.declare_group("engine", _state.ENGINE)
        with self.assertRaisesRegex(ValueError, "by position"):
            state.load({"0": 1, "1": 2})


if __name__ == "__main__":
    tf.test.main()
