"""What the node applies committed entries to.

Contract: the node calls :meth:`StateMachine.apply` once per committed entry,
in log order, on the event loop thread, for every entry type (NORMAL, NOOP,
CONF_CHANGE); a state machine that only cares about data ignores the others.
The return value of ``apply`` for a NORMAL entry is handed back to the
proposer.

Snapshots: ``snapshot()`` returns the whole state as deterministic bytes at
the last applied index and ``restore(data)`` replaces the state with one
such snapshot (at a start over a saved snapshot, or when the leader installs
one); after that, ``apply`` continues with the entry after the snapshot.
"""

from __future__ import annotations

import bisect
import struct
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from dledger.core.types import Entry, EntryType


class StateMachine(Protocol):
    def apply(self, entry: Entry) -> object: ...

    def snapshot(self) -> bytes: ...

    def snapshot_builder(self) -> Callable[[], bytes]:
        """Freeze the state as it is now, cheaply, and return a function that
        encodes that frozen state to exactly what :meth:`snapshot` would have
        returned now. The function touches nothing the next ``apply`` changes,
        so the node runs it in a worker thread while applying goes on."""
        ...

    def restore(self, data: bytes) -> None: ...


@runtime_checkable
class DurableStateMachine(Protocol):
    """A state machine that keeps its state in the node's storage, written in
    the log's group commits (see ``LmdbStorage.stage``), so a restart reads
    it back instead of replaying the log from the snapshot. The node stages
    a checkpoint every so often; at start it asks for the last one."""

    @property
    def durable(self) -> bool: ...

    def attach_storage(self, storage: Any) -> None: ...

    def checkpoint(self) -> int:
        """Stage the state as of the last applied entry; returns the number
        ``checkpoint_durable`` takes."""
        ...

    def checkpoint_durable(self, seq: int) -> bool: ...

    def load_checkpoint(self) -> int | None:
        """The applied index of the last durable checkpoint (the state is
        taken back from it), or None; SnapshotError if it is damaged."""
        ...

    def discard_checkpoint(self) -> None: ...

    def compact_floor(self) -> int | None:
        """The lowest log index the state still reads from (None: none)."""
        ...

    def log_compacted(self, front_pos: int) -> None: ...

    def prepare_restore(self, data: bytes) -> Callable[[], None]:
        """``restore`` in two steps: the heavy part (safe to run in a worker
        thread while the loop serves), then a quick one run on the loop."""
        ...


class SnapshotError(ValueError):
    """A state machine snapshot that cannot be restored (damaged or foreign)."""


# Version 2 stores the records as three big-endian columns (every index,
# then every term, then every CRC), written and read as whole arrays: a
# checkpoint of 80,000 records took about 40 ms of Python packing on the
# event loop (once a second, the produce p99 at low load) and now takes a
# copy. Version 1 (one ``>QQI`` row per record) is still read.
_LSM_MAGIC = b"DLLSM\x00\x00\x02"
_LSM_MAGIC_V1 = b"DLLSM\x00\x00\x01"
_LSM_HEAD = struct.Struct(">8sQQQ")  # magic, last_applied, records, recent payloads
_LSM_RECORD = struct.Struct(">QQI")  # version 1: index, term, crc32(data)
_LSM_RECENT = struct.Struct(">QQI")  # index, term, payload length
_CRC = struct.Struct(">I")
_BIG_ENDIAN = sys.byteorder == "big"


def big_endian_bytes(values: array[int]) -> bytes:
    """An array's items as big-endian bytes (a copy and a swap, no loop)."""
    if _BIG_ENDIAN:
        return values.tobytes()
    swapped = values[:]
    swapped.byteswap()
    return swapped.tobytes()


def from_big_endian(typecode: str, raw: bytes) -> array[int]:
    """The array that :func:`big_endian_bytes` wrote ``raw`` from."""
    out = array(typecode)
    out.frombytes(raw)
    if not _BIG_ENDIAN:
        out.byteswap()
    return out


