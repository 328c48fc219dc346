"""Property tests: the broker is a deterministic function of its entries.

Generated logs mix every command kind (with bad ones among them), NOOPs,
raw non-broker payloads, term changes and non-monotonic leader clocks.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_adapter import (
    BrokerError,
    BrokerState,
    CommandKind,
    Message,
    ProduceResult,
    ResetMode,
    encode_commit_offsets,
    encode_produce,
    encode_register_producer,
    encode_reset_group,
    encode_retention,
    encode_topic,
)
from broker_adapter import state as state_mod
from broker_adapter.bodies import Bodies, BodyMissing, LmdbBodies, MemoryBodies
from broker_adapter.errors import OffsetOutOfRange
from broker_adapter.state import ReadColumns, ReadResult
from dledger.core.types import Entry
from dledger.errors import StorageCorrupted
from http_api import arrow
from tests.broker.helpers import Log, all_messages, replay

TOPICS = ["a", "b", "c"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Op:
    kind: str
    args: tuple[Any, ...]


msg_st = st.builds(
    Message,
    body=st.binary(max_size=40),
    tag=st.sampled_from(["", "x", "y"]),
    keys=st.lists(st.sampled_from(["k1", "k2"]), max_size=2).map(tuple),
    properties=st.lists(
        st.tuples(st.sampled_from(["p", "q"]), st.text(max_size=3)), max_size=2
    ).map(tuple),
    queue=st.one_of(st.none(), st.integers(0, 4)),
    sharding_key=st.one_of(st.none(), st.sampled_from(["s1", "s2", "s3"])),
    born_ts_ms=st.integers(0, 10_000),
)

op_st = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(TOPICS), st.integers(1, 4)),
    st.tuples(st.just("update"), st.sampled_from(TOPICS), st.integers(1, 5)),
    st.tuples(st.just("delete"), st.sampled_from(TOPICS)),
    st.tuples(
        st.just("produce"),
        st.sampled_from(TOPICS),
        st.lists(msg_st, min_size=1, max_size=4),
        st.integers(0, 2),
    ),
    st.tuples(
        st.just("iproduce"),
        st.sampled_from(TOPICS),
        st.lists(msg_st.map(lambda m: Message(m.body, m.tag, queue=None)), min_size=1, max_size=3),
        st.integers(1, 3),
        st.integers(0, 1),
        st.integers(0, 8),
    ),
    st.tuples(st.just("retry"), st.integers(0, 50)),
    st.tuples(st.just("register"), st.integers(0, 3)),
    st.tuples(
        st.just("commit"),
        st.sampled_from(["g1", "g2"]),
        st.sampled_from(TOPICS),
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.tuples(
        st.just("reset"),
        st.sampled_from(["g1", "g2"]),
        st.sampled_from(TOPICS),
        st.sampled_from(list(ResetMode)),
        st.integers(0, 3000),
    ),
    st.tuples(
        st.just("retention"),
        st.sampled_from([0, 200, 600, 2000]),
        st.sampled_from([0, 500, 5000]),
        st.sampled_from([0, 800, 100_000]),
    ),
    st.tuples(st.just("noop")),
    st.tuples(st.just("raw"), st.binary(max_size=20)),
    st.tuples(st.just("term")),
)

ops_st = st.lists(st.tuples(op_st, st.integers(-50, 400)), max_size=60)


def build(ops: list[tuple[Any, int]]) -> tuple[list[Entry], dict[int, int]]:
    """Entries for ``ops``; also which entry retries which (retry -> original)."""
    log = Log()
    ts = 1000
    produced: list[tuple[bytes, int]] = []  # idempotent produce payloads and their entry
    retries: dict[int, int] = {}
    for op, dt in ops:
        ts = max(0, ts + dt)  # leader clocks may go backwards
        kind = op[0]
        if kind == "create":
            log.add(encode_topic(CommandKind.CREATE_TOPIC, op[1], ts, op[2]))
        elif kind == "update":
            log.add(encode_topic(CommandKind.UPDATE_TOPIC, op[1], ts, op[2]))
        elif kind == "delete":
            log.add(encode_topic(CommandKind.DELETE_TOPIC, op[1], ts))
        elif kind == "produce":
            log.add(encode_produce(op[1], op[2], ts, auto_create_queues=op[3]))
        elif kind == "iproduce":
            data = encode_produce(
                op[1],
                op[2],
                ts,
                producer_id=op[3],
                epoch=op[4],
                base_seq=op[5],
                auto_create_queues=2,
            )
            e = log.add(data)
            produced.append((data, e.index))
        elif kind == "retry":
            if produced:
                data, idx = produced[op[1] % len(produced)]
                retries[log.add(data).index] = idx
        elif kind == "register":
            log.add(encode_register_producer(ts, op[1]))
        elif kind == "commit":
            log.add(encode_commit_offsets(op[1], [(op[2], op[3], op[4])], ts))
        elif kind == "reset":
            log.add(encode_reset_group(op[1], op[2], op[3], ts, op[4]))
        elif kind == "retention":
            log.add(encode_retention(ts, op[1], op[2], op[3]))
        elif kind == "noop":
            log.noop()
        elif kind == "raw":
            log.add(op[1])
        else:
            log.term += 1
            log.noop()
    return log.entries, retries


def answers(s: BrokerState) -> Any:
    return (
        s.stats(),
        [s.topic(n) for n in s.topic_names()],
        all_messages(s),
        {g: s.group_offsets(g) for g in s.groups()},
        [s.producer(p) for p in range(1, 5)],
        dict(s.epochs),
    )


@SETTINGS
@given(ops_st)
def test_same_entries_give_identical_state_and_answers(ops: list[tuple[Any, int]]) -> None:
    entries, _ = build(ops)
    s1, r1 = replay(entries)
    s2, r2 = replay(entries)
    assert r1 == r2
    assert s1.snapshot() == s2.snapshot()
    assert answers(s1) == answers(s2)


@SETTINGS
@given(ops_st, st.integers(0, 1000))
def test_snapshot_plus_remaining_entries_equals_full_replay(
    ops: list[tuple[Any, int]], cut_seed: int
) -> None:
    entries, _ = build(ops)
    cut = cut_seed % (len(entries) + 1)
    full, full_results = replay(entries)
    part, _ = replay(entries[:cut])
    snap = part.snapshot()
    restored = BrokerState.restore(snap)
    assert restored.snapshot() == snap
    rest = [restored.apply(e) for e in entries[cut:]]
    assert rest == full_results[cut:]
    assert restored.snapshot() == full.snapshot()
    assert answers(restored) == answers(full)


@SETTINGS
@given(ops_st)
def test_confirm_offset_and_queue_offsets_are_monotonic(ops: list[tuple[Any, int]]) -> None:
    entries, _ = build(ops)
    s = BrokerState("m")
    seen: dict[tuple[str, int], tuple[int, int]] = {}
    confirm = 0
    for e in entries:
        before = set(s.topic_names())
        s.apply(e)
        assert s.confirm_offset == e.end_pos >= confirm
        confirm = s.confirm_offset
        assert s.applied_index == e.index
        deleted = before - set(s.topic_names())
        # A deleted topic's queues start a new history if it is recreated.
        for key in [k for k in seen if k[0] in deleted]:
            del seen[key]
        for name in s.topic_names():
            for q in s.topic(name).queues:
                lo, hi = seen.get((name, q.queue), (0, 0))
                assert q.min_offset >= lo and q.max_offset >= hi
                assert q.min_offset <= q.max_offset
                seen[(name, q.queue)] = (q.min_offset, q.max_offset)


@SETTINGS
@given(ops_st)
def test_retried_idempotent_batch_never_duplicates(ops: list[tuple[Any, int]]) -> None:
    entries, retries = build(ops)
    s, results = replay(entries)
    by_index = {e.index: r for e, r in zip(entries, results, strict=True)}
    for retry_idx, orig_idx in retries.items():
        orig, again = by_index[orig_idx], by_index[retry_idx]
        if isinstance(again, ProduceResult):
            # Stored again only if the original was refused (and the state
            # changed since, e.g. the producer registered); never twice.
            if isinstance(orig, ProduceResult):
                assert again.duplicate and again.acks == orig.acks
        else:
            assert isinstance(again, BrokerError)
    # Every stored idempotent message is at exactly one (queue, offset):
    # commit offsets (physical) are unique and each belongs to one entry.
    phys = [m.phys_offset for msgs in all_messages(s).values() for m in msgs]  # type: ignore[attr-defined]
    assert len(phys) == len(set(phys))
    acked: dict[int, int] = {}
    for idx, r in by_index.items():
        if isinstance(r, ProduceResult) and not r.duplicate:
            for a in r.acks:
                assert a.phys_offset not in acked
                acked[a.phys_offset] = idx
    stored_by = {acked[p] for p in phys}
    for retry_idx, orig_idx in retries.items():
        if isinstance(by_index[orig_idx], ProduceResult):
            assert retry_idx not in stored_by, "a retried batch was stored twice"


@SETTINGS
@given(ops_st, st.integers(0, 1000))
def test_records_on_disk_answer_exactly_like_records_in_memory(
    ops: list[tuple[Any, int]], cut_seed: int
) -> None:
    """The same entries on a state keeping records in LMDB (small batches, so
    commits, deletes by retention and topic deletion all reach the disk) and
    on one keeping them in memory: identical results, answers and snapshot
    bytes. A snapshot frozen at the cut and encoded only after the remaining
    entries were applied equals the snapshot taken at the cut; restoring it
    into the LMDB store and replaying the rest equals the full replay."""
    entries, _ = build(ops)
    cut = cut_seed % (len(entries) + 1)
    with tempfile.TemporaryDirectory() as d:
        disk = BrokerState("test", LmdbBodies(os.path.join(d, "b"), batch=3))
        mem, mem_results = replay(entries)
        res = [disk.apply(e) for e in entries[:cut]]
        at_cut = disk.snapshot()
        frozen = disk.snapshot_builder()
        res += [disk.apply(e) for e in entries[cut:]]
        assert res == mem_results
        assert answers(disk) == answers(mem)
        assert disk.snapshot() == mem.snapshot()
        assert frozen() == at_cut
        restored = BrokerState.restore(at_cut, LmdbBodies(os.path.join(d, "r"), batch=5))
        for e in entries[cut:]:
            restored.apply(e)
        assert answers(restored) == answers(mem)
        assert restored.snapshot() == mem.snapshot()


class OneHeadAtATime(BrokerState):
    """Size retention as it was first written: pop the oldest head across
    the queues, drop it, look the queue's next head up, repeat."""

    def _enforce_size(self) -> None:
        qs = self._all_queues()
        heap = [(h, k) for k, q in enumerate(qs) if (h := self._head_phys(q)) is not None]
        heapq.heapify(heap)
        while self.stored_bytes > self.retention_max_bytes and heap:
            _, k = heapq.heappop(heap)
            self._drop_head(qs[k])
            h = self._head_phys(qs[k])
            if h is not None:
                heapq.heappush(heap, (h, k))


