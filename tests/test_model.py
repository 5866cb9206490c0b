"""AccumModel against plain large-batch Keras training."""

import os
import re
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model.keras._adapter import ADAPTER
from accum_model.keras._adapter import keras
from accum_model.model import _epoch_end
from tests import testing_utils as tu

# (dataset size, micro-batch, accum_steps): divisible, short last micro-batch,
# short last window, and a window that never fills within the epoch.
_SHAPES = (
    ("even", 16, 2, 4),
    ("short_micro", 22, 4, 2),
    ("short_window", 22, 2, 4),
    ("epoch_shorter_than_window", 6, 2, 4),
)


def _reference_and_accum(
    n,
    micro,
    steps,
    optimizer,
    epochs=2,
    seed=0,
    data=tu.regression_data,
    loss="mse",
    **fit_kwargs,
):
    """Per-update weights of plain fit at micro*steps and AccumModel."""
    x, y = data(n, seed=seed)
    reference = tu.mlp(keras.Model, seed=seed)
    model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=steps))
    ref_hist, expected = tu.train(
        reference, x, y, micro * steps, epochs, optimizer, loss, **fit_kwargs
    )
    hist, actual = tu.train(
        model, x, y, micro, epochs, optimizer, loss, **fit_kwargs
    )
    return (ref_hist, expected), (hist, actual), model


def _probability_loss_sgd_float64(
    weights, x, y, sample_weight, batch_size, epochs, learning_rate
):
    """`tu.mlp`'s SGD trajectory in float64, by hand, at `batch_size`.

    The loss is Keras' `sparse_categorical_crossentropy` on the linear
    outputs read as probabilities (clipped to `[eps, 1 - eps]`, then the
    cross-entropy of their normalized logs), weighted per sample and summed
    over the batch size, as `fit` reduces it. Returns the weights after
    every update.
    """
    eps = keras.backend.epsilon()
    weights = [tf.Variable(w.astype(np.float64)) for w in weights]
    trajectory = []
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            end = start + batch_size
            xb = tf.constant(x[start:end], tf.float64)
            wb = tf.constant(sample_weight[start:end], tf.float64)
            with tf.GradientTape() as tape:
                kernel, bias, out_kernel, out_bias = weights
                outputs = tf.tanh(xb @ kernel + bias) @ out_kernel + out_bias
                per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(
                    y[start:end],
                    tf.math.log(tf.clip_by_value(outputs, eps, 1 - eps)),
                )
                loss = tf.reduce_sum(per_sample * wb) / len(per_sample)
            grads = tape.gradient(loss, weights)
            for w, g in zip(weights, grads):
                w.assign_sub(learning_rate * g)
            trajectory.append([w.numpy() for w in weights])
    return trajectory


