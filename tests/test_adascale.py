"""AdaScale SGD: the gain against hand computations and population values."""

import os
import re
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import AdaScale
from accum_model import GradientAccumulator
from accum_model.engine import _adascale
from accum_model.keras._adapter import keras
from tests import noise_scale_problem as problem
from tests import testing_utils as tu


def _population_gain(base_batch, weight):
    """The exact gain of a window of `weight` samples at the frozen weights."""
    x, y = problem.data()
    grad_sq, trace, _ = problem.population(x, y, *problem.frozen_weights())
    return (trace / base_batch + grad_sq) / (trace / weight + grad_sq)


def _gain_by_hand(trace, grad_sq, weight, base_batch):
    """`_adascale.gain`'s rule, in float64."""
    scale = weight / base_batch
    if weight == base_batch:
        return 1.0
    if np.isnan(trace):
        return min(1.0, scale)
    noise = max(trace, 0.0)
    if grad_sq <= 0.0:
        r = scale
    else:
        r = (noise / base_batch + grad_sq) / (noise / weight + grad_sq)
    return float(np.clip(r, min(1.0, scale), max(1.0, scale)))


def _linear_model(weights=None, **kwargs):
    kernel, bias = weights or problem.frozen_weights()
    inputs = keras.Input((problem.IN_DIM,))
    outputs = keras.layers.Dense(1)(inputs)
    model = AccumModel(inputs=inputs, outputs=outputs, **kwargs)
    model.set_weights([kernel, bias])
    return model


