"""The gradient noise scale of a window of micro-batches (McCandlish 2018).

A window holds `n` micro-batches at the same weights. Micro-batch `k` has
normalizer `w_k` (its samples, tokens, ...) and mean gradient `g_k`; the
window applies `G_w = sum_k w_k g_k / W`, with `W = sum_k w_k`. With i.i.d.
units, `E|g_k|^2 = |G|^2 + S / w_k` and `E|G_w|^2 = |G|^2 + S / W`, where
`G` is the true gradient and `S = tr(Sigma)` the trace of the per-unit
gradient covariance. Hence the unbiased pair, for any sizes `w_k`:

    S_hat  = (sum_k w_k |g_k|^2 - W |G_w|^2) / (n - 1)
    G2_hat = |G_w|^2 - S_hat / W

(with equal `w_k = B` this is McCandlish et al.'s eq. A.2 with
`B_small = B`, `B_big = n B`). The simple noise scale is
`B_simple = S / |G|^2`, in the unit of `w`. Each part is smoothed with its
own exponential moving average over measured windows and the ratio is taken
of the averages (a ratio of unbiased estimates is biased, and a single
window's `G2_hat` is often <= 0).

Per micro-batch the accumulator hands over `q_k = w_k |g_k|^2` (one float32
scalar); at the close it hands over `|sum_k w_k g_k|^2 = W^2 |G_w|^2` of its
accumulators. Under `tf.distribute` every replica measures its own window
(its micro-batches and its accumulators, before the optimizer's all-reduce)
and the per-replica estimates, each unbiased, are averaged by
`combine_statistics`; the three scalars this takes ride the all-reduce the
accumulator does anyway for the weight sum.

This module knows TensorFlow only.
"""

import tensorflow as tf

from accum_model.core._validation import SettingConfig
from accum_model.core._validation import as_setting
from accum_model.core._validation import check_integer
from accum_model.core._validation import is_real
from accum_model.engine import _state


class NoiseScale(SettingConfig):
    """How to measure the gradient noise scale of accumulated windows.

    Pass `noise_scale=True` (these defaults) or a `NoiseScale(...)` to
    `AccumModel` or `GradientAccumulator`.

    Args:
        every: Int >= 1. Measure every `every`-th window (`k`); the others
            cost nothing.
        beta: Float in [0, 1). Decay of the moving averages of `tr(Sigma)`
            and `|G|^2`, per measured window: they average over roughly the
            last `1 / (1 - beta)` measurements.

    Raises:
        ValueError: If `every` or `beta` is out of range.
    """

    def __init__(self, every=1, beta=0.99):
        every = check_integer("every", every, 1)
        if not is_real(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"`beta` must be a float in [0, 1). Received: beta={beta!r}"
            )
        self.every = every
        self.beta = float(beta)

    def get_config(self):
        return {"every": self.every, "beta": self.beta}


def as_config(noise_scale):
    """Returns a `NoiseScale`, or None when the measurement is off.

    Args:
        noise_scale: `None` or `False` (off), `True` (defaults), a
            `NoiseScale`, or a dict of its arguments (as `get_config` of a
            model writes it).

    Raises:
        TypeError: For any other value.
    """
    return as_setting(
        "noise_scale",
        noise_scale,
        NoiseScale,
        "a bool, an `accum_model.NoiseScale` or a dict of its arguments",
        on=NoiseScale,
    )


def squared_norm(grads):
    """Float32 scalar: the squared norm of a list of gradients, all together.

    Args:
        grads: List of tensors, `tf.IndexedSlices` or `None` (skipped).

    Returns:
        `sum(reduce_sum(g**2))` in float32. An `IndexedSlices` counts as the
        dense tensor it stands for: rows of repeated indices are summed
        before they are squared.
    """
    terms = []
    for g in grads:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            unique, position = tf.unique(g.indices)
            values = tf.math.unsorted_segment_sum(
                tf.cast(g.values, tf.float32),
                position,
                tf.shape(unique)[0],
            )
        else:
            values = tf.cast(g, tf.float32)
        # One op per tensor (`l2_loss` is half the sum of squares) rather
        # than a square and a sum: models have many small variables.
        terms.append(tf.nn.l2_loss(values))
    if not terms:
        return tf.constant(0.0)
    return 2.0 * tf.add_n(terms)


