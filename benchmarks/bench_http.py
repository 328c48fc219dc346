"""HTTP produce: batched (100 x 100 B per request) and one message per
request over many keep-alive connections, against a 3-voter ``sync`` cluster.

Requests carry the binary produce body (``application/vnd.dledger.batch``,
what the Python client sends); the saturation of the same batch as JSON is
measured beside it. For each shape: the saturation rate from a closed-loop
run (repeated), then
an open-loop sweep at fixed offered rates (fractions of that saturation
rate) with latency from the intended send time -> the latency-throughput
curve; the half-saturation point is repeated for its p99.
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.bench_core import peer_key
from benchmarks.common import cluster, produce_batch, produce_body, produce_url, set_retention
from benchmarks.loadgen import JSON, closed_loop, open_loop
from benchmarks.profiling import profile_leader
from benchmarks.registry import BenchResult, Context, Figure, Series, benchmark
from broker_adapter.codec import BATCH_CONTENT_TYPE

SHAPES: dict[str, dict[str, int]] = {
    # msgs per request, closed-loop concurrency, open-loop connection pool
    "batched": {"msgs": 100, "concurrency": 8, "connections": 16},
    "single": {"msgs": 1, "concurrency": 64, "connections": 64},
}
PAYLOAD = 100
RECORD_BYTES = 140  # a 100-byte message on the CommitLog, about


def _snapshot_point(
    ctx: Context, sh: dict[str, int], rate: float, point_s: float
) -> dict[str, Any]:
    """The half-saturation point again, on a cluster where a snapshot and a
    log compaction must happen inside the window: retention keeps about a
    quarter of the window's records (so it drops throughout, which is what
    lets the log go), a snapshot is due every quarter of the window's
    entries, and the cluster is filled past retention first. Counts what
    happened from every node's status before and after."""
    msgs = sh["msgs"]
    entries = max(8, int(rate * point_s))
    settings: dict[str, object] = {
        "flush": "sync",
        "map_size_bytes": 4 << 30,
        "snapshot_every_entries": max(4, entries // 4),
        "snapshot_trailing_entries": 8,
    }
    with cluster(ctx, voters=3, settings=settings) as (lc, leader):
        addr = lc.http(leader)
        keep = max(1, entries * msgs // 4) * RECORD_BYTES
        set_retention(lc, addr, keep)
        url, body = produce_url(addr), produce_batch(msgs, PAYLOAD)
        asyncio.run(
            closed_loop(
                url,
                body,
                concurrency=sh["concurrency"],
                duration_s=point_s,
                msgs_per_req=msgs,
                content_type=BATCH_CONTENT_TYPE,
            )
        )
        before = {nid: lc.status(nid, timeout_s=5) or {} for nid in lc.ids()}
        p = asyncio.run(
            open_loop(
                url,
                body,
                rate=rate,
                duration_s=point_s,
                msgs_per_req=msgs,
                connections=sh["connections"],
                content_type=BATCH_CONTENT_TYPE,
            )
        )
        after = {nid: lc.status(nid, timeout_s=5) or {} for nid in lc.ids()}

    def taken(st: dict[str, Any]) -> int:
        return int((st.get("snapshot") or {}).get("taken", 0))

    def front(st: dict[str, Any]) -> int:
        return int((st.get("storage") or {}).get("first_index", 0))

    p["snapshots_in_window"] = sum(taken(after[n]) - taken(before[n]) for n in before)
    p["compactions_in_window"] = sum(front(after[n]) > front(before[n]) for n in before)
    p["retention_bytes"] = keep
    return p


@benchmark(
    "http_produce",
    "HTTP produce, batched and one message per request: saturation, open-loop curve",
    needs=("peer",),
)
def run_http_produce(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = ctx.repeats()
    sat_s = 2.0 if ctx.quick else 4.0
    point_s = 1.5 if ctx.quick else 3.0
    fractions = [0.25, 0.5, 0.9, 1.2] if ctx.quick else [0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.3]
    with cluster(ctx, voters=3, settings={"flush": "sync", "map_size_bytes": 4 << 30}) as (
        lc,
        leader,
    ):
        url = produce_url(lc.http(leader))
        for shape, sh in SHAPES.items():
            msgs = sh["msgs"]
            body = produce_batch(msgs, PAYLOAD)
            cfg = {"voters": 3, "flush": "sync", "payload_bytes": PAYLOAD, "msgs_per_request": msgs}
            ctx.log(f"http_produce {shape}: warm-up")
            asyncio.run(
                closed_loop(
                    url,
                    body,
                    concurrency=sh["concurrency"],
                    duration_s=1.0,
                    msgs_per_req=msgs,
                    content_type=BATCH_CONTENT_TYPE,
                )
            )
            sats: list[dict[str, Any]] = []
            jsons: list[dict[str, Any]] = []
            kinds = (
                ("binary", body, BATCH_CONTENT_TYPE, sats),
                ("JSON", produce_body(msgs, PAYLOAD), JSON, jsons),
            )
            for k in range(repeats):  # binary and JSON bodies, interleaved
                for kind, kind_body, ctype, out in kinds:
                    r = asyncio.run(
                        closed_loop(
                            url,
                            kind_body,
                            concurrency=sh["concurrency"],
                            duration_s=sat_s,
                            msgs_per_req=msgs,
                            content_type=ctype,
                        )
                    )
                    out.append(r)
                    ctx.log(
                        f"  saturation {k + 1}/{repeats}, {kind}: {r['msg_per_s']:,.0f} msg/s "
                        f"({r['req_per_s']:,.0f} req/s, {sh['concurrency']} in flight), "
                        f"p50 {r['latency_ms']['p50']:.1f} ms, "
                        f"p99 {r['latency_ms']['p99']:.1f} ms, errors {r['errors']}"
                    )
            peak_req = sorted(r["req_per_s"] for r in sats)[len(sats) // 2]
            points: list[dict[str, Any]] = []
            for f in fractions:
                rate = max(1.0, peak_req * f)
                runs = repeats if f == 0.5 else 1
                for _ in range(runs):
                    p = asyncio.run(
                        open_loop(
                            url,
                            body,
                            rate=rate,
                            duration_s=point_s,
                            msgs_per_req=msgs,
                            connections=sh["connections"],
                            content_type=BATCH_CONTENT_TYPE,
                        )
                    )
                    p["fraction"] = f
                    # A leader change during the point (e.g. a snapshot built on
                    # the event loop outlasting the election timeout) turns the
                    # rest into 307s: record it and aim the next point at the
                    # new leader.
                    now_leader = lc.wait_leader(30)
                    p["leader"], p["leader_after"] = leader, now_leader
                    if now_leader != leader:
                        res.notes.append(
                            f"{shape}: leadership moved {leader} -> {now_leader} during the "
                            f"open-loop point at {f:.2f} x saturation (errors {p['errors']})"
                        )
                        leader = now_leader
                        url = produce_url(lc.http(leader))
                    points.append(p)
                    ctx.log(
                        f"  open loop {f:.2f} x saturation = {rate * msgs:,.0f} msg/s offered: "
                        f"{p['msg_per_s']:,.0f} msg/s, p50 {p['latency_ms']['p50']:.1f} ms, "
                        f"p99 {p['latency_ms']['p99']:.1f} ms, errors {p['errors']}"
                    )
            rate = max(1.0, peak_req * 0.5)
            ctx.log(
                f"http_produce {shape}: half saturation with a snapshot and a compaction inside"
            )
            snaps = [_snapshot_point(ctx, sh, rate, point_s) for _ in range(repeats)]
            for sp in snaps:
                ctx.log(
                    f"  {sp['snapshots_in_window']} snapshots and {sp['compactions_in_window']} "
                    f"log compactions (node count) in the window: p50 "
                    f"{sp['latency_ms']['p50']:.1f} ms, p99 {sp['latency_ms']['p99']:.1f} ms, "
                    f"errors {sp['errors']}"
                )
            forced = [
                sp for sp in snaps if sp["snapshots_in_window"] and sp["compactions_in_window"]
            ]
            if len(forced) < len(snaps):
                res.notes.append(
                    f"{shape}: {len(snaps) - len(forced)} of {len(snaps)} snapshot-window "
                    "points saw no snapshot or no compaction; their p99 is left out"
                )
            if forced:
                res.figures.append(
                    Figure.of(
                        f"http_produce.{shape}.half_sat_snap_p99_ms",
                        f"HTTP produce {shape}: p99 at half saturation with a snapshot and a "
                        "log compaction in the window (open loop)",
                        "ms",
                        [sp["latency_ms"]["p99"] for sp in forced],
                        higher_is_better=False,
                        config={
                            **cfg,
                            "snapshots_in_window": [sp["snapshots_in_window"] for sp in forced],
                            "compactions_in_window": [sp["compactions_in_window"] for sp in forced],
                        },
                    )
                )
            res.raw[shape] = {
                "saturation": sats,
                "open_loop": points,
                "snapshot_window": snaps,
                "config": {**sh, **cfg},
            }
            peer = (
                peer_key(3, PAYLOAD, "pipelined")
                if shape == "batched"
                else peer_key(3, PAYLOAD, "best_sync")
            )
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.msg_per_s",
                    f"HTTP produce {shape} ({msgs} msg/request), 3 voters sync: saturation",
                    "msg/s",
                    [r["msg_per_s"] for r in sats],
                    peer_key=peer,
                    config={**cfg, "concurrency": sh["concurrency"]},
                )
            )
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.json_msg_per_s",
                    f"HTTP produce {shape} ({msgs} msg/request) with a JSON body: saturation "
                    "(the binary body's figure is the one above)",
                    "msg/s",
                    [r["msg_per_s"] for r in jsons],
                    config={**cfg, "concurrency": sh["concurrency"], "body": "JSON"},
                )
            )
            ratios = [b["msg_per_s"] / j["msg_per_s"] for b, j in zip(sats, jsons, strict=True)
                      if j["msg_per_s"]]  # fmt: skip
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.binary_over_json",
                    f"HTTP produce {shape}: binary body's saturation over JSON's, per repeat",
                    "x",
                    ratios,
                    config=cfg,
                )
            )
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.closed_p99_ms",
                    f"HTTP produce {shape}: p99 at saturation (closed loop)",
                    "ms",
                    [r["latency_ms"]["p99"] for r in sats],
                    higher_is_better=False,
                    config=cfg,
                )
            )
            half = [p for p in points if p["fraction"] == 0.5]
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.half_sat_p99_ms",
                    f"HTTP produce {shape}: p99 at half saturation (open loop)",
                    "ms",
                    [p["latency_ms"]["p99"] for p in half],
                    higher_is_better=False,
                    config={
                        **cfg,
                        "offered_msg_per_s": half[0]["offered_msg_per_s"] if half else 0,
                    },
                )
            )
            res.figures.append(
                Figure.of(
                    f"http_produce.{shape}.half_sat_p50_ms",
                    f"HTTP produce {shape}: p50 at half saturation (open loop)",
                    "ms",
                    [p["latency_ms"]["p50"] for p in half],
                    higher_is_better=False,
                    config=cfg,
                )
            )
            pts = sorted(points, key=lambda p: p["offered_msg_per_s"])
            for pct in ("p50", "p99"):
                res.series.append(
                    Series(
                        f"http_produce.{shape}.{pct}",
                        f"http_produce_{shape}_latency",
                        f"{pct} (open loop)",
                        "achieved msg/s",
                        "latency from intended send time (ms)",
                        [p["msg_per_s"] for p in pts],
                        [p["latency_ms"][pct] for p in pts],
                        log_y=True,
                    )
                )
        if ctx.profile:
            prof: dict[str, Any] = {}
            for shape, sh in SHAPES.items():
                ctx.log(f"http_produce {shape}: cProfile of the leader under closed-loop load")
                body = produce_batch(sh["msgs"], PAYLOAD)

                def load(addr: str, body: bytes = body, sh: dict[str, int] = sh) -> None:
                    asyncio.run(
                        closed_loop(
                            produce_url(addr),
                            body,
                            concurrency=sh["concurrency"],
                            duration_s=3.0 if ctx.quick else 6.0,
                            msgs_per_req=sh["msgs"],
                            content_type=BATCH_CONTENT_TYPE,
                        )
                    )

                prof[shape] = profile_leader(
                    ctx,
                    ctx.out_dir / "profiles" / f"http_produce_{shape}.prof",
                    load,
                    settings={"flush": "sync", "map_size_bytes": 4 << 30},
                )
            res.raw["profiles"] = prof
    res.notes.append(
        "The load generator (the lean HTTP/1.1 client of benchmarks.loadgen, one process) "
        "shares the machine's cores with the "
        "three nodes; the peer's driver runs inside its leader and needs no client."
    )
    return res
