"""`AccumModel`: a `tf.keras.Model` whose `fit` accumulates gradients."""

import functools
import inspect
import warnings
import weakref

import tensorflow as tf

from accum_model import _keras
from accum_model import _noise_scale
from accum_model import _normalizers
from accum_model import _optimizer
from accum_model._accumulator import GradientAccumulator
from accum_model._window import APPENDED_STATE_COUNT
from accum_model._window import validate_accum_steps

ADAPTER = _keras.ADAPTER
keras = _keras.keras

EPOCH_END_MODES = ("apply", "carry")

_UNSET = type("Unset", (), {"__repr__": lambda self: "<default>"})()


def validate_epoch_end(epoch_end):
    """Returns `epoch_end` if it is a known mode, else raises `ValueError`."""
    if not isinstance(epoch_end, str) or epoch_end not in EPOCH_END_MODES:
        raise ValueError(
            f"`epoch_end` must be one of {EPOCH_END_MODES}. "
            f"Received: epoch_end={epoch_end!r}"
        )
    return epoch_end


class MultiWorkerFitWorkarounds:
    """Makes Keras 3.15's `fit` run under MultiWorkerMirroredStrategy.

    A mixin for a `keras.Model` (put it first among the bases). Keras' `fit`
    fails there on CPU for any model: see
    `_Keras3Adapter.symbolic_build_arguments` and
    `logs_for_replica_reduction`, both no-ops elsewhere and under tf_keras.
    `AccumModel` has it; tests and benchmarks put it on the plain
    `keras.Model` they compare with, so that both run under the strategy.
    """

    def train_step(self, data):
        return ADAPTER.logs_for_replica_reduction(
            self, super().train_step(data)
        )

    def test_step(self, data):
        return ADAPTER.logs_for_replica_reduction(self, super().test_step(data))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 only (tf_keras never calls it).
        iterator, data_batch = ADAPTER.symbolic_build_arguments(
            self, iterator, data_batch
        )
        return super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )


class _KeepsOwnBases(type):
    """The metaclass of `AccumModel`: its bases are never rewritten.

    When a subclass of a Keras model class is constructed with `inputs` and
    `outputs`, Keras rewrites `__bases__` of every ancestor, replacing
    `keras.Model` with `Functional` (`ADAPTER.inject_functional`). Applied
    to `AccumModel` (by `class X(AccumModel, Task)`, or by any keras-hub
    task class among the bases) it would make every later subclass-style
    `AccumModel` a Functional one, and break the MRO of `(Functional,
    AccumModel)` classes. `AccumModel` builds Functional classes of its own
    (`ADAPTER.functional_variant`), so the rewrite is skipped for it.
    """

    def __setattr__(cls, name, value):
        if name == "__bases__" and "_keeps_own_bases" in cls.__dict__:
            return
        super().__setattr__(name, value)


