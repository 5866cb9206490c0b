"""`GradientAccumulator`: the engine, a window of micro-batches.

Per micro-batch `k` of a window:

    acc      += w_k * g_k        (g_k: gradient of micro-batch k's mean loss)
    weight   += w_k              (w_k: the normalizer that loss divided by)
    step     += 1
    if step == window_steps:     apply acc / weight once, then zero weight and
                                 step (the next window's first micro-batch
                                 overwrites acc instead of adding to it)

so the applied gradient is `sum_k w_k g_k / sum_k w_k`, the gradient of the
large batch's loss, whatever the sizes of the micro-batches.

Both front ends drive it the same way: `AccumModel.train_step` and a custom
loop call `step` (one micro-batch in through `accumulate`, then a close if
the window is full), and the epoch-end flush and custom loops call `apply`.
Read top to bottom, this module is a micro-batch's path: into the window
(weighting, loss-scale unscaling, the finite check, the noise-scale sums),
then out of it (the finite check of the window, the mean, the optimizer).
Keras optimizers of either generation are reached through the adapter
(`_keras.ADAPTER`); loss-scale rules are in `_mixed_precision`, the
estimator in `_noise_scale`, AdaScale's gain in `_adascale`, the
conditionals in `_control_flow`.
"""

import tensorflow as tf

from accum_model import _adascale
from accum_model import _control_flow
from accum_model import _keras
from accum_model import _mixed_precision
from accum_model import _noise_scale
from accum_model._validation import check_accum_steps
from accum_model._validation import check_optimizer_not_accumulating

ADAPTER = _keras.ADAPTER

_ON_READ = tf.VariableSynchronization.ON_READ
_SUM = tf.VariableAggregation.SUM
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


