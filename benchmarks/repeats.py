"""Interleaved repeats and the medians' intervals the benchmarks report."""

import math


def rotated(items, r):
    """Returns `items` rotated left by `r`.

    Over `len(items)` consecutive repeats, each item runs once in every
    position.
    """
    first = r % len(items)
    return list(items[first:]) + list(items[:first])


def median_interval(values, confidence=0.95):
    """A confidence interval for the median, free of any distribution.

    Of `n` independent samples, the k-th smallest and the k-th largest
    bracket the median of their distribution with probability
    `1 - 2 * P(Binomial(n, 1/2) < k)`, whatever the distribution.

    Args:
        values: The samples (at least one).
        confidence: The least coverage wanted.

    Returns:
        `(low, high, coverage)` for the largest such `k` whose coverage is at
        least `confidence`; `(min, max, its coverage)` when even `k = 1`
        falls short (fewer than 6 samples).
    """
    xs = sorted(values)
    n = len(xs)

    def coverage(k):
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < n // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)