class AccumModel(
    MultiWorkerFitWorkarounds, keras.Model, metaclass=_KeepsOwnBases
):
    """A `tf.keras.Model` that trains as if its batch were `accum_steps` larger.

    `fit` feeds micro-batches of `batch_size` samples; `AccumModel` keeps the
    sum of their gradients, each weighted by what its mean loss divided by
    (its number of samples), and once every `accum_steps` micro-batches applies
    `sum(w_k * g_k) / sum(w_k)` through the compiled optimizer. That is the
    gradient of the large batch, so training equals plain training with
    `batch_size * accum_steps`, with the memory of `batch_size`.
    `optimizer.iterations` counts applied updates, so learning-rate schedules,
    weight decay, EMA and clipping act once per update.

    Everything runs inside the one `train_function` that `fit` compiles: no
    retrace per window, per epoch or when `accum_steps` changes.

    Example:

    ```python
    class Net(AccumModel):
        def __init__(self):
            super().__init__(accum_steps=8)
            self.dense = tf.keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)

    # or functionally
    model = AccumModel(inputs=inputs, outputs=outputs, accum_steps=8)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=3)   # updates of 128 samples
    ```

    Args:
        *args: Passed to `tf.keras.Model` (e.g. `inputs`, `outputs`).
        accum_steps: Int >= 1 (default 1). Micro-batches per update; 1 is plain
            training. Also a read/write property: a new value takes effect when
            the next window opens, without retracing.
        epoch_end: `"apply"` (default) applies a partly filled window at the end
            of every epoch, before validation and the `on_epoch_end`
            callbacks, so they see the epoch's final weights. `"carry"` keeps
            the window open into the next epoch (Keras' built-in behaviour).
        noise_scale: `False` (default), `True` or an
            `accum_model.NoiseScale(every=..., beta=...)`: measure the
            gradient noise scale `B_simple` of the windows and log it as
            `logs["gradient_noise_scale"]` (see docs/noise_scale.md). Off,
            the training step is unchanged.
        **kwargs: Passed to `tf.keras.Model` (e.g. `name`).

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1, if `epoch_end` is
            not a known mode, or if Keras does not run on TensorFlow.
        TypeError: If `noise_scale` is not one of the above.
    """

    _keeps_own_bases = True

    def __init__(
        self,
        *args,
        accum_steps=_UNSET,
        epoch_end=_UNSET,
        noise_scale=_UNSET,
        **kwargs,
    ):
        # Given to a subclass's `__init__` that did not pass them on (see
        # `_seeing_accumulation_arguments`), else the defaults.
        given = self.__dict__.get("_accum_new_kwargs", {})
        if accum_steps is _UNSET:
            accum_steps = given.get("accum_steps", 1)
        if epoch_end is _UNSET:
            epoch_end = given.get("epoch_end", "apply")
        if noise_scale is _UNSET:
            noise_scale = given.get("noise_scale", False)
        ADAPTER.check_backend()
        accum_steps = validate_accum_steps(accum_steps)
        epoch_end = validate_epoch_end(epoch_end)
        noise_scale = _noise_scale.as_config(noise_scale)
        if ADAPTER.is_functional_call(args, kwargs):
            if not issubclass(type(self), ADAPTER.functional_class):
                # What `keras.Model.__init__` does first, for the other
                # Keras model classes among the bases (`class X(Task,
                # AccumModel)`: keras-hub's `PipelineModel` has just taken
                # Functional out of its bases and expects it back).
                ADAPTER.inject_functional(type(self))
            self.__class__ = ADAPTER.functional_variant(type(self))
            ADAPTER.init_functional(self, args, kwargs)
        else:
            self.__class__ = ADAPTER.non_functional_base(type(self))
            super().__init__(*args, **kwargs)
        _init_accumulation(self, accum_steps, epoch_end, noise_scale)

    # Configuration

    @property
    def accum_steps(self):
        """Int. Micro-batches per optimizer update."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        value = validate_accum_steps(value)
        self._accum_steps = value
        engine = self._accumulation.engine
        if engine is not None:
            engine.accum_steps = value

    @property
    def epoch_end(self):
        """Str. What happens to a partly filled window when an epoch ends."""
        return self._epoch_end

    @epoch_end.setter
    def epoch_end(self, value):
        self._epoch_end = validate_epoch_end(value)

    @property
    def noise_scale(self):
        """The `NoiseScale` measured, or None (off).

        Settable before the first training step only (the measurement is
        part of the compiled step).
        """
        return self._noise_scale

    @noise_scale.setter
    def noise_scale(self, value):
        value = _noise_scale.as_config(value)
        if value != self._noise_scale and self._accumulation.engine is not None:
            raise ValueError(
                "`noise_scale` can only be set before the model is trained "
                "(it is part of the compiled training step). Received: "
                f"noise_scale={value!r} after training started"
            )
        self._noise_scale = value

    @property
    def gradient_noise_scale(self):
        """Float: the measured `B_simple`, in the loss normalizer's unit.

        NaN before a window gave an estimate, None when `noise_scale` is
        off. The engine's `noise_scale` has the parts.
        """
        engine = self._accumulation.engine
        if engine is None or engine.noise_scale is None:
            return None if self._noise_scale is None else float("nan")
        return float(engine.noise_scale.b_simple)

    @property
    def gradient_accumulator(self):
        """The `GradientAccumulator` holding the window (None before fit)."""
        return self._accumulation.engine

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_accum_base" in cls.__dict__:
            return  # Made by `accumulate`, never constructed.
        init = cls.__init__
        if init is not AccumModel.__init__ and not getattr(
            init, "_accum_sees_arguments", False
        ):
            cls.__init__ = _seeing_accumulation_arguments(init)
        # `class X(Task, AccumModel)`: a base before `AccumModel` whose
        # `get_config` does not chain to ours (keras-hub's `Task`) would
        # drop `accum_steps` from saved files and clones.
        if cls.get_config is not AccumModel.get_config:
            cls.get_config = _with_accumulation_config(cls.get_config)

    def get_config(self):
        if isinstance(self, ADAPTER.functional_class) and (
            _next_definer(type(self), AccumModel, "get_config")
            in _KERAS_CONFIG_CLASSES
        ):
            config = ADAPTER.functional_config(self)
        else:
            config = super().get_config()
        config.update(_accumulation_config(self))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        accum_steps = config.pop("accum_steps", None)
        epoch_end = config.pop("epoch_end", None)
        noise_scale = config.pop("noise_scale", None)
        next_from_config = super().from_config
        if "custom_objects" in inspect.signature(next_from_config).parameters:
            model = next_from_config(config, custom_objects=custom_objects)
        else:  # keras-hub's `Task.from_config(config)`, for one.
            model = next_from_config(config)
        if noise_scale is not None:
            model.noise_scale = noise_scale
        if accum_steps is not None:
            model.accum_steps = accum_steps
        if epoch_end is not None:
            model.epoch_end = epoch_end
        return model

    # The hook for custom losses

    def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
        """Returns what this micro-batch's loss was divided by.

        The one hook for losses that divide by something else. Micro-batch
        `k`'s gradient enters the window with this weight `w_k`, and an update
        applies `sum(w_k * g_k) / sum(w_k)`: the large batch's gradient when
        `w_k` is what micro-batch `k`'s loss divided by (up to a factor that
        is the same for every micro-batch). The default reads the compiled
        loss's rule, per output:

        - the number of samples for Keras' default reduction
          (`"sum_over_batch_size"`);
        - the number of valid elements when the output carries a Keras mask
          (e.g. `Embedding(mask_zero=True)` upstream of an RNN or Dense);
        - the sum of the sample weights for
          `reduction="mean_with_sample_weight"` (Keras 3);
        - 1 for `"sum"` reductions.

        Override it when `compute_loss` (or a custom loss's reduction) divides
        by something else, e.g. the number of non-padding tokens of a custom
        masked loss:

        ```python
        def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
            return tf.reduce_sum(tf.cast(y != PAD, tf.float32))
        ```

        It is called inside the training step, after `compute_loss`, and its
        result is not differentiated.

        Args:
            x: Input data of the micro-batch.
            y: Target data.
            y_pred: The model's predictions.
            sample_weight: Sample weights, or None.

        Returns:
            A float32 scalar tensor (any real dtype is cast).
        """
        return _normalizers.loss_normalizer(
            ADAPTER, self, x, y, y_pred, sample_weight
        )

    @property
    def skipped_microbatches(self):
        """Int. Micro-batches left out of their window for non-finite gradients.

        Counted over the life of the model (only a `LossScaleOptimizer`, as
        `mixed_float16` uses, skips micro-batches); also in the training logs
        as `"skipped_microbatches"` when one is in use.
        """
        engine = self._accumulation.engine
        return 0 if engine is None else int(engine.skipped_steps)

    @property
    def discarded_windows(self):
        """Int. Windows discarded, not applied, for non-finite gradients.

        A window whose accumulated gradients hold an `inf` or `NaN` is never
        applied, whether a full window, the epoch-end apply or
        `apply_accumulated()` closes it: it is discarded whole, counted here
        (over the life of the model; also in the training logs as
        `"discarded_windows"`) and a warning says so. The weights stay those
        of the last finite update, so `TerminateOnNaN` stops on finite
        weights.
        """
        engine = self._accumulation.engine
        return 0 if engine is None else int(engine.discarded_windows)

    def _warn_if_discarded(self):
        # Read once per epoch or flush, never per step: a host read would
        # wait for the step.
        state = self._accumulation
        discarded = self.discarded_windows
        if discarded > state.warned_discarded:
            warnings.warn(
                f"{discarded - state.warned_discarded} window(s) of "
                "accumulated gradients held inf or NaN and were discarded, "
                "not applied (the weights are those of the last finite "
                f"update; {discarded} discarded in all, "
                "`model.discarded_windows`).",
                stacklevel=3,
            )
        state.warned_discarded = discarded

    # Training

    def accumulate_gradients(self, grads, weight=1.0):
        """Adds a micro-batch's gradients to the window; applies it when full.

        For a `train_step` of your own that computes its gradients itself
        (where `super().train_step(data)` does not fit): call this where
        Keras' guide calls `self.optimizer.apply(grads)`, and `fit`
        accumulates as with `AccumModel`'s own step (epoch ends included).

        ```python
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.accumulate_gradients(grads, weight=tf.shape(x)[0])
            ...
        ```

        Args:
            grads: One gradient per variable of `self.trainable_variables`,
                of the micro-batch's *mean* loss (with a `LossScaleOptimizer`,
                as `GradientAccumulator.step` takes them).
            weight: Float scalar: what that mean divided by (the number of
                samples for Keras' default reduction, the number of tokens
                for a per-token mean). 1.0 weighs micro-batches equally.

        Returns:
            A bool scalar tensor: whether this call applied an update.
        """
        self._accumulation.stepped = True
        engine = self._accumulation.build()
        return engine.step(grads, self.optimizer, weight=weight)

    def train_step(self, data):
        # Seen when `fit` traces the step: it goes through the window.
        self._accumulation.stepped = True
        x, y, sample_weight = ADAPTER.unpack(data)
        scaling = ADAPTER.is_loss_scale_optimizer(self.optimizer)

        # Forward pass
        with tf.GradientTape() as tape:
            y_pred = ADAPTER.forward(self, x)
            loss = ADAPTER.compute_loss(self, x, y, y_pred, sample_weight)
            ADAPTER.track_loss(self, loss, _normalizers.batch_size(x, y))
            weight = tf.stop_gradient(
                tf.cast(
                    self.compute_loss_normalizer(x, y, y_pred, sample_weight),
                    tf.float32,
                )
            )
            objective = ADAPTER.unscale_loss_for_distribution(loss)
            # The forward pass has built a lazily built model by now; the
            # engine build also builds the optimizer, whose loss-scale
            # variable must exist before it is read (a value read before
            # would be baked into the traced step as a constant).
            engine = self._accumulation.build()
            if scaling:
                # As Keras scales it: the weight (which may be thousands of
                # tokens) must not push float16 gradients into overflow, so
                # it joins the unscaling multiply in float32 instead.
                scale = ADAPTER.loss_scale(self.optimizer)
                objective = objective * tf.cast(scale, objective.dtype)
            else:
                # The weight goes into the loss before the tape: one scalar
                # multiply instead of one per gradient element.
                objective = objective * tf.cast(weight, objective.dtype)

        # Compute gradients, accumulate, apply once the window is full.
        logs = {}
        if engine._variables:
            grads = tape.gradient(objective, engine._variables)
            # Under loss scaling, unscaled with the scale this micro-batch
            # used, so a scale change mid-window is harmless.
            _optimizer.add_micro_batch(
                engine,
                grads,
                weight,
                self.optimizer,
                weighted=True,
                gradient_scale=scale if scaling else None,
            )
            engine._close_if_full(self._apply_gradients)
            if engine.noise_scale is not None:
                logs["gradient_noise_scale"] = ADAPTER.replica_log(
                    self, engine.noise_scale.b_simple
                )
            # In every precision: a NaN gradient can come with a finite
            # loss (ReLU on a NaN input), which `TerminateOnNaN` never sees;
            # a callback can stop on this count instead.
            logs["discarded_windows"] = ADAPTER.replica_log(
                self, engine.discarded_windows
            )
            if scaling:
                # Where non-finite gradients are expected; elsewhere the
                # logs stay those of plain fit.
                logs["skipped_microbatches"] = ADAPTER.replica_log(
                    self, engine.skipped_steps
                )
        else:
            warnings.warn("The model does not have any trainable weights.")

        metrics = ADAPTER.compute_metrics(self, x, y, y_pred, sample_weight)
        if logs:
            metrics = dict(metrics)
            metrics.update(logs)
        # Its own train step, so it reshapes its logs itself (see
        # `MultiWorkerFitWorkarounds`).
        return ADAPTER.logs_for_replica_reduction(self, metrics)

    def _apply_gradients(self, grads, variables):
        _optimizer.apply_fn(self.optimizer)(grads, variables)

    def make_train_function(self, force=False):
        # Keras has built the model and the optimizer by now (fit's symbolic
        # build); create the accumulators here so that the train step never
        # creates variables and traces no more often than plain fit's.
        layers = ADAPTER.layers(self, include_self=True)
        if all(layer.built for layer in layers):
            self._accumulation.build()
        _warn_once_on_plain_batchnorm(self)
        # `fit` calls this on every call; the flush function (traced like the
        # train function, with the same optimizer and `run_eagerly`) is stale
        # only when the train function is rebuilt (after `compile`, or
        # `force`), so it is kept across `fit` calls otherwise.
        if force or self.train_function is None:
            self._flush_function = None
        return super().make_train_function(force=force)

    def apply_accumulated(self):
        """Applies a pending, partly filled window now (no-op when empty).

        A window whose gradients are not all finite is discarded instead
        (see `discarded_windows`), with a warning.

        Returns:
            Bool: whether an update was applied.
        """
        engine = self._accumulation.engine
        if engine is None or not _went_through_window(self):
            # A `train_step` of its own that applies updates itself (see
            # `_warn_once_on_bypass`): nothing was accumulated.
            return False
        if self._flush_function is None:
            self._flush_function = self._make_flush_function(engine)
        discarded = int(engine.discarded_windows)
        closed = bool(self._flush_function())
        applied = closed and int(engine.discarded_windows) == discarded
        self._warn_if_discarded()
        return applied

    def _make_flush_function(self, engine):
        strategy = self.distribute_strategy

        def flush():
            return engine._close_if(
                engine.micro_step > 0, self._apply_gradients
            )

        def run():
            return strategy.experimental_local_results(strategy.run(flush))[0]

        if self.run_eagerly:
            return run
        function = tf.function(run)
        # Traced once per model and called once per epoch: TensorFlow's
        # retracing warning (keyed by the code of `run`, shared by all
        # models) would fire after a few models in one process (k-fold, a
        # notebook) for retracing that is expected (`_omit_...`, private).
        function._omit_frequent_tracing_warning = True
        return function

    def fit(self, *args, **kwargs):
        # The arguments go on as they came, to whichever `fit` is next: a
        # base's own `fit` (keras-hub's takes `sample_weight` fourth, where
        # `keras.Model.fit` takes `epochs`). Only `callbacks` is changed,
        # where it was passed.
        next_fit = super().fit
        args, kwargs = list(args), dict(kwargs)
        position = _positional_index(next_fit, "callbacks")
        in_args = position is not None and position < len(args)
        callbacks = args[position] if in_args else kwargs.get("callbacks")
        flush = _EpochEndFlush()
        if isinstance(callbacks, keras.callbacks.CallbackList):
            flush.set_model(self)
            callbacks.callbacks.insert(0, flush)
        else:
            # First in the list, so later callbacks see the final weights.
            callbacks = [flush] + list(callbacks or [])
        if in_args:
            args[position] = callbacks
        else:
            kwargs["callbacks"] = callbacks
        return next_fit(*args, **kwargs)


AccumModel = ADAPTER.register_serializable(AccumModel)

# Keras' own `get_config`s, which write no constructor arguments of a
# Functional subclass.
_KERAS_CONFIG_CLASSES = tuple(
    c
    for c in (ADAPTER.functional_class, keras.Model, keras.layers.Layer)
    for c in c.__mro__
)


def _next_definer(cls, after, name):
    """The class after `after` in `cls`'s MRO that defines `name`."""
    mro = cls.__mro__
    for c in mro[mro.index(after) + 1 :]:
        if name in c.__dict__:
            return c
    return None


