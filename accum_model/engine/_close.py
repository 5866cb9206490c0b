"""A window out of the engine: `close_window`, once per update.

`GradientAccumulator` runs `close_window` in each replica when a window
closes (`close_if`: one conditional, `_control_flow.run_in_replicas_if`):
the finite check on every replica (`window_is_finite`), then, for a finite
window that holds data, the mean (`inverse_weight`: the one all-reduce of
the weight sum, which carries the noise scale's statistics, then AdaScale's
gain), the update (`update_function`: the mean and the optimizer's apply,
compiled with XLA where it can be) and the hooks; then the window ends.
Under XLA every read of the accumulators goes through `_kept_in_loop`.
"""

import tensorflow as tf

from accum_model.core import _control_flow
from accum_model.engine import _mixed_precision
from accum_model.keras import _adapter
from accum_model.keras._optimizers import (
    build_optimizer_in_cross_replica_context,
)

ADAPTER = _adapter.ADAPTER


def close_if(state, should_close, optimizer, xla, compile_update):
    """Closes `state`'s window (`close_window`) if `should_close` holds.

    Everything a close does happens inside the conditional, so a micro-batch
    that does not close a window runs none of it.

    Args:
        state: The engine's `EngineState`.
        should_close: Bool scalar tensor.
        optimizer: The optimizer to apply the mean with.
        xla: Bool, whether the graph is compiled by XLA.
        compile_update: Bool, as `GradientAccumulator.step` takes it.

    Returns:
        `should_close`.
    """
    build_optimizer_in_cross_replica_context(optimizer, state.variables)
    update = update_function(
        state, optimizer, state.received.at_apply(), xla, compile_update
    )
    _control_flow.run_in_replicas_if(
        should_close,
        lambda: close_window(state, optimizer, update, xla),
        xla,
    )
    return should_close


def close_window(state, optimizer, update, xla):
    """Closes `state`'s open window, in replica context.

    A window whose micro-batches were all left out applies nothing; one
    whose sums are not finite on some replica is discarded, never applied.
    Then the window ends; no pass over the accumulators: the next window's
    first contribution overwrites them.

    Args:
        state: The engine's `EngineState`.
        optimizer: The optimizer the window is applied with.
        update: What `update_function` returned for them, or None when no
            variable gets a gradient.
        xla: Bool, whether the graph is compiled by XLA.
    """
    has_data = state.contributed > 0
    finite = window_is_finite(state, xla)
    _control_flow.run_in_replicas_if(
        tf.logical_and(has_data, finite),
        lambda: _apply_mean(state, optimizer, update, xla),
        xla,
    )
    discarded = tf.logical_and(has_data, tf.logical_not(finite))
    state.discarded.assign_add(tf.cast(discarded, tf.int64))
    state.end_window(closed=True)


def _apply_mean(state, optimizer, update, xla):
    inverse = inverse_weight(state, optimizer, xla)
    if update is None:
        return
    update(inverse)
    for hook in state.apply_hooks:
        hook()


