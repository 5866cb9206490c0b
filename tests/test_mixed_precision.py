"""AccumModel under mixed precision, against large-batch Keras training.

Under `mixed_float16` each micro-batch is unscaled with its own loss scale
and a micro-batch with non-finite gradients is left out of its window. The
reference is plain Keras training, under the same policy and loss-scale
settings, with one large batch per window holding exactly the micro-batches
that were not left out.
"""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model import GradientAccumulator
from accum_model.keras._adapter import ADAPTER
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_MICRO, _STEPS = 4, 2


def _lso(initial_scale=256.0, growth_steps=2000, **sgd_kwargs):
    # A modest initial scale: 2**15 would overflow float16 on ordinary
    # micro-batches of this tiny model, and the test must choose which
    # micro-batch overflows.
    return keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, **sgd_kwargs),
        initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps,
    )


def _data(n=16, overflowing=()):
    x, y = tu.regression_data(n)
    for k in overflowing:
        # float16 tops out at 65504: this micro-batch's activations, and so
        # its gradients, are not finite.
        x[k * _MICRO] = 1e6
    return x, y


def _reference_weights(x, y, windows, optimizer):
    """Large-batch training: one update per window of kept micro-batches."""
    model = tu.mlp(keras.Model)
    model.compile(optimizer=optimizer, loss="mse")
    for window in windows:
        rows = np.concatenate(
            [np.arange(k * _MICRO, (k + 1) * _MICRO) for k in window]
        )
        model.train_on_batch(x[rows], y[rows])
    return model


def _all_finite(model):
    return all(np.all(np.isfinite(w)) for w in model.get_weights())


class _MixedFloat16TestCase(tf.test.TestCase, parameterized.TestCase):
    """Runs each test under the `mixed_float16` policy."""

    def setUp(self):
        super().setUp()
        tu.use_policy(self, "mixed_float16")


