"""The controller-mode node driver (dledger.cmode.node) on real LMDB storage
and the in-process transport: writes confirmed by the SyncStateSet and
applied on every replica, fail-fast below min_in_sync_replicas, a master
change with truncation of the old master's unconfirmed tail, and restarts
that keep the epoch file in step with the log."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from dledger.cmode.master import CmodeConfig
from dledger.cmode.node import CmodeNode, NotInSync
from dledger.config import MemberSpec, NodeConfig
from dledger.errors import NotLeader
from dledger.node import OutcomeUnknown
from dledger.runtime import NodeEnv, open_lmdb_storage
from dledger.statemachine import LogStateMachine
from dledger.transport.memory import MemoryNetwork

IDS = (1, 2, 3)


def cfg(tmp: Path, nid: int) -> NodeConfig:
    members = tuple(
        MemberSpec(i, "127.0.0.1", 17000 + i, "127.0.0.1", 18000 + i, data_dir=str(tmp / f"n{i}"))
        for i in IDS
    )
    return NodeConfig(
        node_id=nid,
        cluster_id="cm",
        raft_host="127.0.0.1",
        raft_port=17000 + nid,
        http_host="127.0.0.1",
        http_port=18000 + nid,
        data_dir=str(tmp / f"n{nid}"),
        tick_ms=10,
        members=members,
    )


class GuardedStorage:
    """LMDB log storage whose sync takes a few ms in its worker thread and
    that fails any append or truncation made meanwhile: the storage forgets
    a batch appended while the previous one is being committed."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.syncing = False
        self.violations = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def sync(self) -> None:
        self.syncing = True
        try:
            time.sleep(0.003)
            self.real.sync()
        finally:
            self.syncing = False

    def append(self, entries: Any) -> None:
        if self.syncing:
            self.violations += 1
            raise AssertionError("append while a sync runs")
        self.real.append(entries)

    def truncate_from(self, index: int) -> None:
        if self.syncing:
            self.violations += 1
            raise AssertionError("truncate while a sync runs")
        self.real.truncate_from(index)


class Group:
    def __init__(self, tmp: Path, cmode: CmodeConfig) -> None:
        self.tmp = tmp
        self.cmode = cmode
        self.net = MemoryNetwork()
        self.nodes: dict[int, CmodeNode] = {}
        self.storages: list[GuardedStorage] = []
        self.flush = "sync"

    async def start(self, nid: int) -> CmodeNode:
        (self.tmp / f"n{nid}").mkdir(exist_ok=True)

        def make_transport(node_id, cluster_id, host, port, peers, secret, on_message):  # type: ignore[no-untyped-def]
            return self.net.transport(node_id, on_message, list(peers))

        def open_storage(c: NodeConfig) -> tuple[Any, Any]:
            real, release = open_lmdb_storage(c)
            guarded = GuardedStorage(real)
            self.storages.append(guarded)
            return guarded, release

        env = NodeEnv(make_transport=make_transport, open_storage=open_storage)
        c = dataclasses.replace(cfg(self.tmp, nid), flush=self.flush, flush_interval_ms=50)
        n = CmodeNode(c, LogStateMachine(), self.cmode, env)
        await n.start()
        self.nodes[nid] = n
        return n

    def assign(self, master: int, epoch: int, sss: set[int], sss_epoch: int) -> None:
        for n in self.nodes.values():
            if n.running:
                n.assign(master, epoch, frozenset(sss), sss_epoch)

    async def stop_all(self) -> None:
        for n in self.nodes.values():
            await n.stop()


