"""LmdbStorage: contract, durability, recovery checks and a model test
against MemoryStorage."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dledger.core.codec import ENTRY_OVERHEAD
from dledger.core.types import Entry, EntryType, HardState
from dledger.errors import Compacted, ConfigError, StorageCorrupted
from dledger.storage import lmdb_store
from dledger.storage.base import LogStorage, StableStore
from dledger.storage.lmdb_store import LmdbStorage
from dledger.storage.memory import MemoryStorage

MiB = 1 << 20


def chain(
    first: int,
    terms: Sequence[int],
    pos: int = 0,
    payload: bytes | None = None,
    size: int = 8,
) -> list[Entry]:
    """Entries first.. with the given terms, positions continuing from pos.
    Each payload is unique (it names its index) unless ``payload`` is given."""
    out = []
    for k, t in enumerate(terms):
        i = first + k
        data = payload if payload is not None else f"e{i:06d}".encode().ljust(size, b".")
        e = Entry(index=i, term=t, data=data, pos=pos)
        out.append(e)
        pos = e.end_pos
    return out


def end_of(store: LogStorage) -> int:
    """End position of the last entry (front_pos when empty)."""
    last = store.last_index()
    if last < store.first_index():
        assert isinstance(store, LmdbStorage | MemoryStorage)
        return store.front_pos()
    return store.entries(last, last + 1)[0].end_pos


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LmdbStorage]:
    s = LmdbStorage(tmp_path / "log")
    yield s
    s.close()


# -- the contract ------------------------------------------------------------
def test_implements_protocols(store: LmdbStorage) -> None:
    assert isinstance(store, LogStorage)
    assert isinstance(store, StableStore)


def test_empty_log(store: LmdbStorage) -> None:
    assert (store.first_index(), store.last_index()) == (1, 0)
    assert store.term(0) == 0
    assert store.front_pos() == 0
    assert store.entries(1, 10) == []
    assert store.hard_state() == HardState()
    assert store.epoch_map() == {}
    with pytest.raises(IndexError):
        store.term(1)


def test_append_read_term(store: LmdbStorage) -> None:
    es = chain(1, [1, 1, 2, 2, 3])
    store.append(es)
    store.sync()
    assert store.last_index() == 5
    assert [store.term(i) for i in range(0, 6)] == [0, 1, 1, 2, 2, 3]
    assert store.entries(1, 6) == es
    assert store.entries(2, 4) == es[1:3]
    assert store.entries(4, 100) == es[3:]  # hi is clamped to the log
    assert store.entries(6, 10) == []
    assert store.entries(3, 3) == []


def test_entry_types_and_empty_payloads_round_trip(tmp_path: Path) -> None:
    es = [
        Entry(1, 1, EntryType.NOOP, b"", 0),
        Entry(2, 1, EntryType.CONF_CHANGE, b"\x01" * 9, 0),
        Entry(3, 2, EntryType.NOOP, b"", 9),
        Entry(4, 2, EntryType.NORMAL, b"x", 9),
    ]
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert s.entries(1, 5) == es
        assert s.epoch_map() == {1: 0, 2: 9}


def test_entries_max_bytes(store: LmdbStorage) -> None:
    es = chain(1, [1] * 6, size=10)  # 10 bytes each
    store.append(es[:3])
    store.sync()
    store.append(es[3:])  # buffered: the budget must span durable and buffered
    assert store.entries(1, 7, max_bytes=0) == es[:1]  # always at least one
    assert store.entries(1, 7, max_bytes=25) == es[:2]
    assert store.entries(1, 7, max_bytes=30) == es[:3]
    assert store.entries(1, 7, max_bytes=45) == es[:4]
    assert store.entries(2, 7, max_bytes=40) == es[1:5]
    assert store.entries(4, 7, max_bytes=15) == es[3:4]
    assert store.entries(1, 7, max_bytes=10_000) == es


@pytest.mark.parametrize("synced", [True, False])
def test_append_replaces_conflicting_suffix(store: LmdbStorage, synced: bool) -> None:
    store.append(chain(1, [1, 1, 1, 1]))
    if synced:
        store.sync()
    new = chain(3, [2, 2], pos=store.entries(2, 3)[0].end_pos, payload=b"new!")
    store.append(new)
    assert store.last_index() == 4
    assert [store.term(i) for i in range(1, 5)] == [1, 1, 2, 2]
    assert store.entries(3, 5) == new
    store.sync()
    assert store.entries(3, 5) == new
    assert store.verify_all() == 4


def test_truncate_from(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path) as s:
        es = chain(1, [1, 1, 2, 2, 3])
        s.append(es)
        s.sync()
        s.truncate_from(4)
        assert s.last_index() == 3
        assert s.term(3) == 2
        s.truncate_from(10)  # beyond the end: nothing to do
        assert s.last_index() == 3
        s.sync()
        with pytest.raises(IndexError):
            s.term(4)
        # Appending after a truncation continues at the cut.
        s.append(chain(4, [4], pos=es[2].end_pos))
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert s.last_index() == 4
        assert s.entries(1, 5) == [*es[:3], *chain(4, [4], pos=es[2].end_pos)]


def test_append_refuses_invalid_batches(store: LmdbStorage) -> None:
    store.append(chain(1, [2, 2]))
    end = end_of(store)
    with pytest.raises(ValueError, match="gap"):
        store.append(chain(4, [2], pos=end))
    with pytest.raises(ValueError, match="term"):
        store.append(chain(3, [1], pos=end))
    with pytest.raises(ValueError, match="position"):
        store.append(chain(3, [2], pos=end + 1))
    with pytest.raises(ValueError, match="follow"):
        store.append([*chain(3, [2], pos=end), Entry(5, 2, pos=end + 8)])
    # A refused batch changes nothing.
    assert store.last_index() == 2
    assert store.epoch_map() == {2: 0}


def test_read_your_writes_before_sync(store: LmdbStorage) -> None:
    es = chain(1, [1, 1, 2])
    store.append(es)
    hs = HardState(term=2, vote=1, commit=1)
    store.save_hard_state(hs)
    assert store.write_txns == 0  # nothing written yet
    assert store.last_index() == 3
    assert store.term(3) == 2
    assert store.entries(1, 4) == es
    assert store.hard_state() == hs
    assert store.epoch_map() == {1: 0, 2: es[2].pos}


def test_group_commit_is_one_transaction(store: LmdbStorage) -> None:
    store.append(chain(1, [1, 1, 1]))
    store.save_hard_state(HardState(1, 1, 0))
    store.append(chain(4, [2, 2], pos=end_of(store)))
    store.truncate_from(5)
    store.save_hard_state(HardState(2, 1, 3))
    store.sync()
    assert store.write_txns == 1
    store.sync()  # nothing buffered: no transaction at all
    assert store.write_txns == 1


# -- durability --------------------------------------------------------------
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_durable_across_reopen(tmp_path: Path, flush: str) -> None:
    es = chain(1, [1, 2, 2, 3])
    hs = HardState(term=3, vote=2, commit=4)
    with LmdbStorage(tmp_path, flush=flush) as s:  # type: ignore[arg-type]
        s.append(es)
        s.save_hard_state(hs)
        s.sync()
    with LmdbStorage(tmp_path, flush=flush) as s:  # type: ignore[arg-type]
        assert s.entries(1, 5) == es
        assert s.hard_state() == hs
        assert (s.first_index(), s.last_index(), s.term(4)) == (1, 4, 3)


def test_hard_state_round_trip(tmp_path: Path) -> None:
    for n in range(1, 4):
        with LmdbStorage(tmp_path) as s:
            assert s.hard_state() == HardState(n - 1, n - 1, n - 1)
            s.save_hard_state(HardState(n, n, n))
            s.sync()


def test_unsynced_writes_are_lost_on_close(tmp_path: Path) -> None:
    """close() does not commit the buffered batch: closing is a crash."""
    es = chain(1, [1, 1, 1, 1])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.save_hard_state(HardState(1, 1, 2))
        s.sync()
        # A buffered batch touching everything, then "crash".
        s.append(chain(5, [2, 2], pos=es[-1].end_pos))
        s.truncate_from(3)
        s.compact(2, 1, es[0].end_pos)
        s.save_hard_state(HardState(2, 0, 2))
        assert s.last_index() == 2
    with LmdbStorage(tmp_path) as s:
        assert s.entries(1, 5) == es
        assert s.hard_state() == HardState(1, 1, 2)
        assert s.first_index() == 1
        assert s.epoch_map() == {1: 0}


def test_async_flush_interval(tmp_path: Path) -> None:
    with LmdbStorage(tmp_path, flush="async", flush_interval_s=1.0) as s:
        assert s.maybe_flush(0.0) is False  # nothing committed yet
        s.append(chain(1, [1]))
        s.sync()
        assert s.maybe_flush(10.0) is True
        assert s.maybe_flush(10.1) is False  # nothing new
        s.append(chain(2, [1], pos=end_of(s)))
        s.sync()
        assert s.maybe_flush(10.5) is False  # within the interval
        assert s.maybe_flush(11.0) is True
        s.append(chain(3, [1], pos=end_of(s)))
        s.sync()
        assert s.flushes == 2
    assert s.flushes == 3  # close() flushed the last commit
    with LmdbStorage(tmp_path, flush="sync") as s:
        assert s.last_index() == 3
        assert s.maybe_flush(100.0) is False  # sync mode: already durable


def test_async_mode_fsyncs_a_new_term_or_vote_at_once(tmp_path: Path) -> None:
    """A vote left to the flush interval could be forgotten in a power loss
    and granted again in the same term (two leaders of one term, replicas
    that no check can tell apart): the commit recording it fsyncs at once."""
    with LmdbStorage(tmp_path, flush="async", flush_interval_s=3600.0) as s:
        s.append(chain(1, [1, 1]))
        s.save_hard_state(HardState(1, 0, 0))
        s.sync()
        assert s.flushes == 1  # the first term
        s.append(chain(3, [1], pos=end_of(s)))
        s.save_hard_state(HardState(1, 0, 2))  # only the commit index moved
        s.sync()
        assert s.flushes == 1  # left to the interval
        s.save_hard_state(HardState(2, 3, 2))  # a vote in a new term
        s.sync()
        assert s.flushes == 2
        s.save_hard_state(HardState(2, 3, 3))
        s.append(chain(4, [2], pos=end_of(s)))
        s.sync()
        assert s.flushes == 2 and s.maybe_flush(0.0) is True


# -- compaction and epochs ---------------------------------------------------
def test_compaction_survives_reopen(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 2, 2, 3, 3])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.sync()
        s.compact(4, 2, es[2].end_pos)
        # Visible before sync.
        assert (s.first_index(), s.term(3), s.front_pos()) == (4, 2, es[2].end_pos)
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert (s.first_index(), s.last_index()) == (4, 6)
        assert s.term(3) == 2
        assert s.front_pos() == es[2].end_pos
        assert s.entries(4, 7) == es[3:]
        with pytest.raises(Compacted):
            s.entries(3, 7)
        with pytest.raises(Compacted):
            s.term(2)
        with pytest.raises(Compacted):
            s.append(chain(3, [2], pos=es[1].end_pos))
        with pytest.raises(Compacted):
            s.truncate_from(3)
        assert s.verify_all() == 3
        # Compact everything, reopen, and keep appending from the front.
        s.compact(7, 3, es[5].end_pos)
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert (s.first_index(), s.last_index(), s.term(6)) == (7, 6, 3)
        assert s.entries(7, 10) == []
        s.append(chain(7, [4], pos=s.front_pos()))
        s.sync()
        assert s.entries(7, 8) == chain(7, [4], pos=es[5].end_pos)


def test_compact_checks_its_arguments(store: LmdbStorage) -> None:
    es = chain(1, [1, 2, 2])
    store.append(es)
    with pytest.raises(ValueError, match="term"):
        store.compact(3, 1, es[1].end_pos)
    with pytest.raises(ValueError, match="term"):
        store.compact(3, 2, es[1].end_pos + 1)
    store.compact(1, 0, 0)  # nothing below 1: a no-op
    assert store.first_index() == 1


def test_compact_beyond_last_index_matches_memory(tmp_path: Path) -> None:
    """upto - 1 beyond the log empties it and adopts the given front (as
    MemoryStorage does), e.g. after a snapshot jump."""
    es = chain(1, [1, 1])
    mem = MemoryStorage()
    with LmdbStorage(tmp_path) as s:
        for store in (s, mem):
            store.append(es)
            store.compact(10, 5, 500)
        s.sync()
    with LmdbStorage(tmp_path) as s:
        for store in (s, mem):
            assert (store.first_index(), store.last_index()) == (3, 2)
            assert (store.term(2), store.front_pos()) == (5, 500)
        assert s.epoch_map() == {5: 500}
        s.append(chain(3, [5], pos=500))
        s.sync()
        assert s.verify_all() == 1


def test_epoch_map(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 3, 3, 3, 4, 6, 6])
    with LmdbStorage(tmp_path) as s:
        s.append(es[:5])
        s.sync()
        s.append(es[5:])
        expected = {1: 0, 3: es[2].pos, 4: es[5].pos, 6: es[6].pos}
        assert s.epoch_map() == expected
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert s.epoch_map() == expected
        # Truncation removes the epochs that start at or after the cut.
        s.truncate_from(6)
        assert s.epoch_map() == {1: 0, 3: es[2].pos}
        s.truncate_from(4)  # the cut is inside epoch 3: it stays
        assert s.epoch_map() == {1: 0, 3: es[2].pos}
        # A new term after the truncation point.
        s.append(chain(4, [7, 7], pos=es[2].end_pos))
        assert s.epoch_map() == {1: 0, 3: es[2].pos, 7: es[2].end_pos}
        s.sync()
    with LmdbStorage(tmp_path, verify="full") as s:
        assert s.epoch_map() == {1: 0, 3: es[2].pos, 7: es[2].end_pos}
        # Compaction drops whole epochs and clamps the straddling one.
        s.compact(3, 1, es[1].end_pos)
        assert s.epoch_map() == {1: es[1].end_pos, 3: es[2].pos, 7: es[2].end_pos}
        s.compact(5, 7, s.entries(4, 5)[0].end_pos)
        front = s.front_pos()
        assert s.epoch_map() == {7: front}
        s.sync()
    with LmdbStorage(tmp_path, verify="full") as s:
        assert s.epoch_map() == {7: front}
        assert [s.term(i) for i in (4, 5)] == [7, 7]


# -- map growth --------------------------------------------------------------
def test_map_grows_instead_of_failing(tmp_path: Path) -> None:
    payload = b"z" * (64 << 10)
    batches = 16  # 16 x 8 x 64 KiB = 8 MiB through a 1 MiB map
    with LmdbStorage(tmp_path, map_size=1 * MiB) as s:
        for b in range(batches):
            s.append(chain(b * 8 + 1, [1] * 8, pos=end_of(s), payload=payload))
            s.save_hard_state(HardState(1, 1, b * 8))
            s.sync()
        assert s.map_growths >= 3
        assert s.last_index() == batches * 8
        assert s.entries(1, 2) == chain(1, [1], payload=payload)
    # Reopening with the small map still works, and so does writing on.
    with LmdbStorage(tmp_path, map_size=1 * MiB, verify="full") as s:
        assert s.last_index() == batches * 8
        s.append(chain(s.last_index() + 1, [2] * 16, pos=end_of(s), payload=payload))
        s.sync()
        assert s.verify_all() == batches * 8 + 16


# -- corruption --------------------------------------------------------------
def marked(index: int) -> bytes:
    return f"<<MARK-{index:06d}>>".encode()


def flip_marker(dirpath: Path, index: int) -> int:
    """Flip one byte of entry ``index``'s payload in data.mdb. Copy-on-write
    may have left stale copies of the page, so flip every occurrence."""
    data_file = dirpath / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    needle = marked(index)
    hits = 0
    at = raw.find(needle)
    while at >= 0:
        raw[at + 3] ^= 0x20  # MARK -> mARK
        hits += 1
        at = raw.find(needle, at + 1)
    assert hits >= 1, "payload marker not found in data.mdb"
    data_file.write_bytes(bytes(raw))
    return hits


def write_marked_log(dirpath: Path, n: int) -> list[Entry]:
    es: list[Entry] = []
    pos = 0
    for i in range(1, n + 1):
        e = Entry(index=i, term=1 + i // 10, data=marked(i), pos=pos)
        es.append(e)
        pos = e.end_pos
    with LmdbStorage(dirpath) as s:
        s.append(es[: n // 2])
        s.sync()
        s.append(es[n // 2 :])
        s.sync()
    return es


def test_corrupt_tail_is_refused_at_open(tmp_path: Path) -> None:
    write_marked_log(tmp_path, 50)
    flip_marker(tmp_path, 47)
    with pytest.raises(StorageCorrupted) as err:
        LmdbStorage(tmp_path, verify_tail=10)
    assert err.value.index == 47
    assert "log index 47" in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_corruption_outside_the_tail_is_caught_on_read(tmp_path: Path) -> None:
    es = write_marked_log(tmp_path, 50)
    flip_marker(tmp_path, 5)
    with LmdbStorage(tmp_path, verify_tail=10) as s:  # 41..50 verified: opens
        assert s.entries(6, 51) == es[5:]  # the healthy records still serve
        assert s.term(5) == es[4].term  # from the epoch index, not the record
        with pytest.raises(StorageCorrupted) as err:
            s.entries(1, 51)
        assert err.value.index == 5
        with pytest.raises(StorageCorrupted) as err:
            s.entries(5, 6)
        assert err.value.index == 5
        with pytest.raises(StorageCorrupted) as err:
            s.verify_all()
        assert err.value.index == 5
    with pytest.raises(StorageCorrupted) as err:
        LmdbStorage(tmp_path, verify="full")
    assert err.value.index == 5


def test_corrupt_record_does_not_leak_into_append(tmp_path: Path) -> None:
    """Appending over a conflict reads the previous entry; a corrupt one is
    reported, not trusted."""
    es = write_marked_log(tmp_path, 30)
    flip_marker(tmp_path, 9)
    with LmdbStorage(tmp_path, verify_tail=5) as s:
        with pytest.raises(StorageCorrupted) as err:
            s.append(chain(10, [9], pos=es[8].end_pos))
        assert err.value.index == 9
        assert s.last_index() == 30


def test_open_refuses_a_foreign_file(tmp_path: Path) -> None:
    (tmp_path / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    with pytest.raises(StorageCorrupted, match=str(tmp_path)):
        LmdbStorage(tmp_path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flush": "fsync"},
        {"verify": "some"},
        {"verify_tail": 0},
        {"map_size": 1024},
        {"flush_interval_s": -1.0},
    ],
)
def test_config_errors(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LmdbStorage(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_closed_store_refuses_sync(tmp_path: Path) -> None:
    s = LmdbStorage.open(tmp_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        s.sync()


# -- model test against MemoryStorage ----------------------------------------
def expected_epochs(mem: MemoryStorage, compacted: bool) -> dict[int, int]:
    """The epoch map is a function of the log: one epoch per run of terms,
    plus the compaction marker's term at front_pos."""
    eps: dict[int, int] = {}
    cur: int | None = None
    if compacted:
        cur = mem.term(mem.first_index() - 1)
        eps[cur] = mem.front_pos()
    for e in mem.entries(mem.first_index(), mem.last_index() + 1):
        if e.term != cur:
            eps[e.term] = e.pos
            cur = e.term
    return eps


