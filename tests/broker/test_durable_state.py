"""The broker's state kept in the node's log storage (DurableBodies):
checkpoints written in the log's group commits give back, after a crash or a
clean stop, exactly the state a full replay gives at the checkpoint's index,
so a restart replays only the tail."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_adapter import (
    BrokerState,
    CommandKind,
    Message,
    encode_produce,
    encode_retention,
    encode_topic,
)
from broker_adapter.bodies import _IVAL, DurableBodies, _ival_columns
from broker_adapter.node_sm import BrokerStateMachine
from dledger.core.types import ClusterConfig, Entry, Snapshot, SnapshotMeta
from dledger.statemachine import DurableStateMachine, SnapshotError
from dledger.storage.lmdb_store import LmdbStorage
from tests.broker.helpers import Log, replay
from tests.broker.test_properties import SETTINGS, answers, build, ops_st


def durable_sm(storage: LmdbStorage) -> BrokerStateMachine:
    sm = BrokerStateMachine(broker_name="test", bodies=DurableBodies())
    sm.attach_storage(storage)
    return sm


def answers_without_records(s: BrokerState) -> Any:
    return (s.stats(), [s.topic(n) for n in s.topic_names()], s.groups(), dict(s.epochs))


def snapshot_at_end(storage: LmdbStorage, entries: list[Entry]) -> bytes:
    """The snapshot of a second durable state fed every entry, in a
    storage of its own."""
    other = open_log(Path(storage.path + "-other"))
    try:
        sm = durable_sm(other)
        feed(other, sm, entries)
        return sm.broker.snapshot()
    finally:
        other.close()


def spy_entry_reads(storage: LmdbStorage) -> list[tuple[int, int]]:
    """Every ``storage.entries(lo, hi)`` call from now on, as (lo, hi)."""
    reads: list[tuple[int, int]] = []
    real = storage.entries

    def spy(lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        reads.append((lo, hi))
        return real(lo, hi, max_bytes)

    storage.entries = spy  # type: ignore[method-assign]
    return reads


def open_log(path: Path) -> LmdbStorage:
    # async: committed without fsync (these tests crash by closing, which
    # drops what was never synced, not what was committed)
    return LmdbStorage(path, flush="async")


def checkpoint_and_reopen(
    storage: LmdbStorage, sm: BrokerStateMachine
) -> tuple[LmdbStorage, BrokerStateMachine]:
    """A durable checkpoint of ``sm``, a clean stop, and a new state machine
    on the storage opened again (nothing loaded yet)."""
    sm.checkpoint()
    storage.sync()
    storage.close()
    storage = open_log(Path(storage.path))
    return storage, durable_sm(storage)


def feed(storage: LmdbStorage, sm: BrokerStateMachine, entries: list[Entry]) -> None:
    """What a node does: the entries are in the log before they are applied."""
    new = [e for e in entries if e.index > storage.last_index()]
    if new:
        storage.append(new)
        storage.sync()
    for e in entries:
        sm.apply(e)


def test_side_databases_move_with_the_log(tmp_path: Path) -> None:
    st = LmdbStorage(tmp_path / "log")
    st.side_db(b"x")
    seq = st.stage({b"x": {b"k": b"v", b"gone": None}})
    assert st.side_synced < seq
    with st.env.begin() as txn:
        assert txn.get(b"k", db=st.side_db(b"x")) is None  # staged, not written
    st.sync()
    assert st.side_synced >= seq
    with st.env.begin() as txn:
        assert txn.get(b"k", db=st.side_db(b"x")) == b"v"
    st.stage({b"x": {b"k": b"w"}})
    st.close()  # never synced: lost, as in a crash
    again = LmdbStorage(tmp_path / "log")
    db = again.side_db(b"x")  # opened before any transaction that uses it
    with again.env.begin() as txn:
        assert txn.get(b"k", db=db) == b"v"
    with pytest.raises(ValueError):
        again.side_db(b"log")  # the log's own
    again.close()


@settings(parent=SETTINGS, max_examples=60)
@given(ops_st, st.integers(0, 1000), st.integers(0, 1000), st.booleans())
def test_a_restart_takes_back_the_last_durable_checkpoint(
    ops: list[tuple[Any, int]], a_seed: int, b_seed: int, clean: bool
) -> None:
    """Apply, checkpoint at one point (synced), apply more, checkpoint again
    but crash before the sync (or stop cleanly after it): the reopened state
    is the one a full replay has at the durable checkpoint, and replaying
    the rest from there gives the full replay's answers and snapshot."""
    entries, _ = build(ops)
    first = a_seed % (len(entries) + 1)
    second = first + b_seed % (len(entries) - first + 1)
    mem, _ = replay(entries)
    with tempfile.TemporaryDirectory() as d:
        storage = open_log(Path(d) / "log")
        storage.append(entries)
        storage.sync()
        sm = durable_sm(storage)
        for e in entries[:first]:
            sm.apply(e)
        storage.stage({})  # nothing: no effect
        seq = sm.checkpoint()
        storage.sync()
        assert sm.checkpoint_durable(seq)
        for e in entries[first:second]:
            sm.apply(e)
        sm.checkpoint()
        if clean:
            storage.sync()
        storage.close()
        durable_at = second if clean else first

        storage = open_log(Path(d) / "log")
        back = durable_sm(storage)
        applied = back.load_checkpoint()
        assert applied == (entries[durable_at - 1].index if durable_at else 0)
        at, _ = replay(entries[:durable_at])
        assert answers(back.broker) == answers(at)
        for e in entries[durable_at:]:
            back.apply(e)
        assert answers(back.broker) == answers(mem)
        # the same state: equal snapshots (index only, both log-backed)
        assert back.broker.snapshot() == snapshot_at_end(storage, entries)
        storage.close()


