"""What a step's attempt may write before it fails, read and put back.

`_auto` runs a batch again after an out-of-memory error; what the failed
attempt's forward pass wrote (compiled metrics, non-trainable variables,
window moments) is read before each attempt, per replica, and put back
where it changed (`AttemptState`).
"""

import tensorflow as tf


class AttemptState:
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