class DenseNet(AccumModel):
    """A subclassed `AccumModel` with one Dense layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


class EquivalenceTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        (f"{opt}_{name}", opt, n, micro, steps)
        for opt in tu.OPTIMIZERS
        for name, n, micro, steps in _SHAPES
    )
    def test_weights_equal_large_batch_after_every_update(
        self, optimizer, n, micro, steps
    ):
        (_, expected), (_, actual), model = _reference_and_accum(
            n, micro, steps, optimizer
        )
        tu.assert_same_trajectory(self, expected, actual)
        self.assertEqual(int(model.optimizer.iterations), len(expected))

    def test_accum_steps_one_is_plain_training(self):
        (_, expected), (_, actual), _ = _reference_and_accum(22, 4, 1, "adam")
        tu.assert_same_trajectory(self, expected, actual, atol=1e-6)

    @parameterized.named_parameters(
        ("short_micro", 22, 4, 2), ("short_window", 22, 2, 4)
    )
    def test_canary_divide_by_n_and_builtin_differ_where_we_are_exact(
        self, n, micro, steps
    ):
        # Canary: checks Keras' built-in option, not this package; it
        # fails when Keras changes what the docs compare with.
        # The same data through Keras' built-in option (mean of micro-batch
        # means, window carried across epochs) leaves the large batch; the
        # exact test above would catch that implementation.
        if not tu.HAS_BUILTIN_ACCUMULATION:
            self.skipTest("tf_keras has no built-in accumulation")
        x, y = tu.regression_data(n)
        reference = tu.mlp(keras.Model)
        builtin = tu.copy_weights(reference, tu.mlp(keras.Model))
        _, expected = tu.train(reference, x, y, micro * steps, 2, "sgd")
        _, got = tu.train(
            builtin,
            x,
            y,
            micro,
            2,
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps),
        )
        self.assertGreater(
            tu.max_abs_diff(expected[-1], got[-1] if got else []), 1e-3
        )

    @parameterized.named_parameters(("sgd", "sgd"), ("adam", "adam"))
    def test_sample_weight_and_class_weight(self, optimizer):
        x, y = tu.classification_data(22)
        sw = np.linspace(0.1, 2.0, len(x)).astype("float32")
        for fit_kwargs in (
            {"sample_weight": sw},
            {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}},
        ):
            reference = tu.mlp(keras.Model)
            model = tu.copy_weights(
                reference, tu.mlp(AccumModel, accum_steps=4)
            )
            # The MLP's head is linear: logits. (Read as probabilities, they
            # would be clipped at epsilon; see the ill-conditioned test.)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            _, expected = tu.train(
                reference, x, y, 8, 2, optimizer, loss, **fit_kwargs
            )
            _, actual = tu.train(
                model, x, y, 2, 2, optimizer, loss, **fit_kwargs
            )
            tu.assert_same_trajectory(self, expected, actual)

    # Linear outputs read as probabilities: clipped to [eps, 1 - eps], then
    # logged, so a target output a little above eps has a gradient of about
    # 1 / output. That multiplies the rounding of every sum in the step: in
    # float32, Keras' own large batch ends about 1e-4 from the exact
    # trajectory, and by a different amount for each order of the same
    # samples in a batch. These two tests say that AccumModel's distance
    # there is that rounding: in float64 it vanishes, and in float32 it is
    # within the spread of Keras' large batch over sample orders.

    def _ill_conditioned_run(self, cls, x, y, sw, batch_size, **kwargs):
        model = tu.mlp(cls, **kwargs)
        model.set_weights(tu.mlp(keras.Model).get_weights())
        _, trajectory = tu.train(
            model,
            x,
            y,
            batch_size,
            2,
            "sgd",
            "sparse_categorical_crossentropy",
            sample_weight=sw,
        )
        return trajectory

    def _exact_ill_conditioned(self, x, y, sw):
        return _probability_loss_sgd_float64(
            tu.mlp(keras.Model).get_weights(),
            x,
            y,
            sw,
            batch_size=8,
            epochs=2,
            learning_rate=0.1,
        )

    def test_ill_conditioned_loss_in_float64_is_exact(self):
        # Keras 3 keeps a global dtype policy made from floatx when first
        # read: both are set.
        keras.backend.set_floatx("float64")
        self.addCleanup(keras.backend.set_floatx, "float32")
        tu.use_policy(self, "float64")
        x, y = tu.classification_data(22)
        x = x.astype("float64")
        sw = np.linspace(0.1, 2.0, len(x))
        exact = self._exact_ill_conditioned(x, y, sw)
        actual = self._ill_conditioned_run(
            AccumModel, x, y, sw, 2, accum_steps=4
        )
        self.assertEqual(len(exact), len(actual))
        # Four orders of magnitude below the float32 distance, where a
        # weighting error (1/N per micro-batch, a lost sample) is >= 1e-3.
        self.assertLess(tu.trajectory_diff(exact, actual), 1e-6)

    def test_ill_conditioned_loss_in_float32_is_within_keras_rounding(self):
        x, y = tu.classification_data(22)
        sw = np.linspace(0.1, 2.0, len(x)).astype("float32")
        exact = self._exact_ill_conditioned(x, y, sw)
        actual = self._ill_conditioned_run(
            AccumModel, x, y, sw, 2, accum_steps=4
        )
        self.assertEqual(len(exact), len(actual))
        # Keras' large batch, the same samples in each batch in other
        # orders: the same exact trajectory, other float32 roundings.
        rng = np.random.default_rng(0)
        keras_errors = []
        for _ in range(4):
            order = np.concatenate(
                [
                    s + rng.permutation(len(x[s : s + 8]))
                    for s in range(0, 22, 8)
                ]
            )
            large = self._ill_conditioned_run(
                keras.Model, x[order], y[order], sw[order], 8
            )
            keras_errors.append(tu.trajectory_diff(exact, large))
        accum_error = tu.trajectory_diff(exact, actual)
        # The float32 distance is rounding, far below a weighting error.
        self.assertLess(max(keras_errors), 1e-3)
        self.assertLessEqual(
            accum_error,
            2 * max(keras_errors),
            f"AccumModel is {accum_error:.2e} from the exact trajectory, "
            f"Keras' large batch {min(keras_errors):.2e} to "
            f"{max(keras_errors):.2e} over sample orders",
        )

    def test_dict_inputs_and_multi_output_with_loss_weights(self):
        def build(cls, **kwargs):
            keras.utils.set_random_seed(1)
            a = keras.Input((3,), name="a")
            b = keras.Input((2,), name="b")
            h = keras.layers.Dense(4, activation="relu")(
                keras.layers.Concatenate()([a, b])
            )
            reg = keras.layers.Dense(1, name="reg")(h)
            cls_out = keras.layers.Dense(3, name="cls")(h)
            return cls(
                inputs={"a": a, "b": b},
                outputs={"reg": reg, "cls": cls_out},
                **kwargs,
            )

        rng = np.random.default_rng(0)
        n = 21
        x = {
            "a": rng.normal(size=(n, 3)).astype("float32"),
            "b": rng.normal(size=(n, 2)).astype("float32"),
        }
        y = {
            "reg": rng.normal(size=(n, 1)).astype("float32"),
            "cls": rng.integers(0, 3, size=(n,)).astype("int32"),
        }
        loss = {
            "reg": "mse",
            "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        }
        compile_kwargs = {"loss_weights": {"reg": 0.3, "cls": 2.0}}
        reference = build(keras.Model)
        model = tu.copy_weights(reference, build(AccumModel, accum_steps=3))
        _, expected = tu.train(
            reference, x, y, 6, 2, "adam", loss, compile_kwargs
        )
        _, actual = tu.train(model, x, y, 2, 2, "adam", loss, compile_kwargs)
        tu.assert_same_trajectory(self, expected, actual)

    @parameterized.named_parameters(
        ("with_compiled_loss", "mse"), ("loss_none", None)
    )
    def test_add_loss(self, loss):
        class ActivityPenalty(keras.layers.Layer):
            def call(self, h):
                # A per-sample mean, so the large batch is exact.
                self.add_loss(0.1 * tf.reduce_mean(tf.square(h)))
                return h

        def build(cls, **kwargs):
            keras.utils.set_random_seed(2)
            inputs = keras.Input((4,))
            h = ActivityPenalty()(keras.layers.Dense(5)(inputs))
            outputs = keras.layers.Dense(
                3, kernel_regularizer=keras.regularizers.L2(0.01)
            )(h)
            return cls(inputs=inputs, outputs=outputs, **kwargs)

        x, y = tu.regression_data(22)
        reference = build(keras.Model)
        model = tu.copy_weights(reference, build(AccumModel, accum_steps=4))
        _, expected = tu.train(reference, x, y, 8, 2, "sgd", loss)
        _, actual = tu.train(model, x, y, 2, 2, "sgd", loss)
        tu.assert_same_trajectory(self, expected, actual)

    @parameterized.named_parameters(("sgd", "sgd"), ("adam", "adam"))
    def test_embedding_sparse_gradients(self, optimizer):
        def build(cls, **kwargs):
            keras.utils.set_random_seed(3)
            inputs = keras.Input((5,), dtype="int32")
            h = keras.layers.Embedding(50, 4)(inputs)
            h = keras.layers.GlobalAveragePooling1D()(h)
            return cls(
                inputs=inputs, outputs=keras.layers.Dense(2)(h), **kwargs
            )

        rng = np.random.default_rng(0)
        # Few distinct ids, so rows repeat within and across micro-batches.
        x = rng.integers(0, 8, size=(20, 5)).astype("int32")
        y = rng.normal(size=(20, 2)).astype("float32")
        model = build(AccumModel, accum_steps=4)
        initial = model.get_weights()
        _, actual = tu.train(model, x, y, 2, 1, optimizer)

        # Ground truth: the same optimizer on each window's large-batch
        # gradient, densified (Keras' sparse Adam update squares repeated
        # rows one by one, which is not the large batch's gradient).
        reference = build(keras.Model)
        reference.set_weights(initial)
        opt = tu.OPTIMIZERS[optimizer]()
        expected = []
        for start in range(0, len(x), 8):
            xb, yb = x[start : start + 8], y[start : start + 8]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(reference(xb) - yb))
            grads = tape.gradient(loss, reference.trainable_variables)
            grads = [tf.convert_to_tensor(g) for g in grads]
            ADAPTER.apply_gradients(opt, grads, reference.trainable_variables)
            expected.append(reference.get_weights())
        tu.assert_same_trajectory(self, expected, actual)

    def test_unused_branch_gets_no_update(self):
        class TwoHeads(AccumModel):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.used = keras.layers.Dense(3)
                self.unused = keras.layers.Dense(3)

            def call(self, x):
                return self.used(x)

        class PlainTwoHeads(keras.Model):
            def __init__(self):
                super().__init__()
                self.used = keras.layers.Dense(3)
                self.unused = keras.layers.Dense(3)

            def call(self, x):
                return self.used(x)

        x, y = tu.regression_data(20)
        reference = PlainTwoHeads()
        reference(x[:1]), reference.unused(x[:1])
        model = TwoHeads(accum_steps=2)
        model(x[:1]), model.unused(x[:1])
        model.set_weights(reference.get_weights())
        _, expected = tu.train(reference, x, y, 8, 2, "adamw")
        _, actual = tu.train(model, x, y, 4, 2, "adamw")
        tu.assert_same_trajectory(self, expected, actual)
        # AdamW would decay the unused head if it were given a zero gradient.
        self.assertAllClose(
            model.unused.get_weights()[0], reference.unused.get_weights()[0]
        )

    def test_frozen_layer_stays_frozen(self):
        x, y = tu.regression_data(16)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=2))
        for m in (reference, model):
            m.layers[1].trainable = False
        frozen = model.layers[1].get_weights()
        _, expected = tu.train(reference, x, y, 8, 1, "adam")
        _, actual = tu.train(model, x, y, 4, 1, "adam")
        tu.assert_same_trajectory(self, expected, actual)
        tu.assert_same_trajectory(
            self, [frozen], [model.layers[1].get_weights()], atol=0
        )

    def test_no_trainable_weights_warns_like_keras(self):
        inputs = keras.Input((4,))
        model = AccumModel(inputs=inputs, outputs=inputs * 2.0, accum_steps=2)
        model.compile("sgd", "mse")
        x, _ = tu.regression_data(8, out_dim=4)
        with self.assertWarnsRegex(UserWarning, "no.*trainable weights"):
            model.fit(x, x, batch_size=2, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 0)


class CompiledStepTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("eager", {"run_eagerly": True}),
        ("graph", {}),
        ("jit", {"jit_compile": True}),
        ("steps_per_execution", {"steps_per_execution": 3}),
        (
            "jit_steps_per_execution",
            {"jit_compile": True, "steps_per_execution": 2},
        ),
    )
    def test_execution_modes_equal_large_batch(self, compile_kwargs):
        x, y = tu.regression_data(22)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=4))
        _, expected = tu.train(reference, x, y, 8, 2, "adam")
        model.compile(tu.OPTIMIZERS["adam"](), "mse", **compile_kwargs)
        model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        tu.assert_same_trajectory(self, expected[-1:], [model.get_weights()])
        self.assertEqual(int(model.optimizer.iterations), len(expected))

    @parameterized.named_parameters(
        ("functional", False), ("subclassed_unbuilt", True)
    )
    def test_traces_no_more_than_plain_fit(self, subclassed):
        def counting(cls):
            class Counting(cls):
                traces = 0

                def train_step(self, data):
                    type(self).traces += 1
                    return super().train_step(data)

            return Counting

        def build(cls, **kwargs):
            if not subclassed:
                return tu.mlp(cls, **kwargs)

            class Net(cls):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.hidden = keras.layers.Dense(5, activation="tanh")
                    self.out = keras.layers.Dense(3)

                def call(self, x):
                    return self.out(self.hidden(x))

            return Net(**kwargs)

        x, y = tu.regression_data(22)
        plain = build(counting(keras.Model))
        model = build(counting(AccumModel), accum_steps=3)
        for m in (plain, model):
            m.compile(tu.OPTIMIZERS["adam"](), "mse")
            m.fit(x, y, batch_size=2, epochs=3, verbose=0)
        model.accum_steps = 5  # must not retrace
        model.fit(x, y, batch_size=2, epochs=2, verbose=0)
        plain.fit(x, y, batch_size=2, epochs=2, verbose=0)
        self.assertLessEqual(type(model).traces, type(plain).traces)
        self.assertGreater(type(model).traces, 0)

    def test_epoch_end_flush_traces_once_across_fit_calls(self):
        # The flush that applies a partial window at epoch end is a
        # `tf.function` of its own; like the train step, it must be traced
        # once, not once per `fit` call.
        x, y = tu.regression_data(22)
        model = tu.mlp(AccumModel, accum_steps=4)
        model.compile(tu.OPTIMIZERS["sgd"](), "mse")
        made = []
        original = _epoch_end.flush_function

        def recording(model, accumulator):
            made.append(original(model, accumulator))
            return made[-1]

        with mock.patch.object(_epoch_end, "flush_function", recording):
            for _ in range(3):
                model.fit(x, y, batch_size=2, epochs=2, verbose=0)
        traces = sum(f.experimental_get_tracing_count() for f in made)
        self.assertEqual(traces, 1)
        # A new `compile` (here: another optimizer) must rebuild it.
        model.compile(tu.OPTIMIZERS["adam"](), "mse")
        with mock.patch.object(_epoch_end, "flush_function", recording):
            model.fit(x, y, batch_size=2, epochs=1, verbose=0)
        self.assertLen(made, 2)

    def test_accum_steps_change_takes_effect_at_next_window(self):
        x, y = tu.regression_data(24)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=2))

        class Switch(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 2:  # mid-window: the 2nd window has 1 of 2
                    self.model.accum_steps = 3

        model.compile(tu.OPTIMIZERS["sgd"](), "mse")
        recorder = tu.UpdateRecorder()
        model.fit(
            x,
            y,
            batch_size=2,
            shuffle=False,
            verbose=0,
            callbacks=[Switch(), recorder],
        )
        # Windows of 2, 2 (finishing with the old length), then 3 each.
        sizes = [4, 4, 6, 6, 4]
        reference.compile(tu.OPTIMIZERS["sgd"](), "mse")
        expected, start = [], 0
        for size in sizes:
            reference.train_on_batch(
                x[start : start + size], y[start : start + size]
            )
            expected.append(reference.get_weights())
            start += size
        tu.assert_same_trajectory(self, expected, recorder.weights)


class CompiledUpdateTest(tf.test.TestCase):
    """The window's update, compiled with XLA apart (`_close`)."""

    def _model(self):
        model = tu.mlp(AccumModel, accum_steps=2)
        model.compile(tu.PyFunctionSGD(0.1), "mse")
        return model

    def test_an_update_xla_cannot_compile_says_what_to_set(self):
        x, y = tu.regression_data(16)
        model = self._model()
        reference = tu.copy_weights(model, tu.mlp(keras.Model))
        before = model.get_weights()
        # The default: compiled, so the step's trace fails, before anything
        # of the window is added.
        with self.assertRaisesRegex(
            ValueError, r"XLA cannot compile .* `jit_compile=False`"
        ):
            model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        tu.assert_same_trajectory(self, [before], [model.get_weights()])
        self.assertEqual(int(model.gradient_accumulator.micro_step), 0)

        model.compile(tu.PyFunctionSGD(0.1), "mse", jit_compile=False)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        _, expected = tu.train(
            reference, x, y, 8, optimizer=tu.PyFunctionSGD(0.1)
        )
        tu.assert_same_trajectory(self, expected[-1:], [model.get_weights()])

    def test_jit_compile_is_saved_as_given(self):
        # Keras saves `jit_compile` as it resolved it: False on a CPU for
        # "auto", which would have kept XLA out of a loaded model's update.
        x, y = tu.regression_data(16)
        for jit_compile in (None, False):
            model = self._model()
            if jit_compile is False:
                model.compile(tu.PyFunctionSGD(0.1), "mse", jit_compile=False)
            path = os.path.join(self.get_temp_dir(), f"{jit_compile}.keras")
            model.save(path)
            loaded = keras.models.load_model(
                path, custom_objects={"PyFunctionSGD": tu.PyFunctionSGD}
            )
            self.assertIsInstance(loaded.optimizer, tu.PyFunctionSGD)
            if jit_compile is False:
                loaded.fit(x, y, batch_size=4, verbose=0)
            else:
                with self.assertRaisesRegex(ValueError, "jit_compile=False"):
                    loaded.fit(x, y, batch_size=4, verbose=0)


