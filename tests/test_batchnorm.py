"""Tests of `AccumBatchNormalization`, `replace_batchnorm` and the BN warning.

Ground truths: `keras.layers.BatchNormalization` itself (accum_steps=1 and
outside an accumulator), numpy moments of a window's concatenated
activations, and plain large-batch `fit` for a model whose only BN sits on
the input (its activations do not depend on the weights).
"""

import os
import unittest
import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumBatchNormalization
from accum_model import AccumModel
from accum_model import GradientAccumulator
from accum_model import replace_batchnorm
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_KERAS3_ONLY = unittest.skipIf(
    tu.TF_KERAS, "AccumBatchNormalization needs Keras 3"
)

_MOMENTUM = 0.9
# Shapes per rank, channels last for axis=-1 and at position 1 for axis=1.
_SHAPES = {2: (6, 3), 3: (4, 5, 3), 4: (3, 4, 2, 3), 5: (2, 3, 2, 2, 3)}


def _numpy_moments(x, axis):
    """Biased mean and variance per channel, in float64."""
    x = np.asarray(x, np.float64)
    axes = tuple(i for i in range(x.ndim) if i != axis % x.ndim)
    return x.mean(axis=axes), x.var(axis=axes)


def _expected_moving(initial_mean, initial_var, mean, var):
    m = _MOMENTUM
    return (
        initial_mean * m + mean * (1.0 - m),
        initial_var * m + var * (1.0 - m),
    )


class _WindowDriver:
    """An engine with one dummy variable, to drive a layer's window."""

    def __init__(self, layer, accum_steps):
        self.dummy = tf.Variable(0.0)
        self.accumulator = GradientAccumulator([self.dummy], accum_steps)
        # Its updates move the dummy by nothing.
        self.optimizer = keras.optimizers.SGD(0.0)
        layer.attach_to_accumulator(self.accumulator)

    def micro_step(self, layer, x, **kwargs):
        y = layer(x, training=True, **kwargs)
        self.accumulator.step([tf.zeros(())], self.optimizer, weight=1.0)
        return y


def _pair(rank, axis, dtype="float32"):
    """A BatchNormalization and an AccumBatchNormalization, equal weights."""
    shape = _SHAPES[rank]
    if axis == 1:
        shape = (shape[0], shape[-1]) + shape[1:-1]
    rng = np.random.default_rng(rank)
    bn = keras.layers.BatchNormalization(
        axis=axis, momentum=_MOMENTUM, dtype=dtype
    )
    accum_bn = AccumBatchNormalization(
        axis=axis, momentum=_MOMENTUM, dtype=dtype
    )
    bn.build(shape)
    accum_bn.build(shape)
    weights = [rng.normal(size=w.shape).astype("float32") for w in bn.weights]
    weights[3] = np.abs(weights[3]) + 0.5  # a variance
    bn.set_weights(weights)
    accum_bn.set_weights(weights)
    return bn, accum_bn, shape, rng


def _input_bn_model(cls, bn_cls, **kwargs):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    h = bn_cls(momentum=_MOMENTUM, name="bn")(inputs)
    outputs = keras.layers.Dense(1)(h)
    return cls(inputs, outputs, **kwargs)


