"""The classes of accumulating models: how they are built, and their configs.

Keras builds a model class's objects in more than one way: `Model(inputs,
outputs)` by rewriting class hierarchies, `from_config` and `clone_model`
from configs, and subclasses (keras-hub tasks) that pass only the arguments
they know. What keeps `AccumModel`'s arguments and bases through all of them
is here: its constructor arguments and their defaults, the metaclass that
keeps its bases, the functional construction, the wrappers a subclass gets,
and the accumulation part of configs. `AccumModel` calls it from `__init__`,
`__init_subclass__`, `get_config` and `from_config`, and `accumulate` from
the classes it makes.
"""

import functools
import inspect

from accum_model.core._validation import check_accum_steps
from accum_model.core._validation import check_epoch_end
from accum_model.core._validation import check_keywords
from accum_model.core._validation import check_micro_batch_size
from accum_model.engine import _adascale
from accum_model.engine import _noise_scale
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER
keras = _adapter.keras

# The constructor arguments `AccumModel` adds to a Keras model's.
ARGUMENTS = (
    "accum_steps",
    "epoch_end",
    "noise_scale",
    "adascale",
    "micro_batch_size",
)
UNSET = type("Unset", (), {"__repr__": lambda self: "<default>"})()
_DEFAULTS = {
    "accum_steps": 1,
    "epoch_end": "apply",
    "noise_scale": False,
    "adascale": None,
    "micro_batch_size": None,
}
# On the classes `accumulate` makes: the class each was made from.
_BASE = "_accum_base"

# Keras' own `get_config`s, which write no constructor arguments of a
# Functional subclass.
KERAS_CONFIG_CLASSES = tuple(
    c
    for c in (ADAPTER.functional_class, keras.Model, keras.layers.Layer)
    for c in c.__mro__
)


class KeepsOwnBases(type):
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


def checked_arguments(model, kwargs, *arguments):
    """The accumulation arguments of a construction, checked, defaults in.

    Args:
        model: The model being constructed.
        kwargs: The other keyword arguments of the construction (Keras'
            Functional drops keywords it does not know: a misspelled
            `accum_steps` would train plain without a word).
        *arguments: `ARGUMENTS` as `AccumModel.__init__` received them,
            `UNSET` where not given: then what a subclass's `__init__` kept
            for it (see `seeing_accumulation_arguments`), else the default.

    Returns:
        A tuple in the order of `ARGUMENTS`, checked (`noise_scale` and
        `adascale` as configs).

    Raises:
        ValueError, TypeError: As `AccumModel`'s constructor.
    """
    check_keywords(
        type(model).__name__, kwargs, ARGUMENTS, passed_to=type(model).__mro__
    )
    given = model.__dict__.get("_accum_new_kwargs", {})
    accum_steps, epoch_end, noise_scale, adascale, micro_batch_size = (
        given.get(name, _DEFAULTS[name]) if value is UNSET else value
        for name, value in zip(ARGUMENTS, arguments)
    )
    ADAPTER.check_backend()
    accum_steps = check_accum_steps(accum_steps)
    epoch_end = check_epoch_end(epoch_end)
    noise_scale = _noise_scale.as_config(noise_scale)
    adascale = _adascale.as_config(adascale)
    _adascale.measurement_for(adascale, noise_scale)
    micro_batch_size = check_micro_batch_size(micro_batch_size)
    return accum_steps, epoch_end, noise_scale, adascale, micro_batch_size


def init_functional(model, args, kwargs):
    """What `keras.Model.__init__` does for `inputs` and `outputs`, our way.

    The object becomes an instance of the cached `(cls, Functional)` class
    of its class, so `AccumModel` itself never turns Functional.
    """
    if not issubclass(type(model), ADAPTER.functional_class):
        # What `keras.Model.__init__` does first, for the other Keras model
        # classes among the bases (`class X(Task, AccumModel)`: keras-hub's
        # `PipelineModel` has just taken Functional out of its bases and
        # expects it back).
        ADAPTER.inject_functional(type(model))
    # Class surgery instead of Keras' (which rewrites the bases of the class
    # and its ancestors, for every later object): only this object turns
    # Functional. Here, not in `__new__`: a subclass decides in its own
    # `__init__` whether it builds itself functionally (keras-hub tasks pass
    # `inputs` and `outputs` up from subclass-style arguments).
    model.__class__ = ADAPTER.functional_variant(type(model))
    ADAPTER.init_functional(model, args, kwargs)


def prepare_subclass(cls, accum_model_class):
    """What `AccumModel.__init_subclass__` does to a new subclass `cls`."""
    if _BASE in cls.__dict__:
        return  # Made by `accumulate`, never constructed.
    init = cls.__init__
    if init is not accum_model_class.__init__ and not getattr(
        init, "_accum_sees_arguments", False
    ):
        cls.__init__ = seeing_accumulation_arguments(init)
    # `class X(Task, AccumModel)`: a base before `AccumModel` whose
    # `get_config` does not chain to ours (keras-hub's `Task`) would drop
    # `accum_steps` from saved files and clones.
    if cls.get_config is not accum_model_class.get_config:
        cls.get_config = with_accumulation_config(cls.get_config)


def base_config(model, accum_model_class, next_get_config):
    """The config of `model` without its accumulation arguments."""
    if isinstance(model, ADAPTER.functional_class) and (
        next_definer(type(model), accum_model_class, "get_config")
        in KERAS_CONFIG_CLASSES
    ):
        return ADAPTER.functional_config(model)
    return next_get_config()


def from_config(next_from_config, config, custom_objects):
    """Builds a model from `config` with the next class's `from_config`.

    The accumulation arguments `config` holds are set on the model after
    (through its properties): `noise_scale` and `adascale` first, as they
    can only be set before training.

    Returns:
        The model.
    """
    config = dict(config)
    arguments = {name: config.pop(name) for name in ARGUMENTS if name in config}
    if "custom_objects" in inspect.signature(next_from_config).parameters:
        model = next_from_config(config, custom_objects=custom_objects)
    else:  # keras-hub's `Task.from_config(config)`, for one.
        model = next_from_config(config)
    for name in _SET_ORDER:
        if arguments.get(name) is not None:
            setattr(model, name, arguments[name])
    return model


_SET_ORDER = (
    "noise_scale",
    "adascale",
    "accum_steps",
    "epoch_end",
    "micro_batch_size",
)


def marking_base(base):
    """The class-namespace entry that marks a class made from `base`."""
    return {_BASE: base}


def base_of(cls):
    """The class an `accumulate` class was made from, else `cls` itself."""
    return getattr(cls, _BASE, cls)


def next_definer(cls, after, name):
    """The class after `after` in `cls`'s MRO that defines `name`."""
    mro = cls.__mro__
    for c in mro[mro.index(after) + 1 :]:
        if name in c.__dict__:
            return c
    return None


def with_accumulation_config(get_config):
    """Wraps a `get_config` to add the accumulation arguments."""

    def get_config_with_accumulation(self):
        config = get_config(self)
        config.update(self.get_accumulation_config())
        return config

    get_config_with_accumulation.__wrapped__ = get_config
    get_config_with_accumulation.__doc__ = get_config.__doc__
    return get_config_with_accumulation


def seeing_accumulation_arguments(init):
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
            for name in ARGUMENTS:
                if name in kwargs:
                    given[name] = (
                        kwargs[name] if name in named else kwargs.pop(name)
                    )
            object.__setattr__(self, "_accum_new_kwargs", given)
        init(self, *args, **kwargs)

    __init__.__signature__ = signature
    __init__._accum_sees_arguments = True
    return __init__