class CountersTest(tf.test.TestCase, parameterized.TestCase):
    def test_learning_rate_schedule_counts_updates(self):
        schedule = keras.optimizers.schedules.ExponentialDecay(
            0.5, decay_steps=1, decay_rate=0.5
        )
        x, y = tu.regression_data(24)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=4))
        builtin = tu.copy_weights(reference, tu.mlp(keras.Model))
        _, expected = tu.train(
            reference, x, y, 8, 2, keras.optimizers.SGD(schedule)
        )
        _, actual = tu.train(model, x, y, 2, 2, keras.optimizers.SGD(schedule))
        tu.assert_same_trajectory(self, expected, actual)
        self.assertEqual(int(model.optimizer.iterations), len(expected))
        self.assertAllClose(
            model.optimizer.learning_rate, reference.optimizer.learning_rate
        )
        if not tu.HAS_BUILTIN_ACCUMULATION:
            return
        # Keras' built-in option steps the schedule per micro-batch.
        _, got = tu.train(
            builtin,
            x,
            y,
            2,
            2,
            keras.optimizers.SGD(schedule, gradient_accumulation_steps=4),
        )
        self.assertGreater(tu.max_abs_diff(expected[-1], got[-1]), 1e-3)

    @parameterized.named_parameters(
        ("clipnorm", {"clipnorm": 0.05}),
        ("clipvalue", {"clipvalue": 0.01}),
        ("global_clipnorm", {"global_clipnorm": 0.05}),
        ("ema", {"use_ema": True, "ema_momentum": 0.5}),
    )
    def test_clipping_and_ema_act_once_per_update(self, kwargs):
        x, y = tu.regression_data(22)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=4))
        _, expected = tu.train(
            reference, x, y, 8, 2, tu.OPTIMIZERS["adam"](**kwargs)
        )
        _, actual = tu.train(model, x, y, 2, 2, tu.OPTIMIZERS["adam"](**kwargs))
        tu.assert_same_trajectory(self, expected, actual)
        if "use_ema" in kwargs:
            # fit ends by writing the EMA into the weights.
            self.assertGreater(
                tu.max_abs_diff(expected[-1], reference.get_weights()), 0
            )
            tu.assert_same_trajectory(
                self, [reference.get_weights()], [model.get_weights()]
            )

    def test_keras_callbacks_work_unchanged(self):
        x, y = tu.regression_data(24)
        xv, yv = tu.regression_data(8, seed=1)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=3))
        tmp = self.get_temp_dir()

        def callbacks(tag):
            return [
                keras.callbacks.LearningRateScheduler(
                    lambda epoch, lr: lr * 0.5
                ),
                keras.callbacks.ReduceLROnPlateau(
                    monitor="val_loss", patience=0, factor=0.9, min_delta=10
                ),
                keras.callbacks.EarlyStopping(
                    monitor="val_loss", patience=2, min_delta=10
                ),
                keras.callbacks.ModelCheckpoint(
                    os.path.join(tmp, f"{tag}.keras"), monitor="val_loss"
                ),
            ]

        ref_hist, expected = tu.train(
            reference,
            x,
            y,
            6,
            5,
            "adam",
            validation_data=(xv, yv),
            callbacks=callbacks("ref"),
        )
        hist, actual = tu.train(
            model,
            x,
            y,
            2,
            5,
            "adam",
            validation_data=(xv, yv),
            callbacks=callbacks("accum"),
        )
        tu.assert_same_trajectory(self, expected, actual)
        self.assertLen(hist.history["loss"], len(ref_hist.history["loss"]))
        lr = "lr" if tu.TF_KERAS else "learning_rate"
        self.assertAllClose(hist.history[lr], ref_hist.history[lr])
        self.assertAllClose(
            hist.history["val_loss"], ref_hist.history["val_loss"], atol=1e-5
        )
        restored = keras.models.load_model(os.path.join(tmp, "accum.keras"))
        tu.assert_same_trajectory(
            self, [model.get_weights()], [restored.get_weights()], atol=0
        )

    def test_backup_and_restore_resumes_mid_window(self):
        # Keras restores at epoch granularity; with `epoch_end="carry"` the
        # epoch ends mid-window (5 micro-batches, windows of 4), so the open
        # window must travel through the backup.
        x, y = tu.regression_data(10)
        backup_dir = os.path.join(self.get_temp_dir(), "backup")
        reference = tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        model = tu.copy_weights(
            reference, tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        )
        reference.compile(tu.OPTIMIZERS["adam"](), "mse")
        reference.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0)

        class Interrupt(keras.callbacks.Callback):
            fired = False

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if self.epoch == 1 and batch == 2 and not Interrupt.fired:
                    Interrupt.fired = True
                    raise RuntimeError("interrupted")

        model.compile(tu.OPTIMIZERS["adam"](), "mse")
        callbacks = [keras.callbacks.BackupAndRestore(backup_dir), Interrupt()]
        with self.assertRaisesRegex(RuntimeError, "interrupted"):
            model.fit(
                x,
                y,
                batch_size=2,
                epochs=3,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        resumed = tu.mlp(AccumModel, seed=3, accum_steps=4, epoch_end="carry")
        resumed.compile(tu.OPTIMIZERS["adam"](), "mse")
        resumed.fit(
            x,
            y,
            batch_size=2,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [resumed.get_weights()]
        )
        self.assertEqual(
            int(resumed.gradient_accumulator.micro_step),
            int(reference.gradient_accumulator.micro_step),
        )


class LogsTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(("even", 24), ("ragged", 22))
    def test_history_equals_large_batch_fit(self, n):
        x, y = tu.classification_data(n)
        xv, yv = tu.classification_data(10, seed=1)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(AccumModel, accum_steps=4))
        kwargs = {
            "loss": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
            "compile_kwargs": {"metrics": ["accuracy"]},
            "validation_data": (xv, yv),
        }
        ref_hist, _ = tu.train(reference, x, y, 8, 3, "adam", **kwargs)
        hist, _ = tu.train(model, x, y, 2, 3, "adam", **kwargs)
        # Plain fit's logs: nothing was discarded, so no count is shown.
        self.assertEqual(set(hist.history), set(ref_hist.history))
        for key, values in ref_hist.history.items():
            self.assertAllClose(hist.history[key], values, atol=1e-5, msg=key)
        self.assertAllClose(
            model.evaluate(xv, yv, verbose=0),
            reference.evaluate(xv, yv, verbose=0),
            atol=1e-5,
        )
        self.assertAllClose(
            model.predict(xv, verbose=0),
            reference.predict(xv, verbose=0),
            atol=1e-5,
        )