def _carrying_input_bn_model():
    """An input-BN AccumModel, windows of 4, open windows carried, compiled."""
    model = _input_bn_model(
        AccumModel, AccumBatchNormalization, accum_steps=4, epoch_end="carry"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _dense_bn_model(bn_cls, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, name="features")(inputs)
    h = bn_cls(momentum=_MOMENTUM, name="bn")(h)
    outputs = keras.layers.Dense(1)(h)
    return AccumModel(inputs, outputs, **kwargs)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, (n, 4)).astype("float32")
    x *= np.array([1.0, 0.1, 3.0, 0.5], "float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _moving(model):
    bn = model.get_layer("bn")
    return bn.moving_mean.numpy(), bn.moving_variance.numpy()


@_KERAS3_ONLY
class AccumBatchNormalizationTest(tf.test.TestCase, parameterized.TestCase):
    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_weights_are_those_of_batchnorm(self):
        bn, accum_bn, _, _ = _pair(rank=2, axis=-1)
        self.assertEqual(
            [(w.name, w.shape, w.trainable) for w in bn.weights],
            [(w.name, w.shape, w.trainable) for w in accum_bn.weights],
        )
        # Attaching adds window state, but no weight.
        _WindowDriver(accum_bn, accum_steps=2)
        self.assertLen(accum_bn.weights, 4)
        self.assertEqual(bn.get_config().keys(), accum_bn.get_config().keys())
        # Weights go both ways.
        for source, target in ((bn, accum_bn), (accum_bn, bn)):
            values = [w * 2.0 + 1.0 for w in source.get_weights()]
            source.set_weights(values)
            target.set_weights(source.get_weights())
            for a, b in zip(target.get_weights(), values):
                self.assertAllEqual(a, b)

    @parameterized.named_parameters(
        (f"rank{rank}_axis{axis}_{dtype}", rank, axis, dtype)
        for rank in (2, 3, 4, 5)
        for axis in (-1, 1)
        for dtype in ("float32", "mixed_float16")
        if not (rank == 2 and axis == 1)
    )
    def test_equals_batchnorm_unattached_and_with_one_step(
        self, rank, axis, dtype
    ):
        bn, accum_bn, shape, rng = _pair(rank, axis, dtype)
        attached_bn = AccumBatchNormalization.from_config(accum_bn.get_config())
        attached_bn.build(shape)
        attached_bn.set_weights(bn.get_weights())
        driver = _WindowDriver(attached_bn, accum_steps=1)
        input_dtype = "float16" if dtype == "mixed_float16" else "float32"
        for step in range(3):
            x = rng.normal(1.0, 2.0, shape).astype(input_dtype)
            expected = bn(x, training=True)
            self.assertAllEqual(accum_bn(x, training=True), expected)
            self.assertAllEqual(driver.micro_step(attached_bn, x), expected)
            for layer in (accum_bn, attached_bn):
                # Equal to the last bit on CPU (tolerance 0).
                self.assertAllEqual(layer.moving_mean, bn.moving_mean)
                self.assertAllEqual(layer.moving_variance, bn.moving_variance)
            self.assertAllEqual(
                attached_bn(x, training=False), bn(x, training=False)
            )
        self.assertEqual(attached_bn._accum_window.mean.dtype, tf.float32)

    def test_renorm_equals_batchnorm_with_one_step(self):
        config = dict(
            momentum=_MOMENTUM,
            renorm=True,
            renorm_momentum=0.8,
            renorm_clipping={"rmax": 2.0, "rmin": 0.5, "dmax": 1.0},
        )
        bn = keras.layers.BatchNormalization(**config)
        accum_bn = AccumBatchNormalization(**config)
        bn.build((None, 3))
        accum_bn.build((None, 3))
        driver = _WindowDriver(accum_bn, accum_steps=1)
        rng = np.random.default_rng(1)
        for _ in range(3):
            x = rng.normal(1.0, 2.0, (5, 3)).astype("float32")
            self.assertAllEqual(
                driver.micro_step(accum_bn, x), bn(x, training=True)
            )
        self.assertLen(accum_bn.weights, 7)
        for a, b in zip(accum_bn.weights, bn.weights):
            self.assertEqual(a.name, b.name)
            self.assertAllEqual(a, b)

    @parameterized.named_parameters(
        ("two_equal", (4, 4), None),
        ("three_unequal", (5, 2, 3), None),
        ("three_masked", (4, 3, 5), "mask"),
    )
    def test_one_window_matches_numpy_closed_form(self, sizes, masked):
        rng = np.random.default_rng(len(sizes))
        layer = AccumBatchNormalization(momentum=_MOMENTUM)
        naive = keras.layers.BatchNormalization(momentum=_MOMENTUM)
        shape = (None, 3, 2) if masked else (None, 2)
        layer.build(shape)
        naive.build(shape)
        driver = _WindowDriver(layer, accum_steps=len(sizes))
        batches, valid = [], []
        for i, n in enumerate(sizes):
            # Micro-batches with different means and spreads, so that the
            # between-batch variance matters.
            x = rng.normal(i * 2.0, 1.0 + i, (n,) + shape[1:])
            x = x.astype("float32")
            kwargs = {}
            if masked:
                mask = rng.uniform(size=(n, 3)) < 0.6
                mask[0] = True  # never an empty micro-batch
                kwargs["mask"] = mask
                valid.append(x[mask])
            else:
                valid.append(x)
            batches.append((x, kwargs))
            before = layer.moving_mean.numpy()
            driver.micro_step(layer, x, **kwargs)
            naive(x, training=True, **kwargs)
            if i < len(sizes) - 1:
                # Nothing moves before the window closes.
                self.assertAllEqual(layer.moving_mean, before)
        mean, var = _numpy_moments(np.concatenate(valid), axis=-1)
        expected_mean, expected_var = _expected_moving(0.0, 1.0, mean, var)
        self.assertAllClose(layer.moving_mean, expected_mean, atol=1e-6)
        self.assertAllClose(layer.moving_variance, expected_var, atol=1e-6)
        # The window is empty again.
        self.assertAllEqual(layer._accum_window.count, np.zeros(2))
        # Discriminating: per-micro-batch updates, and the mean of the
        # micro-batch variances (which drops the between-batch variance),
        # are both far from it.
        self.assertNotAllClose(naive.moving_variance, expected_var, atol=1e-2)
        mean_of_vars = np.mean([_numpy_moments(v, -1)[1] for v in valid], 0)
        self.assertNotAllClose(
            _expected_moving(0.0, 1.0, mean, mean_of_vars)[1],
            expected_var,
            atol=1e-2,
        )

    @parameterized.named_parameters(("plain", False), ("renorm", True))
    def test_fully_masked_window_moves_nothing(self, renorm):
        layer = AccumBatchNormalization(momentum=_MOMENTUM, renorm=renorm)
        layer.build((None, 3, 2))
        layer.moving_mean.assign([1.5, -2.0])  # not a fixed point of m * x
        driver = _WindowDriver(layer, accum_steps=2)
        before = [w.numpy() for w in layer.non_trainable_weights]
        x = np.random.default_rng(0).normal(size=(4, 3, 2)).astype("float32")
        for _ in range(2):
            driver.micro_step(layer, x, mask=np.zeros((4, 3), bool))
        self.assertEqual(int(driver.accumulator.micro_step), 0)  # applied
        for w, b in zip(layer.non_trainable_weights, before):
            self.assertAllEqual(w, b)
        # A window with values does move them.
        for _ in range(2):
            driver.micro_step(layer, x)
        self.assertNotAllClose(layer.moving_mean, before[0])

    def test_fit_window_matches_closed_form_of_activations(self):
        x, y = _data(12)
        model = _dense_bn_model(AccumBatchNormalization, accum_steps=3)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        # The window's activations: the features under the initial weights
        # (the one update comes after the window).
        kernel, bias = model.get_layer("features").get_weights()
        features = x.astype(np.float64) @ kernel + bias
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 1)
        mean, var = _numpy_moments(features, axis=-1)
        expected = _expected_moving(0.0, 1.0, mean, var)
        moving = _moving(model)
        self.assertAllClose(moving[0], expected[0], atol=1e-6)
        self.assertAllClose(moving[1], expected[1], rtol=1e-6, atol=1e-6)

    @parameterized.named_parameters(("graph", False), ("jit_compile", True))
    def test_input_bn_equals_large_batch_fit(self, jit_compile):
        # 40 samples: windows of 32 and, flushed at the epoch's end, 8.
        x, y = _data(40)
        model = _input_bn_model(
            AccumModel, AccumBatchNormalization, accum_steps=4
        )
        naive = _input_bn_model(
            AccumModel, keras.layers.BatchNormalization, accum_steps=4
        )
        reference = _input_bn_model(
            keras.Model, keras.layers.BatchNormalization
        )
        for m in (model, naive, reference):
            m.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss="mse",
                jit_compile=jit_compile,
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for m, batch_size in ((model, 8), (naive, 8), (reference, 32)):
                m.fit(
                    x,
                    y,
                    batch_size=batch_size,
                    epochs=2,
                    shuffle=False,
                    verbose=0,
                )
            # A new accum_steps takes effect without retracing; the hook
            # still fires once per window.
            model.accum_steps = 2
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            reference.fit(
                x, y, batch_size=16, epochs=1, shuffle=False, verbose=0
            )
        self.assertEqual(
            int(model.optimizer.iterations),
            int(reference.optimizer.iterations),
        )
        for got, want in zip(_moving(model), _moving(reference)):
            self.assertAllClose(got, want, rtol=1e-6, atol=1e-6)
        self.assertNotAllClose(
            _moving(naive)[1], _moving(reference)[1], atol=1e-2
        )

    @parameterized.named_parameters(
        ("keras", ".keras"), ("weights_h5", ".weights.h5")
    )
    def test_save_mid_window_keeps_the_window_of_moments(self, suffix):
        # Windows of 4 micro-batches of 4; saved after 3 micro-batches of the
        # second window and resumed. Ground truth: plain large-batch fit
        # (batch 16) of the same input-BN model, uninterrupted.
        x, y = _data(32)
        reference = _input_bn_model(
            keras.Model, keras.layers.BatchNormalization
        )
        reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)

        model = _carrying_input_bn_model()
        model.fit(x[:28], y[:28], batch_size=4, shuffle=False, verbose=0)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 3)
        path = os.path.join(self.get_temp_dir(), "mid" + suffix)
        restored = tu.save_and_load(model, path, _carrying_input_bn_model)
        restored.fit(x[28:], y[28:], batch_size=4, shuffle=False, verbose=0)

        self.assertEqual(int(restored.optimizer.iterations), 2)
        # (Not the Dense weights: each micro-batch is normalized with its own
        # moments, the large batch with its 16 samples'.)
        for got, want in zip(_moving(restored), _moving(reference)):
            self.assertAllClose(got, want, rtol=1e-6, atol=1e-6)

    def test_reset_discards_the_window_of_moments(self):
        # reset() discards the open window: the gradients' and the moments'.
        # Ground truth: a model that never saw the discarded micro-batches.
        x, y = _data(24)

        model = _carrying_input_bn_model()
        reference = _carrying_input_bn_model()
        model.fit(x[16:], y[16:], batch_size=4, shuffle=False, verbose=0)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 2)
        model.gradient_accumulator.reset()
        for m in (model, reference):
            m.fit(x[:16], y[:16], batch_size=4, shuffle=False, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 1)
        for got, want in zip(_moving(model), _moving(reference)):
            self.assertAllClose(got, want, rtol=1e-6, atol=1e-6)
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )

    def test_keras_file_round_trip(self):
        x, y = _data(16)
        model = _input_bn_model(
            AccumModel, AccumBatchNormalization, accum_steps=2
        )
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        path = os.path.join(self.get_temp_dir(), "model.keras")
        model.save(path)
        restored = keras.models.load_model(path)
        self.assertIsInstance(restored.get_layer("bn"), AccumBatchNormalization)
        for a, b in zip(restored.get_weights(), model.get_weights()):
            self.assertAllEqual(a, b)
        self.assertAllClose(
            restored.predict(x, verbose=0), model.predict(x, verbose=0)
        )