def _produce_log(n: int) -> Log:
    log = Log()
    log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1000, 2))
    for k in range(n):
        log.add(encode_produce("t", [Message(body=b"m%d" % k, queue=k % 2)], 1000 + k))
    return log


def test_a_checkpoint_refused_after_loading_leaves_an_empty_state_to_rebuild(
    tmp_path: Path,
) -> None:
    """The node refuses a checkpoint that loads fine when its applied index
    is outside the durable log (async mode, power loss: ahead of the durable
    commit index) and rebuilds from the log's start. Discarding it must
    forget what loading took back: the jepsen power nemesis found a replica
    that stopped on "entry 1 applied after 3286: apply order broken"."""
    log = _produce_log(20)
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    feed(storage, sm, log.entries)
    storage, back = checkpoint_and_reopen(storage, sm)
    assert back.load_checkpoint() == log.entries[-1].index
    back.discard_checkpoint()  # what Node._load_checkpoint does when it refuses it
    assert back.last_applied == 0 and back.broker.applied_index == 0
    assert back.broker.topic_names() == []
    for e in log.entries:  # the rebuild, from the first entry
        back.apply(e)
    mem, _ = replay(log.entries)
    assert answers(back.broker) == answers(mem)
    assert back.broker.snapshot() == snapshot_at_end(storage, log.entries)
    storage.close()


def test_changes_stay_in_memory_until_their_checkpoint_is_durable(tmp_path: Path) -> None:
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = _produce_log(20)
    feed(storage, sm, log.entries)
    bodies = sm.broker.bodies
    assert isinstance(bodies, DurableBodies)
    assert not bodies._pending  # the records are in the log entries
    assert len(bodies._cq.over) == 2  # the index blocks of both queues, read through from memory
    assert len(bodies._pos_rows) == 20
    assert sm.broker.read("t", 0, 0, 100).messages[0].body == b"m0"
    seq = sm.checkpoint()
    assert not sm.checkpoint_durable(seq)
    assert sm.broker.read("t", 1, 0, 100).messages[-1].body == b"m19"
    storage.sync()
    assert sm.checkpoint_durable(seq)
    assert not bodies._cq.over and not bodies._pos_rows  # all on disk now
    assert sm.broker.read("t", 1, 0, 100).messages[-1].body == b"m19"  # from LMDB
    feed(storage, sm, [log.add(encode_produce("t", [Message(body=b"late", queue=0)], 5000))])
    frozen = sm.broker.snapshot_builder()  # with "late" still only in memory
    feed(storage, sm, [log.add(encode_produce("t", [Message(body=b"later", queue=1)], 5001))])
    again, _ = replay(log.entries[:-1])
    restored = BrokerState.restore(frozen())  # index only: records stay in the log
    assert answers_without_records(restored) == answers_without_records(again)
    storage.close()