class EpochEndTest(tf.test.TestCase):
    def test_apply_happens_before_validation_and_callbacks(self):
        x, y = tu.regression_data(10)  # 5 micro-batches, window of 4
        seen = []

        class Watch(keras.callbacks.Callback):
            def on_test_begin(self, logs=None):
                seen.append(("val", int(self.model.optimizer.iterations)))

            def on_epoch_end(self, epoch, logs=None):
                seen.append(("end", int(self.model.optimizer.iterations)))

        model = tu.mlp(AccumModel, accum_steps=4)
        tu.train(
            model,
            x,
            y,
            2,
            2,
            "sgd",
            validation_data=(x, y),
            callbacks=[Watch()],
        )
        self.assertEqual(seen, [("val", 2), ("end", 2), ("val", 4), ("end", 4)])

    def test_carry_keeps_the_window_open_across_epochs(self):
        x, y = tu.regression_data(10)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(
            reference, tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        )
        model.compile(tu.OPTIMIZERS["sgd"](), "mse")
        model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        # 10 micro-batches: windows of 4 and 4 (straddling the epoch), and
        # 2 left open.
        self.assertEqual(int(model.optimizer.iterations), 2)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 2)
        xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
        reference.compile(tu.OPTIMIZERS["sgd"](), "mse")
        reference.fit(xx[:16], yy[:16], batch_size=8, shuffle=False, verbose=0)
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )
        self.assertTrue(model.apply_accumulated())
        reference.train_on_batch(xx[16:], yy[16:])
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )
        self.assertFalse(model.apply_accumulated())  # nothing pending