retention_ops_st = st.lists(
    st.one_of(
        st.tuples(
            st.just("produce"),
            st.sampled_from(["a", "b"]),
            st.lists(
                st.tuples(st.integers(0, 60), st.one_of(st.none(), st.integers(0, 3))),
                min_size=1,
                max_size=8,
            ),
        ),
        st.tuples(st.just("retention"), st.sampled_from([0, 150, 400, 1000, 3000])),
    ),
    max_size=40,
)


@SETTINGS
@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([150, 400, 1000]),
    retention_ops_st,
    st.sampled_from([1, 2, 3, 64]),
    st.booleans(),
)
def test_size_retention_in_chunks_drops_what_one_head_at_a_time_drops(
    qa: int, qb: int, limit: int, ops: list[Any], chunk: int, on_disk: bool
) -> None:
    """The chunked size retention (each queue's index read a chunk at a
    time, each queue's dropped run deleted at once) leaves the same state,
    answers and snapshot bytes as the one-message-at-a-time reference, on
    records in memory and in LMDB, whatever the chunk size."""
    log = Log()
    log.add(encode_topic(CommandKind.CREATE_TOPIC, "a", 1, qa))
    log.add(encode_topic(CommandKind.CREATE_TOPIC, "b", 1, qb))
    log.add(encode_retention(1, limit))
    for n, op in enumerate(ops):
        if op[0] == "produce":
            msgs = [Message(b"%d" % n * size, queue=q) for size, q in op[2]]
            log.add(encode_produce(op[1], msgs, 2 + n))
        else:
            log.add(encode_retention(2 + n, op[1]))
    with tempfile.TemporaryDirectory() as d, mock.patch.object(state_mod, "RETENTION_CHUNK", chunk):

        def bodies(name: str) -> LmdbBodies | MemoryBodies:
            return LmdbBodies(os.path.join(d, name), batch=3) if on_disk else MemoryBodies()

        new = BrokerState("test", bodies("new"))
        ref = OneHeadAtATime("test", bodies("ref"))
        for e in log.entries:
            assert new.apply(e) == ref.apply(e)
        assert new.stats() == ref.stats()
        assert answers(new) == answers(ref)
        assert new.snapshot() == ref.snapshot()
        assert stored(new.bodies) == stored(ref.bodies)  # the dropped rows went too


