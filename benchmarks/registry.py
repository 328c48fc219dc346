"""The benchmark registry and what every benchmark reports.

A benchmark is a function ``run(ctx) -> BenchResult`` registered under a
short name with :func:`benchmark`. It reports *figures*: one number each,
already reduced over repeats to a median with its min and max
(:func:`Figure.of`), with the unit, whether higher is better, the
configuration that produced it, and optionally the key of the peer figure
(PySyncObj, measured in the same run) it is compared with. It may also
return *series* (curves for plots: latency against throughput, RSS against
stored messages) and free-form ``raw`` detail for results.json.

``peer`` is a benchmark like the others; benchmarks that compare with it
name it in ``needs``, and ``python -m benchmarks run --only X`` adds it
unless ``--no-peer`` is given.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Figure:
    """One reported number: median over repeats, with min and max."""

    key: str  # unique within the run, e.g. "http_produce.batched.msg_per_s"
    label: str  # human text for tables
    unit: str
    median: float
    min: float
    max: float
    n: int
    higher_is_better: bool = True
    peer_key: str | None = None  # the figure of the peer this one is compared with
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        key: str,
        label: str,
        unit: str,
        repeats: Iterable[float | None],
        *,
        higher_is_better: bool = True,
        peer_key: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> Figure:
        # Drop NaN, and None: a latency of a run in which no operation
        # succeeded (log_append's 5-voter 1 KiB run lost its leader under
        # that overload and crashed the whole configuration's figures).
        vals = [float(v) for v in repeats if v is not None and v == v]
        if not vals:
            nan = float("nan")
            return cls(key, label, unit, nan, nan, nan, 0, higher_is_better, peer_key, config or {})
        return cls(
            key,
            label,
            unit,
            float(statistics.median(vals)),
            min(vals),
            max(vals),
            len(vals),
            higher_is_better,
            peer_key,
            dict(config or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "unit": self.unit,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "n": self.n,
            "higher_is_better": self.higher_is_better,
            "peer_key": self.peer_key,
            "config": self.config,
        }


@dataclass(slots=True)
class Series:
    """A curve for a plot: named x/y points (one line per series)."""

    key: str
    plot: str  # series with the same ``plot`` share one PNG
    label: str
    x_label: str
    y_label: str
    x: list[float]
    y: list[float]
    log_y: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "plot": self.plot,
            "label": self.label,
            "x_label": self.x_label,
            "y_label": self.y_label,
            "x": self.x,
            "y": self.y,
            "log_y": self.log_y,
        }


@dataclass(slots=True)
class BenchResult:
    figures: list[Figure] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Context:
    """What a benchmark gets: the run's mode and a place for scratch files."""

    quick: bool
    big: bool
    out_dir: Path
    work_dir: Path  # scratch (cluster data dirs); removed after the run
    profile: bool = True  # capture a leader profile where a goal is missed
    started: float = field(default_factory=time.monotonic)

    def log(self, msg: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{elapsed:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def repeats(self, full: int = 3, quick: int = 2) -> int:
        return quick if self.quick else full


BenchFn = Callable[[Context], BenchResult]


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    fn: BenchFn
    summary: str
    needs: tuple[str, ...] = ()


REGISTRY: dict[str, Benchmark] = {}


class Skipped(Exception):
    """Raised by a benchmark that cannot run here (e.g. a peer's server is not
    installed): the run records ``skipped: <reason>`` and goes on; not a failure."""


def benchmark(name: str, summary: str, needs: tuple[str, ...] = ()) -> Callable[[BenchFn], BenchFn]:
    """Register ``fn`` as benchmark ``name`` (run in registration order)."""

    def deco(fn: BenchFn) -> BenchFn:
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} registered twice")
        REGISTRY[name] = Benchmark(name, fn, summary, needs)
        return fn

    return deco
