"""GradientAccumulator, the engine, in custom training loops."""

import os
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import GradientAccumulator
from accum_model.core import _control_flow
from accum_model.keras._adapter import keras
from tests import testing_utils as tu


def _sgd(lr=1.0):
    return keras.optimizers.SGD(learning_rate=lr)


class HandComputedTest(tf.test.TestCase, parameterized.TestCase):
    def test_mean_of_four_micro_batches(self):
        # grads 1, 2, 3, 4 -> one update by their mean, 2.5.
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=4)
        opt = _sgd()
        applied = [
            bool(acc.step([tf.constant([g])], opt))
            for g in (1.0, 2.0, 3.0, 4.0)
        ]
        self.assertEqual(applied, [False, False, False, True])
        self.assertAllClose(v, [-2.5])
        self.assertEqual(int(opt.iterations), 1)
        self.assertEqual(int(acc.micro_step), 0)
        self.assertEqual(float(acc.weight_sum), 0.0)
        # The next window starts from nothing, not from the last one's sum.
        acc.step([tf.constant([1.0])], opt)
        self.assertAllClose(acc._engine.accumulators[0], [1.0])

    def test_weighted_mean(self):
        # A micro-batch of 4 samples with mean gradient 1 and one of 2
        # samples with mean gradient 4: the 6-sample mean is (4 + 8) / 6 = 2,
        # not the mean of means 2.5.
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=2)
        opt = _sgd()
        acc.step([tf.constant([1.0])], opt, weight=4)
        acc.step([tf.constant([4.0])], opt, weight=2)
        self.assertAllClose(v, [-2.0])

    def test_apply_flushes_a_partial_window_and_is_noop_when_empty(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=4)
        opt = _sgd()
        acc.accumulate([tf.constant([3.0])], weight=1)
        acc.accumulate([tf.constant([6.0])], weight=2)
        self.assertTrue(bool(acc.apply(opt)))
        self.assertAllClose(v, [-5.0])
        self.assertFalse(bool(acc.apply(opt)))
        self.assertEqual(int(opt.iterations), 1)

    def test_indexed_slices_sum_repeated_rows(self):
        table = tf.Variable(tf.zeros((4, 2)))
        acc = GradientAccumulator([table], accum_steps=2)
        opt = _sgd()
        g1 = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([0, 2, 0]))
        g2 = tf.IndexedSlices(tf.fill((1, 2), 4.0), tf.constant([3]))
        acc.step([g1], opt)
        acc.step([g2], opt)
        # Dense sums: row 0 twice, rows 2 and 3 once; mean over 2 steps.
        self.assertAllClose(
            table, -np.array([[1, 1], [0, 0], [0.5, 0.5], [2, 2]])
        )

    def test_none_gradient_leaves_variable_alone(self):
        a, b = tf.Variable([1.0]), tf.Variable([1.0])
        acc = GradientAccumulator([a, b], accum_steps=1)
        acc.step([tf.constant([1.0]), None], _sgd())
        self.assertAllClose(a, [0.0])
        self.assertAllClose(b, [1.0])

    def test_non_finite_micro_batch_left_out_window_on_schedule(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=3)
        opt = _sgd()
        results = [
            bool(
                acc.step(
                    [tf.constant([g])],
                    opt,
                    weight=1,
                    is_finite=tf.constant(np.isfinite(g)),
                )
            )
            for g in (2.0, np.inf, 4.0)
        ]
        self.assertEqual(results, [False, False, True])
        self.assertAllClose(v, [-3.0])  # mean of the finite two
        self.assertEqual(int(acc.skipped_microbatches), 1)
        # A window of nothing but skipped micro-batches applies nothing.
        for _ in range(3):
            acc.step([tf.constant([np.nan])], opt, is_finite=tf.constant(False))
        self.assertAllClose(v, [-3.0])
        self.assertEqual(int(opt.iterations), 1)
        self.assertEqual(int(acc.micro_step), 0)

    @parameterized.product(
        position=("first", "middle"),
        weight_in_loss=(False, True),
        compiled=(False, True),
    )
    def test_zero_weight_micro_batch_adds_nothing(
        self, position, weight_in_loss, compiled
    ):
        # A micro-batch that weighs 0 (a shard or bucket of padding only)
        # adds nothing, also as a window's first, where it leaves nothing of
        # the last window behind. By hand: the other two micro-batches'
        # weighted mean (2 * [1, 1] + 1 * [4, 0]) / 3.
        v = tf.Variable([0.0, 0.0])
        acc = GradientAccumulator([v], accum_steps=3)
        opt = _sgd()
        # A first window of different gradients, left in the accumulators.
        for _ in range(3):
            acc.step([tf.constant([100.0, -100.0])], opt)
        start = v.numpy()

        def step(g, w):
            # With `weight_in_loss`, the gradient carries the weight.
            g = tf.constant(g) * (w if weight_in_loss else 1.0)
            return acc.step([g], opt, weight=w, weight_in_loss=weight_in_loss)

        step_fn = tf.function(step) if compiled else step
        batches = [([1.0, 1.0], 2.0), ([7.0, -7.0], 0.0), ([4.0, 0.0], 1.0)]
        if position == "first":
            batches = [batches[1], batches[0], batches[2]]
        for g, w in batches:
            step_fn(g, w)
        self.assertEqual(int(opt.iterations), 2)
        self.assertAllClose(v.numpy(), start - [2.0, 2.0 / 3.0])

    def test_accum_steps_change_latches_at_next_window(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=2)
        opt = _sgd()
        acc.step([tf.constant([1.0])], opt)
        acc.accum_steps = 3  # the open window still closes after 2
        self.assertTrue(bool(acc.step([tf.constant([1.0])], opt)))
        closed = [bool(acc.step([tf.constant([1.0])], opt)) for _ in range(3)]
        self.assertEqual(closed, [False, False, True])

    def test_accum_steps_set_between_windows_applies_to_the_next(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=2)
        opt = _sgd()

        closed = [bool(acc.step([tf.constant([1.0])], opt)) for _ in range(2)]
        self.assertEqual(closed, [False, True])
        acc.accum_steps = 3
        closed = [bool(acc.step([tf.constant([1.0])], opt)) for _ in range(3)]
        self.assertEqual(closed, [False, False, True])
        acc.reset()
        acc.accum_steps = 1
        self.assertTrue(bool(acc.step([tf.constant([1.0])], opt)))

    def test_reset_discards_the_window(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=2)
        acc.accumulate([tf.constant([5.0])])
        acc.reset()
        acc.step([tf.constant([1.0])], _sgd())
        acc.step([tf.constant([1.0])], _sgd())
        self.assertAllClose(v, [-1.0])

    def test_checkpoint_keeps_an_open_window(self):
        v = tf.Variable([0.0])
        acc = GradientAccumulator([v], accum_steps=2)
        acc.accumulate([tf.constant([4.0])])
        path = tf.train.Checkpoint(acc=acc).save(self.get_temp_dir() + "/c")
        fresh = GradientAccumulator([v], accum_steps=2)
        tf.train.Checkpoint(acc=fresh).restore(path).assert_consumed()
        fresh.step([tf.constant([2.0])], _sgd())
        self.assertAllClose(v, [-3.0])


class CustomLoopTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("sgd_eager", "sgd", False),
        ("adam_function", "adam", True),
        ("adamw_function", "adamw", True),
        # Under XLA the apply runs in a 0-or-1-trip loop, not a cond.
        ("adam_xla", "adam", "jit"),
    )
    def test_custom_loop_equals_large_batch(self, optimizer, compiled):
        x, y = tu.regression_data(22)
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(reference, tu.mlp(keras.Model))
        reference.compile(tu.OPTIMIZERS[optimizer](), "mse")
        expected = []
        for start in range(0, 22, 8):
            reference.train_on_batch(x[start : start + 8], y[start : start + 8])
            expected.append(reference.get_weights())

        opt = tu.OPTIMIZERS[optimizer]()
        acc = GradientAccumulator(model.trainable_variables, accum_steps=4)

        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            return acc.step(grads, opt, weight=tf.shape(xb)[0])

        if compiled:
            train_step = tf.function(train_step, jit_compile=compiled == "jit")
        actual = []
        for start in range(0, 22, 2):
            if bool(train_step(x[start : start + 2], y[start : start + 2])):
                actual.append(model.get_weights())
        if bool(acc.apply(opt)):  # the short last window
            actual.append(model.get_weights())
        tu.assert_same_trajectory(self, expected, actual)


class ValidationTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("zero", 0),
        ("negative", -3),
        ("float", 1.0),
        ("bool", False),
        ("none", None),
    )
    def test_bad_accum_steps(self, value):
        v = tf.Variable([0.0])
        with self.assertRaisesRegex(
            ValueError, re.escape(f"Received: accum_steps={value!r}")
        ):
            GradientAccumulator([v], accum_steps=value)
        acc = GradientAccumulator([v], accum_steps=2)
        with self.assertRaises(ValueError):
            acc.accum_steps = value
        self.assertEqual(acc.accum_steps, 2)

    def test_wrong_number_of_gradients(self):
        acc = GradientAccumulator([tf.Variable([0.0])], accum_steps=2)
        with self.assertRaisesRegex(ValueError, "Received: 2 gradients"):
            acc.accumulate([tf.constant([1.0]), tf.constant([1.0])])
        self.assertEqual(int(acc.micro_step), 0)

    @parameterized.named_parameters(
        ("step_eager", "step", False),
        ("step_function", "step", True),
        ("apply_eager", "apply", False),
        ("apply_function", "apply", True),
    )
    def test_optimizer_that_accumulates_itself_is_refused(self, call, traced):
        # Two windows would multiply (issue 32): refused before the
        # micro-batch is added or anything applied.
        if not tu.HAS_BUILTIN_ACCUMULATION:
            self.skipTest("tf_keras has no built-in accumulation")
        v = tf.Variable([1.0])
        opt = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
        acc = GradientAccumulator([v], accum_steps=2)

        def run():
            if call == "step":
                return acc.step([tf.constant([1.0])], opt)
            return acc.apply(opt)

        run = tf.function(run) if traced else run
        with self.assertRaisesRegex(
            ValueError,
            re.escape(
                "Received: gradient_accumulation_steps=2 (optimizer=SGD)"
            ),
        ):
            run()
        self.assertEqual(int(acc.micro_step), 0)
        self.assertAllEqual(v, [1.0])
        self.assertEqual(int(opt.iterations), 0)


