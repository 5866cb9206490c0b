"""`AccumStepsWarmup`: batch-size warm-up through `accum_steps`."""

import math

from accum_model.core._validation import check_accum_steps
from accum_model.core._validation import check_integer
from accum_model.core._validation import is_real
from accum_model.keras import _adapter


def accum_steps_for_noise_scale(
    b_simple,
    micro_batch_weight,
    factor=1.0,
    min_accum_steps=1,
    max_accum_steps=None,
):
    """The rule `clip(round(factor * B_simple / micro_batch), min, max)`.

    Args:
        b_simple: Float, the measured simple noise scale (in the unit of
            the loss normalizer: samples, tokens, ...). `+inf` gives
            `max_accum_steps`.
        micro_batch_weight: Float > 0, the normalizer of one global
            micro-batch (all replicas), in the same unit: for a per-sample
            loss `replicas * batch_size`.
        factor: Float > 0. The target batch in units of `B_simple`.
        min_accum_steps: Int >= 1.
        max_accum_steps: Int >= `min_accum_steps`, or None (no bound).

    Returns:
        `(accum_steps, target)`: the int, and the unrounded, unclipped
        `factor * b_simple / micro_batch_weight` (None when `b_simple` is
        NaN: no estimate yet).
    """
    if b_simple is None or math.isnan(b_simple) or micro_batch_weight <= 0:
        return None, None
    target = factor * b_simple / micro_batch_weight
    if math.isinf(target):
        # No measurable signal: as large as allowed.
        steps = max_accum_steps
    else:
        steps = max(round(target), min_accum_steps)
        if max_accum_steps is not None:
            steps = min(steps, max_accum_steps)
    return steps, target


