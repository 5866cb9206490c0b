"""One batch split inside the training step (`micro_batch_size`).

`fit(batch_size=E)` on a model with `micro_batch_size=m` runs each batch's
rows in slices of at most `m`, inside the one compiled step: a
`tf.while_loop` (one iteration at a time, so one slice's activations live
at once) runs each slice's forward and backward pass, updates the compiled
metrics with it, and adds its weighted gradients `w_k g_k` to sums the loop
carries. After the loop the sums enter the window as one contribution of
weight `W = sum_k w_k`, with the slices' noise-scale statistics, so the
window counts batches as `fit` does: `sum_k w_k g_k / W` is the gradient
of the batch's loss whatever the slices' sizes (docs/micro_batch.md).

Nothing of the window, the optimizer or the weights is written inside the
loop: an out-of-memory error there leaves them as they were, which is what
lets `_auto` run the same batch again with smaller slices. What the
forward pass writes itself (metrics, BatchNorm statistics, seed
generators) `_auto` restores.

Slices are taken so that XLA sees static shapes: the full slices of `m`
rows at a dynamic offset, then the rest of the batch, cut outside the loop
(its size is known when XLA compiles for the batch's shape).
"""

import tensorflow as tf

from accum_model import _contribution
from accum_model import _keras
from accum_model import _noise_scale
from accum_model import _normalizers

ADAPTER = _keras.ADAPTER


class SplitBatch:
    """What the loop over one batch's slices sums, for the window.

    Attributes:
        grads: One float32 gradient sum `sum_k w_k g_k` per variable (None
            where no slice's loss reached the variable).
        weight: Float32 scalar `W = sum_k w_k`.
        loss: Float32 scalar, the batch's loss `sum_k w_k L_k / W`.
        noise_statistics: `(sum_k w_k |g_k|^2, slices of weight > 0)`, or
            None when the noise scale is not measured.
    """

    def __init__(self, grads, weight, loss, noise_statistics):
        self.grads = grads
        self.weight = weight
        self.loss = loss
        self.noise_statistics = noise_statistics


def run_slices(
    model, data, micro_batch_size, variables, scale, measure, xla=False
):
    """Runs the forward and backward pass of `data` in slices.

    Args:
        model: The `AccumModel` (its forward pass, loss, normalizer and
            compiled metrics are used).
        data: The batch, as `train_step` receives it.
        micro_batch_size: Python int >= 1, the rows of a full slice.
        variables: The variables whose gradients are summed.
        scale: None, or the loss scale (float32 scalar) of a
            `LossScaleOptimizer`: each slice's loss is multiplied by it, and
            its gradients divided by it in float32.
        measure: Bool, whether to sum the noise-scale statistics.
        xla: Bool, whether the step is compiled by XLA.

    Returns:
        A `SplitBatch`.
    """
    x, y, sample_weight = ADAPTER.unpack(data)
    batch = (x, y, sample_weight)
    rows = tf.cast(_normalizers.batch_size(x, y), tf.int32)
    size = micro_batch_size
    full = rows // size
    received = [False] * len(variables)

    def one_slice(part):
        """`(w_k g_k, w_k, w_k L_k, w_k |g_k|^2)` of one slice."""
        px, py, psw = part
        with tf.GradientTape() as tape:
            y_pred = ADAPTER.forward(model, px)
            loss = ADAPTER.compute_loss(model, px, py, y_pred, psw)
            weight = tf.stop_gradient(
                tf.cast(
                    model.compute_loss_normalizer(px, py, y_pred, psw),
                    tf.float32,
                )
            )
            objective = ADAPTER.unscale_loss_for_distribution(loss)
            # As in `AccumModel.train_step`: the weight goes into the loss,
            # except under loss scaling (float16 gradients could overflow).
            objective = objective * tf.cast(
                weight if scale is None else scale, objective.dtype
            )
        grads = tape.gradient(objective, variables)
        ADAPTER.update_metrics(model, px, py, y_pred, psw)
        for i, g in enumerate(grads):
            received[i] = received[i] or g is not None
        contributions = _contribution.in_float32(
            grads, None if scale is None else weight / scale
        )
        # Scalars, also where the trace sees a slice of no rows (the rest of
        # a batch of static shape that `m` divides: never run), for which
        # Keras may give a loss of shape `(0,)`.
        loss = tf.reduce_sum(tf.cast(loss, tf.float32))
        weight = tf.reduce_sum(weight)
        # A slice of no weight (an empty shard) has a 0/0 mean loss.
        weighted_loss = tf.where(weight > 0.0, weight * loss, 0.0)
        statistics = (0.0, 0.0)
        if measure:
            statistics = _noise_scale.microbatch_statistics(
                contributions, weight
            )
        return contributions, weight, weighted_loss, statistics

    def add(sums, part):
        contributions, weight, weighted_loss, (q_k, n_k) = one_slice(part)
        grads, w, wl, q, n = sums
        grads = [_add(s, c) for s, c in zip(grads, contributions)]
        return grads, w + weight, wl + weighted_loss, q + q_k, n + n_k

    zero = tf.constant(0.0)
    sums = (
        [tf.zeros(v.shape, tf.float32) for v in variables],
        zero,
        zero,
        zero,
        zero,
    )

    # The full slices stacked on a new axis, taken by index in the loop: a
    # static shape, which XLA compiles also for a batch shorter than `m`.
    stacked = tf.nest.map_structure(lambda t: _stack(t, full, size, xla), batch)

    def full_slice(i, sums):
        part = tf.nest.map_structure(lambda t: _take(t, i, size), stacked)
        return i + 1, add(sums, part)

    # One iteration at a time: a second one started early would hold its
    # slice's activations beside the first's.
    _, sums = tf.while_loop(
        lambda i, _: i < full,
        full_slice,
        (tf.constant(0), sums),
        parallel_iterations=1,
    )
    start = full * size
    rest = tf.nest.map_structure(lambda t: _rows(t, start, rows - start), batch)
    _, sums = tf.while_loop(
        lambda i, _: i < tf.minimum(rows - start, 1),
        lambda i, sums: (i + 1, add(sums, rest)),
        (tf.constant(0), sums),
        parallel_iterations=1,
    )
    grads, weight, weighted_loss, q, n = sums
    grads = [g if r else None for g, r in zip(grads, received)]
    return SplitBatch(
        grads,
        weight,
        tf.math.divide_no_nan(weighted_loss, weight),
        (q, n) if measure else None,
    )


