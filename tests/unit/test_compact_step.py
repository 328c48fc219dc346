"""The node compacts its log behind a snapshot in steps bounded by entries
and by bytes (``dledger.node._compact_step_end``): one step of big entries
must not become one long write transaction that stalls the commit path."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dledger import node as node_mod
from dledger.core.types import Entry, EntryType
from dledger.storage.memory import MemoryStorage


def _log(sizes: list[int], dropped: int) -> MemoryStorage:
    s = MemoryStorage()
    pos, es = 0, []
    for i, size in enumerate(sizes, start=1):
        e = Entry(index=i, term=1, data=b"x" * size, type=EntryType.NORMAL, pos=pos)
        es.append(e)
        pos = e.end_pos
    s.append(es)
    if dropped:
        s.compact(dropped + 1, 1, es[dropped - 1].end_pos)
    s.sync()
    return s


@given(
    sizes=st.lists(st.integers(0, 300), min_size=2, max_size=60),
    data=st.data(),
    bound=st.integers(1, 2000),
)
@settings(max_examples=300, deadline=None)
def test_a_step_drops_as_many_entries_as_fit_in_the_byte_bound(
    sizes: list[int], data: st.DataObject, bound: int
) -> None:
    dropped = data.draw(st.integers(0, len(sizes) - 2))
    s = _log(sizes, dropped)
    first = s.first_index()
    upto = data.draw(st.integers(first + 1, s.last_index() + 1))
    saved = node_mod._COMPACT_STEP_BYTES
    node_mod._COMPACT_STEP_BYTES = bound
    try:
        end = node_mod._compact_step_end(s, first, upto)
    finally:
        node_mod._COMPACT_STEP_BYTES = saved
    assert first < end <= upto

    def dropped_bytes(k: int) -> int:  # bytes of log in entries first .. k - 1
        return sum(sizes[i - 1] + _overhead(s, i) for i in range(first, k))

    assert end == first + 1 or dropped_bytes(end) <= bound
    assert end == upto or dropped_bytes(end + 1) > bound


def _overhead(s: MemoryStorage, index: int) -> int:
    e = s.entries(index, index + 1)[0]
    return e.end_pos - e.pos - len(e.data)


def test_big_entries_are_dropped_a_few_at_a_time() -> None:
    """4,096 entries of 14 KB (a batched producer's) are 57 MB: a step takes
    at most the byte bound's worth."""
    s = _log([14_000] * 600, 0)
    end = node_mod._compact_step_end(s, 1, 601)
    per_entry = s.entries(1, 2)[0].end_pos
    assert end - 1 == node_mod._COMPACT_STEP_BYTES // per_entry
    small = _log([100] * 600, 0)
    assert node_mod._compact_step_end(small, 1, 601) == 601