class LogStateMachine:
    """Records ``(index, term, crc32(data))`` of every NORMAL entry applied.

    It keeps no payloads, only what tests and operators need to compare
    replicas: two nodes applied the same log iff their records agree.
    ``apply`` returns the CRC, so a proposer can check what was applied.

    With ``max_records`` only the newest records are kept (a broker node
    keeps 65,536: its state is the broker's, and these records are there to
    compare replicas, which needs the recent ones).

    Its snapshot holds every record kept (20 bytes each) and the recent payload
    window as it is, so a restored replica answers ``records()`` and
    ``recent()`` exactly like one that applied the whole log. Nothing is
    lost; the price is that the snapshot grows with the number of NORMAL
    entries ever applied (and the window, up to ``recent_payloads`` *
    ``payload_bytes_max`` bytes).
    """

    def __init__(
        self,
        recent_payloads: int = 10_000,
        payload_bytes_max: int = 4096,
        max_records: int | None = None,
    ) -> None:
        # One record per NORMAL entry, kept as three parallel arrays (about
        # 20 bytes a record instead of ~150 for a list of int tuples).
        self._idx = array("q")
        self._term = array("q")
        self._crc = array("I")  # 4 bytes (``L`` is 8 on 64-bit Linux)
        self.last_applied = 0
        # The most recent small payloads, so an operator (and the demo) can
        # read back what was written; bounded so memory stays flat.
        self._recent: deque[tuple[int, int, bytes]] = deque(maxlen=recent_payloads)
        self._payload_bytes_max = payload_bytes_max
        # None: every record is kept. Otherwise the oldest are dropped once a
        # quarter more than ``max_records`` are held (a count, so every
        # replica that applied the same log drops the same ones).
        self._max_records = max_records

    def _keep_payload(self, data: bytes) -> bool:
        """Whether a payload goes into the recent window (a subclass that
        keeps its own copy of some payloads can say no)."""
        return True

    def apply(self, entry: Entry) -> object:
        if entry.index <= self.last_applied:
            raise AssertionError(
                f"entry {entry.index} applied after {self.last_applied}: apply order broken"
            )
        self.last_applied = entry.index
        if entry.type is not EntryType.NORMAL:
            return None
        crc = zlib.crc32(entry.data)
        if len(entry.data) <= self._payload_bytes_max and self._keep_payload(entry.data):
            self._recent.append((entry.index, entry.term, entry.data))
        self._idx.append(entry.index)
        self._term.append(entry.term)
        self._crc.append(crc)
        cap = self._max_records
        if cap is not None and len(self._idx) > cap + cap // 4:
            drop = len(self._idx) - cap
            del self._idx[:drop]
            del self._term[:drop]
            del self._crc[:drop]
        return crc

    def snapshot(self) -> bytes:
        return self.snapshot_builder()()

    def snapshot_builder(self) -> Callable[[], bytes]:
        # Copies of the containers (array copies are memcpy, the payload
        # window holds immutable tuples); the packing loop runs later.
        last_applied = self.last_applied
        idx, term, crc = self._idx[:], self._term[:], self._crc[:]
        recent = list(self._recent)

        def build() -> bytes:
            parts = [_LSM_HEAD.pack(_LSM_MAGIC, last_applied, len(idx), len(recent))]
            parts += (big_endian_bytes(idx), big_endian_bytes(term), big_endian_bytes(crc))
            for r_index, r_term, data in recent:
                parts.append(_LSM_RECENT.pack(r_index, r_term, len(data)))
                parts.append(data)
            body = b"".join(parts)
            return body + _CRC.pack(zlib.crc32(body))

        return build

    def restore(self, data: bytes) -> None:
        """Replace the state with a snapshot's; raises SnapshotError."""
        data = bytes(data)
        if len(data) < _LSM_HEAD.size + _CRC.size:
            raise SnapshotError("log state machine snapshot is truncated")
        body = data[: -_CRC.size]
        if zlib.crc32(body) != _CRC.unpack_from(data, len(body))[0]:
            raise SnapshotError("log state machine snapshot CRC mismatch")
        magic, applied, n_records, n_recent = _LSM_HEAD.unpack_from(body, 0)
        if magic not in (_LSM_MAGIC, _LSM_MAGIC_V1):
            raise SnapshotError("not a log state machine snapshot")
        off = _LSM_HEAD.size
        end = off + n_records * _LSM_RECORD.size  # 20 bytes a record in both versions
        if end > len(body):
            raise SnapshotError("log state machine snapshot overruns its records")
        if magic == _LSM_MAGIC:
            mid, last = off + 8 * n_records, off + 16 * n_records
            a_idx = from_big_endian("q", body[off:mid])
            a_term = from_big_endian("q", body[mid:last])
            a_crc = from_big_endian("I", body[last:end])
        else:
            a_idx, a_term, a_crc = array("q"), array("q"), array("I")
            for i, t, c in _LSM_RECORD.iter_unpack(body[off:end]):
                a_idx.append(i)
                a_term.append(t)
                a_crc.append(c)
        off = end
        recent: deque[tuple[int, int, bytes]] = deque(maxlen=self._recent.maxlen)
        for _ in range(n_recent):
            if off + _LSM_RECENT.size > len(body):
                raise SnapshotError("log state machine snapshot overruns its payloads")
            index, term, size = _LSM_RECENT.unpack_from(body, off)
            off += _LSM_RECENT.size
            if off + size > len(body):
                raise SnapshotError("log state machine snapshot overruns its payloads")
            recent.append((index, term, body[off : off + size]))
            off += size
        if off != len(body):
            raise SnapshotError("log state machine snapshot has trailing bytes")
        self.last_applied = applied
        self._idx, self._term, self._crc = a_idx, a_term, a_crc
        self._recent = recent

    def records(self, start: int = 1, limit: int = 1000) -> list[tuple[int, int, int]]:
        """Up to ``limit`` records of entries with ``index >= start``, in order."""
        k = bisect.bisect_left(self._idx, start)
        hi = k + max(0, limit)
        return list(zip(self._idx[k:hi], self._term[k:hi], self._crc[k:hi], strict=True))

    def recent(self, start: int = 1, limit: int = 100) -> list[tuple[int, int, bytes]]:
        """Payloads of recent NORMAL entries with ``index >= start`` (bounded window)."""
        out = [r for r in self._recent if r[0] >= start]
        return out[: max(0, limit)]

    def __len__(self) -> int:
        return len(self._idx)