def test_a_damaged_checkpoint_is_refused_then_discarded(tmp_path: Path) -> None:
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    feed(storage, sm, _produce_log(5).entries)
    sm.checkpoint()
    storage.sync()
    db = storage.side_db(b"broker")
    with storage.env.begin(write=True) as txn:
        raw = txn.get(b"checkpoint", db=db)
        assert raw is not None
        blob = bytearray(raw)
        blob[-3] ^= 0x40
        txn.put(b"checkpoint", bytes(blob), db=db)
    back = durable_sm(storage)
    with pytest.raises(SnapshotError):
        back.load_checkpoint()
    back.discard_checkpoint()
    assert back.load_checkpoint() is None
    with storage.env.begin() as txn:
        assert txn.stat(storage.side_db(b"records"))["entries"] == 0
    storage.close()


def test_a_restored_snapshot_replaces_the_stored_state(tmp_path: Path) -> None:
    """A snapshot installed from the leader: the old checkpoint goes first
    (a crash before the next one rebuilds rather than mixes), then the
    restored state's own checkpoint reads back equal."""
    log = _produce_log(30)
    leader_sm = BrokerStateMachine(broker_name="test")
    for e in log.entries:
        leader_sm.apply(e)
    leader = leader_sm.broker
    snap = leader_sm.snapshot()
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    feed(storage, sm, _produce_log(3).entries)
    sm.checkpoint()
    storage.sync()
    sm.restore(snap)
    assert sm.durable and isinstance(sm, DurableStateMachine)
    storage.close()  # crash before the checkpoint of the restored state
    storage = open_log(tmp_path / "log")
    assert durable_sm(storage).load_checkpoint() is None  # rebuild, never a mix
    sm = durable_sm(storage)
    sm.restore(snap)
    storage, back = checkpoint_and_reopen(storage, sm)
    assert back.load_checkpoint() == log.entries[-1].index
    assert answers(back.broker) == answers(leader)
    storage.close()


def test_lmdb_is_what_the_tests_think(tmp_path: Path) -> None:
    # The damage test writes through the environment directly: make sure the
    # environment handle is the storage's own (one per process per file).
    storage = LmdbStorage(tmp_path / "log")
    assert isinstance(storage.env, lmdb.Environment)
    storage.close()


def test_a_record_not_in_this_replicas_log_is_catching_up_not_damage(tmp_path: Path) -> None:
    """An index-only snapshot installed on a replica whose log starts after
    it: the index names records in entries it never held. A read of one is
    503 CATCHING_UP (ask again or elsewhere), never a record and never
    reported as damage."""
    from dledger.errors import CatchingUp
    from http_api.errors import status_of

    leader_log = open_log(tmp_path / "leader")
    leader = durable_sm(leader_log)
    log = _produce_log(6)
    feed(leader_log, leader, log.entries)
    snap = leader.snapshot()
    assert b"m3" not in snap  # index only: the records stay in the log
    storage = open_log(tmp_path / "follower")
    follower = durable_sm(storage)
    follower.restore(snap)
    assert follower.broker.topic("t").queues[1].max_offset == 3
    with pytest.raises(CatchingUp) as exc:
        follower.broker.read("t", 1, 0)
    assert status_of(exc.value) == 503 and exc.value.code == "CATCHING_UP"
    with pytest.raises(CatchingUp):
        follower.broker.read_columns("t", 1, 0)
    leader_log.close()
    storage.close()


