"""Cost growth: throughput, per-node RSS and disk bytes per message as the
stored log grows, and throughput by topology.

Growth: one 3-voter ``sync`` cluster is filled with batched produce (100 x
100 B per request) up to checkpoints (quick: 25k and 100k messages; full:
100k, 250k, 500k, 1M; ``--big`` adds 2M, 5M and 10M). At each checkpoint:
the produce rate over the last segment, every node's RSS, and bytes
allocated on disk under each node's data directory divided by the messages
stored.

Topology: saturation throughput of batched produce with 3 and 5 voters,
and 3 voters with 1 and 2 learners.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.bench_core import peer_key
from benchmarks.common import (
    cluster,
    disk_bytes,
    produce_body,
    produce_url,
    rss_anon_bytes,
    rss_bytes,
    wait_caught_up,
)
from benchmarks.loadgen import closed_loop
from benchmarks.registry import BenchResult, Context, Figure, Series, benchmark

MB = 1 << 20


@benchmark("cost_growth", "throughput, RSS and disk bytes/message as the log grows; topologies")
def run_cost_growth(ctx: Context) -> BenchResult:
    res = BenchResult()
    if ctx.quick:
        checkpoints = [25_000, 100_000]
    else:
        checkpoints = [100_000, 250_000, 500_000, 1_000_000]
    if ctx.big:
        checkpoints += [2_000_000, 5_000_000, 10_000_000]
    body = produce_body(100, 100)
    map_size = (24 << 30) if ctx.big else (4 << 30)
    rows = []
    with cluster(ctx, voters=3, settings={"map_size_bytes": map_size}) as (lc, leader):
        stored = 0
        for cp in checkpoints:
            t0 = time.perf_counter()
            ok = 0
            errors: dict[str, int] = {}
            p99s: list[float] = []
            # In pieces of at most 1000 requests (100k messages), each aimed at
            # the leader of the moment: after a leader change the old one
            # answers 307 (not followed here), and a single closed loop of
            # millions of messages would spin on those until its deadline.
            while stored + ok * 100 < cp and time.perf_counter() - t0 < 1800:
                leader = lc.wait_leader(timeout_s=30)
                piece = asyncio.run(
                    closed_loop(
                        produce_url(lc.http(leader)),
                        body,
                        concurrency=8,
                        duration_s=120,
                        msgs_per_req=100,
                        total_requests=min(1000, (cp - stored) // 100 - ok),
                    )
                )
                ok += piece["requests_ok"]
                p99s.append(piece["latency_ms"]["p99"])
                for k, v in piece["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            secs = time.perf_counter() - t0
            stored += ok * 100
            wait_caught_up(lc, 300)
            rss = {nid: rss_bytes(lc.pid(nid)) for nid in lc.ids()}
            anon = {nid: rss_anon_bytes(lc.pid(nid)) for nid in lc.ids()}
            disk = {nid: disk_bytes(lc.data_dir(nid)) for nid in lc.ids()}
            row: dict[str, Any] = {
                "messages": stored,
                "segment_msg_per_s": ok * 100 / secs,
                "segment_p99_ms": max(p99s, default=0.0),
                "rss_mb": {str(k): v / MB for k, v in rss.items()},
                "rss_anon_mb": {str(k): v / MB for k, v in anon.items()},
                "disk_bytes_per_msg": {str(k): v / max(stored, 1) for k, v in disk.items()},
                "errors": errors,
            }
            rows.append(row)
            ctx.log(
                f"cost_growth: {stored:,} messages: {row['segment_msg_per_s']:,.0f} msg/s, "
                f"RSS max {max(rss.values()) / MB:,.0f} MB "
                f"(anonymous {max(anon.values()) / MB:,.0f} MB), "
                f"disk {max(disk.values()) / max(stored, 1):,.0f} B/msg"
            )
    res.raw["growth"] = rows
    xs = [float(r["messages"]) for r in rows]
    res.series += [
        Series(
            "cost_growth.rss",
            "cost_growth_rss",
            "max node RSS",
            "stored messages",
            "MB",
            xs,
            [max(r["rss_mb"].values()) for r in rows],
        ),
        Series(
            "cost_growth.rss_anon",
            "cost_growth_rss_anon",
            "max node anonymous RSS (heap; excludes mapped LMDB pages)",
            "stored messages",
            "MB",
            xs,
            [max(r["rss_anon_mb"].values()) for r in rows],
        ),
        Series(
            "cost_growth.disk",
            "cost_growth_disk",
            "max disk bytes per message",
            "stored messages",
            "bytes/message",
            xs,
            [max(r["disk_bytes_per_msg"].values()) for r in rows],
        ),
        Series(
            "cost_growth.rate",
            "cost_growth_rate",
            "produce msg/s over the segment",
            "stored messages",
            "msg/s",
            xs,
            [r["segment_msg_per_s"] for r in rows],
        ),
    ]
    for r in rows:
        m = r["messages"]
        res.figures += [
            Figure.of(
                f"cost_growth.{m}.rss_mb",
                f"max node RSS at {m:,} stored messages",
                "MB",
                [max(r["rss_mb"].values())],
                higher_is_better=False,
                config={"per_node": r["rss_mb"]},
            ),
            Figure.of(
                f"cost_growth.{m}.rss_anon_mb",
                f"max node anonymous RSS at {m:,} stored messages",
                "MB",
                [max(r["rss_anon_mb"].values())],
                higher_is_better=False,
                config={"per_node": r["rss_anon_mb"]},
            ),
            Figure.of(
                f"cost_growth.{m}.disk_bytes_per_msg",
                f"disk bytes per message at {m:,} stored messages (max node)",
                "B/msg",
                [max(r["disk_bytes_per_msg"].values())],
                higher_is_better=False,
                config={"per_node": r["disk_bytes_per_msg"]},
            ),
            Figure.of(
                f"cost_growth.{m}.msg_per_s",
                f"produce rate while growing to {m:,} messages",
                "msg/s",
                [r["segment_msg_per_s"]],
                config={"p99_ms": r["segment_p99_ms"]},
            ),
        ]

    repeats = ctx.repeats()
    sat_s = 2.0 if ctx.quick else 3.0
    for voters, learners in ((3, 0), (5, 0), (3, 1), (3, 2)):
        with cluster(
            ctx, voters=voters, learners=learners, settings={"map_size_bytes": 2 << 30}
        ) as (
            lc,
            leader,
        ):
            url = produce_url(lc.http(leader))
            asyncio.run(closed_loop(url, body, concurrency=8, duration_s=1.0, msgs_per_req=100))
            runs = [
                asyncio.run(
                    closed_loop(url, body, concurrency=8, duration_s=sat_s, msgs_per_req=100)
                )
                for _ in range(repeats)
            ]
        rates = [r["msg_per_s"] for r in runs]
        ctx.log(
            f"cost_growth: {voters} voters + {learners} learners: "
            f"{sorted(rates)[len(rates) // 2]:,.0f} msg/s"
        )
        res.figures.append(
            Figure.of(
                f"cost_growth.topology.{voters}v{learners}l.msg_per_s",
                f"batched HTTP produce, {voters} voters + {learners} learners",
                "msg/s",
                rates,
                peer_key=peer_key(voters, 100, "pipelined") if learners == 0 else None,
                config={"voters": voters, "learners": learners, "msgs_per_request": 100},
            )
        )
    return res
