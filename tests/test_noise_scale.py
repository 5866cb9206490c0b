"""The noise-scale estimator, against exact per-sample gradients."""

import itertools
import os

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import GradientAccumulator
from accum_model.engine import _noise_scale
from accum_model.keras._adapter import keras
from tests import noise_scale_problem as problem
from tests import testing_utils as tu

# Windows of micro-batch sizes; the estimator must not need them equal.
SIZES = {
    "equal": (4, 4, 4, 4),
    "short_last": (8, 8, 8, 3),
    "mixed": (12, 5, 9, 2, 7),
    "two": (6, 6),
}


def _run_if(pred, fn):
    def branch():
        fn()
        return tf.constant(True)

    tf.cond(pred, branch, lambda: tf.constant(False))


class NoiseScaleConfigTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.parameters(0, -1, 1.5, True, "2", None)
    def test_every_must_be_an_integer_of_at_least_one(self, every):
        with self.assertRaisesRegex(ValueError, "`every` must be"):
            _noise_scale.NoiseScale(every=every)

    @parameterized.parameters(1.0, -0.1, 2, "0.9", None, True)
    def test_beta_must_be_in_unit_interval(self, beta):
        with self.assertRaisesRegex(ValueError, "`beta` must be"):
            _noise_scale.NoiseScale(beta=beta)

    def test_as_config(self):
        self.assertIsNone(_noise_scale.as_config(False))
        self.assertIsNone(_noise_scale.as_config(None))
        self.assertEqual(
            _noise_scale.as_config(True), _noise_scale.NoiseScale()
        )
        self.assertEqual(
            _noise_scale.as_config({"every": 3, "beta": 0.5}),
            _noise_scale.NoiseScale(every=3, beta=0.5),
        )
        with self.assertRaisesRegex(TypeError, "`noise_scale` must be"):
            _noise_scale.as_config("yes")


class SquaredNormTest(tf.test.TestCase):
    def test_dense_and_none(self):
        a = np.arange(6, dtype="float32").reshape(2, 3)
        b = np.array([1.5, -2.0], "float32")
        norm = _noise_scale.squared_norm([a, None, b])
        self.assertAllClose(norm, (a**2).sum() + (b**2).sum())

    def test_indexed_slices_sum_repeated_rows_before_squaring(self):
        # Rows 1 and 3 appear twice: the dense gradient holds their sums.
        values = np.array(
            [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [-1.0, 4.0], [2.0, 2.0]],
            "float32",
        )
        indices = np.array([1, 3, 1, 0, 3])
        slices = tf.IndexedSlices(
            tf.constant(values), tf.constant(indices), tf.constant([5, 2])
        )
        dense = np.zeros((5, 2), "float32")
        np.add.at(dense, indices, values)
        self.assertAllClose(
            _noise_scale.squared_norm([slices]), (dense**2).sum()
        )
        # Squaring rows before summing them would give another number.
        self.assertNotAllClose((values**2).sum(), (dense**2).sum())

    def test_half_precision_is_squared_in_float32(self):
        # 300^2 overflows float16 (max 65504), not float32.
        g = tf.constant([300.0, 300.0], tf.float16)
        self.assertAllClose(_noise_scale.squared_norm([g]), 180000.0)


class WindowEstimateTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        (name, sizes) for name, sizes in SIZES.items()
    )
    def test_mean_over_windows_is_the_population_value(self, sizes):
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        grad_sq, trace, b_simple = problem.population(x, y, kernel, bias)
        g = problem.per_sample_gradients(x, y, kernel, bias)
        windows = 4000
        indices = problem.window_indices(sizes, windows, len(x))
        q, n, weight, norm = problem.window_sums(g, indices, sizes)
        s_hat, g2_hat, valid = _noise_scale.window_estimate(
            tf.constant(q, tf.float32),
            tf.constant(float(n)),
            tf.constant(weight),
            tf.constant(norm, tf.float32),
        )
        self.assertEqual(float(valid), 1.0)
        # Standard errors of these means are about 1% (measured on this
        # problem); a biased estimator (e.g. the nominal size 8 for the
        # short micro-batch of 3) misses by 30% or more.
        s_mean = float(np.mean(s_hat))
        g2_mean = float(np.mean(g2_hat))
        self.assertAllClose(s_mean, trace, rtol=0.05)
        self.assertAllClose(g2_mean, grad_sq, rtol=0.05)
        self.assertAllClose(s_mean / g2_mean, b_simple, rtol=0.06)

    def test_one_micro_batch_gives_no_estimate(self):
        s, g2, valid = _noise_scale.window_estimate(
            tf.constant([5.0, 5.0]),
            tf.constant([1.0, 2.0]),
            tf.constant([4.0, 0.0]),
            tf.constant([16.0, 0.0]),
        )
        self.assertAllEqual(valid, [0.0, 0.0])
        self.assertAllEqual(s, [0.0, 0.0])
        self.assertAllEqual(g2, [0.0, 0.0])

    def test_combine_averages_replicas_with_an_estimate(self):
        # Replica 0: (S, G2) = (10, 2); replica 1: (14, 4); replica 2: none.
        summed = tf.constant([24.0, 6.0, 2.0, 9.0])
        s, g2, valid, n = _noise_scale.combine_statistics(summed)
        self.assertAllClose([s, g2, n], [12.0, 3.0, 9.0])
        self.assertTrue(bool(valid))
        _, _, valid, _ = _noise_scale.combine_statistics(tf.zeros([4]))
        self.assertFalse(bool(valid))


def _end_window(estimator, closed):
    """What the accumulator does to the estimator when a window ends."""
    for v in estimator.window_variables:
        v.assign(tf.zeros_like(v))
    if closed:
        estimator.count_closed_window()


class EstimatorTest(tf.test.TestCase, parameterized.TestCase):
    """The stateful estimator, fed as the engine feeds it."""

    def _feed(self, estimator, windows):
        @tf.function
        def one_window(hs, weights):
            accumulators = [tf.zeros([hs.shape[1]])]
            for k in range(hs.shape[0]):
                # What the accumulator hands over: `w_k g_k`.
                h = hs[k]
                estimator.add([h], weights[k], _run_if)
                accumulators = [accumulators[0] + h]
            weight = tf.reduce_sum(weights)
            stats = estimator.statistics(accumulators, weight)
            estimator.update(stats, weight)
            _end_window(estimator, closed=True)

        for hs, weights in windows:
            one_window(
                tf.constant(hs, tf.float32), tf.constant(weights, tf.float32)
            )

    def _windows(self, sizes, count, seed=0):
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        g = problem.per_sample_gradients(x, y, kernel, bias)
        indices = problem.window_indices(sizes, count, len(x), seed=seed)
        bounds = np.cumsum((0,) + tuple(sizes))
        out = []
        for row in indices:
            hs = np.stack(
                [g[row[a:b]].sum(axis=0) for a, b in itertools.pairwise(bounds)]
            )
            out.append((hs, np.array(sizes, np.float64)))
        return out

    def _by_hand(self, windows, beta, every=1):
        """The smoothed estimates, computed here from the formula."""
        ema_s = ema_g = 0.0
        count = 0
        for i, (hs, weights) in enumerate(windows):
            if i % every:
                continue
            weight = weights.sum()
            q = ((hs**2).sum(axis=1) / weights).sum()
            a = (hs.sum(axis=0) ** 2).sum()
            s = (q - a / weight) / (len(weights) - 1)
            g2 = a / weight**2 - s / weight
            ema_s = beta * ema_s + (1 - beta) * s
            ema_g = beta * ema_g + (1 - beta) * g2
            count += 1
        correction = 1 - beta**count
        return ema_s / correction, ema_g / correction, count

    @parameterized.named_parameters(
        ("every_window", 1),
        ("every_third", 3),
    )
    def test_moving_averages_follow_the_formula(self, every):
        beta = 0.8
        estimator = _noise_scale.NoiseScaleEstimator(
            _noise_scale.NoiseScale(every=every, beta=beta)
        )
        windows = self._windows(SIZES["short_last"], 7)
        self._feed(estimator, windows)
        s, g2, count = self._by_hand(windows, beta, every)
        self.assertEqual(estimator.measurements, count)
        self.assertAllClose(estimator.trace_sigma, s, rtol=1e-4)
        self.assertAllClose(estimator.grad_sq_norm, g2, rtol=1e-4)
        self.assertAllClose(estimator.b_simple, s / g2, rtol=1e-4)
        # Windows of 8 + 8 + 8 + 3 samples, on one replica.
        self.assertAllClose(estimator.micro_batch_weight, 27.0 / 4)
        self.assertAllClose(estimator.window_weight, 27.0)

    def test_smoothed_ratio_is_near_the_population_b_simple(self):
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        _, _, b_simple = problem.population(x, y, kernel, bias)
        estimator = _noise_scale.NoiseScaleEstimator(
            _noise_scale.NoiseScale(beta=0.998)
        )
        self._feed(estimator, self._windows(SIZES["mixed"], 1500))
        self.assertAllClose(estimator.b_simple, b_simple, rtol=0.08)

    def test_nan_before_a_measurement_and_inf_without_signal(self):
        estimator = _noise_scale.NoiseScaleEstimator(_noise_scale.NoiseScale())
        self.assertTrue(np.isnan(estimator.b_simple.numpy()))
        self.assertTrue(np.isnan(estimator.trace_sigma.numpy()))
        # Two micro-batches with opposite gradients: |G_w|^2 = 0, so the
        # window's |G|^2 estimate is negative.
        self._feed(
            estimator,
            [(np.array([[1.0, 0.0], [-1.0, 0.0]]), np.array([1.0, 1.0]))],
        )
        self.assertLess(float(estimator.grad_sq_norm), 0.0)
        self.assertEqual(float(estimator.b_simple), float("inf"))

    def test_a_discarded_window_is_not_counted(self):
        estimator = _noise_scale.NoiseScaleEstimator(
            _noise_scale.NoiseScale(every=2)
        )
        estimator.add([tf.ones([2])], 1.0, _run_if)
        _end_window(estimator, closed=False)
        self.assertAllEqual(estimator.measuring(), True)
        self.assertEqual(float(estimator.state_variables[0]), 0.0)
        _end_window(estimator, closed=True)
        self.assertAllEqual(estimator.measuring(), False)


