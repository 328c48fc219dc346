"""The peer baseline (PySyncObj) and the Raft log append benchmark (no HTTP).

Both drive their leader from inside its own process, so neither pays for a
client: ``peer`` through PySyncObj's callbacks (``benchmarks.peer_pysyncobj``),
``log_append`` through the node's ``POST /raft/bench`` (``dledger.bench``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.log_append import run_dledger
from benchmarks.peer_pysyncobj import run_pysyncobj
from benchmarks.registry import BenchResult, Context, Figure, benchmark

PEER_WINDOW = 5000  # outstanding pipelined appends (PySyncObj's best mode: batch appends)


def peer_key(nodes: int, payload: int, mode: str, metric: str = "ops_per_s") -> str:
    return f"peer.{nodes}n.{payload}B.{mode}.{metric}"


def _peer_payloads(ctx: Context) -> list[int]:
    return [100] if ctx.quick else [100, 1024, 16384]


@benchmark("peer", "PySyncObj 3 and 5 nodes: pipelined appends to a replicated list, and sync")
def run_peer(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = ctx.repeats()
    for nodes in (3, 5):
        for payload in _peer_payloads(ctx):
            ops = (10_000 if ctx.quick else 20_000) if payload <= 1024 else 4000
            ctx.log(f"peer: PySyncObj {nodes} nodes, {payload} B, {ops} pipelined x {repeats}")
            r = run_pysyncobj(
                nodes,
                payload,
                ops,
                PEER_WINDOW,
                repeats,
                progress=lambda m: ctx.log("  " + m),
                sync_ops=10 if ctx.quick else 30,
                fresh_cluster=True,  # every repeat from an empty list: the peer's best case
            )
            res.raw[f"{nodes}n.{payload}B"] = r
            cfg: dict[str, Any] = {"nodes": nodes, "payload_bytes": payload, **r["config"]}
            pipe = r["pipelined"]
            res.figures.append(
                Figure(
                    peer_key(nodes, payload, "pipelined"),
                    f"PySyncObj {nodes}n pipelined appends, {payload} B",
                    "ops/s",
                    pipe["ops_per_s"]["median"],
                    pipe["ops_per_s"]["min"],
                    pipe["ops_per_s"]["max"],
                    pipe["ops_per_s"]["n"],
                    config=cfg,
                )
            )
            res.figures.append(
                Figure.of(
                    peer_key(nodes, payload, "pipelined", "p99_ms"),
                    f"PySyncObj {nodes}n pipelined p99 commit latency, {payload} B",
                    "ms",
                    [x["latency_ms"]["p99"] for x in pipe["runs"]],
                    higher_is_better=False,
                    config=cfg,
                )
            )
            for mode, label in (
                ("sync", "sync one-at-a-time (batch mode, its default)"),
                ("sync_low_latency", "sync one-at-a-time (appendEntriesUseBatch=False)"),
            ):
                s = r.get(mode)
                if not s:
                    continue
                res.figures.append(
                    Figure(
                        peer_key(nodes, payload, mode),
                        f"PySyncObj {nodes}n {label}, {payload} B",
                        "ops/s",
                        s["ops_per_s"]["median"],
                        s["ops_per_s"]["min"],
                        s["ops_per_s"]["max"],
                        s["ops_per_s"]["n"],
                        config={**cfg, **(s.get("config") or {})},
                    )
                )
                res.figures.append(
                    Figure.of(
                        peer_key(nodes, payload, mode, "p50_ms"),
                        f"PySyncObj {nodes}n {label} p50 latency, {payload} B",
                        "ms",
                        [x["latency_ms"]["p50"] for x in s["runs"]],
                        higher_is_better=False,
                        config=cfg,
                    )
                )
            best = best_peer_sync_key({f.key: f for f in res.figures}, nodes, payload)
            if best is not None:
                b = next(f for f in res.figures if f.key == best)
                res.figures.append(
                    Figure(
                        peer_key(nodes, payload, "best_sync"),
                        f"PySyncObj {nodes}n sync one-at-a-time, better of its two modes, "
                        f"{payload} B",
                        b.unit,
                        b.median,
                        b.min,
                        b.max,
                        b.n,
                        config={**b.config, "mode": best.split(".")[3]},
                    )
                )
    res.notes.append(
        "PySyncObj 0.3.17 with its default SyncObjConf (appendEntriesUseBatch=True, "
        "in-memory journal, never fsyncs), one process per node on 127.0.0.1, driven "
        "from inside the leader process; a fresh cluster per repeat. The sync figure "
        "quoted for ratios is the better of its two sync modes."
    )
    return res


def best_peer_sync_key(figs: dict[str, Figure], nodes: int, payload: int) -> str | None:
    """The faster of the peer's sync modes (never compare with the slower one)."""
    keys = [peer_key(nodes, payload, m) for m in ("sync", "sync_low_latency")]
    present = [k for k in keys if k in figs]
    return max(present, key=lambda k: figs[k].median) if present else None


