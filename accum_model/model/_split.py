"""One batch split inside the training step (`micro_batch_size`).

`fit(batch_size=E)` on a model with `micro_batch_size=m` runs each batch's
rows in slices of at most `m`, inside the one compiled step: a
`tf.while_loop` (one iteration at a time, so one slice's activations live
at once) runs each slice's forward and backward pass, updates the compiled
metrics with it, and adds its weighted gradients `w_k g_k` into the
window's accumulators in place (`GradientAccumulator.add_slice`), each as
soon as it exists. After the loop the batch ends as one micro-batch of the
window, of weight `W = sum_k w_k` (`end_batch`): `sum_k w_k g_k / W` is the
gradient of the batch's loss whatever the slices' sizes
(docs/micro_batch.md). Nothing the size of the weights is carried beside
the window.

A batch that may run again after an out-of-memory error (`resumable`,
`micro_batch_size="auto"` outside XLA) keeps, per variable, the row up to
which it holds the batch's gradient, and, in the batch's sums, the rows
whose slices are all in: run again, it replays the forward pass of those
rows only (for what the forward pass writes, which `_auto` put back) and
adds the others, none twice. Under XLA a step that runs out of memory
writes nothing.

Slices are taken so that XLA sees static shapes: the full slices of `m`
rows at a dynamic offset, then the rest of the batch, cut outside the loop
(its size is known when XLA compiles for the batch's shape).
"""

import tensorflow as tf

from accum_model.keras import _adapter
from accum_model.model import _normalizers

ADAPTER = _adapter.ADAPTER


def train_batch(
    model, accumulator, data, size, *, scale, xla, resumable, compilation
):
    """Runs one batch into the window, in slices of `size` rows.

    Args:
        model: The `AccumModel` (its forward pass, loss, normalizer and
            compiled metrics are used).
        accumulator: Its `GradientAccumulator`.
        data: The batch, as `train_step` receives it.
        size: Python int >= 1, the rows of a full slice; None: the batch is
            one slice, with no loop.
        scale: None, or the loss scale (float32 scalar) of a
            `LossScaleOptimizer`: each slice's loss is multiplied by it, and
            its gradients divided by it in float32.
        xla: Bool, whether the step is compiled by XLA.
        resumable: Bool, whether the batch may run again after an
            out-of-memory error (see the module). Never under XLA.
        compilation: `end_batch`'s `jit_compile` and `compile_update`, as
            the model's settings give them.

    Returns:
        The batch's loss and weight, as `GradientAccumulator.end_batch`.
    """
    x, y, sample_weight = ADAPTER.unpack(data)
    batch = (x, y, sample_weight)
    rows = tf.cast(_normalizers.batch_size(x, y), tf.int64)
    variables = accumulator.updated_variables
    # Found while a slice is traced, read after the loop.
    summed = []

    def full(part, start, count):
        """One slice's forward and backward pass, into the window."""
        px, py, psw = part
        with tf.GradientTape() as tape:
            y_pred = ADAPTER.forward(model, px)
            loss = ADAPTER.compute_loss(model, px, py, y_pred, psw)
            objective, weight = _normalizers.weighted_objective(
                ADAPTER, model, part, y_pred, loss, scale
            )
        if not summed:
            summed.append(
                _normalizers.sums_over_batch(ADAPTER, model, py, y_pred, psw)
            )
        grads = tape.gradient(objective, variables)
        ADAPTER.update_metrics(model, px, py, y_pred, psw)
        accumulator.add_slice(
            grads,
            weight,
            loss,
            rows=count,
            rows_end=start + count,
            scale=scale,
            resumable=resumable,
        )

    def replay(part):
        """The forward pass of a slice already in the window."""
        px, py, psw = part
        y_pred = ADAPTER.forward(model, px)
        ADAPTER.update_metrics(model, px, py, y_pred, psw)

    if size is None:
        full(batch, tf.constant(0, tf.int64), rows)
    elif resumable:
        # Rows whose slices are in: those of an attempt that ran out of
        # memory after them.
        done = tf.cast(accumulator.batch_rows(), tf.int64)
        _loop(batch, 0, done, size, lambda part, start, count: replay(part))
        _loop(batch, done, rows, size, full)
    else:

        def body(part, start, count, carried):
            full(part, start, count)
            return carried

        stacked_loop(batch, rows, size, xla, body)
    return accumulator.end_batch(
        model.optimizer,
        summed=bool(summed and summed[0]),
        **compilation,
    )


