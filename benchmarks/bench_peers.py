"""Our 3-voter cluster against etcd (``vs_etcd``) and NATS JetStream (``vs_nats``).

One cluster runs at a time, in interleaved rounds (ours, peer, ours, peer,
...; 3 rounds, 1 with ``--quick``), each on a fresh cluster with its data
under the run's scratch directory. Ours is 3 voters with ``flush = "sync"``
against etcd (which fsyncs its WAL before acknowledging) and
``flush = "async"`` against JetStream (which acknowledges before fsync).

In every round, for each system, with 100-byte messages:

* idle: % of one core used by each server process over ``idle_s`` without load;
* ``batched``: 100 messages per request, 8 requests in flight (closed loop);
* ``single32``: one message per request, 32 clients (closed loop);
* ``single1``: one message per request, 1 client: throughput, p50/p99, and the
  server CPU per message (utime+stime of the 3 server processes over the
  workload, divided by the messages acknowledged).

Ours and etcd are driven by the same generator,
:func:`benchmarks.loadgen.closed_loop` (its lean HTTP/1.1 client, keep-alive,
in this process); JetStream by :func:`benchmarks.peer_nats.closed_loop` (nats-py,
same process and loop shape). The 1-minute load average is recorded at the
start and end of every round.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import peer_etcd, peer_nats, peer_procs
from benchmarks.common import cluster, produce_batch, produce_url
from benchmarks.loadgen import closed_loop
from benchmarks.registry import BenchResult, Context, Figure, Skipped, benchmark
from broker_adapter.codec import BATCH_CONTENT_TYPE

PAYLOAD = 100
# name -> (messages per request, requests in flight)
SHAPES: dict[str, tuple[int, int]] = {"batched": (100, 8), "single32": (1, 32), "single1": (1, 1)}

Drive = Callable[[str, float], dict[str, Any]]  # (shape, seconds) -> loadgen result
System = Callable[[], contextlib.AbstractContextManager[tuple[list[int], Drive]]]


def _durations(ctx: Context) -> dict[str, float]:
    if ctx.quick:
        return {"rounds": 1, "load_s": 2.0, "warm_s": 1.0, "idle_s": 5.0, "settle_s": 2.0}
    return {"rounds": 3, "load_s": 5.0, "warm_s": 1.0, "idle_s": 10.0, "settle_s": 2.0}


def _ours(ctx: Context, flush: str) -> System:
    @contextlib.contextmanager
    def start() -> Iterator[tuple[list[int], Drive]]:
        settings: dict[str, object] = {"flush": flush, "map_size_bytes": 4 << 30}
        with cluster(ctx, voters=3, settings=settings) as (lc, _leader):
            # the binary produce body: what the Python client sends
            bodies = {s: produce_batch(m, PAYLOAD) for s, (m, _) in SHAPES.items()}

            def drive(shape: str, secs: float) -> dict[str, Any]:
                msgs, conc = SHAPES[shape]
                url = produce_url(lc.http(lc.wait_leader(30)))
                return asyncio.run(
                    closed_loop(
                        url,
                        bodies[shape],
                        concurrency=conc,
                        duration_s=secs,
                        msgs_per_req=msgs,
                        content_type=BATCH_CONTENT_TYPE,
                    )
                )

            yield [p for p in (lc.pid(i) for i in lc.ids()) if p is not None], drive

    return start


def _etcd(ctx: Context, k: list[int]) -> System:
    @contextlib.contextmanager
    def start() -> Iterator[tuple[list[int], Drive]]:
        k[0] += 1
        with peer_etcd.etcd_cluster(ctx.work_dir / f"etcd{k[0]}") as (ec, leader):
            req = {
                "batched": (leader + "/v3/kv/txn", peer_etcd.txn_body(100, PAYLOAD)),
                "single32": (leader + "/v3/kv/put", peer_etcd.put_body(PAYLOAD)),
                "single1": (leader + "/v3/kv/put", peer_etcd.put_body(PAYLOAD)),
            }

            def drive(shape: str, secs: float) -> dict[str, Any]:
                msgs, conc = SHAPES[shape]
                url, body = req[shape]
                return asyncio.run(
                    closed_loop(url, body, concurrency=conc, duration_s=secs, msgs_per_req=msgs)
                )

            yield ec.pids, drive

    return start


def _nats(ctx: Context, k: list[int]) -> System:
    @contextlib.contextmanager
    def start() -> Iterator[tuple[list[int], Drive]]:
        k[0] += 1
        with peer_nats.nats_cluster(ctx.work_dir / f"nats{k[0]}") as (nc, leader):
            payload = peer_etcd.value_of(PAYLOAD)

            def drive(shape: str, secs: float) -> dict[str, Any]:
                msgs, conc = SHAPES[shape]
                return asyncio.run(
                    peer_nats.closed_loop(
                        leader, payload, concurrency=conc, duration_s=secs, msgs_per_req=msgs
                    )
                )

            yield nc.pids, drive

    return start


def _round(ctx: Context, who: str, system: System, d: dict[str, float]) -> dict[str, Any]:
    rec: dict[str, Any] = {"who": who, "loadavg_start": list(os.getloadavg())}
    with system() as (pids, drive):
        time.sleep(d["settle_s"])
        c0 = {p: peer_procs.cpu_seconds([p]) for p in pids}
        t0 = time.monotonic()
        time.sleep(d["idle_s"])
        wall = time.monotonic() - t0
        idle = [100.0 * (peer_procs.cpu_seconds([p]) - c0[p]) / wall for p in pids]
        rec["idle_cpu_pct"] = idle
        drive("batched", d["warm_s"])  # warm-up, not recorded
        for shape in SHAPES:
            cpu0 = peer_procs.cpu_seconds(pids)
            r = drive(shape, d["load_s"])
            cpu = peer_procs.cpu_seconds(pids) - cpu0
            msgs = r["requests_ok"] * SHAPES[shape][0]
            r["server_cpu_s"] = cpu
            r["cpu_us_per_msg"] = cpu * 1e6 / msgs if msgs else float("nan")
            rec[shape] = r
            ctx.log(
                f"  {who} {shape}: {r['msg_per_s']:,.0f} msg/s, p50 "
                f"{r['latency_ms']['p50']:.2f} ms, p99 {r['latency_ms']['p99']:.2f} ms, "
                f"server CPU {r['cpu_us_per_msg']:.0f} us/msg, errors {r['errors']}"
            )
        ctx.log(f"  {who} idle CPU per node: {', '.join(f'{x:.2f}%' for x in idle)}")
    rec["loadavg_end"] = list(os.getloadavg())
    return rec


def _figures(
    name: str,
    who: str,
    peer: str | None,
    label: str,
    rounds: list[dict[str, Any]],
    cfg: dict[str, Any],
) -> list[Figure]:
    mine = [r for r in rounds if r["who"] == who]

    def pk(suffix: str) -> str | None:
        return f"{name}.{peer}.{suffix}" if peer else None

    figs = []
    for shape, text in (
        ("batched", "batched (100 msg/request, 8 in flight)"),
        ("single32", "one message per request, 32 clients"),
        ("single1", "one message per request, 1 client"),
    ):
        figs.append(
            Figure.of(
                f"{name}.{who}.{shape}.msg_per_s",
                f"{label}: {text}",
                "msg/s",
                [r[shape]["msg_per_s"] for r in mine],
                peer_key=pk(f"{shape}.msg_per_s"),
                config={**cfg, "msgs_per_request": SHAPES[shape][0], "in_flight": SHAPES[shape][1]},
            )
        )
    for pct in ("p50", "p99"):
        figs.append(
            Figure.of(
                f"{name}.{who}.single1.{pct}_ms",
                f"{label}: one message per request, 1 client, {pct} latency",
                "ms",
                [r["single1"]["latency_ms"][pct] for r in mine],
                higher_is_better=False,
                peer_key=pk(f"single1.{pct}_ms"),
                config=cfg,
            )
        )
    figs.append(
        Figure.of(
            f"{name}.{who}.single1.cpu_us_per_msg",
            f"{label}: server CPU per message (3 servers, 1 client)",
            "us/msg",
            [r["single1"]["cpu_us_per_msg"] for r in mine],
            higher_is_better=False,
            peer_key=pk("single1.cpu_us_per_msg"),
            config=cfg,
        )
    )
    figs.append(
        Figure.of(
            f"{name}.{who}.idle_cpu_pct",
            f"{label}: idle CPU, busiest of the 3 server processes",
            "% core",
            [max(r["idle_cpu_pct"]) for r in mine],
            higher_is_better=False,
            peer_key=pk("idle_cpu_pct"),
            config=cfg,
        )
    )
    return figs


def _compare(
    ctx: Context,
    name: str,
    flush: str,
    peer: str,
    peer_label: str,
    peer_system: System,
    peer_cfg: dict[str, Any],
) -> BenchResult:
    d = _durations(ctx)
    ours = _ours(ctx, flush)
    rounds: list[dict[str, Any]] = []
    for i in range(int(d["rounds"])):
        # Who goes first alternates from round to round: this machine's
        # speed drifts over minutes (its speed index has halved within one
        # run), and a fixed order hands the drift to one side every round.
        pair = [("ours", ours), (peer, peer_system)]
        for who, system in pair if i % 2 == 0 else pair[::-1]:
            ctx.log(f"{name} round {i + 1}/{int(d['rounds'])}: {who}")
            rec = _round(ctx, who, system, d)
            rec["round"] = i + 1
            rounds.append(rec)
    our_cfg = {"voters": 3, "flush": flush, "payload_bytes": PAYLOAD}
    res = BenchResult()
    res.figures += _figures(name, "ours", peer, f"ours, 3 voters flush={flush}", rounds, our_cfg)
    res.figures += _figures(
        name, peer, None, peer_label, rounds, {**peer_cfg, "payload_bytes": 100}
    )
    res.raw = {"rounds": rounds, "durations": d, "shapes": SHAPES, "peer": peer_cfg}
    return res


@benchmark(
    "vs_etcd",
    "ours (3 voters, flush=sync) vs etcd 3-member cluster: batched, 32 and 1 client, CPU, idle",
)
def run_vs_etcd(ctx: Context) -> BenchResult:
    binary = peer_etcd.etcd_binary()
    if binary is None:
        raise Skipped(peer_etcd.INSTALL_HINT)
    cfg = {
        "members": 3,
        "version": peer_etcd.etcd_version(binary),
        "durability": peer_etcd.DURABILITY,
    }
    res = _compare(ctx, "vs_etcd", "sync", "etcd", "etcd", _etcd(ctx, [0]), cfg)
    res.notes += [
        f"etcd {cfg['version']}, 3 members, default settings: {peer_etcd.DURABILITY}; ours "
        'flush = "sync" (fsync per group commit before acknowledging).',
        "etcd is driven through its JSON gateway with the same generator as ours (the lean "
        "HTTP/1.1 client of benchmarks.loadgen, about 45 us of CPU per request; aiohttp's "
        "client, used before 2026-11-28, cost 4x that and held etcd back more than ours), "
        "at its leader: one message = POST /v3/kv/put (one key rewritten, a new revision "
        "each time), a batch of 100 = POST /v3/kv/txn with 100 puts in `success` (one Raft "
        "entry). Ours gets the binary produce body (application/vnd.dledger.batch, what the "
        "Python client sends; http_produce measures it against JSON).",
        "Clusters run one at a time, rounds interleaved (who goes first alternates from "
        "round to round); the load generator shares the two cores with the servers.",
    ]
    return res


@benchmark(
    "vs_nats",
    "ours (3 voters, flush=async) vs NATS JetStream R3 file stream: batched, 32 and 1 client",
)
def run_vs_nats(ctx: Context) -> BenchResult:
    binary = peer_nats.nats_binary()
    why = peer_nats.missing()
    if binary is None or why:
        raise Skipped(why or peer_nats.INSTALL_HINT)
    cfg = {
        "servers": 3,
        "stream": "R3, file storage",
        "version": peer_nats.nats_version(binary),
        "durability": peer_nats.DURABILITY,
        "sync_interval_s": peer_nats.SYNC_INTERVAL_S,
    }
    res = _compare(ctx, "vs_nats", "async", "nats", "NATS JetStream", _nats(ctx, [0]), cfg)
    res.notes += [
        f"nats-server {cfg['version']}, 3 servers, one R3 file-backed stream. Durability: "
        f'{peer_nats.DURABILITY}. Ours: 3 voters, flush = "async" (fsync every '
        "flush_interval_ms, 200 ms by default).",
        "JetStream is driven with nats-py (one connection, 1/32/8 tasks awaiting each "
        "publish's acknowledgement); it has no batch publish in 2.9, so a batch of 100 is "
        "100 publish_async calls sent together and done when all 100 are acknowledged.",
    ]
    return res