def window_estimate(q, n, weight, accumulated_squared_norm):
    """One window's unbiased `(S_hat, G2_hat, valid)`.

    Elementwise, so it also takes tensors of many windows at once.

    Args:
        q: Float32. `sum_k w_k |g_k|^2` over the window's micro-batches.
        n: Float32. How many micro-batches (with `w_k > 0`) `q` holds.
        weight: Float32. `W = sum_k w_k`.
        accumulated_squared_norm: Float32. `|sum_k w_k g_k|^2`.

    Returns:
        `(S_hat, G2_hat, valid)`: float32 estimates of `tr(Sigma)` and
        `|G|^2` (zero where not valid), and a float32 1.0 where the window
        gives an estimate (`n >= 2` and `W > 0`), else 0.0.
    """
    valid = tf.logical_and(n >= 2.0, weight > 0.0)
    mean_squared = tf.math.divide_no_nan(
        accumulated_squared_norm, tf.square(weight)
    )
    trace = tf.math.divide_no_nan(q - weight * mean_squared, n - 1.0)
    grad_sq = mean_squared - tf.math.divide_no_nan(trace, weight)
    zero = tf.zeros_like(trace)
    return (
        tf.where(valid, trace, zero),
        tf.where(valid, grad_sq, zero),
        tf.cast(valid, tf.float32),
    )


def combine_statistics(summed):
    """Averages per-replica estimates summed by an all-reduce.

    Args:
        summed: Float32 vector `[sum_r v_r S_r, sum_r v_r G2_r, sum_r v_r,
            sum_r n_r]`, the sum over replicas of what
            `NoiseScaleEstimator.statistics` returned (`v_r` is 1.0 where
            replica `r` had an estimate, `n_r` its micro-batches).

    Returns:
        `(S, G2, valid, n)`: the mean over replicas with an estimate, a
        bool scalar (whether any had one), and the micro-batches measured on
        all replicas together.
    """
    count = summed[2]
    return (
        tf.math.divide_no_nan(summed[0], count),
        tf.math.divide_no_nan(summed[1], count),
        count > 0.0,
        summed[3],
    )


def microbatch_statistics(contributions, weight):
    """What one micro-batch adds to its window's sums.

    Args:
        contributions: Its float32 `w_k g_k` (tensors, `IndexedSlices`,
            `None`).
        weight: Float32 scalar `w_k`.

    Returns:
        `(w_k |g_k|^2, 1.0)` as float32 scalars: `|w_k g_k|^2 / w_k`, and
        the micro-batch counted; `(0.0, 0.0)` for one of weight 0 (an empty
        shard), which holds no sample.
    """
    q = tf.math.divide_no_nan(squared_norm(contributions), weight)
    return q, tf.cast(weight > 0.0, tf.float32)