def _accumulation_config(model):
    config = dict(accum_steps=model.accum_steps, epoch_end=model.epoch_end)
    if model._noise_scale is not None:
        config["noise_scale"] = model._noise_scale.get_config()
    return config


def _with_accumulation_config(get_config):
    def get_config_with_accumulation(self):
        config = get_config(self)
        config.update(_accumulation_config(self))
        return config

    get_config_with_accumulation.__wrapped__ = get_config
    get_config_with_accumulation.__doc__ = get_config.__doc__
    return get_config_with_accumulation


def _seeing_accumulation_arguments(init):
    """Wraps a subclass's `__init__` so `AccumModel.__init__` sees its args.

    `class X(Base, AccumModel)` where `Base` builds itself functionally:
    once Keras has made `Base` Functional, `X(..., accum_steps=4)` reaches
    `AccumModel.__init__` only through `Functional.__init__`, which drops
    arguments it does not know. The wrapper keeps them on the instance
    first, and takes them out of what `init` passes on through its own
    `**kwargs` (tf_keras' `Functional.__init__` refuses unknown ones). Its
    signature stays `init`'s, which `clone_model` reads.
    """
    signature = inspect.signature(init)
    named = {
        name
        for name, p in signature.parameters.items()
        if p.kind is not p.VAR_KEYWORD
    }

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "_accum_new_kwargs" not in self.__dict__:
            given = {}
            for name in ("accum_steps", "epoch_end", "noise_scale"):
                if name in kwargs:
                    given[name] = (
                        kwargs[name] if name in named else kwargs.pop(name)
                    )
            object.__setattr__(self, "_accum_new_kwargs", given)
        init(self, *args, **kwargs)

    __init__.__signature__ = signature
    __init__._accum_sees_arguments = True
    return __init__


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