class StateTest(tf.test.TestCase, parameterized.TestCase):
    def _trained_mid_window(self):
        x, y = tu.regression_data(10)
        model = tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        tu.train(model, x, y, 2, 1, "adam")
        self.assertEqual(int(model.gradient_accumulator.micro_step), 1)
        return model

    def test_state_is_not_weights(self):
        model = self._trained_mid_window()
        plain = tu.mlp(keras.Model)
        self.assertEqual(len(model.weights), len(plain.weights))
        self.assertEqual(model.count_params(), plain.count_params())
        self.assertLen(model.get_weights(), len(plain.get_weights()))
        self.assertEqual(len(model.non_trainable_weights), 0)
        self.assertIsInstance(model.optimizer, keras.optimizers.Adam)

    def test_export_holds_only_model_variables(self):
        model = self._trained_mid_window()
        path = os.path.join(self.get_temp_dir(), "exported")
        model.export(path, **({} if tu.TF_KERAS else {"verbose": False}))
        restored = tf.saved_model.load(path)
        self.assertLen(restored.variables, len(model.weights))
        x, _ = tu.regression_data(3, seed=5)
        self.assertAllClose(
            restored.serve(x), model.predict(x, verbose=0), atol=1e-6
        )

    @parameterized.named_parameters(
        ("keras", ".keras"), ("weights_h5", ".weights.h5")
    )
    def test_save_mid_window_resumes_exactly(self, suffix):
        x, y = tu.regression_data(20)
        reference = tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        model = tu.copy_weights(
            reference, tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
        )
        reference.compile(tu.OPTIMIZERS["adam"](), "mse")
        reference.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        model.compile(tu.OPTIMIZERS["adam"](), "mse")
        model.fit(x[:6], y[:6], batch_size=2, shuffle=False, verbose=0)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 3)
        path = os.path.join(self.get_temp_dir(), "mid" + suffix)

        def fresh():
            new = tu.mlp(AccumModel, accum_steps=4, epoch_end="carry")
            new.compile(tu.OPTIMIZERS["adam"](), "mse")
            new.optimizer.build(new.trainable_variables)
            return new

        restored = tu.save_and_load(model, path, fresh)
        self.assertEqual(int(restored.gradient_accumulator.micro_step), 3)
        restored.fit(x[6:], y[6:], batch_size=2, shuffle=False, verbose=0)
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [restored.get_weights()]
        )
        self.assertEqual(
            int(restored.optimizer.iterations),
            int(reference.optimizer.iterations),
        )

    def test_config_round_trip_without_custom_objects(self):
        model = tu.mlp(AccumModel, accum_steps=6, epoch_end="carry")
        model.compile("sgd", "mse")
        path = os.path.join(self.get_temp_dir(), "m.keras")
        model.save(path)
        restored = keras.models.load_model(path)
        self.assertIsInstance(restored, AccumModel)
        self.assertEqual(restored.accum_steps, 6)
        self.assertEqual(restored.epoch_end, "carry")

    def test_weights_transfer_both_ways_with_plain_model(self):
        model = self._trained_mid_window()
        path = os.path.join(self.get_temp_dir(), "w.weights.h5")
        model.save_weights(path)
        plain = tu.mlp(keras.Model, seed=9)
        plain.load_weights(path)
        tu.assert_same_trajectory(
            self, [model.get_weights()], [plain.get_weights()], atol=0
        )
        back = tu.mlp(AccumModel, seed=7, accum_steps=2)
        plain_path = os.path.join(self.get_temp_dir(), "p.weights.h5")
        plain.save_weights(plain_path)
        back.load_weights(plain_path)
        tu.assert_same_trajectory(
            self, [plain.get_weights()], [back.get_weights()], atol=0
        )


