"""The argument checks shared by the package's front ends."""

import numbers

import numpy as np

EPOCH_END_MODES = ("apply", "carry")


def is_real(value):
    """Whether `value` is a real number, Python's or NumPy's, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(
        value, (bool, np.bool_)
    )


def check_integer(name, value, minimum):
    """Returns `value` as a Python int if it is an integer >= `minimum`.

    Python and NumPy integers are accepted; bools (Python or NumPy), floats,
    strings and `None` are not.

    Args:
        name: Str. The argument's name, for the message.
        value: The value to check.
        minimum: Int. The smallest value accepted.

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
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_accum_steps(accum_steps):
    """Returns `accum_steps` as a Python int, or raises `ValueError`."""
    return check_integer("accum_steps", accum_steps, 1)


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
