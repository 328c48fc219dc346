"""In-memory storage for tests and simulation, with a faithful crash model.

Writes land in a volatile view first; ``sync()`` copies the view into the
durable image. ``crash()`` throws the volatile view away and restores the
durable one, which is exactly what losing the page cache does to a real log.
"""

from __future__ import annotations

from collections.abc import Sequence

from dledger.core.types import Entry, HardState, Snapshot
from dledger.errors import Compacted


class MemoryStorage:
    """Implements :class:`LogStorage`, :class:`StableStore` and
    :class:`SnapshotStore`; the snapshot is part of the durable image."""

    def __init__(self) -> None:
        # entries[k] has index offset + k + 1; offset is the last compacted index
        self._entries: list[Entry] = []
        self._offset = 0
        self._offset_term = 0
        self._offset_pos = 0
        self._hs = HardState()
        self._snap: Snapshot | None = None
        self._durable: tuple[list[Entry], int, int, int, HardState, Snapshot | None] = (
            [],
            0,
            0,
            0,
            HardState(),
            None,
        )
        self.syncs = 0

    # -- LogStorage --------------------------------------------------------
    def first_index(self) -> int:
        return self._offset + 1

    def last_index(self) -> int:
        return self._offset + len(self._entries)

    def term(self, index: int) -> int:
        if index == self._offset:
            return self._offset_term
        if index < self._offset:
            raise Compacted(f"index {index} is compacted (first index {self._offset + 1})")
        k = index - self._offset - 1
        if k >= len(self._entries):
            raise IndexError(f"index {index} is beyond the last index {self.last_index()}")
        return self._entries[k].term

    def front_pos(self) -> int:
        """End position of the last compacted entry (0 at the start)."""
        return self._offset_pos

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        if lo <= self._offset:
            raise Compacted(f"index {lo} is compacted (first index {self._offset + 1})")
        hi = min(hi, self.last_index() + 1)
        out = self._entries[lo - self._offset - 1 : hi - self._offset - 1]
        if max_bytes is None or not out:
            return list(out)
        total = 0
        for k, e in enumerate(out):
            total += len(e.data)
            if total > max_bytes and k > 0:
                return out[:k]
        return list(out)

    def append(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        first = entries[0].index
        if first <= self._offset:
            raise Compacted(f"append at {first} below the first index {self._offset + 1}")
        if first > self.last_index() + 1:
            raise ValueError(f"append at {first} leaves a gap after {self.last_index()}")
        del self._entries[first - self._offset - 1 :]
        self._entries.extend(entries)

    def truncate_from(self, index: int) -> None:
        if index <= self._offset:
            raise Compacted(f"truncate at {index} below the first index {self._offset + 1}")
        del self._entries[index - self._offset - 1 :]

    def compact(self, upto: int, term: int, pos: int) -> None:
        if upto <= self._offset + 1:
            return
        drop = min(upto - 1, self.last_index()) - self._offset
        self._entries = self._entries[drop:]
        self._offset += drop
        self._offset_term = term
        self._offset_pos = pos

    # -- SnapshotStore ------------------------------------------------------
    def snapshot(self) -> Snapshot | None:
        return self._snap

    def save_snapshot(self, snap: Snapshot) -> None:
        self._snap = snap

    def apply_snapshot(self, snap: Snapshot) -> None:
        self._snap = snap
        self._entries = []
        self._offset = snap.meta.index
        self._offset_term = snap.meta.term
        self._offset_pos = snap.meta.end_pos

    # -- StableStore -------------------------------------------------------
    def hard_state(self) -> HardState:
        return self._hs

    def save_hard_state(self, hs: HardState) -> None:
        self._hs = hs

    # -- durability --------------------------------------------------------
    def small_batch(self, max_bytes: int) -> bool:
        """No I/O here: every batch is cheap to sync."""
        return True

    def catch_up_due(self) -> bool:
        """No second store to catch up (LmdbStorage's write-ahead log)."""
        return False

    def catches_up(self) -> bool:
        return False

    def checkpoint(self) -> bool:
        return True

    def sync(self, *, catch_up: bool = True) -> None:
        self._durable = (
            list(self._entries),
            self._offset,
            self._offset_term,
            self._offset_pos,
            self._hs,
            self._snap,
        )
        self.syncs += 1

    def crash(self) -> None:
        """Lose every write since the last ``sync()``."""
        entries, off, off_term, off_pos, hs, snap = self._durable
        self._entries = list(entries)
        self._offset, self._offset_term, self._offset_pos, self._hs = off, off_term, off_pos, hs
        self._snap = snap

    def durable_last(self) -> tuple[int, int]:
        """(last index, last term) of the synced image (sim checks)."""
        entries, off, off_term, _, _, _ = self._durable
        if entries:
            return entries[-1].index, entries[-1].term
        return off, off_term

    def durable_compacted(self, index: int) -> bool:
        """Is ``index`` below the synced image's front (sim checks)?"""
        return index < self._durable[1]

    def durable_term(self, index: int) -> int | None:
        """Term of ``index`` in the synced image, or None if absent (sim checks)."""
        entries, off, off_term, _, _, _ = self._durable
        if index == off:
            return off_term
        k = index - off - 1
        if 0 <= k < len(entries):
            return entries[k].term
        return None
