"""`micro_batch_size="auto"`: the slice that fits, found by the allocator.

The train function `fit` calls for such a model takes each batch from the
iterator itself, eagerly, and hands it to a compiled step of one batch
(`ADAPTER.step_on_data`), so that the batch is still held when the step
fails. Until the first out-of-memory error a batch runs whole, as one
slice with no loop. When the device's allocator raises
`tf.errors.ResourceExhaustedError`, it puts back what the forward pass
wrote, halves the slice, traces the step again and runs the **same batch**
again, down to one row. The size that ran is kept (the model's
`micro_batch_size`, and the epoch's logs) for the rest of the
training and later `fit` calls; a later batch that does not fit (longer
sequences, memory taken by another process) halves it again, with a
warning. No memory statistics are read: the allocator's own error decides,
on every device.

Nothing is added twice and nothing lost. What the forward pass writes (the
compiled metrics, the model's non-trainable variables such as BatchNorm
statistics and seed generators, `AccumBatchNormalization`'s window
moments) is read before each attempt, per replica (a read shares the
variable's buffer; a write after it copies), and put back after a failure
where it changed. Then, where the batch opened its window, the rerun
starts from the batch's first row and its first slice overwrites the
accumulators, the failed attempt's additions with them: exactly the batch
in the smaller slices. Where the window holds earlier batches, each
accumulator has recorded the rows of the batch it holds, after adding
them, and the batch's sums the rows whose slices are all in (`_split`,
`resumable`): the rerun replays the forward pass of those rows and adds
the others, none twice; the rows a variable had added keep the failed
attempt's slicing there (which only a layer that sees its slice, as
BatchNorm in training or Dropout, can tell). Under XLA a step that runs
out of memory writes nothing. An error after the batch's slices all ran
(the update itself does not fit) ends `fit`, saying so.

Under `MultiWorkerMirroredStrategy` `"auto"` is refused: a worker that runs
out of memory would leave the others waiting in a collective.
"""

import contextlib
import warnings

import tensorflow as tf

from accum_model.keras import _adapter
from accum_model.model import _normalizers
from accum_model.model._attempts import AttemptState

ADAPTER = _adapter.ADAPTER

# How the errors this train function raises begin.
_OURS = 'micro_batch_size="auto": '


class AutoTrainFunction:
    """What `fit` calls as the train function of a model with `"auto"`.

    Args:
        model: The `AccumModel`, with `micro_batch_size="auto"`.
        micro_batch: Its `_settings.MicroBatch`, which records the size
            that ran.
        split_step: `split_step(data, size, resumable)`, the model's train
            step of one batch in slices of `size` rows (None: whole).

    Raises:
        ValueError: Under `MultiWorkerMirroredStrategy` with several workers.
    """

    def __init__(self, model, micro_batch, split_step):
        if ADAPTER.is_multi_worker(model.distribute_strategy):
            raise ValueError(
                'micro_batch_size="auto" is not supported under '
                "MultiWorkerMirroredStrategy: a worker whose step runs out "
                "of memory would leave the others waiting in a collective. "
                'Find the size on one worker (fit with "auto" there and '
                "read `model.micro_batch_size`), then pass that int. "
                f"Received: micro_batch_size='auto' with "
                f"{type(model.distribute_strategy).__name__}"
            )
        self._model = model
        self._micro_batch = micro_batch
        self._split_step = split_step
        self._steps = {}
        accumulator = model.gradient_accumulator
        self._state = AttemptState(
            model,
            lambda: (
                list(model.non_trainable_variables)
                + ADAPTER.metric_variables(model)
                + accumulator.state.item_variables()
            ),
            accumulator.progress_variables(),
        )
        self._batch = accumulator.state.batch_variables()

    def __call__(self, iterator):
        logs = None
        for _ in range(int(ADAPTER.steps_per_execution(self._model))):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise
                break
            logs = self.run(data)
        return logs

    def run(self, data):
        """Runs one batch, halving the slice until it fits.

        Returns:
            The step's logs.

        Raises:
            tf.errors.ResourceExhaustedError: If one row does not fit, or if
                the update after the slices ran out of memory.
        """
        model = self._model
        rows = _rows_per_replica(model, data)
        size = self._micro_batch.first_try()
        while True:
            step = self._step_of(size, data)
            before = self._state.read()
            try:
                logs = step(data)
                break
            except tf.errors.ResourceExhaustedError as error:
                if self._past_slices(before, data):
                    raise out_of_memory(
                        error,
                        f"{_OURS}the update itself ran out of memory after "
                        "every slice of the batch had run: smaller slices "
                        "cannot help. Free memory on the device, or make "
                        "the model or its optimizer state smaller.",
                    ) from error
                size = _halved(error, size or rows, rows, "training goes on")
                self._state.restore(before)
                self._start_over_where_window_was_empty(before)
                self._micro_batch.cap(size)
        if size is None:
            # Whole batches ran: the size follows the largest.
            self._micro_batch.ran_whole(rows)
        return logs

    def _past_slices(self, before, data):
        """Whether the failed attempt got past the batch's slices.

        True when the window moved on a micro-step on some replica (the
        error came in the update), or when every replica's batch has all
        of its rows in.
        """
        steps, _, sums = self._state.progress(before)
        now_steps, _, now_sums = self._state.progress(self._state.read())
        if any(int(a) != int(b) for a, b in zip(now_steps, steps)):
            return True
        shards = _rows_of_replicas(self._model, data)
        return all(int(s[0]) >= n for s, n in zip(now_sums, shards))

    def _start_over_where_window_was_empty(self, before):
        """Zeroes the batch's progress where its window was empty.

        There the rerun starts from the batch's first row, and its first
        slice overwrites the accumulators, the failed attempt's additions
        with them: the batch is then exactly as if it had run in the
        smaller slices from the start. Elsewhere (a window holding earlier
        batches) the rerun adds only what is missing (`_split`).
        """
        _, contributed, _ = self._state.progress(before)
        strategy = self._model.distribute_strategy
        for v in self._batch:
            for replica, part in enumerate(
                strategy.experimental_local_results(v)
            ):
                if int(contributed[replica]) == 0:
                    part.assign(tf.zeros_like(part))

    def _step_of(self, size, data):
        """The compiled step of one batch in slices of `size` rows."""
        step = self._steps.get(size)
        if step is None:
            split_step = self._split_step
            step = self._steps[size] = ADAPTER.step_on_data(
                self._model,
                lambda d: split_step(d, size, resumable=True),
            )
            self._state.trace(step, data)
        return step


