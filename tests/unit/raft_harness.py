"""A tiny deterministic harness for unit-testing the pure Raft core.

In the style of etcd raft's ``raft_test.go``: N :class:`RawNode` s over
:class:`MemoryStorage`, each with its own seeded ``random.Random``; a driver
that follows the Ready contract exactly (persist + sync, send, apply,
advance); and an in-test network that can drop, isolate and intercept.

Nothing here is clever: every test that needs a precise message sequence
steps nodes by hand and looks at ``read_messages(node)``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dledger.core.raft import RawNode
from dledger.core.types import (
    NONE,
    ClusterConfig,
    Entry,
    EntryType,
    HardState,
    Message,
    MsgType,
    RaftConfig,
    ReadFailed,
    ReadState,
    Ready,
    Role,
    Snapshot,
    SnapshotMeta,
)
from dledger.storage.memory import MemoryStorage

E = 10  # election_ticks used by default throughout the tests


def raft_config(
    nid: int,
    voters: Sequence[int] = (1, 2, 3),
    learners: Sequence[int] = (),
    **kw: Any,
) -> RaftConfig:
    kw.setdefault("election_ticks", E)
    return RaftConfig(
        node_id=nid,
        peers=ClusterConfig(tuple(sorted(voters)), tuple(sorted(learners))),
        **kw,
    )


def ents(*terms: int, start: int = 1, data: bytes = b"") -> list[Entry]:
    """Entries with consecutive indexes starting at ``start`` and the given terms."""
    return [Entry(start + k, t, EntryType.NORMAL, data) for k, t in enumerate(terms)]


def preload(
    entries: Iterable[Entry] = (),
    term: int = 0,
    vote: int = NONE,
    commit: int = 0,
) -> MemoryStorage:
    """A storage holding ``entries`` and a hard state, all synced (durable)."""
    st = MemoryStorage()
    es = list(entries)
    if es:
        st.append(es)
    st.save_hard_state(HardState(term, vote, commit))
    st.sync()
    return st


def skip_boot_stickiness(node: RawNode) -> None:
    """Pretend the node booted ``election_ticks`` ago (without ticking it).

    A freshly constructed node ignores vote requests for ``election_ticks``
    ticks (it cannot know whether it heard from a leader before a restart).
    Ticking it that long would also fire its own election timer, so tests that
    need a "long-running" node set the tick counter directly, as etcd's tests
    set ``electionElapsed``."""
    node._tick_count = max(node._tick_count, node.cfg.election_ticks)


def new_node(
    nid: int,
    voters: Sequence[int] = (1, 2, 3),
    learners: Sequence[int] = (),
    *,
    storage: MemoryStorage | None = None,
    seed: int | None = None,
    booted: bool = True,
    applied: int = 0,
    snapshot: SnapshotMeta | None = None,
    **kw: Any,
) -> RawNode:
    st = storage if storage is not None else MemoryStorage()
    rng = random.Random(nid * 7919 if seed is None else seed)
    cfg = raft_config(nid, voters, learners, **kw)
    node = RawNode(cfg, st, st, rng, applied=applied, snapshot=snapshot)
    if booted:
        skip_boot_stickiness(node)
    return node


def storage_of(node: RawNode) -> MemoryStorage:
    st = node.log.storage
    assert isinstance(st, MemoryStorage)
    return st


def persist(node: RawNode, rd: Ready) -> None:
    """Step 1 of the Ready contract: install a received snapshot, write
    entries + hard state, then sync."""
    st = storage_of(node)
    if rd.snapshot is not None:
        st.apply_snapshot(rd.snapshot)
    if rd.entries:
        st.append(rd.entries)
    if rd.hard_state is not None:
        st.save_hard_state(rd.hard_state)
    if rd.entries or rd.hard_state is not None or rd.snapshot is not None:
        st.sync()


def take_snapshot(node: RawNode, data: bytes = b"") -> None:
    """What an application does after applying: save a snapshot at the
    applied index (durably), tell the core, compact as far as it allows."""
    st = storage_of(node)
    meta = node.snapshot_meta()
    st.save_snapshot(Snapshot(meta, data or f"state@{meta.index}".encode()))
    st.sync()
    comp = node.snapshot_taken(meta)
    if comp is not None:
        st.compact(comp.upto, comp.term, comp.pos)
        st.sync()


def with_snapshot_data(node: RawNode, m: Message) -> Message:
    """Step 2 for ``Ready.snapshots_to_send``: attach the stored payload."""
    snap = storage_of(node).snapshot()
    assert snap is not None and snap.meta == m.snapshot, (snap, m.snapshot)
    return dataclasses.replace(m, snapshot_data=snap.data)


def step_ready(node: RawNode) -> Ready:
    """Take one Ready, persist it and advance. Returns the Ready."""
    rd = node.ready()
    persist(node, rd)
    node.advance(rd)
    return rd


def drain(node: RawNode) -> list[Ready]:
    """Handle Ready batches until the node has nothing left to do."""
    out: list[Ready] = []
    for _ in range(100):
        if not node.has_ready():
            return out
        out.append(step_ready(node))
    raise AssertionError("node kept producing Ready batches")


def read_messages(node: RawNode) -> list[Message]:
    """Every message the node wants to send now (persisting and advancing)."""
    return [m for rd in drain(node) for m in rd.messages]


def stored_log(node: RawNode) -> list[tuple[int, int]]:
    """(index, term) of every entry in the node's durable storage."""
    st = storage_of(node)
    if st.last_index() < st.first_index():
        return []
    return [(e.index, e.term) for e in st.entries(st.first_index(), st.last_index() + 1)]