def _loop(batch, start, stop, size, body):
    """`body(part, start, count)` for the slices of rows `[start, stop)`.

    Slices of `size` rows (the last one shorter), cut at dynamic offsets:
    graph mode only.
    """
    start = tf.cast(start, tf.int64)
    size = tf.constant(size, tf.int64)

    def step(begin):
        count = tf.minimum(size, stop - begin)
        part = tf.nest.map_structure(lambda t: rows_of(t, begin, count), batch)
        body(part, begin, count)
        return begin + count

    # One iteration at a time: a second one started early would hold its
    # slice's activations beside the first's.
    tf.while_loop(
        lambda begin: begin < stop,
        step,
        (start,),
        parallel_iterations=1,
    )


def stacked_loop(batch, rows, size, xla, body, carried=()):
    """`carried = body(part, start, count, carried)` over the batch's slices.

    The full slices stacked on a new axis, taken by index in the loop: a
    static shape, which XLA compiles also for a batch shorter than `size`;
    then the rest, cut outside the loop.

    Returns:
        `carried` after the last slice (a tuple of tensors).
    """
    full = rows // size
    stacked = tf.nest.map_structure(lambda t: stack(t, full, size, xla), batch)
    size64 = tf.constant(size, tf.int64)

    def full_slice(i, carried):
        part = tf.nest.map_structure(lambda t: take(t, i, size), stacked)
        return i + 1, body(part, i * size64, size64, carried)

    # One iteration at a time: a second one started early would hold its
    # slice's activations beside the first's.
    _, carried = tf.while_loop(
        lambda i, _: i < full,
        full_slice,
        (tf.constant(0, tf.int64), carried),
        parallel_iterations=1,
    )
    start = full * size64
    rest = tf.nest.map_structure(
        lambda t: rows_of(t, start, rows - start), batch
    )

    def rest_slice(i, carried):
        return i + 1, body(rest, start, rows - start, carried)

    # A loop of at most one trip: a slice of no rows (the rest of a batch
    # that `size` divides) never runs.
    _, carried = tf.while_loop(
        lambda i, _: i < tf.minimum(rows - start, 1),
        rest_slice,
        (tf.constant(0, tf.int64), carried),
        parallel_iterations=1,
    )
    return carried


def stack(t, count, size, xla):
    """The first `count * size` rows of a dense `t` as `[count, size, ...]`.

    Under XLA with one slice of zeros after them: XLA compiles the loop's
    body for the batch's shape also when it holds no full slice (a short
    last batch), and a slice of an empty axis does not compile. Ragged and
    sparse tensors stay as they are (`take` slices them).
    """
    if t is None or isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
        return t
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return t
    shape = tf.shape(t, out_type=tf.int64)
    stacked = tf.reshape(
        t[: count * size], tf.concat([[count, size], shape[1:]], 0)
    )
    if xla:
        stacked = tf.pad(stacked, [[0, 1]] + [[0, 0]] * t.shape.rank)
    return stacked


def take(stacked, i, size):
    """Slice `i` of `size` rows, from what `stack` made of a tensor."""
    if stacked is None or stacked.shape.rank == 0:
        return stacked
    if isinstance(stacked, (tf.RaggedTensor, tf.SparseTensor)):
        return rows_of(stacked, i * size, size)
    return stacked[i]


def rows_of(t, start, size):
    """Rows `[start, start + size)` of a batch's tensor (None stays None)."""
    if t is None:
        return None
    start = tf.cast(start, tf.int64)
    size = tf.cast(size, tf.int64)
    if isinstance(t, tf.SparseTensor):
        rank = tf.shape(t.dense_shape)[0]
        begin = tf.concat([[start], tf.zeros([rank - 1], tf.int64)], 0)
        extent = tf.concat([[size], t.dense_shape[1:]], 0)
        return tf.sparse.slice(t, begin, extent)
    if isinstance(t, tf.RaggedTensor):
        return t[start : start + size]
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return t
    begin = tf.concat([[start], tf.zeros([t.shape.rank - 1], tf.int64)], 0)
    extent = tf.concat([[size], -tf.ones([t.shape.rank - 1], tf.int64)], 0)
    return tf.slice(t, begin, extent)
