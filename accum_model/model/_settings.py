"""`AccumSettings`: what an `AccumModel` is set to, and what it counted.

A mixin of `AccumModel`: the settings of its constructor (`accum_steps`,
`epoch_end`, `noise_scale`, `adascale`) as validated properties, the
`jit_compile` that `compile` was given, and the readings of its window (the
noise scale, AdaScale's gain and `tau`, the micro-batches and windows left
out). The training path that uses them is in `_model`; the window itself is
the `GradientAccumulator` that `gradient_accumulator` returns.
"""

import inspect

from accum_model.core._validation import check_accum_steps
from accum_model.core._validation import check_epoch_end
from accum_model.core._validation import check_micro_batch_size
from accum_model.engine import _adascale
from accum_model.engine import _noise_scale
from accum_model.keras import _adapter
from accum_model.model._model_classes import UNSET

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras


class AccumSettings:
    """The settings and window readings of an `AccumModel` (a mixin).

    Its attributes are set here only: `_init_settings` when a model starts
    accumulating, the properties and `_set_measurement` after.
    """

    def _init_settings(
        self, accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
    ):
        # Checked by the caller (`AccumModel.__init__`, `accumulate`).
        self._accum_steps = accum_steps
        self._epoch_end = epoch_end
        self._noise_scale = noise_scale
        self._adascale = adascale
        self._micro_batch = MicroBatch(micro_batch_size)
        # What `compile` was given as `jit_compile`: Keras keeps only what
        # it resolved (`"auto"` is False on a CPU), and only an explicit
        # False keeps XLA out of the window's update (`_compilation`). UNSET
        # for a model not compiled yet (and first, as `get_compile_config`
        # reads it). A model compiled before it accumulates (`accumulate`)
        # takes what Keras kept: Keras 3 keeps it resolved, so "auto" on a
        # CPU reads as False, as an explicit False, which must be kept.
        self._jit_compile_given = UNSET
        compiled = self.get_compile_config()
        if compiled is not None and "jit_compile" in compiled:
            self._jit_compile_given = compiled["jit_compile"]

    # `compile`'s `jit_compile`, kept as given

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        arguments = inspect.signature(keras.Model.compile).bind(
            self, *args, **kwargs
        )
        arguments.apply_defaults()
        self._jit_compile_given = arguments.arguments.get("jit_compile")

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None and "jit_compile" in config:
            if self._jit_compile_given is not UNSET:
                # As given, not as resolved: `"auto"` saved as a CPU's False
                # would keep XLA out of a loaded model's update.
                config["jit_compile"] = self._jit_compile_given
        return config

    def compile_from_config(self, config):
        if type(self).compile is not AccumSettings.compile:
            # A class with a `compile` of its own (a keras-hub task): as
            # Keras does, not compiled from the file.
            return super().compile_from_config(config)
        # What Keras' does, which skips every class whose `compile` is
        # overridden (this one only notes `jit_compile`).
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            ADAPTER.build_optimizer_for_restore(
                self.optimizer, self.trainable_variables
            )

    @property
    def _compilation(self):
        """`GradientAccumulator.step`'s `jit_compile` and `compile_update`.

        Where the train step is not compiled with XLA (Keras' `"auto"` on a
        CPU), the window's update still is, outside a strategy
        (`_close.update_function`), unless `compile` was given
        `jit_compile=False`: no XLA at all.
        """
        return {
            "jit_compile": bool(self.jit_compile),
            "compile_update": self._jit_compile_given is not False,
        }

    def _set_measurement(self, noise_scale, adascale):
        """Sets `noise_scale` and `adascale` together, checked as a pair.

        Raises before changing either: if AdaScale cannot read that
        measurement, or if one changes after training started.
        """
        _adascale.measurement_for(adascale, noise_scale)
        self._check_before_training(
            "noise_scale", noise_scale, self._noise_scale
        )
        self._check_before_training("adascale", adascale, self._adascale)
        self._noise_scale = noise_scale
        self._adascale = adascale

    def get_accumulation_config(self):
        """The accumulation arguments, as the constructor takes them.

        What the model's config holds besides Keras' own: `accum_steps` and
        `epoch_end`, and where set `noise_scale` and `adascale` (as their
        configs) and `micro_batch_size` (the setting: `"auto"`, not the
        size it chose here, so that a file loaded on another device
        chooses again).

        Returns:
            A dict.
        """
        config = dict(accum_steps=self.accum_steps, epoch_end=self.epoch_end)
        if self.noise_scale is not None:
            config["noise_scale"] = self.noise_scale.get_config()
        if self.adascale is not None:
            config["adascale"] = self.adascale.get_config()
        if self._micro_batch.setting is not None:
            config["micro_batch_size"] = self._micro_batch.setting
        return config

    # Settings

    @property
    def accum_steps(self):
        """Int. Micro-batches per optimizer update.

        Held by the model until its `GradientAccumulator` exists, then by
        the accumulator alone (a variable, so that a new value needs no
        retrace); a new value takes effect when the next window opens.
        """
        accumulator = self.gradient_accumulator
        if accumulator is None:
            return self._accum_steps
        return accumulator.accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        value = check_accum_steps(value)
        accumulator = self.gradient_accumulator
        if accumulator is None:
            self._accum_steps = value
        else:
            accumulator.accum_steps = value

    @property
    def micro_batch_size(self):
        """The rows of one slice of a batch, or None (batches are not split).

        Set to an int `m`, `fit(batch_size=E)` splits each batch inside the
        training step into slices of at most `m` rows and applies the
        batch's update once (docs/micro_batch.md). Set to `"auto"`, it reads
        `"auto"` until a batch ran, then the int it runs with: the largest
        batch (per replica) that ran whole, until an out-of-memory error
        halves it; from then on it never grows. A new value takes effect at
        the next `fit` (the step is traced again).
        """
        return self._micro_batch.size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        value = check_micro_batch_size(value)
        if value == self._micro_batch.setting and value != "auto":
            return
        # `"auto"` again starts over: batches run whole until an
        # out-of-memory error.
        self._micro_batch = MicroBatch(value)
        # The slice size is part of the traced steps.
        self.train_function = None
        self.test_function = None
        self.predict_function = None

    @property
    def epoch_end(self):
        """Str. What happens to a partly filled window when an epoch ends."""
        return self._epoch_end

    @epoch_end.setter
    def epoch_end(self, value):
        self._epoch_end = check_epoch_end(value)

    @property
    def noise_scale(self):
        """The `NoiseScale` measured, or None (off).

        With `adascale` on and no `noise_scale` set, the `NoiseScale()` that
        AdaScale measures with. Settable before the first training step
        only (the measurement is part of the compiled step).
        """
        return _adascale.measurement_for(self._adascale, self._noise_scale)

    @noise_scale.setter
    def noise_scale(self, value):
        self._set_measurement(_noise_scale.as_config(value), self._adascale)

    @property
    def adascale(self):
        """The `AdaScale` applied, or None (off).

        Settable before the first training step only (the gain is part of
        the compiled step).
        """
        return self._adascale

    @adascale.setter
    def adascale(self, value):
        self._set_measurement(self._noise_scale, _adascale.as_config(value))

    def _check_before_training(self, name, value, current):
        if value != current and self.gradient_accumulator is not None:
            raise ValueError(
                f"`{name}` can only be set before the model is trained (it "
                "is part of the compiled training step). Received: "
                f"{name}={value!r} after training started"
            )

    # Readings of the window

    @property
    def gradient_noise_scale(self):
        """Float: the measured `B_simple`, in the loss normalizer's unit.

        NaN before a window gave an estimate, None when `noise_scale` is
        off. The accumulator's `noise_scale` has the parts.
        """
        if self.noise_scale is None:
            return None
        accumulator = self.gradient_accumulator
        if accumulator is None:
            return float("nan")
        return float(accumulator.noise_scale.b_simple)

    @property
    def adascale_gain(self):
        """Float: the AdaScale gain `r` of the last update.

        1.0 before any update, None when `adascale` is off.
        """
        return self._adascale_reading("gain", 1.0)

    @property
    def adascale_tau(self):
        """Float: AdaScale's scale-invariant iterations, `sum(r)` so far.

        What a learning-rate schedule is read at, and what to compare with
        the base run's number of updates. None when `adascale` is off.
        """
        return self._adascale_reading("tau", 0.0)

    def _adascale_reading(self, name, before_training):
        if self._adascale is None:
            return None
        accumulator = self.gradient_accumulator
        if accumulator is None:
            return before_training
        return float(getattr(accumulator.adascale, name))

    @property
    def skipped_microbatches(self):
        """Int. Micro-batches left out of their window for non-finite gradients.

        Counted over the life of the model (only a `LossScaleOptimizer`, as
        `mixed_float16` uses, skips micro-batches); also in the training logs
        as `"skipped_microbatches"` when one is in use.
        """
        accumulator = self.gradient_accumulator
        return (
            0 if accumulator is None else int(accumulator.skipped_microbatches)
        )

    @property
    def discarded_windows(self):
        """Int. Windows discarded, not applied, for non-finite gradients.

        A window holding an `inf` or `NaN` is discarded whole, however it
        closes, counted here (over the model's life; also in the training
        logs as `"discarded_windows"`) and warned about. The weights stay
        those of the last finite update, so `TerminateOnNaN` stops on finite
        weights.
        """
        accumulator = self.gradient_accumulator
        return 0 if accumulator is None else int(accumulator.discarded_windows)