def _init_accumulation(model, accum_steps, epoch_end, noise_scale=None):
    model._accum_steps = accum_steps
    model._epoch_end = epoch_end
    model._noise_scale = noise_scale
    model._accumulation = _AccumulationState(model)
    model._flush_function = None


class _EpochEndFlush(ADAPTER.callback_base):
    """Applies a partial window at the end of each epoch (`epoch_end="apply"`).

    Validation in `fit` runs `evaluate` with fit's own callback list, so
    `on_test_begin` is the moment just before validation; `on_epoch_end`
    covers epochs without validation. The second call finds nothing pending.
    """

    def __init__(self):
        super().__init__()
        self._in_fit = False

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_train_end(self, logs=None):
        self._in_fit = False

    def on_test_begin(self, logs=None):
        if self._in_fit:
            self._flush()

    def on_epoch_end(self, epoch, logs=None):
        _warn_once_on_bypass(self.model)
        self._flush()
        self.model._warn_if_discarded()

    def _flush(self):
        if self.model.epoch_end == "apply":
            self.model.apply_accumulated()


class _AccumulationState(ADAPTER.saveable_base):
    """Holds the engine of an `AccumModel`: training state, not weights.

    Keras' saving visits this object (it is a saveable attribute of the model)
    and stores what `save_own_variables` writes, so `.keras` and `.weights.h5`
    files, `ModelCheckpoint` and `BackupAndRestore` keep an open window. Its
    variables are plain `tf.Variable`s, which Keras does not count as model
    weights, and a plain `tf.keras.Model` loading the file never visits it.
    """

    def __init__(self, model):
        super().__init__()
        self._model_ref = weakref.ref(model)
        self.engine = None
        self.warned_batchnorm = False
        self.warned_discarded = 0
        # Whether a traced step went through the window (`train_step` or
        # `accumulate_gradients`), and whether the model warned it did not.
        self.stepped = False
        self.warned_bypass = False
        # Set by `save_plain`: the file is for Keras alone, without a window.
        self.saving_plain = False

    def _obj_type(self):
        return ADAPTER.saveable_obj_type

    def build(self):
        """Creates the engine for the model's trainable variables, once.

        Runs eagerly (lifted out of any `tf.function` being traced), like
        Keras' own optimizer building, so it may be called from the first
        trace of the train step.
        """
        model = self._model_ref()
        variables = list(model.trainable_variables)
        if self.engine is not None and _same_variables(
            self.engine._variables, variables
        ):
            # A `compile` since may have brought an unbuilt optimizer, whose
            # loss-scale variable the train step reads before applying.
            if (
                model.optimizer is not None
                and variables
                and not ADAPTER.optimizer_built(model.optimizer)
            ):
                with tf.init_scope(), model.distribute_strategy.scope():
                    ADAPTER.build_optimizer(model.optimizer, variables)
            return self.engine
        with tf.init_scope():
            if self.engine is not None and int(self.engine.micro_step) > 0:
                warnings.warn(
                    "The trainable variables of the model changed while a "
                    "window of accumulated gradients was open; that window "
                    "is discarded.",
                    stacklevel=3,
                )
            with model.distribute_strategy.scope():
                engine = GradientAccumulator(
                    variables,
                    accum_steps=model.accum_steps,
                    noise_scale=model.noise_scale,
                    name="accumulation",
                )
                if model.optimizer is not None and variables:
                    ADAPTER.build_optimizer(model.optimizer, variables)
                # Eagerly and under the strategy, like the engine: layers
                # create their window state here.
                for layer in ADAPTER.layers(model):
                    attach = getattr(layer, "attach_to_accumulator", None)
                    if callable(attach):
                        attach(engine)
        self.engine = engine
        ADAPTER.track_state(model, engine)
        model._flush_function = None
        return engine

    def save_own_variables(self, store):
        if self.engine is None or self.saving_plain:
            return
        for i, v in enumerate(self.engine.state_variables):
            store[str(i)] = v.numpy()

    def load_own_variables(self, store):
        keys = list(store.keys())
        if not keys:
            # Saved by a plain model, or before any training: no open window.
            if self.engine is not None:
                self.engine.reset()
            return
        engine = self.build()
        state = engine.state_variables
        if len(keys) not in (len(state), len(state) - APPENDED_STATE_COUNT):
            raise ValueError(
                "The saved accumulation state does not match this model: "
                f"expected {len(state)} variables, received {len(keys)}."
            )
        for i, v in enumerate(state[: len(keys)]):
            v.assign(store[str(i)])
        for v in state[len(keys) :]:
            v.assign(tf.zeros_like(v))
        # Discarded before the save: warned about then.
        self.warned_discarded = int(engine.discarded_windows)
        _went_through_window(self._model_ref())


