"""Failures that shipped in other replicated logs, tested on the real node
driver (dledger/node.py) over real LMDB storage in a temporary directory.

The core's own tests (test_raft_paper.py, test_raft_features.py) check that a
``Ready`` asks for the right things; these check that the node really does
them: what a message promises is on disk when the message leaves, a saved
commit index past the durable log is clamped at restart, a damaged log is
refused, and a whole cluster restarted after membership changes agrees on
its membership and its data.

Two harnesses:

* :class:`Solo`: one real :class:`Node`; its peers are played by the test
  (:class:`FakePeers` decodes what the node sends and may answer). Its
  storage is the real :class:`LmdbStorage` behind :class:`Crashable`: after
  ``crash()`` nothing more becomes durable and closing discards every
  buffered write, which is what a process killed at that instant leaves on
  disk. Crashing at the moment a message leaves tells whether what the
  message promises was durable before it left.
* :class:`Cluster`: several real nodes on the in-process transport
  (:class:`MemoryNetwork`), each with LMDB in its own directory.

Every test runs on the real clock with 10 ms ticks and takes well under a
second or two.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from dledger import node as node_module
from dledger.config import MemberSpec, NodeConfig
from dledger.core.codec import decode_message, encode_message
from dledger.core.types import (
    EARLY_SEND_TYPES,
    ClusterConfig,
    Entry,
    HardState,
    Message,
    MsgType,
    Role,
)
from dledger.errors import DLedgerError, StorageCorrupted, StorageFailed
from dledger.node import Node, OutcomeUnknown
from dledger.runtime import NodeEnv, NodeStorage, open_lmdb_storage
from dledger.snapshot_stream import is_stream_frame
from dledger.statemachine import LogStateMachine
from dledger.storage import lmdb_store
from dledger.storage.lmdb_store import LmdbStorage
from dledger.transport.memory import MemoryNetwork
from tests.unit.test_lmdb_store import flip_marker, write_marked_log

TICK_MS = 10
E = 10  # election ticks
PAST_BOOT_STICKINESS_S = 1.5 * E * TICK_MS / 1000  # a restarted node ignores votes this long


def node_cfg(
    tmp: Path, nid: int, ids: Iterable[int] = (1, 2, 3), learners: Iterable[int] = (), **kw: Any
) -> NodeConfig:
    learner_ids = set(learners)
    members = tuple(
        MemberSpec(
            i,
            "127.0.0.1",
            17300 + i,
            "127.0.0.1",
            18300 + i,
            role="learner" if i in learner_ids else "voter",
            data_dir=str(tmp / f"n{i}"),
        )
        for i in ids
    )
    return NodeConfig(
        node_id=nid,
        cluster_id="scenarios",
        raft_host="127.0.0.1",
        raft_port=17300 + nid,
        http_host="127.0.0.1",
        http_port=18300 + nid,
        data_dir=str(tmp / f"n{nid}"),
        members=members,
        tick_ms=TICK_MS,
        election_ticks=E,
        heartbeat_ticks=1,
        lease_drift_ticks=2,
        **{"snapshot_every_entries": 0, **kw},
    )


async def until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------
# Solo: one real node, peers played by the test
# ---------------------------------------------------------------------------


class Crashable:
    """The real LmdbStorage; after :meth:`crash` nothing more becomes durable
    (``sync`` does nothing), and the node's ``close()`` then discards every
    buffered write: the disk holds exactly what it held at the crash."""

    def __init__(self, real: NodeStorage, crash_at_sync: int | None = None) -> None:
        self.real = real
        self.crashed = False
        self.syncs = 0  # real syncs done
        self.crash_at_sync = crash_at_sync  # crash instead of doing this one (0-based)
        self.fail_at_sync: int | None = None  # raise StorageFailed at this one
        self.sync_threads: set[str] = set()  # the threads sync() ran on
        # LMDB commits made inside a sync() that ran on the event loop's thread
        self.commits_in_loop_syncs = 0
        self.catch_up_threads: list[str] = []  # the threads checkpoint() ran on
        self.on_checkpoint: Callable[[], None] | None = None
        # planted: every sync() takes LMDB's catch-up along, as before the node
        # left it for after the answers
        self.catch_up_in_sync = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    @property
    def lmdb_commits(self) -> int:
        assert isinstance(self.real, LmdbStorage)
        return self.real.lmdb_commits

    def checkpoint(self) -> bool:
        self.catch_up_threads.append(threading.current_thread().name)
        if self.on_checkpoint is not None:
            self.on_checkpoint()
        return False if self.crashed else bool(self.real.checkpoint())

    def crash(self) -> None:
        self.crashed = True

    def sync(self, *, catch_up: bool = True) -> None:
        self.sync_threads.add(threading.current_thread().name)
        if self.syncs == self.crash_at_sync:
            self.crashed = True
        if self.syncs == self.fail_at_sync:
            raise StorageFailed("injected: fsync returned EIO")
        if not self.crashed:
            before = self.lmdb_commits
            self.real.sync(catch_up=catch_up or self.catch_up_in_sync)
            if threading.current_thread() is threading.main_thread():
                self.commits_in_loop_syncs += self.lmdb_commits - before
            self.syncs += 1

    def maybe_flush(self, now_s: float) -> bool:
        return False if self.crashed else self.real.maybe_flush(now_s)


Responder = Callable[[Message], list[Message]]


class FakePeers:
    """The node's transport, with its peers played by the test: every Raft
    message the node sends is decoded into ``sent``; ``watch`` sees it first
    (at the instant it leaves), ``respond`` may answer it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.watch: Callable[[Message], None] | None = None
        self.respond: Responder | None = None
        self._on_message: Callable[[int, bytes], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def make(
        self,
        node_id: int,
        cluster_id: str,
        host: str,
        port: int,
        peers: dict[int, tuple[str, int]],
        secret: bytes | None,
        on_message: Callable[[int, bytes], None],
    ) -> FakePeers:
        self._on_message = on_message
        return self

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        self._on_message = None

    def send(self, to: int, payload: bytes) -> bool:
        if is_stream_frame(payload):
            return True
        m = decode_message(payload)
        if self.watch is not None:
            self.watch(m)
        self.sent.append(m)
        if self.respond is not None and self._loop is not None:
            for reply in self.respond(m):
                self._loop.call_soon(self.inject, reply)
        return True

    def inject(self, m: Message) -> None:
        if self._on_message is not None:
            self._on_message(m.frm, encode_message(m))

    def update_peers(self, peers: Mapping[int, tuple[str, int]]) -> None:
        return None

    def peer_status(self, peer_id: int) -> Any:
        return None

    @property
    def stats(self) -> Mapping[str, int]:
        return {}


class Solo:
    """Node 1 of voters ``ids`` (its data in ``tmp/n1``); the others are
    played through :attr:`peers`."""

    def __init__(self, tmp: Path, ids: Iterable[int] = (1, 2, 3), **kw: Any) -> None:
        self.cfg = node_cfg(tmp, 1, ids, **kw)
        Path(self.cfg.data_dir).mkdir(parents=True, exist_ok=True)
        self.peers = FakePeers()
        self.storage: Crashable | None = None
        self.sm = LogStateMachine()
        self.crash_at_sync: int | None = None  # for the next start only
        self.inline_sync_bytes = NodeEnv().inline_sync_bytes

    def _open(self, c: NodeConfig) -> tuple[NodeStorage, Callable[[], None]]:
        real, release = open_lmdb_storage(c)
        self.storage = Crashable(real, self.crash_at_sync)
        self.crash_at_sync = None
        return self.storage, release

    async def start(self) -> Node:
        self.peers = FakePeers()
        self.sm = LogStateMachine()
        env = NodeEnv(
            make_transport=self.peers.make,
            open_storage=self._open,
            inline_sync_bytes=self.inline_sync_bytes,
        )
        node = Node(self.cfg, self.sm, env)
        await node.start()
        return node

    def crash_when(self, pred: Callable[[Message], bool]) -> None:
        def watch(m: Message) -> None:
            if pred(m):
                assert self.storage is not None
                self.storage.crash()

        self.peers.watch = watch

    def on_disk(self) -> tuple[HardState, list[Entry]]:
        """What a restart would find (the node must be stopped)."""
        with LmdbStorage(self.cfg.data_dir) as st:
            hs = st.hard_state()
            es = st.entries(st.first_index(), st.last_index() + 1)
        return hs, es


def obliging(*acking: int) -> Responder:
    """Peers that grant every (pre-)vote; of them, ``acking`` acknowledge
    every append and heartbeat as if they held the entries."""

    def respond(m: Message) -> list[Message]:
        if m.type is MsgType.PRE_VOTE:
            return [Message(MsgType.PRE_VOTE_RESP, m.frm, m.to, m.term)]
        if m.type is MsgType.VOTE:
            return [Message(MsgType.VOTE_RESP, m.frm, m.to, m.term)]
        if m.to not in acking:
            return []
        if m.type is MsgType.APP:
            return [Message(MsgType.APP_RESP, m.frm, m.to, m.term, index=m.index + len(m.entries))]
        if m.type is MsgType.HEARTBEAT:
            return [Message(MsgType.HEARTBEAT_RESP, m.frm, m.to, m.term, context=m.context)]
        return []

    return respond


def chain(terms: Iterable[int], data: bytes = b"entry") -> tuple[Entry, ...]:
    out: list[Entry] = []
    pos = 0
    for i, t in enumerate(terms, start=1):
        e = Entry(i, t, data=data + b"-%d" % i, pos=pos)
        out.append(e)
        pos = e.end_pos
    return tuple(out)


@pytest.fixture
def early_vote_resp(monkeypatch: pytest.MonkeyPatch) -> Callable[[MsgType], None]:
    """Plant a bug in the node: send this reply type before the Ready's
    fsync, like a leader's appends (the bug raftos and PySyncObj < 0.3.17
    shipped for votes). Shows that the tests below can fail."""

    def plant(t: MsgType) -> None:
        monkeypatch.setattr(node_module, "EARLY_SEND_TYPES", EARLY_SEND_TYPES | {t})

    return plant


# -- scenario 2: a vote is on disk before the grant leaves ---------------------


@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-early-send"])
async def test_a_granted_vote_is_on_disk_when_the_grant_leaves(
    tmp_path: Path, planted: bool, early_vote_resp: Callable[[MsgType], None]
) -> None:
    """Kill the node at the instant its VOTE_RESP leaves: the restarted node
    must still know it voted for 2 in term 7, and refuse 3 in that term
    (else two leaders in one term). With the reply planted into the early
    sends, the crash loses the vote: the check can fail."""
    if planted:
        early_vote_resp(MsgType.VOTE_RESP)
    h = Solo(tmp_path)
    n = await h.start()
    try:
        await asyncio.sleep(PAST_BOOT_STICKINESS_S)
        h.crash_when(lambda m: m.type is MsgType.VOTE_RESP and not m.reject)
        h.peers.inject(Message(MsgType.VOTE, 1, 2, 7, log_term=0, index=0))
        await until(
            lambda: any(m.type is MsgType.VOTE_RESP for m in h.peers.sent), what="a vote reply"
        )
        (resp,) = [m for m in h.peers.sent if m.type is MsgType.VOTE_RESP]
        assert (resp.to, resp.term, resp.reject) == (2, 7, False)
    finally:
        await n.stop()
    hs, _ = h.on_disk()
    if planted:
        assert (hs.term, hs.vote) != (7, 2), "the planted early send should lose the vote"
        return
    assert (hs.term, hs.vote) == (7, 2)
    # The restarted node answers another candidate of term 7 with a refusal.
    n = await h.start()
    try:
        h.peers.inject(Message(MsgType.VOTE, 1, 3, 7, log_term=0, index=0))
        await until(lambda: any(m.type is MsgType.VOTE_RESP for m in h.peers.sent), what="reply")
        assert [(m.to, m.term, m.reject) for m in h.peers.sent if m.type is MsgType.VOTE_RESP] == [
            (3, 7, True)
        ]
    finally:
        await n.stop()


# -- scenario 11: acknowledged means synced ------------------------------------


@pytest.mark.parametrize("inline", [True, False], ids=["sync-on-loop", "sync-in-thread"])
@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-early-send"])
async def test_a_follower_acknowledges_only_entries_on_disk(
    tmp_path: Path, planted: bool, inline: bool, early_vote_resp: Callable[[MsgType], None]
) -> None:
    """Kill a follower at the instant its APP_RESP leaves: every entry it
    acknowledged is on disk (the leader counts that reply toward commit).
    With the reply planted into the early sends the crash loses them. Both
    ways a follower syncs hold it: a small batch on the loop, a batch over
    ``inline_sync_bytes`` in a thread."""
    if planted:
        early_vote_resp(MsgType.APP_RESP)
    h = Solo(tmp_path)
    if not inline:
        h.inline_sync_bytes = 4  # the three entries' data is 15 bytes
    n = await h.start()
    ents = chain([1, 1, 1])
    try:
        h.crash_when(lambda m: m.type is MsgType.APP_RESP and not m.reject and m.index >= 3)
        h.peers.inject(Message(MsgType.APP, 1, 2, 1, log_term=0, index=0, entries=ents))
        await until(lambda: any(m.type is MsgType.APP_RESP for m in h.peers.sent), what="ack")
        assert [m.index for m in h.peers.sent if m.type is MsgType.APP_RESP] == [3]
        assert (n.counters["inline_syncs"] > 0) is inline, n.counters
    finally:
        await n.stop()
    _, on_disk = h.on_disk()
    if planted:
        assert on_disk == [], "the planted early send should lose the entries"
    else:
        assert [(e.index, e.term, e.data) for e in on_disk] == [
            (e.index, e.term, e.data) for e in ents
        ]


@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-catch-up-in-sync"])
async def test_a_follower_acknowledges_before_lmdb_catches_up_and_never_on_the_loop(
    tmp_path: Path, planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower's group commit appends to the write-ahead log; LMDB's
    catch-up (a commit of up to a mebibyte, 7-8 ms under load) comes after
    the acknowledgement has left, in a thread. Before: a small batch synced
    on the loop took the catch-up with it whenever its record made the log
    due, so the loop stood still for the commit and the acknowledgement
    waited for it (and both followers, fed the same entries, stalled at the
    same entry). Planted: the follower's sync takes the catch-up as before;
    the check fails."""
    monkeypatch.setattr(lmdb_store, "WAL_MAX_BYTES", 4000)
    monkeypatch.setattr(lmdb_store, "CATCH_UP_SHARE_MIN", 1.0)
    h = Solo(tmp_path)
    n = await h.start()
    ents = chain([1] * 12, data=b"x" * 1000)
    acked_at_catch_up: list[int] = []

    def acked(index: int) -> bool:
        return any(m.type is MsgType.APP_RESP and m.index == index for m in h.peers.sent)

    try:
        st = h.storage
        assert st is not None
        st.catch_up_in_sync = planted
        st.on_checkpoint = lambda: acked_at_catch_up.append(
            max((m.index for m in h.peers.sent if m.type is MsgType.APP_RESP), default=0)
        )
        for k in range(0, 12, 3):  # four batches of three 1 KB entries
            h.peers.inject(
                Message(
                    MsgType.APP, 1, 2, 1, log_term=1 if k else 0, index=k, entries=ents[k : k + 3]
                )
            )
            await until(
                functools.partial(acked, k + 3), what=f"the acknowledgement of entries ..{k + 3}"
            )
        # Both counted: a catch-up's LMDB commit ends in its thread before
        # the node, back on the loop, counts it (a loaded machine shows it).
        await until(
            lambda: (
                st.lmdb_commits >= 2
                and n.counters["deferred_catch_ups"] == len(st.catch_up_threads)
            ),
            what="two catch-ups, each finished on the node's side",
        )
        assert n.counters["inline_syncs"] > 0, n.counters  # the batches synced on the loop
        assert st.commits_in_loop_syncs == 0, "LMDB caught up inside a sync on the event loop"
        assert st.catch_up_threads and "MainThread" not in st.catch_up_threads
        # the batch whose record made the log due was acknowledged first
        assert acked_at_catch_up and all(i % 3 == 0 and i > 0 for i in acked_at_catch_up)
        assert n.counters["deferred_catch_ups"] == len(st.catch_up_threads)
    except AssertionError:
        if planted:
            return  # the planted catch-up inside the loop's sync is caught
        raise
    finally:
        await n.stop()
    assert not planted, "the planted catch-up inside the loop's sync went unnoticed"
    _, on_disk = h.on_disk()
    assert [(e.index, e.data) for e in on_disk] == [(e.index, e.data) for e in ents]


@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-catch-up-in-sync"])
async def test_a_leader_answers_while_lmdb_catches_up(
    tmp_path: Path, planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader's catch-up (made 50 ms slow here: half an election timeout)
    runs after the group commit that made it due, with acknowledgements
    stepped meanwhile: by the time it ends, the writes it covers have been
    answered. Planted: the group commit takes the catch-up along (as
    before), and none of those writes is answered before it ends."""
    monkeypatch.setattr(lmdb_store, "WAL_MAX_BYTES", 4000)
    monkeypatch.setattr(lmdb_store, "CATCH_UP_SHARE_MIN", 1.0)
    h = Solo(tmp_path)
    n = await h.start()
    answered: list[int] = []  # entry indexes, in the order their writes were answered
    covered_answered: list[bool] = []  # per catch-up: its last entry answered when it ended
    try:
        h.peers.respond = obliging(2, 3)
        await until(n.leader_ready, what="node 1 leads and its no-op committed")
        st = h.storage
        assert st is not None and isinstance(st.real, LmdbStorage)
        real = st.real
        real_commit = real._commit

        def slow_commit() -> None:
            covered = real.last_index()
            time.sleep(0.05)
            covered_answered.append(max(answered, default=0) >= covered)
            real_commit()

        monkeypatch.setattr(real, "_commit", slow_commit)
        st.catch_up_in_sync = planted
        for k in range(12):
            res = await asyncio.wait_for(n.submit(b"x" * 1000 + b"%d" % k), 5)
            answered.append(res.index)
        assert len(covered_answered) >= 2, covered_answered
        if planted:
            assert not any(covered_answered), "the planted catch-up in the group commit went unseen"
            return
        assert all(covered_answered), covered_answered
        # the last catch-up may still be running when the last write is
        # answered (that is the point): wait for the node to count it
        await until(
            lambda: n.counters["deferred_catch_ups"] == len(covered_answered),
            what="every catch-up finished on the node's side",
        )
    finally:
        await n.stop()
    _, on_disk = h.on_disk()
    assert sum(1 for e in on_disk if e.data.startswith(b"x" * 1000)) == 12


async def test_a_write_acknowledged_to_a_client_is_on_the_leaders_disk(tmp_path: Path) -> None:
    """A leader of voters 1, 2, 3 whose only acknowledging follower is 2:
    the write commits on {1, 2}, so the leader's own copy counts, and it
    must be durable by the time the client hears "ok". Kill the leader
    right then: the entry is on its disk."""
    h = Solo(tmp_path)
    n = await h.start()
    try:
        h.peers.respond = obliging(2)
        await until(n.leader_ready, what="node 1 leads and its no-op committed")
        fut = n.submit(b"acked-write")
        fut.add_done_callback(lambda f: h.storage.crash() if h.storage else None)
        applied = await asyncio.wait_for(fut, 5)
    finally:
        await n.stop()
    _, on_disk = h.on_disk()
    assert any(e.index == applied.index and e.data == b"acked-write" for e in on_disk)


# -- scenario 8: a saved commit index past the durable log ---------------------


def _log_with_commit_past_its_end(data_dir: str, last: int, commit: int) -> tuple[Entry, ...]:
    ents = chain([1] * last)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with LmdbStorage(data_dir) as st:
        st.append(ents)
        st.save_hard_state(HardState(1, 0, commit))
        st.sync()
    with LmdbStorage(data_dir) as st:
        assert st.hard_state().commit == commit and st.last_index() == last  # LMDB keeps it
    return ents


async def test_a_restart_clamps_a_saved_commit_past_the_durable_log(tmp_path: Path) -> None:
    """The saved hard state says commit 5 but only 3 entries survived:
    the node starts (no hang, no error), applies exactly 1..3, and reports
    commit 3 until a leader tells it more."""
    h = Solo(tmp_path)
    ents = _log_with_commit_past_its_end(h.cfg.data_dir, last=3, commit=5)
    n = await h.start()
    try:
        await until(lambda: n.applied == 3, what="the surviving entries applied")
        await asyncio.sleep(3 * TICK_MS / 1000)  # and nothing more
        assert n.running and n.fatal is None
        st = n.status()
        assert (st["commit"], st["applied"], st["last_index"]) == (3, 3, 3)
        assert [r[0] for r in h.sm.records()] == [e.index for e in ents]
    finally:
        await n.stop()


async def test_a_lone_voter_with_a_commit_past_its_log_keeps_working(tmp_path: Path) -> None:
    """Same damage on a one-voter cluster: it elects itself, commits its
    no-op at 4 (not the phantom 4 and 5 the hard state named) and takes
    new writes."""
    h = Solo(tmp_path, ids=(1,))
    _log_with_commit_past_its_end(h.cfg.data_dir, last=3, commit=5)
    n = await h.start()
    try:
        await until(n.leader_ready, what="the lone voter leads")
        a = await asyncio.wait_for(n.submit(b"after"), 5)
        assert a.index == 5 and a.term == n.status()["term"]
        assert [r[0] for r in h.sm.records()] == [1, 2, 3, 5]  # 4 is the no-op
    finally:
        await n.stop()


# -- scenario 12: a damaged log is refused, never served ------------------------


async def test_a_node_with_a_damaged_tail_refuses_to_start(tmp_path: Path) -> None:
    """A flipped bit in the verified tail: start() raises StorageCorrupted
    (exit 2, "rebuild this replica"); the node never votes or sends, and it
    releases its data directory so an operator can rebuild it."""
    h = Solo(tmp_path)
    write_marked_log(Path(h.cfg.data_dir), 20)
    flip_marker(Path(h.cfg.data_dir), 18)
    with pytest.raises(StorageCorrupted):
        await h.start()
    assert h.peers.sent == []
    # rebuilt from an empty directory, it starts
    for f in Path(h.cfg.data_dir).iterdir():
        f.unlink()
    n = await h.start()
    await n.stop()


async def test_a_leader_stops_rather_than_send_a_damaged_record(tmp_path: Path) -> None:
    """A flipped bit in an old record outside the verified tail (the node
    starts). It leads (its peers grant votes); the peers say their logs are
    empty, so it must read the damaged record to catch them up: it stops on
    StorageCorrupted, and no append carrying that record ever leaves."""
    h = Solo(tmp_path, verify_tail_entries=5)
    ents = write_marked_log(Path(h.cfg.data_dir), 30)
    with LmdbStorage(h.cfg.data_dir) as st:  # a term past the log's, nothing committed
        st.save_hard_state(HardState(ents[-1].term, 0, 0))
        st.sync()
    flip_marker(Path(h.cfg.data_dir), 4)

    def empty_peers(m: Message) -> list[Message]:
        if m.type is MsgType.APP and m.index > 0:  # "I hold nothing"
            return [Message(MsgType.APP_RESP, m.frm, m.to, m.term, index=m.index, reject=True)]
        return obliging()(m)

    n = await h.start()
    try:
        h.peers.respond = empty_peers
        await until(lambda: n.fatal is not None, what="the node stops on the damaged record")
        assert isinstance(n.fatal, StorageCorrupted)
        assert not n.running
        assert any(m.type is MsgType.VOTE for m in h.peers.sent)  # it did lead
        sent_entries = {e.index for m in h.peers.sent if m.type is MsgType.APP for e in m.entries}
        assert 4 not in sent_entries
    finally:
        await n.stop()


# -- scenario 13: recovery after a kill at any point, or a clean stop ---------


async def _lone_voter_run(h: Solo, writes: int) -> tuple[list[bytes], Node]:
    """Start, write ``writes`` entries one by one (the log snapshots and
    compacts as it goes), stop. Returns the writes acknowledged while the
    storage was still really syncing (the ones a crash must not lose)."""
    n = await h.start()
    durable_acks: list[bytes] = []
    try:
        await until(n.leader_ready, what="the lone voter leads")
        for k in range(writes):
            data = b"w%02d" % k
            await asyncio.wait_for(n.submit(data), 5)
            assert h.storage is not None
            if not h.storage.crashed:
                durable_acks.append(data)
        await asyncio.sleep(2 * TICK_MS / 1000)  # let a snapshot task finish
    finally:
        await n.stop()
    return durable_acks, n


async def test_restart_recovers_after_a_kill_at_every_sync_and_after_a_clean_stop(
    tmp_path: Path,
) -> None:
    """A lone voter writing, snapshotting and compacting is killed at its
    k-th sync, for every k (each sync is one LMDB transaction, plus the
    snapshot file written before its record): every restart opens the
    directory without a storage error, holds every write acknowledged
    before the kill, and takes new writes. k past the last sync is the
    clean stop."""
    kw = {"snapshot_every_entries": 3, "snapshot_trailing_entries": 1}
    probe = Solo(tmp_path / "probe", ids=(1,), **kw)
    _, ran = await _lone_voter_run(probe, 8)
    assert probe.storage is not None
    total = probe.storage.syncs
    assert ran.counters["snapshots_taken"] >= 2
    assert probe.on_disk()[1][0].index > 1  # compacted
    for k in range(total + 1):
        h = Solo(tmp_path / f"k{k}", ids=(1,), **kw)
        h.crash_at_sync = k
        acked, _ = await _lone_voter_run(h, 8)
        n = await h.start()  # must open: no StorageCorrupted, no disk error
        try:
            await until(n.leader_ready, what=f"restart after a kill at sync {k}")
            held = {data for _, _, data in h.sm.recent(1, 1000)}
            missing = [d for d in acked if d not in held]
            assert not missing, f"kill at sync {k} of {total}: lost acknowledged {missing}"
            await asyncio.wait_for(n.submit(b"after"), 5)
        finally:
            await n.stop()


async def test_a_disk_failure_in_the_leaders_group_commit_stops_the_node_unacknowledged(
    tmp_path: Path,
) -> None:
    """The leader's group commit runs on a worker thread (started before
    the loop turns, NodeEnv.submit); a disk error there reaches the loop:
    the write in flight fails as OutcomeUnknown (never acknowledged), the
    node stops with the StorageFailed (DISK_FAILED), and it does not hang."""
    h = Solo(tmp_path, ids=(1,))
    n = await h.start()
    try:
        await until(n.leader_ready, what="the lone voter leads")
        await asyncio.wait_for(n.submit(b"before"), 5)
        st = h.storage
        assert st is not None
        assert any(t != threading.main_thread().name for t in st.sync_threads), st.sync_threads
        st.fail_at_sync = st.syncs
        with pytest.raises(OutcomeUnknown):
            await asyncio.wait_for(n.submit(b"lost"), 5)
        await asyncio.wait_for(n.failed.wait(), 5)
        assert isinstance(n.fatal, StorageFailed)
        assert b"lost" not in {data for _, _, data in h.sm.recent(1, 100)}
    finally:
        await n.stop()


# ---------------------------------------------------------------------------
# Cluster: real nodes on the in-process transport
# ---------------------------------------------------------------------------


class Cluster:
    def __init__(
        self, tmp: Path, ids: Iterable[int], learners: Iterable[int] = (), **kw: Any
    ) -> None:
        self.tmp = tmp
        self.ids = tuple(ids)
        self.learners = tuple(learners)
        self.kw = kw
        self.net = MemoryNetwork()
        self.nodes: dict[int, Node] = {}

    async def start(self, nid: int) -> Node:
        def make_transport(  # type: ignore[no-untyped-def]
            node_id, cluster_id, host, port, peers, secret, on_message
        ):
            return self.net.transport(node_id, on_message, list(peers))

        c = node_cfg(self.tmp, nid, self.ids, self.learners, **self.kw)
        Path(c.data_dir).mkdir(parents=True, exist_ok=True)
        n = Node(c, LogStateMachine(), NodeEnv(make_transport=make_transport))
        await n.start()
        self.nodes[nid] = n
        return n

    async def start_all(self) -> None:
        for nid in self.ids:
            await self.start(nid)

    async def stop_all(self) -> None:
        for n in self.nodes.values():
            await n.stop()

    def leader(self) -> Node | None:
        ready = [n for n in self.nodes.values() if n.running and n.leader_ready()]
        return ready[0] if len(ready) == 1 else None

    async def wait_leader(self) -> Node:
        await until(lambda: self.leader() is not None, 10, "one ready leader")
        lead = self.leader()
        assert lead is not None
        return lead

    async def write(self, data: bytes) -> tuple[int, int]:
        """Propose through whoever leads, retrying refusals; (index, term)."""
        for _ in range(200):
            lead = await self.wait_leader()
            try:
                a = await asyncio.wait_for(lead.submit(data), 5)
                return a.index, a.term
            except DLedgerError:
                await asyncio.sleep(0.02)
        raise AssertionError(f"write {data!r} never acknowledged")

    async def change(self, op: str, nid: int) -> ClusterConfig:
        """A membership change through the leader, retried while another one
        is in progress or the learner is catching up."""
        for _ in range(300):
            lead = await self.wait_leader()
            try:
                conf: ClusterConfig = await asyncio.wait_for(getattr(lead, op)(nid), 5)
                return conf
            except DLedgerError:
                await asyncio.sleep(0.02)
        raise AssertionError(f"{op} {nid} never accepted")

    def records(self, nid: int) -> list[tuple[int, int, int]]:
        sm = self.nodes[nid].state_machine
        assert isinstance(sm, LogStateMachine)
        return sm.records(1, 1 << 20)


async def test_full_cluster_restart_after_membership_changes_agrees_on_everything(
    tmp_path: Path,
) -> None:
    """Scenarios 13 and 20. Voters 1-3 and learner 4 (the cluster file);
    through the log: remove 4, add it back as a learner, promote it, with
    snapshots and compaction along the way. Every node stops cleanly, then
    all restart: each must come back with voters 1-4 (from its snapshot plus
    the changes replayed after it, not the cluster file's bootstrap roles),
    the same applied history holding every acknowledged write, a leader, and
    a quorum of 3 of 4 for new writes."""
    c = Cluster(
        tmp_path, (1, 2, 3, 4), learners=(4,), snapshot_every_entries=7,
        snapshot_trailing_entries=2,
    )  # fmt: skip
    want = ClusterConfig((1, 2, 3, 4), ())
    acked: dict[int, int] = {}
    await c.start_all()
    try:
        for k in range(8):
            i, t = await c.write(b"a%d" % k)
            acked[i] = t
        assert (await c.change("remove", 4)).learners == ()
        for k in range(8):
            i, t = await c.write(b"b%d" % k)
            acked[i] = t
        assert (await c.change("add_learner", 4)).learners == (4,)
        assert await c.change("promote", 4) == want
        for k in range(8):
            i, t = await c.write(b"c%d" % k)
            acked[i] = t
        last = max(acked)
        await until(lambda: all(n.applied >= last for n in c.nodes.values()), 10, "converged")
        assert all(n.counters["snapshots_taken"] for n in c.nodes.values())
    finally:
        await c.stop_all()

    c.net = MemoryNetwork()
    await c.start_all()
    try:
        lead = await c.wait_leader()
        i, t = await c.write(b"after-restart")
        acked[i] = t
        await until(lambda: all(n.applied >= i for n in c.nodes.values()), 10, "all applied")
        for nid, n in c.nodes.items():
            assert n._raft is not None
            st = n._raft.status()  # (MemoryTransport has no peer_status for Node.status)
            assert st.config == want, (nid, st.config)
            assert st.role in (Role.LEADER, Role.FOLLOWER), (nid, st.role)
        histories = {nid: c.records(nid) for nid in c.nodes}
        ref = histories[lead.cfg.node_id]
        assert all(h == ref for h in histories.values())
        applied = {idx: term for idx, term, _ in ref}
        assert all(applied.get(idx) == term for idx, term in acked.items())
        # 4 voters: with two of them cut off, nothing commits
        lead = await c.wait_leader()
        others = [nid for nid in c.ids if nid != lead.cfg.node_id]
        for nid in others[:2]:
            c.net.isolate(nid)
        fut = lead.submit(b"needs-three-of-four")
        await asyncio.sleep(3 * E * TICK_MS / 1000)
        assert not fut.done() or fut.exception() is not None
        fut.cancel()
    finally:
        await c.stop_all()


async def test_an_idle_leader_holds_its_peers_between_rounds_and_keeps_its_quorum(
    tmp_path: Path,
) -> None:
    """An idle leader leaves its followers' answers unread between its
    rounds (hold_inbound, issue 17: reading each one as it came was most of
    its wake-ups). They are read, in order, before anything is stepped at
    its next round, so check-quorum still sees its followers: over many
    idle rounds nobody's term moves and nobody else campaigns; the first
    write after the idle spell is served and replicated as usual."""
    c = Cluster(tmp_path, (1, 2, 3))
    await c.start_all()
    try:
        await c.write(b"before")
        lead = await c.wait_leader()
        assert lead._raft is not None and lead._transport is not None
        term = lead._raft.term
        holds0 = lead._transport.stats["holds"]
        # idle after 3 election timeouts (0.3 s); then rounds every 6 ticks:
        # 1.5 s is ~20 idle rounds and ~15 check-quorum boundaries
        await asyncio.sleep(1.5)
        assert c.leader() is lead
        assert lead._transport.stats["holds"] - holds0 >= 10
        for n in c.nodes.values():
            assert n._raft is not None and n._raft.term == term, n.cfg.node_id
            assert n._transport is not None
            if n is not lead:
                assert n._transport.stats["holds"] == 0  # only a leader holds
        index, t2 = await c.write(b"after")
        assert t2 == term
        await until(
            lambda: all(
                n._raft is not None and n._raft.log.applied >= index for n in c.nodes.values()
            ),
            5,
            "every node applies the write after the idle spell",
        )
    finally:
        await c.stop_all()
