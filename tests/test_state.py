"""`_state`: the window's state by name, and files that outlive a release.

The checked-in fixtures (tests/fixtures/window_state.py wrote them, each
release its own) were saved mid-window with the noise scale, AdaScale and
AccumBatchNormalization on. Loaded into a model built from the current
code, after another model in the same process (so that the layers Keras
names get other names than in the file), each must continue to the
weights of the uninterrupted run, trained here from the same initial
weights on the same data.
"""

import os
from unittest import mock

import h5py
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model.engine import _checkpoint
from accum_model.engine import _formats
from accum_model.engine import _state
from accum_model.keras._adapter import keras
from tests import testing_utils as tu
from tests.fixtures import tf_keras_state
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


def _build(prefix):
    """The fixture's model, built after another one: Keras' names differ."""
    auto = prefix in fixture.AUTO_NAMES
    fixture.build_model(auto)
    model = fixture.build_model(auto)
    model.build((None, 3))
    return model


def _ordered_model(order):
    """Dense layers of the same shape named in `order` (None: by Keras)."""
    inputs = keras.Input((4,))
    h = inputs
    for name in order:
        h = keras.layers.Dense(4, name=name)(h)
    model = accum_model.AccumModel(
        inputs, keras.layers.Dense(3)(h), accum_steps=4, epoch_end="carry"
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


@tu.skip_unless_available("keras_3")
class PlaceTest(tf.test.TestCase):
    def test_same_shape_variables_that_changed_places_are_refused(self):
        # Keras loads the weights by place: the second model's `b` gets the
        # first one's `a` weights. Loading the accumulators by name would
        # give each layer the other's gradients; by place with names they
        # are refused.
        x, y = tu.regression_data(8, in_dim=4)
        first = _ordered_model(["a", "b"])
        first.fit(x, y, batch_size=4, verbose=0)
        path = os.path.join(self.get_temp_dir(), "ab.weights.h5")
        first.save_weights(path)
        swapped = _ordered_model(["b", "a"])
        swapped.fit(x[:4], y[:4], batch_size=4, verbose=0)
        state = swapped.gradient_accumulator.state
        before = [v.numpy() for v in state.variables]
        with self.assertRaisesRegex(ValueError, "lacks the entry"):
            swapped.load_weights(path)
        for a, v in zip(before, state.variables):
            self.assertAllEqual(a, v)

    def test_a_frozen_layer_keeps_the_places_after_it(self):
        # The places count every weight: freezing a layer changes which
        # variables accumulate, not the keys of the others.
        x, y = tu.regression_data(8, in_dim=4)
        first = _ordered_model([None, None])
        first.layers[1].trainable = False
        first.compile(optimizer="sgd", loss="mse")
        first.fit(x[:8], y[:8], batch_size=4, verbose=0)
        self.assertEqual(int(first.gradient_accumulator.micro_step), 2)
        path = os.path.join(self.get_temp_dir(), "frozen.weights.h5")
        first.save_weights(path)
        again = _ordered_model([None, None])  # Named by other counters.
        again.layers[1].trainable = False
        again.compile(optimizer="sgd", loss="mse")
        again.fit(x[:4], y[:4], batch_size=4, verbose=0)
        again.load_weights(path)
        for a, b in zip(
            first.gradient_accumulator.state.variables,
            again.gradient_accumulator.state.variables,
        ):
            self.assertAllEqual(a, b)


@tu.skip_unless_available("keras_3")
class FixtureTest(tf.test.TestCase, parameterized.TestCase):
    # The uninterrupted run of each fixture, trained once for both kinds.
    _expected = {}

    def _uninterrupted(self, prefix):
        if prefix not in self._expected:
            model = _build(prefix)
            model.load_weights(_path(prefix, "initial.weights.h5"))
            x, y = _data(prefix)
            fixture.fit(model, x, y)
            self._expected[prefix] = _readings(model)
        return self._expected[prefix]

    def _restored(self, prefix, kind):
        if kind == "keras":
            fixture.build_model(prefix in fixture.AUTO_NAMES)
            return keras.models.load_model(_path(prefix, "mid_window.keras"))
        model = _build(prefix)
        if prefix in fixture.AUTO_NAMES:
            # The file's first Dense is `dense`; this one has a counter.
            self.assertNotEqual(model.layers[1].name, "dense")
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
        # Loaded by a release that adds an entry to the tables: the entry
        # takes its initial value, the file loads as it would without it.
        future = _state.Entry(
            "from_the_future", tf.int64, _state.FIRST, _state.LIFETIME, 7, 3
        )
        with (
            mock.patch.object(_state, "ENGINE", _state.ENGINE + (future,)),
            mock.patch.object(_formats, "FORMAT_VERSION", 3),
        ):
            model = self._restored(prefix, kind)
        engine = model.gradient_accumulator
        self.assertEqual(int(engine.state.get("engine/from_the_future")), 7)
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

    def test_a_later_format_is_refused(self):
        def newer(group):
            del group[_formats.VERSION_KEY]
            group[_formats.VERSION_KEY] = np.int64(_formats.FORMAT_VERSION + 1)

        self._loads_nothing(
            self._edited_copy(newer, "structure_auto"),
            "written by a later accum_model",
            "structure_auto",
        )

    def _edited_copy(self, edit, prefix="named"):
        path = os.path.join(self.get_temp_dir(), "edited.weights.h5")
        with open(_path(prefix, "mid_window.weights.h5"), "rb") as src:
            with open(path, "wb") as dst:
                dst.write(src.read())
        with h5py.File(path, "a") as f:
            edit(f["_accum_state"]["vars"])
        return path

    def _loads_nothing(self, path, message, prefix="named"):
        model = _build(prefix)
        x, y = _data(prefix)
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


@tu.skip_unless_available("tf_keras")
class TfKerasCheckpointTest(tf.test.TestCase):
    """tf_keras' TensorFlow-format checkpoints: the same match as files.

    `save_weights` without `.h5` (and `BackupAndRestore`, `tf.train.
    Checkpoint`) save the state by name and structure, as Keras 3 files
    do: into the same network built after another model (Keras names its
    layers with other counters) it restores exactly, a model of other
    settings or with layers that changed places is refused.
    """

    fx = tf_keras_state

    def _build_second(self):
        """The fixture's model, built after another: Keras' names differ."""
        self.fx.build_model()
        return self.fx.build_model()

    def _uninterrupted(self, initial):
        model = self._build_second()
        model.set_weights(initial)
        x, y = self.fx.data()
        self.fx.fit(model, x, y)
        return _readings(model)

    def _mid_window(self):
        """A model trained mid-window, saved in TF format: (path, initial)."""
        keras.utils.set_random_seed(0)
        model = self.fx.build_model()
        initial = model.get_weights()
        x, y = self.fx.data()
        n = self.fx.SAVED_AFTER * self.fx.BATCH_SIZE
        self.fx.fit(model, x[:n], y[:n])
        self.assertEqual(int(model.gradient_accumulator.micro_step), 2)
        path = os.path.join(self.get_temp_dir(), "mid_window")
        model.save_weights(path)
        return path, initial, [w.name for w in model.weights]

    def _continue(self, model):
        x, y = self.fx.data()
        n = self.fx.SAVED_AFTER * self.fx.BATCH_SIZE
        self.fx.fit(model, x[n:], y[n:])
        return _readings(model)

    def _assert_same(self, expected, actual):
        self.assertEqual(
            expected["iterations"], self.fx.TOTAL // self.fx.ACCUM_STEPS
        )
        FixtureTest._assert_same(self, expected, actual)

    def test_continues_to_the_uninterrupted_run(self):
        # Loaded before the accumulator exists: restored as it is created.
        path, initial, names = self._mid_window()
        model = self._build_second()
        self.assertNotEqual([w.name for w in model.weights], names)
        model.load_weights(path)
        self._assert_same(self._uninterrupted(initial), self._continue(model))

    def test_continues_when_loaded_into_a_trained_model(self):
        # Loaded once the accumulator exists (and holds a window of its
        # own): restored at once.
        path, initial, _ = self._mid_window()
        model = self._build_second()
        x, y = self.fx.data()
        self.fx.fit(model, x[:4], y[:4])
        model.load_weights(path)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 2)
        self._assert_same(self._uninterrupted(initial), self._continue(model))

    def test_checked_in_checkpoint_continues(self):
        # Written by tests/fixtures/tf_keras_state.py, in another process.
        for prefix in self.fx.FIXTURES:
            with self.subTest(prefix):
                model = self._build_second()
                model.load_weights(self.fx.path(prefix, "initial"))
                initial = model.get_weights()
                model = self._build_second()
                model.load_weights(self.fx.path(prefix, "mid_window"))
                with np.load(self.fx.path(prefix, "data.npz")) as data:
                    self.assertAllEqual(data["x"], self.fx.data()[0])
                self._assert_same(
                    self._uninterrupted(initial), self._continue(model)
                )

    def test_settings_and_batches_are_not_saved(self):
        path, _, _ = self._mid_window()
        reader = tf.train.load_checkpoint(path)
        keys = [
            k.decode()
            for k in reader.get_tensor("accumulation/.ATTRIBUTES/keys")
        ]
        self.assertIn(_formats.VERSION_KEY, keys)
        self.assertIn("engine.micro_step", keys)
        self.assertIn("noise_scale.windows", keys)
        self.assertFalse(
            [k for k in keys if k.startswith(("batch.", "rows_added."))]
        )
        self.assertNotIn("engine.accum_steps", keys)

    def _loads_nothing(self, model, path, message, data=None):
        x, y = data or self.fx.data()
        self.fx.fit(model, x[:4], y[:4])
        state = model.gradient_accumulator.state
        before = [v.numpy() for v in state.variables]
        with self.assertRaisesRegex(ValueError, message):
            model.load_weights(path)
        for a, v in zip(before, state.variables):
            self.assertAllEqual(a, v)

    def test_a_model_of_other_settings_is_refused(self):
        path, _, _ = self._mid_window()
        inputs = keras.Input((3,))
        h = keras.layers.Dense(4, activation="tanh")(inputs)
        model = accum_model.AccumModel(
            inputs,
            keras.layers.Dense(2)(h),
            accum_steps=self.fx.ACCUM_STEPS,
            epoch_end="carry",
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        self._loads_nothing(model, path, r"does not know: \['adascale\.")

    def test_same_shape_layers_that_changed_places_are_refused(self):
        # TensorFlow loads the weights by place: the second model's `b`
        # gets the first one's `a` weights. The accumulators are matched by
        # name and place, so they are refused, never loaded crosswise.
        x, y = tu.regression_data(8, in_dim=4)
        first = _ordered_model(["a", "b"])
        first.fit(x, y, batch_size=4, verbose=0)
        path = os.path.join(self.get_temp_dir(), "ab")
        first.save_weights(path)
        swapped = _ordered_model(["b", "a"])
        self._loads_nothing(
            swapped, path, "lacks the entry 'accumulator.", (x, y)
        )

    def test_a_checkpoint_of_the_old_layout_is_said_not_restored(self):
        # Before issue 39 the model tracked the accumulator itself, whose
        # variables a checkpoint keyed by Keras' names.
        model = self.fx.build_model()
        x, y = self.fx.data()
        self.fx.fit(model, x[:8], y[:8])
        engine = model.gradient_accumulator
        path = tf.train.Checkpoint(accumulation=engine).write(
            os.path.join(self.get_temp_dir(), "old")
        )
        before = [v.numpy() for v in engine.state.variables]
        restoring = _checkpoint.StateCheckpoint(engine.state)
        with self.assertWarnsRegex(UserWarning, r"before 0\.2\.0 \(the"):
            tf.train.Checkpoint(accumulation=restoring).restore(path)
        for a, v in zip(before, engine.state.variables):
            self.assertAllEqual(a, v)

    def test_same_shape_layers_refused_before_the_accumulator_exists(self):
        x, y = tu.regression_data(8, in_dim=4)
        first = _ordered_model(["a", "b"])
        first.fit(x, y, batch_size=4, verbose=0)
        path = os.path.join(self.get_temp_dir(), "ab")
        first.save_weights(path)
        swapped = _ordered_model(["b", "a"])
        swapped.load_weights(path)
        # Restored as the accumulator is created, in the first `fit`.
        with self.assertRaisesRegex(ValueError, "lacks the entry"):
            swapped.fit(x[:4], y[:4], batch_size=4, verbose=0)


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