@benchmark(
    "log_append",
    "Raft log append inside the leader (no HTTP): proposals/s, p50/p99 commit latency",
    needs=("peer",),
)
def run_log_append(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = ctx.repeats()
    if ctx.quick:
        combos = [(3, "sync", 100), (3, "async", 100), (5, "sync", 100), (3, "sync", 1024)]
    else:
        combos = [
            (v, fl, p) for v in (3, 5) for fl in ("sync", "async") for p in (100, 1024, 16384)
        ]
    for voters, flush, payload in combos:
        ops = (5000 if ctx.quick else 20_000) if payload <= 1024 else 3000
        # At most ~8 MiB in flight: with 5000 x 16 KiB (80 MB) queued, the
        # leader stalls past the election timeout and loses leadership.
        window = min(PEER_WINDOW, max(64, (8 << 20) // max(payload, 1)))
        ctx.log(
            f"log_append: {voters} voters, flush={flush}, {payload} B, {ops} ops x {repeats}, "
            f"window {window}"
        )
        tag = f"{voters}v.{flush}.{payload}B"
        try:
            d = run_dledger(
                voters,
                flush,
                payload,
                ops,
                window,
                repeats,
                half_peak_s=2.0 if ctx.quick else 4.0,
                progress=lambda m: ctx.log("  " + m),
            )
        except Exception as exc:  # one configuration failing must not lose the others
            ctx.log(f"  {tag} failed: {type(exc).__name__}: {exc}")
            res.raw[tag] = {"error": f"{type(exc).__name__}: {exc}"}
            res.notes.append(f"{tag} failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        res.raw[tag] = d
        cfg = {"voters": voters, "flush": flush, "payload_bytes": payload, "window": window}
        runs = d["pipelined"]["runs"]
        name = f"{voters} voters, {flush}, {payload} B"
        res.figures += [
            Figure.of(
                f"log_append.{tag}.ops_per_s",
                f"log append {name}: committed proposals/s",
                "ops/s",
                [r["ops_per_s"] for r in runs],
                peer_key=peer_key(voters, payload, "pipelined"),
                config=cfg,
            ),
            Figure.of(
                f"log_append.{tag}.p50_ms",
                f"log append {name}: p50 commit latency (window {window})",
                "ms",
                [r["latency_ms"]["p50"] for r in runs],
                higher_is_better=False,
                config=cfg,
            ),
            Figure.of(
                f"log_append.{tag}.p99_ms",
                f"log append {name}: p99 commit latency (window {window})",
                "ms",
                [r["latency_ms"]["p99"] for r in runs],
                higher_is_better=False,
                peer_key=peer_key(voters, payload, "pipelined", "p99_ms"),
                config=cfg,
            ),
            Figure.of(
                f"log_append.{tag}.half_peak_p99_ms",
                f"log append {name}: p99 at half the peak rate (open loop, one run)",
                "ms",
                [d["half_peak"]["latency_ms"]["p99"]],
                higher_is_better=False,
                config={**cfg, "rate": d["half_peak"].get("offered_per_s")},
            ),
        ]
    return res
