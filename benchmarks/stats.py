"""Small statistics helpers shared by the benchmark scripts.

Everything here works on plain lists of floats and returns plain dicts, so the
results can go straight into ``json.dumps``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = ["median_min_max", "percentile", "summarize"]


def percentile(values: Sequence[float], p: float) -> float:
    """Return the ``p``-th percentile (0 <= p <= 100) of ``values``.

    Uses linear interpolation between the two closest ranks (the same
    definition as ``numpy.percentile``'s default), so ``percentile(x, 50)`` is
    the median and ``percentile(x, 0)`` / ``percentile(x, 100)`` are min / max.
    Raises ``ValueError`` for an empty sequence or ``p`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile() of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile p must be within [0, 100], got {p!r}")
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * (p / 100.0)
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return float(ordered[lo])
    frac = rank - lo
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * frac)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Summarize a sample as ``{p50, p99, min, max, mean, n}``.

    An empty sample gives NaN statistics (JSON-serialisable as ``NaN`` by
    ``json.dumps``) and ``n == 0`` rather than raising, so that a benchmark that
    produced no successful operation can still report its failure counts.
    """
    n = len(values)
    if n == 0:
        nan = float("nan")
        return {"p50": nan, "p99": nan, "min": nan, "max": nan, "mean": nan, "n": 0}
    ordered = sorted(values)
    return {
        "p50": percentile(ordered, 50.0),
        "p99": percentile(ordered, 99.0),
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
        "mean": float(statistics.fmean(ordered)),
        "n": n,
    }


def median_min_max(repeats: Iterable[float]) -> dict[str, float]:
    """Reduce per-repeat figures to ``{median, min, max}`` (plus ``n``)."""
    values = [float(v) for v in repeats]
    if not values:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "n": 0}
    return {
        "median": float(statistics.median(values)),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
