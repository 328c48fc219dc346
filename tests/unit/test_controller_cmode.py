"""The controller's state machine for controller-mode groups: master
elections from committed heartbeats, epochs, SyncStateSet changes fenced
by epoch, unclean elections, snapshots."""

from __future__ import annotations

import zlib

import orjson

from controller import codec
from controller.state import (
    _SNAP_HDR,
    LIVENESS_TIMEOUT_MS,
    SNAPSHOT_MAGIC,
    ControllerState,
    StaleEpoch,
)
from dledger.core.types import Entry, EntryType

T = LIVENESS_TIMEOUT_MS


class Log:
    """Applies commands as a controller would. ``ticking``: the controller
    leader's clock ticks every second in between (as it does when it runs),
    so time never jumps as it does after a controller outage."""

    def __init__(self, ticking: bool = True) -> None:
        self.st = ControllerState()
        self.n = 0
        self.ticking = ticking
        self.last_ts = 0

    def _apply(self, data: bytes) -> object:
        self.n += 1
        return self.st.apply(Entry(self.n, 1, EntryType.NORMAL, data))

    def __call__(self, data: bytes) -> object:
        ts = int(codec.decode(data)["ts_ms"])
        if self.ticking and self.last_ts:
            for t in range(self.last_ts + 1000, ts, 1000):
                self._apply(codec.tick(t))
        self.last_ts = max(self.last_ts, ts)
        return self._apply(data)


def hb(
    ts: int,
    nid: int,
    *,
    offset: int = 0,
    epoch: int = 0,
    master: bool = False,
    unclean: bool = False,
) -> bytes:
    book = [(i, f"127.0.0.1:{7000 + i}") for i in (1, 2, 3)]
    return codec.heartbeat(
        ts,
        "c1",
        nid,
        dict(book)[nid],
        leader=master,
        term=epoch,
        knows_leader=True,
        members=book,
        replica={"epoch": epoch, "max_offset": offset, "unclean": unclean},
    )


def replica(log: Log) -> dict[str, object]:
    g = log.st.groups["c1"]
    assert g.replica is not None
    return g.replica.json()


def test_the_first_heartbeat_elects_a_master_at_epoch_one() -> None:
    log = Log()
    out = log(hb(1000, 2))
    assert isinstance(out, dict)
    assert out["replica"]["master"] == 2 and out["replica"]["epoch"] == 1
    assert out["replica"]["sync_state_set"] == [2]
    # Not the group's leader until it heartbeats as the master of epoch 1.
    assert not log.st.group_live("c1")
    log(hb(1100, 2, epoch=1, master=True))
    assert log.st.group_live("c1")
    assert log.st.group_json("c1")["mode"] == "controller"


def three_in_sync(log: Log) -> None:
    log(hb(1000, 1))
    for n in (2, 3):
        log(hb(1000, n, epoch=1))
    log(hb(1000, 1, epoch=1, master=True, offset=500))
    out = log(codec.alter_sync_state_set(1000, "c1", 1, 1, 1, [1, 2, 3]))
    assert isinstance(out, dict) and out["sync_state_set"] == [1, 2, 3]


def test_a_dead_master_is_replaced_from_the_sync_state_set_by_offset() -> None:
    log = Log()
    three_in_sync(log)
    log(hb(2000, 2, epoch=1, offset=400))
    log(hb(2000, 3, epoch=1, offset=450))
    # The master falls silent; the others go on.
    log(hb(1000 + T, 2, epoch=1, offset=400))
    log(hb(1000 + T, 3, epoch=1, offset=450))
    assert replica(log)["master"] == 1  # exactly at the timeout: still alive
    log(codec.tick(1001 + T))
    r = replica(log)
    assert (r["master"], r["epoch"], r["sync_state_set"]) == (3, 2, [3])
    assert not log.st.group_live("c1")  # until 3 heartbeats as master of epoch 2
    # The old master comes back still claiming epoch 1: not the leader.
    log(hb(1002 + T, 1, epoch=1, master=True, offset=500))
    assert not log.st.group_live("c1")
    log(hb(1003 + T, 3, epoch=2, master=True, offset=450))
    assert log.st.group_live("c1") and log.st.groups["c1"].leader == 3


def test_a_deposed_master_cannot_change_the_set() -> None:
    log = Log()
    three_in_sync(log)
    log(codec.tick(2000 + T))  # everyone silent: the master is dead, no one is electable
    r = replica(log)
    assert r["master"] == 1 and "none" in str(r["last_election"])
    log(hb(3000 + T, 2, epoch=1, offset=100))
    r = replica(log)
    assert (r["master"], r["epoch"]) == (2, 2)
    out = log(codec.alter_sync_state_set(3000 + T, "c1", 1, 1, 1, [1]))
    assert isinstance(out, StaleEpoch)
    out = log(codec.alter_sync_state_set(3000 + T, "c1", 2, 2, 1, [2]))
    assert isinstance(out, StaleEpoch) and "SyncStateSet changed" in str(out)