class StatefulLayersTest(tf.test.TestCase):
    def test_batchnorm_moving_stats_update_per_micro_batch(self):
        # Behaves as plain fit at the micro-batch: with BN on the input the
        # moving statistics follow the micro-batches, whatever the weights.
        def build(cls, **kwargs):
            keras.utils.set_random_seed(4)
            inputs = keras.Input((4,))
            h = keras.layers.BatchNormalization(momentum=0.5)(inputs)
            return cls(
                inputs=inputs, outputs=keras.layers.Dense(3)(h), **kwargs
            )

        x, y = tu.regression_data(16)
        plain = build(keras.Model)
        model = tu.copy_weights(plain, build(AccumModel, accum_steps=4))
        tu.train(plain, x, y, 2, 1, "sgd")
        tu.train(model, x, y, 2, 1, "sgd")
        self.assertAllClose(
            model.layers[1].moving_mean, plain.layers[1].moving_mean
        )
        self.assertAllClose(
            model.layers[1].moving_variance, plain.layers[1].moving_variance
        )

    def test_dropout_matches_plain_fit_with_one_step(self):
        def build(cls, **kwargs):
            keras.utils.set_random_seed(5)
            inputs = keras.Input((4,))
            h = keras.layers.Dropout(0.5, seed=1)(keras.layers.Dense(8)(inputs))
            return cls(
                inputs=inputs, outputs=keras.layers.Dense(3)(h), **kwargs
            )

        x, y = tu.regression_data(16)
        plain = build(keras.Model)
        initial = plain.get_weights()
        _, expected = tu.train(plain, x, y, 4, 1, "sgd")
        # tf_keras' Dropout seeds each Python trace with the next integer,
        # and plain fit traces its step twice here (its optimizer creates
        # its slots in the first trace): so does AccumModel, its update
        # compiled apart or not.
        for compile_kwargs in ({}, {"jit_compile": False}):
            model = tu.copy_weights(plain, build(AccumModel, accum_steps=1))
            model.set_weights(initial)
            _, actual = tu.train(
                model, x, y, 4, 1, "sgd", compile_kwargs=compile_kwargs
            )
            tu.assert_same_trajectory(self, expected, actual, atol=1e-6)


class ValidationTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("zero", 0),
        ("negative", -1),
        ("float", 2.5),
        ("string", "4"),
        ("bool", True),
        ("none", None),
    )
    def test_bad_accum_steps(self, value):
        message = re.escape(f"Received: accum_steps={value!r}")
        with self.assertRaisesRegex(
            ValueError, "`accum_steps` must be an integer >= 1. " + message
        ):
            tu.mlp(AccumModel, accum_steps=value)
        model = tu.mlp(AccumModel, accum_steps=3)
        with self.assertRaisesRegex(ValueError, message):
            model.accum_steps = value
        self.assertEqual(model.accum_steps, 3)

    def test_bad_accum_steps_after_training_leaves_state(self):
        model = self._model_trained_with(accum_steps=3)
        with self.assertRaises(ValueError):
            model.accum_steps = 0
        self.assertEqual(model.accum_steps, 3)
        self.assertEqual(model.gradient_accumulator.accum_steps, 3)

    def test_accum_steps_has_one_source_once_the_engine_exists(self):
        # The engine's variable is what the compiled step reads; the model
        # reads and writes that one value, whichever side sets it.
        model = self._model_trained_with(accum_steps=3)
        model.gradient_accumulator.accum_steps = 5
        self.assertEqual(model.accum_steps, 5)
        self.assertEqual(model.get_config()["accum_steps"], 5)
        model.accum_steps = 2
        self.assertEqual(model.gradient_accumulator.accum_steps, 2)

    def _model_trained_with(self, accum_steps):
        x, y = tu.regression_data(8)
        model = tu.mlp(AccumModel, accum_steps=accum_steps)
        tu.train(model, x, y, 2, 1, "sgd")
        return model

    def test_numpy_integer_accepted(self):
        self.assertEqual(
            tu.mlp(AccumModel, accum_steps=np.int64(4)).accum_steps, 4
        )

    def test_bad_epoch_end(self):
        with self.assertRaisesRegex(
            ValueError, re.escape("Received: epoch_end='flush'")
        ):
            tu.mlp(AccumModel, epoch_end="flush")

    def test_non_tensorflow_backend_is_refused(self):
        if tu.TF_KERAS:
            self.skipTest("tf_keras has no backend other than TensorFlow")
        with mock.patch.object(keras.backend, "backend", return_value="jax"):
            with self.assertRaisesRegex(ValueError, "TensorFlow backend"):
                tu.mlp(AccumModel, accum_steps=2)

    @parameterized.named_parameters(
        ("functional", "functional", 4),
        ("functional_accum_steps_1", "functional", 1),
        ("subclassed", "subclassed", 4),
        ("loss_scale_optimizer", "loss_scale", 4),
    )
    def test_optimizer_that_accumulates_itself_is_refused(self, kind, steps):
        # Two windows would multiply: accum_steps=4 with the optimizer's own
        # 4 made one update per 16 micro-batches (issue 32).
        if not tu.HAS_BUILTIN_ACCUMULATION:
            self.skipTest("tf_keras has no built-in accumulation")
        x, y = tu.regression_data(8)
        sgd = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
        if kind == "subclassed":
            model = DenseNet(accum_steps=steps)
            model(x[:1])
        else:
            model = tu.mlp(AccumModel, accum_steps=steps)
        if kind == "loss_scale":
            sgd = keras.optimizers.LossScaleOptimizer(sgd)
        model.compile(optimizer=sgd, loss="mse")
        before = model.get_weights()
        with self.assertRaisesRegex(
            ValueError,
            "Use one or the other: `accum_steps` with "
            "`gradient_accumulation_steps=None`, or Keras' built-in option on "
            "a plain `keras.Model`.*"
            + re.escape("Received: gradient_accumulation_steps=4 "),
        ):
            model.fit(x, y, batch_size=2, verbose=0)
        # Refused before anything was built or trained.
        self.assertIsNone(model.gradient_accumulator)
        self.assertEqual(int(model.optimizer.iterations), 0)
        tu.assert_same_trajectory(self, [before], [model.get_weights()], atol=0)
        # The same model trains with the optimizer's option off.
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=2, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 4 // steps)

    @parameterized.named_parameters(
        ("functional_accum_steps", "functional", "acum_steps", "accum_steps"),
        ("functional_epoch_end", "functional", "epochend", "epoch_end"),
        ("functional_noise_scale", "functional", "noisescale", "noise_scale"),
        ("subclassed_accum_steps", "subclassed", "accum_step", "accum_steps"),
        ("subclassed_adascale", "subclassed", "ada_scale", "adascale"),
    )
    def test_misspelled_keyword_is_refused(self, kind, keyword, meant):
        # Keras 3's Functional dropped `acum_steps=8` and the model trained
        # plain without a word (issue 32).
        message = f"`{keyword}`. Did you mean `{meant}`? Received: {keyword}=8"
        with self.assertRaisesRegex(TypeError, re.escape(message)):
            if kind == "functional":
                tu.mlp(AccumModel, **{keyword: 8})
            else:
                DenseNet(**{keyword: 8})

    @parameterized.named_parameters(
        ("functional", "functional"), ("subclassed", "subclassed")
    )
    def test_keras_keywords_still_pass(self, kind):
        kwargs = dict(name="net", trainable=False, accum_steps=2)
        if kind == "functional":
            model = tu.mlp(AccumModel, **kwargs)
        else:
            model = DenseNet(dtype="float64", **kwargs)
            self.assertEqual(model.dtype, "float64")
        self.assertEqual((model.name, model.trainable), ("net", False))
        self.assertEqual(model.accum_steps, 2)


class ConstructionTest(tf.test.TestCase):
    def test_functional_and_subclassed_in_either_order(self):
        class Net(AccumModel):
            def __init__(self):
                super().__init__(accum_steps=2)
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        bases = AccumModel.__bases__
        x, y = tu.regression_data(8)
        for build in (
            lambda: tu.mlp(AccumModel, accum_steps=2),
            Net,
            lambda: tu.mlp(AccumModel, accum_steps=2),
            Net,
        ):
            model = build()
            tu.train(model, x, y, 2, 1, "sgd")
            self.assertEqual(int(model.optimizer.iterations), 2)
            self.assertEqual(AccumModel.__bases__, bases)
        # A subclass built functionally, then subclass-style.
        functional_net = tu.mlp(Net.__mro__[1], accum_steps=2)
        self.assertIsInstance(functional_net, AccumModel)
        self.assertIsInstance(Net(), Net)


if __name__ == "__main__":
    tf.test.main()