def assert_same(s: LmdbStorage, mem: MemoryStorage, compacted: bool) -> None:
    first, last = mem.first_index(), mem.last_index()
    assert (s.first_index(), s.last_index()) == (first, last)
    assert s.front_pos() == mem.front_pos()
    assert s.hard_state() == mem.hard_state()
    assert [s.term(i) for i in range(first - 1, last + 1)] == [
        mem.term(i) for i in range(first - 1, last + 1)
    ]
    assert s.entries(first, last + 1) == mem.entries(first, last + 1)
    assert s.entries(first, last + 1, max_bytes=16) == mem.entries(first, last + 1, max_bytes=16)
    for i in range(first, last + 1):  # ranges ending inside LMDB, the buffer, or across
        assert s.entries(i, i + 1) == mem.entries(i, i + 1)
        assert s.entries(first, i + 1) == mem.entries(first, i + 1)
    assert s.epoch_map() == expected_epochs(mem, compacted)
    if first >= 2:
        with pytest.raises(Compacted):
            s.term(first - 2)


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@pytest.mark.parametrize("flush", ["async", "sync"])  # sync: through the write-ahead log
@given(data=st.data())
def test_matches_memory_storage(flush: lmdb_store.FlushMode, data: st.DataObject) -> None:
    kinds = ["append", "append", "append", "truncate", "compact", "hs", "sync", "sync"]
    ops = st.sampled_from([*kinds, "crash", "checkpoint"])
    with tempfile.TemporaryDirectory() as d:
        s = LmdbStorage(d, flush=flush, verify="full")
        mem = MemoryStorage()
        compacted = durable_compacted = False
        try:
            for _ in range(data.draw(st.integers(1, 25), label="n_ops")):
                op = data.draw(ops, label="op")
                first, last = mem.first_index(), mem.last_index()
                if op == "append":
                    at = data.draw(st.integers(first, last + 1), label="at")
                    prev = mem.entries(at - 1, at)[0] if at - 1 >= first else None
                    term = prev.term if prev else mem.term(at - 1)
                    pos = prev.end_pos if prev else mem.front_pos()
                    batch = []
                    for i in range(at, at + data.draw(st.integers(1, 4), label="n")):
                        term = max(1, term + data.draw(st.integers(0, 2), label="dt"))
                        # small records stay inline; big ones (> 2000 B) go
                        # in parts (see "Parted records" in lmdb_store)
                        payload = data.draw(
                            st.one_of(
                                st.binary(max_size=12),
                                st.tuples(st.integers(1990, 7000), st.integers(0, 255)).map(
                                    lambda t: bytes([t[1]]) * t[0] + t[0].to_bytes(4, "big")
                                ),
                            ),
                            label="data",
                        )
                        e = Entry(index=i, term=term, data=payload, pos=pos)
                        batch.append(e)
                        pos = e.end_pos
                    s.append(batch)
                    mem.append(batch)
                elif op == "truncate":
                    at = data.draw(st.integers(first, last + 1), label="at")
                    s.truncate_from(at)
                    mem.truncate_from(at)
                elif op == "compact" and last >= first:
                    upto = data.draw(st.integers(first + 1, last + 1), label="upto")
                    before = mem.entries(upto - 1, upto)[0]
                    s.compact(upto, before.term, before.end_pos)
                    mem.compact(upto, before.term, before.end_pos)
                    compacted = True
                elif op == "hs":
                    hs = HardState(*data.draw(st.tuples(*[st.integers(0, 9)] * 3), label="hs"))
                    s.save_hard_state(hs)
                    mem.save_hard_state(hs)
                elif op == "sync":
                    s.sync()
                    mem.sync()
                    durable_compacted = compacted
                elif op == "checkpoint":
                    s.checkpoint()  # LMDB takes what the log holds; nothing changes in view
                elif op == "crash":
                    s.close()  # drops the buffered batch
                    s = LmdbStorage(d, flush=flush, verify="full")
                    mem.crash()
                    compacted = durable_compacted
                assert_same(s, mem, compacted)
            s.sync()
            mem.sync()
            s.close()
            s = LmdbStorage(d, verify="full")
            assert_same(s, mem, compacted)
            assert s.verify_all() == mem.last_index() - mem.first_index() + 1
        finally:
            s.close()


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.01])
def test_truncated_data_file_is_refused_before_lmdb_maps_it(tmp_path: Path, keep: float) -> None:
    """A truncated data.mdb would SIGBUS the process inside LMDB's mmap; it
    must be reported as StorageCorrupted instead."""
    write_marked_log(tmp_path, 400)
    data_file = tmp_path / "data.mdb"
    size = data_file.stat().st_size
    with open(data_file, "r+b") as f:
        f.truncate(int(size * keep))
    with pytest.raises(StorageCorrupted, match="truncated"):
        LmdbStorage(tmp_path)