class MicroBatch:
    """A model's `micro_batch_size` setting and, for `"auto"`, its choice.

    One object per setting: setting the model's `micro_batch_size` makes a
    new one. `_auto`'s functions are handed it and record what ran.

    Args:
        setting: None, `"auto"` or an int >= 1, checked.
    """

    def __init__(self, setting):
        self.setting = setting
        # The slice size `"auto"` runs with, kept for later `fit` calls,
        # and whether an out-of-memory error capped it (until then it
        # grows with the batches).
        self.chosen = None
        self.capped = False

    @property
    def size(self):
        """What `micro_batch_size` reads: the setting, or the size chosen."""
        if self.setting == "auto":
            return self.chosen or "auto"
        return self.setting

    def first_try(self):
        """The slice size a batch is tried in first (None: whole)."""
        return self.chosen if self.capped else None

    def ran_whole(self, rows):
        """Notes a batch of `rows` rows that ran in one slice."""
        if not self.capped:
            self.chosen = max(self.chosen or 0, rows)

    def cap(self, size):
        """Notes that batches run in slices of `size` from now on."""
        self.capped = True
        self.chosen = size


def micro_batch_setting(model):
    """An `AccumModel`'s `micro_batch_size` setting: `"auto"`, an int or
    None, not the size `"auto"` chose (what configs, clones and the choice
    of train, test and predict functions read)."""
    return model._micro_batch.setting


def configure(model, **changes):
    """Applies `accumulate`'s arguments to an `AccumModel`, in place.

    Args:
        model: The `AccumModel`.
        **changes: Any of the constructor's accumulation arguments,
            checked (`noise_scale` and `adascale` as configs); those left
            out keep their value.

    Raises:
        ValueError: As the settings' setters, before anything changes
            (`noise_scale` and `adascale` are checked as a pair).
    """
    model._set_measurement(
        changes.pop("noise_scale", model._noise_scale),
        changes.pop("adascale", model._adascale),
    )
    for name, value in changes.items():
        setattr(model, name, value)
