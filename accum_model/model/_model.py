"""`AccumModel`: a `tf.keras.Model` whose `fit` accumulates gradients.

The training path: `train_step` (one micro-batch into the window, which
applies when full), the epoch-end flush and `fit`. Its settings and the
readings of its window are in `_settings`, how its objects and classes are
built in `_model_classes`, what it keeps besides its weights in
`_model_engine`, and the window itself in `_accumulator`.
"""

import warnings

import tensorflow as tf

from accum_model.core._validation import check_not_fit_arguments
from accum_model.core._validation import check_optimizer_not_accumulating
from accum_model.keras import _adapter
from accum_model.keras._multi_worker import MultiWorkerFitWorkarounds
from accum_model.model import _auto
from accum_model.model import _epoch_end
from accum_model.model import _model_classes
from accum_model.model import _normalizers
from accum_model.model._inference import SlicedInference
from accum_model.model._model_engine import ModelEngine
from accum_model.model._model_engine import step_logs
from accum_model.model._model_engine import window_logs
from accum_model.model._settings import AccumSettings

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras
UNSET = _model_classes.UNSET


class AccumModel(
    MultiWorkerFitWorkarounds,
    AccumSettings,
    SlicedInference,
    keras.Model,
    metaclass=_model_classes.KeepsOwnBases,
):
    """A `tf.keras.Model` that trains as if its batch were `accum_steps` larger.

    `fit` feeds micro-batches of `batch_size` samples; `AccumModel` keeps the
    sum of their gradients, each weighted by what its mean loss divided by
    (`compute_loss_normalizer`), and once every `accum_steps` micro-batches
    applies `sum(w_k * g_k) / sum(w_k)` through the compiled optimizer: the
    gradient of the large batch, with the memory of `batch_size`.
    `optimizer.iterations` counts applied updates, so learning-rate
    schedules, weight decay, EMA and clipping act once per update. All of it
    runs in the one `train_function` `fit` compiles: no retrace per window,
    per epoch or when `accum_steps` changes.

    Example:

    ```python
    model = AccumModel(inputs=inputs, outputs=outputs, accum_steps=8)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=3)   # updates of 128 samples
    ```

    Subclassed, pass `accum_steps=8` to `super().__init__`.

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
            `logs["gradient_noise_scale"]` (see docs/noise_scale.md).
        adascale: None (default) or an `accum_model.AdaScale(base_batch=...)`:
            AdaScale SGD. Each update's learning rate is multiplied by the
            gain `r` (between 1 and the window's weight over `base_batch`)
            measured from the windows' gradient noise, and a learning-rate
            schedule is read at the scale-invariant iteration `tau`; logs
            `adascale_gain`, `adascale_tau` and `adascale_lr` (see
            docs/adascale.md). Turns `noise_scale` on with its defaults when
            it is off. The compiled optimizer must be `SGD`.
        **kwargs: Passed to `tf.keras.Model` (e.g. `name`).

    Raises:
        ValueError: If `accum_steps` is not an integer >= 1, if `epoch_end` is
            not a known mode, if `adascale` is on with `noise_scale` measuring
            less often than every window, or if Keras does not run on
            TensorFlow. When the train function is built with an optimizer
            that has Keras' own `gradient_accumulation_steps` set (at any
            `accum_steps`: the two windows would multiply). With `adascale`,
            when it is built with an optimizer other than SGD, or SGD with
            `weight_decay` or gradient clipping.
        TypeError: If `noise_scale` or `adascale` is not one of the above,
            or for a keyword close to one of these four names that the
            Keras model does not take either (such as `acum_steps`).
    """

    _keeps_own_bases = True

    def __init__(
        self,
        *args,
        accum_steps=UNSET,
        epoch_end=UNSET,
        noise_scale=UNSET,
        adascale=UNSET,
        micro_batch_size=UNSET,
        **kwargs,
    ):
        accum_steps, epoch_end, noise_scale, adascale, micro_batch_size = (
            _model_classes.checked_arguments(
                self,
                kwargs,
                accum_steps,
                epoch_end,
                noise_scale,
                adascale,
                micro_batch_size,
            )
        )
        if ADAPTER.is_functional_call(args, kwargs):
            _model_classes.init_functional(self, args, kwargs)
        else:
            # Class surgery, undoing `init_functional`'s: a construction
            # without `inputs` and `outputs` through the `(cls, Functional)`
            # class of a functional object (`type(model)(...)`, a
            # `from_config`) makes a plain `cls` again.
            self.__class__ = ADAPTER.non_functional_base(type(self))
            super().__init__(*args, **kwargs)
        self._init_accumulation(
            accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
        )

    def _init_accumulation(
        self, accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
    ):
        """What `__init__` gives a model; `accumulate` gives it to one too.

        Args:
            accum_steps: Int >= 1, checked.
            epoch_end: Str, checked.
            noise_scale: A `NoiseScale`, or None.
            adascale: An `AdaScale`, or None; checked against `noise_scale`.
            micro_batch_size: None, `"auto"` or an int >= 1, checked.
        """
        self._init_settings(
            accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
        )
        self._accum_state = ModelEngine(self)

    @property
    def gradient_accumulator(self):
        """The `GradientAccumulator` holding the window (None before fit)."""
        return self._accum_state.accumulator

    # Construction and configs (see `_model_classes`)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _model_classes.prepare_subclass(cls, AccumModel)

    def get_config(self):
        config = _model_classes.base_config(
            self, AccumModel, super().get_config
        )
        config.update(self.get_accumulation_config())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = _model_classes.from_config(
            super().from_config, config, custom_objects
        )
        return model

    # The hook for custom losses

    @_normalizers.default
    def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
        """Returns what this micro-batch's loss was divided by.

        The one hook for losses that divide by something else: micro-batch
        `k`'s gradient enters the window with this weight `w_k`. The default
        reads the compiled loss's rule per output (samples; valid elements
        under a Keras mask; the sample-weight sum for
        `reduction="mean_with_sample_weight"`; 1 for `"sum"`; see
        docs/normalizers.md). Override it when `compute_loss` divides by
        something else, e.g. a custom masked loss's non-padding tokens:

        ```python
        def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
            return tf.reduce_sum(tf.cast(y != PAD, tf.float32))
        ```

        Called inside the training step, after `compute_loss`; its result
        is not differentiated.

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

    # Training

    def accumulate_gradients(self, grads, weight=1.0):
        """Adds a micro-batch's gradients to the window; applies it when full.

        For a `train_step` of your own that computes its gradients itself:
        call this where Keras' guide calls `self.optimizer.apply(grads)`,
        and `fit` accumulates as with `AccumModel`'s own step (see
        docs/models.md).

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
        self._accum_state.traced_through_window()
        accumulator = self._accum_state.build()
        return accumulator.step(
            grads,
            self.optimizer,
            weight=weight,
            **self._compilation,
        )

    def train_step(self, data):
        # Seen when `fit` traces the step: it goes through the window.
        self._accum_state.traced_through_window()
        if self.micro_batch_size not in (None, "auto"):
            return self._split_train_step(data, self.micro_batch_size)
        x, y, sample_weight = ADAPTER.unpack(data)
        scaling = ADAPTER.is_loss_scale_optimizer(self.optimizer)

        # Forward pass
        with tf.GradientTape() as tape:
            y_pred = ADAPTER.forward(self, x)
            loss = ADAPTER.compute_loss(self, x, y, y_pred, sample_weight)
            ADAPTER.track_loss(self, loss, _normalizers.batch_size(x, y))
            # Built after the forward pass (which builds a lazily built
            # model), with the optimizer, whose loss scale must be a variable
            # before it is read (or the trace would keep it as a constant).
            accumulator = self._accum_state.build()
            loss_scale = ADAPTER.loss_scale(self.optimizer) if scaling else None
            objective, weight = _normalizers.weighted_objective(
                ADAPTER, self, (x, y, sample_weight), y_pred, loss, loss_scale
            )

        # Compute gradients, accumulate, apply once the window is full.
        logs = {}
        variables = accumulator.updated_variables
        if variables:
            grads = tape.gradient(objective, variables)
            accumulator.step(
                grads,
                self.optimizer,
                weight=weight,
                loss_scale=loss_scale,
                **self._compilation,
                weight_in_loss=not scaling,
            )
            logs = window_logs(accumulator, scaling)
        else:
            warnings.warn("The model does not have any trainable weights.")

        metrics = ADAPTER.compute_metrics(self, x, y, y_pred, sample_weight)
        return step_logs(self, metrics, logs)

    def _split_train_step(self, data, size=None, resumable=False):
        """`train_step` for a batch split into slices of `size` rows (None:
        one slice), resumable after an out-of-memory error or not (`_auto`).
        """
        return self._accum_state.split_train_step(
            data, size, resumable=resumable, compilation=self._compilation
        )

    def make_train_function(self, force=False):
        # At every `fit` (and for every front end built on this class),
        # before anything is built: a refused optimizer changes nothing.
        check_optimizer_not_accumulating(self.optimizer)
        # Keras has built the model and the optimizer by now (fit's symbolic
        # build); create the accumulators here so that the train step never
        # creates variables and traces no more often than plain fit's.
        layers = ADAPTER.layers(self, include_self=True)
        if all(layer.built for layer in layers):
            self._accum_state.build()
        self._accum_state.warn_once_on_plain_batchnorm()
        # `fit` calls this on every call; the flush function (traced like the
        # train function, with the same optimizer and `run_eagerly`) is stale
        # only when the train function is rebuilt (after `compile`, or
        # `force`), so it is kept across `fit` calls otherwise.
        rebuilt = force or self.train_function is None
        if rebuilt:
            self._accum_state.forget_flush()
        function = super().make_train_function(force=force)
        if rebuilt and self._micro_batch.setting == "auto":
            # Takes each batch itself, so that it can run it again.
            self.train_function = function = _auto.AutoTrainFunction(
                self, self._micro_batch, self._split_train_step
            )
        return function

    def apply_accumulated(self):
        """Applies a pending, partly filled window now (no-op when empty).

        A window whose gradients are not all finite is discarded instead
        (see `discarded_windows`), with a warning.

        Returns:
            Bool: whether an update was applied.
        """
        return self._accum_state.flush()

    def fit(self, *args, **kwargs):
        check_not_fit_arguments(kwargs)
        # The arguments go on as they came, to whichever `fit` is next (a
        # keras-hub task's takes `sample_weight` fourth); only `callbacks`
        # gains the epoch-end flush, first.
        next_fit = super().fit
        args, kwargs = _epoch_end.with_flush_callback(
            self, self._accum_state, next_fit, args, kwargs
        )
        with (
            _auto.saying_what_to_set(self),
            self._accum_state.discarding_interrupted_batch(),
        ):
            return next_fit(*args, **kwargs)


AccumModel = ADAPTER.register_serializable(AccumModel)


def start_accumulating(
    model, accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
):
    """Gives `model`, whose class `accumulate` made an `AccumModel`
    subclass (never constructed), what `AccumModel.__init__` gives."""
    model._init_accumulation(
        accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
    )


def training_state(model):
    """The `ModelEngine` of an `AccumModel` (for `save_plain`)."""
    return model._accum_state