def _variable(name, initial=0, aggregation=_FIRST, dtype=tf.int64):
    # Per-replica under a strategy: summed on read (`_SUM`) or the first
    # replica's (`_FIRST`, for values equal on every replica).
    return tf.Variable(
        initial,
        dtype=dtype,
        trainable=False,
        name=name,
        synchronization=_ON_READ,
        aggregation=aggregation,
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
        noise_scale: `False` (default), `True` or an
            `accum_model.NoiseScale(every=..., beta=...)`: measure the
            gradient noise scale of the windows, read from the
            `noise_scale` property (see docs/noise_scale.md).
        adascale: None (default) or an `accum_model.AdaScale(base_batch)`:
            multiply each update's learning rate by the AdaScale gain of
            its window (SGD only; see docs/adascale.md). Turns the noise
            scale on with its defaults when `noise_scale` is off.
        name: Optional name of the module.

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1, or if
            `adascale` is on and `noise_scale` measures less often than
            every window.
        TypeError: If `noise_scale` is not a bool, a `NoiseScale` or a dict,
            or `adascale` not an `AdaScale`, a dict or None.
    """

    def __init__(
        self,
        variables,
        accum_steps=1,
        noise_scale=False,
        name=None,
        adascale=None,
    ):
        accum_steps = check_accum_steps(accum_steps)
        adascale = _adascale.as_config(adascale)
        noise_scale = _adascale.measurement_for(
            adascale, _noise_scale.as_config(noise_scale)
        )
        variables = list(variables)
        super().__init__(name=name or "gradient_accumulator")
        self._variables = variables
        self._apply_hooks = []
        # Which variables ever received a gradient: the others get `None` at
        # apply, as plain training gives them (so the optimizer neither
        # decays nor counts them, and warns as Keras does). Known when a
        # step is traced, and saved (`_received_flags`) so that a restored
        # window can be applied before any step is traced.
        self._received = [False] * len(variables)
        with tf.init_scope(), tf.name_scope(self.name):
            # The setting, not state: a model restores it from its config.
            self._accum_steps = _variable("accum_steps", accum_steps)
            # The open window. Its length is latched when it opens, so that
            # changing `accum_steps` mid-window takes effect at the next one.
            self._window_steps = _variable("window_steps", accum_steps)
            self._micro_step = _variable("micro_step")
            self._contributed = _variable("contributed_steps")
            self._weight_sum = _variable("weight_sum", 0.0, _SUM, tf.float32)
            self._accumulators = [
                _variable(
                    "gradient_accumulator",
                    tf.zeros(v.shape, tf.float32),
                    _SUM,
                    tf.float32,
                )
                for v in variables
            ]
            # Over the engine's life.
            self._skipped = _variable("skipped_steps")
            self._discarded = _variable("discarded_windows")
            self._received_flags = _variable(
                "received", tf.zeros([len(variables)], tf.int64)
            )
            self._noise_scale = None
            if noise_scale is not None:
                self._noise_scale = _noise_scale.NoiseScaleEstimator(
                    noise_scale
                )
            self._adascale = None
            if adascale is not None:
                self._adascale = _adascale.AdaScaleState(adascale)
        # Variables of the apply hooks' own windows (`add_apply_hook`).
        self._hook_variables = []

    # The state, declared once: saving, restoring, resetting and the
    # memory count all derive from these two lists.

    @property
    def window_variables(self):
        """The variables of the open window that are zero when it is empty.

        Zeroed when a window closes and by `reset()`: the engine's counters
        and weight sum, the noise-scale sums and the apply hooks' windows.
        (The accumulators are not among them: the next window's first
        micro-batch overwrites them; nor is the latched window length.)
        """
        noise = self._noise_scale
        return (
            [self._micro_step, self._contributed, self._weight_sum]
            + ([] if noise is None else noise.window_variables)
            + self._hook_variables
        )

    @property
    def state_variables(self):
        """Every variable of the engine's state, in a fixed order.

        What a checkpoint of the engine must hold (`AccumModel` saves them
        with the model); also what the accumulation costs in memory.
        """
        noise = self._noise_scale
        lifetime = [self._skipped, self._discarded, self._received_flags]
        if noise is not None:
            # The estimator's own window sums are already listed.
            lifetime += noise.state_variables[len(noise.window_variables) :]
        if self._adascale is not None:
            lifetime += self._adascale.state_variables
        return (
            self.window_variables
            + [self._window_steps]
            + self._accumulators
            + lifetime
        )

    def reset(self):
        """Discards the open window without applying it."""
        self._end_window(closed=False)

    def _end_window(self, closed):
        # The next window's length is latched here, when the last one ends,
        # rather than tested on every micro-batch.
        self._window_steps.assign(self._accum_steps.read_value())
        for v in self.window_variables:
            v.assign(tf.zeros_like(v))
        if closed and self._noise_scale is not None:
            self._noise_scale.count_closed_window()

    # Read-mostly views of the state.

    @property
    def accum_steps(self):
        """Int. Micro-batches per update; set it to change the next window."""
        return int(self._accum_steps.numpy())

    @accum_steps.setter
    def accum_steps(self, value):
        value = check_accum_steps(value)
        self._accum_steps.assign(value)
        # Between windows the next one is not open yet: it takes the value.
        if int(self._micro_step.read_value()) == 0:
            self._window_steps.assign(value)

    @property
    def updated_variables(self):
        """The variables whose gradients are accumulated, in `grads` order."""
        return list(self._variables)

    @property
    def micro_step(self):
        """Int64 tensor. Micro-batches seen in the current window."""
        return self._micro_step.read_value()

    @property
    def weight_sum(self):
        """Float32 tensor. Sum of the weights accumulated in this window."""
        return self._weight_sum.read_value()

    @property
    def skipped_microbatches(self):
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

    @property
    def adascale(self):
        """The AdaScale state, or None when off.

        Its tensors `tau` (scale-invariant iterations), `gain` and
        `learning_rate` (of the last update). See docs/adascale.md.
        """
        return self._adascale

    def check_optimizer(self, optimizer):
        """Raises if `optimizer` cannot apply this engine's windows.

        With AdaScale on, only Keras' SGD can (see `AdaScale`); called by
        `step` and `apply` when they are traced, and by `AccumModel` before
        its train function is built.

        Raises:
            ValueError: As `accum_model.AdaScale`'s optimizer check.
        """
        check_optimizer_not_accumulating(optimizer)
        if self._adascale is not None:
            _adascale.check_optimizer(optimizer)

    def add_apply_hook(self, fn, state=()):
        """Registers `fn()` to run inside the branch that applies a window.

        For state that must change once per update rather than once per
        micro-batch (`AccumBatchNormalization`'s pooled statistics).

        Args:
            fn: Callable without arguments.
            state: Variables that hold the hook's part of the open window
                (all zeros when it is empty). They are saved and restored
                with the window, and zeroed when it ends.
        """
        self._apply_hooks.append(fn)
        self._hook_variables.extend(state)

    # The front ends: a micro-batch in, a window out.

    def step(
        self,
        grads,
        optimizer,
        weight=1.0,
        is_finite=None,
        loss_scale=None,
        jit_compile=None,
    ):
        """Accumulates `grads` and applies the window when it is full.

        With a `LossScaleOptimizer`, `grads` are what that optimizer's own
        apply takes: under Keras 3 the gradients of
        `optimizer.scale_loss(loss)`, under tf_keras those of
        `optimizer.get_scaled_loss(loss)` passed through
        `optimizer.get_unscaled_gradients`. Each micro-batch is then unscaled
        in float32 with the scale it was computed with, a micro-batch whose
        gradients are not all finite (on any replica) is left out of its
        window (counted in `skipped_microbatches`), and the dynamic scale
        moves once per micro-batch, as `AccumModel` does (see
        docs/numerics.md). Under
        Keras 3 in a `tf.function`, build the optimizer before the first
        trace (`optimizer.build(variables)`): an unbuilt one's `scale_loss`
        multiplies by its initial scale as a constant.

        Args:
            grads: As in `accumulate()`.
            optimizer: The optimizer to apply the mean with (Keras 3 or
                tf_keras), called once per window.
            weight: As in `accumulate()`.
            is_finite: As in `accumulate()`.
            loss_scale: As in `accumulate()`.
            jit_compile: As in `accumulate()`.

        Returns:
            A bool scalar tensor: whether this call closed a window.

        Raises:
            ValueError: If `grads` does not hold one gradient per variable,
                or if a Keras 3 `LossScaleOptimizer` is not built yet when
                the step is traced.
        """
        xla = _resolve_xla(jit_compile)
        # Before anything of the micro-batch runs.
        self.check_optimizer(optimizer)
        self.accumulate(
            grads,
            weight,
            is_finite,
            optimizer=optimizer,
            loss_scale=loss_scale,
            jit_compile=xla,
        )
        full = self._micro_step >= self._window_steps
        return self._close_if(full, optimizer, xla)

    def accumulate(
        self,
        grads,
        weight=1.0,
        is_finite=None,
        *,
        optimizer=None,
        loss_scale=None,
        jit_compile=None,
    ):
        """Adds one micro-batch's gradients, weighted, to the window.

        Does not apply anything; `step()` does both. The one way in for a
        micro-batch: its gradients are multiplied by `weight / loss_scale`
        in float32, checked under loss scaling, and added.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`),
                one per variable, of the micro-batch's *mean* loss times
                `loss_scale`.
            weight: Float scalar. What that mean divided by (its number of
                samples by default).
            is_finite: Optional bool scalar tensor. When False the micro-batch
                is left out (its weight does not count), but it still takes
                its place in the window.
            optimizer: Optional, the optimizer that will apply the window.
                A `LossScaleOptimizer` makes this a loss-scaled micro-batch
                (see `step()`): its finiteness is checked on every replica
                and the dynamic scale moves on by one micro-batch.
            loss_scale: Optional float32 scalar, what the differentiated loss
                was multiplied by: by default 1, or with a
                `LossScaleOptimizer` the scale its own apply expects. Pass
                `weight` itself (the same object) when the loss was
                multiplied by the weight: the gradients then go in as they
                are, without a multiply per element.
            jit_compile: Optional bool, whether the function being traced
                is compiled with XLA; by default read from the graph.

        Raises:
            ValueError: If `grads` does not hold one gradient per variable,
                or (with `optimizer`) as `step()` raises.
        """
        grads = self._checked(grads)
        xla = _resolve_xla(jit_compile)
        scaled = optimizer is not None and ADAPTER.is_loss_scale_optimizer(
            optimizer
        )
        if scaled:
            _check_loss_scale_readable(optimizer)
            self._build_optimizer(optimizer)
        # Every state change of a micro-batch (the loss scale's, the
        # window's) waits for its data: Keras runs the train function once
        # more at the end of an epoch of unknown length, and that call's
        # iterator runs dry. Ops that do not depend on the data (a counter's
        # increment) would still run in it; with this dependence none does,
        # and the close (which reads the counter) waits too. A gradient's
        # own addition depends on it already and runs as soon as it exists,
        # which frees it: only the other changes wait for all of them, so
        # the window never holds a micro-batch's gradients all at once. A
        # loss-scaled micro-batch must: its finite check reads them all.
        data = _data_of(grads, weight)
        with tf.control_dependencies(data if scaled else []):
            self._accumulate_after_data(
                grads,
                weight,
                is_finite,
                optimizer,
                scaled,
                loss_scale,
                xla,
                data,
            )

    def _accumulate_after_data(
        self, grads, weight, is_finite, optimizer, scaled, loss_scale, xla, data
    ):
        if scaled and loss_scale is None:
            loss_scale = ADAPTER.applied_gradient_scale(optimizer)
        # The one multiply of a micro-batch's gradients: by its weight, and
        # back from the scale its loss carried (a scale that changes
        # mid-window is harmless: the window holds unscaled gradients).
        if loss_scale is weight:
            factor = None
        elif loss_scale is None:
            factor = tf.cast(weight, tf.float32)
        else:
            factor = tf.cast(weight, tf.float32) / tf.cast(
                loss_scale, tf.float32
            )
        weight = tf.cast(weight, tf.float32)
        contributions = _times(grads, factor)
        if scaled:
            finite = _mixed_precision.all_replicas_finite(contributions)
            _mixed_precision.update_loss_scale(
                ADAPTER.dynamic_loss_scale(optimizer), finite
            )
            if is_finite is not None:
                finite = tf.logical_and(finite, is_finite)
            is_finite = finite
        self._add(contributions, weight, is_finite, xla, data)

    def apply(self, optimizer, jit_compile=None):
        """Applies the weighted mean of what was accumulated, then zeroes.

        A no-op when nothing was accumulated since the last apply.

        Args:
            optimizer: The optimizer to apply the mean with.
            jit_compile: As in `accumulate()`.

        Returns:
            A bool scalar tensor: whether a window was closed.
        """
        self.check_optimizer(optimizer)
        return self._close_if(
            self._micro_step > 0, optimizer, _resolve_xla(jit_compile)
        )

    # Into the window.

    def _checked(self, grads):
        grads = list(grads)
        if len(grads) != len(self._accumulators):
            raise ValueError(
                "`grads` must hold one gradient per variable of the "
                f"accumulator ({len(self._accumulators)}). "
                f"Received: {len(grads)} gradients"
            )
        return grads

    def _add(self, contributions, weight, is_finite, xla, data):
        """Adds one micro-batch's float32 `w_k g_k` to the window.

        `data`: the micro-batch's tensors that exist only once its data has
        come; every change that does not read a contribution waits for them.
        """
        # Python state, shared by the replicas' traces: only ever grows, and
        # every replica computes the same union, whatever the trace order.
        self._received = [
            r or c is not None for r, c in zip(self._received, contributions)
        ]
        received_flags = tf.constant([int(r) for r in self._received], tf.int64)

        # The window's first contribution overwrites what the last window
        # left, so no pass is spent zeroing the accumulators; one `tf.cond`
        # for all variables keeps it one op per step.
        first = tf.equal(self._contributed, 0)
        dense, sparse, absent = [], [], []
        for acc, c in zip(self._accumulators, contributions):
            if c is None:
                absent.append(acc)
            elif isinstance(c, tf.IndexedSlices):
                sparse.append((acc, c))
            else:
                dense.append((acc, c))

        def overwrite():
            for acc, c in dense:
                acc.assign(c)
            return tf.constant(True)

        def add_to():
            for acc, c in dense:
                acc.assign_add(c)
            return tf.constant(True)

        def start():
            # Once per window, before anything of it can be saved. Not in
            # `overwrite`: a control dependency inside a branch becomes an
            # input of the whole conditional, and every addition would wait
            # for all of the micro-batch's gradients.
            self._received_flags.assign(received_flags)
            for acc in absent + [acc for acc, _ in sparse]:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        def add():
            tf.cond(first, overwrite, add_to)
            with tf.control_dependencies(data):
                tf.cond(first, start, lambda: tf.constant(False))
                self._weight_sum.assign_add(weight)
                self._contributed.assign_add(1)
            for acc, c in sparse:
                acc.scatter_add(c)
            if self._noise_scale is not None:
                # Float32, unscaled, before any clipping; only what joins
                # the window (a skipped micro-batch never gets here).
                self._noise_scale.add(
                    contributions,
                    weight,
                    lambda pred, fn: _control_flow.run_if(pred, fn, xla),
                )
            return tf.constant(True)

        if is_finite is None:
            add()
        else:

            def skip():
                with tf.control_dependencies(data):
                    self._skipped.assign_add(1)
                return tf.constant(False)

            tf.cond(is_finite, add, skip)
        with tf.control_dependencies(data):
            self._micro_step.assign_add(1)

    # Out of it.

    def _close_if(self, should_close, optimizer, xla):
        """Applies and empties the window when `should_close` holds.

        Everything a close does happens inside its branch, so a micro-batch
        that does not close a window runs none of it. A window whose
        micro-batches were all left out applies nothing; one that is not
        finite is discarded, never applied. No pass over the accumulators:
        the next window's first contribution overwrites them.

        Args:
            should_close: Bool scalar tensor (equal on every replica).
            optimizer: The optimizer to apply the mean with.
            xla: Bool. Whether the graph is compiled by XLA.

        Returns:
            `should_close`.
        """
        self._build_optimizer(optimizer)
        receiving = self._receiving()
        _control_flow.close_if(
            should_close,
            apply_if=lambda: self._contributed > 0,
            apply_fn=lambda: self._apply_mean(optimizer, receiving, xla),
            then=lambda: self._end_window(closed=True),
            check=lambda: self._all_finite(xla),
            on_failed_check=lambda: self._discarded.assign_add(1),
            xla=xla,
        )
        return should_close

    def _build_optimizer(self, optimizer):
        """Creates the optimizer's slots now, if it has none.

        Keras optimizers create their slots on their first apply. Here that
        is inside the branch that closes a window, and under a strategy that
        branch runs in `merge_call`, where a traced function cannot lift new
        variables out of the conditional ("You must feed a value for
        placeholder"). So they are built first, eagerly (lifted out of any
        function being traced) and in cross-replica context.
        """
        if ADAPTER.optimizer_built(optimizer):
            return

        def build_now():
            with tf.init_scope():
                ADAPTER.build_optimizer(optimizer, self._variables)

        _control_flow.call_in_cross_replica_context(build_now)

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

    def _all_finite(self, xla):
        """Bool scalar: whether the window is finite on every replica.

        In replica context, once per window. Under a strategy the replicas'
        counts are summed, so the decision is the same on every replica.
        """
        accumulators = self._accumulators + [self._weight_sum]

        def exact():
            bad = [
                tf.logical_not(tf.reduce_all(tf.math.is_finite(v)))
                for v in self._kept_in_loop(accumulators)
            ]
            return tf.reduce_sum(tf.cast(tf.stack(bad), tf.float32))

        # A finite sum proves every element finite (an inf or NaN makes it
        # inf or NaN), with one read of each accumulator and no temporary.
        # Only a sum that is not finite (a non-finite element, or finite
        # values summing past float32's range) pays for the exact count.
        sums = tf.stack([tf.reduce_sum(v) for v in accumulators])
        sums_finite = tf.reduce_all(tf.math.is_finite(sums))
        if xla:
            # XLA would run both branches of a conditional.
            bad = exact()
        else:
            bad = tf.cond(sums_finite, lambda: tf.constant(0.0), exact)
        if _control_flow.in_replica_context_of_strategy():
            bad = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, bad
            )
        return tf.equal(bad, 0.0)

    def _kept_in_loop(self, accumulators):
        """The accumulators, as values XLA keeps inside the close's loop.

        XLA hoists work on values a loop does not change out of it, assuming
        the loop runs; the close's loop runs once a window, so a reduction
        over the accumulators would run on every micro-batch. Multiplied by
        a counter the close resets (1 here, as the close runs after a
        micro-batch), they are values the loop changes: exactly equal, and
        the multiply fuses into the reduction.
        """
        live = tf.cast(self._micro_step > 0, tf.float32)
        return [v * live for v in accumulators]

    def _apply_mean(self, optimizer, receiving, xla):
        # In replica context. The weight sum is global: replicas may hold
        # unequal (even empty) shards of a global batch.
        weight_sum = self._weight_sum.read_value()
        noise = self._noise_scale
        if noise is not None:
            # Before the update, from this replica's window.
            accumulators = self._accumulators
            if xla:
                accumulators = self._kept_in_loop(accumulators)
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
        # One multiply per element; a zero weight sum (all samples weighted
        # 0) gives a zero gradient, as the large batch's zero loss would.
        inverse = tf.math.divide_no_nan(1.0, weight_sum)
        if not any(receiving):
            # No step of this engine, nor the state it was restored from, has
            # given a gradient: nothing was accumulated that could apply.
            return
        if self._adascale is not None:
            # The gain is a learning-rate multiplier; for SGD (the only
            # optimizer allowed) it is the same on the gradient.
            inverse = inverse * self._adascale.factor(
                noise, weight_sum, optimizer
            )
        grads = [
            tf.cast(acc * inverse, v.dtype) if received else None
            for acc, v, received in zip(
                self._accumulators, self._variables, receiving
            )
        ]
        # Unscaled and checked already: a LossScaleOptimizer's inner
        # optimizer applies them.
        ADAPTER.apply_gradients(optimizer, grads, self._variables)
        for hook in self._apply_hooks:
            hook()


def _data_of(grads, weight):
    """The tensors of a micro-batch that exist only once its data has come."""
    tensors = [weight]
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            tensors.append(g.values)
        elif g is not None:
            tensors.append(g)
    return [t for t in tensors if isinstance(t, tf.Tensor)]


def _resolve_xla(jit_compile):
    if jit_compile is None:
        return _control_flow.in_xla_context()
    return bool(jit_compile)


def _times(grads, factor):
    """`grads` in float32, each multiplied by `factor` (None: by nothing)."""
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif isinstance(g, tf.IndexedSlices):
            # Sparse (embedding) gradients stay sparse: scale the rows only.
            values = tf.cast(g.values, tf.float32)
            if factor is not None:
                values = values * factor
            out.append(tf.IndexedSlices(values, g.indices, g.dense_shape))
        else:
            g = tf.cast(g, tf.float32)
            out.append(g if factor is None else g * factor)
    return out


def _check_loss_scale_readable(optimizer):
    if not tf.executing_eagerly() and not ADAPTER.loss_scale_is_variable(
        optimizer
    ):
        raise ValueError(
            "`optimizer` must be built before a step that scales its "
            "loss is traced: until then Keras 3's `scale_loss` "
            "multiplies by the initial scale as a constant, which would "
            "stay in the traced step while the scale moves. Call "
            "`optimizer.build(variables)` first. Received: an unbuilt "
            f"{type(optimizer).__name__}"
        )
