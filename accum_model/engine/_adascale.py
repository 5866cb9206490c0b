"""AdaScale SGD (Johnson et al., ICML 2020): the gain of a larger batch.

A base batch of weight `W0` (in the loss normalizer's unit: samples by
default) has a tuned learning rate `lr(t)`. A window of weight `W` is at
scale `S = W / W0`. With the noise-scale estimator's per-unit `tr(Sigma)`
(`S_hat`) and `|G|^2` (`G2_hat`), the base batch's gradient variance is
`sigma^2 = S_hat / W0`, and the gain

    r = (S_hat / W0 + G2_hat) / (S_hat / W + G2_hat)

lies between 1 and `S`. The update uses the learning rate `r * lr(tau)`
and the scale-invariant iteration advances `tau += r`.

For Keras' SGD (with or without momentum, Nesterov or not) the learning
rate multiplies the gradient and nothing else (`m = mu m - lr g`), so `r *
lr(tau) / lr(iterations)` is folded into the one multiply that takes the
window's sum to its mean: a few scalar ops per update. Every other
optimizer is refused (see `check_optimizer`).

This module knows TensorFlow only; Keras objects are read through the
adapter.
"""

import numbers

import tensorflow as tf

from accum_model.core._validation import SettingConfig
from accum_model.core._validation import as_setting
from accum_model.core._validation import is_real
from accum_model.engine import _noise_scale
from accum_model.engine import _state
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER


class AdaScale(SettingConfig):
    """AdaScale SGD: scale the learning rate by the measured gain.

    Pass it to `AccumModel(adascale=...)`, `accumulate(model, accum_steps,
    adascale=...)` or `GradientAccumulator(adascale=...)`. Each update's
    learning rate becomes `r` times the compiled SGD's learning rate (read at
    `tau`, the scale-invariant iteration, when it is a schedule), where the
    gain `r` (1 <= r <= S) comes from the gradient noise-scale measurement of
    the window, and `S` is the window's weight over `base_batch`. See
    docs/adascale.md.

    Example:

    ```python
    model = AccumModel(
        inputs, outputs, accum_steps=8, adascale=AdaScale(base_batch=32)
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), ...)
    model.fit(x, y, batch_size=32)   # windows of 256 samples: S = 8
    ```

    Args:
        base_batch: Positive number. The weight of the batch the learning
            rate was tuned for, in the unit of the loss normalizer
            (samples for Keras' default losses, tokens for a per-token
            mean).

    Raises:
        ValueError: If `base_batch` is not a positive number.
    """

    def __init__(self, base_batch):
        if (
            not is_real(base_batch)
            or not base_batch > 0
            or base_batch == float("inf")
        ):
            raise ValueError(
                "`base_batch` must be a positive number (the weight of the "
                "batch the learning rate was tuned for). Received: "
                f"base_batch={base_batch!r}"
            )
        self.base_batch = (
            int(base_batch)
            if isinstance(base_batch, numbers.Integral)
            else float(base_batch)
        )

    def get_config(self):
        return {"base_batch": self.base_batch}


def as_config(adascale):
    """Returns an `AdaScale`, or None when it is off.

    Args:
        adascale: `None` or `False` (off), an `AdaScale`, or a dict of its
            arguments (as `get_config` of a model writes it).

    Raises:
        TypeError: For any other value.
    """
    return as_setting(
        "adascale",
        adascale,
        AdaScale,
        "None, an `accum_model.AdaScale` or a dict of its arguments",
    )


def measurement_for(adascale, noise_scale):
    """The `NoiseScale` an engine runs with, given both settings.

    AdaScale reads the estimate at every window's close, so it turns the
    measurement on (with its defaults) when it is off.

    Args:
        adascale: An `AdaScale` or None.
        noise_scale: A `NoiseScale` or None.

    Returns:
        `noise_scale`, or `NoiseScale()` when AdaScale is on and it is None.

    Raises:
        ValueError: If AdaScale is on and `noise_scale.every > 1`.
    """
    if adascale is None:
        return noise_scale
    if noise_scale is None:
        return _noise_scale.NoiseScale()
    if noise_scale.every != 1:
        raise ValueError(
            "`adascale` needs the noise scale measured at every window: "
            "`noise_scale.every` must be 1. Received: "
            f"noise_scale={noise_scale!r}, adascale={adascale!r}"
        )
    return noise_scale


def check_optimizer(optimizer):
    """Raises unless AdaScale's rule holds for `optimizer`.

    The rule multiplies the learning rate; it is folded into the gradient,
    which is the same thing only for plain SGD (momentum and Nesterov
    included) without gradient clipping and without decoupled weight decay.

    Args:
        optimizer: A Keras optimizer (a `LossScaleOptimizer` is checked by
            its inner optimizer).

    Raises:
        ValueError: If the optimizer is not SGD, or has `weight_decay` or
            gradient clipping. (Its own gradient accumulation is refused
            for every accumulating model: `_validation`.)
    """
    inner = ADAPTER.inner_optimizer(optimizer)
    if not ADAPTER.is_sgd(inner):
        raise ValueError(
            "`adascale` is derived for SGD (with or without momentum and "
            "Nesterov) only: its gain multiplies the learning rate, and for "
            "Adam-family optimizers there is no such guarantee. Compile with "
            "`keras.optimizers.SGD`, or pass `adascale=None`. Received: "
            f"optimizer={type(inner).__name__}"
        )
    decay = getattr(inner, "weight_decay", None)
    if decay:
        raise ValueError(
            "`adascale` cannot scale SGD's decoupled `weight_decay` (it does "
            "not follow the learning rate's gain). Use an L2 "
            "`kernel_regularizer` instead (the coupled form of the paper). "
            f"Received: weight_decay={decay!r}"
        )
    for name in ("clipnorm", "clipvalue", "global_clipnorm"):
        value = getattr(inner, name, None)
        if value is not None:
            raise ValueError(
                f"`adascale` cannot be used with `{name}`: the gain is "
                "folded into the gradient, which clipping would undo. "
                f"Received: {name}={value!r}"
            )


