"""The core's view of the Raft log: stable entries (in storage) + unstable ones.

Theory of operation. Entries the core appended but the driver has not yet
persisted live in ``_unstable`` (indexes ``_unstable_offset ..``). Everything
below ``_unstable_offset`` is read from the injected :class:`LogStorage`. A
follower that truncates a conflicting suffix moves ``_unstable_offset`` below
the storage's last index; lookups at or above the offset never consult the
storage, so the stale stored suffix is invisible until the driver overwrites it
(``LogStorage.append`` replaces the suffix).

Recently persisted entries also stay in ``_cache`` (indexes ``_cache_offset
.. _unstable_offset - 1``, bounded by count and bytes), so that sending them to
followers and applying them does not read and CRC-check them back from disk.
The cache only ever holds a contiguous run ending right below the unstable
part; truncating a conflicting suffix trims it the same way.

A snapshot received from the leader (``restore``) replaces the whole log:
until the driver has persisted it (``snapshot_persisted``) it is *pending*:
the log is empty after its index, its term answers ``term(index)``, and
everything before it reads as compacted, whatever the storage still holds.

Invariants: ``applied <= committed <= last_index()``; ``committed`` never
decreases (raising :class:`InvariantViolation` instead); the storage is only
read here, never written.
"""

from __future__ import annotations

from collections.abc import Sequence

from dledger.core.types import Entry, EntryType, SnapshotMeta
from dledger.errors import Compacted, InvariantViolation
from dledger.storage.base import LogStorage


