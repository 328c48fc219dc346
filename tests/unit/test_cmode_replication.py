"""Controller mode's HA link (dledger.cmode.replication) driven in one process
over a seeded lossy network: convergence, truncation of forked tails on
join, the confirm offset's bounds, and a deposed master that its slaves no
longer follow. Each failing seed is printed."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from dledger.cmode import codec
from dledger.cmode.epochs import EpochMap
from dledger.cmode.master import CmodeConfig, MasterCore
from dledger.cmode.replication import (
    Action,
    Append,
    MasterLink,
    Refuse,
    Send,
    SlaveLink,
    Truncate,
)
from dledger.core.types import Entry, EntryType
from dledger.storage.memory import MemoryStorage


@dataclass
class Replica:
    id: int
    log: MemoryStorage = field(default_factory=MemoryStorage)
    epochs: EpochMap = field(default_factory=EpochMap)
    master: MasterLink | None = None
    slave: SlaveLink | None = None
    refused: str = ""


class Net:
    """FIFO per link, each message lost with probability ``loss`` (the
    transport's contract: a subsequence, in order). Messages go through the
    real codec."""

    def __init__(self, rng: random.Random, loss: float) -> None:
        self.rng = rng
        self.loss = loss
        self.q: dict[tuple[int, int], deque[bytes]] = {}
        self.cut: set[frozenset[int]] = set()

    def send(self, frm: int, to: int, msg: codec.HaMessage) -> None:
        if frozenset((frm, to)) in self.cut or self.rng.random() < self.loss:
            return
        self.q.setdefault((frm, to), deque()).append(codec.encode(msg))

    def deliver_one(self) -> tuple[int, int, codec.HaMessage] | None:
        links = [k for k, v in sorted(self.q.items()) if v]
        if not links:
            return None
        frm, to = self.rng.choice(links)
        return frm, to, codec.decode(self.q[(frm, to)].popleft())


class World:
    def __init__(self, seed: int, n: int = 3, loss: float = 0.1) -> None:
        self.rng = random.Random(seed)
        self.net = Net(self.rng, loss)
        self.r = {i: Replica(i) for i in range(1, n + 1)}
        self.now = 0

    def make_master(self, me: int, epoch: int, sss: set[int], cfg: CmodeConfig) -> MasterLink:
        r = self.r[me]
        r.slave = None
        r.epochs.append(epoch, r.log.last_index())
        core = MasterCore(
            me=me,
            epoch=epoch,
            members=frozenset(self.r),
            sync_state_set=frozenset(sss),
            cfg=cfg,
            max_offset=r.log.last_index(),
            started_ms=self.now,
        )
        # A new master confirms everything it holds before taking traffic.
        core.confirm = r.log.last_index()
        r.master = MasterLink(core, r.log, r.epochs, max_batch_bytes=64, max_inflight=8)
        return r.master

    def follow(self, me: int, master: int, epoch: int) -> None:
        r = self.r[me]
        r.master = None
        r.slave = SlaveLink(me, master, epoch, r.log, r.epochs)
        self.act(me, r.slave.start(self.now))

    def write(self, me: int, n: int) -> None:
        r = self.r[me]
        assert r.master is not None
        last = r.log.last_index()
        pos = 0 if last == 0 else r.log.entries(last, last + 1)[0].pos + 10
        epoch = r.master.core.epoch
        new = [
            Entry(
                last + k + 1,
                epoch,
                EntryType.NORMAL,
                f"{me}:{epoch}:{last + k + 1}".encode(),
                pos + 10 * k,
            )
            for k in range(n)
        ]
        r.log.append(new)
        r.master.core.on_local(r.log.last_index())

    def act(self, me: int, actions: list[Action]) -> None:
        r = self.r[me]
        for a in actions:
            if isinstance(a, Send):
                self.net.send(me, a.to, a.msg)
            elif isinstance(a, Truncate):
                r.log.truncate_from(a.to + 1)
                assert r.slave is not None
                self.act(me, r.slave.on_durable(a.to))
            elif isinstance(a, Append):
                r.log.append(list(a.entries))
                assert r.slave is not None
                self.act(me, r.slave.on_durable(r.log.last_index()))
            elif isinstance(a, Refuse):
                r.refused = a.reason

    def step(self) -> None:
        self.now += 5
        for me, r in self.r.items():
            if r.master is not None:
                self.act(me, r.master.pump(self.now))
            elif r.slave is not None:
                self.act(me, r.slave.tick(self.now))
        got = self.net.deliver_one()
        if got is not None:
            frm, to, msg = got
            r = self.r[to]
            if r.master is not None:
                self.act(to, r.master.on_message(frm, msg, self.now))
            elif r.slave is not None:
                self.act(to, r.slave.on_message(frm, msg, self.now))
        self.check()

    def check(self) -> None:
        for r in self.r.values():
            if r.slave is not None:
                assert r.slave.confirm <= r.slave.durable <= r.log.last_index()
            if r.master is not None:
                core = r.master.core
                assert core.confirm <= r.log.last_index()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def entries(self, me: int) -> list[tuple[int, int, bytes]]:
        log = self.r[me].log
        return [(e.index, e.term, e.data) for e in log.entries(1, log.last_index() + 1)]


SEEDS = range(1, 31)


@pytest.mark.parametrize("seed", SEEDS)
def test_slaves_converge_on_a_lossy_network(seed: int) -> None:
    w = World(seed, loss=0.2)
    m = w.make_master(1, 1, {1, 2, 3}, CmodeConfig(all_ack_in_sync_state_set=True))
    w.follow(2, 1, 1)
    w.follow(3, 1, 1)
    for _ in range(10):
        w.write(1, w.rng.randint(1, 5))
        w.run(50)
    w.run(3000)
    want = w.entries(1)
    assert w.entries(2) == want and w.entries(3) == want, f"seed {seed}"
    assert m.core.confirm == w.r[1].log.last_index(), f"seed {seed}"
    # Every replica's epoch map says the master's epoch wrote everything.
    for i in (2, 3):
        assert list(w.r[i].epochs) == list(w.r[1].epochs), f"seed {seed}"


@pytest.mark.parametrize("seed", SEEDS)
def test_all_ack_never_confirms_past_a_member_of_the_set(seed: int) -> None:
    w = World(seed, loss=0.3)
    m = w.make_master(1, 1, {1, 2, 3}, CmodeConfig(all_ack_in_sync_state_set=True))
    w.follow(2, 1, 1)
    w.follow(3, 1, 1)
    for _ in range(30):
        w.write(1, 2)
        w.run(20)
        held = min(w.r[2].log.last_index(), w.r[3].log.last_index())
        assert m.core.confirm <= held, f"seed {seed}: confirm {m.core.confirm} > {held}"


def test_a_forked_tail_is_truncated_when_the_old_master_rejoins() -> None:
    w = World(7, loss=0.0)
    cfg = CmodeConfig()
    w.make_master(1, 1, {1, 2, 3}, cfg)
    w.follow(2, 1, 1)
    w.follow(3, 1, 1)
    w.write(1, 6)
    w.run(400)
    assert w.r[3].log.last_index() == 6
    # Slave 3 is cut off; the master writes 4 more that reach slave 2 only.
    w.net.cut.add(frozenset((1, 3)))
    w.write(1, 4)
    w.run(400)
    assert w.r[2].log.last_index() == 10 and w.r[3].log.last_index() == 6
    # Master 1 dies with 2 unreplicated entries; the controller elects 3
    # (unclean: it lacks 7..10), epoch 2; 3 writes 5 of its own.
    w.net.cut.add(frozenset((1, 2)))
    w.write(1, 2)
    w.net.cut.clear()
    w.r[1].master = None
    w.make_master(3, 2, {3}, CmodeConfig(min_in_sync_replicas=1))
    w.write(3, 5)
    # 2 and the old master 1 rejoin 3: both truncate to 6 (the last point
    # where their logs and 3's agree) and copy 3's entries.
    w.follow(2, 3, 2)
    w.follow(1, 3, 2)
    w.run(1000)
    want = w.entries(3)
    assert w.entries(1) == want and w.entries(2) == want
    assert [e.epoch for e in w.r[1].epochs] == [1, 2]
    assert w.r[1].epochs.find(2) is not None and w.r[1].epochs.find(2).start == 6  # type: ignore[union-attr]


def test_a_deposed_master_is_not_followed() -> None:
    w = World(3, loss=0.0)
    old = w.make_master(1, 1, {1, 2, 3}, CmodeConfig(all_ack_in_sync_state_set=True))
    w.follow(2, 1, 1)
    w.follow(3, 1, 1)
    w.write(1, 3)
    w.run(300)
    assert old.core.confirm == 3
    # The controller makes 2 master of epoch 2; 3 follows it. Node 1 never
    # hears (no lease): it keeps writing and pushing.
    new = w.make_master(2, 2, {2, 3}, CmodeConfig(all_ack_in_sync_state_set=True))
    w.follow(3, 2, 2)
    w.run(300)
    w.write(1, 4)
    w.write(2, 2)
    w.run(600)
    # 3 holds the new master's entries, not the old one's; the old master's
    # confirm offset did not move (3 never acknowledged it again, 2 is master).
    assert w.entries(3) == w.entries(2)
    assert old.core.confirm == 3
    assert new.core.confirm == 5


def test_a_master_that_came_back_empty_makes_its_slave_start_over() -> None:
    """The cost of electing a replica that lost its data (unclean): the
    slave shares no epoch with it and drops everything it held."""
    w = World(5, loss=0.0)
    w.make_master(1, 1, {1, 2}, CmodeConfig())
    w.follow(2, 1, 1)
    w.write(1, 5)
    w.run(300)
    assert w.r[2].log.last_index() == 5
    w.r[1] = Replica(1)  # its disk was replaced
    w.make_master(1, 2, {1}, CmodeConfig())
    w.write(1, 2)
    w.follow(2, 1, 2)
    w.run(300)
    assert w.entries(2) == w.entries(1) and len(w.entries(2)) == 2
    assert not w.r[2].refused


def test_case_3_3_is_refused_and_nothing_is_dropped() -> None:
    w = World(5, loss=0.0)
    w.make_master(1, 1, {1, 2}, CmodeConfig())
    w.write(1, 2)
    # Node 2 holds (3, 5]: its head was dropped, past the master's max (2).
    w.r[2].log.append([Entry(i, 1, EntryType.NORMAL, b"x", i) for i in range(1, 6)])
    w.r[2].log.compact(4, 1, 3)
    w.r[2].epochs.append(1, 0)
    w.follow(2, 1, 1)
    w.run(100)
    assert "3-3" in w.r[2].refused
    assert w.r[2].log.last_index() == 5