def core_log(node: RawNode) -> list[tuple[int, int]]:
    """(index, term) of every entry in the node's view of its log."""
    lo, hi = node.log.first_index(), node.log.last_index() + 1
    return [(e.index, e.term) for e in node.log.entries(lo, hi)]


def of_type(msgs: Iterable[Message], *types: MsgType) -> list[Message]:
    return [m for m in msgs if m.type in types]


@dataclass
class Network:
    """An in-test network. Messages sit in a FIFO until ``deliver_all``.

    ``drop(frm, to)`` cuts one direction, ``isolate(n)`` cuts both directions
    for ``n``, ``recover()`` heals everything. ``intercept`` may swallow (return
    True) any message before it is queued. Applied entries, read states and
    read failures are recorded per node."""

    nodes: dict[int, RawNode]
    queue: deque[Message] = field(default_factory=deque)
    cut: set[tuple[int, int]] = field(default_factory=set)
    dropped_types: set[MsgType] = field(default_factory=set)
    intercept: Callable[[Message], bool] | None = None
    applied: dict[int, list[Entry]] = field(default_factory=dict)
    read_states: dict[int, list[ReadState]] = field(default_factory=dict)
    read_failures: dict[int, list[ReadFailed]] = field(default_factory=dict)
    delivered: list[Message] = field(default_factory=list)
    rng: random.Random | None = None  # when set: deliver in random order
    dup_rate: float = 0.0  # with rng: probability a message is queued twice

    @classmethod
    def of(
        cls,
        voters: Sequence[int] = (1, 2, 3),
        learners: Sequence[int] = (),
        **kw: Any,
    ) -> Network:
        nodes = {nid: new_node(nid, voters, learners, **kw) for nid in (*voters, *learners)}
        return cls(nodes)

    # -- faults -------------------------------------------------------------
    def drop(self, frm: int, to: int) -> None:
        self.cut.add((frm, to))

    def isolate(self, nid: int) -> None:
        for other in self.nodes:
            if other != nid:
                self.cut.add((nid, other))
                self.cut.add((other, nid))

    def recover(self) -> None:
        self.cut.clear()
        self.dropped_types.clear()

    # -- driving ------------------------------------------------------------
    def send(self, *msgs: Message) -> None:
        for m in msgs:
            if (m.frm, m.to) in self.cut or m.type in self.dropped_types:
                continue
            if self.intercept is not None and self.intercept(m):
                continue
            self.queue.append(m)
            if self.rng is not None and self.rng.random() < self.dup_rate:
                self.queue.append(m)

    def process(self, nid: int) -> list[Ready]:
        """Run the Ready loop of one node, following the contract."""
        node = self.nodes[nid]
        out: list[Ready] = []
        for _ in range(100):
            if not node.has_ready():
                return out
            rd = node.ready()
            persist(node, rd)
            self.send(*rd.messages)
            self.send(*(with_snapshot_data(node, m) for m in rd.snapshots_to_send))
            self.applied.setdefault(nid, []).extend(rd.committed_entries)
            self.read_states.setdefault(nid, []).extend(rd.read_states)
            self.read_failures.setdefault(nid, []).extend(rd.read_failures)
            node.advance(rd)
            out.append(rd)
        raise AssertionError(f"node {nid} kept producing Ready batches")

    def process_all(self) -> None:
        for nid in sorted(self.nodes):
            self.process(nid)

    def deliver_all(self, limit: int = 100_000) -> int:
        """Deliver queued messages (and everything they cause) until quiet."""
        self.process_all()
        n = 0
        while self.queue:
            n += 1
            if n > limit:
                raise AssertionError("network did not quiesce")
            if self.rng is not None and len(self.queue) > 1:
                self.queue.rotate(-self.rng.randrange(len(self.queue)))
            m = self.queue.popleft()
            node = self.nodes.get(m.to)
            if node is None or (m.frm, m.to) in self.cut:
                continue
            self.delivered.append(m)
            node.step(m)
            self.process(m.to)
        return n

    def take(self) -> list[Message]:
        """Remove and return every queued message (after processing Readies)."""
        self.process_all()
        out = list(self.queue)
        self.queue.clear()
        return out

    def tick(self, nids: Iterable[int] | None = None, times: int = 1) -> None:
        """Tick the given nodes (all by default) ``times`` times, delivering
        every message after each round of ticks."""
        ids = sorted(self.nodes) if nids is None else list(nids)
        for _ in range(times):
            for nid in ids:
                self.nodes[nid].tick()
            self.deliver_all()

    def elect(self, nid: int) -> None:
        """Make ``nid`` campaign and deliver until quiet; assert it leads."""
        self.nodes[nid].campaign()
        self.deliver_all()
        assert self.nodes[nid].role is Role.LEADER, self.nodes[nid].status()

    def leaders(self) -> list[int]:
        return [nid for nid, n in sorted(self.nodes.items()) if n.role is Role.LEADER]

    def restart(self, nid: int, *, crash: bool = True, booted: bool = False, **kw: Any) -> RawNode:
        """Replace ``nid`` by a new RawNode over the same storage (after a crash)."""
        old = self.nodes[nid]
        st = storage_of(old)
        if crash:
            st.crash()
        voters = old.cfg.peers.voters
        learners = old.cfg.peers.learners
        params = {
            "election_ticks": old.cfg.election_ticks,
            "heartbeat_ticks": old.cfg.heartbeat_ticks,
            "lease_drift_ticks": old.cfg.lease_drift_ticks,
            "max_inflight_msgs": old.cfg.max_inflight_msgs,
            "max_msg_bytes": old.cfg.max_msg_bytes,
            "check_quorum": old.cfg.check_quorum,
            "pre_vote": old.cfg.pre_vote,
            "transfer_max_lag": old.cfg.transfer_max_lag,
        }
        params.update(kw)
        snap = st.snapshot()
        if snap is not None:
            params.setdefault("snapshot", snap.meta)
            params.setdefault("applied", snap.meta.index)
        node = new_node(nid, voters, learners, storage=st, booted=booted, **params)
        self.nodes[nid] = node
        self.queue = deque(m for m in self.queue if m.to != nid)
        return node