def stored(b: Bodies) -> Any:
    """Every record and index row a bodies store holds."""
    if isinstance(b, MemoryBodies):
        return dict(b._d), dict(b._idx)
    assert isinstance(b, LmdbBodies)
    b.commit()
    env, db, idx = b._open()
    with env.begin() as txn:
        return list(txn.cursor(db=db)), list(txn.cursor(db=idx))


def test_lmdb_bodies_start_empty_and_report_a_missing_record(tmp_path: Path) -> None:
    path = str(tmp_path / "bodies")
    b = LmdbBodies(path)
    b.put(10, b"ten")
    b.commit()
    b.close()
    again = LmdbBodies(path)  # a node's store is rebuilt at every start
    with pytest.raises(BodyMissing):
        again.get(10)
    again.put(7, b"seven")
    assert again.get(7) == b"seven"  # pending, not yet committed
    again.delete(7)
    with pytest.raises(BodyMissing):
        again.get(7)


def test_a_damaged_record_is_reported_not_served(tmp_path: Path) -> None:
    log = Log()
    s = BrokerState("test", LmdbBodies(str(tmp_path / "bodies"), batch=1))
    s.apply(log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 1)))
    res = s.apply(log.add(encode_produce("t", [Message(b"hello"), Message(b"world")], 2)))
    assert isinstance(res, ProduceResult)
    first, _ = res.acks
    rec = bytearray(s.bodies.get(first.phys_offset))
    rec[-1] ^= 0x01  # one bit of the body
    s.bodies.put(first.phys_offset, bytes(rec))
    with pytest.raises(StorageCorrupted, match="t/0@0"):
        s.read("t", 0, 0, max_messages=10)
    assert s.read("t", 0, 1, max_messages=10).messages[0].body == b"world"