def update_function(state, optimizer, receiving, xla, compile_update):
    """The window's update, `update(inverse)`: applies `acc * inverse`.

    Compiled with XLA (one fused pass per variable, no temporaries) when
    `compile_update` asks for it, the step is traced in a graph XLA does not
    compile already, no `tf.distribute` strategy is in scope, and XLA runs
    on this platform (`_control_flow.xla_available`). An
    optimizer's apply is a dozen elementwise passes over every weight
    (AdamW reads and writes its two moments and the weight several times
    each), and the close runs it after the whole backward pass: nothing
    hides it, since the finite check needs the last gradient. Eagerly each
    close would compile anew, and under a strategy the apply updates every
    replica's copy through the strategy: both run as Keras runs them.

    Args:
        state: The engine's `EngineState`.
        optimizer: The optimizer to apply the mean with.
        receiving: Per variable, whether it gets a gradient (`receiving`).
        xla: Bool, whether the graph is compiled by XLA.
        compile_update: Bool, as `GradientAccumulator.step` takes it.

    Returns:
        A callable of the float32 scalar `inverse_weight`, or None when no
        step of the engine, nor the state it was restored from, has given a
        gradient (nothing was accumulated that could apply).
    """
    if not any(receiving):
        return None

    # Named so that TensorFlow's errors and profiles name it.
    def accum_model_window_update(inverse):
        grads = [
            tf.cast(acc * inverse, v.dtype) if received else None
            for acc, v, received in zip(
                state.accumulators, state.variables, receiving
            )
        ]
        # Unscaled and checked already: a LossScaleOptimizer's inner
        # optimizer applies them. In a scope: a function's root scope
        # refuses names that start with "_", as an optimizer's may.
        with tf.name_scope("update"):
            ADAPTER.apply_gradients(optimizer, grads, state.variables)

    if (
        compile_update
        and not xla
        and not tf.executing_eagerly()
        and not tf.distribute.has_strategy()
        and _control_flow.xla_available()
    ):
        cached = state.compiled_updates.get(optimizer, receiving)
        if cached is not None:
            # One compiled update per optimizer and variables receiving
            # gradients: retraces of the step (a new slice size, a new
            # `fit`) reuse its trace and XLA's compilation.
            return cached
        # An optimizer that creates its slots at its first apply (tf_keras)
        # creates them here, in the step being traced, as plain fit's
        # first trace does: TensorFlow then traces the step again, and a
        # layer that seeds each trace (tf_keras' Dropout) draws what it
        # draws in plain fit.
        ADAPTER.build_optimizer_in_trace(optimizer, state.variables)
        compiled = tf.function(accum_model_window_update, jit_compile=True)
        if not _check_xla_compiles(compiled):
            # Its slots were created by the step being traced: XLA cannot
            # read them yet, so a copy of the optimizer answers.
            _check_xla_compiles_copy(optimizer, state.variables, receiving)
        state.compiled_updates.put(optimizer, receiving, compiled)
        return compiled
    return accum_model_window_update


def _check_xla_compiles(function):
    """Raises, while the step is traced, if XLA cannot compile `function`.

    An optimizer with an op XLA has no kernel for (a `tf.py_function`, a
    string op) would otherwise fail at the first window's close, after its
    micro-batches were added: the window left full, unapplied. Converted to
    XLA's HLO here, outside the step's graph, nothing has run yet. The
    trace made here is the one the step's call reuses.

    Args:
        function: The update, a `tf.function` with `jit_compile=True`.

    Returns:
        True if XLA compiled it; False if it could not tell: variables
        created by the step being traced (a model built by its first step,
        tf_keras' optimizer slots) hold no value until the step runs.

    Raises:
        ValueError: If XLA cannot compile it, saying what to set.
    """
    spec = tf.TensorSpec([], tf.float32)
    with tf.init_scope():
        # Traced first, on its own: an error of the trace (not of XLA)
        # passes as it is.
        function.get_concrete_function(spec)
        return _compiles(lambda: function.experimental_get_compiler_ir(spec))


def _compiles(compiler_ir):
    """Whether XLA compiles what `compiler_ir()` returns the IR of."""
    try:
        compiler_ir()(stage="hlo")
    except (ValueError, tf.errors.OpError) as error:
        if "is_initialized" in str(error):
            return False
        raise ValueError(
            "The window's update (the optimizer's apply) is compiled "
            "with XLA when the train step is not, and XLA cannot compile "
            "this optimizer's. Pass `jit_compile=False` to `compile()` "
            "(AccumModel), or `compile_update=False` to `step()` and "
            "`apply()` (GradientAccumulator), to run it as Keras does. "
            f"XLA said: {error}"
        ) from None
    return True