def test_without_unclean_elections_a_group_outside_the_set_stays_masterless() -> None:
    log = Log()
    log(hb(1000, 1))
    log(hb(1000, 2, epoch=1, offset=10))
    log(hb(1000, 1, epoch=1, master=True, offset=10))
    assert replica(log)["sync_state_set"] == [1]
    log(hb(1000 + T + 1, 2, epoch=1, offset=10))
    r = replica(log)
    assert r["master"] == 1 and r["epoch"] == 1  # 2 is not in the set
    assert "unclean elections are off" in str(r["last_election"])


def test_unclean_elections_pick_any_alive_member() -> None:
    log = Log()
    log(hb(1000, 1, unclean=True))
    log(hb(1000, 2, epoch=1, offset=10, unclean=True))
    log(hb(1000, 1, epoch=1, master=True, offset=10, unclean=True))
    log(hb(1000 + T + 1, 2, epoch=1, offset=10, unclean=True))
    r = replica(log)
    assert (r["master"], r["epoch"]) == (2, 2) and "unclean" in str(r["last_election"])


def test_a_set_change_is_checked() -> None:
    log = Log()
    three_in_sync(log)
    with_dead = log(codec.alter_sync_state_set(1000, "c1", 1, 1, 2, [1, 2, 4]))
    assert "not in group" in str(with_dead)
    no_master = log(codec.alter_sync_state_set(1000, "c1", 1, 1, 2, [2, 3]))
    assert "must hold its master" in str(no_master)
    out = log(codec.alter_sync_state_set(1000, "c1", 1, 1, 2, [1, 3]))
    assert isinstance(out, dict) and out["sync_state_set"] == [1, 3]


def test_snapshots_keep_the_replica_set_and_read_old_ones() -> None:
    log = Log()
    three_in_sync(log)
    snap = log.st.snapshot()
    back = ControllerState.restore(snap)
    assert back.snapshot() == snap
    assert back.groups["c1"].replica == log.st.groups["c1"].replica
    # A snapshot from before controller mode (five fields per group) still loads.
    v = orjson.loads(snap[_SNAP_HDR.size :])
    for row in v["groups"].values():
        del row[5]
    body = orjson.dumps(v, option=orjson.OPT_SORT_KEYS)
    old = ControllerState.restore(_SNAP_HDR.pack(SNAPSHOT_MAGIC, zlib.crc32(body)) + body)
    assert old.groups["c1"].replica is None


def test_elections_are_deterministic() -> None:
    cmds = [hb(1000, 1), hb(1000, 2, epoch=1), hb(1000, 3, epoch=1)]
    cmds += [hb(1000 + T + 1, 2, epoch=1, offset=7), hb(1000 + T + 1, 3, epoch=1, offset=7)]
    a, b = Log(), Log()
    for c in cmds:
        a(c)
        b(c)
    assert a.st.snapshot() == b.st.snapshot()
    r = a.st.groups["c1"].replica
    assert r is not None and r.epoch == 1 and "unclean elections are off" in r.last_election


def test_a_controller_outage_alone_does_not_move_a_master() -> None:
    """The controller was down for 20 s: when it comes back, its first tick
    must not find the master's last heartbeat 20 s old and replace it."""
    log = Log(ticking=False)
    three_in_sync(log)
    log(hb(1500, 2, epoch=1))
    log(hb(1500, 3, epoch=1))
    log(codec.tick(21_000))  # the first command after the outage
    assert replica(log)["master"] == 1 and replica(log)["epoch"] == 1
    log.ticking = True  # the controller runs again: its clock ticks every second
    log(hb(21_500, 1, epoch=1, master=True, offset=500))
    log(hb(21_500, 2, epoch=1))
    log(codec.tick(21_000 + T + 1))
    assert replica(log)["epoch"] == 1  # everyone heartbeat in time
    # ... but a master that does not come back is replaced once the grace ends.
    log(hb(21_000 + T + 100, 2, epoch=1))
    log(hb(21_500 + T + 200, 2, epoch=1))
    log(hb(21_500 + T + 200, 3, epoch=1))
    log(codec.tick(21_500 + T + 300))
    r = replica(log)
    assert r["master"] in (2, 3) and r["epoch"] == 2