def test_intact_data_file_passes_the_size_check(tmp_path: Path) -> None:
    es = write_marked_log(tmp_path, 400)
    with LmdbStorage(tmp_path) as s:
        assert s.last_index() == len(es)


def _open_in_child(d: Path, es: list[Entry]) -> str:
    """Open ``d`` with a full verification in a forked child: "intact" (every
    entry read back equal), "detected" (StorageCorrupted), "changed" (other
    data came back), "other" (another exception) or "signal N"."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 5
        try:
            faulthandler.disable()
            with LmdbStorage(d, verify="full") as s:
                code = 0 if s.entries(1, len(es) + 1) == es else 4
        except StorageCorrupted:
            code = 3
        except BaseException:
            code = 5
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return {0: "intact", 3: "detected", 4: "changed"}.get(os.WEXITSTATUS(status), "other")


def test_random_bit_flips_are_detected_or_harmless(tmp_path: Path) -> None:
    """Flip one bit anywhere in data.mdb (40 seeded trials): opening with a full
    verification either reports StorageCorrupted or finds every entry intact;
    it never returns other data and never raises anything else. (LMDB does
    not checksum its pages, so flips in B-tree pages are caught by our record
    CRCs and structural checks; flips in free pages are harmless.) A flip in
    a page number or a length that LMDB follows past the end of the file
    kills the process (SIGBUS) before any check can run: nothing is served,
    but nothing is reported either, so each trial runs in a child process
    and that outcome is counted apart."""
    import random
    import shutil

    src = tmp_path / "src"
    es = write_marked_log(src, 300)
    raw0 = (src / "data.mdb").read_bytes()
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    for trial in range(40):
        d = tmp_path / f"t{trial}"
        shutil.copytree(src, d)
        raw = bytearray(raw0)
        off = rng.randrange(len(raw))
        raw[off] ^= 1 << rng.randrange(8)
        (d / "data.mdb").write_bytes(bytes(raw))
        got = _open_in_child(d, es)
        assert got not in ("changed", "other"), f"trial {trial}: offset {off}: {got}"
        outcomes[got] = outcomes.get(got, 0) + 1
    print("bit flips in data.mdb:", outcomes)
    assert outcomes.get("detected", 0) > 0
    assert outcomes.get("intact", 0) > 0


@pytest.mark.parametrize(
    "exc",
    [
        lmdb.BadTxnError("mdb_cursor_get: MDB_BAD_TXN"),
        lmdb.CorruptedError("MDB_CORRUPTED: Located page was wrong type"),
        SystemError(
            "<method 'delete' of 'Cursor' objects> returned a result with an exception set"
        ),
    ],
)
def test_damage_met_while_writing_is_storage_corrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    """What a write transaction raises after meeting a damaged page (seen by
    the fault harness: a bit-flipped data.mdb opened cleanly, then a
    compaction's delete failed with MDB_BAD_TXN surfacing as SystemError)
    must come out as StorageCorrupted (exit code 2: rebuild this replica),
    not as another exception (exit code 1: restart and try again). LMDB has
    no page checksums, so the damage itself cannot be provoked reliably here
    (a flipped page pointer can as well crash the process)."""
    es = write_marked_log(tmp_path, 50)
    with LmdbStorage(tmp_path) as s:
        s.compact(20, es[18].term, es[18].end_pos)

        def broken(txn: object) -> None:
            raise exc

        monkeypatch.setattr(s, "_apply_batch", broken)
        with pytest.raises(StorageCorrupted, match="rebuild it from a healthy peer"):
            s.sync()


# -- parted records ------------------------------------------------------------
def _big(i: int, n: int) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(n))


@pytest.mark.parametrize("n", [1000, 1304, 1305, 13_300, 50_000])
def test_parted_records_round_trip_truncate_and_compact(tmp_path: Path, n: int) -> None:
    s = LmdbStorage(tmp_path / "log")
    es: list[Entry] = []
    pos = 0
    for i in range(1, 9):
        e = Entry(index=i, term=1, data=_big(i, n), pos=pos)
        es.append(e)
        pos = e.end_pos
    s.append(es)
    s.sync()
    s.truncate_from(6)
    s.compact(3, 1, es[1].end_pos)
    s.sync()
    s.close()
    s = LmdbStorage(tmp_path / "log", verify="full")
    assert s.entries(3, 6) == es[2:5]
    assert s.verify_all() == 3
    with s.env.begin() as txn:
        parts = txn.stat(s._parts_db)["entries"]
    rec = n + ENTRY_OVERHEAD
    per = -(-rec // lmdb_store._PART_MAX) if rec > lmdb_store._INLINE_MAX else 0
    assert parts == 3 * per, "parts of truncated or compacted entries were left behind"
    s.close()


def test_a_damaged_or_missing_part_is_corruption(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path / "log")
    es = chain(1, [1, 1, 1], payload=_big(0, 9000))
    s.append(es)
    s.sync()
    s.checkpoint()  # into LMDB (sync() made it durable in the write-ahead log)
    with s.env.begin(write=True) as txn:
        key = (2).to_bytes(8, "big") + (3).to_bytes(2, "big")
        raw = bytearray(txn.get(key, db=s._parts_db) or b"")
        raw[100] ^= 0x04
        txn.put(key, bytes(raw), db=s._parts_db)
    s.close()
    with pytest.raises(StorageCorrupted, match="log index 2"):
        LmdbStorage(tmp_path / "log", verify="full")
    # a part missing outside the verified tail: caught when read
    t = LmdbStorage(tmp_path / "other")
    more = chain(1, [1] * 5, payload=_big(1, 9000))
    t.append(more)
    t.sync()
    t.checkpoint()
    with t.env.begin(write=True) as txn:
        txn.delete((2).to_bytes(8, "big") + (1).to_bytes(2, "big"), db=t._parts_db)
    t.close()
    t = LmdbStorage(tmp_path / "other", verify="tail", verify_tail=1)
    with pytest.raises(StorageCorrupted, match="log index 2"):
        t.entries(2, 3)
    assert t.entries(1, 2) == more[:1]
    assert t.entries(3, 6) == more[2:]
    t.close()


def test_conf_entries_reads_headers_and_finds_every_membership_change(tmp_path: Path) -> None:
    """A start reads only the membership changes after the snapshot (the
    log is the CommitLog); they must be exactly the CONF_CHANGE entries,
    from short records, behind long (parted) ones, and still unwritten."""
    s = LmdbStorage(tmp_path / "log")
    try:
        pos, ents = 0, []
        for i in range(1, 301):
            kind = EntryType.CONF_CHANGE if i % 37 == 0 else EntryType.NORMAL
            if i % 5 == 0 and kind is EntryType.NORMAL:
                data = b"L" * 5000  # stored in parts
            else:
                data = f"e{i}".encode()
            e = Entry(index=i, term=1, type=kind, data=data, pos=pos)
            ents.append(e)
            pos = e.end_pos
        s.append(ents[:250])
        s.sync()
        s.append(ents[250:])  # not yet committed to LMDB
        want = [e for e in ents if e.type is EntryType.CONF_CHANGE]
        assert s.conf_entries(1, 301) == want
        assert s.conf_entries(40, 260) == [e for e in want if 40 <= e.index < 260]
        s.compact(100, 1, ents[98].end_pos)
        with pytest.raises(Compacted):
            s.conf_entries(50, 301)
        assert s.conf_entries(100, 301) == [e for e in want if e.index >= 100]
    finally:
        s.close()