class XlaApplyTest(tf.test.TestCase):
    def test_xla_keeps_the_apply_out_of_every_micro_step(self):
        # XLA turns a `tf.cond` with elementwise branches (an optimizer
        # update) into a select of both, running the update on every
        # micro-batch; the engine applies in a loop XLA does not speculate.
        variable = tf.Variable([1.0, 2.0])
        optimizer = keras.optimizers.Adam(0.1)
        accumulator = GradientAccumulator([variable], accum_steps=2)
        step = tf.function(
            lambda g: accumulator.step([g], optimizer), jit_compile=True
        )
        grad = tf.constant([1.0, 1.0])
        for _ in range(4):
            step(grad)
        self.assertEqual(int(optimizer.iterations), 2)
        hlo = step.experimental_get_compiler_ir(grad)(stage="optimized_hlo")
        self.assertIn("while", hlo)
        # Nor does the window's finite check run on every micro-step: XLA
        # hoists loop-invariant work out of a loop, onto the entry
        # computation, unless the check reads a value the loop changes.
        self.assertIn("is-finite", hlo)
        self.assertNotIn("is-finite", _outside_loops(hlo))

    def test_xla_keeps_the_window_norm_in_the_close(self):
        # The noise scale's squared norm of the window reads only the
        # accumulators, which the close's loop does not change: XLA hoisted
        # it out of the loop, one more pass over them per micro-batch. The
        # micro-batch's own norm (of the gradients) belongs outside.
        variables = [tf.Variable(tf.ones([7919])), tf.Variable(tf.ones([3]))]
        optimizer = keras.optimizers.SGD(0.1)
        accumulator = GradientAccumulator(
            variables, accum_steps=2, noise_scale=True
        )
        step = tf.function(
            lambda g, h: accumulator.step([g, h], optimizer), jit_compile=True
        )
        grads = tf.ones([7919]), tf.ones([3])
        for _ in range(4):
            step(*grads)
        self.assertEqual(int(accumulator.noise_scale.measurements), 2)
        hlo = step.experimental_get_compiler_ir(*grads)(stage="optimized_hlo")
        in_close = re.compile(r'op_name="[^"]*while/[^"]*L2Loss')
        micro_batch = re.compile(r'op_name="L2Loss')
        self.assertRegex(hlo, in_close)
        self.assertRegex(_outside_loops(hlo), micro_batch)
        self.assertNotRegex(_outside_loops(hlo), in_close)


def _compiled_updates(function, *args):
    """The calls of `function`'s graph to a window update compiled by XLA."""
    graph = function.get_concrete_function(*args).graph.as_graph_def()
    nodes = list(graph.node)
    for f in graph.library.function:
        nodes.extend(f.node_def)
    return [
        node
        for node in nodes
        if node.attr["_XlaMustCompile"].b
        and "accum_model_window_update" in node.attr["f"].func.name
    ]


class CompiledUpdateTest(tf.test.TestCase, parameterized.TestCase):
    def _step_function(self, compile_update, jit_compile=False):
        strategy = tf.distribute.get_strategy()
        variable = tf.Variable([1.0, -2.0])
        optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.1)
        accumulator = GradientAccumulator([variable], accum_steps=2)

        def replica_step(g):
            return accumulator.step(
                [g], optimizer, compile_update=compile_update
            )

        step = tf.function(
            lambda g: strategy.run(replica_step, (g,)),
            jit_compile=jit_compile,
        )
        return step, variable, optimizer

    def test_the_update_is_compiled_in_a_graph(self):
        step, _, _ = self._step_function(compile_update=True)
        self.assertLen(_compiled_updates(step, tf.constant([1.0, 1.0])), 1)

    def test_one_compiled_update_across_retraces(self):
        # A retrace (another input shape; "auto"'s halvings) reuses the
        # update compiled for the same optimizer and variables.
        step, _, _ = self._step_function(compile_update=True)
        names = {
            node.attr["f"].func.name
            for spec in (tf.TensorSpec([2]), tf.TensorSpec([None]))
            for node in _compiled_updates(step, spec)
        }
        self.assertLen(names, 1)

    @parameterized.named_parameters(
        ("not_asked", dict(compile_update=False)),
        # The whole step is compiled: nothing to compile apart.
        ("xla_step", dict(compile_update=True, jit_compile=True)),
    )
    def test_the_update_is_not_compiled_apart(self, kwargs):
        step, _, _ = self._step_function(**kwargs)
        self.assertEmpty(_compiled_updates(step, tf.constant([1.0, 1.0])))

    def test_not_under_a_strategy(self):
        with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
            step, _, _ = self._step_function(compile_update=True)
            self.assertEmpty(_compiled_updates(step, tf.constant([1.0, 1.0])))

    def test_not_where_keras_keeps_xla_off(self):
        # Apple's ARM processors: Keras turns XLA off under TensorFlow's
        # Metal plugin, tf_keras' optimizers on any of them.
        _control_flow.xla_available.cache_clear()
        self.addCleanup(_control_flow.xla_available.cache_clear)
        with (
            mock.patch("platform.system", return_value="Darwin"),
            mock.patch("platform.processor", return_value="arm"),
        ):
            step, _, _ = self._step_function(compile_update=True)
            self.assertEmpty(_compiled_updates(step, tf.constant([1.0, 1.0])))

    def test_an_optimizer_named_with_an_underscore(self):
        # Its name scope opened at the root of the compiled function's graph
        # was refused ("not a valid root scope name").
        variable = tf.Variable([1.0])
        optimizer = keras.optimizers.SGD(1.0, name="_private")
        accumulator = GradientAccumulator([variable], accum_steps=1)
        step = tf.function(lambda g: accumulator.step([g], optimizer))
        step(tf.constant([0.5]))
        self.assertLen(_compiled_updates(step, tf.constant([0.5])), 1)
        self.assertAllClose(variable, [0.5])

    def test_compiled_and_not_apply_the_same_updates(self):
        # The same arithmetic, fused: equal to float32 rounding.
        grads = [tf.constant([g, 2.0 - g]) for g in (0.5, -1.0, 3.0, 0.25)]
        weights = []
        for compile_update in (True, False):
            step, variable, optimizer = self._step_function(compile_update)
            for g in grads * 3:
                step(g)
            self.assertEqual(int(optimizer.iterations), 6)
            weights.append(variable.numpy())
        self.assertAllClose(weights[0], weights[1], rtol=1e-6, atol=1e-6)
        self.assertNotAllClose(weights[0], [1.0, -2.0])