async def until(cond, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def records(n: CmodeNode) -> list[tuple[int, int, int]]:
    sm = n.state_machine
    assert isinstance(sm, LogStateMachine)
    return sm.records()


async def test_writes_are_confirmed_by_the_set_and_applied_everywhere(tmp_path: Path) -> None:
    g = Group(tmp_path, CmodeConfig(all_ack_in_sync_state_set=True))
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1, 2, 3}, 1)
        m = g.nodes[1]
        await until(m.leader_ready)
        got = [await m.propose_entry(f"m{k}".encode()) for k in range(20)]
        assert [a.index for a in got] == list(range(1, 21))
        # all_ack: a write answered is held by every member of the set.
        for i in (2, 3):
            assert g.nodes[i]._st().last_index() >= 20
        await until(lambda: all(g.nodes[i].applied == 20 for i in IDS))
        assert records(g.nodes[2]) == records(g.nodes[1]) == records(g.nodes[3])
        with pytest.raises(NotLeader):
            await g.nodes[2].propose_entry(b"x")
    finally:
        await g.stop_all()


async def test_fail_fast_below_min_in_sync_replicas(tmp_path: Path) -> None:
    g = Group(tmp_path, CmodeConfig.cp(3))
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1}, 1)  # the set shrank to the master alone
        with pytest.raises(NotInSync):
            await g.nodes[1].propose_entry(b"x")
    finally:
        await g.stop_all()


async def test_a_new_master_truncates_the_old_masters_unconfirmed_tail(tmp_path: Path) -> None:
    g = Group(tmp_path, CmodeConfig(in_sync_replicas=2, min_in_sync_replicas=1))
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1, 2, 3}, 1)
        m = g.nodes[1]
        await until(m.leader_ready)
        for k in range(5):
            await m.propose_entry(f"a{k}".encode())
        await until(lambda: all(g.nodes[i]._st().last_index() == 5 for i in IDS))
        # The old master is cut off and keeps writing: nobody acknowledges,
        # the writes stay unconfirmed (2 acknowledgements needed).
        g.net.isolate(1)
        lost = [asyncio.ensure_future(m.propose_entry(f"lost{k}".encode())) for k in range(3)]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in lost)
        assert m._st().last_index() == 8
        # The controller elects 2 (epoch 2, set {2, 3}); 3 follows it.
        for i in (2, 3):
            g.nodes[i].assign(2, 2, frozenset({2, 3}), 2)
        await until(g.nodes[2].leader_ready)
        a = await g.nodes[2].propose_entry(b"b0")
        assert a.index == 6 and a.term == 2
        # The old master hears of it, becomes a slave, truncates 6..8.
        g.net.heal()
        m.assign(2, 2, frozenset({2, 3}), 2)
        await until(lambda: m._st().last_index() == 6 and m.applied == 6, 10)
        for f in lost:
            with pytest.raises(OutcomeUnknown):
                await f
        assert records(m) == records(g.nodes[2])
        assert [e.epoch for e in m.epochs] == [1, 2] and m.counters["truncated_entries"] == 3
    finally:
        await g.stop_all()


async def test_restart_keeps_the_epoch_file_in_step_with_the_log(tmp_path: Path) -> None:
    g = Group(tmp_path, CmodeConfig())
    for i in IDS:
        await g.start(i)
    g.assign(1, 1, {1, 2, 3}, 1)
    await until(g.nodes[1].leader_ready)
    for k in range(4):
        await g.nodes[1].propose_entry(f"x{k}".encode())
    await until(lambda: all(g.nodes[i]._st().last_index() == 4 for i in IDS))
    await g.stop_all()
    # The file on node 3 is lost (or behind): the log's terms rebuild it.
    (tmp_path / "n3" / "cmode-epochs.bin").unlink()
    g2 = Group(tmp_path, CmodeConfig())
    for i in IDS:
        await g2.start(i)
    try:
        assert [(e.epoch, e.start) for e in g2.nodes[3].epochs] == [(1, 0)]
        g2.assign(2, 2, {2}, 1)
        await until(g2.nodes[2].leader_ready)
        await g2.nodes[2].propose_entry(b"y")
        await until(lambda: all(g2.nodes[i]._st().last_index() == 5 for i in IDS))
        await until(lambda: all(g2.nodes[i].applied == 5 for i in IDS))
        assert [(e.epoch, e.start) for e in g2.nodes[3].epochs] == [(1, 0), (2, 4)]
        assert dataclasses.asdict(g2.nodes[1].epochs.last) == {"epoch": 2, "start": 4}  # type: ignore[call-overload]
    finally:
        await g2.stop_all()


