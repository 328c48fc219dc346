"""Log append benchmark (no HTTP produce path): committed proposals per second
and commit latency of our replicated log, next to PySyncObj in the same run.

For each (voters, flush mode) a real local cluster is started (one OS process
per node, LMDB storage); the leader is driven from inside its own process
(``POST /raft/bench``), exactly as ``benchmarks.peer_pysyncobj`` drives
PySyncObj's leader, so neither side pays for an external client. Reported per
configuration: pipelined ops/s (median, min, max over repeats), p50/p99 commit
latency, then p50/p99 under an open-loop load at half of the measured peak, and
CPU seconds per node. Ratios are against PySyncObj's pipelined throughput with
the same payload and window, measured in this run.

    python -m benchmarks.log_append [--quick] [--voters 3 5] [--flush sync async]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peer_pysyncobj import run_pysyncobj
from benchmarks.stats import median_min_max
from dledger.cluster import LocalCluster, cpu_ticks, http_request


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _bench(lc: LocalCluster, leader: int, query: str, timeout_s: float) -> dict[str, Any]:
    res = http_request(lc.http(leader), "POST", f"/raft/bench?{query}", timeout_s=timeout_s)
    if res.status != 200:
        raise RuntimeError(f"bench on node {leader} failed: {res.status} {res.body[:300]!r}")
    out: dict[str, Any] = res.json()
    return out


def run_dledger(
    voters: int,
    flush: str,
    size: int,
    ops: int,
    window: int,
    repeats: int,
    snapshot_every: int = 50_000,
    half_peak_s: float = 5.0,
    map_size_bytes: int = 2 << 30,
    progress: Callable[[str], None] = _log,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dledger-bench-") as tmp:
        lc = LocalCluster.create(
            Path(tmp) / "c",
            voters=voters,
            settings={
                "flush": flush,
                "state_machine": "log",
                "snapshot_every_entries": snapshot_every,
                "map_size_bytes": map_size_bytes,
            },
        )
        try:
            lc.start_all()
            leader = lc.wait_leader(timeout_s=60)
            progress(f"dledger {voters} voters flush={flush}: leader is node {leader}; warming up")
            _bench(lc, leader, f"n={min(ops, 2000)}&size={size}&window={window}", 300)
            runs = []
            cpu0 = {i: cpu_ticks(lc.pid(i) or 0) or 0 for i in lc.ids()}
            t0 = time.monotonic()
            for k in range(repeats):
                r = _bench(lc, leader, f"n={ops}&size={size}&window={window}", 600)
                runs.append(r)
                lat = r["latency_ms"]  # null (NaN) when nothing committed
                progress(
                    f"  repeat {k + 1}/{repeats}: {r['ops_per_s']:,.0f} ops/s, "
                    f"p50 {lat['p50'] or float('nan'):.2f} ms, "
                    f"p99 {lat['p99'] or float('nan'):.2f} ms, errors {r['errors']}"
                )
            wall = time.monotonic() - t0
            cpu = {i: ((cpu_ticks(lc.pid(i) or 0) or 0) - cpu0[i]) / 100.0 / wall for i in lc.ids()}
            peak = median_min_max([r["ops_per_s"] for r in runs])["median"]
            rate = max(peak / 2, 1.0)
            n_half = max(1, int(rate * half_peak_s))  # open-loop load for half_peak_s
            progress(f"  open-loop load at half the peak: {rate:,.0f}/s for {n_half} entries")
            half = _bench(lc, leader, f"n={n_half}&size={size}&rate={rate}", 600)
            progress(
                f"  half-peak: p50 {half['latency_ms']['p50'] or float('nan'):.2f} ms, "
                f"p99 {half['latency_ms']['p99'] or float('nan'):.2f} ms, errors {half['errors']}"
            )
            return {
                "system": "dledger-py",
                "voters": voters,
                "flush": flush,
                "payload_bytes": size,
                "window": window,
                "pipelined": {
                    "ops_per_s": median_min_max([r["ops_per_s"] for r in runs]),
                    "latency_ms": {
                        "p50": median_min_max([r["latency_ms"]["p50"] for r in runs])["median"],
                        "p99": median_min_max([r["latency_ms"]["p99"] for r in runs])["median"],
                    },
                    "runs": runs,
                },
                "half_peak": half,
                "cpu_fraction_per_node": cpu,
            }
        finally:
            lc.down()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.log_append", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small run for a smoke check")
    ap.add_argument("--voters", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--flush", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--payload", type=int, default=100)
    ap.add_argument("--ops", type=int, default=None)
    ap.add_argument("--window", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--snapshot-every",
        type=int,
        default=50_000,
        help="node snapshot interval in entries (0: off); snapshots are built on the "
        "event loop, so they show in the latency tail",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    a = ap.parse_args(argv)
    ops = a.ops or (5000 if a.quick else 20000)
    repeats = a.repeats or (1 if a.quick else 3)
    results: dict[str, Any] = {"dledger": [], "pysyncobj": []}
    for v in a.voters:
        _log(f"pysyncobj {v} nodes: {ops} ops x {repeats}, window {a.window}")
        peer = run_pysyncobj(v, a.payload, ops, a.window, repeats, progress=_log)
        results["pysyncobj"].append(peer)
        for fl in a.flush:
            results["dledger"].append(
                run_dledger(v, fl, a.payload, ops, a.window, repeats, a.snapshot_every)
            )
    rows = []
    for d in results["dledger"]:
        peer = next(p for p in results["pysyncobj"] if p["nodes"] == d["voters"])
        p_ops = peer["pipelined"]["ops_per_s"]["median"]
        ratio = d["pipelined"]["ops_per_s"]["median"] / p_ops if p_ops else float("nan")
        rows.append(
            f"| {d['voters']} | {d['flush']} | {d['pipelined']['ops_per_s']['median']:,.0f} "
            f"({d['pipelined']['ops_per_s']['min']:,.0f}-{d['pipelined']['ops_per_s']['max']:,.0f}) "
            f"| {d['pipelined']['latency_ms']['p50']:.1f} / {d['pipelined']['latency_ms']['p99']:.1f} "
            f"| {d['half_peak']['latency_ms']['p50']:.1f} / {d['half_peak']['latency_ms']['p99']:.1f} "
            f"| {p_ops:,.0f} | {ratio:.2f}x |"
        )
    print(
        "| voters | flush | dledger ops/s median (min-max) | p50/p99 ms at peak "
        "| p50/p99 ms at half peak | PySyncObj pipelined ops/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=2))
        _log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