_LIFETIME_SCRIPT = """
import os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # keeps peak statistics
import tensorflow as tf
from accum_model import GradientAccumulator
from accum_model.keras._adapter import keras

layers = [keras.layers.Dense(1024, use_bias=False) for _ in range(16)]
model = keras.Sequential([keras.Input((1024,))] + layers)
accumulator = GradientAccumulator(model.trainable_variables, accum_steps=4)


@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    accumulator.accumulate(tape.gradient(loss, model.trainable_variables))


x = tf.ones((2, 1024))
step(x)
tf.config.experimental.reset_memory_stats("CPU:0")
step(x), step(x)
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
"""


class GradientLifetimeTest(tf.test.TestCase):
    def test_a_gradient_is_freed_once_added(self):
        # 16 layers of 4 MiB: weights, accumulators and one micro-batch's
        # gradients are 64 MiB each; activations at batch 2 are negligible.
        # Each gradient is added as soon as the backward pass produces it,
        # so a micro-step never holds them all besides the accumulators. It
        # did when every addition waited for all of the micro-batch's
        # gradients. (Micro-steps only: the optimizer's apply is another
        # matter, and tf_keras' holds every gradient.)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        result = subprocess.run(
            [sys.executable, "-c", _LIFETIME_SCRIPT],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        peak = int(result.stdout.split()[-1]) / 2**20
        weights = accumulators = gradients = 64
        self.assertGreater(peak, weights + accumulators)
        self.assertLess(peak, weights + accumulators + gradients / 2)


def _outside_loops(hlo):
    """The text of what an HLO module's entry runs outside any loop.

    The entry computation and the fusions and reductions it calls, however
    deep, without the bodies and conditions of its `while` loops.
    """
    computations = {}
    for block in hlo.split("\n\n"):
        words = block.split()
        if len(words) < 2 or not block.rstrip().endswith("}"):
            continue  # the module's header line
        is_entry = words[0] == "ENTRY"
        computations[words[is_entry].lstrip("%")] = (is_entry, block)
    entry = next(
        name for name, (is_entry, _) in computations.items() if is_entry
    )
    seen, todo, text = set(), [entry], []
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        block = computations[name][1]
        text.append(block)
        todo += re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", block)
    return "\n".join(text)


if __name__ == "__main__":
    tf.test.main()