# Through the engine: AccumModel.fit and GradientAccumulator, at frozen
# weights (SGD with learning rate 0), against the exact population values.


class _WindowRecorder(keras.callbacks.Callback):
    """Each window's raw estimates, read after every update."""

    def __init__(self):
        super().__init__()
        self.trace, self.grad_sq = [], []
        self._last = 0

    def on_train_batch_end(self, batch, logs=None):
        estimator = self.model.gradient_accumulator.noise_scale
        if estimator.measurements != self._last:
            self._last = estimator.measurements
            self.trace.append(float(estimator.last_trace_sigma))
            self.grad_sq.append(float(estimator.last_grad_sq_norm))


def _linear_model(**kwargs):
    kernel, bias = problem.frozen_weights()
    inputs = keras.Input((problem.IN_DIM,))
    outputs = keras.layers.Dense(1)(inputs)
    model = AccumModel(inputs=inputs, outputs=outputs, **kwargs)
    model.set_weights([kernel, bias])
    return model


def _frozen_fit(model, x, y, micro, callbacks=(), **fit_kwargs):
    model.compile(keras.optimizers.SGD(learning_rate=0.0), "mse")
    return model.fit(
        x,
        y,
        batch_size=micro,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
        **fit_kwargs,
    )


class AccumModelNoiseScaleTest(tf.test.TestCase, parameterized.TestCase):
    def _assert_population(self, trace, grad_sq, rtol=0.05):
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        true_grad_sq, true_trace, b_simple = problem.population(
            x, y, kernel, bias
        )
        self.assertAllClose(np.mean(trace), true_trace, rtol=rtol)
        self.assertAllClose(np.mean(grad_sq), true_grad_sq, rtol=rtol)
        self.assertAllClose(
            np.mean(trace) / np.mean(grad_sq), b_simple, rtol=rtol + 0.01
        )

    def test_fit_at_frozen_weights_measures_the_population(self):
        sizes = (4, 4, 4, 4)
        x, y = problem.data()
        xs, ys, _ = problem.window_data(x, y, sizes, 1500)
        model = _linear_model(
            accum_steps=4, noise_scale=accum_model.NoiseScale(beta=0.999)
        )
        recorder = _WindowRecorder()
        history = _frozen_fit(model, xs, ys, 4, [recorder])
        self.assertLen(recorder.trace, 1500)
        self._assert_population(recorder.trace, recorder.grad_sq)
        # What fit logs is the ratio of the moving averages.
        estimator = model.gradient_accumulator.noise_scale
        self.assertAllClose(
            history.history["gradient_noise_scale"][-1],
            float(estimator.trace_sigma) / float(estimator.grad_sq_norm),
            rtol=1e-5,
        )
        self.assertAllClose(
            model.gradient_noise_scale,
            history.history["gradient_noise_scale"][-1],
            rtol=1e-6,
        )
        _, _, b_simple = problem.population(x, y, *problem.frozen_weights())
        # beta=0.999 averages about the last 1000 windows.
        self.assertAllClose(model.gradient_noise_scale, b_simple, rtol=0.1)
        self.assertAllClose(estimator.micro_batch_weight, 4.0)

    @parameterized.named_parameters(
        ("graph", False, 1), ("xla", True, 1), ("xla_every_2", True, 2)
    )
    def test_each_window_is_the_formula_on_exact_gradients(self, xla, every):
        # Window by window (not only on average), equal to the estimate
        # computed here from the exact per-sample gradients.
        sizes = (4, 4, 4)
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        xs, ys, indices = problem.window_data(x, y, sizes, 20)
        g = problem.per_sample_gradients(x, y, kernel, bias)
        trace, grad_sq = problem.estimate_by_hand(g, indices, sizes)
        model = _linear_model(
            accum_steps=3,
            noise_scale=accum_model.NoiseScale(every=every),
        )
        recorder = _WindowRecorder()
        model.compile(
            keras.optimizers.SGD(learning_rate=0.0), "mse", jit_compile=xla
        )
        model.fit(
            xs, ys, batch_size=4, shuffle=False, verbose=0, callbacks=[recorder]
        )
        trace, grad_sq = trace[::every], grad_sq[::every]
        scale = np.abs(trace).max()
        self.assertAllClose(recorder.trace, trace, atol=1e-4 * scale)
        self.assertAllClose(recorder.grad_sq, grad_sq, atol=1e-4 * scale)

    def test_one_micro_batch_per_window_gives_no_estimate(self):
        x, y = problem.data(64)
        model = _linear_model(accum_steps=1, noise_scale=True)
        history = _frozen_fit(model, x, y, 8)
        self.assertEqual(model.gradient_accumulator.noise_scale.measurements, 0)
        self.assertTrue(np.isnan(history.history["gradient_noise_scale"][0]))
        self.assertTrue(np.isnan(model.gradient_noise_scale))

    def test_every_kth_window(self):
        x, y = problem.data(96)
        model = _linear_model(
            accum_steps=2, noise_scale=accum_model.NoiseScale(every=3)
        )
        _frozen_fit(model, x, y, 4)  # 12 windows: 0, 3, 6, 9 measured
        self.assertEqual(model.gradient_accumulator.noise_scale.measurements, 4)

    def test_off_by_default(self):
        x, y = problem.data(32)
        model = _linear_model(accum_steps=2)
        history = _frozen_fit(model, x, y, 4)
        self.assertNotIn("gradient_noise_scale", history.history)
        self.assertIsNone(model.gradient_noise_scale)
        self.assertIsNone(model.gradient_accumulator.noise_scale)

    def test_config_round_trip_and_late_change(self):
        model = _linear_model(
            accum_steps=2, noise_scale=accum_model.NoiseScale(every=2)
        )
        config = model.get_config()
        self.assertEqual(config["noise_scale"], {"every": 2, "beta": 0.99})
        restored = AccumModel.from_config(config)
        self.assertEqual(restored.noise_scale, accum_model.NoiseScale(every=2))
        self.assertNotIn("noise_scale", _linear_model().get_config())
        x, y = problem.data(16)
        _frozen_fit(model, x, y, 4)
        with self.assertRaisesRegex(ValueError, "before the model is trained"):
            model.noise_scale = False
        with self.assertRaisesRegex(TypeError, "`noise_scale` must be"):
            _linear_model(noise_scale="on")

    def test_saved_with_the_window(self):
        x, y = problem.data(40)
        model = _linear_model(
            accum_steps=4, noise_scale=True, epoch_end="carry"
        )
        _frozen_fit(model, x, y, 4)  # 2 windows and 2 micro-batches open
        path = os.path.join(self.get_temp_dir(), "m.weights.h5")
        model.save_weights(path)
        restored = _linear_model(
            accum_steps=4, noise_scale=True, epoch_end="carry"
        )
        restored.compile(keras.optimizers.SGD(0.0), "mse")
        restored.load_weights(path)
        before = model.gradient_accumulator.noise_scale
        after = restored.gradient_accumulator.noise_scale
        for a, b in zip(before.state_variables, after.state_variables):
            self.assertAllEqual(a, b)
        self.assertGreater(float(before.state_variables[0]), 0.0)

    def test_in_every_batch_log(self):
        # The batch logs are what the progress bar prints and what Keras'
        # TensorBoard callback writes (with `update_freq="batch"`).
        seen = []

        class Logs(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append(logs["gradient_noise_scale"])

        x, y = problem.data(32)
        model = _linear_model(accum_steps=2, noise_scale=True)
        _frozen_fit(model, x, y, 4, [Logs()])
        self.assertLen(seen, 8)
        self.assertTrue(np.isnan(seen[0]))  # before the first window closed
        self.assertAllClose(seen[-1], model.gradient_noise_scale)


class MixedFloat16NoiseScaleTest(tf.test.TestCase):
    def setUp(self):
        super().setUp()
        tu.use_policy(self, "mixed_float16")

    def test_skipped_micro_batches_are_left_out(self):
        sizes = (4, 4, 4, 4)
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        xs, ys, indices = problem.window_data(x, y, sizes, 6)
        # Beyond float16's range: window 2's micro-batch 1 overflows, and
        # is left out of the window (3 micro-batches of 4 remain).
        xs[2 * 16 + 4] = 1e6
        model = _linear_model(accum_steps=4, noise_scale=True)
        model.compile(
            keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.SGD(0.0), initial_scale=256.0
            ),
            "mse",
        )
        recorder = _WindowRecorder()
        model.fit(
            xs, ys, batch_size=4, shuffle=False, verbose=0, callbacks=[recorder]
        )
        self.assertEqual(model.skipped_microbatches, 1)
        g = problem.per_sample_gradients(x, y, kernel, bias)
        trace, grad_sq = problem.estimate_by_hand(g, indices, sizes)
        kept = np.delete(indices[2], np.arange(4, 8))[None]
        trace[2], grad_sq[2] = (
            v[0] for v in problem.estimate_by_hand(g, kept, (4, 4, 4))
        )
        # float16 forward and backward passes: about 1e-3 of the scale.
        scale = np.abs(trace).max()
        self.assertAllClose(recorder.trace, trace, atol=2e-2 * scale)
        self.assertAllClose(recorder.grad_sq, grad_sq, atol=2e-2 * scale)


