"""A batch that enters the window in slices (`micro_batch_size`).

Each slice's gradients go into the accumulators in place, each as soon as
it exists (`_contribution.add_gradients`), and its scalars into the
batch's sums (`_state.BATCH_SUMS`); `end_batch` then enters the batch into
the window as one micro-batch. A batch that may run again after an
out-of-memory error adds no row twice (`resumable`).
"""

import tensorflow as tf

from accum_model.engine import _contribution
from accum_model.engine import _mixed_precision
from accum_model.engine import _noise_scale
from accum_model.engine import _state

_ADDED = _state.BATCH_SUMS.index("added")


def add_slice(
    state,
    grads,
    weight,
    loss,
    *,
    scale,
    rows,
    rows_end,
    measure,
    resumable,
):
    """Adds one slice of a batch to the window (see `end_batch`).

    Its gradients go into the accumulators in place, each as soon as it
    exists; its scalars into the batch's sums (`_state.BATCH_SUMS`), in one
    operation after all of its additions, which is what marks its rows as
    in. Nothing of the window's own counters changes before `end_batch`.

    Args:
        state: The engine's `EngineState`.
        grads: One gradient per variable, of the slice's loss times its
            weight (or, with `scale`, times the loss scale).
        weight: Float32 scalar `w_k`, what the slice's loss divided by.
        loss: The slice's loss (any real dtype).
        scale: None, or the loss scale (float32 scalar) the loss was
            multiplied by instead of `weight`: the gradients are divided by
            it in float32, checked, and a slice that is not finite on this
            replica is left out (counted in `non_finite`).
        rows: Int64 scalar, the slice's rows.
        rows_end: Int64 scalar, the row of the batch the slice ends at.
        measure: Bool, whether to sum the noise scale's statistics.
        resumable: Bool. Whether the batch may run again after an
            out-of-memory error: each variable then records the rows it
            holds, and adds none twice (`_guarded_add`).
    """
    weight = tf.cast(weight, tf.float32)
    factor = None if scale is None else weight / tf.cast(scale, tf.float32)
    contributions = _contribution.in_float32(grads, factor)
    state.received.note(grads)
    data = _contribution.data_of(grads, weight)
    loss = tf.reduce_sum(tf.cast(loss, tf.float32))
    # A slice of no weight (an empty shard) has a 0/0 mean loss.
    weighted_loss = tf.where(weight > 0.0, weight * loss, 0.0)
    rows = tf.cast(rows, tf.float32)
    sums = state.batch_sums
    zero = tf.constant(0.0)

    def add():
        # After the forward pass (the weight reads its output), before any
        # addition; not after the gradients, which it would hold.
        with tf.control_dependencies([weight]):
            opened = state.batch_open.assign(1)
        with tf.control_dependencies([opened]):
            # Read before this slice's sums are added: all slices before it.
            first = tf.logical_and(
                tf.equal(state.contributed, 0),
                tf.equal(sums[_ADDED], 0.0),
            )
        guard = (tf.cast(rows_end, tf.int64), opened) if resumable else None
        outputs = _contribution.add_gradients(
            state, contributions, first, [weight], guard
        )
        q, n = zero, zero
        if measure:
            q, n = _noise_scale.microbatch_statistics(contributions, weight)
        with tf.control_dependencies(outputs):
            sums.assign_add(
                tf.stack([rows, weight, weight, weighted_loss, q, n, 1.0, zero])
            )
        return tf.constant(True)

    def skip():
        with tf.control_dependencies(data):
            sums.assign_add(
                tf.stack(
                    [rows, zero, weight, weighted_loss, zero, zero, zero, 1.0]
                )
            )
        return tf.constant(False)

    if scale is None:
        add()
    else:
        # This replica's own: no collective inside a batch's slices, whose
        # number may differ between replicas (an empty shard).
        finite = tf.equal(
            _mixed_precision.non_finite_count(_values(contributions)), 0.0
        )
        tf.cond(finite, add, skip)


def end_batch(state, *, summed, dynamic_loss_scale):
    """Ends the batch `add_slice` added: its sums into the window.

    The window's weight grows by the batch's `W` (`sum_k w_k` over the added
    slices; 1 for a loss that sums over the batch, `summed`, whose slices'
    gradients add up to the batch's), its counters by one micro-step; under
    loss scaling the scale moves once, by whether any slice on any replica
    was not finite. Then the batch's state is zeroed, last.

    Args:
        state: The engine's `EngineState`.
        summed: Bool: the loss sums over the batch (reduction "sum").
        dynamic_loss_scale: As `ADAPTER.dynamic_loss_scale`, or None.

    Returns:
        `(loss, weight)`: float32 scalars, the batch's loss (`sum_k w_k L_k /
        sum_k w_k` over all its slices, or `sum_k L_k` when `summed`) and
        what it is weighted by.
    """
    sums = state.batch_sums.read_value()
    field = dict(zip(_state.BATCH_SUMS, tf.unstack(sums)))
    added = field["added"]
    if summed:
        weight = tf.cast(added > 0.0, tf.float32)
        loss = field["weighted_loss"]
    else:
        weight = field["weight"]
        loss = tf.math.divide_no_nan(
            field["weighted_loss"], field["loss_weight"]
        )
    # A replica whose shard of the batch is empty adds no slice; where its
    # window opens with this batch its accumulators still hold the last
    # window's sums: zeroed, they are its (empty) contribution, as a
    # micro-batch of no rows gives one, and the window's counters stay
    # equal on every replica. With one replica an empty batch counts for
    # nothing instead (the next batch overwrites; a window of nothing
    # applies nothing): a conditional that writes the accumulators, even
    # one never taken, costs the step a variable's size of memory.
    empty = tf.constant(False)
    changes = []
    if tf.distribute.get_replica_context().num_replicas_in_sync > 1:
        empty = tf.logical_and(
            tf.equal(field["rows"], 0.0), tf.equal(state.contributed, 0)
        )
        received_flags = state.received.seen_constant()

        def zero_window():
            state.received.flags.assign(received_flags)
            for acc in state.accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        changes.append(tf.cond(empty, zero_window, _false))
    changes += [
        state.weight_sum.assign_add(weight),
        state.contributed.assign_add(
            tf.cast(added, tf.int64) + tf.cast(empty, tf.int64)
        ),
        state.skipped.assign_add(tf.cast(field["non_finite"], tf.int64)),
    ]
    if state.noise_scale is not None:
        changes.append(
            state.noise_scale.add_sums(
                field["squared_norm_sum"], field["micro_batches"]
            )
        )
    if dynamic_loss_scale is not None:
        finite = _mixed_precision.none_on_any_replica(field["non_finite"])
        _mixed_precision.update_loss_scale(dynamic_loss_scale, finite)
    with tf.control_dependencies(changes):
        step = state.micro_step.assign_add(1)
    with tf.control_dependencies([step]):
        state.end_batch()
    return loss, field["loss_weight"]


def _values(contributions):
    return [
        c.values if isinstance(c, tf.IndexedSlices) else c
        for c in contributions
        if c is not None
    ]


def _false():
    return tf.constant(False)
