"""A problem whose per-sample gradients are known exactly, for the noise scale.

Linear regression with the mean squared error, `loss_i = (x_i . a + b -
y_i)^2`, on a fixed data set: per-sample gradients `2 r_i [x_i, 1]` by hand,
in float64. Windows draw their samples from the data set *with
replacement*, so they are i.i.d. draws from the population whose gradient
mean is `G` and covariance `Sigma` (population covariance, dividing by the
number of samples), which is what the estimator's unbiasedness assumes.
"""

import itertools

import numpy as np

IN_DIM = 6


def data(n=2048, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN_DIM))
    coef = rng.normal(size=IN_DIM)
    y = x @ coef + 0.5 * rng.normal(size=n)
    return x.astype("float32"), y[:, None].astype("float32")


def frozen_weights(seed=0):
    """`(kernel [IN_DIM, 1], bias [1])`, where the gradient is far from 0."""
    rng = np.random.default_rng(seed + 1)
    return (
        (0.3 * rng.normal(size=(IN_DIM, 1))).astype("float32"),
        np.array([0.5], "float32"),
    )


def per_sample_gradients(x, y, kernel, bias):
    """float64 `[n, IN_DIM + 1]`: each sample's gradient (kernel, bias)."""
    x = x.astype(np.float64)
    r = x @ kernel.astype(np.float64)[:, 0] + float(bias[0]) - y[:, 0]
    return 2.0 * r[:, None] * np.c_[x, np.ones(len(x))]


def population(x, y, kernel, bias):
    """Exact `(|G|^2, tr(Sigma), B_simple)` over the data set."""
    g = per_sample_gradients(x, y, kernel, bias)
    mean = g.mean(axis=0)
    trace = ((g - mean) ** 2).sum(axis=1).mean()
    grad_sq = mean @ mean
    return grad_sq, trace, trace / grad_sq


def window_indices(sizes, windows, n, seed=0):
    """Row indices of `windows` windows of micro-batches of `sizes`."""
    rng = np.random.default_rng(seed + 2)
    return rng.integers(0, n, size=(windows, sum(sizes)))


def window_data(x, y, sizes, windows, seed=0):
    """The rows of `windows` windows, concatenated, and the indices."""
    indices = window_indices(sizes, windows, len(x), seed=seed)
    flat = indices.reshape(-1)
    return x[flat], y[flat], indices


def window_sums(g, indices, sizes):
    """Per window: q, n, W and |sum_k h_k|^2 from per-sample gradients.

    `q = sum_k |h_k|^2 / w_k` with `h_k = w_k g_k` the summed gradient of
    micro-batch k, `n` the number of micro-batches and `W` the samples.
    """
    bounds = np.cumsum((0,) + tuple(sizes))
    q = np.zeros(len(indices))
    acc = np.zeros((len(indices), g.shape[1]))
    for start, stop in itertools.pairwise(bounds):
        h = g[indices[:, start:stop]].sum(axis=1)  # w_k g_k
        q += (h**2).sum(axis=1) / (stop - start)
        acc += h
    return q, len(sizes), float(sum(sizes)), (acc**2).sum(axis=1)


def estimate_by_hand(g, indices, sizes):
    """Per window: the unbiased (S_hat, G2_hat), from exact gradients."""
    q, n, weight, a = window_sums(g, indices, sizes)
    s = (q - a / weight) / (n - 1)
    return s, a / weight**2 - s / weight