class OffAddsNothingTest(tf.test.TestCase, parameterized.TestCase):
    """With the measurement off, tracing the step runs none of its code."""

    def _poisoned(self):
        def poison(*args, **kwargs):
            raise AssertionError("noise-scale code traced")

        patches = [
            (_noise_scale, "squared_norm"),
            (_noise_scale, "window_estimate"),
            (_noise_scale, "combine_statistics"),
            (_noise_scale.NoiseScaleEstimator, "add"),
            (_noise_scale.NoiseScaleEstimator, "statistics"),
            (_noise_scale.NoiseScaleEstimator, "update"),
            (_noise_scale.NoiseScaleEstimator, "count_closed_window"),
        ]
        originals = [
            (owner, name, getattr(owner, name)) for owner, name in patches
        ]
        for owner, name in patches:
            setattr(owner, name, poison)

        def restore():
            for owner, name, value in originals:
                setattr(owner, name, value)

        self.addCleanup(restore)

    def _trace(self, noise_scale, mixed):
        model = _linear_model(accum_steps=2, noise_scale=noise_scale)
        optimizer = keras.optimizers.SGD(0.1)
        if mixed:
            optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
        model.compile(optimizer, "mse")
        x, y = problem.data(8)
        model.fit(x, y, batch_size=4, verbose=0)  # builds everything
        self._poisoned()
        step = tf.function(model.train_step)
        return step.get_concrete_function(
            (tf.TensorSpec([None, problem.IN_DIM]), tf.TensorSpec([None, 1]))
        )

    @parameterized.named_parameters(("float32", False), ("loss_scale", True))
    def test_off_traces_none_of_it(self, mixed):
        self._trace(False, mixed)
        with self.assertRaisesRegex(AssertionError, "noise-scale code"):
            self._trace(True, mixed)

    def test_custom_loop_off_traces_none_of_it(self):
        self._poisoned()
        variables = [tf.Variable(tf.ones([3]))]
        accumulator = GradientAccumulator(variables, accum_steps=2)
        optimizer = keras.optimizers.SGD(0.1)

        @tf.function
        def step():
            return accumulator.step([tf.ones([3])], optimizer, weight=2.0)

        step.get_concrete_function()
        accumulator.reset()
        on = GradientAccumulator(variables, accum_steps=2, noise_scale=True)

        @tf.function
        def step_on():
            return on.step([tf.ones([3])], optimizer, weight=2.0)

        with self.assertRaisesRegex(AssertionError, "noise-scale code"):
            step_on.get_concrete_function()


