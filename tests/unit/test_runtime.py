"""The node's runtime environment: production defaults, and the loop's
stall handling that a simulated clock makes testable."""

from __future__ import annotations

import dataclasses
import time

from dledger.config import NodeConfig
from dledger.core.raft import RawNode
from dledger.core.types import Role
from dledger.node import FAULT_LEASE_STALE_CLOCK, Node
from dledger.runtime import NodeEnv, open_lmdb_storage, to_thread
from tests.unit.raft_harness import E, Network


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


class _LeaseCore:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def lease_read_index(self, behind: int = 0) -> int | None:
        self.asked.append(behind)
        return 7


def test_a_direct_lease_read_counts_the_ticks_not_yet_delivered() -> None:
    """Node._lease_read_now asks the core about the clock as it is now: the
    ticks due since the loop last ticked are counted, not ignored."""
    node, clock = _node()
    core = _LeaseCore()
    node._ticks = 4  # delivered up to tick 4 (t0 + 40 ms)
    node._last_catch_up_s = clock.now + 0.040
    clock.now += 0.058  # tick 5 is due now, the next pass is 8 ms late: within the margin
    assert node._lease_read_now(core) == 7  # type: ignore[arg-type]
    assert core.asked == [1]


def test_no_direct_lease_read_after_a_stall_the_loop_has_not_seen() -> None:
    """A pause beyond the lease's safety margin (SIGSTOP, a blocked pass):
    the loop's next pass must suspend the lease first, so the read waits
    for it instead of trusting a lease counted from before the pause."""
    node, clock = _node()
    core = _LeaseCore()
    clock.now += 0.010 + 0.005  # late, within the margin
    assert node._lease_read_now(core) == 7  # type: ignore[arg-type]
    clock.now += 0.050
    assert node._lease_read_now(core) is None  # type: ignore[arg-type]
    assert len(core.asked) == 1
    planted, _ = _node(frozenset({FAULT_LEASE_STALE_CLOCK}))
    assert planted._lease_read_now(core) is None  # type: ignore[arg-type]


def test_loop_lag_is_observed_per_pass() -> None:
    node, clock = _node()
    start = clock.now
    clock.now += 0.030
    node._end_pass(start - 0.005, start - 0.010)
    assert node.loop_lag_seconds.count == 1
    assert abs(node.loop_lag_seconds.sum - 0.040) < 1e-9
    assert node.status()["id"] == 1


class _Leader:
    """What Node._quiet_input reads of the core."""

    def __init__(self) -> None:
        from dledger.core.types import NONE, Role

        self.role = Role.LEADER
        self.term = 3
        self.transferee = NONE


def test_heartbeat_answers_wait_for_the_leaders_next_wake_up() -> None:
    """An idle leader is not woken by each follower's HEARTBEAT_RESP: the
    answer waits in the inbox, in order, for the next heartbeat round (the
    lease counts from the round's send time, so it never lapses for that).
    A read waiting for a round, a leadership transfer, another term or any
    other message still wakes the loop at once."""
    from dledger.core.codec import encode_message
    from dledger.core.types import Message, MsgType, Role

    node, _clock = _node()
    core = _Leader()
    node._raft = core  # type: ignore[assignment]

    def deliver(m: Message) -> bool:
        node._wake.clear()
        node._on_message(m.frm, encode_message(m))
        return node._wake.is_set()

    hb = Message(MsgType.HEARTBEAT_RESP, 1, 2, 3, context=7)
    assert not deliver(hb)
    assert not deliver(Message(MsgType.HEARTBEAT_RESP, 1, 3, 3, context=7))
    assert [m.frm for m in node._inbox] == [2, 3]  # kept, in order
    assert deliver(Message(MsgType.APP_RESP, 1, 2, 3, index=5))
    assert deliver(Message(MsgType.HEARTBEAT_RESP, 1, 2, 4, context=8))  # a newer term
    node._reads[1] = None  # type: ignore[assignment]  # a ReadIndex read waits
    assert deliver(hb)
    node._reads.clear()
    core.transferee = 2
    assert deliver(hb)
    core.transferee = 0
    core.role = Role.FOLLOWER
    assert deliver(hb)


# -- a stall with answers waiting: the order of ticks and inputs --------------------------------


def _leader_with_answers_waiting() -> tuple[Node, _Clock, RawNode]:
    """A real leader core (1 of 3) just past a check-quorum boundary (its
    followers' activity flags reset), whose heartbeat round the followers
    answered; the answers wait in the node's inbox, as they do when the
    loop stalls right after sending the round."""
    net = Network.of((1, 2, 3))
    net.elect(1)
    leader = net.nodes[1]
    while leader._election_elapsed != E - 1:
        leader.tick()
        net.deliver_all()
    leader.tick()  # the boundary: the flags are reset, a round leaves
    assert leader._election_elapsed == 0
    round_ = [m for m in net.take() if m.to != 1]
    assert round_
    for m in round_:
        net.nodes[m.to].step(m)
    answers = [m for m in net.take() if m.to == 1]
    assert {m.frm for m in answers} == {2, 3}
    node, clock = _node()
    node._inbox.extend(answers)
    return node, clock, leader


async def test_a_stalled_leader_steps_its_followers_answers_before_ticking() -> None:
    """A leader whose loop stood still for just over one election timeout
    (CPU starvation, a long collection) with its followers' answers
    waiting: ticking first crosses the check-quorum boundary with no answer
    counted, and the leader deposes itself although a quorum follows it
    (seen as a 504 in a benchmark with no fault at all). Stepping the
    answers first keeps it leading; the lease is suspended all the same."""
    node, clock, leader = _leader_with_answers_waiting()
    clock.now += (E + 1) * 0.010  # one boundary crossed, not two
    await node._time_and_inputs(leader)
    assert leader.role is Role.LEADER, leader.status()
    assert node.counters["lease_suspended"] == 1
    assert node.counters["stalled_leader_reads_first"] == 1
    assert not node._inbox

    # The order this replaces: the same stall deposes the leader.
    node, clock, leader = _leader_with_answers_waiting()
    clock.now += (E + 1) * 0.010
    node._catch_up_ticks(leader)
    node._step_inputs(leader)
    assert leader.role is Role.FOLLOWER


async def test_a_stalled_follower_ticks_before_it_hears_the_leader() -> None:
    """A follower counts a leader's message that waited out a stall as
    heard when it is stepped, after the stall's ticks: its election timer
    restarts at the real time, never earlier (the leader's lease relies on
    the followers' timers not running out before it does)."""
    net = Network.of((1, 2, 3))
    net.elect(1)
    net.nodes[1].tick()
    beat = [m for m in net.take() if m.to == 2]
    assert beat
    follower = net.nodes[2]
    node, clock = _node()
    node._inbox.extend(beat)
    clock.now += 5 * 0.010  # a stall shorter than any election timeout
    await node._time_and_inputs(follower)
    assert follower.role is Role.FOLLOWER
    assert follower._election_elapsed == 0
    assert node.counters["stalled_leader_reads_first"] == 0
