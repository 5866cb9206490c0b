"""`micro_batch_size="auto"`: the slice that fits, found by the allocator.

The train function `fit` calls for such a model takes each batch from the
iterator itself, eagerly, and hands it to a compiled step of one batch
(`ADAPTER.step_on_data`), so that the batch is still held when the step
fails. Its first attempt runs the whole batch as one slice; when the
device's allocator raises `tf.errors.ResourceExhaustedError`, it puts back
what the attempt wrote, halves the slice, traces the step again and runs
the **same batch** again, down to one row. The size that ran is kept (the
model's `micro_batch_size`, `logs["micro_batch_size"]`) for the rest of the
training and later `fit` calls; a later batch that does not fit (longer
sequences, memory taken by another process) halves it again, with a
warning. No memory statistics are read: the allocator's own error decides,
on every device.

What an attempt may have written before it failed: inside the slices'
loop (`_split`) only the forward pass's own writes (metrics, the model's
non-trainable variables such as BatchNorm statistics and seed generators,
`AccumBatchNormalization`'s window moments). They are read before each
attempt (a read shares the variable's buffer; a write after it copies) and
assigned back after a failure. The window, the optimizer and the weights
change only after the loop; an error there (the update itself does not
fit, whatever the slices) ends `fit` with the error instead of a retry.
"""

import contextlib
import warnings

import tensorflow as tf

from accum_model import _keras
from accum_model import _normalizers

ADAPTER = _keras.ADAPTER

# The engine's counters that every batch's contribution writes: changed by
# a failed attempt, they show that it failed after its slices ran.
_COMMITTED = (
    "engine/micro_step",
    "engine/skipped_microbatches",
    "engine/discarded_windows",
)
_ACCUMULATORS = "accumulator/"
# How the errors this train function raises begin.
_OURS = 'micro_batch_size="auto": '


class AutoTrainFunction:
    """What `fit` calls as the train function of a model with `"auto"`.

    Args:
        model: The `AccumModel`, with `micro_batch_size="auto"`.
    """

    def __init__(self, model):
        self._model = model
        self._size = None
        self._step = None
        self._written = []
        self._read = None

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
            The step's logs, with `micro_batch_size`.

        Raises:
            tf.errors.ResourceExhaustedError: If one row does not fit, or if
                the update after the slices ran out of memory.
        """
        model = self._model
        rows = _rows_per_replica(model, data)
        size = model._micro_batch_chosen or rows
        if not model._micro_batch_capped:
            # No out-of-memory error yet: batches run whole.
            size = max(size, rows)
        while True:
            step = self._step_of(size, data)
            # Reads share the variables' buffers: nothing is copied unless
            # the attempt writes them.
            before, committed = self._read()
            try:
                logs = step(data)
                break
            except tf.errors.ResourceExhaustedError as error:
                if _values(self._read()[1]) != _values(committed):
                    raise out_of_memory(
                        error,
                        f"{_OURS}the update itself ran out of memory after "
                        f"every slice of {size} rows had run: smaller slices "
                        "cannot help. Free memory on the device, or make "
                        "the model or its optimizer state smaller.",
                    ) from error
                if size == 1:
                    raise out_of_memory(
                        error,
                        f"{_OURS}even a slice of one row does not fit on "
                        "this device.",
                    ) from error
                for v, value in zip(self._written, before):
                    v.assign(value)
                smaller = size // 2
                warnings.warn(
                    f'micro_batch_size="auto": a batch of {rows} rows ran '
                    f"out of memory in slices of {size} rows; it runs "
                    f"again, and training goes on, in slices of {smaller}.",
                    stacklevel=3,
                )
                size = smaller
                model._micro_batch_capped = True
        logs = dict(logs)
        logs["micro_batch_size"] = tf.constant(float(size), tf.float32)
        return logs

    def _step_of(self, size, data):
        """The compiled step of one batch in slices of `size` rows."""
        model = self._model
        # Read by `train_step` while the step is traced.
        model._micro_batch_chosen = size
        if size != self._size:
            self._size = size
            self._step = ADAPTER.step_on_data(model)
            if not model.run_eagerly:
                # Traced now, not in the first attempt: the trace creates
                # what Keras builds lazily (the compiled metrics' variables),
                # which an attempt that fails must find among those it puts
                # back.
                self._step.get_concrete_function(data)
            self._prepare()
        return self._step

    def _prepare(self):
        """Finds what an attempt may write before it fails in its slices,
        and what shows that it got past them."""
        model = self._model
        state = model.gradient_accumulator.state
        small = [
            state.get(name)
            for name in state.names()
            if not name.startswith(_ACCUMULATORS)
        ]
        self._written = _unique(
            list(model.non_trainable_variables)
            + ADAPTER.metric_variables(model)
            + small
        )
        committed = [state.get(name) for name in _COMMITTED]
        committed.append(model.optimizer.iterations)
        written = self._written

        # One call a step: the values of both lists.
        @tf.function(autograph=False)
        def read():
            return (
                [tf.identity(v) for v in written],
                [tf.identity(v) for v in committed],
            )

        self._read = read


def _values(tensors):
    return [t.numpy().tolist() for t in tensors]


def _unique(variables):
    seen, unique = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    return unique


def _rows_per_replica(model, data):
    """The rows of the first tensor of a replica's part of `data`."""
    strategy = model.distribute_strategy
    for leaf in tf.nest.flatten(data):
        if leaf is None:
            continue
        part = strategy.experimental_local_results(leaf)[0]
        return max(1, int(_normalizers.batch_size(part)))
    return 1


def out_of_memory(error, message):
    """`error`, a `ResourceExhaustedError`, with `message` before its own."""
    return tf.errors.ResourceExhaustedError(
        error.node_def, error.op, f"{message}\n\n{error.message}"
    )


@contextlib.contextmanager
def saying_what_to_set(model):
    """Adds to an out-of-memory error in `fit` what to set.

    One from `"auto"`'s train function passes as it is: it says what was
    tried.
    """
    try:
        yield
    except tf.errors.ResourceExhaustedError as error:
        if error.message.startswith(_OURS):
            raise
        if model._micro_batch_setting == "auto":
            advice = (
                'micro_batch_size="auto" splits the training steps only: '
                "validation, `evaluate` and `predict` run at their own batch "
                "size. Pass a `validation_batch_size` that fits (and a "
                "`batch_size` to `evaluate` and `predict`), such as the "
                f"model's micro_batch_size ({model.micro_batch_size})."
            )
        else:
            advice = _what_to_set(model.micro_batch_size)
        raise out_of_memory(error, advice) from error


def _what_to_set(micro_batch_size):
    if micro_batch_size is None:
        return (
            'A training step ran out of memory. Set micro_batch_size="auto" '
            "(or an int) to split each batch inside the step into slices "
            "that fit, with the same update; or pass a smaller batch_size "
            "with a larger accum_steps."
        )
    return (
        f"A training step ran out of memory in slices of {micro_batch_size} "
        "rows (micro_batch_size). Set a smaller micro_batch_size, or "
        'micro_batch_size="auto" to find the largest that fits and halve it '
        "when a later batch does not."
    )
