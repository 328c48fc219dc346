"""Consume throughput and long-poll latency, and read-barrier latencies.

``consume``: a 3-voter cluster with one learner holds a preloaded topic;
one reader per queue reads it all by offset (pages of 1000) from the
leader, a follower and the learner. Then long-poll end-to-end latency: a
producer sends one message at a time to queue 0 while a consumer on each
replica long-polls the next offset; latency from the produce being sent,
and from its acknowledgement, to each consumer receiving it.

``reads``: sequential reads over one keep-alive connection, on the leader:
``/raft/read?consistency=committed`` (local), ``linearizable`` with the
lease (default settings), and ReadIndex. There is no switch that turns the
lease off alone (``check_quorum`` would, but it also removes leader
stickiness), so a second cluster runs with ``lease_drift_ticks =
election_ticks - 1`` (a one-tick lease) and only the reads the node
reports as ``mode = read_index`` are counted. The same committed vs lease
comparison is made on ``GET /v1/.../messages`` (one message).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from benchmarks.common import (
    QUEUES,
    TOPIC,
    cluster,
    followers,
    learner_ids,
    produce_body,
    produce_url,
    wait_caught_up,
)
from benchmarks.loadgen import closed_loop
from benchmarks.registry import BenchResult, Context, Figure, benchmark
from benchmarks.stats import summarize


async def _read_all(base: str) -> tuple[int, float]:
    """Read every queue of the topic from offset 0; (messages, seconds)."""
    async with aiohttp.ClientSession() as s:

        async def one(q: int) -> int:
            off, n = 0, 0
            while True:
                url = (
                    f"{base}/v1/topics/{TOPIC}/queues/{q}/messages"
                    f"?offset={off}&max_messages=1000&encoding=utf-8"
                )
                async with s.get(url) as r:
                    body = orjson.loads(await r.read())
                    if r.status != 200:
                        raise RuntimeError(f"read {url}: {r.status} {body}")
                got = len(body["messages"])
                n += got
                off = body["next_offset"]
                if got == 0 or off >= body["max_offset"]:
                    return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(q) for q in range(QUEUES)))
        return sum(counts), time.perf_counter() - t0


async def _long_poll(
    producer_addr: str, consumers: dict[str, str], samples: int, interval_s: float
) -> dict[str, dict[str, list[float]]]:
    """Per consumer role: latencies (ms) from send and from ack to receipt."""
    sent: dict[int, float] = {}
    acked: dict[int, float] = {}
    recv: dict[str, dict[int, float]] = {role: {} for role in consumers}
    async with aiohttp.ClientSession() as s:
        topic_url = f"http://{producer_addr}/v1/topics/{TOPIC}"
        async with s.get(topic_url) as r:
            info = orjson.loads(await r.read())
        start_off = next(q["max_offset"] for q in info["queues"] if q["queue"] == 0)
        stop = asyncio.Event()

        async def consumer(role: str, addr: str) -> None:
            off = start_off
            while not stop.is_set():
                url = (
                    f"http://{addr}/v1/topics/{TOPIC}/queues/0/messages"
                    f"?offset={off}&wait_ms=2000&max_messages=100&encoding=utf-8"
                )
                try:
                    async with s.get(url) as r:
                        raw = await r.read()
                        now = time.perf_counter()
                        if r.status != 200:
                            await asyncio.sleep(0.01)
                            continue
                except aiohttp.ClientError:
                    await asyncio.sleep(0.01)
                    continue
                body = orjson.loads(raw)
                for m in body["messages"]:
                    recv[role].setdefault(m["queue_offset"], now)
                off = body["next_offset"]

        tasks = [asyncio.create_task(consumer(r, a)) for r, a in consumers.items()]
        await asyncio.sleep(0.2)  # consumers parked in their long-poll
        body = produce_body(1, 100, queue=0)
        for _ in range(samples):
            t = time.perf_counter()
            async with s.post(
                produce_url(producer_addr), data=body, headers={"content-type": "application/json"}
            ) as r:
                res = orjson.loads(await r.read())
            ta = time.perf_counter()
            off = res["messages"][0]["queue_offset"]
            sent[off], acked[off] = t, ta
            await asyncio.sleep(interval_s)
        await asyncio.sleep(0.5)
        stop.set()
        for t_ in tasks:
            t_.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out: dict[str, dict[str, list[float]]] = {}
    for role in consumers:
        got = recv[role]
        out[role] = {
            "from_send_ms": [(got[o] - sent[o]) * 1000 for o in sent if o in got],
            "from_ack_ms": [(got[o] - acked[o]) * 1000 for o in sent if o in got],
            "missing": [float(o) for o in sent if o not in got],
        }
    return out


@benchmark("consume", "consume by offset from leader, follower, learner; long-poll latency")
def run_consume(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = ctx.repeats()
    preload = 20_000 if ctx.quick else 200_000
    with cluster(ctx, voters=3, learners=1, settings={"map_size_bytes": 2 << 30}) as (lc, leader):
        url = produce_url(lc.http(leader))
        ctx.log(f"consume: preloading {preload:,} messages of 100 B")
        asyncio.run(
            closed_loop(
                url,
                produce_body(100, 100),
                concurrency=8,
                duration_s=600,
                msgs_per_req=100,
                total_requests=preload // 100,
            )
        )
        wait_caught_up(lc, 120)
        roles = {
            "leader": leader,
            "follower": followers(lc, leader)[0],
            "learner": learner_ids(lc)[0],
        }
        for role, nid in roles.items():
            rates = []
            for _ in range(repeats):
                n, secs = asyncio.run(_read_all(f"http://{lc.http(nid)}"))
                if n != preload:
                    res.notes.append(f"consume from {role}: read {n} of {preload} messages")
                rates.append(n / secs)
            ctx.log(f"  read by offset from the {role}: {rates[len(rates) // 2]:,.0f} msg/s")
            res.figures.append(
                Figure.of(
                    f"consume.{role}.msg_per_s",
                    f"consume by offset from the {role} (4 queues, pages of 1000)",
                    "msg/s",
                    rates,
                    config={"messages": preload, "payload_bytes": 100, "node": nid},
                )
            )
        samples = 100 if ctx.quick else 300
        ctx.log(f"consume: long-poll end-to-end latency, {samples} messages")
        consumers = {role: lc.http(nid) for role, nid in roles.items()}
        lp = asyncio.run(_long_poll(lc.http(leader), consumers, samples, 0.01))
        res.raw["long_poll"] = {r: {k: summarize(v) for k, v in d.items()} for r, d in lp.items()}
        for role, d in lp.items():
            for what in ("from_send_ms", "from_ack_ms"):
                st = summarize(d[what])
                res.figures.append(
                    Figure.of(
                        f"consume.long_poll.{role}.{what}.p50",
                        f"long-poll on the {role}: p50 {what.replace('_ms', '').replace('_', ' ')}"
                        " to receipt",
                        "ms",
                        [st["p50"]],
                        higher_is_better=False,
                        config={"samples": st["n"], "p99": st["p99"]},
                    )
                )
            ctx.log(
                f"  long-poll {role}: from ack p50 {summarize(d['from_ack_ms'])['p50']:.2f} ms, "
                f"from send p50 {summarize(d['from_send_ms'])['p50']:.2f} ms, "
                f"missing {len(d['missing'])}"
            )
    return res


async def _sequential_reads(
    urls: dict[str, tuple[str, str | None]], n: int, gap_s: float = 0.0
) -> dict[str, dict[str, Any]]:
    """``n`` rounds over one keep-alive connection; each round reads every
    URL once, in turn, so the kinds share the same moments of machine noise.
    ``urls``: name -> (url, mode the node must report, None for data reads);
    a read reported with another mode is counted but not timed."""
    lat: dict[str, list[float]] = {k: [] for k in urls}
    modes: dict[str, dict[str, int]] = {k: {} for k in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for url, _ in urls.values():  # warm the connection and the route
            for _ in range(10):
                async with s.get(url) as r:
                    await r.read()
        for _ in range(n):
            for name, (url, want_mode) in urls.items():
                if gap_s:
                    await asyncio.sleep(gap_s)
                t = time.perf_counter()
                async with s.get(url) as r:
                    raw = await r.read()
                dt = (time.perf_counter() - t) * 1000
                m = modes[name]
                if r.status != 200:
                    m[f"status_{r.status}"] = m.get(f"status_{r.status}", 0) + 1
                    continue
                mode = "data" if want_mode is None else str(orjson.loads(raw).get("mode"))
                m[mode] = m.get(mode, 0) + 1
                if want_mode is None or mode == want_mode:
                    lat[name].append(dt)
    return {k: {"latency_ms": summarize(lat[k]), "modes": modes[k]} for k in urls}


@benchmark("reads", "p50/p99 of committed, lease-linearizable and ReadIndex reads on the leader")
def run_reads(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = ctx.repeats()
    n = 300 if ctx.quick else 1500
    v1 = f"/v1/topics/{TOPIC}/queues/0/messages?offset=0&max_messages=1&consistency="
    plans: list[tuple[dict[str, object], dict[str, tuple[str, str | None]], int, float]] = [
        (
            {},  # default settings: the lease holds on a healthy leader
            {
                "committed": ("/raft/read?consistency=committed", "local"),
                "lease": ("/raft/read?consistency=linearizable", "lease"),
                "v1_committed": (v1 + "committed", None),
                "v1_lease": (v1 + "linearizable", None),
            },
            n,
            0.0,
        ),
        (
            # election_ticks 15: a one-tick lease. A ReadIndex round refreshes
            # the lease for the rest of its 20 ms tick, so reads are spaced by
            # more than a tick and only those served by ReadIndex are timed.
            {"lease_drift_ticks": 14},
            {"read_index": ("/raft/read?consistency=linearizable", "read_index")},
            max(50, n // 6),
            0.025,
        ),
    ]
    for settings, kinds, rounds, gap in plans:
        with cluster(ctx, voters=3, settings=settings) as (lc, leader):
            addr = lc.http(leader)
            asyncio.run(
                closed_loop(
                    produce_url(addr),
                    produce_body(10, 100, queue=0),
                    concurrency=1,
                    duration_s=30,
                    msgs_per_req=10,
                    total_requests=2,
                )
            )
            urls = {k: (f"http://{addr}{path}", mode) for k, (path, mode) in kinds.items()}
            runs = [asyncio.run(_sequential_reads(urls, rounds, gap)) for _ in range(repeats)]
        for name, (path, _) in kinds.items():
            mine = [r[name] for r in runs]
            res.raw[name] = mine
            for pct in ("p50", "p99"):
                res.figures.append(
                    Figure.of(
                        f"reads.{name}.{pct}_ms",
                        f"read {name.replace('_', ' ')} on the leader: {pct}",
                        "ms",
                        [r["latency_ms"][pct] for r in mine],
                        higher_is_better=False,
                        config={
                            "path": path,
                            "settings": settings,
                            "rounds_per_repeat": rounds,
                            "gap_s": gap,
                            "modes": mine[0]["modes"],
                        },
                    )
                )
            ctx.log(
                f"  reads {name}: p50 {mine[0]['latency_ms']['p50']:.3f} ms, "
                f"p99 {mine[0]['latency_ms']['p99']:.3f} ms, modes {mine[0]['modes']}"
            )
    res.notes.append(
        "Sequential reads over one keep-alive connection, the kinds interleaved round by "
        "round. ReadIndex is forced with lease_drift_ticks = election_ticks - 1 (a one-tick "
        "lease; no config switch disables the lease alone: check_quorum would, but it also "
        "removes leader stickiness) and only reads reported as mode=read_index are timed; "
        "they are spaced 25 ms apart (a ReadIndex round refreshes the lease for the rest of "
        "its 20 ms tick)."
    )
    return res