def assert_columns_are_read(c: ReadColumns, r: ReadResult, topic: str, queue: int) -> None:
    """``c`` (read_columns) holds the messages and offsets of ``r`` (read),
    column by column, and so does its Arrow page."""
    ms = r.messages
    assert list(c.queue_offsets) == [m.queue_offset for m in ms]
    assert list(c.phys_offsets) == [m.phys_offset for m in ms]
    assert list(c.sizes) == [m.size for m in ms]
    assert list(c.store_ts_ms) == [m.store_ts_ms for m in ms]
    assert c.msg_ids() == [m.msg_id for m in ms]
    rc = c.records
    assert rc.body_list() == [m.body for m in ms]
    assert list(rc.born_ts_ms) == [m.born_ts_ms for m in ms]
    assert rc.tag_list() == [m.tag or None for m in ms]
    ko, po = rc.key_offsets, rc.prop_offsets
    assert [tuple(rc.keys[ko[i] : ko[i + 1]]) for i in range(len(ms))] == [m.keys for m in ms]
    assert [
        tuple(zip(rc.prop_keys[po[i] : po[i + 1]], rc.prop_values[po[i] : po[i + 1]], strict=True))
        for i in range(len(ms))
    ] == [m.properties for m in ms]
    assert (c.next_offset, c.min_offset, c.max_offset) == (
        r.next_offset,
        r.min_offset,
        r.max_offset,
    )
    pa = arrow.load_pyarrow()
    if pa is None:
        return
    batch = arrow.record_batch(pa, topic, queue, c)
    batch.validate(full=True)
    cols = {
        name: batch.column(name).cast(pa.int64()).to_pylist()
        if name.endswith("_ts_ms")
        else batch.column(name).to_pylist()
        for name in batch.schema.names
    }
    assert [
        (*row[:9], tuple(row[9]), tuple(row[10]), row[11])
        for row in zip(*(cols[name] for name, _t, _f in arrow.COLUMNS), strict=True)
    ] == [
        (
            topic,
            queue,
            m.queue_offset,
            m.phys_offset,
            m.size,
            m.msg_id,
            m.store_ts_ms,
            m.born_ts_ms,
            m.tag or None,
            m.keys,
            m.properties,
            m.body,
        )
        for m in ms
    ]


