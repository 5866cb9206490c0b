"""The accumulation engine: float32 gradient sums, a weight sum, a window.

This module knows TensorFlow and `tf.distribute`, and nothing about Keras
models: `AccumModel` and custom training loops are thin users of
`GradientAccumulator`.

The state machine, per micro-batch `k` of a window:

    acc      += w_k * g_k        (g_k: gradient of micro-batch k's mean loss)
    weight   += w_k              (w_k: the normalizer that loss divided by)
    step     += 1
    if step == window_steps:     apply acc / weight once, then zero weight and
                                 step (the next window's first micro-batch
                                 overwrites acc instead of adding to it)

so the applied gradient is `sum_k w_k g_k / sum_k w_k`, the gradient of the
large batch's loss, whatever the sizes of the micro-batches.
"""

import numbers

import numpy as np
import tensorflow as tf

from accum_model import _mixed_precision

_ON_READ = tf.VariableSynchronization.ON_READ
_SUM = tf.VariableAggregation.SUM
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


def validate_accum_steps(accum_steps):
    """Returns `accum_steps` as a Python int, or raises `ValueError`.

    Args:
        accum_steps: The value to check. Integers >= 1 (Python or NumPy) are
            accepted; bools, floats, strings and `None` are not.

    Returns:
        The value as a Python `int`.

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1.
    """
    is_int = isinstance(accum_steps, numbers.Integral) and not isinstance(
        accum_steps, (bool, np.bool_)
    )
    if not is_int or accum_steps < 1:
        raise ValueError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r}"
        )
    return int(accum_steps)


def _in_replica_context_of_strategy():
    # Inside `strategy.run` a `tf.cond` whose branch all-reduces (the
    # optimizer's apply does) fails with "merge_call called while defining a
    # new graph"; such conds must be taken in cross-replica context.
    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
    )


