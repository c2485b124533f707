"""The intervals that the long-context evaluations report: a Wilson score interval for an
accuracy (:func:`wilson_interval`) and a percentile bootstrap over sequences for a mean
(:func:`bootstrap_interval`), both at :data:`LEVEL` unless told otherwise.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import torch

__all__ = ["LEVEL", "RESAMPLES", "bootstrap_interval", "wilson_interval"]

LEVEL = 0.95
RESAMPLES = 10_000
# A bootstrap over one sequence has no spread to resample.
MIN_SEQUENCES = 2


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def wilson_interval(correct: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``correct / n`` at ``level`` (two-sided)."""
    _check_int("n", n, 1)
    if isinstance(correct, bool) or not isinstance(correct, int) or not 0 <= correct <= n:
        raise ValueError(f"correct must be an int in [0, n={n}], got {correct!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p, z2 = correct / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(
    values: np.ndarray | torch.Tensor,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of the mean over the rows of ``values`` (``(n, k)``: one row
    per sequence, one column per quantity), at ``level``: ``resamples`` resamples of n rows with
    replacement, from a generator seeded by ``seed``. Returns (low, high), each ``(k,)``."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] < MIN_SEQUENCES:
        raise ValueError(
            f"values must be (n, k) with n >= {MIN_SEQUENCES} rows, got shape {values.shape}"
        )
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.shape[0], size=(resamples, values.shape[0]))
    means = np.stack([values[:, j][picks].mean(axis=1) for j in range(values.shape[1])], axis=1)
    tail = 100 * (1 - level) / 2
    return np.percentile(means, tail, axis=0), np.percentile(means, 100 - tail, axis=0)