class NoiseScaleEstimator(tf.Module):
    """The state of the measurement: one window's sums and the averages.

    Made by `GradientAccumulator(noise_scale=...)`, which calls `add` in the
    branch that adds a micro-batch, `statistics` and `update` when it
    applies a window, and `count_closed_window` when a window closes; it
    zeroes `window_variables` when a window ends and saves
    `state_variables` with its own. Read the estimates through the
    properties.

    Args:
        config: A `NoiseScale`.
        name: Optional name of the module.
    """

    def __init__(self, config, state=None, name=None):
        super().__init__(name=name or "noise_scale")
        self.config = config
        if state is None:
            state = _state.WindowState()
        self._state = state
        v = state.declare_group("noise_scale", _state.NOISE_SCALE)
        # This replica's part of the open window.
        self._q = v["squared_norm_sum"]
        self._n = v["micro_batches"]
        # Windows closed since the start (measured or not): which ones to
        # measure.
        self._windows = v["windows"]
        # Smoothed over measured windows; equal on every replica.
        self._measurements = v["measurements"]
        self._ema_trace = v["ema_trace_sigma"]
        self._ema_grad_sq = v["ema_grad_sq_norm"]
        self._ema_weight = v["ema_window_weight"]
        self._ema_micro = v["ema_micro_batch_weight"]
        self._last_trace = v["last_trace_sigma"]
        self._last_grad_sq = v["last_grad_sq_norm"]
        self._all = list(v.values())

    @property
    def window_variables(self):
        """The variables of the open window's sums (zero when it is empty)."""
        return [self._q, self._n]

    @property
    def state_variables(self):
        """Every variable of the state (`_state.NOISE_SCALE`'s order)."""
        return list(self._all)

    # What the accumulator calls (in replica context).

    def measuring(self):
        """Bool scalar tensor: whether the open window is measured."""
        return tf.equal(self._windows % self.config.every, 0)

    def add(self, contributions, weight, run_if):
        """Adds one micro-batch that joins the window.

        Args:
            contributions: Its float32 `w_k g_k`, as the window adds them
                (tensors, `IndexedSlices`, `None`).
            weight: Float32 scalar `w_k`.
            run_if: `run_if(pred, fn)`, the accumulator's conditional.
        """

        def fn():
            q, n = microbatch_statistics(contributions, weight)
            self._q.assign_add(q)
            # After the data, as the window's counters (the norm reads it).
            with tf.control_dependencies([q]):
                self._n.assign_add(n)

        if self.config.every == 1:
            fn()
        else:
            run_if(self.measuring(), fn)

    def add_sums(self, q, n):
        """Adds a batch's sums over its slices, `(sum_k w_k |g_k|^2, n)`.

        Returns:
            The last addition's output, to order what must follow it.
        """
        if self.config.every != 1:
            measuring = self.measuring()
            q = tf.where(measuring, q, tf.zeros_like(q))
            n = tf.where(measuring, n, tf.zeros_like(n))
        self._q.assign_add(q)
        return self._n.assign_add(n)

    def statistics(self, accumulators, weight):
        """This replica's estimate of its window, to be summed over replicas.

        Args:
            accumulators: The window's float32 sums `sum_k w_k g_k`.
            weight: Float32 scalar, this replica's `W`.

        Returns:
            A float32 vector of 4: `[v S_hat, v G2_hat, v,
            n]`, `v` 1.0 when the window is measured and gives an estimate,
            `n` its micro-batches (0 when not measured).
        """
        q = self._q.read_value()
        n = self._n.read_value()
        if self.config.every != 1:
            # An unmeasured window holds no micro-batch (n = 0): no estimate
            # and no pass over the accumulators.
            n = tf.where(self.measuring(), n, tf.zeros_like(n))
            norm = tf.cond(
                n >= 2.0,
                lambda: squared_norm(accumulators),
                lambda: tf.constant(0.0),
            )
        else:
            norm = squared_norm(accumulators)
        trace, grad_sq, valid = window_estimate(q, n, weight, norm)
        return tf.stack([trace, grad_sq, valid, n])

    def update(self, summed, weight, num_replicas=1):
        """Folds the window's combined estimate into the averages.

        Args:
            summed: What `statistics` returned, summed over replicas.
            weight: Float32 scalar, the window's total `W`.
            num_replicas: Int, the replicas `summed` was summed over.
        """
        trace, grad_sq, valid, n = combine_statistics(summed)
        # One global micro-batch spans the replicas.
        micro = tf.math.divide_no_nan(weight * float(num_replicas), n)

        def fold():
            beta = self.config.beta
            for ema, value in [
                (self._ema_trace, trace),
                (self._ema_grad_sq, grad_sq),
                (self._ema_weight, weight),
                (self._ema_micro, micro),
            ]:
                ema.assign(beta * ema + (1.0 - beta) * value)
            self._last_trace.assign(trace)
            self._last_grad_sq.assign(grad_sq)
            self._measurements.assign_add(1.0)
            return tf.constant(True)

        tf.cond(valid, fold, lambda: tf.constant(False))

    def count_closed_window(self):
        """Counts a window that closed (a discarded one is not counted)."""
        self._windows.assign_add(1)

    # What users read.

    def _debiased(self, ema):
        # The moving averages start at 0; dividing by 1 - beta^count makes
        # them unbiased means of what they averaged (the factor cancels in
        # `b_simple`). NaN before the first measurement.
        count = self._measurements.read_value()
        correction = 1.0 - tf.pow(self.config.beta, count)
        nan = tf.constant(float("nan"))
        return tf.where(count > 0.0, ema.read_value() / correction, nan)

    @property
    def b_simple(self):
        """Float32 tensor: `tr(Sigma) / |G|^2`, in the normalizer's unit.

        The ratio of the moving averages. NaN before the first measured
        window; +inf while the averaged `|G|^2` is <= 0 (the noise drowns
        the signal: the estimate is not clipped).
        """
        # The debiasing factors cancel: the ratio of the raw averages.
        trace = self._ema_trace.read_value()
        grad_sq = self._ema_grad_sq.read_value()
        ratio = tf.where(
            grad_sq > 0.0,
            tf.math.divide_no_nan(trace, grad_sq),
            tf.constant(float("inf")),
        )
        return tf.where(
            self._measurements.read_value() > 0.0,
            ratio,
            tf.constant(float("nan")),
        )

    @property
    def trace_sigma(self):
        """Float32 tensor: the averaged `tr(Sigma)` (per unit of weight)."""
        return self._debiased(self._ema_trace)

    @property
    def grad_sq_norm(self):
        """Float32 tensor: the averaged `|G|^2`."""
        return self._debiased(self._ema_grad_sq)

    @property
    def window_weight(self):
        """Float32 tensor: the averaged `W` of the measured windows."""
        return self._debiased(self._ema_weight)

    @property
    def micro_batch_weight(self):
        """Float32 tensor: the averaged `W` per global micro-batch.

        A global micro-batch is one micro-batch on every replica: for a
        per-sample loss, `replicas * batch_size` (less for short ones).
        """
        return self._debiased(self._ema_micro)

    @property
    def last_trace_sigma(self):
        """Float32 tensor: the last measured window's unbiased `tr(Sigma)`."""
        return self._last_trace.read_value()

    @property
    def last_grad_sq_norm(self):
        """Float32 tensor: the last measured window's unbiased `|G|^2`."""
        return self._last_grad_sq.read_value()

    @property
    def measurements(self):
        """Int: how many windows gave an estimate."""
        return int(self._measurements.numpy())