@_KERAS3_ONLY
class ReplaceBatchnormTest(tf.test.TestCase, parameterized.TestCase):
    def _assert_replaced(self, original, replaced):
        self.assertNotIn(
            "BatchNormalization",
            [type(layer).__name__ for layer in replaced._flatten_layers()],
        )
        self.assertEqual(len(original.weights), len(replaced.weights))
        for a, b in zip(original.weights, replaced.weights):
            self.assertEqual(a.name, b.name)
            self.assertAllEqual(a, b)
            self.assertIsNot(a, b)
        x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
        self.assertAllClose(
            replaced.predict(x, verbose=0), original.predict(x, verbose=0)
        )

    def _trained_bn(self, model):
        for layer in model._flatten_layers():
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.moving_mean.assign(tf.fill(layer.moving_mean.shape, 2.0))

    def test_sequential_with_nested_functional(self):
        inputs = keras.Input((3,))
        inner = keras.Model(
            inputs, keras.layers.BatchNormalization()(inputs), name="inner"
        )
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3),
                inner,
                keras.layers.Dense(1),
            ]
        )
        self._trained_bn(model)
        replaced = replace_batchnorm(model)
        self.assertIsInstance(replaced, keras.Sequential)
        self.assertLen(
            [
                layer
                for layer in replaced._flatten_layers()
                if isinstance(layer, AccumBatchNormalization)
            ],
            2,
        )
        self._assert_replaced(model, replaced)

    def test_functional_accum_model_keeps_its_settings(self):
        model = _input_bn_model(
            AccumModel,
            keras.layers.BatchNormalization,
            accum_steps=3,
            epoch_end="carry",
        )
        self._trained_bn(model)
        replaced = replace_batchnorm(model)
        self.assertIsInstance(replaced, AccumModel)
        self.assertEqual(replaced.accum_steps, 3)
        self.assertEqual(replaced.epoch_end, "carry")
        self.assertIsInstance(replaced.get_layer("bn"), AccumBatchNormalization)
        self._assert_replaced(model, replaced)

    def test_subclassed_model_is_rejected(self):
        class Net(keras.Model):
            def call(self, x):
                return x

        with self.assertRaisesRegex(ValueError, "Received: model of type Net"):
            replace_batchnorm(Net())


