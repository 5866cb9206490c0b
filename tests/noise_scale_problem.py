"""A problem whose per-sample gradients are known exactly, for the noise scale.

Linear regression with the mean squared error, `loss_i = (x_i . a + b -
y_i)^2`, on a fixed data set: per-sample gradients `2 r_i [x_i, 1]` by hand,
in float64. Windows draw their samples from the data set *with
replacement*, so they are i.i.d. draws from the population whose gradient
mean is `G` and covariance `Sigma` (population covariance, dividing by the
number of samples), which is what the estimator's unbiasedness assumes.
"""

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