class RaftLog:
    def __init__(
        self,
        storage: LogStorage,
        committed: int,
        applied: int,
        cache_entries_max: int = 65536,
        cache_bytes_max: int = 64 << 20,
        snapshot: SnapshotMeta | None = None,
    ) -> None:
        self.storage = storage
        self._pending: SnapshotMeta | None = None
        self._unstable: list[Entry] = []
        self._unstable_offset = storage.last_index() + 1
        self._cache: list[Entry] = []
        self._cache_offset = self._unstable_offset
        self._cache_bytes = 0
        self._cache_entries_max = cache_entries_max
        self._cache_bytes_max = cache_bytes_max
        last = self.last_index()
        # A saved commit index past the durable log (a damaged or truncated
        # tail) is clamped, never trusted: we cannot apply what we lack.
        self.committed = min(committed, last)
        floor = storage.first_index() - 1
        if snapshot is not None:
            if not floor <= snapshot.index <= last or storage.term(snapshot.index) != snapshot.term:
                raise InvariantViolation(
                    f"snapshot at {snapshot.index}@t{snapshot.term} does not match the stored "
                    f"log [{floor + 1}, {last}]"
                )
            # The state machine already holds everything up to the snapshot:
            # never apply those entries again.
            floor = snapshot.index
        self.applied = max(min(applied, self.committed), floor)
        self.committed = max(self.committed, self.applied)
        self._last_end_pos = self._end_pos_of(last)

    # -- reads --------------------------------------------------------------
    def first_index(self) -> int:
        if self._pending is not None:
            return self._pending.index + 1
        return self.storage.first_index()

    def pending_snapshot(self) -> SnapshotMeta | None:
        return self._pending

    def last_index(self) -> int:
        return self._unstable_offset - 1 + len(self._unstable)

    def stable_last_index(self) -> int:
        return self._unstable_offset - 1

    def last_term(self) -> int:
        return self.term(self.last_index())

    def last_end_pos(self) -> int:
        return self._last_end_pos

    def term(self, index: int) -> int:
        """Term of ``index``; 0 for index 0 or past the end. Raises Compacted."""
        if index == 0:
            return 0
        if index >= self._unstable_offset:
            k = index - self._unstable_offset
            return self._unstable[k].term if k < len(self._unstable) else 0
        if self._pending is not None:
            if index == self._pending.index:
                return self._pending.term
            raise Compacted(f"index {index} is covered by the snapshot at {self._pending.index}")
        if index >= self._cache_offset:
            return self._cache[index - self._cache_offset].term
        return self.storage.term(index)

    def match_term(self, index: int, term: int) -> bool:
        try:
            return self.term(index) == term and index <= self.last_index()
        except Compacted:
            return False

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """The largest ``i <= index`` whose term is at most ``term``, with its
        term (etcd's ``findConflictByTerm``). A log repair step uses it to skip
        every entry of a term the other side cannot hold at once, instead of
        one entry per round trip. Stops at the compacted front (its term is
        known) and returns ``(0, 0)`` only for an empty prefix."""
        i = min(index, self.last_index())
        while i > 0:
            try:
                t = self.term(i)
            except Compacted:
                return i, 0  # unknown: the caller probes from here
            if t <= term:
                return i, t
            i -= 1
        return 0, 0

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft section 5.4.1: is a candidate's log at least as up to date as ours?"""
        return (last_term, last_index) >= (self.last_term(), self.last_index())

    def is_newer(self, last_index: int, last_term: int) -> bool:
        """Is a candidate's log strictly more up to date than ours?"""
        return (last_term, last_index) > (self.last_term(), self.last_index())

    def conf_entries(self, lo: int, hi: int) -> list[Entry]:
        """The CONF_CHANGE entries of the stable log in [lo, hi): from the
        storage's own scan when it has one (reading headers only), else
        from its entries a chunk at a time, so that a long log is never
        held in memory whole."""
        scan = getattr(self.storage, "conf_entries", None)
        if scan is not None:
            found: list[Entry] = scan(lo, hi)
            return found
        out: list[Entry] = []
        i = lo
        while i < hi:
            chunk = self.storage.entries(i, min(hi, i + 4096))
            if not chunk:
                break
            out += [e for e in chunk if e.type is EntryType.CONF_CHANGE]
            i = chunk[-1].index + 1
        return out

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries in ``[lo, hi)``: at least one if any, then up to ``max_bytes``
        of data in total. Raises Compacted below the first index."""
        hi = min(hi, self.last_index() + 1)
        if lo >= hi:
            return []
        if self._pending is not None and lo <= self._pending.index:
            raise Compacted(f"index {lo} is covered by the snapshot at {self._pending.index}")
        out: list[Entry] = []
        budget = max_bytes
        if lo < self._unstable_offset:
            stable_hi = min(hi, self._unstable_offset)
            if lo >= self._cache_offset and lo >= self.storage.first_index():
                out = self._take(self._cache, lo - self._cache_offset, stable_hi - lo, budget)
            else:
                out = self.storage.entries(lo, stable_hi, budget)
            if not out or out[-1].index + 1 < stable_hi:
                return out  # the byte budget ran out inside the stable part
            if budget is not None:
                budget -= sum(len(e.data) for e in out)
            lo = stable_hi
        for e in self._unstable[lo - self._unstable_offset : hi - self._unstable_offset]:
            if budget is not None:
                if out and len(e.data) > budget:
                    break
                budget -= len(e.data)
            out.append(e)
        return out

    @staticmethod
    def _take(src: list[Entry], start: int, count: int, budget: int | None) -> list[Entry]:
        """Up to ``count`` entries from ``src[start:]``: at least one, then
        within ``budget`` bytes of data (the LogStorage.entries contract)."""
        window = src[start : start + count]
        if budget is None:
            return window
        total = 0
        for k, e in enumerate(window):
            total += len(e.data)
            if total > budget and k > 0:
                return window[:k]
        return window

    def unstable_entries(self) -> tuple[Entry, ...]:
        return tuple(self._unstable)

    def has_next_committed(self) -> bool:
        return self.committed > self.applied

    def next_committed(self, max_bytes: int) -> list[Entry]:
        if self.committed <= self.applied:
            return []
        return self.entries(self.applied + 1, self.committed + 1, max_bytes)

    # -- writes (in memory; the driver persists) ------------------------------
    def append(self, ents: Sequence[Entry]) -> None:
        """Append ``ents``, replacing any suffix starting at ``ents[0].index``."""
        if not ents:
            return
        first = ents[0].index
        if first <= self.committed:
            raise InvariantViolation(
                f"truncating committed entries: append at {first}, committed {self.committed}"
            )
        if first > self.last_index() + 1:
            raise InvariantViolation(f"append at {first} leaves a gap after {self.last_index()}")
        if first >= self._unstable_offset:
            del self._unstable[first - self._unstable_offset :]
        else:
            # The conflicting suffix reaches into stable storage: everything
            # from ``first`` is now unstable and the stored copy is shadowed.
            self._unstable = []
            self._unstable_offset = first
            if first <= self._cache_offset:
                self._cache = []
                self._cache_bytes = 0
                self._cache_offset = first
            else:
                dropped = self._cache[first - self._cache_offset :]
                del self._cache[first - self._cache_offset :]
                self._cache_bytes -= sum(len(e.data) for e in dropped)
        self._unstable.extend(ents)
        self._last_end_pos = ents[-1].end_pos

    def restore(self, snap: SnapshotMeta, allow_rollback: bool = False) -> None:
        """Replace the whole log by a snapshot past our commit index (pending
        until the driver persists it). ``allow_rollback`` is for a fault
        switch only (the simulator must catch it)."""
        if snap.index <= self.committed and not allow_rollback:
            raise InvariantViolation(
                f"restoring snapshot {snap.index} at or below the commit index {self.committed}"
            )
        self._pending = snap
        self._unstable = []
        self._unstable_offset = snap.index + 1
        self._cache = []
        self._cache_bytes = 0
        self._cache_offset = self._unstable_offset
        self.committed = snap.index
        self.applied = snap.index
        self._last_end_pos = snap.end_pos

    def snapshot_persisted(self, snap: SnapshotMeta) -> None:
        """The driver reset the stored log to ``snap`` (Ready.snapshot)."""
        if self._pending == snap:
            self._pending = None

    def end_pos(self, index: int) -> int:
        """End CommitLog position of entry ``index`` (which must be readable
        or be the entry right before the first one)."""
        if index == self.first_index() - 1:
            if self._pending is not None:
                return self._pending.end_pos
            return self.storage.front_pos()
        if index == 0:
            return 0
        return self.entries(index, index + 1)[0].end_pos

    def commit_to(self, index: int) -> bool:
        if index <= self.committed:
            return False
        if index > self.last_index():
            raise InvariantViolation(f"commit {index} beyond the last index {self.last_index()}")
        self.committed = index
        return True

    def applied_to(self, index: int) -> None:
        if index > self.committed or index < self.applied:
            raise InvariantViolation(
                f"applied_to({index}) outside [{self.applied}, {self.committed}]"
            )
        self.applied = index

    def stable_to(self, index: int, term: int) -> None:
        """The driver persisted entries up to ``index`` (of ``term``)."""
        if index < self._unstable_offset:
            return
        k = index - self._unstable_offset
        if k >= len(self._unstable) or self._unstable[k].term != term:
            return  # replaced since that Ready was taken; persist it next time
        done = self._unstable[: k + 1]
        del self._unstable[: k + 1]
        self._unstable_offset = index + 1
        self._cache.extend(done)
        self._cache_bytes += sum(len(e.data) for e in done)
        drop = max(len(self._cache) - self._cache_entries_max, 0)
        dropped_bytes = sum(len(e.data) for e in self._cache[:drop])
        while self._cache_bytes - dropped_bytes > self._cache_bytes_max and drop < len(self._cache):
            dropped_bytes += len(self._cache[drop].data)
            drop += 1
        if drop:
            del self._cache[:drop]
            self._cache_offset += drop
            self._cache_bytes -= dropped_bytes

    # -- helpers -------------------------------------------------------------
    def _end_pos_of(self, index: int) -> int:
        if index < self.storage.first_index():
            return self.storage.front_pos()
        return self.storage.entries(index, index + 1)[0].end_pos
