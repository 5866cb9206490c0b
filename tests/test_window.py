"""The window's state survives saving, and a non-finite window is discarded.

References: plain Keras applying each window's micro-batches as one batch
(`train_on_batch` from the same initial weights), or the weights before the
window for a discarded one.
"""

import os
import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model import GradientAccumulator
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_N, _B, _M = 3, 2, 9  # accum_steps, micro-batch, micro-batches in all


def _rows(window):
    return np.concatenate([np.arange(k * _B, (k + 1) * _B) for k in window])


def _replay(initial, x, y, windows, optimizer="sgd"):
    """Plain Keras: each window's micro-batches as one batch."""
    model = tu.mlp(keras.Model)
    model.set_weights(initial)
    model.compile(optimizer=tu.OPTIMIZERS[optimizer](), loss="mse")
    for window in windows:
        model.train_on_batch(x[_rows(window)], y[_rows(window)])
    return model


def _chunks(micro_batches, size):
    micro_batches = list(micro_batches)
    return [
        micro_batches[i : i + size] for i in range(0, len(micro_batches), size)
    ]


def _fit_micro_batches(model, x, y, start, stop):
    if stop > start:
        model.fit(
            x[start * _B : stop * _B],
            y[start * _B : stop * _B],
            batch_size=_B,
            shuffle=False,
            verbose=0,
        )


def _restored(model, path):
    """`model` saved to `path` and loaded into a new model object."""

    def fresh():
        new = tu.mlp(AccumModel, seed=5, accum_steps=_N, epoch_end="carry")
        new.compile(tu.OPTIMIZERS["sgd"](), "mse")
        # A `.weights.h5` file restores an optimizer's state only into a
        # built one (tf_keras skips it otherwise).
        new.optimizer.build(new.trainable_variables)
        return new

    return tu.save_and_load(model, path, fresh)


class RestoredWindowTest(tf.test.TestCase, parameterized.TestCase):
    """Save after 0, 1 or N-1 micro-batches of a window, load into a new
    model, then apply at once, train on, change `accum_steps` or reset."""

    @parameterized.named_parameters(
        (
            f"{action}_after_{saved_after}_{suffix.replace('.', '_')[1:]}",
            saved_after,
            action,
            suffix,
        )
        for saved_after in (0, 1, _N - 1)
        for action in ("apply_now", "train_on", "change_accum_steps", "reset")
        for suffix in (".keras", ".weights.h5")
    )
    def test_restored_window_continues_as_uninterrupted(
        self, saved_after, action, suffix
    ):
        x, y = tu.regression_data(_M * _B)
        model = tu.mlp(AccumModel, accum_steps=_N, epoch_end="carry")
        initial = model.get_weights()
        model.compile(tu.OPTIMIZERS["sgd"](), "mse")
        opened = _N + saved_after  # One full window, then the open one.
        _fit_micro_batches(model, x, y, 0, opened)
        path = os.path.join(
            self.get_temp_dir(), f"{action}{saved_after}{suffix}"
        )
        restored = _restored(model, path)
        engine = restored.gradient_accumulator
        self.assertEqual(int(engine.micro_step), saved_after)
        open_window = list(range(_N, opened))
        windows = [list(range(_N))]
        if action == "apply_now":
            # No step in between: nothing was traced in this model yet.
            self.assertEqual(restored.apply_accumulated(), saved_after > 0)
            windows += [open_window] if open_window else []
        elif action == "train_on":
            _fit_micro_batches(restored, x, y, opened, _M)
            windows += _chunks(range(_N, _M), _N)
        elif action == "change_accum_steps":
            # The open window keeps its length; later ones take the new one.
            restored.accum_steps = 2
            _fit_micro_batches(restored, x, y, opened, _M)
            restored.apply_accumulated()
            first = _N if open_window else 2
            windows += [list(range(_N, _N + first))]
            windows += _chunks(range(_N + first, _M), 2)
        else:
            engine.reset()
            _fit_micro_batches(restored, x, y, opened, _M)
            restored.apply_accumulated()
            windows += _chunks(range(opened, _M), _N)
        reference = _replay(initial, x, y, windows)
        self.assertEqual(int(restored.optimizer.iterations), len(windows))
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), restored.get_weights()),
            1e-5,
        )


