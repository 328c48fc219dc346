"""Storage contracts: the Raft log (:class:`LogStorage`) and the hard state
(:class:`StableStore`), split as hashicorp/raft does.

Contract shared by every implementation:

* indexes are 1-based and consecutive; ``first_index() .. last_index()`` are
  readable; ``last_index() == first_index() - 1`` means empty;
* ``term(first_index() - 1)`` is still answered (the term of the last
  compacted entry, 0 at the very start) so log matching works at the front;
  reading below that raises :class:`dledger.errors.Compacted`;
* ``append`` replaces any stored entries at or after ``entries[0].index``
  (a conflicting suffix) and then appends; nothing is durable until
  ``sync()`` returns. ``save_hard_state`` likewise; one ``sync()`` makes a
  whole batch durable (group commit);
* a record that fails its CRC raises :class:`dledger.errors.StorageCorrupted`
  naming its index, never returns wrong bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from dledger.core.types import Entry, HardState, Snapshot


@runtime_checkable
class LogStorage(Protocol):
    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def term(self, index: int) -> int: ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries with ``lo <= index < hi``; at least one if any, then up to
        ``max_bytes`` of data in total."""
        ...

    def append(self, entries: Sequence[Entry]) -> None: ...

    def truncate_from(self, index: int) -> None:
        """Drop every entry with ``index >= index`` (a conflicting suffix)."""
        ...

    def front_pos(self) -> int:
        """End CommitLog position of entry ``first_index() - 1`` (0 at the start)."""
        ...

    def compact(self, upto: int, term: int, pos: int) -> None:
        """Drop every entry with ``index < upto`` (retention).

        ``term`` and ``pos`` describe entry ``upto - 1`` (its term and end
        position) so the front can still be matched after it is gone."""
        ...

    def sync(self) -> None: ...


@runtime_checkable
class StableStore(Protocol):
    def hard_state(self) -> HardState: ...

    def save_hard_state(self, hs: HardState) -> None: ...

    def sync(self) -> None: ...


@runtime_checkable
class SnapshotStore(Protocol):
    """Where a driver keeps the latest snapshot, made durable by the same
    ``sync()`` as the log (so a crash never separates a snapshot from the log
    reset that installing it implies)."""

    def snapshot(self) -> Snapshot | None:
        """The latest saved snapshot (meta and payload), if any."""
        ...

    def save_snapshot(self, snap: Snapshot) -> None:
        """Record a snapshot taken locally; the log is left alone (compaction
        is a separate ``LogStorage.compact``)."""
        ...

    def apply_snapshot(self, snap: Snapshot) -> None:
        """Install a snapshot received from the leader: save it and reset the
        log to it (``first_index() == meta.index + 1``, ``term(meta.index) ==
        meta.term``, ``front_pos() == meta.end_pos``, no entries)."""
        ...