class AutoInferenceFunction:
    """What `evaluate` or `predict` calls for a model with `"auto"`.

    Each batch runs in slices of the size training chose (whole batches
    before training chose one); an out-of-memory error halves the size for
    evaluation or prediction only, puts back the metrics the attempt
    updated and runs the batch again. Training's size is left alone: an
    evaluation that needs less memory does not make training slower.

    Args:
        model: The `AccumModel`, with `micro_batch_size="auto"`.
        split_step: `split_step(data, size)`, the model's test or predict
            step of one batch in slices of `size` rows (None: whole).
        kind: `"test"` or `"predict"`.
    """

    def __init__(self, model, split_step, kind):
        self._model = model
        self._split_step = split_step
        self._kind = kind
        self._size = None
        self._steps = {}
        self._state = AttemptState(
            model, lambda: ADAPTER.metric_variables(model)
        )

    def __call__(self, data):
        # Keras 3's predict hands over a list of batches; the other
        # functions take an iterator.
        batches = data if isinstance(data, list) else self._batches(data)
        outputs = [self.run(batch) for batch in batches]
        if self._kind == "test":
            return outputs[-1]
        return tf.nest.map_structure(
            lambda *parts: tf.concat(parts, 0), *outputs
        )

    def _batches(self, iterator):
        batches = []
        for _ in range(int(ADAPTER.steps_per_execution(self._model))):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                if not batches:
                    raise
                break
        return batches

    def run(self, data):
        """One batch, halving the slice until it fits."""
        model = self._model
        rows = _rows_per_replica(model, data)
        chosen = model.micro_batch_size
        size = self._size or (chosen if isinstance(chosen, int) else None)
        while True:
            step = self._step_of(size, data)
            before = self._state.read()
            try:
                return step(data)
            except tf.errors.ResourceExhaustedError as error:
                where = "evaluate" if self._kind == "test" else "predict"
                size = self._size = _halved(
                    error, min(size or rows, rows), rows, f"{where} goes on"
                )
                self._state.restore(before)

    def _step_of(self, size, data):
        step = self._steps.get(size)
        if step is None:
            split_step = self._split_step
            step = self._steps[size] = ADAPTER.step_on_data(
                self._model, lambda d: split_step(d, size), kind=self._kind
            )
            self._state.trace(step, data)
        return step


def _halved(error, current, rows, goes_on):
    """The slice size after `error` in slices of `current` rows: half.

    Warns that the batch runs again in it.

    Raises:
        tf.errors.ResourceExhaustedError: If `current` is one row already.
    """
    if current == 1:
        raise out_of_memory(
            error,
            f"{_OURS}even a slice of one row does not fit on this device.",
        ) from error
    size = current // 2
    warnings.warn(
        f'micro_batch_size="auto": a batch of {rows} rows ran out of memory '
        f"in slices of {current} rows; it runs again, and {goes_on}, in "
        f"slices of {size}.",
        stacklevel=4,
    )
    return size


def _rows_of_replicas(model, data):
    """The rows of each replica's part of `data`."""
    strategy = model.distribute_strategy
    for leaf in tf.nest.flatten(data):
        if leaf is None:
            continue
        return [
            int(_normalizers.batch_size(part))
            for part in strategy.experimental_local_results(leaf)
        ]
    return [1]


def _rows_per_replica(model, data):
    """The rows of the first replica's part of `data` (at least 1)."""
    return max(1, _rows_of_replicas(model, data)[0])


def out_of_memory(error, message):
    """`error`, a `ResourceExhaustedError`, with `message` before its own."""
    advised = tf.errors.ResourceExhaustedError(
        error.node_def, error.op, f"{message}\n\n{error.message}"
    )
    # Said once: `fit`'s validation runs `evaluate`, which says it too.
    advised.accum_model_advice = True
    return advised


@contextlib.contextmanager
def saying_what_to_set(model):
    """Adds to an out-of-memory error of `fit`, `evaluate` or `predict` what
    to set.

    One from `"auto"`'s functions passes as it is: it says what was tried.
    """
    try:
        yield
    except tf.errors.ResourceExhaustedError as error:
        if getattr(error, "accum_model_advice", False):
            raise
        raise out_of_memory(
            error, _what_to_set(model.micro_batch_size)
        ) from error


def _what_to_set(micro_batch_size):
    if micro_batch_size is None:
        return (
            'A step ran out of memory. Set micro_batch_size="auto" (or an '
            "int) to split each batch inside the step into slices that "
            "fit, with the same update, loss and outputs; or pass a smaller "
            "batch_size (with a larger accum_steps, for training)."
        )
    return (
        f"A step ran out of memory in slices of {micro_batch_size} "
        "rows (micro_batch_size). Set a smaller micro_batch_size, or "
        'micro_batch_size="auto" to find the largest that fits and halve it '
        "when a later batch does not."
    )