def test_a_damaged_index_entry_is_reported_never_followed(tmp_path: Path) -> None:
    """One flipped bit in a ConsumeQueue entry (here: its physical offset,
    by exactly one record's length, so it would point at the neighbouring
    message) fails the entry's CRC: a read is 503 naming topic/queue@offset,
    and an apply that needs it stops the replica instead of diverging."""
    from dledger.errors import StorageCorrupted
    from http_api.errors import status_of

    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = _produce_log(8)
    feed(storage, sm, log.entries)
    seq = sm.checkpoint()
    storage.sync()
    assert sm.checkpoint_durable(seq)  # the overlay forgets: reads go to LMDB
    db = storage.side_db(b"cqblocks")
    qid = sm.broker._topics["t"].queues[1].qid
    key = struct.pack(">IQ", qid, 0)  # offsets 0..679 of queue 1
    with storage.env.begin(write=True) as txn:
        raw = txn.get(key, db=db)
        assert raw is not None
        unit = 24  # offset 2's entry: move its physical offset by one record
        phys, size = struct.unpack_from(">qi", raw, 2 * unit)
        raw = raw[: 2 * unit] + struct.pack(">q", phys + size) + raw[2 * unit + 8 :]
        txn.put(key, raw, db=db)
    bodies = sm.broker.bodies
    assert isinstance(bodies, DurableBodies)
    bodies._cq._cache.clear()  # what a restart would read
    with pytest.raises(StorageCorrupted) as exc:
        sm.broker.read("t", 1, 0)
    assert "t/1@0" in str(exc.value) and status_of(exc.value) == 503
    with pytest.raises(StorageCorrupted):
        sm.broker.read_columns("t", 1, 0)
    # retention dropping that entry on this replica: stop, do not diverge
    with pytest.raises(StorageCorrupted):
        feed(storage, sm, [log.add(encode_retention(9000, 1, 0))])
    storage.close()


def test_a_damaged_entry_map_is_reported_never_followed(tmp_path: Path) -> None:
    """A flipped bit in the map from CommitLog positions to log entries
    names the wrong entry: the read sees that the entry does not hold the
    position and reports damage (503), never slicing another entry."""
    from dledger.errors import StorageCorrupted

    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = _produce_log(6)
    feed(storage, sm, log.entries)
    seq = sm.checkpoint()
    storage.sync()
    assert sm.checkpoint_durable(seq)
    db = storage.side_db(b"entrypos")
    target = log.entries[3]  # m2, queue 0 offset 1
    with storage.env.begin(write=True) as txn:
        key = struct.pack(">Q", target.pos)
        raw = txn.get(key, db=db)
        assert raw is not None and raw[:8] == struct.pack(">Q", target.index)
        txn.put(key, struct.pack(">Q", target.index + 1) + raw[8:], db=db)
    with pytest.raises(StorageCorrupted) as exc:
        sm.broker.read("t", 0, 1, 1)
    assert "t/0@1" in str(exc.value)
    assert sm.broker.read("t", 0, 0, 1).messages[0].body == b"m0"  # the rest still reads
    storage.close()