def gain(trace, grad_sq, weight, base_batch):
    """Float32 scalar `r`: the gain of a window, from the estimates.

    Args:
        trace: Float32 scalar, the averaged per-unit `tr(Sigma)`; NaN when
            no window has given an estimate yet.
        grad_sq: Float32 scalar, the averaged `|G|^2`.
        weight: Float32 scalar, the window's `W`.
        base_batch: Float, `W0`.

    Returns:
        `(S_hat/W0 + G2_hat) / (S_hat/W + G2_hat)`, clipped to `[min(1, S),
        max(1, S)]` with `S = W / W0`; `S` (the noise-dominated limit) where
        the averaged `|G|^2 <= 0`; `min(1, S)` (the smaller step) before
        any estimate; exactly 1.0 where `S == 1`; 0 for a window of no
        weight.
    """
    base = tf.constant(float(base_batch), tf.float32)
    scale = weight / base
    low = tf.minimum(1.0, scale)
    high = tf.maximum(1.0, scale)
    measured = tf.math.is_finite(trace) & tf.math.is_finite(grad_sq)
    # A negative averaged trace is noise in the estimate: no noise.
    noise = tf.maximum(tf.where(measured, trace, 0.0), 0.0)
    signal = tf.where(measured, grad_sq, 0.0)
    ratio = tf.math.divide_no_nan(
        noise / base + signal, tf.math.divide_no_nan(noise, weight) + signal
    )
    r = tf.where(signal > 0.0, ratio, scale)
    r = tf.clip_by_value(r, low, high)
    r = tf.where(measured, r, low)
    r = tf.where(tf.equal(weight, base), tf.ones_like(r), r)
    return tf.where(weight > 0.0, r, tf.zeros_like(r))


class AdaScaleState(tf.Module):
    """The state of AdaScale: `tau`, the last gain and learning rate.

    Made by `GradientAccumulator(adascale=...)`, which calls `factor` once
    per applied window (in replica context, after the noise-scale estimate
    took the window in) and saves `state_variables` with its own.

    Args:
        config: An `AdaScale`.
        name: Optional name of the module.
    """

    def __init__(self, config, state=None, name=None):
        super().__init__(name=name or "adascale")
        self.config = config
        if state is None:
            state = _state.WindowState()
        # Equal on every replica: each computes them from all-reduced values.
        v = state.declare_group("adascale", _state.ADASCALE)
        self._tau = v["tau"]
        self._gain = v["gain"]
        self._lr = v["learning_rate"]

    @property
    def state_variables(self):
        """Every variable of the state (`_state.ADASCALE`'s order)."""
        return [self._tau, self._gain, self._lr]

    def factor(self, estimator, weight, optimizer):
        """Float32 scalar: what the window's mean gradient is multiplied by.

        Before the optimizer applies it: reads the optimizer's step counter
        and records the gain, `tau` and the effective learning rate.

        Args:
            estimator: The `NoiseScaleEstimator`, updated with this window.
            weight: Float32 scalar, the window's total `W`.
            optimizer: The optimizer about to apply it.

        Returns:
            `r * lr(tau) / lr(iterations)` for a schedule, `r` otherwise.
        """
        r = gain(
            estimator.trace_sigma,
            estimator.grad_sq_norm,
            weight,
            self.config.base_batch,
        )
        inner = ADAPTER.inner_optimizer(optimizer)
        schedule = ADAPTER.learning_rate_schedule(inner)
        tau = self._tau.read_value()
        if schedule is None:
            base_lr = tf.cast(ADAPTER.learning_rate(inner), tf.float32)
            factor = r
        else:
            # The optimizer reads its schedule at `iterations`; the rule
            # reads it at `tau`.
            base_lr = tf.cast(schedule(tf.cast(tau, tf.float32)), tf.float32)
            applied = tf.cast(schedule(inner.iterations), tf.float32)
            factor = r * tf.math.divide_no_nan(base_lr, applied)
        self._gain.assign(r)
        self._lr.assign(r * base_lr)
        self._tau.assign(tau + tf.cast(r, tf.float64))
        return factor

    @property
    def tau(self):
        """Float64 tensor: the scale-invariant iterations so far."""
        return self._tau.read_value()

    @property
    def gain(self):
        """Float32 tensor: the last update's gain `r` (1.0 before any)."""
        return self._gain.read_value()

    @property
    def learning_rate(self):
        """Float32 tensor: the last update's `r * lr(tau)` (0 before any)."""
        return self._lr.read_value()