class MixedFloat16Test(_MixedFloat16TestCase):
    def _fit(self, x, y, optimizer, **fit_kwargs):
        model = tu.mlp(AccumModel, accum_steps=_STEPS)
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(
            x, y, batch_size=_MICRO, shuffle=False, verbose=0, **fit_kwargs
        )
        return model, history

    def test_overflowing_microbatch_is_left_out(self):
        # Micro-batches 0..3, windows (0, 1) and (2, 3); 1 overflows.
        x, y = _data(overflowing=[1])
        model, history = self._fit(x, y, _lso())
        reference = _reference_weights(x, y, [[0], [2, 3]], _lso())

        self.assertTrue(_all_finite(model))
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-4,
        )
        self.assertEqual(int(model.optimizer.iterations), 2)
        self.assertEqual(model.skipped_microbatches, 1)
        self.assertEqual(history.history["skipped_microbatches"], [1])
        # Halved once, as Keras does on a non-finite step.
        self.assertEqual(float(ADAPTER.loss_scale(model.optimizer)), 128.0)

    def test_canary_keras_builtin_stretches_the_window(self):
        # Canary: checks Keras' built-in option, not this package; it
        # fails when Keras changes what the docs compare with.
        # Keras' own option skips the overflowing micro-batch by not counting
        # it at all: its window silently takes micro-batches 0, 2 and applies
        # once, with 3 left pending, instead of two updates.
        if not tu.HAS_BUILTIN_ACCUMULATION:
            self.skipTest("tf_keras has no built-in accumulation")
        x, y = _data(overflowing=[1])
        builtin = tu.mlp(keras.Model)
        builtin.compile(
            optimizer=_lso(gradient_accumulation_steps=_STEPS), loss="mse"
        )
        builtin.fit(x, y, batch_size=_MICRO, shuffle=False, verbose=0)
        reference = _reference_weights(x, y, [[0], [2, 3]], _lso())
        self.assertEqual(int(builtin.optimizer.iterations), 1)
        self.assertGreater(
            tu.max_abs_diff(reference.get_weights(), builtin.get_weights()),
            1e-2,
        )

    def test_all_nonfinite_window_applies_nothing(self):
        x, y = _data(overflowing=[0, 1])
        model, history = self._fit(x, y, _lso())
        reference = _reference_weights(x, y, [[2, 3]], _lso())

        self.assertTrue(_all_finite(model))
        self.assertEqual(int(model.optimizer.iterations), 1)
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-4,
        )
        self.assertEqual(model.skipped_microbatches, 2)
        self.assertEqual(float(ADAPTER.loss_scale(model.optimizer)), 64.0)

    def test_window_of_only_overflows_does_not_advance_iterations(self):
        x, y = _data(n=8, overflowing=[0, 1])
        model, _ = self._fit(x, y, _lso())
        self.assertEqual(int(model.optimizer.iterations), 0)
        initial = tu.mlp(keras.Model)
        self.assertEqual(
            tu.max_abs_diff(initial.get_weights(), model.get_weights()), 0.0
        )

    def test_scale_changing_mid_window_is_harmless(self):
        # The scale doubles after every finite micro-batch: each window's two
        # micro-batches are computed with different scales.
        x, y = _data()
        model, _ = self._fit(x, y, _lso(initial_scale=2.0, growth_steps=1))
        reference = _reference_weights(x, y, [[0, 1], [2, 3]], _lso())
        self.assertEqual(float(ADAPTER.loss_scale(model.optimizer)), 32.0)
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-4,
        )

    def test_recompiled_loss_scale_optimizer_is_used(self):
        # A new, unbuilt optimizer after `compile`: its own scale is read
        # and moved, not the first one's (or a constant).
        x, y = _data(overflowing=[1])
        model, _ = self._fit(x, y, _lso())
        model.compile(optimizer=_lso(initial_scale=1024.0), loss="mse")
        model.fit(x, y, batch_size=_MICRO, shuffle=False, verbose=0)
        self.assertEqual(float(ADAPTER.loss_scale(model.optimizer)), 512.0)
        self.assertEqual(model.skipped_microbatches, 2)
        self.assertTrue(_all_finite(model))

    def test_masked_sequences_with_sparse_gradients(self):
        # Embedding gradients are IndexedSlices; each micro-batch is weighted
        # by its valid tokens and unscaled by its scale in the same multiply.
        from tests import test_normalizers as tn

        x, y = tn.padded_sequences(16, micro=_MICRO)
        reference = tn.sequence_model(keras.Model)
        model = tu.copy_weights(
            reference, tn.sequence_model(AccumModel, accum_steps=_STEPS)
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        _, expected = tu.train(
            reference, x, y, _MICRO * _STEPS, 2, _lso(), loss
        )
        _, actual = tu.train(model, x, y, _MICRO, 2, _lso(), loss)
        # float16 forward passes: measured 5e-5 (weights move by 4e-2 to
        # 5e-2; sample-count averaging is off by 2e-2 in float32).
        tu.assert_same_trajectory(self, expected, actual, atol=2e-4)

    def test_logged_loss_is_unscaled(self):
        x, y = _data()
        model, history = self._fit(x, y, _lso(), epochs=2)
        reference = tu.mlp(keras.Model)
        reference.compile(optimizer=_lso(), loss="mse")
        expected = reference.fit(
            x, y, batch_size=_MICRO * _STEPS, shuffle=False, verbose=0, epochs=2
        )
        self.assertAllClose(
            expected.history["loss"], history.history["loss"], rtol=1e-3
        )
        self.assertLess(history.history["loss"][0], 10.0)


def _custom_loop(x, y, optimizer, compiled):
    """`GradientAccumulator.step` in a loop written as Keras documents one.

    The loss is scaled, and the gradients handed over, as each Keras
    generation's `LossScaleOptimizer` takes them in a custom loop.
    """
    model = tu.mlp(keras.Model)
    variables = model.trainable_variables
    accumulator = GradientAccumulator(variables, accum_steps=_STEPS)
    # Keras 3's `scale_loss` multiplies by a constant until the optimizer
    # is built; built first, the traced step reads the scale variable.
    ADAPTER.build_optimizer(optimizer, variables)
    loss_fn = keras.losses.MeanSquaredError()

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled = tu.scale_loss(optimizer, loss)
        grads = tu.gradients_to_apply(
            optimizer, tape.gradient(scaled, variables)
        )
        return accumulator.step(grads, optimizer, weight=tf.shape(xb)[0])

    if compiled:
        train_step = tf.function(train_step)
    for k in range(len(x) // _MICRO):
        rows = slice(k * _MICRO, (k + 1) * _MICRO)
        train_step(x[rows], y[rows])
    return model, accumulator


class CustomLoopLossScaleTest(_MixedFloat16TestCase):
    """`GradientAccumulator.step` with a LossScaleOptimizer, no `fit`."""

    @parameterized.product(
        compiled=[False, True],
        case=[
            # (overflowing micro-batches, windows of the kept ones, scale)
            ((), [[0, 1], [2, 3]], 256.0),
            ((1,), [[0], [2, 3]], 128.0),
        ],
    )
    def test_equals_large_batch_over_kept_microbatches(self, compiled, case):
        overflowing, windows, final_scale = case
        x, y = _data(overflowing=overflowing)
        optimizer = _lso()
        model, accumulator = _custom_loop(x, y, optimizer, compiled)
        reference = _reference_weights(x, y, windows, _lso())

        self.assertTrue(_all_finite(model))
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-4,
        )
        self.assertEqual(int(optimizer.iterations), 2)
        self.assertEqual(
            int(accumulator.skipped_microbatches), len(overflowing)
        )
        self.assertEqual(float(ADAPTER.loss_scale(optimizer)), final_scale)

    def test_unbuilt_optimizer_in_a_traced_step_is_refused(self):
        if tu.TF_KERAS:
            self.skipTest("tf_keras' scale is a variable from the start")
        model = tu.mlp(keras.Model)
        optimizer = _lso()
        accumulator = GradientAccumulator(
            model.trainable_variables, accum_steps=_STEPS
        )

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                y_pred = tf.cast(model(x), tf.float32)
                loss = tf.reduce_mean(tf.square(y_pred - y))
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            return accumulator.step(grads, optimizer)

        x, y = _data()
        with self.assertRaisesRegex(ValueError, "must be built before"):
            train_step(x[:_MICRO], y[:_MICRO])
        self.assertFalse(optimizer.built)
        self.assertEqual(int(accumulator.micro_step), 0)
        # Built first, the same step runs and keeps up with the scale.
        optimizer.build(model.trainable_variables)
        train_step(x[:_MICRO], y[:_MICRO])
        self.assertEqual(int(accumulator.micro_step), 1)

    def test_wrong_number_of_gradients_moves_nothing(self):
        model = tu.mlp(keras.Model)
        optimizer = _lso()
        accumulator = GradientAccumulator(model.trainable_variables)
        with self.assertRaisesRegex(ValueError, "one gradient per variable"):
            accumulator.step([tf.fill([4, 5], float("inf"))], optimizer)
        self.assertEqual(float(ADAPTER.loss_scale(optimizer)), 256.0)
        self.assertEqual(int(accumulator.micro_step), 0)
        self.assertEqual(int(accumulator.skipped_microbatches), 0)


class MixedBfloat16Test(tf.test.TestCase):
    def test_close_to_float32_large_batch(self):
        x, y = _data()
        reference = _reference_weights(
            x, y, [[0, 1], [2, 3]], keras.optimizers.SGD(0.1)
        )
        tu.use_policy(self, "mixed_bfloat16")
        model = tu.mlp(AccumModel, accum_steps=_STEPS)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=_MICRO, shuffle=False, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 2)
        # bfloat16 keeps 8 bits of mantissa (measured: 3e-4 to 4e-4, where
        # the weights move by 7e-2).
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            2e-3,
        )
        self.assertNotIn("skipped_microbatches", model.history.history)


if __name__ == "__main__":
    tf.test.main()