def test_index_blocks_across_boundaries_with_retention_and_topic_deletion(
    tmp_path: Path,
) -> None:
    """Thousands of messages per queue cross index blocks (680 entries
    each): reads, retention from the head, a restart from the checkpoint and
    a topic deletion answer exactly like the in-memory store, and blocks
    wholly behind the head (or of a deleted topic) are deleted on disk."""
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = Log()
    ts = 1000
    entries = [log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", ts, 2))]
    entries.append(log.add(encode_topic(CommandKind.CREATE_TOPIC, "u", ts, 1)))
    for k in range(60):
        ts += 1
        msgs = [Message(body=b"%d-%d" % (k, j), queue=j % 2) for j in range(50)]
        entries.append(log.add(encode_produce("t", msgs, ts)))
    entries.append(log.add(encode_produce("u", [Message(body=b"x" * 10)] * 20, ts)))
    # keep about 900 records of t (each ~40 bytes): queue heads move past
    # the first block boundary
    entries.append(log.add(encode_retention(ts, 900 * 40, 0)))
    for k in range(60, 80):
        ts += 1
        msgs = [Message(body=b"%d-%d" % (k, j), queue=j % 2) for j in range(50)]
        entries.append(log.add(encode_produce("t", msgs, ts)))
    feed(storage, sm, entries)
    mem, _ = replay(entries)
    assert answers(sm.broker) == answers(mem)
    lo = sm.broker.topic("t").queues[0].min_offset
    assert lo > 680, lo  # the head moved past block 0
    seq = sm.checkpoint()
    storage.sync()
    assert sm.checkpoint_durable(seq)
    qid = sm.broker._topics["t"].queues[0].qid
    db = storage.side_db(b"cqblocks")
    with storage.env.begin() as txn:
        assert txn.get(struct.pack(">IQ", qid, 0), db=db) is None  # wholly behind the head
        assert txn.get(struct.pack(">IQ", qid, lo // 680), db=db) is not None
    storage.close()

    storage = open_log(tmp_path / "log")
    back = durable_sm(storage)
    assert back.load_checkpoint() == entries[-1].index
    assert answers(back.broker) == answers(mem)
    uqid = back.broker._topics["u"].queues[0].qid
    more = [log.add(encode_topic(CommandKind.DELETE_TOPIC, "u", ts))]
    feed(storage, back, more)
    mem2, _ = replay(entries + more)
    assert answers(back.broker) == answers(mem2)
    seq = back.checkpoint()
    storage.sync()
    assert back.checkpoint_durable(seq)
    db = storage.side_db(b"cqblocks")
    with storage.env.begin() as txn:
        assert txn.get(struct.pack(">IQ", uqid, 0), db=db) is None  # the deleted topic's block
    storage.close()


def test_reads_during_an_off_loop_restore_are_catching_up(tmp_path: Path) -> None:
    """A node fills the store from a snapshot in a worker thread
    (prepare_restore) and swaps the state in on its loop; reads that come in
    between answer 503 CATCHING_UP rather than see a half-filled store."""
    from dledger.errors import CatchingUp

    leader_log = open_log(tmp_path / "leader")
    leader = durable_sm(leader_log)
    feed(leader_log, leader, _produce_log(6).entries)
    snap = leader.snapshot()
    storage = open_log(tmp_path / "follower")
    follower = durable_sm(storage)
    log = _produce_log(2)
    feed(storage, follower, log.entries)
    bodies = follower.broker.bodies
    assert isinstance(bodies, DurableBodies)
    seen: list[BaseException] = []
    real = bodies.replace_all

    def replace_all(*a: Any, **kw: Any) -> None:
        real(*a, **kw)
        try:  # a read arriving mid-restore, on the old state
            follower.broker.read("t", 0, 0)
        except CatchingUp as exc:
            seen.append(exc)

    bodies.replace_all = replace_all  # type: ignore[method-assign]
    finish = follower.prepare_restore(snap)
    assert len(seen) == 1 and not bodies.restoring
    assert follower.broker.topic("t").queues[0].max_offset == 1  # not swapped yet
    finish()
    assert follower.broker.topic("t").queues[0].max_offset == 3
    leader_log.close()
    storage.close()


def test_a_store_damaged_while_down_is_refused_at_load(tmp_path: Path) -> None:
    """Index blocks and entry-map rows are all checked when the checkpoint
    is taken back, so a node rebuilds its state from the log at start
    instead of finding the damage with a read (or an apply) later."""
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    feed(storage, sm, _produce_log(10).entries)
    sm.checkpoint()
    storage.sync()
    storage.close()
    for db_name, at in ((b"cqblocks", 30), (b"entrypos", 3)):
        storage = open_log(tmp_path / "log")
        db = storage.side_db(db_name)
        with storage.env.begin(write=True) as txn:
            cur = txn.cursor(db=db)
            assert cur.last()
            key, raw = bytes(cur.key()), bytearray(cur.value())
            raw[at] ^= 0x10
            txn.put(key, bytes(raw), db=db)
        with pytest.raises(SnapshotError, match="damaged"):
            durable_sm(storage).load_checkpoint()
        with storage.env.begin(write=True) as txn:  # undo, for the next round
            raw[at] ^= 0x10
            txn.put(key, bytes(raw), db=db)
        assert durable_sm(storage).load_checkpoint() == 11
        storage.close()


def test_retention_deletes_archived_records_and_stages_nothing_for_logged_ones(
    tmp_path: Path,
) -> None:
    """Records restored from a snapshot that carries them (the archive) are
    deleted from disk when retention drops them. Records read from the log
    have no row of their own: dropping them stages no record change (each
    one used to cost a lookup in the checkpoint's commit). Both answer like
    the in-memory store throughout."""
    log = _produce_log(30)
    leader_sm = BrokerStateMachine(broker_name="test")
    for e in log.entries:
        leader_sm.apply(e)
    snap = leader_sm.snapshot()
    storage = open_log(tmp_path / "log")
    staged: list[dict[bytes, dict[bytes, bytes | None]]] = []
    stage = storage.stage

    def spy(changes: dict[bytes, dict[bytes, bytes | None]]) -> int:
        staged.append({k: dict(v) for k, v in changes.items()})
        return stage(changes)

    storage.stage = spy  # type: ignore[method-assign]
    sm = durable_sm(storage)
    last = log.entries[-1]
    meta = SnapshotMeta(last.index, last.term, last.end_pos, ClusterConfig((1,)))
    storage.apply_snapshot(Snapshot(meta, snap))  # the log continues after it
    sm.restore(snap)
    sm.checkpoint()
    storage.sync()
    archived = storage.side_db(b"records")
    with storage.env.begin() as txn:
        before = txn.stat(archived)["entries"]
    assert before > 0, "the snapshot's records are in the archive"
    # new records, in this replica's log, after the archived ones
    ts = 9000
    more = [log.add(encode_produce("t", [Message(body=b"y" * 30)] * 40, ts))]
    feed(storage, sm, more)
    staged.clear()
    # keep about the newest 20 records: every archived one goes, then logged ones
    feed(storage, sm, [log.add(encode_retention(ts, 20 * 60, 0))])
    seq = sm.checkpoint()
    storage.sync()
    assert sm.checkpoint_durable(seq)
    mem, _ = replay(log.entries)
    assert answers(sm.broker) == answers(mem)
    with storage.env.begin() as txn:
        assert txn.stat(archived)["entries"] == 0, "archived records dropped on disk"
    record_changes = [c.get(b"records", {}) for c in staged]
    assert sum(len(c) for c in record_changes) == before, (
        "exactly the archived records are deleted; logged ones stage nothing"
    )
    storage.close()


def test_a_page_of_messages_reads_each_log_entry_once(tmp_path: Path) -> None:
    """A JSON page reads its messages one by one; those of one produce share
    a log entry, which is read (joined from its parts and CRC-checked) once
    per page, not once per message (that was 5,500 messages/s)."""
    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = Log()
    entries = [log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1000, 1))]
    for k in range(3):  # three produce entries of 400 messages (parted records)
        msgs = [Message(body=b"%d-%03d" % (k, j) + b"x" * 300, queue=0) for j in range(400)]
        entries.append(log.add(encode_produce("t", msgs, 1000 + k)))
    feed(storage, sm, entries)
    reads = spy_entry_reads(storage)
    page = sm.broker.read("t", 0, 0, max_messages=1000, max_bytes=1 << 30)
    assert len(page.messages) == 1000
    assert [m.body[:5] for m in page.messages[398:402]] == [b"0-398", b"0-399", b"1-000", b"1-001"]
    assert len(reads) == 3, reads  # the three produce entries, once each
    storage.close()


@pytest.mark.parametrize("where", ["pending", "durable", "checkpointed"])
def test_columnar_pages_are_read_and_slice_each_entry_once(tmp_path: Path, where: str) -> None:
    """read_columns in the node's store (records in the log) takes the
    columnar path (broker_adapter.columnar: one read per log entry, numpy
    slicing) and holds exactly what read() gives, at every offset, page
    cap and byte cap: records of one size or of many, adjacent in an entry
    or interleaved with another queue's, with and without tags, keys and
    properties. Log entries still buffered, synced, or with the index
    checkpointed."""
    from tests.broker.test_properties import assert_columns_are_read

    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = Log()
    entries = [log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 2))]
    for rnd in range(6):
        msgs = [
            Message(
                # rounds 0 and 1: every size differs; then equal sizes
                b"v%d-%03d:" % (rnd, i) + b"x" * (i % 9 if rnd < 2 else 4),
                tag="a" if rnd == 4 and i % 3 == 0 else "",
                keys=("k", "z") if rnd == 5 and i % 7 == 0 else (),
                properties=(("p", str(i)),) if rnd == 5 and i % 11 == 0 else (),
                # odd rounds put runs of ten in a queue, even ones alternate
                queue=(i // 10) % 2 if rnd % 2 else i % 2,
                born_ts_ms=1_700_000_000_000 + 1000 * rnd + i,
            )
            for i in range(50)
        ]
        entries.append(log.add(encode_produce("t", msgs, 2 + rnd)))
    for q in (0, 1):  # long runs of equal records (tagged in queue 1): strided copies
        msgs = [
            Message(b"run-%04d" % i, tag="tg" if q else "", queue=q, born_ts_ms=i)
            for i in range(300)
        ]
        entries.append(log.add(encode_produce("t", msgs, 10 + q)))
    storage.append(entries)
    if where != "pending":
        storage.sync()
    for e in entries:
        sm.apply(e)
    if where == "checkpointed":
        seq = sm.checkpoint()
        storage.sync()
        assert sm.checkpoint_durable(seq)
    reads = spy_entry_reads(storage)
    s = sm.broker
    columnar = other = 0
    for q in (0, 1):
        hi = s.queue_range("t", q)[1]
        for off in [*range(0, hi + 1, 7), hi]:
            for mm, mb in ((1000, 1 << 20), (200, 1 << 20), (5, 1 << 20), (40, 300), (3, 1)):
                r = s.read("t", q, off, mm, mb)
                reads.clear()
                c = s.read_columns("t", q, off, mm, mb)
                assert_columns_are_read(c, r, "t", q)
                if not len(c):
                    continue
                assert c.records.columnar, (q, off, mm, mb)
                columnar += 1
                if any(m.tag or m.keys or m.properties for m in r.messages):
                    other += 1
                # one read per produce entry the page touches
                touched = {
                    e.index for e in entries for p in c.phys_offsets if e.pos <= p < e.end_pos
                }
                assert sorted(lo for lo, _hi in reads) == sorted(touched), (q, off, mm, mb)
    assert columnar > 60 and other > 10, (columnar, other)
    storage.close()


def test_the_columnar_slicer_refuses_what_does_not_check() -> None:
    """columnar.page_records answers None (the general path then decodes
    and names the record) for a record whose length is not the index's,
    whose version is unknown, that runs past its entry, or whose keys run
    past it; and the columns of records that check, with and without tags,
    keys and properties."""
    import numpy as np

    from broker_adapter import codec, columnar

    msgs = [
        Message(b"body-0", born_ts_ms=10),
        Message(b"body-1", tag="t1", born_ts_ms=11, sharding_key="s"),
        Message(b"body-2", keys=("k1", "k2"), properties=(("p", "v"),), born_ts_ms=12),
        Message(b"", tag="t3", born_ts_ms=13),
    ]
    recs = [codec.encode_record(m) for m in msgs]
    data = b"".join(recs)
    pos = 1000
    e = Entry(7, 1, data=data, pos=pos)
    phys = np.array([pos + sum(len(r) for r in recs[:i]) for i in range(4)], np.int64)
    sizes = np.array([len(r) for r in recs], np.int64)
    ok = columnar.page_records([(e, 4)], phys, sizes)
    assert ok is not None
    assert ok.born_ts_ms.tolist() == [10, 11, 12, 13]
    assert ok.body_list() == [b"body-0", b"body-1", b"body-2", b""]
    assert ok.tag_list() == [None, "t1", None, "t3"]
    assert ok.key_offsets.tolist() == [0, 0, 0, 2, 2] and ok.keys == ["k1", "k2"]
    assert ok.prop_offsets.tolist() == [0, 0, 0, 1, 1]
    assert (ok.prop_keys, ok.prop_values) == (["p"], ["v"])
    wrong_size = sizes.copy()
    wrong_size[1] += 1
    assert columnar.page_records([(e, 4)], phys, wrong_size) is None
    bad_ver = bytearray(data)
    bad_ver[len(recs[0]) + 8] = 9  # the second record's version byte
    bad = Entry(7, 1, data=bytes(bad_ver), pos=pos)
    assert columnar.page_records([(bad, 4)], phys, sizes) is None
    short = Entry(7, 1, data=data[:-1], pos=pos)  # the last record runs past its entry
    assert columnar.page_records([(short, 4)], phys, sizes) is None
    long_tag = bytearray(data)  # the second record's tag length runs past it
    at = len(recs[0]) + codec.RECORD_FIXED_SIZE + 2 + 1
    long_tag[at : at + 2] = (200).to_bytes(2, "big")
    bad = Entry(7, 1, data=bytes(long_tag), pos=pos)
    assert columnar.page_records([(bad, 4)], phys, sizes) is None
    bad_keys = bytearray(data)  # the third record's key is damaged: its CRC fails
    bad_keys[sum(len(r) for r in recs[:2]) + 40] ^= 1
    bad = Entry(7, 1, data=bytes(bad_keys), pos=pos)
    assert columnar.page_records([(bad, 4)], phys, sizes) is None


def test_without_numpy_pages_are_decoded_record_by_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy is optional on a node: without it read_columns decodes each
    record (the general path) and the page holds the same rows."""
    from broker_adapter import state as state_mod
    from tests.broker.test_properties import assert_columns_are_read

    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = _produce_log(8)
    feed(storage, sm, log.entries)
    monkeypatch.setattr(state_mod, "_COLUMNAR", [None])
    c = sm.broker.read_columns("t", 1, 0, 100)
    assert len(c) and not c.records.columnar
    assert_columns_are_read(c, sm.broker.read("t", 1, 0, 100), "t", 1)
    monkeypatch.setattr(state_mod, "_COLUMNAR", [])  # imported again: numpy is here
    assert sm.broker.read_columns("t", 1, 0, 100).records.columnar
    storage.close()


def test_a_columnar_page_holds_a_bounded_amount_of_log_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entries a columnar page joins are bounded (PAGE_ENTRY_BYTES,
    after the first): a queue whose messages sit one to a large entry gets
    shorter pages, which read on from next_offset to the same messages."""
    from broker_adapter import state as state_mod

    storage = open_log(tmp_path / "log")
    sm = durable_sm(storage)
    log = Log()
    entries = [log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 2))]
    for k in range(6):  # one message of queue 0 per entry, among 30 of queue 1
        msgs = [Message(b"q0-%d" % k, queue=0)]
        msgs += [Message(b"q1-%d-%d" % (k, j) + b"x" * 200, queue=1) for j in range(30)]
        entries.append(log.add(encode_produce("t", msgs, 2 + k)))
    feed(storage, sm, entries)
    s = sm.broker
    monkeypatch.setattr(state_mod, "PAGE_ENTRY_BYTES", 2 * len(entries[1].data))
    reads = spy_entry_reads(storage)
    c = s.read_columns("t", 0, 0, 100)
    assert c.records.columnar
    assert c.records.body_list() == [b"q0-0", b"q0-1"] and c.next_offset == 2
    assert len(reads) == 3  # the third entry was read, then left for the next page
    got, off = [], 0
    while off < s.queue_range("t", 0)[1]:
        c = s.read_columns("t", 0, off, 100)
        got += c.records.body_list()
        off = c.next_offset
    assert got == [m.body for m in s.read("t", 0, 0, 100).messages]
    storage.close()


