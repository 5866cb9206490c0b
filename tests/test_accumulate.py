"""`accumulate(model)` and models people already have, against plain Keras.

Every kind of model (Sequential, Functional, subclassed), made to accumulate
in place, trains like the same model at the large batch; round trips
(`get_config`, JSON, `.keras` files in a new process, `clone_model`) bring it
back of its own class, accumulating; subclasses in either order keep their
base's `fit`; custom train steps keep accumulating or say they do not.
"""

import json
import logging
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import accumulate
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sequential(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def _unbuilt_sequential(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def _functional(seed=0):
    return tu.mlp(keras.Model, seed=seed)


@keras.saving.register_keras_serializable(package="accum_model_tests")
class SmallNet(keras.Model):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(units)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {"units": self.units, "name": self.name}


def _subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = SmallNet()
    model(np.zeros((1, 4), "float32"))
    return model


def _unbuilt_subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    return SmallNet()


# The kinds of model each round trip is tested with, by name.
_ROUND_TRIP_KINDS = [(k, k) for k in ("sequential", "functional", "subclassed")]

_KINDS = {
    "sequential": _sequential,
    "unbuilt_sequential": _unbuilt_sequential,
    "functional": _functional,
    "subclassed": _subclassed,
    "unbuilt_subclassed": _unbuilt_subclassed,
}


def _same_start(make):
    """Two models of `make()` with the same weights once built."""
    reference, model = make(), make()
    x, _ = tu.regression_data(1)
    reference(x)
    model(x)
    return reference, tu.copy_weights(reference, model)


class AccumulateTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.product(kind=sorted(_KINDS), optimizer=("momentum", "adamw"))
    def test_equals_large_batch(self, kind, optimizer):
        make = _KINDS[kind]
        x, y = tu.regression_data(22)
        reference = make()
        model = make()
        cls = type(model)
        self.assertIs(accumulate(model, 4), model)
        if kind.startswith("unbuilt"):
            # Built after `accumulate`; tf_keras draws initial weights at
            # build time, so the same start is copied in.
            reference(x[:1])
            model(x[:1])
        tu.copy_weights(reference, model)
        self.assertIsInstance(model, AccumModel)
        self.assertIsInstance(model, cls)
        self.assertEqual(type(model).__name__, cls.__name__)
        _, expected = tu.train(reference, x, y, 8, 2, optimizer)
        _, actual = tu.train(model, x, y, 2, 2, optimizer)
        tu.assert_same_trajectory(self, expected, actual)
        self.assertEqual(int(model.optimizer.iterations), 6)

    def test_compiled_and_trained_before(self):
        # A model compiled and fitted plainly, then made to accumulate: the
        # next `fit` traces the accumulating step, with the same optimizer.
        x, y = tu.regression_data(16)
        reference, model = _same_start(_sequential)
        for m in (reference, model):
            m.compile(tu.OPTIMIZERS["adam"](), "mse")
            m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        optimizer = model.optimizer
        accumulate(model, 2)
        recorder = [tu.UpdateRecorder(), tu.UpdateRecorder()]
        reference.fit(
            x,
            y,
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[recorder[0]],
        )
        model.fit(
            x,
            y,
            batch_size=4,
            shuffle=False,
            verbose=0,
            callbacks=[recorder[1]],
        )
        self.assertIs(model.optimizer, optimizer)
        tu.assert_same_trajectory(
            self, recorder[0].weights, recorder[1].weights
        )

    def test_again_changes_settings(self):
        model = accumulate(_sequential(), 4)
        cls = type(model)
        self.assertIs(accumulate(model, 2, epoch_end="carry"), model)
        self.assertIs(type(model), cls)
        self.assertEqual((model.accum_steps, model.epoch_end), (2, "carry"))
        # Left out, `epoch_end` stays: changing N alone keeps "carry".
        accumulate(model, 3)
        self.assertEqual((model.accum_steps, model.epoch_end), (3, "carry"))
        accumulate(model, 2)
        own = tu.mlp(AccumModel, accum_steps=3)
        own_cls = type(own)
        accumulate(own, 5)
        self.assertIs(type(own), own_cls)
        self.assertEqual(own.accum_steps, 5)
        x, y = tu.regression_data(8)
        tu.train(model, x, y, 2, 1, "sgd")
        self.assertEqual(int(model.optimizer.iterations), 2)

    def test_classes_are_cached_per_base(self):
        self.assertIs(
            type(accumulate(_sequential(), 2)),
            type(accumulate(_sequential(1), 3)),
        )

    @parameterized.named_parameters(
        ("layer", lambda: keras.layers.Dense(2), TypeError, "`model` must"),
        ("zero", lambda: 0, TypeError, "`model` must"),
    )
    def test_not_a_model(self, make, error, message):
        with self.assertRaisesRegex(error, message):
            accumulate(make(), 2)

    @parameterized.named_parameters(
        ("steps", dict(accum_steps=0), "accum_steps=0"),
        ("epoch_end", dict(accum_steps=2, epoch_end="x"), "epoch_end='x'"),
    )
    def test_bad_arguments_leave_the_model(self, kwargs, message):
        model = _sequential()
        cls = type(model)
        with self.assertRaisesRegex(ValueError, message):
            accumulate(model, **kwargs)
        self.assertIs(type(model), cls)
        self.assertNotIsInstance(model, AccumModel)

    @parameterized.named_parameters(
        ("sequential", "sequential"),
        ("functional", "functional"),
        ("subclassed", "subclassed"),
    )
    def test_optimizer_that_accumulates_itself_is_refused(self, kind):
        # Two windows would multiply (issue 32); refused at `fit`, before
        # the window or the optimizer is built.
        if not tu.HAS_BUILTIN_ACCUMULATION:
            self.skipTest("tf_keras has no built-in accumulation")
        x, y = tu.regression_data(8)
        model = accumulate(_KINDS[kind](), 2)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
            loss="mse",
        )
        before = model.get_weights()
        with self.assertRaisesRegex(
            ValueError, "Received: gradient_accumulation_steps=2 "
        ):
            model.fit(x, y, batch_size=2, verbose=0)
        self.assertIsNone(model.gradient_accumulator)
        self.assertEqual(int(model.optimizer.iterations), 0)
        tu.assert_same_trajectory(self, [before], [model.get_weights()], atol=0)

    @parameterized.named_parameters(
        ("accum_steps", {"acum_steps": 8}, "acum_steps", "accum_steps"),
        (
            "epoch_end",
            {"accum_steps": 2, "epochend": 8},
            "epochend",
            "epoch_end",
        ),
        ("unrelated", {"accum_steps": 2, "shuffle": 8}, "shuffle", None),
    )
    def test_unknown_keyword_is_refused(self, kwargs, keyword, meant):
        model = _sequential()
        hint = f" Did you mean `{meant}`?" if meant else ""
        message = (
            f"`accumulate` got an unexpected keyword argument `{keyword}`."
            f"{hint} Received: {keyword}=8"
        )
        with self.assertRaisesRegex(TypeError, re.escape(message) + "$"):
            accumulate(model, **kwargs)
        self.assertNotIsInstance(model, AccumModel)
        with self.assertRaisesRegex(TypeError, "missing .*`accum_steps`"):
            accumulate(model)

    def test_own_methods_keep_working(self):
        x, y = tu.regression_data(8)
        model = accumulate(_sequential(), 2)
        tu.train(model, x, y, 2, 1, "sgd")
        self.assertEqual(model.predict(x, verbose=0).shape, (8, 3))
        self.assertLen(model.layers, 2)
        model.pop()  # Sequential's own
        self.assertLen(model.layers, 1)
        lines = []
        model.summary(print_fn=lambda line, *a, **k: lines.append(line))
        self.assertTrue(any("dense" in line for line in lines))

    def test_positional_fit_arguments(self):
        # `fit(x, y, 16, 3)`: batch size 16, 3 epochs, as plain Keras.
        x, y = tu.regression_data(32)
        model = accumulate(_sequential(), 2)
        model.compile("sgd", "mse")
        history = model.fit(x, y, 8, 3, 0)
        self.assertLen(history.history["loss"], 3)
        self.assertEqual(int(model.optimizer.iterations), 6)


class CompiledBeforeTest(tf.test.TestCase):
    def test_jit_compile_false_given_before_accumulate_is_kept(self):
        # `accumulate` found the model compiled with `jit_compile=False` and
        # compiled the window's update with XLA anyway: an optimizer XLA
        # cannot compile was refused, with advice already followed.
        x, y = tu.regression_data(16)
        model = tu.mlp(keras.Model)
        reference = tu.copy_weights(model, tu.mlp(keras.Model))
        model.compile(tu.PyFunctionSGD(0.1), "mse", jit_compile=False)
        accumulate(model, accum_steps=2)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        _, expected = tu.train(
            reference, x, y, 8, optimizer=tu.PyFunctionSGD(0.1)
        )
        tu.assert_same_trajectory(self, expected[-1:], [model.get_weights()])
        # Compiled again after `accumulate`, with the default: compiled
        # apart, so refused.
        model.compile(tu.PyFunctionSGD(0.1), "mse")
        with self.assertRaisesRegex(ValueError, "jit_compile=False"):
            model.fit(x, y, batch_size=4, verbose=0)


class PipelineLike(keras.Model):
    """A model class whose `fit` takes `sample_weight` fourth, like keras-hub.

    It builds itself functionally in `__init__`, as keras-hub tasks do.
    """

    def __init__(self, units=3, seed=0, **kwargs):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(units)(
            keras.layers.Dense(5, activation="tanh")(inputs)
        )
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.units = units

    def fit(
        self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs
    ):
        return super().fit(
            x=x,
            y=y,
            batch_size=batch_size,
            sample_weight=sample_weight,
            **kwargs,
        )

    def get_config(self):
        return {"units": self.units, "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class AccumFirst(AccumModel, PipelineLike):
    pass


class AccumSecond(PipelineLike, AccumModel):
    pass


class SubclassingTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("accum_first", AccumFirst),
        ("accum_second", AccumSecond),
        ("accumulate", None),
    )
    def test_base_fit_arguments_pass_unchanged(self, cls):
        # Positionally, the fourth argument is the base's `sample_weight`.
        x, y = tu.regression_data(16)
        sw = np.linspace(0.5, 2.0, 16).astype("float32")
        reference = PipelineLike()
        if cls is None:
            model = accumulate(PipelineLike(), 4)
        else:
            model = cls(accum_steps=4)
        tu.copy_weights(reference, model)
        recorders = [tu.UpdateRecorder(), tu.UpdateRecorder()]
        for m, batch, recorder in (
            (reference, 8, recorders[0]),
            (model, 2, recorders[1]),
        ):
            m.compile(tu.OPTIMIZERS["momentum"](), "mse")
            m.fit(
                x,
                y,
                batch,
                sw,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[recorder],
            )
        tu.assert_same_trajectory(
            self, recorders[0].weights, recorders[1].weights
        )
        self.assertEqual(model.accum_steps, 4)

    @parameterized.named_parameters(
        ("accum_first", AccumFirst), ("accum_second", AccumSecond)
    )
    def test_save_keeps_accumulation_and_bases(self, cls):
        bases = AccumModel.__bases__
        model = cls(accum_steps=3, epoch_end="carry")
        model.compile("sgd", "mse")
        self.assertEqual(AccumModel.__bases__, bases)
        path = os.path.join(self.get_temp_dir(), "s.keras")
        model.save(path)
        restored = keras.models.load_model(
            path, custom_objects={cls.__name__: cls}
        )
        self.assertIsInstance(restored, cls)
        self.assertEqual(
            (restored.accum_steps, restored.epoch_end), (3, "carry")
        )
        self.assertEqual(AccumModel.__bases__, bases)

    def test_subclass_style_accum_model_survives_functional_bases(self):
        # Before: constructing `class X(AccumModel, <functional-building
        # class>)` let Keras rewrite `AccumModel.__bases__` to Functional,
        # after which subclass-style AccumModels failed to construct.
        AccumFirst(accum_steps=2)
        accumulate(_functional(), 2)
        AccumFirst(accum_steps=2)

        class Net(AccumModel):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        x, y = tu.regression_data(8)
        model = Net(accum_steps=2)
        tu.train(model, x, y, 2, 1, "sgd")
        self.assertEqual(int(model.optimizer.iterations), 2)


_LOAD_SCRIPT = """
import sys, json
import numpy as np
import accum_model
from accum_model.keras._adapter import keras
import tests.test_accumulate  # registers the test's own model class
model = keras.models.load_model(sys.argv[1])
engine = model.gradient_accumulator
print(json.dumps(dict(
    cls=type(model).__name__,
    base=type(model).__mro__[1].__name__,
    accumulating=isinstance(model, accum_model.AccumModel),
    accum_steps=model.accum_steps,
    epoch_end=model.epoch_end,
    micro_step=None if engine is None else int(engine.micro_step),
)))
"""


class RoundTripTest(tf.test.TestCase, parameterized.TestCase):
    def _model(self, kind):
        model = accumulate(_KINDS[kind](), 4, epoch_end="carry")
        model.compile(tu.OPTIMIZERS["adam"](), "mse")
        return model

    def _assert_accumulating(self, restored, model):
        base = type(model)._accum_base
        self.assertIsInstance(restored, AccumModel)
        self.assertIsInstance(restored, base)
        self.assertIs(type(restored), type(model))
        self.assertEqual(
            (restored.accum_steps, restored.epoch_end), (4, "carry")
        )
        # And it trains like the original: 2 updates from 8 micro-batches.
        x, y = tu.regression_data(16)
        restored.compile("sgd", "mse")
        restored.fit(x, y, batch_size=2, shuffle=False, verbose=0)
        self.assertEqual(int(restored.optimizer.iterations), 2)

    @parameterized.named_parameters(_ROUND_TRIP_KINDS)
    def test_get_config_from_config(self, kind):
        model = self._model(kind)
        restored = type(model).from_config(model.get_config())
        self._assert_accumulating(restored, model)

    @parameterized.named_parameters(_ROUND_TRIP_KINDS)
    def test_json(self, kind):
        model = self._model(kind)
        restored = keras.models.model_from_json(model.to_json())
        self._assert_accumulating(restored, model)

    @parameterized.named_parameters(_ROUND_TRIP_KINDS)
    def test_clone_model(self, kind):
        model = self._model(kind)
        clone = keras.models.clone_model(model)
        self.assertIsNot(clone, model)
        self._assert_accumulating(clone, model)

    def test_noise_scale_argument_measures_as_accum_model_does(self):
        # The same micro-batches, weights and windows: the estimate of a
        # `Sequential` made to accumulate is that of an `AccumModel`.
        x, y = tu.regression_data(64)
        model = accumulate(_sequential(), 4, noise_scale=True)
        other = _sequential()
        reference = tu.copy_weights(
            model,
            AccumModel(
                inputs=other.inputs,
                outputs=other.outputs,
                accum_steps=4,
                noise_scale=True,
            ),
        )
        histories = [
            tu.train(m, x, y, 4, 2, "sgd")[0] for m in (model, reference)
        ]
        estimates = [h.history["gradient_noise_scale"] for h in histories]
        self.assertTrue(np.all(np.isfinite(estimates[0])))
        self.assertAllClose(estimates[0], estimates[1], rtol=1e-5)
        self.assertEqual(model.noise_scale, accum_model.NoiseScale())

    def test_noise_scale_argument_refused_before_any_change(self):
        model = _sequential()
        cls = type(model)
        with self.assertRaisesRegex(TypeError, "noise_scale=3"):
            accumulate(model, 4, noise_scale=3)
        self.assertIs(type(model), cls)
        # After training the measurement is part of the compiled step.
        model = accumulate(_sequential(), 2)
        x, y = tu.regression_data(8)
        tu.train(model, x, y, 2, 1)
        with self.assertRaisesRegex(ValueError, "before the model is trained"):
            accumulate(model, 8, noise_scale=True)
        self.assertEqual(model.accum_steps, 2)
        self.assertIsNone(model.noise_scale)
        # Left out, it stays as it is.
        accumulate(model, 8)
        self.assertEqual(model.accum_steps, 8)

    def test_noise_scale_setting_travels(self):
        model = accumulate(_sequential(), 4)
        model.noise_scale = True
        for restored in (
            type(model).from_config(model.get_config()),
            keras.models.clone_model(model),
        ):
            self.assertEqual(restored.noise_scale, model.noise_scale)
            self.assertIsNotNone(restored.noise_scale)

    @parameterized.named_parameters(("compiled", True), ("uncompiled", False))
    def test_clone_model_of_accum_model(self, compiled):
        # Before: a functional `AccumModel` cloned to accum_steps=1.
        model = tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        if compiled:
            model.compile("sgd", "mse")
        clone = keras.models.clone_model(model)
        self.assertIsInstance(clone, AccumModel)
        self.assertEqual((clone.accum_steps, clone.epoch_end), (4, "carry"))

    @parameterized.named_parameters(_ROUND_TRIP_KINDS)
    def test_keras_file_in_a_new_process(self, kind):
        # Saved mid-window; loaded where only `accum_model` is imported
        # (and the module that registers the test's own class).
        model = self._model(kind)
        x, y = tu.regression_data(6)
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 3)
        path = os.path.join(self.get_temp_dir(), f"{kind}.keras")
        model.save(path)
        env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-c", _LOAD_SCRIPT, path],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=_ROOT,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        loaded = json.loads(result.stdout.strip().splitlines()[-1])
        base = type(model)._accum_base.__name__
        self.assertEqual(
            loaded,
            dict(
                cls=base,
                base=base,
                accumulating=True,
                accum_steps=4,
                epoch_end="carry",
                micro_step=3,
            ),
        )


