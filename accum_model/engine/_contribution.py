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

from accum_model.core import _control_flow
from accum_model.engine import _mixed_precision
from accum_model.keras import _adapter
from accum_model.keras._optimizers import (
    build_optimizer_in_cross_replica_context,
)

ADAPTER = _adapter.ADAPTER


def add_microbatch(
    state,
    grads,
    weight,
    is_finite,
    *,
    optimizer,
    loss_scale,
    weight_in_loss,
    xla,
):
    """Adds one micro-batch to `state`'s window (see the module).

    Args:
        state: The engine's `EngineState`.
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
    """
    scaled = optimizer is not None and ADAPTER.is_loss_scale_optimizer(
        optimizer
    )
    dynamic_loss_scale = None
    if scaled:
        check_loss_scale_readable(optimizer)
        build_optimizer_in_cross_replica_context(optimizer, state.variables)
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
    data = data_of(grads, weight)
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
            state,
            contributions,
            weight,
            is_finite,
            xla,
            data,
        )


def _add(state, contributions, weight, is_finite, xla, data):
    """Adds one micro-batch's float32 `w_k g_k` to the window.

    `data`: the micro-batch's tensors that exist only once its data has
    come; every change that does not read a contribution waits for them.
    """
    # After the forward pass (the weight reads its output), before any
    # addition: an error from here to the end shows (`batch_interrupted`).
    with tf.control_dependencies([weight]):
        opened = state.batch_open.assign(1)
    # The window's first contribution overwrites what the last window left,
    # so no pass is spent zeroing the accumulators.
    with tf.control_dependencies([opened]):
        first = tf.equal(state.contributed, 0)

    added = []

    def add():
        added.extend(add_gradients(state, contributions, first, data))
        with tf.control_dependencies(data):
            state.weight_sum.assign_add(weight)
            state.contributed.assign_add(1)
        if state.noise_scale is not None:
            # Float32, unscaled, before any clipping; only what joins the
            # window (a skipped micro-batch never gets here).
            state.noise_scale.add(
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
                state.skipped.assign_add(1)
            return tf.constant(False)

        # The conditional ends after everything its branch changes.
        added = [tf.cond(is_finite, add, skip)]
    with tf.control_dependencies(data):
        step = state.micro_step.assign_add(1)
    # Closed once its additions are all in.
    with tf.control_dependencies([step] + added):
        state.batch_open.assign(0)


def add_gradients(state, contributions, first, data, guard=None):
    """Adds float32 contributions into the accumulators, in place.

    Where `first` holds (nothing of the window is in them yet) a dense
    accumulator is overwritten, and the flags of which variables receive
    gradients are set, the accumulators of sparse and absent gradients
    zeroed. Each addition runs as soon as its gradient exists, which frees
    it: the window never holds a slice's gradients all at once.

    Args:
        state: The engine's `EngineState`.
        contributions: One float32 contribution per variable (tensor,
            `IndexedSlices` or None).
        first: Bool scalar tensor.
        data: Tensors that exist once the data has come (see `_add`).
        guard: None, or `(rows_end, open)` for a batch that may be run again
            after an out-of-memory error (`_slices.add_slice`): each
            variable then adds only while it holds fewer rows than
            `rows_end`, and records
            `rows_end` after its addition, so that no row is ever added
            twice; `open` is the operation that marked the batch open,
            which every addition follows.

    Returns:
        The additions' outputs, to order what must follow all of them.
    """
    received_flags = state.received.seen_constant()
    dense, sparse, absent = [], [], []
    for i, (acc, c) in enumerate(zip(state.accumulators, contributions)):
        if c is None:
            absent.append(acc)
        elif isinstance(c, tf.IndexedSlices):
            sparse.append((i, acc, c))
        else:
            dense.append((i, acc, c))

    def nothing():
        return tf.constant(False)

    def start(zeroed):
        # Once per window, before anything of it can be saved. Not in the
        # dense branch: a control dependency inside a branch becomes an
        # input of the whole conditional, and every addition would wait
        # for all of the micro-batch's gradients.
        def fn():
            state.received.flags.assign(received_flags)
            for acc in zeroed:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return fn

    if guard is None:

        def overwrite():
            for _, acc, c in dense:
                acc.assign(c)
            return tf.constant(True)

        def add_to():
            for _, acc, c in dense:
                acc.assign_add(c)
            return tf.constant(True)

        # The one conditional around the additions: one nested in a branch
        # (or around this one) stays one op that waits for every gradient,
        # which would hold a micro-batch's gradients all at once.
        outputs = [tf.cond(first, overwrite, add_to)]
        with tf.control_dependencies(data):
            tf.cond(
                first, start(absent + [acc for _, acc, _ in sparse]), nothing
            )
        for _, acc, c in sparse:
            outputs.append(acc.scatter_add(c))
        return outputs

    rows_end, opened = guard
    with tf.control_dependencies(data + [opened]):
        # Absent gradients' accumulators stay zero: zeroed again, nothing
        # changes.
        outputs = [tf.cond(first, start(absent), nothing)]
    for i, acc, c in dense + sparse:
        outputs.append(
            _guarded_add(acc, c, state.rows_added[i], rows_end, first, opened)
        )
    return outputs


def _guarded_add(acc, contribution, rows_added, rows_end, first, opened):
    """One variable's addition of a slice ending at `rows_end`, at most once.

    One conditional per variable, with a counter of its own: a counter
    shared by the variables would order their additions one after another.
    """

    def add():
        # Nothing of the window in it yet: the first addition overwrites.
        empty = tf.logical_and(first, tf.equal(rows_added, 0))
        if isinstance(contribution, tf.IndexedSlices):

            def zero():
                acc.assign(tf.zeros_like(acc))
                return tf.constant(True)

            with tf.control_dependencies([tf.cond(empty, zero, _false)]):
                done = acc.scatter_add(contribution)
        else:

            def overwrite():
                acc.assign(contribution)
                return tf.constant(True)

            def add_to():
                acc.assign_add(contribution)
                return tf.constant(True)

            done = tf.cond(empty, overwrite, add_to)
        with tf.control_dependencies([done]):
            rows_added.assign(rows_end)
        return tf.constant(True)

    with tf.control_dependencies([opened]):
        pending = rows_added < rows_end
    return tf.cond(pending, add, _false)


def _false():
    return tf.constant(False)


def data_of(grads, weight):
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
