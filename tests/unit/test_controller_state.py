"""The controller's state machine: placement, liveness from committed
heartbeats (no local clock), route versions, snapshots, determinism."""

from __future__ import annotations

import random

import pytest

from broker_adapter.errors import InvalidQueue, MalformedCommand, TopicExists, UnknownTopic
from controller import codec
from controller.node_sm import ControllerStateMachine
from controller.state import LIVENESS_TIMEOUT_MS, ControllerState, NoLiveGroup, route_from_table
from dledger.core.types import Entry, EntryType


class Log:
    """Applies commands to a state as a node would (consecutive indexes)."""

    def __init__(self, st: ControllerState | None = None) -> None:
        self.st = st or ControllerState()
        self.entries: list[Entry] = []

    def __call__(self, data: bytes) -> object:
        e = Entry(len(self.entries) + 1, 1, EntryType.NORMAL, data)
        self.entries.append(e)
        return self.st.apply(e)


def hb(
    ts: int,
    group: str,
    nid: int,
    *,
    leader: bool = False,
    term: int = 1,
    knows_leader: bool = True,
) -> bytes:
    book = [(i, f"127.0.0.1:{hash(group) % 1000 + 7000 + i}") for i in (1, 2, 3)]
    return codec.heartbeat(
        ts,
        group,
        nid,
        dict(book)[nid],
        leader=leader,
        term=term,
        knows_leader=knows_leader,
        members=book,
    )


def three_live_groups(log: Log, ts: int = 1000) -> None:
    for g in ("g3", "g1", "g2"):  # registration order does not matter
        log(hb(ts, g, 1, leader=True))


def test_placement_is_round_robin_over_live_groups_sorted_by_name() -> None:
    log = Log()
    three_live_groups(log)
    route = log(codec.create_topic(1000, "orders", 12))
    assert isinstance(route, dict)
    assert [q["group"] for q in route["queues"]] == ["g1", "g2", "g3"] * 4
    assert set(route["groups"]) == {"g1", "g2", "g3"}
    assert route["groups"]["g2"]["leader"] == 1


def test_dead_group_gets_no_queues_and_liveness_comes_from_committed_time_only() -> None:
    log = Log()
    three_live_groups(log, ts=1000)
    # g1 and g3 keep heartbeating; g2 falls silent. Time moves only through
    # committed commands (heartbeats, the leader's ticks).
    log(hb(1000 + LIVENESS_TIMEOUT_MS, "g1", 1, leader=True))
    log(hb(1000 + LIVENESS_TIMEOUT_MS, "g3", 1, leader=True))
    assert log.st.live_groups() == ["g1", "g2", "g3"]  # exactly at the timeout: still live
    log(codec.tick(1001 + LIVENESS_TIMEOUT_MS))
    assert log.st.live_groups() == ["g1", "g3"]
    route = log(codec.create_topic(1001 + LIVENESS_TIMEOUT_MS, "t", 4))
    assert isinstance(route, dict)
    assert [q["group"] for q in route["queues"]] == ["g1", "g3", "g1", "g3"]
    assert route["groups"]["g1"]["live"] and "g2" not in route["groups"]


def test_a_tick_from_a_lagging_clock_does_not_move_time_back() -> None:
    log = Log()
    three_live_groups(log, ts=10_000)
    log(codec.tick(2_000))  # a new controller leader whose clock is behind
    assert log.st.now_ms == 10_000
    assert log.st.live_groups() == ["g1", "g2", "g3"]


def test_leader_stepping_down_or_a_member_losing_it_makes_the_group_not_live() -> None:
    log = Log()
    three_live_groups(log)
    log(hb(1100, "g1", 1, leader=False))  # the leader stepped down
    assert not log.st.group_live("g1")
    log(hb(1200, "g1", 2, leader=True, term=2))
    assert log.st.group_live("g1") and log.st.groups["g1"].leader == 2
    log(hb(1300, "g1", 3, term=1, knows_leader=False))  # older term: ignored
    assert log.st.group_live("g1")
    log(hb(1400, "g1", 3, term=2, knows_leader=False))  # the leader's term: lost it
    assert not log.st.group_live("g1")
    assert log.st.member_alive(log.st.groups["g1"].members[3])
    assert log.st.member_alive(log.st.groups["g1"].members[1])  # seen at 1100


