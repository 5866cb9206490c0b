"""`AccumStepsWarmup`: accum_steps that grow during fit, without retracing."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import AccumStepsWarmup
from accum_model.keras._adapter import keras
from accum_model.model._warmup import accum_steps_for_noise_scale
from tests import noise_scale_problem as problem
from tests import testing_utils as tu


class RuleTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.parameters(
        # b_simple, micro-batch weight, factor, min, max -> steps, target
        (96.0, 8.0, 1.0, 1, 64, 12, 12.0),
        (96.0, 8.0, 4.0, 1, 64, 48, 48.0),
        (96.0, 8.0, 8.0, 1, 64, 64, 96.0),
        (4.0, 8.0, 1.0, 2, 64, 2, 0.5),
        (float("inf"), 8.0, 1.0, 1, 16, 16, float("inf")),
    )
    def test_clip_round_factor_b_simple_over_micro_batch(
        self, b, micro, factor, low, high, steps, target
    ):
        self.assertEqual(
            accum_steps_for_noise_scale(b, micro, factor, low, high),
            (steps, target),
        )

    def test_no_estimate_no_change(self):
        self.assertEqual(
            accum_steps_for_noise_scale(float("nan"), 8.0), (None, None)
        )


class ArgumentsTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("no_max_for_noise_rule", dict(), "`max_accum_steps` is required"),
        ("no_batch_size", dict(double_at=[10]), "`batch_size`"),
        ("factor", dict(factor=0, max_accum_steps=4), "`factor` must be"),
        ("min", dict(min_accum_steps=0, max_accum_steps=4), "`accum_steps`"),
        (
            "max_below_min",
            dict(min_accum_steps=4, max_accum_steps=2),
            "`max_accum_steps` must be an integer >= 4",
        ),
        (
            "cooldown",
            dict(max_accum_steps=4, cooldown_windows=0),
            "`cooldown_windows`",
        ),
        ("hysteresis", dict(max_accum_steps=4, hysteresis=-1), "`hysteresis`"),
    )
    def test_bad_arguments(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            AccumStepsWarmup(**kwargs)

    def test_needs_an_accum_model(self):
        x, y = tu.regression_data(8)
        model = tu.mlp(keras.Model)
        model.compile("sgd", "mse")
        with self.assertRaisesRegex(ValueError, "needs an `AccumModel`"):
            model.fit(
                x,
                y,
                verbose=0,
                callbacks=[AccumStepsWarmup(double_at=[4], batch_size=2)],
            )

    def test_noise_rule_needs_the_measurement(self):
        x, y = tu.regression_data(8)
        model = tu.mlp(AccumModel, accum_steps=2)
        model.compile("sgd", "mse")
        with self.assertRaisesRegex(ValueError, "noise_scale=True"):
            model.fit(
                x, y, verbose=0, callbacks=[AccumStepsWarmup(max_accum_steps=8)]
            )


class ScheduleTest(tf.test.TestCase):
    def test_doubling_schedule_equals_plain_training_on_growing_batches(self):
        def counting():
            class Counting(AccumModel):
                traces = 0

                def train_step(self, data):
                    type(self).traces += 1
                    return super().train_step(data)

            return Counting

        x, y = tu.regression_data(96)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(counting(), accum_steps=1))
        warmup = AccumStepsWarmup(
            double_at=[32, 64],
            batch_size=4,
            warmup_windows=0,
            cooldown_windows=1,
            verbose=0,
        )
        history, actual = tu.train(
            model, x, y, batch_size=4, optimizer="sgd", callbacks=[warmup]
        )
        # By hand: after 32 samples (8 windows of 4) accum_steps becomes 2,
        # from the next window; after 64 (4 windows of 8) it becomes 4.
        bounds = [4 * i for i in range(9)] + [40, 48, 56, 64, 80, 96]
        reference.compile(tu.OPTIMIZERS["sgd"](), "mse")
        expected = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            reference.train_on_batch(x[start:stop], y[start:stop])
            expected.append(reference.get_weights())
        tu.assert_same_trajectory(self, expected, actual)
        self.assertEqual(
            [(c["samples"], c["old"], c["new"]) for c in warmup.changes],
            [(32, 1, 2), (64, 2, 4)],
        )
        self.assertEqual(history.history["accum_steps"], [4])
        # As many traces as a fit whose accum_steps never changes.
        fixed = tu.mlp(counting(), accum_steps=1)
        tu.train(fixed, x, y, batch_size=4, optimizer="sgd")
        self.assertEqual(type(model).traces, type(fixed).traces)


class NoiseScaleRuleTest(tf.test.TestCase):
    def test_settles_at_factor_b_simple_over_micro_batch(self):
        # Frozen weights (learning rate 0) on the problem whose B_simple is
        # known exactly: accum_steps must settle where the rule puts the
        # population value, within the hysteresis band.
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        _, _, b_simple = problem.population(x, y, kernel, bias)
        rows = np.random.default_rng(3).integers(0, len(x), size=16000)
        inputs = keras.Input((problem.IN_DIM,))
        model = AccumModel(
            inputs=inputs,
            outputs=keras.layers.Dense(1)(inputs),
            accum_steps=2,
            noise_scale=accum_model.NoiseScale(beta=0.98),
        )
        model.set_weights([kernel, bias])
        model.compile(keras.optimizers.SGD(0.0), "mse")
        factor, micro = 4.0, 4
        warmup = AccumStepsWarmup(
            factor=factor,
            min_accum_steps=2,
            max_accum_steps=32,
            warmup_windows=50,
            cooldown_windows=50,
            hysteresis=0.25,
            verbose=0,
        )
        history = model.fit(
            x[rows],
            y[rows],
            batch_size=micro,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[warmup],
        )
        target = factor * b_simple / micro
        self.assertGreater(target, 4.0)  # the rule has to move it
        self.assertNotEmpty(warmup.changes)
        final = model.accum_steps
        self.assertBetween(final / target, 1 / 1.35, 1.35)
        self.assertEqual(history.history["accum_steps"], [final])
        # No thrashing: changes at least cooldown_windows apart.
        windows = [c["window"] for c in warmup.changes]
        self.assertGreaterEqual(windows[0], 50)
        self.assertTrue(all(b - a >= 50 for a, b in zip(windows, windows[1:])))

    def test_adascale_alone_feeds_the_rule(self):
        # AdaScale measures the noise scale without `noise_scale=`: the
        # warm-up must follow that estimate as it follows an explicit one
        # (the same defaults), to the same changes and weights.
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        rows = np.random.default_rng(5).integers(0, len(x), size=4800)

        def run(**settings):
            inputs = keras.Input((problem.IN_DIM,))
            model = AccumModel(
                inputs=inputs,
                outputs=keras.layers.Dense(1)(inputs),
                accum_steps=2,
                adascale=accum_model.AdaScale(base_batch=4),
                **settings,
            )
            model.set_weights([kernel, bias])
            model.compile(keras.optimizers.SGD(1e-3), "mse")
            warmup = AccumStepsWarmup(
                factor=4.0,
                min_accum_steps=2,
                max_accum_steps=32,
                warmup_windows=20,
                cooldown_windows=20,
                verbose=0,
            )
            model.fit(
                x[rows],
                y[rows],
                batch_size=4,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[warmup],
            )
            return model, warmup

        alone, alone_warmup = run()
        explicit, explicit_warmup = run(noise_scale=True)
        self.assertNotEmpty(explicit_warmup.changes)
        self.assertEqual(alone_warmup.changes, explicit_warmup.changes)
        self.assertEqual(alone.accum_steps, explicit.accum_steps)
        tu.assert_same_trajectory(
            self, [explicit.get_weights()], [alone.get_weights()]
        )


if __name__ == "__main__":
    tf.test.main()
