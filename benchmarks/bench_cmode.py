"""Controller mode beside Raft (issue #16): produce throughput and latency of
one 3-replica broker group replicated by Raft or as RocketMQ 5's
controller mode does, with sync and async flush, in the same run.

Each configuration is a fresh layout of one broker group (3 nodes) and the
3-node controller group (as ``dledger cluster up --groups 1`` makes it);
the topic is created through the controller and the load goes straight to
the group's writer (the Raft leader or the controller-mode master) with
:func:`benchmarks.loadgen.closed_loop`, 100-byte messages:

* ``batched``: 100 messages per request, 8 requests in flight;
* ``single``: one message per request, 32 clients.

Throughput and p50/p99 request latency per shape; configurations run one
at a time in interleaved rounds (raft-sync, cmode-sync, raft-async,
cmode-async, then again), so a noisy stretch of the machine hits all of
them. Controller mode uses the CP settings (every member of the
SyncStateSet acknowledges, at least 2 of 3); AP would confirm on fewer
acknowledgements only once the set has shrunk, which a healthy group does
not do.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.common import produce_body, produce_url
from benchmarks.loadgen import closed_loop
from benchmarks.registry import BenchResult, Context, Figure, benchmark
from dledger_app.groups import MultiCluster
from dledger_app.multi_cli import wait_groups_live
from http_api.client import ApiError
from http_api.routing import RoutingClient
from jepsen_like.groups import cmode_settings

TOPIC = "bench"
QUEUES = 4
PAYLOAD = 100
SHAPES: dict[str, tuple[int, int]] = {"batched": (100, 8), "single": (1, 32)}
CONFIGS: dict[str, dict[str, object]] = {
    "raft-sync": {"flush": "sync"},
    "cmode-sync": {"flush": "sync", **cmode_settings("cp", 3)},
    "raft-async": {"flush": "async"},
    "cmode-async": {"flush": "async", **cmode_settings("cp", 3)},
}


def _writer(mc: MultiCluster, timeout_s: float) -> str:
    lc = mc.group("g1")
    return lc.http(lc.wait_leader(timeout_s))


def _ready(mc: MultiCluster, timeout_s: float) -> None:
    """The topic exists through the controller and the group takes a write."""
    rc = RoutingClient(mc.endpoints(), timeout_s=5.0)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rc.create_topic(TOPIC, QUEUES)
            break
        except ApiError as exc:
            if exc.code == "TOPIC_EXISTS":
                break
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    body = produce_body(1, PAYLOAD)
    while True:
        r = asyncio.run(
            closed_loop(
                produce_url(_writer(mc, 60)), body, concurrency=1, duration_s=0.3, msgs_per_req=1
            )
        )
        if r["requests_ok"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group took no write in {timeout_s:.0f} s: {r['errors']}")
        time.sleep(0.3)


def _one(ctx: Context, name: str, k: int, load_s: float) -> dict[str, Any]:
    mc = MultiCluster.create(
        ctx.work_dir / f"cmode-{name}-{k}", groups=1, nodes=3, settings=CONFIGS[name]
    )
    try:
        for lc in mc.all().values():
            lc.start_all()
        mc.controller().wait_leader(90)
        wait_groups_live(mc, 90)
        _ready(mc, 60)
        url = produce_url(_writer(mc, 30))
        out: dict[str, Any] = {}
        asyncio.run(
            closed_loop(url, produce_body(100, PAYLOAD), concurrency=8, duration_s=1.0,
                        msgs_per_req=100)
        )  # fmt: skip
        for shape, (msgs, conc) in SHAPES.items():
            r = asyncio.run(
                closed_loop(url, produce_body(msgs, PAYLOAD), concurrency=conc,
                            duration_s=load_s, msgs_per_req=msgs)
            )  # fmt: skip
            out[shape] = r
            ctx.log(
                f"  {name} {shape}: {r['msg_per_s']:,.0f} msg/s, p50 {r['latency_ms']['p50']:.1f} "
                f"ms, p99 {r['latency_ms']['p99']:.1f} ms, errors {r['errors']}"
            )
        return out
    finally:
        mc.down()


@benchmark("cmode", "Controller mode beside Raft: produce throughput and latency, sync and async")
def run_cmode(ctx: Context) -> BenchResult:
    res = BenchResult()
    rounds = ctx.repeats(3, 1)
    load_s = 2.0 if ctx.quick else 5.0
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in CONFIGS}
    for k in range(rounds):
        ctx.log(f"cmode: round {k + 1}/{rounds}")
        for name in CONFIGS:
            runs[name].append(_one(ctx, name, k, load_s))
    for name, rs in runs.items():
        conf = {"group": "3 replicas + 3-node controller group", **CONFIGS[name]}
        for shape in SHAPES:
            peer = None
            if name.startswith("cmode"):
                peer = f"cmode.raft-{name.split('-')[1]}.{shape}.msg_per_s"
            res.figures += [
                Figure.of(f"cmode.{name}.{shape}.msg_per_s", f"{name} {shape}: throughput",
                          "msg/s", [r[shape]["msg_per_s"] for r in rs], peer_key=peer,
                          config={**conf, "shape": shape}),
                Figure.of(f"cmode.{name}.{shape}.p50_ms", f"{name} {shape}: p50 latency", "ms",
                          [r[shape]["latency_ms"]["p50"] for r in rs], higher_is_better=False,
                          config={**conf, "shape": shape}),
                Figure.of(f"cmode.{name}.{shape}.p99_ms", f"{name} {shape}: p99 latency", "ms",
                          [r[shape]["latency_ms"]["p99"] for r in rs], higher_is_better=False,
                          config={**conf, "shape": shape}),
            ]  # fmt: skip
    res.raw = {"runs": runs, "shapes": SHAPES, "configs": CONFIGS}
    res.notes.append(
        "Controller mode (CP settings) is compared with Raft at the same flush: its throughput "
        "figures name the Raft figure as their peer. Both replicate to the same 3 replicas; a "
        "controller-mode master waits for every member of its SyncStateSet, a Raft leader for "
        "a majority."
    )
    return res