def test_versions_grow_with_every_route_change_and_only_then() -> None:
    log = Log()
    three_live_groups(log)
    v0 = log.st.version
    r1 = log(codec.create_topic(1000, "a", 2))
    assert isinstance(r1, dict) and r1["version"] == v0 + 1
    log(hb(1500, "g1", 1, leader=True))  # a heartbeat of a known member: no change
    assert log.st.version == v0 + 1
    r2 = log(codec.create_topic(1500, "b", 3))
    assert isinstance(r2, dict) and r2["version"] == v0 + 2
    assert log.st.route("a")["version"] == v0 + 1  # a's route did not change
    grown = log(codec.update_topic(1600, "a", 5))
    assert isinstance(grown, dict) and grown["version"] == v0 + 3
    # the old queues keep their owner; new ones are placed by their number
    assert [q["group"] for q in grown["queues"]] == ["g1", "g2", "g3", "g1", "g2"]
    same = log(codec.update_topic(1600, "a", 5))
    assert isinstance(same, dict) and same["version"] == v0 + 3
    assert isinstance(log(codec.update_topic(1600, "a", 4)), InvalidQueue)
    gone = log(codec.delete_topic(1700, "b"))
    assert isinstance(gone, dict) and gone["version"] == v0 + 4
    assert log.st.tombstones == {"b": v0 + 4}
    assert isinstance(log(codec.delete_topic(1700, "b")), UnknownTopic)
    assert isinstance(log(codec.create_topic(1700, "a", 1)), TopicExists)
    again = log(codec.create_topic(1800, "b", 1))
    assert isinstance(again, dict) and "b" not in log.st.tombstones


def test_no_live_group_refuses_placement_and_changes_nothing() -> None:
    log = Log()
    res = log(codec.create_topic(1, "t", 3))
    assert isinstance(res, NoLiveGroup)
    assert log.st.routes == {} and log.st.version == 0


def test_malformed_and_foreign_entries_are_answered_not_raised() -> None:
    log = Log()
    assert log(b"not a controller command") is None
    bad = bytearray(codec.tick(5))
    bad[-1] ^= 0xFF
    assert isinstance(log(bytes(bad)), MalformedCommand)
    assert isinstance(log(codec.encode("create_topic", 5, topic="t")), MalformedCommand)
    assert isinstance(log(codec.create_topic(5, "bad name!", 1)), Exception)
    noop = Entry(len(log.entries) + 1, 2, EntryType.NOOP, b"")
    assert log.st.apply(noop) is None
    with pytest.raises(AssertionError):
        log.st.apply(noop)  # applied twice: an invariant, not an answer


def test_replicas_agree_and_snapshots_restore_exactly() -> None:
    rng = random.Random(7)
    cmds: list[bytes] = []
    ts = 0
    for _ in range(400):
        ts += rng.randint(0, 1500)
        k = rng.random()
        g = rng.choice(["g1", "g2", "g3", "g4"])
        if k < 0.6:
            cmds.append(
                hb(ts, g, rng.randint(1, 3), leader=rng.random() < 0.5, term=rng.randint(1, 4))
            )
        elif k < 0.7:
            cmds.append(codec.tick(ts))
        elif k < 0.85:
            cmds.append(codec.create_topic(ts, f"t{rng.randint(0, 9)}", rng.randint(1, 12)))
        elif k < 0.95:
            cmds.append(codec.update_topic(ts, f"t{rng.randint(0, 9)}", rng.randint(1, 16)))
        else:
            cmds.append(codec.delete_topic(ts, f"t{rng.randint(0, 9)}"))
    a, b = Log(), Log()
    for c in cmds[:200]:
        assert a(c) == b(c)
    sm = ControllerStateMachine(a.st)
    snap = sm.snapshot()
    assert snap == b.st.snapshot()
    restored = ControllerStateMachine()
    restored.restore(snap)
    c_log = Log(restored.state)
    c_log.entries = list(a.entries)
    for c in cmds[200:]:
        assert a(c) == b(c) == c_log(c)
    assert a.st.snapshot() == b.st.snapshot() == c_log.st.snapshot()
    assert a.st.table() == c_log.st.table()
    with pytest.raises(Exception, match="controller snapshot"):
        restored.restore(snap[:-1] + bytes([snap[-1] ^ 1]))


def test_a_broker_cached_table_answers_what_the_controller_answers() -> None:
    log = Log()
    three_live_groups(log)
    log(codec.create_topic(1000, "a", 5))
    log(codec.create_topic(1000, "b", 2))
    table = log.st.table()
    for t in ("a", "b"):
        assert route_from_table(table, t) == log.st.route(t)
    assert route_from_table(table, "c") is None