def _went_through_window(model):
    """Whether the model's steps go through its window.

    True once a traced step went through it, or once the window holds
    micro-batches: restored from a save, which tf_keras' `BackupAndRestore`
    does through a checkpoint of the engine's variables, never calling
    `load_own_variables`. Such a window is applicable at once, before any
    step of this process.
    """
    state = model._accumulation
    if not state.stepped and state.engine is not None:
        state.stepped = int(state.engine.micro_step) > 0
    return state.stepped


def _warn_once_on_bypass(model):
    state = model._accumulation
    if state.warned_bypass or _went_through_window(model):
        return
    state.warned_bypass = True
    warnings.warn(
        f"The `train_step` of {type(model).__name__} {model.name!r} did not "
        "go through `AccumModel.train_step` or `accumulate_gradients`, so "
        f"it applies every micro-batch itself: accum_steps="
        f"{model.accum_steps} and epoch_end={model.epoch_end!r} have no "
        "effect. Call `super().train_step(data)`, or pass the gradients to "
        "`self.accumulate_gradients(grads, weight)` instead of "
        "`self.optimizer.apply` (see docs/models.md).",
        stacklevel=2,
    )


def _warn_once_on_plain_batchnorm(model):
    state = model._accumulation
    if state.warned_batchnorm or model.accum_steps <= 1:
        return
    for layer in ADAPTER.layers(model):
        # A BatchNormalization subclass that takes the accumulator's hook
        # (`AccumBatchNormalization`) handles accumulation itself; a frozen
        # one runs in inference mode and updates nothing.
        if (
            isinstance(layer, keras.layers.BatchNormalization)
            and layer.trainable
            and not callable(getattr(layer, "attach_to_accumulator", None))
        ):
            state.warned_batchnorm = True
            warnings.warn(
                f"`AccumModel` with accum_steps={model.accum_steps} trains "
                f"the BatchNormalization layer {layer.name!r}: its moving "
                "mean and variance are updated once per micro-batch (they "
                "decay like momentum ** accum_steps per update and follow "
                "micro-batch moments). Use "
                "`accum_model.AccumBatchNormalization`, or "
                "`accum_model.replace_batchnorm(model)`, to update them once "
                "per update from the pooled moments of the whole window.",
                stacklevel=2,
            )
            return


def _same_variables(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