def _stack(t, count, size, xla):
    """The first `count * size` rows of a dense `t` as `[count, size, ...]`.

    Under XLA with one slice of zeros after them: XLA compiles the loop's
    body for the batch's shape also when it holds no full slice (a short
    last batch), and a slice of an empty axis does not compile. Ragged and
    sparse tensors stay as they are (`_take` slices them).
    """
    if t is None or isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
        return t
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return t
    shape = tf.shape(t)
    stacked = tf.reshape(
        t[: count * size], tf.concat([[count, size], shape[1:]], 0)
    )
    if xla:
        stacked = tf.pad(stacked, [[0, 1]] + [[0, 0]] * t.shape.rank)
    return stacked


def _take(stacked, i, size):
    """Slice `i` of `size` rows, from what `_stack` made of a tensor."""
    if stacked is None or stacked.shape.rank == 0:
        return stacked
    if isinstance(stacked, (tf.RaggedTensor, tf.SparseTensor)):
        return _rows(stacked, i * size, size)
    return stacked[i]


def _rows(t, start, size):
    """Rows `[start, start + size)` of a batch's tensor (None stays None)."""
    if t is None:
        return None
    if isinstance(t, tf.SparseTensor):
        rank = tf.shape(t.dense_shape)[0]
        begin = tf.concat([[start], tf.zeros([rank - 1], tf.int64)], 0)
        extent = tf.concat([[size], t.dense_shape[1:]], 0)
        return tf.sparse.slice(
            t, tf.cast(begin, tf.int64), tf.cast(extent, tf.int64)
        )
    if isinstance(t, tf.RaggedTensor):
        return t[start : start + size]
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return t
    begin = tf.concat([[start], tf.zeros([t.shape.rank - 1], tf.int32)], 0)
    extent = tf.concat([[size], -tf.ones([t.shape.rank - 1], tf.int32)], 0)
    return tf.slice(t, begin, extent)


def _add(total, contribution):
    """`total + contribution`, a sparse one added by its rows only."""
    if contribution is None:
        return total
    if isinstance(contribution, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(
            total,
            tf.expand_dims(tf.cast(contribution.indices, tf.int64), -1),
            contribution.values,
        )
    return total + contribution
