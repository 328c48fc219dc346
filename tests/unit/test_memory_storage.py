"""MemoryStorage: the LogStorage / StableStore contract and its crash model
(crash() drops every write since the last sync and keeps synced ones)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.core.types import Entry, EntryType, HardState, Message, MsgType
from dledger.errors import Compacted
from dledger.storage.base import LogStorage, StableStore
from dledger.storage.memory import MemoryStorage
from tests.unit.raft_harness import new_node, read_messages, storage_of, stored_log


def es(lo: int, hi: int, term: int = 1, size: int = 4) -> list[Entry]:
    out = []
    pos = 0
    for i in range(lo, hi + 1):
        out.append(Entry(i, term, EntryType.NORMAL, bytes([i % 256]) * size, pos))
        pos += size
    return out


def log_of(s: MemoryStorage) -> list[tuple[int, int]]:
    if s.last_index() < s.first_index():
        return []
    return [(e.index, e.term) for e in s.entries(s.first_index(), s.last_index() + 1)]


def test_memory_implements_the_protocols() -> None:
    s = MemoryStorage()
    assert isinstance(s, LogStorage)
    assert isinstance(s, StableStore)
    assert (s.first_index(), s.last_index(), s.term(0), s.front_pos()) == (1, 0, 0, 0)
    assert s.hard_state() == HardState()


def test_memory_crash_drops_unsynced_appends_and_keeps_synced_ones() -> None:
    s = MemoryStorage()
    s.append(es(1, 3))
    s.sync()
    s.append(es(4, 6))
    assert s.last_index() == 6
    s.crash()
    assert log_of(s) == [(1, 1), (2, 1), (3, 1)]
    assert s.durable_last() == (3, 1)
    s.crash()  # idempotent
    assert s.last_index() == 3


def test_memory_crash_drops_unsynced_hard_state() -> None:
    s = MemoryStorage()
    s.save_hard_state(HardState(2, 1, 0))
    s.sync()
    s.save_hard_state(HardState(3, 2, 1))
    s.crash()
    assert s.hard_state() == HardState(2, 1, 0)
    s.save_hard_state(HardState(4, 0, 0))
    s.sync()
    s.crash()
    assert s.hard_state() == HardState(4, 0, 0)


def test_memory_crash_restores_an_unsynced_overwritten_suffix() -> None:
    s = MemoryStorage()
    s.append(es(1, 5, term=1))
    s.sync()
    s.append(es(3, 4, term=2))  # replaces 3..5 with 3@2, 4@2
    assert log_of(s) == [(1, 1), (2, 1), (3, 2), (4, 2)]
    s.crash()
    assert log_of(s) == [(i, 1) for i in range(1, 6)]
    s.truncate_from(2)
    s.crash()
    assert s.last_index() == 5


def test_memory_crash_undoes_unsynced_compaction() -> None:
    s = MemoryStorage()
    s.append(es(1, 5))
    s.sync()
    s.compact(4, 1, 12)
    assert (s.first_index(), s.term(3), s.front_pos()) == (4, 1, 12)
    s.crash()
    assert (s.first_index(), s.front_pos()) == (1, 0)
    s.compact(4, 1, 12)
    s.sync()
    s.crash()
    assert (s.first_index(), s.last_index(), s.front_pos()) == (4, 5, 12)


def test_memory_synced_state_is_a_snapshot_not_an_alias() -> None:
    s = MemoryStorage()
    s.append(es(1, 2))
    s.sync()
    s.append(es(3, 3))  # must not leak into the durable image
    assert s.durable_last() == (2, 1)
    assert s.durable_term(3) is None
    assert s.durable_term(2) == 1
    assert s.syncs == 1


def test_memory_append_replaces_suffix_and_refuses_gaps_and_compacted() -> None:
    s = MemoryStorage()
    s.append(es(1, 3))
    with pytest.raises(ValueError):
        s.append(es(5, 5))
    s.append(es(2, 2, term=3))
    assert log_of(s) == [(1, 1), (2, 3)]
    s.compact(2, 1, 4)
    with pytest.raises(Compacted):
        s.append(es(1, 1))
    with pytest.raises(Compacted):
        s.truncate_from(1)
    s.append([])  # nothing to do
    assert log_of(s) == [(2, 3)]


def test_memory_term_and_entries_bounds() -> None:
    s = MemoryStorage()
    s.append(es(1, 5))
    s.compact(3, 1, 8)
    assert s.term(2) == 1  # the last compacted entry still answers
    with pytest.raises(Compacted):
        s.term(1)
    with pytest.raises(Compacted):
        s.entries(2, 4)
    with pytest.raises(IndexError):
        s.term(6)
    assert [e.index for e in s.entries(3, 100)] == [3, 4, 5]
    assert s.entries(6, 9) == []


@pytest.mark.parametrize(
    "max_bytes, want",
    [
        (None, [1, 2, 3, 4]),
        (0, [1]),
        (3, [1]),
        (4, [1]),
        (7, [1]),
        (8, [1, 2]),
        (100, [1, 2, 3, 4]),
    ],
)
def test_memory_entries_byte_budget(max_bytes: int | None, want: list[int]) -> None:
    s = MemoryStorage()
    s.append(es(1, 4, size=4))
    assert [e.index for e in s.entries(1, 5, max_bytes)] == want


def test_memory_entries_returns_a_copy() -> None:
    s = MemoryStorage()
    s.append(es(1, 3))
    got = s.entries(1, 4)
    got.clear()
    assert s.last_index() == 3


def test_memory_raft_ready_contract_survives_a_crash() -> None:
    """What a follower acknowledged was synced first: a crash right after the
    acknowledgement loses none of it, nor the vote it granted."""
    r = new_node(1)
    r.step(Message(MsgType.VOTE, 1, 2, 1))
    r.step(
        Message(
            MsgType.APP,
            1,
            2,
            1,
            entries=(Entry(1, 1, EntryType.NORMAL, b"a"), Entry(2, 1, EntryType.NORMAL, b"b", 1)),
        )
    )
    msgs = read_messages(r)
    assert Message(MsgType.APP_RESP, 2, 1, 1, index=2) in msgs
    st_ = storage_of(r)
    st_.crash()
    assert stored_log(r) == [(1, 1), (2, 1)]
    assert st_.hard_state().vote == 2 and st_.hard_state().term == 1


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 12), st.integers(1, 4), st.integers(1, 5)),
        st.tuples(st.just("hs"), st.integers(0, 9), st.integers(0, 3), st.integers(0, 9)),
        st.tuples(st.just("sync")),
        st.tuples(st.just("crash")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_memory_crash_model_matches_a_reference(ops: list[tuple[object, ...]]) -> None:
    """Against a trivial model: the live state follows every write, and
    after a crash it equals the state at the last sync."""
    s = MemoryStorage()
    live: list[tuple[int, int]] = []
    live_hs = HardState()
    durable: tuple[list[tuple[int, int]], HardState] = ([], HardState())
    for op in ops:
        if op[0] == "append":
            _, first, n, term = op
            assert isinstance(first, int) and isinstance(n, int) and isinstance(term, int)
            first = min(first, len(live)) + 1
            new = [Entry(first + k, term) for k in range(n)]
            s.append(new)
            live = live[: first - 1] + [(e.index, e.term) for e in new]
        elif op[0] == "hs":
            _, t, v, c = op
            assert isinstance(t, int) and isinstance(v, int) and isinstance(c, int)
            live_hs = HardState(t, v, c)
            s.save_hard_state(live_hs)
        elif op[0] == "sync":
            s.sync()
            durable = (list(live), live_hs)
        else:
            s.crash()
            live, live_hs = list(durable[0]), durable[1]
        assert log_of(s) == live
        assert s.hard_state() == live_hs
        assert s.durable_last() == (durable[0][-1] if durable[0] else (0, 0))