_I64 = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(st.tuples(_I64, st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**32 - 1), _I64)))
@settings(max_examples=200, deadline=None)
def test_index_rows_decode_to_columns_like_unpacking_each_row(
    rows: list[tuple[int, int, int, int]],
) -> None:
    """The snapshot's column decoder (whole buffers, no loop per row) gives
    what unpacking row by row gives, at every extreme of every field."""
    raw = b"".join(_IVAL.pack(*r) for r in rows)
    cols = _ival_columns(raw)
    assert [list(c) for c in cols] == [[r[k] for r in rows] for k in range(4)]
    assert all(c.typecode == "q" for c in cols)
    if rows:
        with pytest.raises(ValueError, match="whole number"):
            _ival_columns(raw[:-1])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 900)),
        min_size=1,
        max_size=6,
    ),
    st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=4),
)
def test_a_run_of_index_entries_stores_what_a_put_of_each_does(
    runs: list[tuple[int, int, int]], durable_blocks: set[tuple[int, int]]
) -> None:
    """index_put_run (a produce's entries of one queue, packed at once) and
    index_put of each entry leave the same blocks: across block boundaries,
    after gaps, over blocks read back from LMDB."""
    from broker_adapter.bodies import _BKEY, BLOCK_UNITS, _BlockIndex

    def fresh() -> _BlockIndex:
        bi = _BlockIndex(None)  # type: ignore[arg-type]
        stored = {_BKEY.pack(q, b): bytes(range(q + b, q + b + 48)) for q, b in durable_blocks}
        bi._durable = stored.get  # type: ignore[method-assign]
        return bi

    one, run = fresh(), fresh()
    hi = [0, 0, 0, 0]
    for q, gap, n in runs:
        off = hi[q] + gap * (BLOCK_UNITS - 7)
        flat = [v for k in range(n) for v in (1000 * q + off + k, 140 + k, k * 7, 5 + q)]
        for k in range(n):
            one.put(q, off + k, (flat[4 * k], flat[4 * k + 1], flat[4 * k + 2], flat[4 * k + 3]))
        run.put_run(q, off, flat)
        hi[q] = off + n
    assert run.over == one.over