def _check_xla_compiles_copy(optimizer, variables, receiving):
    """`_check_xla_compiles` of a copy of `optimizer`, on stand-ins.

    The ops XLA supports do not depend on the variables' shapes: a copy
    from the optimizer's config applies to one variable of one element per
    dtype, built eagerly. An optimizer that cannot be copied from its
    config is left to the first close.
    """
    inner = ADAPTER.inner_optimizer(optimizer)
    dtypes = sorted(
        {v.dtype for v, r in zip(variables, receiving) if r}, key=str
    )
    with tf.init_scope():
        # Eagerly: a config reads the learning rate's value.
        try:
            copy = type(inner).from_config(inner.get_config())
        except Exception:  # noqa: BLE001 - any optimizer's own config error
            return
        stand_ins = [tf.Variable(tf.zeros([1], d)) for d in dtypes]
        ADAPTER.build_optimizer_for_restore(copy, stand_ins)

        def apply():
            ADAPTER.apply_gradients(
                copy, [tf.zeros_like(v) for v in stand_ins], stand_ins
            )

        probe = tf.function(apply, jit_compile=True)
        _compiles(lambda: probe.experimental_get_compiler_ir())


def window_is_finite(state, xla):
    """Bool scalar: whether the window is finite on every replica.

    Under a strategy the replicas' counts are summed, so the decision is the
    same on every replica.
    """
    accumulators = state.accumulators + [state.weight_sum]

    def exact():
        return _mixed_precision.non_finite_count(
            _kept_in_loop(state, accumulators)
        )

    # A finite sum proves every element finite (an inf or NaN makes it inf
    # or NaN), with one read of each accumulator and no temporary. Only a
    # sum that is not finite (a non-finite element, or finite values
    # summing past float32's range) pays for the exact count.
    sums = tf.stack([tf.reduce_sum(v) for v in accumulators])
    sums_finite = tf.reduce_all(tf.math.is_finite(sums))
    if xla:
        # XLA would run both branches of a conditional.
        bad = exact()
    else:
        bad = tf.cond(sums_finite, lambda: tf.constant(0.0), exact)
    return _mixed_precision.none_on_any_replica(bad)


def _kept_in_loop(state, accumulators):
    """The accumulators, as values XLA keeps inside the close's loop.

    XLA hoists work on values a loop does not change out of it, assuming
    the loop runs; the close's loop runs once a window, so a reduction over
    the accumulators would run on every micro-batch. Multiplied by a
    counter the close resets (1 here, as the close runs after a
    micro-batch), they are values the loop changes: exactly equal, and the
    multiply fuses into the reduction.
    """
    live = tf.cast(state.micro_step > 0, tf.float32)
    return [v * live for v in accumulators]


def inverse_weight(state, optimizer, xla):
    """Float32 scalar the accumulators are multiplied by: `gain / W`.

    `W` is the window's weight summed over replicas (they may hold unequal,
    even empty, shards of a global batch); the noise-scale estimate of the
    window is taken on the way and AdaScale's gain (1 when off) multiplies
    it. A zero `W` (all samples weighted 0) gives a zero gradient, as the
    large batch's zero loss would.
    """
    weight_sum = state.weight_sum.read_value()
    noise = state.noise_scale
    if noise is not None:
        # Before the update, from this replica's window.
        accumulators = state.accumulators
        if xla:
            accumulators = _kept_in_loop(state, accumulators)
        statistics = noise.statistics(accumulators, weight_sum)
    replicas = 1
    if tf.distribute.has_strategy():
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        if noise is None:
            weight_sum = context.all_reduce(
                tf.distribute.ReduceOp.SUM, weight_sum
            )
        else:
            # The estimate's scalars ride the weight sum's all-reduce.
            summed = context.all_reduce(
                tf.distribute.ReduceOp.SUM,
                tf.concat([weight_sum[None], statistics], 0),
            )
            weight_sum, statistics = summed[0], summed[1:]
    if noise is not None:
        noise.update(statistics, weight_sum, replicas)
    inverse = tf.math.divide_no_nan(1.0, weight_sum)
    if state.adascale is not None:
        # The gain is a learning-rate multiplier; for SGD (the only
        # optimizer allowed) it is the same on the gradient.
        inverse = inverse * state.adascale.factor(noise, weight_sum, optimizer)
    return inverse