class GradientAccumulator(tf.Module):
    """Accumulates gradients over micro-batches and applies their mean.

    The engine behind `AccumModel`, usable on its own in custom training loops
    with `tf.GradientTape`, eagerly or inside a `tf.function`, with or without
    `tf.distribute` (create it under `strategy.scope()`; accumulators are
    per-replica and gradients cross replicas once per applied update).

    Each micro-batch's gradients are added with a weight: the number of samples
    (or tokens, or the sum of sample weights) its mean loss was divided by.
    `apply()` hands `sum(weight * grads) / sum(weight)` to the optimizer, once,
    so a short last micro-batch counts for exactly what it holds and the
    optimizer's step counter, learning-rate schedule, clipping and weight decay
    act once per update.

    Example:

    ```python
    accumulator = GradientAccumulator(model.trainable_variables, accum_steps=4)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return accumulator.step(grads, optimizer, weight=tf.shape(x)[0])
    ```

    Args:
        variables: List of variables whose gradients are accumulated, in the
            order `grads` will be given.
        accum_steps: Int >= 1. Micro-batches per update in `step()`.
        name: Optional name of the module.

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1.
    """

    def __init__(self, variables, accum_steps=1, name=None):
        accum_steps = validate_accum_steps(accum_steps)
        variables = list(variables)
        super().__init__(name=name or "gradient_accumulator")
        self._variables = variables
        self._on_apply = []
        # Variables of the apply hooks' own windows, saved with the engine.
        self._hook_state = []
        # Which variables ever received a gradient, known at trace time: the
        # others get `None` at apply, as plain training gives them (so the
        # optimizer neither decays nor counts them, and warns as Keras does).
        self._received = [False] * len(variables)
        with tf.init_scope(), tf.name_scope(self.name):
            self._accum_steps = tf.Variable(
                accum_steps,
                dtype=tf.int64,
                trainable=False,
                name="accum_steps",
                synchronization=_ON_READ,
                aggregation=_FIRST,
            )
            # The window length is latched when a window opens, so that
            # changing `accum_steps` mid-window takes effect at the next one.
            self._window_steps = self._counter("window_steps", accum_steps)
            self._micro_step = self._counter("micro_step")
            self._contributed = self._counter("contributed_steps")
            self._skipped = self._counter("skipped_steps")
            self._weight_sum = tf.Variable(
                0.0,
                dtype=tf.float32,
                trainable=False,
                name="weight_sum",
                synchronization=_ON_READ,
                aggregation=_SUM,
            )
            self._accumulators = [
                tf.Variable(
                    tf.zeros(v.shape, tf.float32),
                    trainable=False,
                    name="gradient_accumulator",
                    synchronization=_ON_READ,
                    aggregation=_SUM,
                )
                for v in variables
            ]

    def _counter(self, name, initial=0):
        return tf.Variable(
            initial,
            dtype=tf.int64,
            trainable=False,
            name=name,
            synchronization=_ON_READ,
            aggregation=_FIRST,
        )

    # Read-only views of the state.

    @property
    def variables_to_update(self):
        """The variables this accumulator serves, in gradient order."""
        return list(self._variables)

    @property
    def accumulators(self):
        """The float32 accumulators, one per variable (training state).

        They hold the open window's weighted sums; between windows they hold
        the last window's, which the next contribution overwrites.
        """
        return list(self._accumulators)

    @property
    def state_variables(self):
        """Every variable of the state, for saving and restoring it."""
        return [
            self._micro_step,
            self._window_steps,
            self._contributed,
            self._skipped,
            self._weight_sum,
        ] + self._accumulators + self._hook_state

    @property
    def accum_steps(self):
        """Int. Micro-batches per update; set it to change the next window."""
        return int(self._accum_steps.numpy())

    @accum_steps.setter
    def accum_steps(self, value):
        value = validate_accum_steps(value)
        self._accum_steps.assign(value)
        # Between windows the next one is not open yet: it takes the value.
        if int(self._micro_step.read_value()) == 0:
            self._window_steps.assign(value)

    @property
    def micro_step(self):
        """Int64 tensor. Micro-batches seen in the current window."""
        return self._micro_step.read_value()

    @property
    def weight_sum(self):
        """Float32 tensor. Sum of the weights accumulated in this window."""
        return self._weight_sum.read_value()

    @property
    def skipped_steps(self):
        """Int64 tensor. Micro-batches left out for non-finite gradients."""
        return self._skipped.read_value()

    def add_apply_hook(self, fn, state=()):
        """Registers `fn()` to run inside the branch that applies a window.

        Used for state that must change once per update rather than once per
        micro-batch (for example pooled BatchNormalization statistics).

        Args:
            fn: Callable without arguments.
            state: Variables that hold the hook's part of the open window
                (all zeros when it is empty). They join `state_variables`, so
                an open window is saved and restored whole, and `reset()`
                zeroes them.
        """
        self._on_apply.append(fn)
        self._hook_state.extend(state)

    # The state machine.

    def accumulate(self, grads, weight=1.0, is_finite=None):
        """Adds one micro-batch's gradients, weighted, to the window.

        Does not apply anything; `step()` does both.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`),
                one per variable, of the micro-batch's *mean* loss, unscaled
                (`step()` takes those of a loss-scaled loss).
            weight: Float scalar. What that mean divided by (its number of
                samples by default).
            is_finite: Optional bool scalar tensor. When False the micro-batch
                is left out (its weight does not count), but it still takes
                its place in the window.
        """
        weight = tf.cast(weight, tf.float32)
        self._accumulate(grads, weight, weighted=False, is_finite=is_finite)

    def step(self, grads, optimizer, weight=1.0, is_finite=None):
        """Accumulates `grads` and applies the window when it is full.

        With a `LossScaleOptimizer`, `grads` are what that optimizer's own
        apply takes: under Keras 3 the gradients of
        `optimizer.scale_loss(loss)`, under tf_keras those of
        `optimizer.get_scaled_loss(loss)` passed through
        `optimizer.get_unscaled_gradients`. Each micro-batch is then unscaled
        in float32 with the scale it was computed with, a micro-batch whose
        gradients are not all finite (on any replica) is left out of its
        window (counted in `skipped_steps`), and the dynamic scale moves once
        per micro-batch, as `AccumModel` does (see the README, "Mixed
        precision"). Under Keras 3 in a `tf.function`, build the optimizer
        before the first trace (`optimizer.build(variables)`): an unbuilt
        one's `scale_loss` multiplies by its initial scale as a constant.

        Args:
            grads: As in `accumulate()`.
            optimizer: The optimizer to apply the mean with (Keras 3 or
                tf_keras), called once per window.
            weight: As in `accumulate()`.
            is_finite: As in `accumulate()`.

        Returns:
            A bool scalar tensor: whether this call closed a window.

        Raises:
            ValueError: If `grads` does not hold one gradient per variable,
                or if a Keras 3 `LossScaleOptimizer` is not built yet when
                the step is traced.
        """
        from accum_model import _keras

        adapter = _keras.ADAPTER
        scaling = adapter.is_loss_scale_optimizer(optimizer)
        # Checked before the loss scale moves or the optimizer is built.
        grads = self._checked(grads)
        if (
            scaling
            and not tf.executing_eagerly()
            and not adapter.loss_scale_is_variable(optimizer)
        ):
            raise ValueError(
                "`optimizer` must be built before a step that scales its "
                "loss is traced: until then Keras 3's `scale_loss` "
                "multiplies by the initial scale as a constant, which would "
                "stay in the traced step while the scale moves. Call "
                "`optimizer.build(variables)` first. Received: an unbuilt "
                f"{type(optimizer).__name__}"
            )
        self._build_optimizer(optimizer)
        if scaling:
            weight = tf.cast(weight, tf.float32)
            grads, finite = _mixed_precision.unscale_and_check(
                grads,
                weight / adapter.applied_gradient_scale(optimizer),
                adapter.dynamic_loss_scale(optimizer),
            )
            if is_finite is not None:
                finite = tf.logical_and(finite, is_finite)
            self.accumulate_weighted(grads, weight, is_finite=finite)
        else:
            self.accumulate(grads, weight, is_finite=is_finite)
        return self.close_window_if_full(_optimizer_apply_fn(optimizer))

    def apply(self, optimizer):
        """Applies the weighted mean of what was accumulated, then zeroes.

        A no-op when nothing was accumulated since the last apply.

        Args:
            optimizer: The optimizer to apply the mean with.

        Returns:
            A bool scalar tensor: whether a window was closed.
        """
        self._build_optimizer(optimizer)
        return self.close_window_if(
            self._micro_step > 0, _optimizer_apply_fn(optimizer)
        )

    def _build_optimizer(self, optimizer):
        # Keras optimizers create their slots on their first apply. Here that
        # is inside the apply branch, and under a strategy that branch runs
        # in `merge_call`, where a traced function cannot lift new variables
        # out of the `tf.cond` ("You must feed a value for placeholder").
        # Build them first, eagerly and in cross-replica context.
        from accum_model import _keras

        def build(*_):
            with tf.init_scope():
                _keras.ADAPTER.build_optimizer(optimizer, self._variables)

        if _in_replica_context_of_strategy():
            tf.distribute.get_replica_context().merge_call(build)
        else:
            build()

    def reset(self):
        """Discards the open window without applying it."""
        self._reset_window()
        for v in self._hook_state:
            v.assign(tf.zeros_like(v))

    def _reset_window(self):
        # The next window's length is latched here, when the last one ends,
        # rather than tested on every micro-batch.
        self._window_steps.assign(self._accum_steps.read_value())
        for v in [self._micro_step, self._contributed]:
            v.assign(tf.zeros_like(v))
        self._weight_sum.assign(0.0)

    # Used by `AccumModel`, which folds the weight into the loss before the
    # tape: one multiply on a scalar instead of one per gradient element.

    def accumulate_weighted(self, weighted_grads, weight, is_finite=None):
        """Like `accumulate()`, for gradients already multiplied by `weight`."""
        weight = tf.cast(weight, tf.float32)
        self._accumulate(
            weighted_grads, weight, weighted=True, is_finite=is_finite
        )

    def close_window_if_full(self, apply_fn):
        """Closes the window when it holds `window_steps` micro-batches."""
        return self.close_window_if(
            self._micro_step >= self._window_steps, apply_fn
        )

    def close_window_if(self, should_close, apply_fn):
        """Applies and zeroes the window when `should_close` holds.

        Args:
            should_close: Bool scalar tensor (equal on every replica).
            apply_fn: `apply_fn(grads, variables)` applies one update; called
                in replica context, at most once, inside the taken branch.

        Returns:
            `should_close`.
        """
        # Everything a close does happens inside its branch, so a micro-batch
        # that does not close a window runs no op of it (engine alone, 2-core
        # CPU: such steps 2-3% faster; within the noise of a whole fit step).
        # A window whose micro-batches were all left out applies nothing. No
        # pass over the accumulators: the next window's first contribution
        # overwrites them (see `_accumulate`).
        _close_if(
            should_close,
            apply_if=lambda: self._contributed > 0,
            apply_fn=lambda: self._apply_mean(apply_fn),
            then=self._reset_window,
        )
        return should_close

    def _apply_mean(self, apply_fn):
        # In replica context. The weight sum is global: replicas may hold
        # unequal (even empty) shards of a global batch.
        weight_sum = self._weight_sum.read_value()
        if tf.distribute.has_strategy():
            weight_sum = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, weight_sum
            )
        # One multiply per element; a zero weight sum (all samples weighted
        # 0) gives a zero gradient, as the large batch's zero loss would.
        inverse = tf.math.divide_no_nan(1.0, weight_sum)
        grads = [
            tf.cast(acc * inverse, v.dtype)
            if received
            else None
            for acc, v, received in zip(
                self._accumulators, self._variables, self._received
            )
        ]
        apply_fn(grads, self._variables)
        for hook in self._on_apply:
            hook()

    def _checked(self, grads):
        grads = list(grads)
        if len(grads) != len(self._accumulators):
            raise ValueError(
                "`grads` must hold one gradient per variable of the "
                f"accumulator ({len(self._accumulators)}). "
                f"Received: {len(grads)} gradients"
            )
        return grads

    def _accumulate(self, grads, weight, weighted, is_finite):
        grads = self._checked(grads)
        for i, g in enumerate(grads):
            if g is not None:
                self._received[i] = True

        # The window's first contribution overwrites what the last window
        # left: one pass per micro-batch and none to zero the accumulators.
        # One `tf.cond` for all variables keeps it one op per step.
        # Measured (benchmarks/bench_fit.py's MLP, 5.3M parameters, B=32,
        # N=4, 2-core CPU, CPU time per micro-step, interleaved medians):
        # this costs 1.7 ms over the floor's 10.6 ms (1.3 ms under XLA), the
        # price of reading `g` and `acc` and writing `acc` once. The
        # branch-free `acc.assign(g + keep * acc)` was 3 ms slower without
        # XLA (two temporaries) and equal under XLA; always `assign_add`, with
        # zeroing in the apply branch, was 0.6 ms slower without XLA and
        # 2.5 ms slower under XLA.
        first = tf.equal(self._contributed, 0)
        dense, sparse, absent = [], [], []
        for acc, g in zip(self._accumulators, grads):
            if g is None:
                absent.append(acc)
            elif isinstance(g, tf.IndexedSlices):
                values = tf.cast(g.values, tf.float32)
                if not weighted:
                    values = values * weight
                sparse.append((acc, tf.IndexedSlices(values, g.indices)))
            else:
                g = tf.cast(g, tf.float32)
                dense.append((acc, g if weighted else g * weight))

        def overwrite():
            for acc, g in dense:
                acc.assign(g)
            for acc in absent + [acc for acc, _ in sparse]:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        def add_to():
            for acc, g in dense:
                acc.assign_add(g)
            return tf.constant(True)

        def add():
            tf.cond(first, overwrite, add_to)
            for acc, g in sparse:
                acc.scatter_add(g)
            self._weight_sum.assign_add(weight)
            self._contributed.assign_add(1)
            return tf.constant(True)

        if is_finite is None:
            add()
        else:

            def skip():
                self._skipped.assign_add(1)
                return tf.constant(False)

            tf.cond(is_finite, add, skip)
        self._micro_step.assign_add(1)


