"""Recovery and availability: RTO per fault window, gaps, throughput, latency.

Theory of operation
-------------------
An op's *event time* is its completion time, or its invoke time when it was
never completed. Final reads are left out (they run after healing, by
design serially).

RTO per fault window and per ``f``: the first ``fail`` / ``info`` op whose
event time lies in ``[start, stop + grace]`` marks the impact; recovery is
the completion of the next ``ok`` op of the same ``f`` after that event.
``rto_ms`` = recovery - max(impact op's invoke, fault start). A window with
no failed op has ``impacted = false`` and ``rto_ms = null``; an impacted
``f`` with no later ``ok`` op is *unrecovered*. The window's RTO is the
largest over its ``f``s.

Unavailability outside faults: the gaps between consecutive ``ok``
completions (of any ``f``, from the first invoke to the last event) minus
every fault window stretched to its recovery, longer than
``gap_threshold_ms``.

Timeline: fixed buckets of ``bucket_ms`` from the first invoke; per bucket
and ``f``: ok / fail / info counts by event time and ok latency
percentiles (nearest rank), for plots.

The verdict is ``invalid`` when a window is unrecovered or there is
unavailability outside faults (each switchable in :class:`RecoveryConfig`),
else ``valid``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from jepsen_like.history import FaultWindow, History, Operation

_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    bucket_ms: int = 1000
    gap_threshold_ms: int = 2000
    grace_ms: int = 2000
    percentiles: tuple[int, ...] = (50, 95, 99)
    fail_on_unrecovered: bool = True
    fail_on_unavailability: bool = True


def _event_ns(op: Operation) -> int:
    return op.complete_ns if op.complete_ns is not None else op.invoke_ns


def percentile(sorted_values: list[float], p: int) -> float | None:
    """Nearest-rank percentile (``p`` in 1..100) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, -(-(p * len(sorted_values)) // 100))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _latency_summary(lat_ms: list[float], pcts: tuple[int, ...]) -> dict[str, Any]:
    lat_ms.sort()
    out: dict[str, Any] = {"count": len(lat_ms)}
    for p in pcts:
        v = percentile(lat_ms, p)
        out[f"p{p}_ms"] = None if v is None else round(v, 3)
    out["max_ms"] = round(lat_ms[-1], 3) if lat_ms else None
    return out


def _window(
    w: FaultWindow, by_f: dict[str, list[Operation]], end_ns: int, cfg: RecoveryConfig
) -> tuple[dict[str, Any], int]:
    """The window's report and the time it counts as covered until."""
    limit = (w.stop_ns if w.stop_ns is not None else end_ns) + cfg.grace_ms * _MS
    per_f: dict[str, Any] = {}
    covered_until = w.stop_ns if w.stop_ns is not None else end_ns
    unrecovered = []
    rtos = []
    for f, ops in sorted(by_f.items()):
        bad = next(
            (o for o in ops if o.status != "ok" and w.start_ns <= _event_ns(o) <= limit), None
        )
        if bad is None:
            per_f[f] = {"impacted": False, "rto_ms": None}
            continue
        bad_t = _event_ns(bad)
        good = min(
            (
                o.complete_ns
                for o in ops
                if o.status == "ok" and o.complete_ns is not None and o.complete_ns > bad_t
            ),
            default=None,
        )
        impact_ns = max(bad.invoke_ns, w.start_ns)
        if good is None:
            per_f[f] = {
                "impacted": True,
                "rto_ms": None,
                "recovered": False,
                "first_failure_index": bad.invoke_index,
            }
            unrecovered.append(f)
            covered_until = max(covered_until, end_ns)
            continue
        rto = (good - impact_ns) / _MS
        rtos.append(rto)
        covered_until = max(covered_until, good)
        per_f[f] = {
            "impacted": True,
            "rto_ms": round(rto, 3),
            "recovered": True,
            "first_failure_index": bad.invoke_index,
        }
    report = {
        "kind": w.kind,
        "targets": list(w.targets),
        "start_ns": w.start_ns,
        "stop_ns": w.stop_ns,
        "duration_ms": None if w.stop_ns is None else round((w.stop_ns - w.start_ns) / _MS, 3),
        "healed": w.stop_ns is not None,
        "rto_ms": round(max(rtos), 3) if rtos else None,
        "unrecovered": unrecovered,
        "by_f": per_f,
    }
    return report, covered_until


def _uncovered(a: int, b: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of ``[a, b]`` outside every (sorted) covered interval."""
    out = []
    cur = a
    for s, e in covered:
        if e <= cur or s >= b:
            continue
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
        if cur >= b:
            break
    if cur < b:
        out.append((cur, b))
    return out


def check(history: History, config: RecoveryConfig | None = None) -> dict[str, Any]:
    cfg = config or RecoveryConfig()
    ops = [op for op in history.ops if op.f != "final_read"]
    by_f: dict[str, list[Operation]] = defaultdict(list)
    for op in sorted(ops, key=_event_ns):
        by_f[op.f].append(op)
    if not ops:
        return {
            "checker": "recovery",
            "verdict": "valid",
            "windows": [],
            "unavailability": [],
            "latency": {},
            "timeline": {"bucket_ms": cfg.bucket_ms, "buckets": []},
        }
    t0 = min(op.invoke_ns for op in ops)
    end_ns = max(_event_ns(op) for op in ops)

    windows = []
    covered: list[tuple[int, int]] = []
    for w in history.faults:
        rep, until = _window(w, by_f, end_ns, cfg)
        windows.append(rep)
        covered.append((w.start_ns, until))
    covered.sort()

    oks = sorted(op.complete_ns for op in ops if op.status == "ok" and op.complete_ns is not None)
    points = [t0, *oks, end_ns]
    gaps = []
    threshold = cfg.gap_threshold_ms * _MS
    for a, b in itertools.pairwise(points):
        if b - a <= threshold:
            continue
        for s, e in _uncovered(a, b, covered):
            if e - s > threshold:
                gaps.append({"from_ns": s, "to_ns": e, "duration_ms": round((e - s) / _MS, 3)})

    latency = {
        f: _latency_summary(
            [
                (o.complete_ns - o.invoke_ns) / _MS
                for o in fops
                if o.status == "ok" and o.complete_ns is not None
            ],
            cfg.percentiles,
        )
        for f, fops in sorted(by_f.items())
    }

    bucket_ns = cfg.bucket_ms * _MS
    n_buckets = (end_ns - t0) // bucket_ns + 1
    counts: dict[tuple[int, str], dict[str, int]] = defaultdict(
        lambda: {"ok": 0, "fail": 0, "info": 0}
    )
    lats: dict[tuple[int, str], list[float]] = defaultdict(list)
    for op in ops:
        b = (_event_ns(op) - t0) // bucket_ns
        counts[(b, op.f)][op.status] += 1
        if op.status == "ok" and op.complete_ns is not None:
            lats[(b, op.f)].append((op.complete_ns - op.invoke_ns) / _MS)
    buckets = []
    for b in range(n_buckets):
        row: dict[str, Any] = {"t_ms": b * cfg.bucket_ms, "f": {}}
        for f in sorted(by_f):
            c = counts.get((b, f))
            if c is None:
                continue
            row["f"][f] = {
                **c,
                "ok_per_s": round(c["ok"] * 1000 / cfg.bucket_ms, 3),
                "latency": _latency_summary(lats.get((b, f), []), cfg.percentiles),
            }
        buckets.append(row)

    unrecovered = [w for w in windows if w["unrecovered"]]
    invalid = (cfg.fail_on_unrecovered and bool(unrecovered)) or (
        cfg.fail_on_unavailability and bool(gaps)
    )
    rtos = [w["rto_ms"] for w in windows if w["rto_ms"] is not None]
    return {
        "checker": "recovery",
        "verdict": "invalid" if invalid else "valid",
        "windows": windows,
        "max_rto_ms": max(rtos) if rtos else None,
        "unrecovered_windows": len(unrecovered),
        "unavailability": gaps,
        "latency": latency,
        "timeline": {"bucket_ms": cfg.bucket_ms, "t0_ns": t0, "buckets": buckets},
    }