class CheckpointedAccumulatorTest(tf.test.TestCase, parameterized.TestCase):
    """`tf.train.Checkpoint` of a custom loop's `GradientAccumulator`."""

    def _loop(self, seed=0):
        model = tu.mlp(keras.Model, seed=seed)
        # A variable that is never in the loss: its gradient is None, and
        # at apply it must stay None (AdamW would decay a zero gradient's
        # variable), as in plain training.
        unused = tf.Variable(tf.ones([2]), name="unused")
        variables = model.trainable_variables + [unused]
        optimizer = tu.OPTIMIZERS["adamw"]()
        optimizer.build(variables)
        accumulator = GradientAccumulator(variables, accum_steps=_N)
        checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            accumulator=accumulator,
            unused=unused,
        )
        return model, unused, variables, optimizer, accumulator, checkpoint

    @parameterized.named_parameters(("eager", False), ("function", True))
    def test_restored_window_applies_before_any_step(self, in_function):
        x, y = tu.regression_data(_N * _B)
        model, unused, variables, optimizer, accumulator, checkpoint = (
            self._loop()
        )
        initial = model.get_weights()
        for k in range(_N - 1):
            xb, yb = x[k * _B : (k + 1) * _B], y[k * _B : (k + 1) * _B]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            grads = tape.gradient(loss, variables)
            accumulator.step(grads, optimizer, weight=_B)
        path = checkpoint.save(os.path.join(self.get_temp_dir(), "ckpt"))

        # A new process: new objects, other initial weights.
        model2, unused2, _, optimizer2, accumulator2, checkpoint2 = self._loop(
            seed=3
        )
        checkpoint2.restore(path).assert_consumed()
        apply = lambda: accumulator2.apply(optimizer2)  # noqa: E731
        if in_function:
            apply = tf.function(apply)
        self.assertTrue(bool(apply()))

        reference = tu.mlp(keras.Model)
        reference.set_weights(initial)
        reference.compile(optimizer=tu.OPTIMIZERS["adamw"](), loss="mse")
        rows = _rows(range(_N - 1))
        reference.train_on_batch(x[rows], y[rows])
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model2.get_weights()),
            1e-5,
        )
        self.assertAllEqual(unused2, tf.ones([2]))
        self.assertEqual(int(optimizer2.iterations), 1)


def _with_nan(x, micro_batches):
    x = x.copy()
    for k in micro_batches:
        x[k * _B] = np.nan
    return x


