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
        self._state = _AttemptState(
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
        self._state = _AttemptState(
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


class _AttemptState:
    """What an attempt may write before it fails, read and put back.

    Args:
        model: The model.
        variables: Callable returning the variables an attempt may write
            before it fails (listed again after each trace, which may have
            created some), read and put back as their per-replica parts.
        progress: Variables that tell how far an attempt got, read with
            the others (`progress`), or None.
    """

    def __init__(self, model, variables, progress=None):
        self._model = model
        self._variables = variables
        self._progress_variables = progress or []
        self._parts = []
        self._read = None

    def trace(self, step, data):
        """Traces `step` on `data`, then lists the variables.

        Traced now, not in the first attempt: the trace creates what Keras
        builds lazily (the compiled metrics' variables), which an attempt
        that fails must find among those it puts back.
        """
        if not self._model.run_eagerly:
            step.get_concrete_function(_any_rows(data))
        strategy = self._model.distribute_strategy
        parts, seen = [], set()
        for v in self._variables():
            for part in strategy.experimental_local_results(v):
                if id(part) not in seen:
                    seen.add(id(part))
                    parts.append(part)
        self._progress = [
            strategy.experimental_local_results(v)
            for v in self._progress_variables
        ]
        self._parts = parts
        progress = [p for replicas in self._progress for p in replicas]

        # One call a batch. Reads share the buffers: nothing is copied
        # unless the attempt writes them.
        @tf.function(autograph=False)
        def read():
            return (
                [tf.identity(p) for p in parts],
                [tf.identity(p) for p in progress],
            )

        # Made again for every slice size, by design: TensorFlow's warning
        # about frequent retracing would count them.
        read._omit_frequent_tracing_warning = True
        self._read = read

    def read(self):
        return self._read()

    def progress(self, read):
        """What `read()` returned of the progress variables, per variable:
        a list of each one's per-replica values."""
        values = read[1]
        out, start = [], 0
        for replicas in self._progress:
            out.append(values[start : start + len(replicas)])
            start += len(replicas)
        return out

    def restore(self, before):
        """Puts back, per replica, what the failed attempt changed."""
        for part, value in zip(self._parts, before[0]):
            if _changed(part, value):
                part.assign(value)


def _any_rows(data):
    """Specs of `data` with any number of rows, where it is dense tensors.

    A step traced for the batch's exact shape would let TensorFlow fold its
    constants of that shape (zeros the size of an activation) when it first
    runs: the allocator's limit is hit there, where a failure is not an
    error TensorFlow raises but a crash. Other data traces as it is.
    """
    leaves = tf.nest.flatten(data)
    if not all(t is None or isinstance(t, tf.Tensor) for t in leaves):
        return data
    return tf.nest.map_structure(
        lambda t: (
            tf.TensorSpec([None] + t.shape[1:], t.dtype) if t.shape.rank else t
        ),
        data,
    )


def _changed(variable, value):
    """Whether `variable` no longer holds `value`, without a copy of it.

    A sum reads each once and allocates nothing of their size: a frozen
    weight (never written) is not assigned, which would copy it.
    """
    if not (value.dtype.is_floating or value.dtype.is_integer):
        return True
    # NaN sums differ too: such a variable is put back.
    return bool(
        tf.reduce_sum(tf.convert_to_tensor(variable)) != tf.reduce_sum(value)
    )


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
