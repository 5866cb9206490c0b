"""The argument checks shared by the package's front ends."""

import difflib
import inspect
import numbers

import numpy as np

EPOCH_END_MODES = ("apply", "carry")


def is_real(value):
    """Whether `value` is a real number, Python's or NumPy's, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(
        value, (bool, np.bool_)
    )


def check_integer(name, value, minimum, or_else=""):
    """Returns `value` as a Python int if it is an integer >= `minimum`.

    Python and NumPy integers are accepted; bools (Python or NumPy), floats,
    strings and `None` are not.

    Args:
        name: Str. The argument's name, for the message.
        value: The value to check.
        minimum: Int. The smallest value accepted.
        or_else: Str. What else the argument takes, for the message
            (`', "auto" or None'`).

    Returns:
        The value as a Python `int`.

    Raises:
        ValueError: If `value` is not an integer >= `minimum`.
    """
    if (
        not is_real(value)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}{or_else}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_accum_steps(accum_steps):
    """Returns `accum_steps` as a Python int, or raises `ValueError`."""
    if isinstance(accum_steps, str) and accum_steps == "auto":
        raise ValueError(
            "`accum_steps` must be an integer >= 1; to let the model find "
            'the slice that fits, pass micro_batch_size="auto". Received: '
            "accum_steps='auto'"
        )
    return check_integer("accum_steps", accum_steps, 1)


def check_micro_batch_size(micro_batch_size):
    """Returns `micro_batch_size` checked: None, `"auto"` or an int >= 1.

    Raises:
        ValueError: For any other value (bools, floats and numeric strings
            included), before anything changes.
    """
    if micro_batch_size is None or (
        isinstance(micro_batch_size, str) and micro_batch_size == "auto"
    ):
        return micro_batch_size
    return check_integer(
        "micro_batch_size", micro_batch_size, 1, or_else=', "auto" or None'
    )


# The settings of an accumulating model, which `fit` does not take.
SETTINGS = (
    "accum_steps",
    "micro_batch_size",
    "epoch_end",
    "noise_scale",
    "adascale",
)


def check_not_fit_arguments(kwargs):
    """Raises `TypeError` for a setting of the model passed to `fit`.

    Keras' own message ("got an unexpected keyword argument") says nothing
    of where the setting goes.
    """
    for name in SETTINGS:
        if name in kwargs:
            raise TypeError(
                f"`fit` does not take `{name}`: it is a setting of the "
                f"model. Pass it to the model's constructor (`AccumModel(..., "
                f"{name}=...)`) or to `accum_model.accumulate(model, "
                f"{name}=...)`, or set `model.{name}` before `fit`. "
                f"Received: {name}={kwargs[name]!r}"
            )


def check_epoch_end(epoch_end):
    """Returns `epoch_end` if it is a known mode, else raises `ValueError`."""
    if not isinstance(epoch_end, str) or epoch_end not in EPOCH_END_MODES:
        raise ValueError(
            f"`epoch_end` must be one of {EPOCH_END_MODES}. "
            f"Received: epoch_end={epoch_end!r}"
        )
    return epoch_end


class SettingConfig:
    """The arguments of a setting: equal when their configs are, shown so.

    The base of `NoiseScale` and `AdaScale`, which define `get_config`.
    """

    def __eq__(self, other):
        return (
            isinstance(other, type(self))
            and self.get_config() == other.get_config()
        )

    def __repr__(self):
        arguments = ", ".join(
            f"{key}={value!r}" for key, value in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"


def as_setting(name, value, cls, accepted, on=None):
    """Returns `value` as a `cls` (a `SettingConfig`), or None when off.

    Args:
        name: Str. The argument's name, for the message.
        value: `None` or `False` (off), `True` (where `on` is given), a
            `cls`, or a dict of its arguments (as a model's `get_config`
            writes it).
        cls: The setting's class.
        accepted: Str. What the message says `name` must be.
        on: Optional callable: the setting `True` stands for.

    Raises:
        TypeError: For any other value.
    """
    if value is None or value is False:
        return None
    if value is True and on is not None:
        return on()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"`{name}` must be {accepted}. Received: {name}={value!r}")


def check_optimizer_not_accumulating(optimizer):
    """Raises if `optimizer` accumulates gradients itself.

    Keras 3's optimizers take `gradient_accumulation_steps`: each one then
    applies once per that many calls, so under an accumulating model the
    two windows would multiply (`accum_steps=4` with
    `gradient_accumulation_steps=4` makes one update per 16 micro-batches)
    and weigh micro-batches differently. Refused at any `accum_steps`, 1
    included, because `accum_steps` can grow later without a new check
    (between `fit` calls, or from `AccumStepsWarmup` during one). tf_keras'
    optimizers have no such option: nothing to check there.

    Args:
        optimizer: A Keras optimizer, or None (nothing to check). A
            `LossScaleOptimizer` is checked with its inner optimizer.

    Raises:
        ValueError: If `gradient_accumulation_steps` is set on `optimizer`
            or its inner optimizer.
    """
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        steps = getattr(candidate, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "An accumulating model cannot be trained with an optimizer "
                "that accumulates gradients itself: the two windows would "
                "multiply. Use one or the other: `accum_steps` with "
                "`gradient_accumulation_steps=None`, or Keras' built-in "
                "option on a plain `keras.Model` (refused at any "
                "`accum_steps`, 1 included, since it can grow later). "
                f"Received: gradient_accumulation_steps={steps!r} "
                f"(optimizer={type(candidate).__name__})"
            )


def check_keywords(callee, kwargs, own, passed_to=None):
    """Raises `TypeError` for a keyword argument `callee` would lose.

    Args:
        callee: Str. The function or class named in the message.
        kwargs: Dict. The keyword arguments received beyond `callee`'s own.
        own: The names of `callee`'s own arguments, suggested by closeness.
        passed_to: None, when `callee` takes no keywords but `own`: any
            other is refused. Or the classes `kwargs` go on to (a model's
            bases): then only a keyword close to one of `own` and taken by
            none of their `__init__`s is refused, since Keras' Functional
            takes (and drops) keywords its signature does not name.

    Raises:
        TypeError: Naming the keyword and the closest of `own`, if any.
    """
    taken = set()
    for cls in passed_to or ():
        try:
            parameters = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            continue
        taken.update(
            name
            for name, p in parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
    for name, value in kwargs.items():
        close = difflib.get_close_matches(name, own, n=1)
        if passed_to is not None and (not close or name in taken):
            continue
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise TypeError(
            f"`{callee}` got an unexpected keyword argument `{name}`."
            f"{hint} Received: {name}={value!r}"
        )