class CustomTrainStepTest(tf.test.TestCase, parameterized.TestCase):
    def _fit_pair(self, cls, epoch_end="apply", steps=4, n=22):
        x, y = tu.regression_data(n)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(
            reference, tu.mlp(cls, accum_steps=steps, epoch_end=epoch_end)
        )
        _, expected = tu.train(reference, x, y, 2 * steps, 2, "momentum")
        history, actual = tu.train(model, x, y, 2, 2, "momentum")
        return expected, actual, history, model

    def test_super_train_step_plus_extras(self):
        class WithExtraLog(AccumModel):
            def train_step(self, data):
                logs = dict(super().train_step(data))
                logs["micro_step"] = tf.cast(
                    self.gradient_accumulator.micro_step, tf.float32
                )
                return logs

        expected, actual, history, _ = self._fit_pair(WithExtraLog)
        tu.assert_same_trajectory(self, expected, actual)
        self.assertIn("micro_step", history.history)

    def test_accumulate_gradients_in_own_step(self):
        class OwnStep(AccumModel):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = tf.reduce_mean(tf.square(y_pred - y))
                grads = tape.gradient(loss, self.trainable_variables)
                # The mean divided by the micro-batch's number of samples.
                self.accumulate_gradients(grads, weight=tf.shape(x)[0])
                return {"loss": loss}

        expected, actual, _, _ = self._fit_pair(OwnStep)
        tu.assert_same_trajectory(self, expected, actual)

    @parameterized.named_parameters(("apply", "apply"), ("carry", "carry"))
    def test_keras_guide_step_warns_once_and_does_not_crash(self, epoch_end):
        # Keras' guide: tape, then `self.optimizer.apply`. Before: "No
        # gradients provided for any variable" at the first epoch end.
        apply = (
            (lambda opt, g, v: opt.apply_gradients(zip(g, v)))
            if tu.TF_KERAS
            else (lambda opt, g, v: opt.apply(g, v))
        )

        class GuideStep(AccumModel):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = tf.reduce_mean(tf.square(y_pred - y))
                grads = tape.gradient(loss, self.trainable_variables)
                apply(self.optimizer, grads, self.trainable_variables)
                return {"loss": loss}

        x, y = tu.regression_data(22)
        model = tu.mlp(GuideStep, accum_steps=1, epoch_end=epoch_end)
        model.compile(tu.OPTIMIZERS["sgd"](), "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=3, verbose=0)
        bypass = [w for w in caught if "did not go through" in str(w.message)]
        self.assertLen(bypass, 1)
        # It trains as its own step says: one update per micro-batch.
        self.assertEqual(int(model.optimizer.iterations), 18)


class RetracingTest(tf.test.TestCase):
    def test_many_models_print_no_retracing_warning(self):
        # k-fold style: eight models fitted in one process, each with a
        # partial window at every epoch end (the epoch-end apply runs).
        records = []

        class Collect(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        handler = Collect(level=logging.WARNING)
        logger = tf.get_logger()
        logger.addHandler(handler)
        try:
            x, y = tu.regression_data(10)
            for seed in range(8):
                model = tu.mlp(AccumModel, seed=seed, accum_steps=4)
                model.compile(tu.OPTIMIZERS["sgd"](), "mse")
                model.fit(x, y, batch_size=2, epochs=2, verbose=0)
        finally:
            logger.removeHandler(handler)
        self.assertEqual(
            [r for r in records if "retracing" in r],
            [],
        )


class TransferLearningTest(tf.test.TestCase):
    def test_freeze_train_unfreeze_recompile(self):
        # Keras' transfer-learning recipe on a small `keras.applications`
        # model (random weights, `weights=None`, no download): the base in
        # inference mode, frozen, then unfrozen and re-compiled.
        def build(seed=0):
            keras.utils.set_random_seed(seed)
            base = keras.applications.MobileNetV3Small(
                input_shape=(32, 32, 3),
                include_top=False,
                weights=None,
                minimalistic=True,
                alpha=0.75,
                include_preprocessing=False,
            )
            inputs = keras.Input((32, 32, 3))
            h = base(inputs, training=False)
            h = keras.layers.GlobalAveragePooling2D()(h)
            return keras.Model(inputs, keras.layers.Dense(3)(h)), base

        rng = np.random.default_rng(0)
        x = rng.uniform(size=(12, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 3, size=(12,)).astype("int32")
        reference, ref_base = build()
        model, base = build(1)
        tu.copy_weights(reference, model)
        accumulate(model, 3)
        trajectories = ([], [])
        for trainable, lr in ((False, 0.1), (True, 0.01)):
            for m, b, batch, out in (
                (reference, ref_base, 6, trajectories[0]),
                (model, base, 2, trajectories[1]),
            ):
                b.trainable = trainable
                # Keras' advice for fine-tuning: BatchNormalization stays
                # frozen (inference mode) when the rest is unfrozen; one in
                # training mode normalizes by micro-batch statistics, which
                # no accumulation makes equal to the large batch's.
                for layer in b.layers:
                    if isinstance(layer, keras.layers.BatchNormalization):
                        layer.trainable = False
                _, weights = tu.train(
                    m,
                    x,
                    y,
                    batch,
                    1,
                    keras.optimizers.SGD(lr, momentum=0.9),
                    "sparse_categorical_crossentropy",
                )
                out.extend(weights)
        self.assertLen(trajectories[1], 4)
        self.assertGreater(len(model.trainable_variables), 2)
        tu.assert_same_trajectory(self, *trajectories)


class PublicApiTest(tf.test.TestCase):
    def test_exported(self):
        self.assertIn("accumulate", accum_model.__all__)
        self.assertIs(accum_model.accumulate, accumulate)


if __name__ == "__main__":
    tf.test.main()
