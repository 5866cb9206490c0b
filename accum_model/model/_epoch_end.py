"""What happens to a window when an epoch ends (`AccumModel.epoch_end`).

`AccumModel.fit` puts `EpochEndFlush` first among the callbacks; with
`epoch_end="apply"` it calls `AccumModel.apply_accumulated`, which runs the
accumulator's `apply` through the function made here.
"""

import inspect

import tensorflow as tf

from accum_model.core._control_flow import first_replica
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras


def with_flush_callback(model, state, next_fit, args, kwargs):
    """`fit`'s arguments with an `EpochEndFlush` first among the callbacks.

    Args:
        model: The `AccumModel`.
        state: Its `ModelEngine`, which gives the epoch end's warnings.
        next_fit: The `fit` the arguments go to (a base's own `fit` may take
            `callbacks` at another position than `keras.Model.fit`).
        args: The positional arguments as `fit` received them.
        kwargs: The keyword arguments.

    Returns:
        `(args, kwargs)`, with `callbacks` changed where it was passed.
    """
    args, kwargs = list(args), dict(kwargs)
    position = _positional_index(next_fit, "callbacks")
    in_args = position is not None and position < len(args)
    callbacks = args[position] if in_args else kwargs.get("callbacks")
    flush = EpochEndFlush(state)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        flush.set_model(model)
        callbacks.callbacks.insert(0, flush)
    else:
        # First in the list, so later callbacks see the final weights.
        callbacks = [flush] + list(callbacks or [])
    if in_args:
        args[position] = callbacks
    else:
        kwargs["callbacks"] = callbacks
    return args, kwargs


def flush_function(model, accumulator):
    """`accumulator.apply(model.optimizer)`, run as `fit` runs a step.

    Under the model's strategy, traced like its train function (the same
    optimizer and `run_eagerly`), but never compiled with XLA, its update
    included: it runs once per epoch, not worth a compilation.

    Returns:
        A callable without arguments returning whether a window closed.
    """
    strategy = model.distribute_strategy

    def flush():
        return accumulator.apply(
            model.optimizer, jit_compile=False, compile_update=False
        )

    def run():
        return first_replica(strategy, strategy.run(flush))

    if model.run_eagerly:
        return run
    function = tf.function(run)
    # Traced once per model and called once per epoch: TensorFlow's
    # retracing warning (keyed by the code of `run`, shared by all models)
    # would fire after a few models in one process (k-fold, a notebook) for
    # retracing that is expected (`_omit_...`, private).
    function._omit_frequent_tracing_warning = True
    return function


class EpochEndFlush(ADAPTER.callback_base):
    """Applies a partial window at the end of each epoch (`epoch_end="apply"`).

    Validation in `fit` runs `evaluate` with fit's own callback list, so
    `on_test_begin` is the moment just before validation; `on_epoch_end`
    covers epochs without validation. The second call finds nothing pending.

    Args:
        state: The model's `ModelEngine`.
    """

    def __init__(self, state):
        super().__init__()
        self._state = state
        self._in_fit = False

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_train_end(self, logs=None):
        self._in_fit = False

    def on_test_begin(self, logs=None):
        if self._in_fit:
            self._flush()

    def on_epoch_end(self, epoch, logs=None):
        self._state.warn_once_on_bypass()
        self._flush()
        self._state.warn_if_discarded()
        if logs is not None:
            # First among the callbacks: the others (History, the progress
            # bar) see these too.
            logs.update(self._state.epoch_logs())

    def _flush(self):
        if self.model.epoch_end == "apply":
            self.model.apply_accumulated()


def _positional_index(fn, name):
    """Where `fn` takes `name` by position, or None."""
    index = 0
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind not in (
            parameter.POSITIONAL_ONLY,
            parameter.POSITIONAL_OR_KEYWORD,
        ):
            return None
        if parameter.name == name:
            return index
        index += 1
    return None
