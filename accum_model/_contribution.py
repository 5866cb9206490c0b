"""One micro-batch into the window: its weighted gradients, added.

Per micro-batch, in replica context: the gradients times `weight` (unless
the loss carried it already, `weight_in_loss`) and divided by the loss
scale, in float32; under loss scaling the finite check on every replica
and the dynamic scale's move; then the additions to the accumulators, the
window's counters and the noise-scale sums. A micro-batch of weight 0 adds
zeros (its gradients times 0, or those of a loss times 0): nothing, unless
its gradients are not finite (a per-token mean over no token, 0 / 0, where
Keras' own losses divide with `divide_no_nan`), which the window's finite
check then discards with the window.
"""

import tensorflow as tf

from accum_model import _close
from accum_model import _control_flow
from accum_model import _keras
from accum_model import _mixed_precision

ADAPTER = _keras.ADAPTER


def add_microbatch(
    engine,
    grads,
    weight,
    is_finite,
    *,
    optimizer,
    loss_scale,
    weight_in_loss,
    xla,
    noise_statistics=None,
):
    """Adds one micro-batch to `engine`'s window (see the module).

    Args:
        engine: The `GradientAccumulator`.
        grads: One gradient per variable (tensor, `IndexedSlices`, None).
        weight: Float scalar `w_k`.
        is_finite: Optional bool scalar: False leaves the micro-batch out.
        optimizer: Optional optimizer of the window: a `LossScaleOptimizer`
            makes the micro-batch loss-scaled (checked for finite gradients
            on every replica, the dynamic scale moved).
        loss_scale: Optional scalar the loss was multiplied by (None: 1, or
            the `LossScaleOptimizer`'s scale).
        weight_in_loss: Whether the loss was multiplied by `weight`.
        xla: Bool, whether the graph is compiled by XLA.
        noise_statistics: Optional `(sum_k w_k |g_k|^2, micro-batches)` of
            `grads` that sum several micro-batches (see
            `GradientAccumulator.accumulate`).
    """
    scaled = optimizer is not None and ADAPTER.is_loss_scale_optimizer(
        optimizer
    )
    dynamic_loss_scale = None
    if scaled:
        check_loss_scale_readable(optimizer)
        _close.build_optimizer_in_cross_replica_context(
            optimizer, engine.updated_variables
        )
        if loss_scale is None:
            loss_scale = ADAPTER.applied_gradient_scale(optimizer)
        dynamic_loss_scale = ADAPTER.dynamic_loss_scale(optimizer)
    # Every state change of a micro-batch (the loss scale's, the window's)
    # waits for its data: Keras runs the train function once more at the
    # end of an epoch of unknown length, and that call's iterator runs dry.
    # Ops that do not depend on the data (a counter's increment) would still
    # run in it; with this dependence none does, and the close (which reads
    # the counter) waits too. A gradient's own addition depends on it
    # already and runs as soon as it exists, which frees it: only the other
    # changes wait for all of them, so the window never holds a
    # micro-batch's gradients all at once. A loss-scaled micro-batch must:
    # its finite check reads them all.
    data = _data_of(grads, weight)
    with tf.control_dependencies(data if scaled else []):
        weight = tf.cast(weight, tf.float32)
        factor = None if weight_in_loss else weight
        if loss_scale is not None:
            scale = tf.cast(loss_scale, tf.float32)
            factor = 1.0 / scale if factor is None else factor / scale
        contributions = in_float32(grads, factor)
        if scaled:
            finite = _mixed_precision.all_replicas_finite(contributions)
            _mixed_precision.update_loss_scale(dynamic_loss_scale, finite)
            if is_finite is not None:
                finite = tf.logical_and(finite, is_finite)
            is_finite = finite
        _add(
            engine,
            contributions,
            weight,
            is_finite,
            xla,
            data,
            noise_statistics,
        )


def _add(engine, contributions, weight, is_finite, xla, data, noise_statistics):
    """Adds one micro-batch's float32 `w_k g_k` to the window.

    `data`: the micro-batch's tensors that exist only once its data has
    come; every change that does not read a contribution waits for them.
    """
    received_flags = tf.constant([int(r) for r in engine._received], tf.int64)
    accumulators = engine._accumulators
    # The window's first contribution overwrites what the last window left,
    # so no pass is spent zeroing the accumulators; one `tf.cond` for all
    # variables keeps it one op per step.
    first = tf.equal(engine._contributed, 0)
    dense, sparse, absent = [], [], []
    for acc, c in zip(accumulators, contributions):
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

    def nothing():
        return tf.constant(False)

    def start():
        # Once per window, before anything of it can be saved. Not in
        # `overwrite`: a control dependency inside a branch becomes an
        # input of the whole conditional, and every addition would wait
        # for all of the micro-batch's gradients.
        engine._received_flags.assign(received_flags)
        for acc in absent + [acc for acc, _ in sparse]:
            acc.assign(tf.zeros_like(acc))
        return tf.constant(True)

    def add():
        # The one conditional around the additions: one nested in a branch
        # (or around this one) stays one op that waits for every gradient,
        # which would hold a micro-batch's gradients all at once.
        tf.cond(first, overwrite, add_to)
        with tf.control_dependencies(data):
            tf.cond(first, start, nothing)
            engine._weight_sum.assign_add(weight)
            engine._contributed.assign_add(1)
        for acc, c in sparse:
            acc.scatter_add(c)
        if engine._noise_scale is not None:
            # Float32, unscaled, before any clipping; only what joins the
            # window (a skipped micro-batch never gets here).
            engine._noise_scale.add(
                contributions,
                weight,
                lambda pred, fn: _control_flow.run_if(pred, fn, xla),
                noise_statistics,
            )
        return tf.constant(True)

    if is_finite is None:
        add()
    else:

        def skip():
            with tf.control_dependencies(data):
                engine._skipped.assign_add(1)
            return tf.constant(False)

        tf.cond(is_finite, add, skip)
    with tf.control_dependencies(data):
        engine._micro_step.assign_add(1)


def _data_of(grads, weight):
    """The tensors of a micro-batch that exist only once its data has come."""
    tensors = [weight]
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            tensors.append(g.values)
        elif g is not None:
            tensors.append(g)
    return [t for t in tensors if isinstance(t, tf.Tensor)]


def in_float32(grads, factor):
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


def check_loss_scale_readable(optimizer):
    """Raises if a Keras 3 `LossScaleOptimizer`'s scale is not a variable."""
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