class AccumStepsWarmup(_adapter.ADAPTER.callback_base):
    """Grows `accum_steps` during `fit`: a batch-size warm-up.

    Changes `model.accum_steps` of an `AccumModel` between windows (no
    retrace: the window length is a variable of the compiled step), by one
    of two rules:

    - **Noise scale** (default): needs `AccumModel(noise_scale=...)` (or
      `adascale=...`, which turns the measurement on). After
      each window, the target is `factor * B_simple / micro_batch`, where
      `B_simple` is the measured simple gradient noise scale and
      `micro_batch` the normalizer of one global micro-batch (both in the
      loss normalizer's unit), rounded and clipped to
      `[min_accum_steps, max_accum_steps]`. McCandlish et al. (2018)
      predict the critical batch size near `B_simple` for SGD (so
      `factor=1`); for Adam, Merrill et al. (2025) measured the critical
      batch size of language models to be *much larger* than `B_simple`
      (orders of magnitude), so `factor` is yours to set, and the result is
      a trend, not an optimum.
    - **Schedule**: `double_at=[s1, s2, ...]` doubles `accum_steps` (from
      its value when training starts) once the number of samples seen
      passes each `s_i` (as Merrill et al.'s warm-up does); `batch_size`
      says how many samples one `fit` step holds.

    Anti-thrashing: no change in the first `warmup_windows` windows, at
    most one change every `cooldown_windows` windows, and (noise-scale rule)
    a change only when the target is more than `1 + hysteresis` times, or
    less than `1 / (1 + hysteresis)` times, the current value. The learning
    rate is left alone: scale it in your schedule if you want to.

    Every change is printed (when `verbose`), kept in `changes` as dicts
    (`window`, `samples`, `old`, `new`, `b_simple`), and `logs["accum_steps"]`
    holds the value in use at every batch and epoch end.

    Args:
        factor: Float > 0, noise-scale rule only (see above).
        min_accum_steps: Int >= 1.
        max_accum_steps: Int, or None for no upper bound (noise-scale rule:
            required, since `B_simple` may be `+inf`).
        double_at: Optional list of sample counts: the schedule rule.
        batch_size: Int, the `batch_size` of `fit`; required with
            `double_at`.
        warmup_windows: Int >= 0. Windows before the first change.
        cooldown_windows: Int >= 1. Windows between two changes.
        hysteresis: Float >= 0 (see above).
        allow_shrink: Bool. Whether the noise-scale rule may lower
            `accum_steps`.
        verbose: Int. 1 prints every change.

    Raises:
        ValueError: On arguments out of range, as named in the message.
    """

    def __init__(
        self,
        factor=1.0,
        min_accum_steps=1,
        max_accum_steps=None,
        double_at=None,
        batch_size=None,
        warmup_windows=10,
        cooldown_windows=10,
        hysteresis=0.25,
        allow_shrink=True,
        verbose=1,
    ):
        super().__init__()
        if not is_real(factor) or not factor > 0:
            raise ValueError(
                f"`factor` must be a number > 0. Received: factor={factor!r}"
            )
        min_accum_steps = check_accum_steps(min_accum_steps)
        if max_accum_steps is not None:
            max_accum_steps = check_integer(
                "max_accum_steps", max_accum_steps, min_accum_steps
            )
        if double_at is not None:
            double_at = sorted(float(s) for s in double_at)
            if batch_size is None:
                raise ValueError(
                    "`batch_size` (the `batch_size` given to `fit`) is "
                    "required with `double_at`. Received: batch_size=None"
                )
            batch_size = check_integer("batch_size", batch_size, 1)
        elif max_accum_steps is None:
            raise ValueError(
                "`max_accum_steps` is required by the noise-scale rule (the "
                "measured noise scale may be unbounded). Received: "
                "max_accum_steps=None"
            )
        if not is_real(hysteresis) or hysteresis < 0:
            raise ValueError(
                "`hysteresis` must be a number >= 0. "
                f"Received: hysteresis={hysteresis!r}"
            )
        self.factor = float(factor)
        self.min_accum_steps = min_accum_steps
        self.max_accum_steps = max_accum_steps
        self.double_at = double_at
        self.batch_size = batch_size
        self.warmup_windows = check_integer("warmup_windows", warmup_windows, 0)
        self.cooldown_windows = check_integer(
            "cooldown_windows", cooldown_windows, 1
        )
        self.hysteresis = float(hysteresis)
        self.allow_shrink = bool(allow_shrink)
        self.verbose = verbose
        self.changes = []
        self._samples = 0
        self._windows = 0
        self._last_iterations = None
        self._last_change = None
        self._initial = None

    # State that survives several `fit` calls on the same callback.

    def on_train_begin(self, logs=None):
        if not hasattr(self.model, "accum_steps"):
            raise ValueError(
                "`AccumStepsWarmup` needs an `AccumModel`. Received: a "
                f"{type(self.model).__name__}"
            )
        if self.double_at is None and not self._measures():
            raise ValueError(
                "The noise-scale rule of `AccumStepsWarmup` needs the "
                "measurement: build the model with "
                "`AccumModel(..., noise_scale=True)` (or `adascale=`, which "
                "measures it), or pass `double_at`. Received: a model "
                "without it"
            )
        if self._initial is None:
            self._initial = self.model.accum_steps
        self._last_iterations = self._iterations()

    def _measures(self):
        return getattr(self.model, "noise_scale", None) is not None

    def _estimator(self):
        if not self._measures():
            return None
        accumulator = self.model.gradient_accumulator
        return None if accumulator is None else accumulator.noise_scale

    def _iterations(self):
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        if self.batch_size is not None:
            self._samples += self.batch_size
        iterations = self._iterations()
        if iterations != self._last_iterations:
            self._windows += iterations - self._last_iterations
            self._last_iterations = iterations
            self._maybe_change()
        if logs is not None:
            logs["accum_steps"] = self.model.accum_steps

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["accum_steps"] = self.model.accum_steps

    def _maybe_change(self):
        if self._windows < self.warmup_windows:
            return
        if (
            self._last_change is not None
            and self._windows - self._last_change < self.cooldown_windows
        ):
            return
        current = self.model.accum_steps
        b_simple = None
        if self.double_at is not None:
            passed = sum(1 for s in self.double_at if self._samples >= s)
            new = self._initial * 2**passed
            if self.max_accum_steps is not None:
                new = min(new, self.max_accum_steps)
            new = max(new, self.min_accum_steps)
        else:
            estimator = self._estimator()
            if estimator is None or estimator.measurements == 0:
                return
            b_simple = float(estimator.b_simple)
            new, target = accum_steps_for_noise_scale(
                b_simple,
                float(estimator.micro_batch_weight),
                self.factor,
                self.min_accum_steps,
                self.max_accum_steps,
            )
            if new is None:
                return
            ratio = target / current
            band = 1.0 + self.hysteresis
            if 1.0 / band <= ratio <= band:
                return
            if new < current and not self.allow_shrink:
                return
        if new == current:
            return
        self.model.accum_steps = new
        self._last_change = self._windows
        change = {
            "window": self._windows,
            "samples": self._samples if self.batch_size else None,
            "old": current,
            "new": new,
            "b_simple": b_simple,
        }
        self.changes.append(change)
        if self.verbose:
            detail = (
                f" (B_simple={b_simple:.4g})" if b_simple is not None else ""
            )
            print(
                f"\nAccumStepsWarmup: window {self._windows}: accum_steps "
                f"{current} -> {new}{detail}"
            )