class GradientAccumulatorNoiseScaleTest(
    tf.test.TestCase, parameterized.TestCase
):
    def _loop(self, sizes, windows, sparse=False):
        x, y = problem.data()
        kernel, bias = problem.frozen_weights()
        kernel_var = tf.Variable(kernel)
        bias_var = tf.Variable(bias)
        variables = [kernel_var, bias_var]
        accumulator = GradientAccumulator(
            variables, accum_steps=len(sizes), noise_scale=True
        )
        optimizer = keras.optimizers.SGD(learning_rate=0.0)

        @tf.function(reduce_retracing=True)
        def step(xb, yb):
            with tf.GradientTape() as tape:
                pred = xb @ kernel_var + bias_var
                loss = tf.reduce_mean(tf.square(pred - yb))
            grads = tape.gradient(loss, variables)
            if sparse:
                # The kernel's gradient as rows, every row listed twice
                # with half its value: summed first, it is the same tensor.
                rows = tf.range(problem.IN_DIM)
                half = grads[0] / 2.0
                grads[0] = tf.IndexedSlices(
                    tf.concat([half, half], 0),
                    tf.concat([rows, rows], 0),
                    tf.constant([problem.IN_DIM, 1]),
                )
            return accumulator.step(grads, optimizer, weight=tf.shape(xb)[0])

        xs, ys, indices = problem.window_data(x, y, sizes, windows)
        bounds = np.cumsum((0,) + tuple(sizes))
        trace, grad_sq = [], []
        for w in range(windows):
            base = w * sum(sizes)
            for start, stop in itertools.pairwise(bounds):
                step(
                    xs[base + start : base + stop],
                    ys[base + start : base + stop],
                )
            trace.append(float(accumulator.noise_scale.last_trace_sigma))
            grad_sq.append(float(accumulator.noise_scale.last_grad_sq_norm))
        g = problem.per_sample_gradients(x, y, kernel, bias)
        return np.array(trace), np.array(grad_sq), g, indices

    @parameterized.named_parameters(
        ("short_last", (8, 8, 8, 3)), ("mixed", (12, 5, 9, 2, 7))
    )
    def test_unequal_micro_batches_measure_the_population(self, sizes):
        trace, grad_sq, g, _ = self._loop(sizes, 1200)
        mean = g.mean(axis=0)
        true_trace = ((g - mean) ** 2).sum(axis=1).mean()
        self.assertAllClose(trace.mean(), true_trace, rtol=0.06)
        self.assertAllClose(grad_sq.mean(), mean @ mean, rtol=0.06)

    def test_sparse_gradients_with_repeated_rows(self):
        sizes = (5, 3, 4)
        trace, grad_sq, g, indices = self._loop(sizes, 5, sparse=True)
        expected_trace, expected_grad_sq = problem.estimate_by_hand(
            g, indices, sizes
        )
        scale = np.abs(expected_trace).max()
        self.assertAllClose(trace, expected_trace, atol=1e-4 * scale)
        self.assertAllClose(grad_sq, expected_grad_sq, atol=1e-4 * scale)


if __name__ == "__main__":
    tf.test.main()
