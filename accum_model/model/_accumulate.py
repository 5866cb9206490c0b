"""`accumulate`: an existing Keras model made to accumulate, in place.

For models the user did not write (`Sequential`, Functional, subclassed,
loaded from a file, keras-hub tasks): the object's class is swapped for a
cached subclass of its own class and `AccumModel`, never constructed, and
the round trips Keras offers (configs, `.keras` files, `clone_model`) bring
such a model back accumulating.
"""

import warnings

from accum_model.core._validation import check_accum_steps
from accum_model.core._validation import check_epoch_end
from accum_model.core._validation import check_keywords
from accum_model.core._validation import check_micro_batch_size
from accum_model.engine import _adascale
from accum_model.engine import _noise_scale
from accum_model.keras import _adapter
from accum_model.keras import _clone_hook
from accum_model.model import _model_classes
from accum_model.model import _settings
from accum_model.model._model import AccumModel
from accum_model.model._model import start_accumulating

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras

# `accumulate`'s defaults of `epoch_end` and `noise_scale`: "apply" and off
# for a model made to accumulate now, unchanged for one that already does.
_UNSET = _model_classes.UNSET


def accumulate(
    model,
    accum_steps=_UNSET,
    *,
    epoch_end=_UNSET,
    noise_scale=_UNSET,
    adascale=_UNSET,
    micro_batch_size=_UNSET,
    **kwargs,
):
    """Makes an existing Keras model accumulate gradients, in place.

    The one line for a model you did not write: a `keras.Sequential`, a
    Functional model, a subclassed model, a model loaded from a file, or a
    keras-hub task (`BertTextClassifier`, `GPT2CausalLM`, ...). Afterwards
    `fit` trains exactly like `AccumModel`: each optimizer update applies
    the weighted mean gradient of `accum_steps` micro-batches, equal to
    training with `batch_size * accum_steps`.

    ```python
    model = keras_hub.models.GPT2CausalLM.from_preset("gpt2_base_en")
    accum_model.accumulate(model, accum_steps=8)
    model.fit(texts, batch_size=4)   # updates of 32 samples
    ```

    The object stays what it was, with its weights, its optimizer and its
    compile settings: its class is swapped for a subclass of its own class
    that also derives from `AccumModel` (cached per class, with the same
    name), so `isinstance(model, AccumModel)` holds and everything of its
    own class keeps working: its `fit` signature, a keras-hub task's
    preprocessor, default `compile()` and `generate()`, `predict`,
    `summary`, `export`, and its own `train_step` (which accumulates when it
    calls `super().train_step(data)`). A train function traced before is
    dropped, so the next `fit` traces the accumulating one. Calling it
    again on an accumulating model (an `AccumModel` included) changes
    `accum_steps`, and `epoch_end` and `noise_scale` where given.

    `get_config`, `to_json`, `.keras` files and `keras.models.clone_model`
    bring the model back as its own class, accumulating, with `accum_steps`
    and `epoch_end` (and saved files with an open window), once
    `accum_model` is imported.

    Args:
        model: A `keras.Model` instance, built or not, compiled or not.
        accum_steps: Int >= 1. Micro-batches per optimizer update; 1 is
            plain training. Also the read/write property `accum_steps`.
            The options after it are keyword-only.
        epoch_end: `"apply"` (the default, or unchanged on a model that
            already accumulates) applies a partly filled window at the end
            of every epoch; `"carry"` keeps it open into the next epoch. See
            `AccumModel`.
        noise_scale: `False` (the default: off, or unchanged on a model
            that already accumulates), `True` or an
            `accum_model.NoiseScale(every=..., beta=...)`: measure the
            gradient noise scale of the windows, as `AccumModel` does
            (`logs["gradient_noise_scale"]`, docs/noise_scale.md). It can
            change only before the model's first training step.
        adascale: None (the default: off, or unchanged on a model that
            already accumulates) or an `accum_model.AdaScale(base_batch)`:
            AdaScale SGD, as `AccumModel` applies it (docs/adascale.md).
            It can change only before the model's first training step.
        micro_batch_size: None (the default: no split, or unchanged on a
            model that already accumulates), an int >= 1 or `"auto"`: split
            each batch inside the training step into slices of at most this
            many rows, as `AccumModel` does (docs/micro_batch.md). Given
            alone, `accum_steps` defaults to 1 (unchanged on a model that
            already accumulates).
        **kwargs: None are taken: an unknown keyword is refused with the
            closest of the above.

    Returns:
        `model` itself.

    Raises:
        TypeError: If `model` is not a `keras.Model` instance, if
            `accum_steps` and `micro_batch_size` are both missing, for an
            unknown keyword, or if
            `noise_scale` is not one of the above.
        ValueError: If `accum_steps`, `epoch_end` or `micro_batch_size` is
            invalid, if
            `noise_scale` or `adascale` changes on a model that has trained,
            if `adascale` is on with `noise_scale` measuring less often
            than every window, or if Keras does not run on TensorFlow. At
            `fit`, as `AccumModel`: if the optimizer has Keras' own
            `gradient_accumulation_steps` set.
    """
    # Keyword-only misspellings (`acum_steps=8`) get the closest name.
    check_keywords("accumulate", kwargs, _model_classes.ARGUMENTS)
    if accum_steps is _UNSET and micro_batch_size is _UNSET:
        raise TypeError(
            "`accumulate` missing required argument `accum_steps` (or "
            "`micro_batch_size`)."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model` instance. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    ADAPTER.check_backend()
    if accum_steps is not _UNSET:
        accum_steps = check_accum_steps(accum_steps)
    if micro_batch_size is not _UNSET:
        micro_batch_size = check_micro_batch_size(micro_batch_size)
    if epoch_end is not _UNSET:
        epoch_end = check_epoch_end(epoch_end)
    if isinstance(model, AccumModel):
        given = dict(
            accum_steps=accum_steps,
            micro_batch_size=micro_batch_size,
            epoch_end=epoch_end,
        )
        if noise_scale is not _UNSET:
            given["noise_scale"] = _noise_scale.as_config(noise_scale)
        if adascale is not _UNSET:
            given["adascale"] = _adascale.as_config(adascale)
        # Checked first: nothing changes when either is refused.
        _settings.configure(
            model, **{k: v for k, v in given.items() if v is not _UNSET}
        )
        return model
    if accum_steps is _UNSET:
        accum_steps = 1
    if micro_batch_size is _UNSET:
        micro_batch_size = None
    if epoch_end is _UNSET:
        epoch_end = "apply"
    noise_scale = _noise_scale.as_config(
        None if noise_scale is _UNSET else noise_scale
    )
    adascale = _adascale.as_config(None if adascale is _UNSET else adascale)
    _adascale.measurement_for(adascale, noise_scale)
    # Class surgery, the feature itself: the user's object (its weights,
    # optimizer, compile state, and every reference to it) must accumulate,
    # so it gets a subclass of its own class; a new object would not do.
    model.__class__ = _accumulating_class(type(model))
    start_accumulating(
        model, accum_steps, epoch_end, noise_scale, adascale, micro_batch_size
    )
    # Traced with the class's own `train_step`; `fit` makes a new one.
    model.train_function = None
    return model


# Under this name Keras saves every class `accumulate` makes; loading it
# calls `_Accumulating.from_config`.
_ACCUMULATING_NAME = "accum_model>Accumulating"
_accumulating_classes = {}


def _accumulating_class(base):
    """The cached `(base, AccumModel)` class `accumulate` gives a `base`.

    Never called to construct (that would run Keras' class rewrite on
    `AccumModel`, see `ADAPTER.inject_functional`): `accumulate` swaps the
    class of a built `base` instance, and loading builds the base first.
    """
    cls = _accumulating_classes.get(base)
    if cls is None:
        namespace = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            **_model_classes.marking_base(base),
            "get_config": _accumulating_get_config,
            "from_config": classmethod(_accumulating_from_config),
            **ADAPTER.accumulating_class_methods(),
        }
        if not ADAPTER.functional_like(base):
            # Not a signature Keras constructs (`clone_model` builds a plain
            # Functional, which its hook makes accumulate). A Functional
            # base keeps its own: `X(inputs, outputs)` reaches
            # `AccumModel.__init__` only without functional arguments.
            namespace["__init__"] = _refuse_init
        cls = type(base.__name__, (base, AccumModel), namespace)
        ADAPTER.register_name(cls, _ACCUMULATING_NAME)
        _accumulating_classes[base] = cls
    return cls


def _refuse_init(self, model=None):
    # Not Functional's signature, so `clone_model` builds a plain Functional
    # (which its hook makes accumulate) instead of calling this class.
    raise TypeError(
        f"{type(self).__name__} is made by `accum_model.accumulate(model, "
        "accum_steps)`; construct the model as its own class, then call "
        "`accumulate` on it."
    )


# The key of an accumulating model's config that names its own class. The
# rest is that class's config with the accumulation settings beside it, so
# `keras.Sequential.from_config` and `keras.Model.from_config` (which ignore
# keys they do not know) rebuild it as a plain model.
_BASE_KEY = "accumulating_base"


def _accumulating_get_config(self):
    base = _model_classes.base_of(type(self))
    definer = next(c for c in base.__mro__ if "get_config" in c.__dict__)
    if isinstance(self, ADAPTER.functional_class) and (
        definer in _model_classes.KERAS_CONFIG_CLASSES
    ):
        # Keras' own writes the graph only for classes it may construct.
        config = ADAPTER.functional_config(self)
    else:
        config = dict(base.get_config(self))
    for key in _model_classes.ARGUMENTS:
        # Reached through `super()` from the base's own `get_config`.
        config.pop(key, None)
    config.update(self.get_accumulation_config())
    config[_BASE_KEY] = {
        "module": base.__module__,
        "class_name": base.__name__,
        "registered_name": ADAPTER.registered_name(base),
    }
    return config


def _accumulating_from_config(cls, config, custom_objects=None):
    if _BASE_KEY not in config:
        # The base's own config: a deserializer that found this class by
        # the base's name (`clone_model`'s `custom_objects`) while loading
        # the base of a saved one, which `_Accumulating` then converts.
        return _model_classes.base_of(cls).from_config(config)
    return _Accumulating.from_config(config, custom_objects=custom_objects)


class _Accumulating:
    """Loads what `accumulate` made: the base from its config, then in place."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        del cls
        config = dict(config)
        base_config = dict(config.pop(_BASE_KEY))
        settings = {
            key: config.pop(key, None) for key in _model_classes.ARGUMENTS
        }
        base_config["config"] = config
        if custom_objects:
            with keras.saving.custom_object_scope(custom_objects):
                model = ADAPTER.deserialize(base_config)
        else:
            model = ADAPTER.deserialize(base_config)
        return accumulate(model, **settings)

    def get_config(self):
        raise NotImplementedError("Loads models; never an instance.")


ADAPTER.register_object(_ACCUMULATING_NAME, _Accumulating)


def _accumulating_clone(model, clone):
    """Makes a `keras.models.clone_model` clone accumulate like `model`."""
    if not isinstance(model, AccumModel) or clone is model:
        return clone
    base = _model_classes.base_of(type(model))
    if isinstance(clone, AccumModel):
        clone.accum_steps = model.accum_steps
        clone.epoch_end = model.epoch_end
        clone.noise_scale = model.noise_scale
        clone.adascale = model.adascale
        clone.micro_batch_size = _settings.micro_batch_setting(model)
        return clone
    if not isinstance(clone, base):
        warnings.warn(
            f"`keras.models.clone_model` rebuilt the {base.__name__} "
            f"{model.name!r} as a plain {type(clone).__name__} (Keras "
            "clones Functional models by their graph, without the "
            "attributes their class adds, e.g. a keras-hub preprocessor). "
            "The clone accumulates like the original. For a clone of the "
            "model's own class (accumulating too), use "
            "`type(model).from_config(model.get_config())`.",
            stacklevel=4,
        )
    return accumulate(
        clone,
        model.accum_steps,
        epoch_end=model.epoch_end,
        noise_scale=model.noise_scale,
        adascale=model.adascale,
        micro_batch_size=_settings.micro_batch_setting(model),
    )


# `clone_model` has no way for a model to pass its settings on (see
# `_clone_hook`, the one patch of Keras).
_clone_hook.install(ADAPTER.cloning_module, _accumulating_clone)
