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
Its state is one `_engine_state.EngineState` (every variable declared by
name in `_state`); a micro-batch goes in through `_contribution`
(weighting, loss-scale unscaling, the finite check, the additions), a batch
in slices through `_slices`, and a window out through `_close.close_window`,
one function (the finite check, the mean, the noise scale, AdaScale's gain,
the optimizer, the hooks) run by one conditional (`_close.close_if`).
"""

import tensorflow as tf

from accum_model.core import _control_flow
from accum_model.core._validation import check_accum_steps
from accum_model.core._validation import check_optimizer_not_accumulating
from accum_model.engine import _adascale
from accum_model.engine import _close
from accum_model.engine import _contribution
from accum_model.engine import _engine_state
from accum_model.engine import _noise_scale
from accum_model.engine import _slices
from accum_model.engine import _state
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER


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
        super().__init__(name=name or "gradient_accumulator")
        # Every variable, by name (`_state`), tracked by checkpoints here.
        self.state = _state.WindowState()
        # What `_contribution` and `_close` are handed: the state's one
        # owner is this engine.
        self._engine = _engine_state.EngineState(
            self.state, variables, accum_steps, noise_scale, adascale
        )
        # Tracked under the names checkpoints have held the state by since
        # 0.1.0: `tf.train.Checkpoint` of a custom loop matches these paths
        # (by index), not `state`'s, which hold Keras' layer names.
        for name, value in self._engine.checkpoint_children().items():
            setattr(self, name, value)

    @property
    def state_variables(self):
        """Every saved variable of the engine's state (`self.state`).

        What a checkpoint of the engine holds (`AccumModel` saves them with
        the model, by name); also what the accumulation costs in memory.
        """
        return self.state.saved_variables()

    def reset(self):
        """Discards the open window without applying it.

        With it, what a batch cut short by an error had added (`fit` calls
        this when a training step fails part-way).
        """
        self._engine.reset()

    # Read-mostly views of the state.

    @property
    def accum_steps(self):
        """Int. Micro-batches per update; set it to change the next window."""
        # Read eagerly, also while a step is traced (Python decisions).
        with tf.init_scope():
            return int(self._engine.accum_steps.numpy())

    @accum_steps.setter
    def accum_steps(self, value):
        self._engine.set_accum_steps(check_accum_steps(value))

    @property
    def updated_variables(self):
        """The variables whose gradients are accumulated, in `grads` order."""
        return list(self._engine.variables)

    @property
    def micro_step(self):
        """Int64 tensor. Micro-batches seen in the current window."""
        return self._engine.micro_step.read_value()

    @property
    def weight_sum(self):
        """Float32 tensor. Sum of the weights accumulated in this window."""
        return self._engine.weight_sum.read_value()

    @property
    def skipped_microbatches(self):
        """Int64 tensor. Micro-batches left out for non-finite gradients."""
        return self._engine.skipped.read_value()

    @property
    def discarded_windows(self):
        """Int64 tensor. Windows discarded whole, not applied, as their
        gradients held an `inf` or `NaN` (on any replica) when they closed."""
        return self._engine.discarded.read_value()

    @property
    def noise_scale(self):
        """The `NoiseScaleEstimator`, or None when off (docs/noise_scale.md).

        Its tensors `b_simple`, `trace_sigma`, `grad_sq_norm`,
        `micro_batch_weight`, `window_weight`, `last_trace_sigma`,
        `last_grad_sq_norm`, and the int `measurements`.
        """
        return self._engine.noise_scale

    @property
    def adascale(self):
        """The `AdaScaleState` (`tau`, `gain`, `learning_rate` tensors), or
        None when off (docs/adascale.md)."""
        return self._engine.adascale

    def check_optimizer(self, optimizer):
        """Raises if `optimizer` cannot apply this engine's windows.

        Called by `step` and `apply` when they are traced.

        Raises:
            ValueError: If it accumulates gradients itself (Keras 3's
                `gradient_accumulation_steps`), or with AdaScale on, as
                `accum_model.AdaScale`'s optimizer check (SGD only).
        """
        check_optimizer_not_accumulating(optimizer)
        if self._engine.adascale is not None:
            _adascale.check_optimizer(optimizer)

    def add_apply_hook(self, fn):
        """Registers `fn()` to run inside the branch that applies a window.

        For state that must change once per update rather than once per
        micro-batch (`AccumBatchNormalization`'s pooled statistics, whose
        window it declares in `state`, `WindowState.declare_item`).

        Args:
            fn: Callable without arguments.
        """
        self._engine.apply_hooks.append(fn)

    def _checked_grads(self, grads):
        grads = list(grads)
        if len(grads) != len(self._engine.accumulators):
            raise ValueError(
                "`grads` must hold one gradient per variable of the "
                f"accumulator ({len(self._engine.accumulators)}). "
                f"Received: {len(grads)} gradients"
            )
        return grads

    def _checked_xla(self, optimizer, jit_compile):
        """Checks `optimizer`; whether the graph is compiled by XLA."""
        self.check_optimizer(optimizer)
        return _resolve_xla(jit_compile)

    # The front ends: a micro-batch in, a window out.

    def step(
        self,
        grads,
        optimizer,
        weight=1.0,
        is_finite=None,
        loss_scale=None,
        jit_compile=None,
        weight_in_loss=False,
        compile_update=True,
    ):
        """Accumulates `grads` and applies the window when it is full.

        With a `LossScaleOptimizer`, `grads` are what its own apply takes
        (Keras 3: the gradients of `optimizer.scale_loss(loss)`; tf_keras:
        of `get_scaled_loss`, through `get_unscaled_gradients`); each
        micro-batch is unscaled with its own scale, left out when not
        finite on some replica, and the scale moves once per micro-batch
        (docs/numerics.md). Under Keras 3 in a `tf.function`, build the
        optimizer before the first trace.

        Args:
            optimizer: The optimizer to apply the mean with (Keras 3 or
                tf_keras), called once per window.
            grads, weight, is_finite, loss_scale, jit_compile,
            weight_in_loss: As in `accumulate()`.
            compile_update: Bool (default True): the window's update is
                compiled with XLA apart in a graph XLA does not compile,
                outside a strategy (docs/semantics.md); False: as Keras.

        Returns:
            A bool scalar tensor: whether this call closed a window.

        Raises:
            ValueError: As `accumulate()`, as `check_optimizer()`, and if
                XLA cannot compile the update that `compile_update` asks for.
        """
        # Before anything of the micro-batch runs.
        xla = self._checked_xla(optimizer, jit_compile)
        self.accumulate(
            grads,
            weight,
            is_finite,
            optimizer=optimizer,
            loss_scale=loss_scale,
            jit_compile=xla,
            weight_in_loss=weight_in_loss,
        )
        full = self._engine.full()
        return _close.close_if(
            self._engine, full, optimizer, xla, compile_update
        )

    def accumulate(
        self,
        grads,
        weight=1.0,
        is_finite=None,
        *,
        optimizer=None,
        loss_scale=None,
        jit_compile=None,
        weight_in_loss=False,
    ):
        """Adds one micro-batch's gradients, weighted, to the window.

        Does not apply anything; `step()` does both. The one way in for a
        micro-batch: its gradients are multiplied by `weight / loss_scale`
        in float32 (not by `weight` when `weight_in_loss`), checked under
        loss scaling, and added. A micro-batch of weight 0 adds nothing.

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
                was multiplied by (besides `weight`): by default 1, or with a
                `LossScaleOptimizer` the scale its own apply expects.
            jit_compile: Optional bool, whether the function being traced
                is compiled with XLA; by default read from the graph.
            weight_in_loss: Bool (default False). True when the
                differentiated loss was multiplied by `weight` already (one
                scalar multiply instead of one per gradient element, as
                `AccumModel` does without loss scaling): the gradients then
                go in as they are, divided by `loss_scale` only.
        Raises:
            ValueError: If `grads` does not hold one gradient per variable,
                or (with `optimizer`) as `step()` raises.
        """
        grads = self._checked_grads(grads)
        # Known at trace time, shared by the replicas' traces.
        self._engine.received.note(grads)
        _contribution.add_microbatch(
            self._engine,
            grads,
            weight,
            is_finite,
            optimizer=optimizer,
            loss_scale=loss_scale,
            weight_in_loss=weight_in_loss,
            xla=_resolve_xla(jit_compile),
        )

    def batch_interrupted(self):
        """Bool: whether a step stopped part-way into its batch (eagerly).

        On any replica: its additions may be in the accumulators, the rest
        not (`reset` discards them).
        """
        return self._engine.batch_interrupted()

    def progress_variables(self):
        """`[micro_step, contributed_steps, batch sums]`: how far a step got
        (`_auto` reads them before and after an error, per replica)."""
        return self._engine.progress_variables()

    def batch_rows(self):
        """Float32 tensor: the rows of the open batch whose slices are in."""
        return self._engine.batch_rows()

    def add_slice(
        self,
        grads,
        weight,
        loss,
        *,
        rows,
        rows_end,
        scale=None,
        resumable=False,
    ):
        """Adds one slice of a batch that enters the window in slices.

        For a batch split inside the training step (`micro_batch_size`):
        each slice's gradients go into the accumulators in place, and the
        batch counts as one micro-batch once `end_batch` ends it.

        Args:
            grads: One gradient per variable, of the slice's loss times
                `weight` (or times `scale`, under loss scaling).
            weight: Float scalar `w_k`: what the slice's loss divided by.
            loss: The slice's loss, for the batch's logged loss.
            rows: Int scalar, the slice's rows.
            rows_end: Int scalar, the row of the batch it ends at.
            scale: None, or the loss scale the loss was multiplied by.
            resumable: Bool: the batch may run again after an out-of-memory
                error, and no row is added twice (docs/micro_batch.md).
        """
        grads = self._checked_grads(grads)
        _slices.add_slice(
            self._engine,
            grads,
            weight,
            loss,
            scale=scale,
            rows=rows,
            rows_end=rows_end,
            measure=self._engine.noise_scale is not None,
            resumable=resumable,
        )

    def end_batch(
        self,
        optimizer,
        *,
        summed=False,
        jit_compile=None,
        compile_update=True,
    ):
        """Ends a batch of slices: one micro-batch of the window; closes it
        when full.

        Args:
            optimizer: The optimizer of the window.
            summed: Bool: the batch's loss sums over its rows (reduction
                "sum"): its weight in the window is 1, not its slices' sum.
            jit_compile, compile_update: As in `step()`.

        Returns:
            `(loss, weight)`: float32 scalars, the batch's loss over all
            its slices and the weight of its mean.
        """
        xla = self._checked_xla(optimizer, jit_compile)
        dynamic = None
        if ADAPTER.is_loss_scale_optimizer(optimizer):
            dynamic = ADAPTER.dynamic_loss_scale(optimizer)
        loss, weight = _slices.end_batch(
            self._engine, summed=summed, dynamic_loss_scale=dynamic
        )
        full = self._engine.full()
        _close.close_if(self._engine, full, optimizer, xla, compile_update)
        return loss, weight

    def apply(self, optimizer, jit_compile=None, compile_update=True):
        """Applies the weighted mean of what was accumulated, then zeroes.

        A no-op when nothing was accumulated since the last apply.

        Args:
            optimizer: The optimizer to apply the mean with.
            jit_compile: As in `accumulate()`.
            compile_update: As in `step()`.

        Returns:
            A bool scalar tensor: whether a window was closed.
        """
        xla = self._checked_xla(optimizer, jit_compile)
        return _close.close_if(
            self._engine,
            self._engine.micro_step > 0,
            optimizer,
            xla,
            compile_update,
        )


def _resolve_xla(jit_compile):
    if jit_compile is None:
        return _control_flow.in_xla_context()
    return bool(jit_compile)