@_KERAS3_ONLY
class BatchnormWarningTest(tf.test.TestCase, parameterized.TestCase):
    def _fit_twice(self, bn_cls, accum_steps, frozen=False, **kwargs):
        x, y = _data(8)
        model = _input_bn_model(
            AccumModel, bn_cls, accum_steps=accum_steps, **kwargs
        )
        model.get_layer("bn").trainable = not frozen
        model.compile(optimizer="sgd", loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        return [w for w in caught if "BatchNormalization" in str(w.message)]

    def test_warns_once_for_plain_batchnorm(self):
        caught = self._fit_twice(keras.layers.BatchNormalization, 2)
        self.assertLen(caught, 1)
        message = str(caught[0].message)
        self.assertIn("accum_model.AccumBatchNormalization", message)
        self.assertIn("accum_model.replace_batchnorm(model)", message)
        self.assertIn("'bn'", message)

    def test_warns_for_plain_batchnorm_in_slices(self):
        caught = self._fit_twice(
            keras.layers.BatchNormalization, 1, micro_batch_size=2
        )
        self.assertLen(caught, 1)
        self.assertIn("micro_batch_size=2", str(caught[0].message))

    @parameterized.named_parameters(
        ("accum_bn", AccumBatchNormalization, 2, False),
        ("accum_steps_1", keras.layers.BatchNormalization, 1, False),
        ("frozen", keras.layers.BatchNormalization, 2, True),
    )
    def test_silent(self, bn_cls, accum_steps, frozen):
        self.assertEmpty(self._fit_twice(bn_cls, accum_steps, frozen))


class ExportsTest(tf.test.TestCase):
    def test_public_and_registered_for_loading(self):
        self.assertIn("AccumBatchNormalization", accum_model.__all__)
        self.assertIn("replace_batchnorm", accum_model.__all__)
        # `load_model` finds the layer by this name, without custom_objects.
        self.assertEqual(
            keras.saving.get_registered_name(AccumBatchNormalization),
            "accum_model>AccumBatchNormalization",
        )


class LegacyKerasTest(tf.test.TestCase):
    @unittest.skipUnless(tu.TF_KERAS, "only under tf_keras")
    def test_refused_with_a_clear_error_under_tf_keras(self):
        with self.assertRaisesRegex(ValueError, "needs Keras 3"):
            AccumBatchNormalization()
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.BatchNormalization()(inputs))
        with self.assertRaisesRegex(ValueError, "needs Keras 3"):
            replace_batchnorm(model)
        self.assertIsInstance(model.layers[1], keras.layers.BatchNormalization)


if __name__ == "__main__":
    tf.test.main()
