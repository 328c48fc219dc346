"""The write-ahead log in front of the LMDB log (``flush="sync"``).

Why
---
An LMDB commit that is durable costs two flushes of the disk: the dirty
pages then ``fdatasync``, then the meta page through a second, ``O_DSYNC``
descriptor (1.4-1.9 ms per group commit with three nodes on one disk here,
issue 17's note). A group commit needs only one: append the batch to a file
and ``fdatasync`` it (0.2-0.4 ms). So :class:`~dledger.storage.lmdb_store.LmdbStorage`
makes each ``sync()`` durable by appending one record here, keeps the
batch in its in-memory view, and commits LMDB (with its two flushes) only
every :data:`~dledger.storage.lmdb_store.WAL_COMMIT_INTERVAL_S` or so, with
every batch logged meanwhile in one transaction. That commit records the
sequence number of the last record it covers; the file is then emptied.

Format
------
A sequence of records, each starting at a multiple of 8 bytes::

    magic u32 | body length u32 | seq u64 | crc u32 | body | zero padding

The CRC32 covers the first 16 header bytes and the body, so a flipped bit
in the length or the sequence number is caught like one in the body. It
starts from the store's *key*, 32 random bits drawn when the store first
logs and kept in LMDB (never sent anywhere), instead of from zero: a body
holds message payloads byte for byte, and a producer could otherwise put
a whole, CRC-valid record with any sequence number inside one. Scanning
never reads inside a whole record, but the check for rot below reads
every 8-byte boundary after a damaged one, and there a forged record in
the torn tail's own payload would pass for a later record of the log and
refuse a replica that a power cut merely tore (with a key, a forgery
passes with odds of 2**-32). Stores logged before the key existed read
their records with key 0 (the plain CRC32) once, and get a key then.
Sequence numbers grow by one from record to record and never restart
(the LMDB image records the last one it covers), so a record left over from
before the file was emptied is recognised by its number.

Reading it back (:func:`scan`)
------------------------------
The file is read from the start while records are whole, pass their CRC
and continue the sequence. Where that stops:

* at the end of the file, or at a record with a lower number (left over
  from before the file was emptied, when the truncation itself was not yet
  on disk): the log ends there;
* at a damaged record: if no whole record with a number above every
  number seen (and above the one LMDB covers) follows at any 8-byte
  boundary after it, it is the torn tail of a write that a crash cut short
  and whose ``fdatasync`` never returned, so nothing in it was
  acknowledged; it is cut off (reported in the log). If such a record does
  follow, a record in the middle of the log rotted: :class:`StorageCorrupted`,
  the replica must be rebuilt.

Only one record can be torn: each is written with one ``write`` and made
durable before the next is written.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from dledger.core.codec import decode_entry, encode_entry
from dledger.core.types import Entry, HardState
from dledger.errors import CodecError, StorageCorrupted

logger = logging.getLogger(__name__)

WAL_NAME = "wal"
MAGIC = 0xD1EDA1CE
ALIGN = 8
_HEAD = struct.Struct("<IIQ")  # magic, body length, seq
_CRC = struct.Struct("<I")
HEAD_SIZE = _HEAD.size + _CRC.size
_BODY = struct.Struct("<QQQQI")  # term, vote, commit, truncate-from (0: none), entries
_LEN = struct.Struct("<I")
# Bodies above this are refused: a record this large was never written.
MAX_BODY = 1 << 30


@dataclass(frozen=True)
class WalRecord:
    """One group commit: the hard state after it, and the log from
    ``trunc_from`` on (``entries`` start there) when the log changed."""

    seq: int
    hard_state: HardState
    trunc_from: int
    entries: list[Entry]


def new_key() -> int:
    """A store's key (see the module doc): 32 random bits, never 0 (the
    key of stores logged before keys existed)."""
    return int.from_bytes(os.urandom(4), "little") or 1


def _pad(n: int) -> int:
    return -n % ALIGN


def encode_record(
    seq: int, hs: HardState, trunc_from: int, entries: Sequence[Entry], key: int = 0
) -> bytes:
    parts = [_BODY.pack(hs.term, hs.vote, hs.commit, trunc_from, len(entries))]
    for e in entries:
        rec = encode_entry(e)
        parts.append(_LEN.pack(len(rec)))
        parts.append(rec)
    body = b"".join(parts)
    head = _HEAD.pack(MAGIC, len(body), seq)
    crc = zlib.crc32(body, zlib.crc32(head, key))
    return b"".join((head, _CRC.pack(crc), body, b"\0" * _pad(HEAD_SIZE + len(body))))


def decode_body(seq: int, body: bytes | memoryview) -> WalRecord:
    """The record whose CRC already passed; raises CodecError on a body
    that does not parse (a bug, not rot: the CRC covered it)."""
    mv = memoryview(body)
    if len(mv) < _BODY.size:
        raise CodecError(f"WAL record {seq}: body of {len(mv)} bytes is too short")
    term, vote, commit, trunc_from, n = _BODY.unpack_from(mv, 0)
    off = _BODY.size
    entries: list[Entry] = []
    for _ in range(n):
        if off + _LEN.size > len(mv):
            raise CodecError(f"WAL record {seq}: entry {len(entries)} runs past the body")
        (length,) = _LEN.unpack_from(mv, off)
        off += _LEN.size
        if off + length > len(mv):
            raise CodecError(f"WAL record {seq}: entry {len(entries)} runs past the body")
        entries.append(decode_entry(mv[off : off + length]))
        off += length
    if off != len(mv):
        raise CodecError(f"WAL record {seq}: {len(mv) - off} bytes after the last entry")
    if entries and entries[0].index != trunc_from:
        raise CodecError(f"WAL record {seq}: entries start at {entries[0].index}, not {trunc_from}")
    return WalRecord(seq, HardState(term=term, vote=vote, commit=commit), trunc_from, entries)


def _record_at(data: bytes, off: int, key: int = 0) -> tuple[int, int, memoryview] | None:
    """(seq, end offset incl. padding, body) of a whole record starting at
    ``off`` whose CRC (started from ``key``) is valid, else None."""
    if off + HEAD_SIZE > len(data):
        return None
    magic, length, seq = _HEAD.unpack_from(data, off)
    if magic != MAGIC or length > MAX_BODY:
        return None
    start = off + HEAD_SIZE
    end = start + length
    if end > len(data):
        return None
    (crc,) = _CRC.unpack_from(data, off + _HEAD.size)
    mv = memoryview(data)
    if zlib.crc32(mv[start:end], zlib.crc32(mv[off : off + _HEAD.size], key)) != crc:
        return None
    return seq, end + _pad(HEAD_SIZE + length), mv[start:end]


@dataclass
class ScanResult:
    records: list[tuple[int, memoryview]]  # (seq, body), in file order
    end: int  # where the log ends: a torn tail starts here
    torn: bool  # bytes after ``end`` that are not a left-over log


def scan(data: bytes, covered: int, path: str = "", key: int = 0) -> ScanResult:
    """Read the records of a WAL file's contents (see the module doc);
    ``key``: the store's, which every record's CRC starts from."""
    records: list[tuple[int, memoryview]] = []
    off = 0
    prev: int | None = None
    while True:
        got = _record_at(data, off, key)
        if got is None:
            break
        seq, end, body = got
        if prev is not None and seq != prev + 1:
            if seq <= prev:
                return ScanResult(records, off, False)  # left over from before a reset
            raise StorageCorrupted(
                f"the write-ahead log in {path} skips from record {prev} to {seq}; "
                "rebuild this replica from a healthy peer"
            )
        records.append((seq, body))
        prev = seq
        off = end
    if off >= len(data):
        return ScanResult(records, off, False)
    # A damaged record at ``off``: a torn tail, unless the log goes on after it.
    floor = max(covered, prev if prev is not None else 0)
    for later in range(off + ALIGN, len(data) - HEAD_SIZE + 1, ALIGN):
        got = _record_at(data, later, key)
        if got is not None and got[0] > floor:
            raise StorageCorrupted(
                f"the write-ahead log in {path} has a damaged record at byte {off} "
                f"followed by record {got[0]} at byte {later}: a record in the middle "
                "of the log rotted. Rebuild this replica from a healthy peer."
            )
    return ScanResult(records, off, True)


class Wal:
    """The file: appends made durable one at a time, emptied after LMDB
    covers it. Errors are the caller's to turn into StorageFailed."""

    def __init__(self, directory: str, *, durable: bool = True) -> None:
        self.path = os.path.join(directory, WAL_NAME)
        self.durable = durable
        self._fd = -1
        self.size = 0
        self.appends = 0

    def read(self) -> bytes:
        """The file's contents (b"" when there is none yet)."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def open(self, keep: int) -> None:
        """Open for appending after the first ``keep`` bytes (the valid log
        :func:`scan` found); anything after them is cut off and the cut made
        durable before anything new is appended."""
        created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        st = os.fstat(self._fd)
        if st.st_size > keep:
            os.ftruncate(self._fd, keep)
            os.fsync(self._fd)
        self.size = keep
        if created:
            fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, record: bytes) -> None:
        """Write ``record`` at the end and make it durable."""
        view = memoryview(record)
        off = self.size
        while view:
            n = os.pwrite(self._fd, view, off)
            view = view[n:]
            off += n
        if self.durable:
            os.fdatasync(self._fd)
        self.size = off
        self.appends += 1

    def reset(self) -> None:
        """Empty the file (everything in it is covered by LMDB). Not
        fsynced: left-over records are recognised by their numbers."""
        if self.size:
            os.ftruncate(self._fd, 0)
            self.size = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