async def test_an_unclean_election_resets_a_replica_that_applied_the_lost_tail(
    tmp_path: Path,
) -> None:
    """AP settings: the master confirms alone, is cut off, and a slave that
    never got its writes is elected (unclean). When the old master rejoins,
    its applied writes are gone from the group's log: it truncates below
    what it applied, resets its state machine and replays the new log."""
    g = Group(tmp_path, CmodeConfig.ap(3))
    for i in IDS:
        await g.start(i)
    try:
        g.net.isolate(1)
        g.assign(1, 1, {1}, 1)
        for k in range(3):
            await g.nodes[1].propose_entry(f"only-on-1-{k}".encode())
        assert g.nodes[1].applied == 3
        for i in (2, 3):
            g.nodes[i].assign(2, 2, frozenset({2}), 2)
        await until(g.nodes[2].leader_ready)
        await g.nodes[2].propose_entry(b"on-2")
        g.net.heal()
        g.nodes[1].assign(2, 2, frozenset({2}), 2)
        await until(lambda: g.nodes[1].applied == 1 and g.nodes[1]._st().last_index() == 1, 10)
        assert g.nodes[1].counters["resets"] == 1
        assert records(g.nodes[1]) == records(g.nodes[2])
    finally:
        await g.stop_all()


async def test_concurrent_writes_are_all_appended_between_syncs(tmp_path: Path) -> None:
    """Many writes in flight at once: none may be appended while a group
    commit's sync runs in its thread (the storage would forget it)."""
    g = Group(tmp_path, CmodeConfig(all_ack_in_sync_state_set=True))
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1, 2, 3}, 1)
        await until(g.nodes[1].leader_ready)

        # Writes keep arriving, one every half millisecond, whatever the
        # loop is doing: many arrive while a group commit is being synced.
        futs = []
        for k in range(300):
            futs.append(asyncio.ensure_future(g.nodes[1].propose_entry(f"w{k}".encode())))
            await asyncio.sleep(0.0005)
        got = await asyncio.gather(*futs)
        assert len({a.index for a in got}) == 300
        last = g.nodes[1]._st().last_index()
        assert last == 300
        await until(lambda: all(g.nodes[i].applied == 300 for i in IDS))
        assert records(g.nodes[1]) == records(g.nodes[2]) == records(g.nodes[3])
        assert g.nodes[1].running and g.nodes[1].fatal is None
        assert sum(s.violations for s in g.storages) == 0
    finally:
        await g.stop_all()


async def test_a_master_restarted_before_the_controller_noticed_keeps_its_epoch(
    tmp_path: Path,
) -> None:
    g = Group(tmp_path, CmodeConfig())
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1, 2, 3}, 1)
        await until(g.nodes[1].leader_ready)
        await g.nodes[1].propose_entry(b"before")
        await g.nodes[1].stop()
        n1 = await g.start(1)
        n1.assign(1, 1, frozenset({1, 2, 3}), 1)  # the controller still says so
        await until(n1.leader_ready)
        assert (await n1.propose_entry(b"after")).index == 2
        assert [(e.epoch, e.start) for e in n1.epochs] == [(1, 0)] and n1.fatal is None
        await until(lambda: all(g.nodes[i].applied == 2 for i in IDS))
    finally:
        await g.stop_all()


async def test_async_flush_acknowledges_before_fsync_and_flushes_on_its_interval(
    tmp_path: Path,
) -> None:
    g = Group(tmp_path, CmodeConfig(all_ack_in_sync_state_set=True))
    g.flush = "async"
    for i in IDS:
        await g.start(i)
    try:
        g.assign(1, 1, {1, 2, 3}, 1)
        await until(g.nodes[1].leader_ready)
        for k in range(5):
            await g.nodes[1].propose_entry(f"a{k}".encode())
        # Every replica's storage flushes within its interval (50 ms here).
        await until(lambda: all(not s.real._unflushed for s in g.storages), 5)
    finally:
        await g.stop_all()
