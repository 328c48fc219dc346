"""Small Prometheus-style metric primitives (no dependency, no global registry).

A :class:`Histogram` counts observations into fixed cumulative buckets, as
Prometheus histograms do, so a scrape is ``O(buckets)`` and an observation
is a bisect plus two additions: cheap enough for every storage sync and
every HTTP request. Owners keep their histograms as attributes (the storage
its fsync durations, the HTTP app its request latencies) and
:func:`render_histogram` turns them into the text exposition format.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

# Seconds: 100 us .. 10 s, dense where fsyncs and local requests land.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Histogram:
    """Observations in cumulative buckets (upper bounds, ``+Inf`` implied)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be strictly increasing and non-empty")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += n
            out.append(("+Inf" if bound == math.inf else _num(bound), acc))
        return out


def _num(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return str(int(v))
    return repr(v)


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels_text(labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels)
    return "{" + inner + "}" if inner else ""


def render_histogram(
    name: str,
    help_: str,
    series: Iterable[tuple[tuple[tuple[str, str], ...], Histogram]],
) -> list[str]:
    """Text-format lines of one histogram family: ``series`` pairs label
    tuples with their histogram (one unlabelled series: ``[((), h)]``)."""
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for labels, h in series:
        for le, n in h.cumulative():
            lines.append(f"{name}_bucket{labels_text((*labels, ('le', le)))} {n}")
        lines.append(f"{name}_sum{labels_text(labels)} {h.sum:.6f}")
        lines.append(f"{name}_count{labels_text(labels)} {h.count}")
    return lines