def _in_xla_context():
    """Whether the graph being traced is compiled by XLA (`jit_compile`)."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # A TensorFlow without it: use `tf.cond`.
        return False
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def _run_if(pred, fn):
    """Runs `fn()` (no outputs) when the bool scalar `pred` holds."""
    if _in_xla_context():
        # XLA turns a conditional whose branches are elementwise, as an
        # optimizer update is, into a select of both: the update would run on
        # every micro-batch (measured on CPU, MLP with 5.3M parameters, AdamW,
        # N=4: AccumModel 0.8x plain fit). It never speculates a loop, so run
        # `fn` in one with a trip count of 0 or 1 (same MLP: 44 -> 32 ms per
        # micro-step).
        def body(i):
            fn()
            return i + 1

        tf.while_loop(
            lambda i: i < tf.cast(pred, tf.int32), body, [tf.constant(0)]
        )
        return

    def branch():
        fn()
        return tf.constant(True)

    tf.cond(pred, branch, lambda: tf.constant(False))


def _close_if(pred, apply_if, apply_fn, then):
    """When `pred`: `apply_fn()` if `apply_if()`, then `then()`.

    Safe when `apply_fn` all-reduces: under a strategy both conditions are
    taken in cross-replica context (the pattern of Keras'
    LossScaleOptimizer), so they are equal on every replica, and the
    functions run back in each replica. `apply_if` and `then` run only when
    `pred` holds.
    """

    def close(in_replicas):
        _run_if(apply_if(), lambda: in_replicas(apply_fn))
        in_replicas(then)

    if not _in_replica_context_of_strategy():
        _run_if(pred, lambda: close(lambda fn: fn()))
        return

    def merge_fn(strategy, pred):
        flag = strategy.experimental_local_results(pred)[0]
        _run_if(
            flag, lambda: close(strategy.extended.call_for_each_replica)
        )

    tf.distribute.get_replica_context().merge_call(merge_fn, args=(pred,))


def _optimizer_apply_fn(optimizer):
    from accum_model import _keras

    def apply_fn(grads, variables):
        _keras.ADAPTER.apply_gradients(optimizer, grads, variables)

    return apply_fn