@pytest.mark.parametrize("store", ["memory", "lmdb-buffered", "lmdb-committed"])
def test_read_columns_is_read_column_by_column(tmp_path: Path, store: str) -> None:
    """The consume route's Arrow page (read_columns) holds what read() gives
    for every offset, page cap, byte cap and tag filter; in LMDB with some
    records still buffered, or all committed (the cursor-scan path)."""
    bodies: MemoryBodies | LmdbBodies = MemoryBodies()
    if store != "memory":
        bodies = LmdbBodies(str(tmp_path / "b"), batch=7 if store == "lmdb-buffered" else 1 << 20)
    log = Log()
    s = BrokerState("test", bodies)
    s.apply(log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 2)))
    for rnd in range(3):
        msgs = [
            Message(
                b"v%d" % i * (i % 7),
                tag="a" if i % 3 == 0 else "",
                keys=(f"k{i}", "z") if i % 4 == 0 else (),
                properties=(("p", str(i)),) if i % 5 == 0 else (),
                # round 1 puts runs of ten in a queue: adjacent records
                queue=(i // 10) % 2 if rnd == 1 else i % 2,
            )
            for i in range(50)
        ]
        s.apply(log.add(encode_produce("t", msgs, 2 + rnd)))
    if isinstance(bodies, LmdbBodies) and store == "lmdb-committed":
        bodies.commit()
    for q in (0, 1):
        hi = s.queue_range("t", q)[1]
        for off in [*range(0, hi + 1, 3), hi]:
            for mm, mb in ((1000, 1 << 20), (5, 1 << 20), (100, 30), (3, 1)):
                for tag in (None, "a", "a||b"):
                    r = s.read("t", q, off, mm, mb, tag)
                    c = s.read_columns("t", q, off, mm, mb, tag)
                    assert_columns_are_read(c, r, "t", q)
    with pytest.raises(OffsetOutOfRange):
        s.read_columns("t", 0, s.queue_range("t", 0)[1] + 1)


def test_a_damaged_record_is_reported_not_served_by_read_columns(tmp_path: Path) -> None:
    log = Log()
    s = BrokerState("test", LmdbBodies(str(tmp_path / "bodies"), batch=1))
    s.apply(log.add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 1)))
    res = s.apply(log.add(encode_produce("t", [Message(b"hello"), Message(b"world")], 2)))
    assert isinstance(res, ProduceResult)
    first, second = res.acks
    rec = bytearray(s.bodies.get(first.phys_offset))
    rec[-1] ^= 0x01  # one bit of the body
    s.bodies.put(first.phys_offset, bytes(rec))
    with pytest.raises(StorageCorrupted, match="t/0@0"):
        s.read_columns("t", 0, 0, max_messages=10)
    assert s.read_columns("t", 0, 1, max_messages=10).records.body_list() == [b"world"]
    s.bodies.delete(second.phys_offset)  # a record the index names is gone
    with pytest.raises(StorageCorrupted, match="t/0"):
        s.read_columns("t", 0, 1, max_messages=10)
