"""What an `AccumModel` keeps besides its weights, and what it warns once.

`ModelEngine` holds the model's `GradientAccumulator` (built once the
model and its optimizer are), is saved with the model, runs what goes
through it besides `train_step` (a batch in slices, the flush of a partial
window), and keeps the flags of the warnings a model gives once (a
`train_step` that bypasses the window, a plain BatchNormalization,
discarded windows).
"""

import contextlib
import warnings
import weakref

import tensorflow as tf

from accum_model.core._validation import check_optimizer_not_accumulating
from accum_model.engine import _adascale
from accum_model.engine import _checkpoint
from accum_model.engine import _state
from accum_model.engine._accumulator import GradientAccumulator
from accum_model.keras import _adapter
from accum_model.keras._optimizers import build_optimizer
from accum_model.model import _epoch_end
from accum_model.model import _normalizers
from accum_model.model import _settings
from accum_model.model import _split

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras


class ModelEngine(ADAPTER.saveable_base):
    """Holds the accumulator of an `AccumModel`: training state, not weights.

    Keras' saving visits this object (it is a saveable attribute of the model)
    and stores what `save_own_variables` writes, so `.keras` and `.weights.h5`
    files, `ModelCheckpoint` and `BackupAndRestore` keep an open window. Its
    variables are plain `tf.Variable`s, which Keras does not count as model
    weights, and a plain `tf.keras.Model` loading the file never visits it.

    Args:
        model: The `AccumModel` (held by a weak reference).
    """

    def __init__(self, model):
        super().__init__()
        self._model_ref = weakref.ref(model)
        self.accumulator = None
        self._warned_batchnorm = False
        self._warned_discarded = 0
        # Whether a traced step went through the window (`train_step` or
        # `accumulate_gradients`), and whether the model warned it did not.
        self._traced_through_window = False
        self._warned_bypass = False
        self._without_window = False
        # The flush of a partial window (`flush`), traced like the train
        # function and for one accumulator.
        self._flush_function = None
        self._flush_accumulator = None

    def _obj_type(self):
        # Private (Keras 3): the kind of object saving records.
        return ADAPTER.saveable_obj_type

    def build(self):
        """Creates the accumulator for the model's trainable variables, once.

        Runs eagerly (lifted out of any `tf.function` being traced), like
        Keras' own optimizer building, so it may be called from the first
        trace of the train step.

        Returns:
            The `GradientAccumulator`.
        """
        model = self._model_ref()
        variables = list(model.trainable_variables)
        if self.accumulator is not None and _same_variables(
            self.accumulator.updated_variables, variables
        ):
            # A `compile` since may have brought an unbuilt optimizer, whose
            # loss-scale variable the train step reads before applying.
            if model.optimizer is not None and not ADAPTER.optimizer_built(
                model.optimizer
            ):
                with tf.init_scope(), model.distribute_strategy.scope():
                    build_optimizer(model.optimizer, variables)
            return self.accumulator
        if model.optimizer is not None:
            # Before any variable is created or changed (also when a file
            # is loaded before any `fit`).
            check_optimizer_not_accumulating(model.optimizer)
            if model.adascale is not None:
                _adascale.check_optimizer(model.optimizer)
        with tf.init_scope():
            if (
                self.accumulator is not None
                and int(self.accumulator.micro_step) > 0
            ):
                warnings.warn(
                    "The trainable variables of the model changed while a "
                    "window of accumulated gradients was open; that window "
                    "is discarded.",
                    stacklevel=3,
                )
            with model.distribute_strategy.scope():
                accumulator = GradientAccumulator(
                    variables,
                    accum_steps=model.accum_steps,
                    noise_scale=model.noise_scale,
                    adascale=model.adascale,
                    name="accumulation",
                )
                accumulator.state.place_items_in(
                    _state.variable_path(w) for w in model.weights
                )
                if model.optimizer is not None:
                    build_optimizer(model.optimizer, variables)
                # Eagerly and under the strategy, like the accumulator:
                # layers create their window state here.
                for layer in ADAPTER.layers(model):
                    attach = getattr(layer, "attach_to_accumulator", None)
                    if callable(attach):
                        attach(accumulator)
        self.accumulator = accumulator
        ADAPTER.track_state(
            model, _checkpoint.StateCheckpoint(accumulator.state)
        )
        return accumulator

    # What goes through the window besides `train_step`

    def split_train_step(self, data, size, *, resumable, compilation):
        """The model's `train_step` for a batch in slices (`_split`).

        Args:
            data: The batch.
            size: The rows of a slice; None runs the batch as one.
            resumable: Whether the batch may run again after an
                out-of-memory error (`_auto`; never under XLA).
            compilation: `GradientAccumulator.step`'s `jit_compile` and
                `compile_update`, from the model's settings.

        Returns:
            The step's logs.
        """
        model = self._model_ref()
        self.traced_through_window()
        # Built eagerly before the trace (`make_train_function`) when the
        # model is: the slices' forward passes run inside a loop, where no
        # layer may create its weights. A model built lazily (a Sequential
        # without an `Input`, a subclassed model) is built here by a
        # forward pass of one row, in inference mode so that it moves no
        # statistic.
        x, y, _ = ADAPTER.unpack(data)
        if not all(
            layer.built for layer in ADAPTER.layers(model, include_self=True)
        ):
            model(tf.nest.map_structure(lambda t: t[:1], x), training=False)
        accumulator = self.build()
        scaling = ADAPTER.is_loss_scale_optimizer(model.optimizer)
        xla = bool(model.jit_compile)
        loss, _ = _split.train_batch(
            model,
            accumulator,
            data,
            size,
            scale=ADAPTER.loss_scale(model.optimizer) if scaling else None,
            xla=xla,
            resumable=resumable and not xla,
            compilation=compilation,
        )
        ADAPTER.track_loss(model, loss, _normalizers.batch_size(x, y))
        return step_logs(
            model, model.get_metrics_result(), window_logs(accumulator, scaling)
        )

    def forget_flush(self):
        """Drops the flush function: the train function was rebuilt."""
        self._flush_function = None

    def flush(self):
        """Applies a pending, partly filled window (`apply_accumulated`).

        Returns:
            Bool: whether an update was applied.
        """
        accumulator = self.accumulator
        if accumulator is None or not self.goes_through_window():
            # A `train_step` of its own that applies updates itself (see
            # `warn_once_on_bypass`): nothing was accumulated.
            return False
        if self._flush_function is None or (
            self._flush_accumulator is not accumulator
        ):
            # A new accumulator (the trainable variables changed) or a new
            # train function: traced again.
            self._flush_function = _epoch_end.flush_function(
                self._model_ref(), accumulator
            )
            self._flush_accumulator = accumulator
        discarded = int(accumulator.discarded_windows)
        closed = bool(self._flush_function())
        applied = closed and int(accumulator.discarded_windows) == discarded
        self.warn_if_discarded()
        return applied

    @contextlib.contextmanager
    def discarding_interrupted_batch(self):
        """Discards the window when an error ends a step part-way into it.

        An error inside a training step (an out-of-memory error, most
        often) can stop it after some of its gradients were added: the
        window then holds part of a batch, which no later step could
        complete, so it is discarded, with a warning, before the error goes
        on.
        """
        try:
            yield
        except tf.errors.OpError:
            accumulator = self.accumulator
            if accumulator is not None and accumulator.batch_interrupted():
                accumulator.reset()
                warnings.warn(
                    "A training step stopped with an error part-way into "
                    "its batch: the open window of accumulated gradients, "
                    "which holds part of that batch, is discarded.",
                    stacklevel=3,
                )
            raise

    @contextlib.contextmanager
    def without_window(self):
        """Saves made inside leave the window out (`save_plain`)."""
        self._without_window = True
        try:
            yield
        finally:
            self._without_window = False

    def save_own_variables(self, store):
        # By name (`_state`): a file outlives the order of the variables.
        if self.accumulator is None or self._without_window:
            return
        self.accumulator.state.save(store)

    def load_own_variables(self, store):
        if not list(store.keys()):
            # Saved by a plain model, or before any training: no open window.
            if self.accumulator is not None:
                self.accumulator.reset()
            return
        self.build().state.load(store)
        # Discarded before the save: warned about then.
        self._warned_discarded = int(self.accumulator.discarded_windows)
        self.goes_through_window()

    # Whether `fit` goes through the window

    def traced_through_window(self):
        """Records that a step being traced goes through the window."""
        self._traced_through_window = True

    def goes_through_window(self):
        """Whether the model's steps go through its window.

        True once a traced step went through it, or once the window holds
        micro-batches: restored from a save, which tf_keras'
        `BackupAndRestore` does through a TensorFlow checkpoint
        (`_checkpoint.StateCheckpoint`), never calling
        `load_own_variables`. Such a window is
        applicable at once, before any step of this process.
        """
        if not self._traced_through_window and self.accumulator is not None:
            self._traced_through_window = int(self.accumulator.micro_step) > 0
        return self._traced_through_window

    # Warnings given once

    def warn_once_on_bypass(self):
        model = self._model_ref()
        if self._warned_bypass or self.goes_through_window():
            return
        self._warned_bypass = True
        warnings.warn(
            f"The `train_step` of {type(model).__name__} {model.name!r} did "
            "not go through `AccumModel.train_step` or "
            "`accumulate_gradients`, so it applies every micro-batch itself: "
            f"accum_steps={model.accum_steps} and "
            f"epoch_end={model.epoch_end!r} have no effect. Call "
            "`super().train_step(data)`, or pass the gradients to "
            "`self.accumulate_gradients(grads, weight)` instead of "
            "`self.optimizer.apply` (see docs/models.md).",
            stacklevel=2,
        )

    def warn_once_on_plain_batchnorm(self):
        model = self._model_ref()
        splits = model.micro_batch_size is not None
        if self._warned_batchnorm or (model.accum_steps <= 1 and not splits):
            return
        for layer in ADAPTER.layers(model):
            # A BatchNormalization subclass that takes the accumulator's
            # hook (`AccumBatchNormalization`) handles accumulation itself;
            # a frozen one runs in inference mode and updates nothing.
            if (
                isinstance(layer, keras.layers.BatchNormalization)
                and layer.trainable
                and not callable(getattr(layer, "attach_to_accumulator", None))
            ):
                self._warned_batchnorm = True
                what = (
                    f"micro_batch_size={model.micro_batch_size!r}"
                    if splits
                    else f"accum_steps={model.accum_steps}"
                )
                warnings.warn(
                    f"`AccumModel` with {what} trains the "
                    f"BatchNormalization layer {layer.name!r}: its moving "
                    "mean and variance are updated once per micro-batch "
                    "(they decay like momentum ** micro-batches per update "
                    "and follow micro-batch moments). Use "
                    "`accum_model.AccumBatchNormalization`, or "
                    "`accum_model.replace_batchnorm(model)`, to update them "
                    "once per update from the pooled moments of the whole "
                    "window.",
                    stacklevel=2,
                )
                return

    def epoch_logs(self):
        """What an epoch's logs add: only what says something, as ints.

        `discarded_windows` once a window was discarded (a NaN gradient can
        come with a finite loss, which `TerminateOnNaN` never sees);
        `micro_batch_size` when `"auto"` chose it.
        """
        model = self._model_ref()
        logs = {}
        if self.accumulator is not None:
            discarded = int(self.accumulator.discarded_windows)
            if discarded:
                logs["discarded_windows"] = discarded
        setting = _settings.micro_batch_setting(model)
        if setting == "auto" and isinstance(model.micro_batch_size, int):
            logs["micro_batch_size"] = model.micro_batch_size
        return logs

    def warn_if_discarded(self):
        # Read once per epoch or flush, never per step: a host read would
        # wait for the step.
        if self.accumulator is None:
            return
        discarded = int(self.accumulator.discarded_windows)
        if discarded > self._warned_discarded:
            warnings.warn(
                f"{discarded - self._warned_discarded} window(s) of "
                "accumulated gradients held inf or NaN and were discarded, "
                "not applied (the weights are those of the last finite "
                f"update; {discarded} discarded in all, "
                "`model.discarded_windows`).",
                stacklevel=3,
            )
        self._warned_discarded = discarded


def _same_variables(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def step_logs(model, metrics, window_logs):
    """The logs of the model's own train step, reshaped as Keras' are (see
    `MultiWorkerFitWorkarounds`)."""
    logs = ADAPTER.train_logs(model, metrics, window_logs)
    return ADAPTER.logs_for_replica_reduction(model, logs)


def window_logs(accumulator, scaling):
    """What a training step adds to `fit`'s logs about the window."""
    logs = {}
    if accumulator.noise_scale is not None:
        logs["gradient_noise_scale"] = accumulator.noise_scale.b_simple
    adascale = accumulator.adascale
    if adascale is not None:
        logs["adascale_gain"] = adascale.gain
        logs["adascale_tau"] = adascale.tau
        logs["adascale_lr"] = adascale.learning_rate
    if scaling:
        # Where non-finite gradients are expected; elsewhere the logs stay
        # those of plain fit.
        logs["skipped_microbatches"] = accumulator.skipped_microbatches
    return {key: tf.cast(value, tf.float32) for key, value in logs.items()}