def _plain_linear_model():
    kernel, bias = problem.frozen_weights()
    inputs = keras.Input((problem.IN_DIM,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    model.set_weights([kernel, bias])
    return model


def _micro_batches(xs, ys, sizes):
    """A dataset of micro-batches cycling through `sizes`."""
    lengths = np.tile(sizes, len(xs) // sum(sizes))
    # Row-split tensors slice into dense micro-batches of their own sizes.
    return tf.data.Dataset.from_tensor_slices(
        (
            tf.RaggedTensor.from_row_lengths(xs, lengths),
            tf.RaggedTensor.from_row_lengths(ys, lengths),
        )
    )


class _GainRecorder(keras.callbacks.Callback):
    """The gain after every window that closed (read from the logs)."""

    def __init__(self, accum_steps):
        super().__init__()
        self.accum_steps = accum_steps
        self.gains, self.taus = [], []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.accum_steps == 0:
            self.gains.append(float(logs["adascale_gain"]))
            self.taus.append(float(logs["adascale_tau"]))


class AdaScaleConfigTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("zero", 0),
        ("negative", -4),
        ("bool", True),
        ("string", "32"),
        ("none", None),
        ("inf", float("inf")),
        ("nan", float("nan")),
    )
    def test_base_batch_must_be_positive(self, base_batch):
        with self.assertRaisesRegex(
            ValueError,
            re.escape(f"Received: base_batch={base_batch!r}"),
        ):
            AdaScale(base_batch=base_batch)

    def test_config_equality_and_repr(self):
        self.assertEqual(AdaScale(32), AdaScale(base_batch=32))
        self.assertNotEqual(AdaScale(32), AdaScale(16))
        self.assertEqual(AdaScale(2.5).get_config(), {"base_batch": 2.5})
        self.assertEqual(repr(AdaScale(32)), "AdaScale(base_batch=32)")
        self.assertEqual(_adascale.as_config({"base_batch": 8}), AdaScale(8))
        self.assertIsNone(_adascale.as_config(None))
        self.assertIsNone(_adascale.as_config(False))
        with self.assertRaisesRegex(TypeError, "Received: adascale=True"):
            _adascale.as_config(True)

    def test_turns_the_noise_scale_on_and_needs_every_window(self):
        engine = GradientAccumulator(
            [tf.Variable([1.0])], accum_steps=2, adascale=AdaScale(4)
        )
        self.assertEqual(
            engine.noise_scale.config, accum_model.NoiseScale(every=1)
        )
        with self.assertRaisesRegex(ValueError, "`noise_scale.every` must"):
            _linear_model(
                accum_steps=2,
                noise_scale=accum_model.NoiseScale(every=2),
                adascale=AdaScale(4),
            )
        model = _linear_model(adascale=AdaScale(4))
        with self.assertRaisesRegex(ValueError, "`noise_scale.every` must"):
            model.noise_scale = accum_model.NoiseScale(every=3)

    def test_the_measurement_it_turns_on_is_the_models(self):
        # One rule, read in one place: the model says what its engine
        # measures, and its reading means the same before and after
        # training (NaN until a window gave an estimate, not None).
        model = _linear_model(accum_steps=2, adascale=AdaScale(4))
        self.assertEqual(model.noise_scale, accum_model.NoiseScale())
        self.assertTrue(np.isnan(model.gradient_noise_scale))
        x, y = tu.regression_data(8, in_dim=problem.IN_DIM, out_dim=1)
        tu.train(model, x, y, 2, 1, "sgd")
        self.assertEqual(
            model.gradient_accumulator.noise_scale.config, model.noise_scale
        )
        self.assertTrue(np.isfinite(model.gradient_noise_scale))
        # Turned off with AdaScale when it was never set.
        plain = _linear_model(adascale=AdaScale(4))
        plain.adascale = None
        self.assertIsNone(plain.noise_scale)
        self.assertIsNone(plain.gradient_noise_scale)

    def test_model_config_round_trip(self):
        model = _linear_model(accum_steps=4, adascale=AdaScale(base_batch=8))
        config = model.get_config()
        self.assertEqual(config["adascale"], {"base_batch": 8})
        restored = AccumModel.from_config(config)
        self.assertEqual(restored.adascale, AdaScale(8))
        # Before training: no update yet.
        self.assertEqual(restored.adascale_gain, 1.0)
        self.assertEqual(restored.adascale_tau, 0.0)
        self.assertNotIn("adascale", _linear_model().get_config())

    def test_accumulate_sets_and_keeps_it(self):
        model = _plain_linear_model()
        accum_model.accumulate(model, 4, adascale=AdaScale(8))
        self.assertEqual(model.adascale, AdaScale(8))
        accum_model.accumulate(model, 2)  # Unchanged when not given.
        self.assertEqual(model.adascale, AdaScale(8))
        with self.assertRaisesRegex(ValueError, "`noise_scale.every` must"):
            accum_model.accumulate(
                model, 2, noise_scale=accum_model.NoiseScale(every=2)
            )
        self.assertEqual(model.accum_steps, 2)  # Nothing changed.
        # Round trips bring it back (the config holds it as a dict).
        restored = keras.models.model_from_json(model.to_json())
        self.assertEqual(restored.adascale, AdaScale(8))
        clone = keras.models.clone_model(model)
        self.assertEqual(clone.adascale, AdaScale(8))
        accum_model.accumulate(model, 2, adascale=None)
        self.assertIsNone(model.adascale)


class GainTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        # (trace, grad_sq, weight, base_batch)
        ("mid", 30.0, 4.0, 32.0, 8.0),
        ("noise_dominated", 1e6, 1e-3, 32.0, 8.0),
        ("signal_dominated", 1e-3, 1e3, 32.0, 8.0),
        ("smaller_than_base", 30.0, 4.0, 3.0, 8.0),
        ("no_signal", 30.0, -0.5, 32.0, 8.0),
        ("negative_trace", -2.0, 4.0, 32.0, 8.0),
        ("not_measured", float("nan"), float("nan"), 32.0, 8.0),
        ("not_measured_short", float("nan"), float("nan"), 3.0, 8.0),
        ("base", 30.0, 4.0, 8.0, 8.0),
        ("base_not_measured", float("nan"), float("nan"), 8.0, 8.0),
    )
    def test_gain_is_the_rule(self, trace, grad_sq, weight, base_batch):
        r = _adascale.gain(
            tf.constant(trace),
            tf.constant(grad_sq),
            tf.constant(weight),
            base_batch,
        )
        self.assertAllClose(
            r, _gain_by_hand(trace, grad_sq, weight, base_batch), rtol=1e-6
        )

    def test_exactly_one_at_the_base_batch(self):
        for trace, grad_sq in [(30.0, 4.0), (float("nan"),) * 2, (1.0, -1.0)]:
            r = _adascale.gain(
                tf.constant(trace), tf.constant(grad_sq), tf.constant(24.0), 24
            )
            self.assertEqual(float(r), 1.0)

    def test_no_progress_without_weight(self):
        r = _adascale.gain(
            tf.constant(30.0), tf.constant(4.0), tf.constant(0.0), 8
        )
        self.assertEqual(float(r), 0.0)


def _frozen_gains(sizes, base_batch, windows, compile_model):
    """Fits `windows` windows of `sizes` at frozen weights; the gains.

    Returns:
        The model and the gain of each window, in order.
    """
    x, y = problem.data()
    xs, ys, _ = problem.window_data(x, y, sizes, windows)
    model = _linear_model(
        accum_steps=len(sizes),
        noise_scale=accum_model.NoiseScale(beta=0.998),
        adascale=AdaScale(base_batch),
    )
    compile_model(model)
    recorder = _GainRecorder(len(sizes))
    model.fit(
        _micro_batches(xs, ys, sizes),
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return model, recorder.gains


class PopulationGainTest(tf.test.TestCase, parameterized.TestCase):
    """At frozen weights (learning rate 0) the gain is a fixed number."""

    @parameterized.named_parameters(
        ("equal", (4, 4, 4, 4), 4),
        ("unequal", (12, 5, 9, 2, 7), 5),
    )
    def test_gain_is_the_population_gain(self, sizes, base_batch):
        windows = 1200
        model, gains = _frozen_gains(
            sizes,
            base_batch,
            windows,
            lambda m: m.compile(keras.optimizers.SGD(0.0), "mse"),
        )
        self.assertLen(gains, windows)
        expected = _population_gain(base_batch, sum(sizes))
        # beta=0.998 averages about the last 500 windows; the estimate's
        # spread over such a span is a few percent of the gain's distance
        # from 1.
        self.assertAllClose(gains[-1], expected, rtol=0.03)
        self.assertAllClose(np.mean(gains[windows // 2 :]), expected, rtol=0.03)
        # tau counts the gains.
        self.assertAllClose(model.adascale_tau, np.sum(gains), rtol=1e-6)

    def test_each_gain_is_the_rule_on_exact_gradients(self):
        # Window by window, the gain of the smoothed estimates computed here
        # from the exact per-sample gradients.
        sizes, base_batch, beta = (8, 8, 8, 3), 6, 0.9
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        xs, ys, indices = problem.window_data(x, y, sizes, 25)
        g = problem.per_sample_gradients(x, y, kernel, bias)
        traces, grad_sqs = problem.estimate_by_hand(g, indices, sizes)
        expected = []
        ema_s = ema_g = 0.0
        for count, (s, g2) in enumerate(zip(traces, grad_sqs), 1):
            ema_s = beta * ema_s + (1 - beta) * s
            ema_g = beta * ema_g + (1 - beta) * g2
            correction = 1 - beta**count
            expected.append(
                _gain_by_hand(
                    ema_s / correction,
                    ema_g / correction,
                    float(sum(sizes)),
                    base_batch,
                )
            )
        model = _linear_model(
            accum_steps=4,
            noise_scale=accum_model.NoiseScale(beta=beta),
            adascale=AdaScale(base_batch),
        )
        model.compile(keras.optimizers.SGD(learning_rate=0.0), "mse")
        recorder = _GainRecorder(4)
        model.fit(
            _micro_batches(xs, ys, sizes),
            shuffle=False,
            verbose=0,
            callbacks=[recorder],
        )
        self.assertAllClose(recorder.gains, expected, rtol=1e-4)
        self.assertAllClose(recorder.taus, np.cumsum(expected), rtol=1e-4)


def _sgd_by_hand(windows, lr_at, base_batch, momentum, beta):
    """Weights after AdaScale SGD on `windows`, from exact gradients.

    Args:
        windows: List of `(x, y)` of each window (equal micro-batches of
            `len(x) // 2`).
        lr_at: The base learning rate as a function of `tau`.

    Returns:
        `(kernel, bias, tau, gains)` in float64.
    """
    kernel, bias = (w.astype(np.float64) for w in problem.frozen_weights())
    velocity = np.zeros(problem.IN_DIM + 1)
    tau, gains = 0.0, []
    ema_s = ema_g = 0.0
    for count, (wx, wy) in enumerate(windows, 1):
        g = problem.per_sample_gradients(wx, wy, kernel, bias)
        half = len(wx) // 2
        micro = [g[:half].mean(axis=0), g[half:].mean(axis=0)]
        mean = g.mean(axis=0)
        weight = float(len(wx))
        q = sum(half * (m @ m) for m in micro)
        s = q - weight * (mean @ mean)  # n - 1 = 1
        g2 = mean @ mean - s / weight
        ema_s = beta * ema_s + (1 - beta) * s
        ema_g = beta * ema_g + (1 - beta) * g2
        correction = 1 - beta**count
        r = _gain_by_hand(
            ema_s / correction, ema_g / correction, weight, base_batch
        )
        velocity = momentum * velocity - r * lr_at(tau) * mean
        kernel = kernel + velocity[:-1, None]
        bias = bias + velocity[-1:]
        tau += r
        gains.append(r)
    return kernel, bias, tau, gains


class TrainingTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("fixed", False, False),
        ("schedule", True, False),
        ("schedule_xla", True, True),
    )
    def test_updates_follow_the_rule_by_hand(self, schedule, jit_compile):
        # Momentum SGD, windows of two micro-batches of 8 at base batch 4
        # (S = 4); a schedule is read at tau, not at the update count.
        x, y = problem.data(64)
        windows = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
        beta, momentum = 0.5, 0.9
        if schedule:
            lr = keras.optimizers.schedules.ExponentialDecay(0.01, 2.0, 0.5)

            def lr_at(step):
                return 0.01 * 0.5 ** (step / 2.0)
        else:
            lr = 0.01

            def lr_at(step):
                del step
                return 0.01

        kernel, bias, tau, gains = _sgd_by_hand(
            windows, lr_at, 4, momentum, beta
        )
        model = _linear_model(
            accum_steps=2,
            noise_scale=accum_model.NoiseScale(beta=beta),
            adascale=AdaScale(4),
        )
        model.compile(
            keras.optimizers.SGD(lr, momentum=momentum),
            "mse",
            jit_compile=jit_compile,
        )
        history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        self.assertAllClose(model.layers[-1].kernel, kernel, rtol=1e-4)
        self.assertAllClose(model.layers[-1].bias, bias, rtol=1e-4)
        self.assertAllClose(model.adascale_tau, tau, rtol=1e-5)
        self.assertAllClose(model.adascale_gain, gains[-1], rtol=1e-5)
        self.assertAllClose(history.history["adascale_tau"][-1], tau, rtol=1e-5)
        # The rate of the last update: r * lr(tau before it).
        self.assertAllClose(
            history.history["adascale_lr"][-1],
            gains[-1] * lr_at(tau - gains[-1]),
            rtol=1e-5,
        )
        # The gains are not all 1 or S: the test exercises the estimate.
        self.assertTrue(all(1.0 < r < 4.0 for r in gains), gains)

    @parameterized.named_parameters(
        ("sgd", False, False),
        ("momentum", True, False),
        ("nesterov", True, True),
    )
    def test_at_the_base_batch_it_is_plain_training(self, momentum, nesterov):
        # Windows of 2 x 8 = the base batch of 16: S = 1, r = 1 exactly, tau
        # is the update count, and the schedule is read where Keras reads it.
        x, y = problem.data(128)
        x[120:] *= 3.0  # The epoch's last update differs from the others.

        def optimizer():
            lr = keras.optimizers.schedules.ExponentialDecay(0.02, 3, 0.7)
            return keras.optimizers.SGD(
                lr, momentum=0.9 if momentum else 0.0, nesterov=nesterov
            )

        plain = _plain_linear_model()
        plain.compile(optimizer(), "mse")
        plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        off = _linear_model(accum_steps=2)
        on = _linear_model(accum_steps=2, adascale=AdaScale(16))
        for model in (off, on):
            model.compile(optimizer(), "mse")
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(on.get_weights(), off.get_weights()):
            self.assertAllEqual(a, b)
        for a, b in zip(on.get_weights(), plain.get_weights()):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)
        self.assertEqual(on.adascale_gain, 1.0)
        self.assertEqual(on.adascale_tau, 16.0)
        self.assertEqual(int(on.optimizer.iterations), 16)

    def test_off_adds_nothing(self):
        # Every AdaScale function fails if called: off, the step is traced
        # and trained without any of them.
        def fail(*args, **kwargs):
            raise AssertionError("AdaScale code ran while it was off")

        self.enter_context(mock.patch.object(_adascale, "gain", fail))
        self.enter_context(
            mock.patch.object(_adascale.AdaScaleState, "__init__", fail)
        )
        self.enter_context(
            mock.patch.object(_adascale, "check_optimizer", fail)
        )
        self.enter_context(
            mock.patch.object(
                type(_adascale.ADAPTER), "learning_rate_schedule", fail
            )
        )
        x, y = problem.data(32)
        model = _linear_model(accum_steps=2, noise_scale=True)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        history = model.fit(x, y, batch_size=4, verbose=0)
        for key in ("adascale_gain", "adascale_tau", "adascale_lr"):
            self.assertNotIn(key, history.history)
        self.assertIsNone(model.gradient_accumulator.adascale)
        self.assertIsNone(model.adascale_gain)
        self.assertIsNone(model.adascale_tau)

    def test_short_last_micro_batch_counts_what_it_holds(self):
        # 40 samples in micro-batches of 8 with accum_steps=3: a window of
        # 24 (S = 3) and an epoch-end window of 16 (S = 2), at base 8; no
        # measurement is possible before the first window is in, and one
        # window's own estimate then sets the gain.
        x, y = problem.data(40)
        model = _linear_model(
            accum_steps=3,
            noise_scale=accum_model.NoiseScale(beta=0.0),
            adascale=AdaScale(8),
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
        recorder = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                recorder.append(float(logs["adascale_tau"]))

        model.fit(
            x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[Record()]
        )
        g = problem.per_sample_gradients(x, y, *problem.frozen_weights())
        taus = []
        for rows in (np.arange(24), np.arange(24, 40)):
            trace, grad_sq = problem.estimate_by_hand(
                g, rows[None, :], (8,) * (len(rows) // 8)
            )
            taus.append(
                _gain_by_hand(trace[0], grad_sq[0], float(len(rows)), 8)
            )
        self.assertAllClose(recorder[2], taus[0], rtol=1e-4)
        self.assertAllClose(model.adascale_tau, sum(taus), rtol=1e-4)


class MixedPrecisionTest(tf.test.TestCase):
    """Under `mixed_float16`: compile wraps SGD in a `LossScaleOptimizer`."""

    def setUp(self):
        super().setUp()
        tu.use_policy(self, "mixed_float16")

    def _compile(self, model, learning_rate, **kwargs):
        # A scale that never overflows here: a skipped micro-batch leaves a
        # window of less weight, whose gain AdaScale rightly makes smaller.
        model.compile(
            keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.SGD(learning_rate, **kwargs),
                initial_scale=64.0,
            ),
            "mse",
        )

    def test_at_the_base_batch_it_is_training_without_it(self):
        # S = 1: r = 1 exactly, so the loss-scaled run is bit for bit the
        # one without AdaScale.
        x, y = problem.data(128)
        runs = []
        for adascale in (None, AdaScale(16)):
            model = _linear_model(accum_steps=2, adascale=adascale)
            self._compile(model, 0.02, momentum=0.9)
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            self.assertEqual(model.skipped_microbatches, 0)
            runs.append(model)
        off, on = runs
        for a, b in zip(on.get_weights(), off.get_weights()):
            self.assertAllEqual(a, b)
        self.assertEqual(on.adascale_gain, 1.0)
        self.assertEqual(on.adascale_tau, 16.0)

    def test_gain_is_the_population_gain(self):
        # The estimate reads gradients unscaled in float32: the gain is the
        # float32 problem's population gain (float16 inputs round by 1e-3).
        sizes, base_batch, windows = (4, 4, 4, 4), 4, 1200
        model, gains = _frozen_gains(
            sizes, base_batch, windows, lambda m: self._compile(m, 0.0)
        )
        self.assertLen(gains, windows)
        self.assertEqual(model.skipped_microbatches, 0)
        expected = _population_gain(base_batch, sum(sizes))
        self.assertAllClose(np.mean(gains[windows // 2 :]), expected, rtol=0.03)


class CustomLoopTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(("eager", False), ("function", True))
    def test_one_window_by_hand(self, function):
        # Two micro-batches of weight 1 at base batch 1 (S = 2): the first
        # window's own estimate sets the gain.
        g1, g2 = np.array([3.0, -1.0]), np.array([1.0, 2.0])
        mean = (g1 + g2) / 2.0
        trace = g1 @ g1 + g2 @ g2 - 2.0 * (mean @ mean)
        grad_sq = mean @ mean - trace / 2.0
        r = _gain_by_hand(trace, grad_sq, 2.0, 1)
        self.assertBetween(r, 1.0001, 1.9999)
        variable = tf.Variable([0.0, 0.0])
        engine = GradientAccumulator(
            [variable], accum_steps=2, adascale=AdaScale(1)
        )
        optimizer = keras.optimizers.SGD(0.1)
        step = engine.step
        if function:
            step = tf.function(step)
        for g in (g1, g2):
            step([tf.constant(g, tf.float32)], optimizer, weight=1.0)
        self.assertAllClose(variable, -0.1 * r * mean, rtol=1e-5)
        self.assertAllClose(engine.adascale.gain, r, rtol=1e-5)
        self.assertAllClose(engine.adascale.tau, r, rtol=1e-5)
        self.assertAllClose(engine.adascale.learning_rate, 0.1 * r, rtol=1e-5)


class RefusalTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("adam", lambda: keras.optimizers.Adam(0.01), "optimizer=Adam"),
        (
            "loss_scaled_adam",
            lambda: keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.Adam(0.01)
            ),
            "optimizer=Adam",
        ),
        (
            "weight_decay",
            lambda: keras.optimizers.SGD(0.01, weight_decay=1e-4),
            "Received: weight_decay=0.0001",
        ),
        (
            "clipnorm",
            lambda: keras.optimizers.SGD(0.01, clipnorm=1.0),
            "Received: clipnorm=1.0",
        ),
    )
    def test_refused_before_any_state_changes(self, make_optimizer, received):
        x, y = problem.data(32)
        model = _linear_model(accum_steps=2, adascale=AdaScale(8))
        before = model.get_weights()
        optimizer = make_optimizer()
        model.compile(optimizer, "mse")
        with self.assertRaisesRegex(ValueError, re.escape(received)):
            model.fit(x, y, batch_size=4, verbose=0)
        for a, b in zip(model.get_weights(), before):
            self.assertAllEqual(a, b)
        self.assertEqual(int(optimizer.iterations), 0)
        self.assertIsNone(model.gradient_accumulator)

    def test_engine_refuses_in_a_custom_loop(self):
        variable = tf.Variable([1.0, 2.0])
        engine = GradientAccumulator(
            [variable], accum_steps=2, adascale=AdaScale(4)
        )
        with self.assertRaisesRegex(ValueError, "optimizer=Adam"):
            engine.step([tf.ones([2])], keras.optimizers.Adam(0.1), weight=4.0)
        self.assertAllEqual(engine.micro_step, 0)
        self.assertAllEqual(variable, [1.0, 2.0])


class ResumeTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("keras_file", "m.keras"), ("weights_file", "m.weights.h5")
    )
    def test_resume_mid_window_continues_exactly(self, filename):
        x, y = problem.data(96)

        def make():
            model = _linear_model(
                accum_steps=4,
                epoch_end="carry",
                noise_scale=accum_model.NoiseScale(beta=0.5),
                adascale=AdaScale(8),
            )
            model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
            return model

        whole = make()
        whole.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        first = make()
        # 6 micro-batches: one window, and half of the next open.
        first.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0)
        self.assertEqual(int(first.gradient_accumulator.micro_step), 2)
        path = os.path.join(self.get_temp_dir(), filename)
        if filename.endswith(".keras"):
            first.save(path)
            resumed = keras.models.load_model(path)
        else:
            first.save_weights(path)
            resumed = make()
            # The optimizer's momentum is in the file too.
            resumed.optimizer.build(resumed.trainable_variables)
            resumed.load_weights(path)
        self.assertEqual(resumed.adascale_tau, first.adascale_tau)
        resumed.fit(x[48:], y[48:], batch_size=8, shuffle=False, verbose=0)
        for a, b in zip(resumed.get_weights(), whole.get_weights()):
            self.assertAllClose(a, b, rtol=1e-6, atol=1e-7)
        self.assertAllClose(resumed.adascale_tau, whole.adascale_tau, 1e-6)
        self.assertGreater(whole.adascale_tau, 3.0)  # 3 windows, r > 1


if __name__ == "__main__":
    tf.test.main()
