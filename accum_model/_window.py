"""The accumulation window: a small state machine over float32 variables.

Per micro-batch `k` of a window:

    acc      += w_k * g_k        (g_k: gradient of micro-batch k's mean loss)
    weight   += w_k              (w_k: the normalizer that loss divided by)
    step     += 1
    if step == window_steps:     apply acc / weight once, then zero weight and
                                 step (the next window's first micro-batch
                                 overwrites acc instead of adding to it)

so the applied gradient is `sum_k w_k g_k / sum_k w_k`, the gradient of the
large batch's loss, whatever the sizes of the micro-batches.

This module knows TensorFlow and `tf.distribute`, and nothing of Keras: what
an update does is the `apply_fn` its caller hands to a close.
"""

import numbers

import numpy as np
import tensorflow as tf

from accum_model import _control_flow
from accum_model import _noise_scale

_ON_READ = tf.VariableSynchronization.ON_READ
_SUM = tf.VariableAggregation.SUM
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA

# The last variables of `Window.state_variables` that files saved by earlier
# versions lack: which variables received gradients (then known again from
# the next traced step) and the count of discarded windows (then 0).
APPENDED_STATE_COUNT = 2


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


class Window(tf.Module):
    """The state of one accumulation window and its transitions.

    Created under `strategy.scope()` its variables are per-replica (summed on
    read); gradients cross replicas only in the update a close applies.

    Args:
        variables: List of variables whose gradients are accumulated, in the
            order gradients will be given.
        accum_steps: Int >= 1. Micro-batches per window.
        noise_scale: `False` (default), `True` or an
            `accum_model.NoiseScale`: also measure the gradient noise scale
            of the windows (`_noise_scale`). Off, no op is added.
        name: Optional name of the module.

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1.
        TypeError: If `noise_scale` is not one of the above.
    """

    # Whether a close checks that the window is finite; off only in
    # benchmarks/bench_fit.py (`--finite_check_cost`), to time the check.
    _check_finite = True

    def __init__(self, variables, accum_steps=1, noise_scale=False, name=None):
        accum_steps = validate_accum_steps(accum_steps)
        noise_scale = _noise_scale.as_config(noise_scale)
        variables = list(variables)
        super().__init__(name=name or "gradient_accumulator")
        self._variables = variables
        self._on_apply = []
        # Variables of the apply hooks' own windows, saved with the engine.
        self._hook_state = []
        # Which variables ever received a gradient: the others get `None` at
        # apply, as plain training gives them (so the optimizer neither
        # decays nor counts them, and warns as Keras does). Known when a
        # step is traced, and saved (`_received_flags`) so that a restored
        # window can be applied before any step is traced.
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
            self._discarded = self._counter("discarded_windows")
            self._received_flags = tf.Variable(
                tf.zeros([len(variables)], tf.int64),
                trainable=False,
                name="received",
                synchronization=_ON_READ,
                aggregation=_FIRST,
            )
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
        self._noise_scale = None
        if noise_scale is not None:
            with tf.init_scope():
                self._noise_scale = _noise_scale.NoiseScaleEstimator(
                    noise_scale
                )

    def _counter(self, name, initial=0):
        return tf.Variable(
            initial,
            dtype=tf.int64,
            trainable=False,
            name=name,
            synchronization=_ON_READ,
            aggregation=_FIRST,
        )

    # Public, read-mostly views of the state.

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

    @property
    def discarded_windows(self):
        """Int64 tensor. Windows not applied: their gradients were not finite.

        A window whose accumulated gradients hold an `inf` or `NaN` (on any
        replica) is discarded whole when it closes, whatever closes it, and
        counted here; the weights stay those of the last finite update.
        """
        return self._discarded.read_value()

    @property
    def noise_scale(self):
        """The gradient noise scale measurement, or None when off.

        Its tensors `b_simple` (`tr(Sigma) / |G|^2`, in the unit of the
        weights), `trace_sigma` and `grad_sq_norm` (smoothed over measured
        windows), `micro_batch_weight`, `window_weight`, the last window's
        `last_trace_sigma` and `last_grad_sq_norm`, and the int
        `measurements`. See docs/noise_scale.md.
        """
        return self._noise_scale

    def reset(self):
        """Discards the open window without applying it."""
        self._reset_window(closed=False)
        for v in self._hook_state:
            v.assign(tf.zeros_like(v))

    @property
    def state_variables(self):
        """Every variable of the open window's state, in a fixed order.

        What a checkpoint of the window must hold (`AccumModel` saves them
        with the model); also what the accumulation costs in memory.
        """
        # Appended ones last: a file saved without them still loads (see
        # `APPENDED_STATE_COUNT`).
        return (
            [
                self._micro_step,
                self._window_steps,
                self._contributed,
                self._skipped,
                self._weight_sum,
            ]
            + self._accumulators
            + self._hook_state
            + (
                []
                if self._noise_scale is None
                else self._noise_scale.state_variables
            )
            + [
                self._received_flags,
                self._discarded,
            ]
        )

    # For the package's front ends (`GradientAccumulator`, `AccumModel`) and
    # the layers that keep a window of their own (`AccumBatchNormalization`).

    def _add_apply_hook(self, fn, state=()):
        """Registers `fn()` to run inside the branch that applies a window.

        For state that must change once per update rather than once per
        micro-batch (pooled BatchNormalization statistics).

        Args:
            fn: Callable without arguments.
            state: Variables that hold the hook's part of the open window
                (all zeros when it is empty). They are saved and restored
                with the window, and `reset()` zeroes them.
        """
        self._on_apply.append(fn)
        self._hook_state.extend(state)

    def _checked(self, grads):
        grads = list(grads)
        if len(grads) != len(self._accumulators):
            raise ValueError(
                "`grads` must hold one gradient per variable of the "
                f"accumulator ({len(self._accumulators)}). "
                f"Received: {len(grads)} gradients"
            )
        return grads

    def _add(self, grads, weight, weighted, is_finite=None):
        """Adds one micro-batch to the window.

        Args:
            grads: One gradient (tensor, `tf.IndexedSlices` or `None`) per
                variable, of the micro-batch's mean loss; already multiplied
                by `weight` when `weighted`.
            weight: Float32 scalar, what that mean divided by.
            weighted: Bool (Python).
            is_finite: Optional bool scalar tensor. When False the
                micro-batch is left out (its weight does not count), but it
                still takes its place in the window.
        """
        grads = self._checked(grads)
        weight = tf.cast(weight, tf.float32)
        # Python state, shared by the replicas' traces: only ever grows, and
        # every replica computes the same union, whatever the trace order.
        self._received = [
            r or g is not None for r, g in zip(self._received, grads)
        ]
        received_flags = tf.constant([int(r) for r in self._received], tf.int64)

        # The window's first contribution overwrites what the last window
        # left, so no pass is spent zeroing the accumulators; one `tf.cond`
        # for all variables keeps it one op per step.
        first = tf.equal(self._contributed, 0)
        dense, sparse, absent, measured = [], [], [], []
        for acc, g in zip(self._accumulators, grads):
            if g is None:
                absent.append(acc)
            elif isinstance(g, tf.IndexedSlices):
                values = tf.cast(g.values, tf.float32)
                measured.append(tf.IndexedSlices(values, g.indices))
                if not weighted:
                    values = values * weight
                sparse.append((acc, tf.IndexedSlices(values, g.indices)))
            else:
                g = tf.cast(g, tf.float32)
                measured.append(g)
                dense.append((acc, g if weighted else g * weight))

        def overwrite():
            # Once per window, before anything of it can be saved.
            self._received_flags.assign(received_flags)
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
            if self._noise_scale is not None:
                # Float32, unscaled, before any clipping; only what joins
                # the window (a skipped micro-batch never gets here).
                self._noise_scale.add(
                    measured, weight, weighted, _control_flow.run_if
                )
            return tf.constant(True)

        if is_finite is None:
            add()
        else:

            def skip():
                self._skipped.assign_add(1)
                return tf.constant(False)

            tf.cond(is_finite, add, skip)
        self._micro_step.assign_add(1)

    def _receiving(self):
        """Per variable: whether it gets a gradient at apply (trace time).

        What traced steps have seen, joined with what was saved: a window
        restored from a file or checkpoint is applicable before any step.
        """
        if all(self._received):
            return self._received
        # Read eagerly, without `merge_call`: under a strategy every replica
        # reads its own copy (all equal), so the replicas' traces stay alike
        # whichever of them updates the shared Python list first.
        with tf.init_scope():
            saved = self._received_flags.numpy()
        self._received = [r or bool(s) for r, s in zip(self._received, saved)]
        return self._received

    def _all_finite(self):
        """Bool scalar: whether the window is finite on every replica.

        In replica context, once per window. Under a strategy the replicas'
        counts are summed, so the decision is the same on every replica.
        """
        accumulators = self._accumulators + [self._weight_sum]

        def exact():
            # Under XLA, reductions of values the close's loop does not
            # change would be hoisted out of it, onto every micro-batch.
            # Scaled by a counter the close resets, they stay in the loop; a
            # factor of 0 or 1 keeps every element's finiteness.
            live = tf.cast(self._micro_step > 0, tf.float32)
            bad = [
                tf.logical_not(tf.reduce_all(tf.math.is_finite(v * live)))
                for v in accumulators
            ]
            return tf.reduce_sum(tf.cast(tf.stack(bad), tf.float32))

        # A finite sum proves every element finite (an inf or NaN makes it
        # inf or NaN), with one read of each accumulator and no temporary.
        # Only a sum that is not finite (a non-finite element, or finite
        # values summing past float32's range) pays for the exact count.
        sums = tf.stack([tf.reduce_sum(v) for v in accumulators])
        sums_finite = tf.reduce_all(tf.math.is_finite(sums))
        if _control_flow.in_xla_context():
            # XLA would run both branches of a conditional.
            bad = exact()
        else:
            bad = tf.cond(sums_finite, lambda: tf.constant(0.0), exact)
        if _control_flow.in_replica_context_of_strategy():
            bad = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, bad
            )
        return tf.equal(bad, 0.0)

    def _discard(self):
        self._discarded.assign_add(1)

    def _close_if_full(self, apply_fn):
        """Closes the window when it holds `window_steps` micro-batches."""
        return self._close_if(self._micro_step >= self._window_steps, apply_fn)

    def _close_if(self, should_close, apply_fn):
        """Applies and empties the window when `should_close` holds.

        Args:
            should_close: Bool scalar tensor (equal on every replica).
            apply_fn: `apply_fn(grads, variables)` applies one update; called
                in replica context, at most once, inside the taken branch.

        Returns:
            `should_close`.
        """
        # Everything a close does happens inside its branch, so a micro-batch
        # that does not close a window runs none of it. A window whose
        # micro-batches were all left out applies nothing. No pass over the
        # accumulators: the next window's first contribution overwrites them.
        # A window that is not finite is discarded, never applied.
        receiving = self._receiving()
        _control_flow.close_if(
            should_close,
            apply_if=lambda: self._contributed > 0,
            apply_fn=lambda: self._apply_mean(apply_fn, receiving),
            then=self._reset_window,
            check=self._all_finite if self._check_finite else None,
            on_failed_check=self._discard,
        )
        return should_close

    def _apply_mean(self, apply_fn, receiving):
        # In replica context. The weight sum is global: replicas may hold
        # unequal (even empty) shards of a global batch.
        weight_sum = self._weight_sum.read_value()
        noise = self._noise_scale
        if noise is not None:
            # Before the update, from this replica's window.
            statistics = noise.statistics(self._accumulators, weight_sum)
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
        # One multiply per element; a zero weight sum (all samples weighted
        # 0) gives a zero gradient, as the large batch's zero loss would.
        inverse = tf.math.divide_no_nan(1.0, weight_sum)
        if not any(receiving):
            # No step of this engine, nor the state it was restored from, has
            # given a gradient: nothing was accumulated that could apply.
            return
        grads = [
            tf.cast(acc * inverse, v.dtype) if received else None
            for acc, v, received in zip(
                self._accumulators, self._variables, receiving
            )
        ]
        apply_fn(grads, self._variables)
        for hook in self._on_apply:
            hook()

    def _reset_window(self, closed=True):
        # The next window's length is latched here, when the last one ends,
        # rather than tested on every micro-batch.
        self._window_steps.assign(self._accum_steps.read_value())
        for v in [self._micro_step, self._contributed]:
            v.assign(tf.zeros_like(v))
        self._weight_sum.assign(0.0)
        if self._noise_scale is not None:
            self._noise_scale.reset_window(closed)