class NonFiniteWindowTest(tf.test.TestCase, parameterized.TestCase):
    """A window holding a NaN gradient is discarded, whatever closes it."""

    def _fit(self, x, y, epoch_end="apply", callbacks=()):
        model = tu.mlp(AccumModel, accum_steps=_N, epoch_end=epoch_end)
        initial = model.get_weights()
        model.compile(tu.OPTIMIZERS["adam"](), "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                x,
                y,
                batch_size=_B,
                shuffle=False,
                verbose=0,
                callbacks=list(callbacks),
            )
        return model, initial, [str(w.message) for w in caught]

    def _assert_replays(self, model, initial, x, y, windows):
        reference = _replay(initial, x, y, windows, optimizer="adam")
        self.assertEqual(int(model.optimizer.iterations), len(windows))
        for w in model.get_weights():
            self.assertTrue(np.all(np.isfinite(w)))
        self.assertLessEqual(
            tu.max_abs_diff(reference.get_weights(), model.get_weights()),
            1e-5,
        )

    def _assert_warned(self, messages, count=1):
        self.assertTrue(
            any(
                f"{count} window(s) of accumulated gradients" in m
                for m in messages
            ),
            messages,
        )

    def test_full_window(self):
        # 8 micro-batches: windows [0-2] [3-5] [6, 7]; micro-batch 4 is NaN.
        x, y = tu.regression_data(8 * _B)
        x = _with_nan(x, [4])
        model, initial, messages = self._fit(x, y)
        self.assertEqual(model.discarded_windows, 1)
        self._assert_warned(messages)
        self._assert_replays(model, initial, x, y, [[0, 1, 2], [6, 7]])

    def test_epoch_end_apply(self):
        x, y = tu.regression_data(8 * _B)
        x = _with_nan(x, [7])
        model, initial, messages = self._fit(x, y)
        self.assertEqual(model.discarded_windows, 1)
        self._assert_warned(messages)
        self._assert_replays(model, initial, x, y, [[0, 1, 2], [3, 4, 5]])

    def test_apply_accumulated(self):
        x, y = tu.regression_data(8 * _B)
        x = _with_nan(x, [6])
        model, initial, _ = self._fit(x, y, epoch_end="carry")
        self.assertEqual(model.discarded_windows, 0)
        with self.assertWarnsRegex(UserWarning, "1 window"):
            self.assertFalse(model.apply_accumulated())
        self.assertEqual(model.discarded_windows, 1)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 0)
        self._assert_replays(model, initial, x, y, [[0, 1, 2], [3, 4, 5]])

    def test_terminate_on_nan_mid_window_keeps_the_last_finite_update(self):
        # Micro-batch 4's loss is NaN: TerminateOnNaN stops there, in the
        # middle of window [3, 4, 5]; the epoch-end apply must not apply it.
        x, y = tu.regression_data(9 * _B)
        x = _with_nan(x, [4])
        model, initial, messages = self._fit(
            x, y, callbacks=[keras.callbacks.TerminateOnNaN()]
        )
        self.assertEqual(model.discarded_windows, 1)
        self._assert_replays(model, initial, x, y, [[0, 1, 2]])

    def test_discarded_count_for_callbacks_in_float32(self):
        # A callback can stop on it without loss scaling (the model's count);
        # the epoch's logs show it once it says something.
        seen = []

        test = self

        class Watch(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                test.assertNotIn("discarded_windows", logs)
                seen.append(self.model.discarded_windows)

        x, y = tu.regression_data(8 * _B)
        x = _with_nan(x, [4])
        model, _, _ = self._fit(x, y, callbacks=[Watch()])
        # Window [3-5] closes, and is discarded, at micro-batch 5.
        self.assertEqual(seen, [0, 0, 0, 0, 0, 1, 1, 1])
        self.assertEqual(model.history.history["discarded_windows"], [1])

    def test_a_finite_run_discards_nothing(self):
        x, y = tu.regression_data(8 * _B)
        model, initial, messages = self._fit(x, y)
        self.assertEqual(model.discarded_windows, 0)
        self.assertFalse(any("window(s)" in m for m in messages))
        self._assert_replays(
            model, initial, x, y, [[0, 1, 2], [3, 4, 5], [6, 7]]
        )


class CustomLoopNonFiniteTest(tf.test.TestCase, parameterized.TestCase):
    # Under XLA the check is the exact count, inside the close's loop.
    @parameterized.named_parameters(
        ("eager", None), ("function", False), ("xla", True)
    )
    def test_nan_window_discarded_and_huge_finite_window_applied(
        self, jit_compile
    ):
        variable = tf.Variable([1.0, 2.0])
        optimizer = keras.optimizers.SGD(learning_rate=1e-30)
        accumulator = GradientAccumulator([variable], accum_steps=2)
        step = lambda g: accumulator.step([g], optimizer)  # noqa: E731
        if jit_compile is not None:
            step = tf.function(step, jit_compile=jit_compile)
        # A NaN in the first window: discarded, the variable untouched.
        step(tf.constant([np.nan, 1.0]))
        step(tf.constant([1.0, 1.0]))
        self.assertEqual(int(accumulator.discarded_windows), 1)
        self.assertAllEqual(variable, [1.0, 2.0])
        self.assertEqual(int(optimizer.iterations), 0)
        # A finite window whose elements sum past float32's range (3e38 +
        # 3e38): applied. By hand: the accumulator holds 3e38 per element,
        # the mean gradient is 1.5e38, times the learning rate 1e-30.
        step(tf.constant([1.5e38, 1.5e38]))
        step(tf.constant([1.5e38, 1.5e38]))
        self.assertEqual(int(accumulator.discarded_windows), 1)
        self.assertEqual(int(optimizer.iterations), 1)
        self.assertAllClose(variable, [1.0 - 1.5e8, 2.0 - 1.5e8], rtol=1e-5)


if __name__ == "__main__":
    tf.test.main()
