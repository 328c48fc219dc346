"""The node's runtime environment: production defaults, and the loop's
stall handling that a simulated clock makes testable."""

from __future__ import annotations

import dataclasses
import time

from dledger.config import NodeConfig
from dledger.node import FAULT_LEASE_STALE_CLOCK, Node
from dledger.runtime import NodeEnv, open_lmdb_storage, to_thread


def _cfg(tmp: str = "/tmp/unused") -> NodeConfig:
    return NodeConfig(
        node_id=1,
        cluster_id="t",
        raft_host="127.0.0.1",
        raft_port=7001,
        http_host="127.0.0.1",
        http_port=8001,
        data_dir=tmp,
        tick_ms=10,
        election_ticks=10,
        heartbeat_ticks=1,
        lease_drift_ticks=2,
    )


class _Core:
    def __init__(self) -> None:
        self.ticks = 0
        self.suspended = 0

    def tick(self) -> None:
        self.ticks += 1

    def suspend_lease(self) -> None:
        self.suspended += 1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_default_env_is_production() -> None:
    env = Node(_cfg()).env
    assert env.clock is time.monotonic
    assert env.offload is to_thread
    assert env.open_storage is open_lmdb_storage
    env.work("step", 1)  # a no-op


def _node(faults: frozenset[str] = frozenset()) -> tuple[Node, _Clock]:
    clock = _Clock()
    node = Node(dataclasses.replace(_cfg(), faults=faults), env=NodeEnv(clock=clock))
    node._t0 = node._last_catch_up_s = clock.now
    return node, clock


def test_a_stall_beyond_the_lease_margin_suspends_the_lease() -> None:
    node, clock = _node()
    core = _Core()
    clock.now += 0.010  # one tick: on time
    node._catch_up_ticks(core)  # type: ignore[arg-type]
    assert (core.ticks, core.suspended) == (1, 0)
    clock.now += 0.010 + 0.005  # late, but within the margin (RaftConfig.lease_margin_ticks)
    node._catch_up_ticks(core)  # type: ignore[arg-type]
    assert core.suspended == 0
    clock.now += 0.050  # stalled: the lease may outlive the followers' timers
    node._catch_up_ticks(core)  # type: ignore[arg-type]
    assert core.suspended == 1
    assert node.counters["lease_suspended"] == 1


def test_planted_lease_stale_clock_skips_the_suspension() -> None:
    node, clock = _node(frozenset({FAULT_LEASE_STALE_CLOCK}))
    core = _Core()
    clock.now += 0.5
    node._catch_up_ticks(core)  # type: ignore[arg-type]
    assert core.suspended == 0
    assert core.ticks == 40  # capped at 4 election timeouts


def test_loop_lag_is_observed_per_pass() -> None:
    node, clock = _node()
    start = clock.now
    clock.now += 0.030
    node._end_pass(start - 0.005, start - 0.010)
    assert node.loop_lag_seconds.count == 1
    assert abs(node.loop_lag_seconds.sum - 0.040) < 1e-9
    assert node.status()["id"] == 1
