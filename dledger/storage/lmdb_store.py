"""Durable Raft log and hard state on LMDB, with group commit.

Theory of operation
-------------------
One LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``)
with three named sub-databases:

``log``
    key = 8-byte big-endian index (so LMDB's byte order is index order and
    appends can use ``MDB_APPEND``), value = the :func:`dledger.core.codec.encode_entry`
    record, which carries its own CRC32. LMDB does not checksum pages, so
    this CRC is what turns a flipped bit into :class:`StorageCorrupted`
    instead of wrong data.
``meta``
    ``format`` (a version tag), ``hard_state`` (term, vote, commit) and
    ``front`` (the compaction marker: offset index, offset term, offset end
    position). Each is a big-endian struct followed by a CRC32 that also
    covers the key, so a value can neither rot nor be swapped unnoticed.
``epochs``
    The Epoch-StartOffset map (what Kafka calls the leader-epoch cache):
    key = 8-byte big-endian term, value = CommitLog position (``Entry.pos``)
    of the first entry of that term, then the index of that entry, then a
    CRC32. The index is not needed by :meth:`LmdbStorage.epoch_map` but it
    lets :meth:`LmdbStorage.term` answer any index with a bisect over the
    epochs instead of an LMDB read, and makes truncation exact even when
    zero-length entries (NOOPs) share a position.

Epochs are a pure function of the log: one epoch per run of equal terms,
plus, once anything has been compacted, a *marker* epoch for the term of the
last compacted entry (index ``first_index() - 1``) starting at
``front_pos()``. ``truncate_from`` drops the epochs that start at or after
the cut; ``compact`` drops the epochs entirely below the new front and
clamps the one straddling it to the front (Kafka's ``truncateFromStart``).

Group commit and read-your-writes
---------------------------------
``append``, ``truncate_from``, ``compact`` and ``save_hard_state`` only
change an in-memory view: buffered entries form a contiguous suffix
``[limit, last]`` and durable records are live for ``(offset, limit)``.
Every read goes through that view, so callers see their own writes before
``sync()``. ``sync()`` applies the whole batch in ONE write transaction
(deletions at the back, deletions at the front, appends, meta, epochs), so
the on-disk image only ever moves between states that were synced as a
whole. If the map is full, the transaction is aborted, the map doubled and
the batch replayed: the batch is only discarded after a successful commit.

``close()`` deliberately does NOT commit buffered writes: anything not
``sync()``-ed is lost, exactly as if the process had crashed. That keeps the
crash model of :class:`dledger.storage.memory.MemoryStorage` and lets tests
simulate a crash by closing.

Flush modes
-----------
``flush="sync"`` (default)
    Every ``sync()`` is durable before it returns: one record appended to
    the write-ahead log and fsynced (see "Write-ahead log"), or an LMDB
    commit opened with ``sync=True, metasync=True`` (data and meta pages
    fsynced). An acknowledged write survives power loss.
``flush="async"``
    The environment is opened with ``sync=False``: ``sync()`` commits the
    transaction into the page cache and returns without fsync, and
    :meth:`LmdbStorage.maybe_flush` fsyncs at most once per
    ``flush_interval_s`` (``close()`` and :meth:`LmdbStorage.flush` fsync
    too). Committed transactions survive a process crash (the kernel still
    has the pages) but NOT power loss: if a majority of replicas lose power
    within one flush interval, writes that were acknowledged to clients are
    lost. This is the trade DLedger/RocketMQ make with ASYNC_FLUSH (an ack
    once the page cache has it); use it only when that is acceptable.
    A change of term or vote is the exception: the commit that records it
    is fsynced at once, so a node never votes twice in one term however it
    loses power.

Write-ahead log
---------------
In sync mode a durable LMDB commit costs two flushes of the disk (the pages,
then the meta page), 1.4-1.9 ms per group commit with three nodes on one
disk. ``sync()`` instead appends the batch's changes since the last record
(the entries from the first index changed, the hard state) as one
CRC-framed record to the file ``wal`` (:mod:`dledger.storage.wal`) and
fsyncs it: 0.2-0.4 ms. The batch stays in the in-memory view, so reads see
it as before, and LMDB takes everything logged in one ordinary commit at
most ``WAL_COMMIT_INTERVAL_S`` later (or when the file reaches
``WAL_MAX_BYTES``; each bound scaled by a random share drawn per cycle),
recording the number of the last record it covers under ``wal`` in the
meta db; the file is then emptied. That catch-up runs inside the
``sync()`` that finds it due, or, with ``sync(catch_up=False)``, when the
caller runs :meth:`LmdbStorage.checkpoint` after :meth:`catch_up_due`
said so (the node does, once the group commit's answers are out). A batch that LMDB
must see at once goes there directly, with everything logged before it: a
snapshot, a compaction, the owner's side rows, or more than
``WAL_RECORD_MAX`` bytes of entries. Opening replays the records past the
covered number into the view and commits them (``wal_replayed``); a torn
last record (a write whose fsync never returned) is cut off, a damaged
record followed by later ones is :class:`StorageCorrupted`. ``close()``
leaves LMDB covering the log unless unsynced writes are buffered (those are
dropped, as in a crash). Async mode commits LMDB directly and replays a log
a sync-mode run left behind. :meth:`LmdbStorage.buffered_tail` hands the
entries only the log holds to readers of a read transaction in other
threads.

Recovery
--------
Opening verifies the tail of the log (the last ``verify_tail`` entries, or
all of them with ``verify="full"``): CRC, key index == record index,
consecutive indexes, non-decreasing terms, ``pos(i) == end_pos(i - 1)``
(the front links to the compaction marker) and agreement with the epoch
map. A failure raises :class:`StorageCorrupted` naming the index and the
data directory: the replica must be rebuilt, not restarted. Records outside
the verified tail are still checked whenever they are read, and
:meth:`LmdbStorage.verify_all` scans everything on demand.

``term()`` is answered from the (CRC-checked) epoch index and never reads
an entry record, so a corrupt payload cannot make it return a wrong term;
the corrupt record itself is reported by ``entries()``.

Because recovery insists on those invariants, ``append`` refuses (with
``ValueError``) batches that break them -- non-consecutive indexes, a term
going backwards, a ``pos`` that does not continue the previous entry -- and
``compact`` refuses a ``term``/``pos`` that does not describe entry
``upto - 1``. Accepting them would only turn into a false corruption report
at the next restart.

Side databases
--------------
The owner of the node's state machine can keep its own durable state in the
same environment (:meth:`LmdbStorage.side_db`, at most
``MAX_SIDE_DBS`` named databases): :meth:`LmdbStorage.stage` hands over a
batch of puts and deletes, and the next ``sync()`` writes it in the same
write transaction as the log, so the two only ever move together (in
``async`` mode a power loss rolls both back to the same transaction).
The storage never reads what it stages; the owner keeps its own
read-your-writes view until :attr:`LmdbStorage.side_synced` reaches the
number :meth:`stage` returned.

Snapshots
---------
:class:`LmdbStorage` also implements
:class:`~dledger.storage.base.SnapshotStore`. The payload lives in a file
``snapshot-<index>-<term>.snap`` in the data directory: a header (magic,
format version, index, term, end position, voters, learners, data length),
the data, then a CRC32 over everything before it (never pickle). ``sync()``
writes a buffered snapshot first (tmp file, fsync, rename, fsync of the
directory), then records its header under ``snapshot`` in the meta db in the
same LMDB transaction as the rest of the batch; the meta db is the authority,
so a crash between the rename and the commit leaves the previous snapshot in
force (the orphan file is removed at the next open). Older snapshot files are
deleted only after the commit (in async mode that commit is fsynced first).
``apply_snapshot`` drops every log entry and moves the compaction front to
the snapshot (marker epoch = the snapshot's term at its end position).

Disk errors
-----------
A write or fsync the disk refuses (``EIO``, ``ENOSPC``: LMDB's commit or
``mdb_env_sync`` fails, or a snapshot file cannot be written) raises
:class:`StorageFailed` and *poisons* the instance: every later ``sync()``,
``flush()`` and snapshot write raises the same error without touching the
disk, and ``close()`` does not flush. A failed fsync is never retried: on
Linux the pages whose writeback failed are marked clean (their data may be
gone), so a second fsync would report success for data that is not on disk
(PostgreSQL's "fsyncgate"). The batch that failed was never reported
durable, so nothing of it was acknowledged; the owner stops, and a restart
on a healthy disk recovers from what was made durable.

Not thread-safe: one owner (the node's storage loop) drives an instance.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import random
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, TypeAlias

import lmdb

from dledger import faults
from dledger.core.codec import decode_entry, encode_entry
from dledger.core.types import ClusterConfig, Entry, EntryType, HardState, Snapshot, SnapshotMeta
from dledger.errors import (
    CodecError,
    Compacted,
    ConfigError,
    InvariantViolation,
    StorageCorrupted,
    StorageFailed,
)
from dledger.metrics import Histogram
from dledger.storage import wal as _wal

FlushMode = Literal["sync", "async"]
VerifyMode = Literal["tail", "full"]
# Something run inside one write transaction; see LmdbStorage._write.
logger = logging.getLogger(__name__)

_TxnFn: TypeAlias = "Callable[[lmdb.Transaction[bytes]], object]"

DEFAULT_MAP_SIZE = 256 << 20
DEFAULT_VERIFY_TAIL = 1024
DEFAULT_FLUSH_INTERVAL_S = 0.2

FORMAT_TAG = b"dledger-lmdb/3"
# Format 1 had no parted records (see "Parted records"); a directory in it is
# read as it is and its tag moved to 2 at open.
_OLDER_FORMATS = (b"dledger-lmdb/1", b"dledger-lmdb/2")

_KEY = struct.Struct(">Q")
_TRIPLE = struct.Struct(">QQQ")  # hard state and front marker bodies
_EPOCH = struct.Struct(">QQ")  # start pos, start index
_CRC = struct.Struct(">I")

_META_FORMAT = b"format"
_META_HARD_STATE = b"hard_state"
_META_FRONT = b"front"
_META_SNAPSHOT = b"snapshot"
_META_WAL = b"wal"  # the last write-ahead log record this image covers
_META_WAL_KEY = b"wal_key"  # what the log's record CRCs start from (dledger/storage/wal.py)

# The write-ahead log (flush="sync", see dledger/storage/wal.py): LMDB is
# committed at most this long after the first batch it has not covered yet,
# or once the log file or the batches held in memory for it reach
# WAL_MAX_BYTES. A batch whose new entries exceed WAL_RECORD_MAX goes
# straight to LMDB (a catch-up, a snapshot's worth: writing it twice would
# cost more than the second flush it saves).
# The size bound is what keeps a catch-up commit short under load: the node
# calls sync(catch_up=False) for a group commit and checkpoint() once the
# Ready's answers are out (Node._catch_up), but the next group commit waits
# for it, and its time grows with what it covers. (Before, a follower's small
# batches synced on the event loop took the catch-up along whenever their
# record made the log due: the loop stood still for 7-12 ms several times a
# second under load, and the acknowledgement waited.) At 45k msg/s (batched,
# half of saturation here) 8 MiB made one 15-17 ms commit every 0.5 s, which set the produce p99 (19-25 ms); 1 MiB
# makes one of 5-6 ms every 0.17 s: p99 12-16 ms, closed-loop batched p99
# 35-39 -> 17-19 ms, throughput unchanged (issue 17's note, 2026-11-28).
# Below 1 MiB the extra commits (two flushes each) start to cost throughput
# (512 KiB: 4% less batched). At low rates the interval decides, as before.
# Each replica catches up at a random share (CATCH_UP_SHARE_MIN..1) of both
# bounds, drawn anew after every catch-up (see _wal_due).
WAL_COMMIT_INTERVAL_S = 0.5
WAL_MAX_BYTES = 1 << 20
WAL_RECORD_MAX = 1 << 20
CATCH_UP_SHARE_MIN = 0.75


# A generator of the storage's own: the process-wide one belongs to whoever
# shares the process (a seeded run, hypothesis's checks around each draw;
# tests/http/test_global_random.py). Reseeded in a forked child, as the
# process-wide one is, so replicas forked from one parent still draw apart.
_RNG = random.Random()
os.register_at_fork(after_in_child=_RNG.seed)


def _catch_up_share() -> float:
    return CATCH_UP_SHARE_MIN + (1.0 - CATCH_UP_SHARE_MIN) * _RNG.random()


# The log's own databases plus these many for the owner's state (side_db).
MAX_SIDE_DBS = 4
_OWN_DBS = (b"log", b"meta", b"epochs", b"logparts")
# Parted records: a record longer than _INLINE_MAX is stored as parts in
# ``logparts`` (key: index, part number) and a stub under its index in
# ``log``. Small nodes pack leaf pages, where a single long value would take
# whole overflow pages and waste on average half a page per entry (18% of a
# 13.3 KB entry of 100 messages).
# Parts of at most 1,340 bytes, of equal size within a record: a part's
# node (8-byte header, 10-byte key, a 2-byte slot) then fits three to a
# 4 KiB leaf page (4,080 usable bytes) whatever the record's length.
_PART_MAX = 1340
_INLINE_MAX = 1340
_STUB_MAGIC = b"\xd1P"  # the entry record's magic is 0xD1E0 little-endian: E0 D1
_STUB = struct.Struct(">2sIII")  # magic, record length, parts, CRC32 of the record
_PKEY = struct.Struct(">QH")  # index, part

SNAPSHOT_MAGIC = b"DLSNAP\x00\x01"
SNAPSHOT_VERSION = 1
# magic, version, index, term, end_pos, number of voters, number of learners
_SNAP_HEAD = struct.Struct(">8sHQQQII")
_SNAP_LEN = struct.Struct(">Q")
_SNAP_PREFIX = "snapshot-"
_SNAP_SUFFIX = ".snap"


def snapshot_header(meta: SnapshotMeta, data_len: int) -> bytes:
    """The header of a snapshot file (everything before the data)."""
    cfg = meta.config
    return (
        _SNAP_HEAD.pack(
            SNAPSHOT_MAGIC,
            SNAPSHOT_VERSION,
            meta.index,
            meta.term,
            meta.end_pos,
            len(cfg.voters),
            len(cfg.learners),
        )
        + b"".join(_KEY.pack(v) for v in cfg.voters)
        + b"".join(_KEY.pack(v) for v in cfg.learners)
        + _SNAP_LEN.pack(data_len)
    )


def encode_snapshot_file(snap: Snapshot) -> bytes:
    """Header + data + CRC32 of both: the bytes of a snapshot file."""
    body = snapshot_header(snap.meta, len(snap.data)) + snap.data
    return body + _CRC.pack(zlib.crc32(body))


def decode_snapshot_file(raw: bytes) -> tuple[Snapshot, bytes]:
    """(snapshot, header bytes) of a snapshot file; ValueError if damaged."""
    if len(raw) < _SNAP_HEAD.size + _SNAP_LEN.size + _CRC.size:
        raise ValueError(f"truncated to {len(raw)} bytes")
    (crc,) = _CRC.unpack_from(raw, len(raw) - _CRC.size)
    body = raw[: -_CRC.size]
    if zlib.crc32(body) != crc:
        raise ValueError("CRC mismatch")
    magic, version, index, term, end_pos, nv, nl = _SNAP_HEAD.unpack_from(body, 0)
    if magic != SNAPSHOT_MAGIC:
        raise ValueError("bad magic")
    if version != SNAPSHOT_VERSION:
        raise ValueError(f"unsupported snapshot version {version}")
    off = _SNAP_HEAD.size
    ids_end = off + (nv + nl) * _KEY.size
    if ids_end + _SNAP_LEN.size > len(body):
        raise ValueError("header overruns the file")
    ids = [int(_KEY.unpack_from(body, off + k * _KEY.size)[0]) for k in range(nv + nl)]
    (data_len,) = _SNAP_LEN.unpack_from(body, ids_end)
    data_off = ids_end + _SNAP_LEN.size
    if data_off + data_len != len(body):
        raise ValueError(f"data length {data_len} does not match the file size")
    meta = SnapshotMeta(
        index=index,
        term=term,
        end_pos=end_pos,
        config=ClusterConfig(voters=tuple(ids[:nv]), learners=tuple(ids[nv:])),
    )
    return Snapshot(meta=meta, data=bytes(body[data_off:])), bytes(body[:data_off])


def _snapshot_name(meta: SnapshotMeta) -> str:
    return f"{_SNAP_PREFIX}{meta.index:020d}-{meta.term:020d}{_SNAP_SUFFIX}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# LMDB errors that mean "the file itself is damaged", as opposed to usage
# errors or resource limits.
_LMDB_DAMAGE: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
)
# ... and what a write transaction raises after meeting such damage (LMDB marks
# the txn bad; py-lmdb can surface that as a SystemError around the error).
_WRITE_DAMAGE: tuple[type[BaseException], ...] = (*_LMDB_DAMAGE, lmdb.BadTxnError, SystemError)


def _seal(key: bytes, body: bytes) -> bytes:
    """Append a CRC32 over key + body (the key is included so a value that
    ends up under the wrong key is caught too)."""
    return body + _CRC.pack(zlib.crc32(body, zlib.crc32(key)))


def _unseal(key: bytes, value: bytes | memoryview, body_size: int) -> bytes | None:
    """The body of a sealed value, or None if its length or CRC is wrong."""
    raw = bytes(value)
    if len(raw) != body_size + _CRC.size:
        return None
    body = raw[:body_size]
    (crc,) = _CRC.unpack_from(raw, body_size)
    if zlib.crc32(body, zlib.crc32(key)) != crc:
        return None
    return body


_LMDB_MAGIC = 0xBEEFC0DE
# Offsets inside an LMDB meta page (64-bit build): a 16-byte page header, then
# MDB_meta {magic u32, version u32, address ptr, mapsize size_t, dbs[2] (48 B
# each; dbs[0].md_pad holds the page size), last_pg size_t, txnid size_t}.
_META_MAGIC_OFF = 16
_META_PSIZE_OFF = 16 + 4 + 4 + 8 + 8
_META_LAST_PG_OFF = _META_PSIZE_OFF + 96
_META_TXNID_OFF = _META_LAST_PG_OFF + 8


def _unkey(key: bytes | memoryview) -> int:
    """Index (or term) of an 8-byte big-endian key; a damaged B-tree can hand
    back a key of another length, which is corruption, not a crash."""
    if len(key) != _KEY.size:
        raise StorageCorrupted(f"a {len(key)}-byte key where 8 bytes were expected (damaged file)")
    return int(_KEY.unpack(key)[0])


def _check_data_file_size(data_path: str) -> None:
    """Refuse a truncated ``data.mdb`` before LMDB maps it.

    LMDB memory-maps the file and trusts its meta page: pages past the end of
    a truncated file fault with SIGBUS, killing the process without a word.
    The newest meta page names the last page in use; the file must reach it."""
    try:
        size = os.path.getsize(data_path)
    except FileNotFoundError:
        return  # a new log
    with open(data_path, "rb") as f:
        head = f.read(_META_TXNID_OFF + 8)
        if len(head) < _META_TXNID_OFF + 8:
            raise StorageCorrupted(f"{data_path} is truncated to {size} bytes (no meta page)")
        (magic,) = struct.unpack_from("<I", head, _META_MAGIC_OFF)
        if magic != _LMDB_MAGIC:
            return  # not ours to judge here: lmdb.open reports it cleanly
        (psize,) = struct.unpack_from("<I", head, _META_PSIZE_OFF)
        if psize < 512 or psize & (psize - 1):
            raise StorageCorrupted(f"{data_path}: implausible page size {psize} in its meta page")
        f.seek(psize)
        second = f.read(_META_TXNID_OFF + 8)
    metas = [head]
    if len(second) == _META_TXNID_OFF + 8:
        metas.append(second)
    elif size < 2 * psize:
        raise StorageCorrupted(
            f"{data_path} is truncated to {size} bytes (second meta page missing)"
        )
    newest = max(metas, key=lambda m: struct.unpack_from("<Q", m, _META_TXNID_OFF)[0])
    (last_pg,) = struct.unpack_from("<Q", newest, _META_LAST_PG_OFF)
    need = (last_pg + 1) * psize
    if size < need:
        raise StorageCorrupted(
            f"{data_path} is truncated: {size} bytes, but its newest meta page uses pages "
            f"up to {last_pg} ({need} bytes); rebuild this replica from its peers"
        )


def _buffered(limit: int, pending: list[Entry], lo: int, hi: int) -> list[Entry]:
    """Buffered entries lo..hi-1 of a view (those at or above ``limit``).
    Empty when hi is at or below limit: a negative slice end would count
    from the end of the buffer and hand back entries after hi."""
    if hi <= limit:
        return []
    return pending[max(lo, limit) - limit : hi - limit]


class LmdbStorage:
    """Implements :class:`~dledger.storage.base.LogStorage`,
    :class:`~dledger.storage.base.StableStore` and
    :class:`~dledger.storage.base.SnapshotStore` on one LMDB environment (plus
    one snapshot file, see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        flush: FlushMode = "sync",
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        verify: VerifyMode = "tail",
        verify_tail: int = DEFAULT_VERIFY_TAIL,
        max_readers: int = 126,
        wal: bool = True,
    ) -> None:
        if flush not in ("sync", "async"):
            raise ConfigError(f"flush must be 'sync' or 'async', not {flush!r}")
        if verify not in ("tail", "full"):
            raise ConfigError(f"verify must be 'tail' or 'full', not {verify!r}")
        if verify_tail < 1:
            raise ConfigError("verify_tail must be >= 1 (the last entry is always checked)")
        if map_size < 1 << 16:
            raise ConfigError("map_size must be at least 64 KiB")
        if flush_interval_s < 0:
            raise ConfigError("flush_interval_s must be >= 0")
        if max_readers < 1:
            raise ConfigError("max_readers must be >= 1")

        self.path = os.fspath(path)
        self.flush_mode: FlushMode = flush
        self.flush_interval_s = flush_interval_s
        # Counters for tests and metrics.
        self.write_txns = 0  # sync() batches made durable (a WAL record or an LMDB commit)
        self.lmdb_commits = 0  # of which LMDB transactions
        self.wal_replayed = 0  # records replayed from the write-ahead log at open
        self.flushes = 0  # explicit fsyncs in async mode
        self.map_growths = 0
        # Durations of the writes that fsync: each group commit in sync mode
        # (one LMDB commit = write + fsync), each explicit flush in async mode.
        self.fsync_seconds = Histogram()

        os.makedirs(self.path, exist_ok=True)
        _check_data_file_size(os.path.join(self.path, "data.mdb"))
        durable = flush == "sync" and not faults.on(faults.SKIP_FSYNC)  # planted bug
        try:
            self._env = lmdb.open(
                self.path,
                map_size=map_size,
                subdir=True,
                lock=True,
                readahead=False,  # random reads of recent entries; don't pollute the cache
                max_dbs=len(_OWN_DBS) + MAX_SIDE_DBS,
                max_readers=max_readers,
                sync=durable,
                metasync=durable,
            )
        except _LMDB_DAMAGE as exc:
            raise StorageCorrupted(
                f"cannot open the LMDB environment in {self.path}: {exc}; "
                "the data directory is damaged or not a dledger log"
            ) from exc
        self._closed = False
        self._failed: StorageFailed | None = None
        try:
            self._log_db = self._env.open_db(b"log")
            self._parts_db = self._env.open_db(b"logparts")
            self._meta_db = self._env.open_db(b"meta")
            self._epoch_db = self._env.open_db(b"epochs")
            self._recover(full=verify == "full", tail=verify_tail)
            # The write-ahead log: on in sync mode; read (and replayed) in
            # any mode, since a directory may have been written in sync mode.
            self._wal_on = wal and flush == "sync"
            self._open_wal(durable=durable)
            faults.lose_unsynced_tail(self)  # planted bug skip_fsync (dledger/faults.py)
        except _LMDB_DAMAGE as exc:
            # A damaged B-tree page met while verifying (e.g. MDB_CORRUPTED
            # from a cursor) is damage like a bad CRC: the replica must be rebuilt.
            self._env.close()
            self._closed = True
            raise StorageCorrupted(
                f"LMDB reported damage while opening {self.path}: {exc}; "
                "rebuild this replica from its peers"
            ) from exc
        except BaseException:
            # Never leak the environment (and its lock) on a failed open.
            self._close_wal()
            self._env.close()
            self._closed = True
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        flush: FlushMode = "sync",
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        verify: VerifyMode = "tail",
        verify_tail: int = DEFAULT_VERIFY_TAIL,
        max_readers: int = 126,
        wal: bool = True,
    ) -> LmdbStorage:
        """Open (creating if needed) the log in directory ``path``."""
        return cls(
            path,
            map_size=map_size,
            flush=flush,
            flush_interval_s=flush_interval_s,
            verify=verify,
            verify_tail=verify_tail,
            max_readers=max_readers,
            wal=wal,
        )

    # -- recovery ----------------------------------------------------------
    def _recover(self, *, full: bool, tail: int) -> None:
        self._check_format()
        with self._env.begin(buffers=True) as txn:
            hs = self._read_hard_state(txn)
            compacted, offset, offset_term, offset_pos = self._read_front(txn)
            terms, idxs, poss = self._read_epochs(txn)
            snap_header = self._read_snapshot_header(txn)
            last, last_term, last_end = self._verify_log(
                txn,
                compacted=compacted,
                offset=offset,
                offset_term=offset_term,
                offset_pos=offset_pos,
                epochs=(terms, idxs, poss),
                tail=None if full else tail,
            )

        # The logical view (what every read sees, buffered writes included).
        self._hs = hs
        self._compacted = compacted  # a marker epoch exists for term(offset)
        self._offset, self._offset_term, self._offset_pos = offset, offset_term, offset_pos
        self._last, self._last_term, self._last_end = last, last_term, last_end
        # Epochs as parallel sorted lists so term(i) is a bisect on _ep_idx.
        self._ep_terms, self._ep_idx, self._ep_pos = terms, idxs, poss

        # Side databases (see "Side databases"): their handles, the batches
        # staged for the next commit, and how many stage() calls are durable.
        self._side: dict[bytes, lmdb._Database] = {}
        self._side_pending: dict[bytes, dict[bytes, bytes | None]] = {}
        self._side_staged = 0
        self.side_synced = 0
        self._batch_side: dict[bytes, dict[bytes, bytes | None]] = {}

        # The buffered batch: durable records are live for (offset, limit),
        # _pending holds entries limit..last.
        self._limit = last + 1
        self._pending: list[Entry] = []
        # The leader's group commit runs sync() in a worker thread while
        # the event loop keeps reading (consume pages, appends to send):
        # when that commit catches LMDB up it swaps the buffer and the
        # limit under this lock, and a read takes both under it (_view), so
        # it never pairs the old limit with the emptied buffer (a short
        # read: a spurious "record not here" for a committed message).
        self._view_lock = threading.Lock()
        self._hs_dirty = False
        # Term or vote changed since the last commit: fsynced even in async
        # mode (see sync()).
        self._vote_dirty = False
        self._front_dirty = False
        self._dirty_terms: set[int] = set()

        # What the durable image holds, to know what sync() must delete.
        self._durable_last = last

        # The write-ahead log (see _open_wal): the first index changed since
        # the last record (None: nothing), the hard state that record holds,
        # the last record's number, and when LMDB last covered the log.
        self._wal: _wal.Wal | None = None
        self._wal_key = 0  # what its record CRCs start from (_open_wal reads or makes it)
        self._wal_from: int | None = None
        self._wal_hs = hs
        self._wal_seq = 0
        self._wal_behind_s: float | None = None  # first record LMDB has not covered
        self._catch_up_share = _catch_up_share()  # see _wal_due

        # Async flushing.
        self._unflushed = False
        self._last_flush_s: float | None = None

        # Snapshots: the durable one (its header from the meta db and its
        # file name) and a buffered one that the next sync() makes durable.
        self._snap_header = snap_header
        self._snap_file: str | None = None
        self._snap_pending: Snapshot | None = None
        # The pending snapshot's file, when it was written ahead of the sync
        # (``write_snapshot_file`` + ``record_snapshot``), and the files being
        # written in worker threads right now (stale-file removal skips them).
        self._snap_pending_file: str | None = None
        self._snap_writing: set[str] = set()
        self._snap_lock = threading.Lock()
        self._batch_snap_header: bytes | None = None
        if snap_header is not None:
            meta = self._parse_header(snap_header)
            self._snap_file = _snapshot_name(meta)
        self._remove_stale_snapshot_files()

    def _open_wal(self, *, durable: bool) -> None:
        """Read the write-ahead log, replay the records LMDB does not cover
        into the view and commit them (see dledger/storage/wal.py)."""
        w = _wal.Wal(self.path, durable=durable)
        data = w.read()
        with self._env.begin(buffers=True) as txn:
            covered = self._read_wal_covered(txn)
            key = self._read_wal_key(txn)
        self._wal_key = key or 0
        if not data and not self._wal_on:
            return  # async mode, and nothing logged in sync mode to replay
        res = _wal.scan(data, covered, self.path, self._wal_key)
        if res.torn:
            logger.warning(
                "%s: the write-ahead log ends in a torn or damaged record (byte %d of %d); "
                "its write never completed (nothing in it was acknowledged): cut off",
                self.path,
                res.end,
                len(data),
            )
        replay = [(seq, body) for seq, body in res.records if seq > covered]
        if replay and replay[0][0] != covered + 1:
            raise self._corrupt(
                None,
                f"the LMDB image covers write-ahead log record {covered} but the log "
                f"resumes at record {replay[0][0]}",
            )
        w.open(keep=res.end)
        self._wal = w
        self._wal_seq = max([covered] + [seq for seq, _ in res.records])
        for seq, body in replay:
            try:
                rec = _wal.decode_body(seq, body)
                if rec.trunc_from and rec.trunc_from <= self._last:
                    self.truncate_from(rec.trunc_from)
                self.append(rec.entries)
            except (CodecError, ValueError, Compacted) as exc:
                raise self._corrupt(
                    None, f"write-ahead log record {seq} does not apply to the log: {exc}"
                ) from exc
            self.save_hard_state(rec.hard_state)
        self.wal_replayed = len(replay)
        if replay:
            self._commit()
            if self.flush_mode == "async":
                self._unflushed = True
                self.flush()  # before the log that held them is emptied
        if not self._wal_on:
            self._close_wal(reset=True)
        elif key is None:
            self._new_wal_key()

    def _new_wal_key(self) -> None:
        """Give a store that has none its write-ahead log key (a new store, or
        one logged before keys existed, whose records were just read with
        key 0 and are all covered now): durable before any record uses it,
        and the log emptied of records under the old key."""
        assert self._wal is not None
        fresh = _wal.new_key()
        self._write(
            lambda txn: txn.put(
                _META_WAL_KEY, _seal(_META_WAL_KEY, _KEY.pack(fresh)), db=self._meta_db
            )
        )
        self._wal_key = fresh
        try:
            self._wal.reset()
        except OSError as exc:
            raise self._disk_failed("empty the write-ahead log", exc) from exc

    def _read_wal_key(self, txn: lmdb.Transaction[memoryview]) -> int | None:
        raw = txn.get(_META_WAL_KEY, db=self._meta_db)
        if raw is None:
            return None
        body = _unseal(_META_WAL_KEY, raw, _KEY.size)
        if body is None:
            raise self._corrupt(None, "the write-ahead log key failed its CRC check")
        return _unkey(body)

    def _read_wal_covered(self, txn: lmdb.Transaction[memoryview]) -> int:
        raw = txn.get(_META_WAL, db=self._meta_db)
        if raw is None:
            return 0
        body = _unseal(_META_WAL, raw, _KEY.size)
        if body is None:
            raise self._corrupt(None, "the write-ahead log mark failed its CRC check")
        return _unkey(body)

    def _close_wal(self, *, reset: bool = False) -> None:
        w, self._wal = getattr(self, "_wal", None), None
        if w is not None:
            try:
                if reset:
                    w.reset()
            finally:
                w.close()

    def _check_format(self) -> None:
        with self._env.begin() as txn:
            tag = txn.get(_META_FORMAT, db=self._meta_db)
            fresh = tag is None and txn.stat(self._log_db)["entries"] == 0
        if tag is None and not fresh:
            raise self._corrupt(None, "the format tag is missing from a non-empty log")
        if tag is not None and tag != FORMAT_TAG and tag not in _OLDER_FORMATS:
            raise StorageCorrupted(
                f"the data directory {self.path} holds format {tag!r}, this build reads "
                f"{FORMAT_TAG!r} (and {', '.join(repr(t) for t in _OLDER_FORMATS)})"
            )
        if fresh or tag != FORMAT_TAG:
            self._write(lambda txn: txn.put(_META_FORMAT, FORMAT_TAG, db=self._meta_db))

    def _read_hard_state(self, txn: lmdb.Transaction[memoryview]) -> HardState:
        raw = txn.get(_META_HARD_STATE, db=self._meta_db)
        if raw is None:
            return HardState()
        body = _unseal(_META_HARD_STATE, raw, _TRIPLE.size)
        if body is None:
            raise self._corrupt(None, "the hard state record failed its CRC check")
        term, vote, commit = _TRIPLE.unpack(body)
        return HardState(term=term, vote=vote, commit=commit)

    def _read_front(self, txn: lmdb.Transaction[memoryview]) -> tuple[bool, int, int, int]:
        raw = txn.get(_META_FRONT, db=self._meta_db)
        if raw is None:
            return False, 0, 0, 0
        body = _unseal(_META_FRONT, raw, _TRIPLE.size)
        if body is None:
            raise self._corrupt(None, "the compaction marker failed its CRC check")
        offset, term, pos = _TRIPLE.unpack(body)
        return True, offset, term, pos

    def _read_snapshot_header(self, txn: lmdb.Transaction[memoryview]) -> bytes | None:
        value = txn.get(_META_SNAPSHOT, db=self._meta_db)
        if value is None:
            return None
        raw = bytes(value)
        body = _unseal(_META_SNAPSHOT, raw, len(raw) - _CRC.size) if len(raw) > _CRC.size else None
        if body is None:
            raise self._corrupt(None, "the snapshot record failed its CRC check")
        self._parse_header(body)
        return body

    def _parse_header(self, header: bytes) -> SnapshotMeta:
        if len(header) < _SNAP_HEAD.size + _SNAP_LEN.size:
            raise self._corrupt(None, "the snapshot record is truncated")
        magic, version, index, term, end_pos, nv, nl = _SNAP_HEAD.unpack_from(header, 0)
        if magic != SNAPSHOT_MAGIC or version != SNAPSHOT_VERSION:
            raise self._corrupt(None, "the snapshot record has a bad magic or version")
        if len(header) != _SNAP_HEAD.size + (nv + nl) * _KEY.size + _SNAP_LEN.size:
            raise self._corrupt(None, "the snapshot record has a bad length")
        ids = [
            int(_KEY.unpack_from(header, _SNAP_HEAD.size + k * _KEY.size)[0])
            for k in range(nv + nl)
        ]
        return SnapshotMeta(
            index=index,
            term=term,
            end_pos=end_pos,
            config=ClusterConfig(voters=tuple(ids[:nv]), learners=tuple(ids[nv:])),
        )

    def _remove_stale_snapshot_files(self) -> None:
        """Delete snapshot files (and temp files) other than the durable one
        and those being written or waiting to be recorded."""
        with self._snap_lock:
            keep = {n for w in self._snap_writing for n in (w, w + ".tmp")}
        keep.add(self._snap_file or "")
        keep.add(self._snap_pending_file or "")
        for name in os.listdir(self.path):
            if not name.startswith(_SNAP_PREFIX) or name in keep:
                continue
            if name.endswith(_SNAP_SUFFIX) or name.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.path, name))

    def _read_epochs(
        self, txn: lmdb.Transaction[memoryview]
    ) -> tuple[list[int], list[int], list[int]]:
        terms: list[int] = []
        idxs: list[int] = []
        poss: list[int] = []
        for key, value in txn.cursor(db=self._epoch_db).iternext():
            kb = bytes(key)
            body = _unseal(kb, value, _EPOCH.size) if len(kb) == _KEY.size else None
            if body is None:
                raise self._corrupt(None, f"the epoch record {kb.hex()} failed its CRC check")
            term = _unkey(kb)
            pos, idx = _EPOCH.unpack(body)
            # Keys iterate in term order; starts must follow it strictly.
            if idxs and (idx <= idxs[-1] or pos < poss[-1]):
                raise self._corrupt(idx, f"epoch {term} starts before the previous epoch")
            terms.append(term)
            idxs.append(idx)
            poss.append(pos)
        return terms, idxs, poss

    def _verify_log(
        self,
        txn: lmdb.Transaction[memoryview],
        *,
        compacted: bool,
        offset: int,
        offset_term: int,
        offset_pos: int,
        epochs: tuple[list[int], list[int], list[int]],
        tail: int | None,
    ) -> tuple[int, int, int]:
        """Check the durable log (its last ``tail`` entries, or all when None)
        against itself, the compaction marker and the epoch map. Returns the
        last index, its term and its end position."""
        terms, idxs, poss = epochs
        cur = txn.cursor(db=self._log_db)
        if not cur.first():
            if offset == 0 and not compacted:
                if terms:
                    raise self._corrupt(None, "the log is empty but the epoch map is not")
                return 0, 0, 0
            if terms != [offset_term] or idxs != [offset] or poss != [offset_pos]:
                raise self._corrupt(offset, "the epoch map does not match the compaction marker")
            return offset, offset_term, offset_pos
        first = _unkey(cur.key())
        cur.last()
        last = _unkey(cur.key())
        if first != offset + 1:
            raise self._corrupt(
                min(first, offset + 1),
                f"the log starts at index {first} but the compaction marker says {offset + 1}",
            )
        if not terms or idxs[0] != (offset if compacted else 1) or idxs[-1] > last:
            raise self._corrupt(first, "the epoch map does not cover the log")
        if compacted and (terms[0] != offset_term or poss[0] != offset_pos):
            raise self._corrupt(offset, "the epoch map does not match the compaction marker")

        start = first if tail is None else max(first, last - tail + 1)
        if start == first:
            prev_term, prev_end = offset_term, offset_pos
        else:
            before = self._decode_at(cur, start - 1, txn)
            prev_term, prev_end = before.term, before.end_pos
        seen_terms: list[int] = [offset_term] if compacted else []
        expect = start
        if not cur.set_key(_KEY.pack(start)):
            raise self._corrupt(start, "the record is missing")
        for key, value in cur.iternext():
            index = _unkey(key)
            if index != expect:
                raise self._corrupt(expect, "the record is missing (the log has a gap)")
            e = self._decode(value, index, txn)
            if e.term < prev_term:
                raise self._corrupt(index, f"term {e.term} goes back from {prev_term}")
            if e.pos != prev_end:
                raise self._corrupt(
                    index, f"position {e.pos} does not continue the previous end {prev_end}"
                )
            k = bisect.bisect_right(idxs, index) - 1
            if k < 0 or terms[k] != e.term or (idxs[k] == index and poss[k] != e.pos):
                raise self._corrupt(index, "the entry disagrees with the epoch map")
            if not seen_terms or seen_terms[-1] != e.term:
                seen_terms.append(e.term)
            prev_term, prev_end = e.term, e.end_pos
            expect += 1
        if expect != last + 1:
            raise self._corrupt(expect, "the record is missing")
        if tail is None and seen_terms != terms:
            # A full scan can rebuild the epoch map; it must match exactly.
            raise self._corrupt(
                None, f"the epoch map lists terms {terms}, the log has {seen_terms}"
            )
        if terms[-1] != prev_term:
            raise self._corrupt(last, "the epoch map's last term is not the last entry's term")
        return last, prev_term, prev_end

    def verify_all(self) -> int:
        """Scan the whole durable log (not buffered writes: ``sync()`` first)
        with the recovery checks. Returns the number of entries checked;
        raises :class:`StorageCorrupted` on the first bad record. What the
        write-ahead log holds is committed to LMDB first (:meth:`checkpoint`)."""
        self.checkpoint()
        with self._env.begin(buffers=True) as txn:
            compacted, offset, offset_term, offset_pos = self._read_front(txn)
            epochs = self._read_epochs(txn)
            last, _, _ = self._verify_log(
                txn,
                compacted=compacted,
                offset=offset,
                offset_term=offset_term,
                offset_pos=offset_pos,
                epochs=epochs,
                tail=None,
            )
        return last - offset

    # -- decoding helpers --------------------------------------------------
    def _corrupt(self, index: int | None, what: str) -> StorageCorrupted:
        where = f"log index {index}" if index is not None else "metadata"
        return StorageCorrupted(
            f"storage corrupted at {where} in data directory {self.path}: {what}. "
            "Do not restart this replica on this directory; rebuild it from a healthy peer.",
            index,
        )

    def _decode(self, value: bytes | memoryview, index: int, txn: lmdb.Transaction[Any]) -> Entry:
        if bytes(value[:2]) == _STUB_MAGIC:
            value = self._join_parts(value, index, txn)
        try:
            e = decode_entry(value)
        except CodecError as exc:
            raise self._corrupt(index, str(exc)) from None
        if e.index != index:
            raise self._corrupt(index, f"the record stored under this key holds index {e.index}")
        return e

    def _join_parts(
        self, stub: bytes | memoryview, index: int, txn: lmdb.Transaction[Any]
    ) -> bytes:
        """The record of a parted entry (see "Parted records"), checked
        against its stub's length and CRC."""
        if len(stub) != _STUB.size:
            raise self._corrupt(index, "a parted record's stub has the wrong length")
        _, length, n, crc = _STUB.unpack(bytes(stub))
        cur = txn.cursor(db=self._parts_db)
        parts: list[bytes] = []
        if n and cur.set_key(_PKEY.pack(index, 0)):
            for key, value in cur.iternext():
                if bytes(key) != _PKEY.pack(index, len(parts)):
                    break
                parts.append(bytes(value))
                if len(parts) == n:
                    break
        if len(parts) != n:
            raise self._corrupt(index, f"part {len(parts)} of {n} of the record is missing")
        rec = b"".join(parts)
        if len(rec) != length or zlib.crc32(rec) != crc:
            raise self._corrupt(index, "the record's parts do not match its stub (length or CRC)")
        return rec

    def _decode_at(
        self, cur: lmdb.Cursor[memoryview], index: int, txn: lmdb.Transaction[Any]
    ) -> Entry:
        value = cur.get(_KEY.pack(index))
        if value is None:
            raise self._corrupt(index, "the record is missing")
        return self._decode(value, index, txn)

    # -- LogStorage --------------------------------------------------------
    def first_index(self) -> int:
        return self._offset + 1

    def last_index(self) -> int:
        return self._last

    def front_pos(self) -> int:
        """End position of the last compacted entry (0 at the start)."""
        return self._offset_pos

    def term(self, index: int) -> int:
        if index == self._offset:
            return self._offset_term
        if index < self._offset:
            raise Compacted(f"index {index} is compacted (first index {self._offset + 1})")
        if index > self._last:
            raise IndexError(f"index {index} is beyond the last index {self._last}")
        if index == self._last:
            return self._last_term
        # Terms only grow along the log, so the epoch starting at or before
        # index is the one containing it.
        return self._ep_terms[bisect.bisect_right(self._ep_idx, index) - 1]

    def epoch_map(self) -> dict[int, int]:
        """term -> CommitLog position where that term starts (buffered writes
        included). The term of the last compacted entry maps to front_pos()."""
        return dict(zip(self._ep_terms, self._ep_pos, strict=True))

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        if lo <= self._offset:
            raise Compacted(f"index {lo} is compacted (first index {self._offset + 1})")
        hi = min(hi, self._last + 1)
        if lo >= hi:
            return []
        out: list[Entry] = []
        total = 0
        limit, pending = self._view()
        durable_hi = min(hi, limit)
        if lo < durable_hi:
            total = self._read_durable(lo, durable_hi, max_bytes, out)
            if len(out) < durable_hi - lo:
                return out  # the byte budget ran out inside the durable part
        for e in _buffered(limit, pending, lo, hi):
            total += len(e.data)
            if max_bytes is not None and total > max_bytes and out:
                break
            out.append(e)
        return out

    def _view(self) -> tuple[int, list[Entry]]:
        """(limit, buffer), taken together (see ``_view_lock``)."""
        with self._view_lock:
            return self._limit, self._pending

    def conf_entries(self, lo: int, hi: int) -> list[Entry]:
        """The CONF_CHANGE entries in [lo, hi), in order. Only each record's
        header is read, and a parted record (never a membership change) not
        even that; the entries found are decoded and CRC-checked in full. A
        start reads the membership changes after the snapshot this way, not
        the whole retained log (which is the CommitLog: gigabytes)."""
        if lo <= self._offset:
            raise Compacted(f"index {lo} is compacted (first index {self._offset + 1})")
        hi = min(hi, self._last + 1)
        out: list[Entry] = []
        limit, pending = self._view()
        durable_hi = min(hi, limit)
        conf = int(EntryType.CONF_CHANGE)
        if lo < durable_hi:
            try:
                with self._env.begin(db=self._log_db, buffers=True) as txn:
                    for index, value in self._durable_values(txn, lo, durable_hi):
                        # A stub stands for a record longer than _INLINE_MAX:
                        # never a membership change (48 bytes; _apply_batch
                        # refuses to part one). Otherwise the entry type is
                        # the header's fourth byte; a record too short to say
                        # is decoded (and reported) in full.
                        if value[:2] == _STUB_MAGIC:
                            continue
                        if len(value) < 4 or value[3] == conf:
                            e = self._decode(value, index, txn)
                            if e.type is EntryType.CONF_CHANGE:
                                out.append(e)
            except _LMDB_DAMAGE as exc:
                raise self._corrupt(lo, f"LMDB reported damage while reading: {exc}") from exc
        for e in _buffered(limit, pending, lo, hi):
            if e.type is EntryType.CONF_CHANGE:
                out.append(e)
        return out

    def _read_durable(self, lo: int, hi: int, max_bytes: int | None, out: list[Entry]) -> int:
        """Append durable entries lo..hi-1 to out, stopping early once
        max_bytes is exceeded (after at least one). Returns the bytes taken."""
        total = 0
        try:
            with self._env.begin(db=self._log_db, buffers=True) as txn:
                for index, value in self._durable_values(txn, lo, hi):
                    e = self._decode(value, index, txn)
                    total += len(e.data)
                    if max_bytes is not None and total > max_bytes and out:
                        return total - len(e.data)
                    out.append(e)
                return total
        except _LMDB_DAMAGE as exc:
            raise self._corrupt(lo, f"LMDB reported damage while reading: {exc}") from exc

    def _durable_values(
        self, txn: lmdb.Transaction[Any], lo: int, hi: int
    ) -> Iterator[tuple[int, memoryview]]:
        """The stored values of durable records lo..hi-1 in order, raising
        StorageCorrupted for a missing one (a gap, or an end before hi)."""
        cur = txn.cursor(db=self._log_db)
        if not cur.set_key(_KEY.pack(lo)):
            raise self._corrupt(lo, "the record is missing")
        expect = lo
        for key, value in cur.iternext():
            index = _unkey(key)
            if index != expect:
                raise self._corrupt(expect, "the record is missing (the log has a gap)")
            yield index, value
            expect += 1
            if expect == hi:
                return
        raise self._corrupt(expect, "the record is missing")

    def _entry(self, index: int) -> Entry:
        """Entry ``index`` (offset < index <= last) from the logical view."""
        limit, pending = self._view()
        if index >= limit:
            return pending[index - limit]
        out: list[Entry] = []
        self._read_durable(index, index + 1, None, out)
        return out[0]

    def _tail_of(self, index: int) -> tuple[int, int]:
        """(term, end position) of entry ``index`` (offset <= index <= last)."""
        if index == self._offset:
            return self._offset_term, self._offset_pos
        if index == self._last:
            return self._last_term, self._last_end
        e = self._entry(index)
        return e.term, e.end_pos

    def append(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        first = entries[0].index
        if first <= self._offset:
            raise Compacted(f"append at {first} below the first index {self._offset + 1}")
        if first > self._last + 1:
            raise ValueError(f"append at {first} leaves a gap after {self._last}")
        # Validate the whole batch before touching anything, so a refused
        # batch leaves the view unchanged.
        prev_term, prev_end = self._tail_of(first - 1)
        for k, e in enumerate(entries):
            if e.index != first + k:
                raise ValueError(f"entry {e.index} does not follow {first + k - 1} in the batch")
            if e.term < prev_term:
                raise ValueError(f"entry {e.index} has term {e.term} < previous term {prev_term}")
            if e.pos != prev_end:
                raise ValueError(
                    f"entry {e.index} starts at position {e.pos}, the log ends at {prev_end}"
                )
            prev_term, prev_end = e.term, e.end_pos

        if first <= self._last:
            self._cut(first)
        if self._wal_from is None or first < self._wal_from:
            self._wal_from = first
        for e in entries:
            if not self._ep_terms or self._ep_terms[-1] != e.term:
                self._ep_terms.append(e.term)
                self._ep_idx.append(e.index)
                self._ep_pos.append(e.pos)
                self._dirty_terms.add(e.term)
        self._pending.extend(entries)
        last = entries[-1]
        self._last, self._last_term, self._last_end = last.index, last.term, last.end_pos

    def truncate_from(self, index: int) -> None:
        if index <= self._offset:
            raise Compacted(f"truncate at {index} below the first index {self._offset + 1}")
        if index <= self._last:
            self._cut(index)

    def _cut(self, index: int) -> None:
        """Drop entries >= index (offset < index <= last) from the view."""
        term, end = self._tail_of(index - 1)
        if self._wal_from is None or index < self._wal_from:
            self._wal_from = index
        if index >= self._limit:
            del self._pending[index - self._limit :]
        else:
            # Durable records from index on are dead; sync() deletes them.
            self._pending.clear()
            self._limit = index
        while self._ep_idx and self._ep_idx[-1] >= index:
            self._dirty_terms.add(self._ep_terms.pop())
            self._ep_idx.pop()
            self._ep_pos.pop()
        self._last, self._last_term, self._last_end = index - 1, term, end

    def compact(self, upto: int, term: int, pos: int) -> None:
        if upto <= self._offset + 1:
            return
        new_offset = min(upto - 1, self._last)
        if upto - 1 <= self._last:
            have_term, have_end = self._tail_of(upto - 1)
            if (have_term, have_end) != (term, pos):
                raise ValueError(
                    f"compact({upto}): entry {upto - 1} has term {have_term} and ends at "
                    f"{have_end}, not term {term} / position {pos}"
                )
        # Drop every epoch up to the one containing new_offset, then put a
        # marker epoch for the compacted entry, starting at the new front.
        k = bisect.bisect_right(self._ep_idx, new_offset)
        for t in self._ep_terms[:k]:
            self._dirty_terms.add(t)
        self._ep_terms[:k] = [term]
        self._ep_idx[:k] = [new_offset]
        self._ep_pos[:k] = [pos]
        self._dirty_terms.add(term)

        self._compacted = True
        self._offset, self._offset_term, self._offset_pos = new_offset, term, pos
        self._front_dirty = True
        if new_offset >= self._limit:
            del self._pending[: new_offset - self._limit + 1]
            self._limit = new_offset + 1
        if self._last == new_offset:
            # Empty log: the front now describes the last entry (this only
            # differs from before when upto - 1 was beyond the last index).
            self._last_term, self._last_end = term, pos

    # -- SnapshotStore -----------------------------------------------------
    def snapshot(self) -> Snapshot | None:
        """The latest saved snapshot (a buffered one included), read back
        from its file and CRC-checked."""
        if self._snap_pending is not None:
            return self._snap_pending
        if self._snap_header is None or self._snap_file is None:
            return None
        path = os.path.join(self.path, self._snap_file)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise StorageCorrupted(
                f"snapshot file {path} is missing (the meta db records it); "
                "rebuild this replica from a healthy peer"
            ) from None
        try:
            snap, header = decode_snapshot_file(raw)
        except ValueError as exc:
            raise StorageCorrupted(
                f"snapshot file {path} is damaged: {exc}; rebuild this replica from a healthy peer"
            ) from None
        if header != self._snap_header:
            raise StorageCorrupted(
                f"snapshot file {path} does not match the snapshot recorded in the meta db"
            )
        return snap

    def snapshot_meta(self) -> SnapshotMeta | None:
        """Meta of the latest saved snapshot without reading its payload."""
        if self._snap_pending is not None:
            return self._snap_pending.meta
        if self._snap_header is None:
            return None
        return self._parse_header(self._snap_header)

    def save_snapshot(self, snap: Snapshot) -> None:
        """Buffer a snapshot taken locally; ``sync()`` makes it durable."""
        self._snap_pending = snap
        self._snap_pending_file = None

    def write_snapshot_file(self, snap: Snapshot) -> str:
        """Write and fsync ``snap``'s file, and nothing else: no LMDB, so a
        worker thread may run it while the loop appends and syncs. The
        snapshot is not in force until :meth:`record_snapshot` and a sync."""
        name = _snapshot_name(snap.meta)
        with self._snap_lock:
            self._snap_writing.add(name)
        try:
            return self._write_snapshot_file(snap)
        except BaseException:
            with self._snap_lock:
                self._snap_writing.discard(name)
            raise

    def record_snapshot(self, snap: Snapshot, name: str) -> bool:
        """Buffer the record of a snapshot whose file ``write_snapshot_file``
        made durable; the next ``sync()`` puts it in force. Returns False (and
        removes the file) when a snapshot at or beyond it is already held, for
        example one installed from the leader meanwhile."""
        with self._snap_lock:
            self._snap_writing.discard(name)
        held = self.snapshot_meta()
        if held is not None and held.index >= snap.meta.index:
            if name not in (self._snap_file, self._snap_pending_file):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.path, name))
            return False
        self._snap_pending = snap
        self._snap_pending_file = name
        return True

    def apply_snapshot(self, snap: Snapshot) -> None:
        """Buffer a snapshot from the leader and reset the log to it."""
        meta = snap.meta
        self._snap_pending = snap
        self._snap_pending_file = None
        for t in self._ep_terms:
            self._dirty_terms.add(t)
        self._ep_terms, self._ep_idx, self._ep_pos = [meta.term], [meta.index], [meta.end_pos]
        self._dirty_terms.add(meta.term)
        self._pending.clear()
        self._compacted = True
        self._offset, self._offset_term, self._offset_pos = meta.index, meta.term, meta.end_pos
        self._front_dirty = True
        # Every durable record goes: those <= index with the front, any
        # above it as a truncated back (limit <= durable_last).
        self._limit = meta.index + 1
        self._last, self._last_term, self._last_end = meta.index, meta.term, meta.end_pos

    def _write_snapshot_file(self, snap: Snapshot) -> str:
        """Write ``snap`` to its file atomically; returns the file name."""
        if self._failed is not None:
            raise self._failed
        name = _snapshot_name(snap.meta)
        final = os.path.join(self.path, name)
        tmp = final + ".tmp"
        header = snapshot_header(snap.meta, len(snap.data))
        try:
            with open(tmp, "wb") as f:
                # The same bytes as encode_snapshot_file, without concatenating a
                # copy of the payload (a long GIL hold for a big snapshot).
                f.write(header)
                f.write(snap.data)
                f.write(_CRC.pack(zlib.crc32(snap.data, zlib.crc32(header))))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.path)
        except OSError as exc:
            raise self._disk_failed(f"write snapshot file {name}", exc) from exc
        return name

    # -- StableStore -------------------------------------------------------
    def hard_state(self) -> HardState:
        return self._hs

    def save_hard_state(self, hs: HardState) -> None:
        if hs != self._hs:
            if (hs.term, hs.vote) != (self._hs.term, self._hs.vote):
                self._vote_dirty = True
            self._hs = hs
            self._hs_dirty = True

    # -- durability --------------------------------------------------------
    def _has_batch(self) -> bool:
        return bool(
            self._pending
            or self._limit <= self._durable_last
            or self._front_dirty
            or self._hs_dirty
            or self._dirty_terms
            or self._snap_pending is not None
            or bool(self._side_pending)
        )

    def sync(self, *, catch_up: bool = True) -> None:
        """Make the buffered batch durable: one write-ahead log record (sync
        mode, see "Write-ahead log") or one LMDB transaction (in async mode
        committed to the page cache only, see the module doc).

        With ``catch_up=False`` a batch that goes to the log never takes
        LMDB's catch-up with it, even when one is due: the caller answers
        for the batch first and then runs :meth:`checkpoint` when
        :meth:`catch_up_due` says so (a follower does, so that its
        acknowledgement does not wait for a commit of a mebibyte)."""
        if self._closed:
            raise ValueError(f"storage in {self.path} is closed")
        if self._failed is not None:
            raise self._failed
        if not self._has_batch():
            return
        if self._loggable():
            if self._wal_from is not None or self._hs != self._wal_hs:
                self._log_batch()
            if not catch_up or not self._wal_due():
                return
        self._commit()

    def catch_up_due(self) -> bool:
        """Whether LMDB should now take what only the write-ahead log holds
        (:meth:`checkpoint`), nothing being buffered that a ``sync()`` has
        not taken yet."""
        return self._failed is None and self._wal_due() and not self._unsynced()

    def catches_up(self) -> bool:
        """Whether group commits go to the write-ahead log (sync mode), so
        that LMDB catches up with them (:meth:`checkpoint`, an LMDB commit)
        within ``WAL_COMMIT_INTERVAL_S`` of any activity. The node lets the
        owner's side rows (its state's checkpoint) wait for that commit
        rather than turn a group commit into an LMDB commit."""
        return self._failed is None and self._wal is not None and self._wal_on

    def _loggable(self) -> bool:
        """Whether the batch may go to the write-ahead log: appends, cuts at
        the back and the hard state, not too large; a snapshot, a compaction
        or the owner's side rows go to LMDB at once."""
        if self._wal is None or not self._wal_on:
            return False
        if self._snap_pending is not None or self._front_dirty or self._side_pending:
            return False
        lo = self._wal_from
        if lo is not None and lo < self._limit:
            return False  # never: every change since the last record is buffered
        return self._unlogged_within(WAL_RECORD_MAX)

    def _unlogged_within(self, max_bytes: int) -> bool:
        """Whether the entries changed since the last record hold at most
        ``max_bytes`` of data."""
        lo = self._wal_from
        if lo is None:
            return True
        size = 0
        for e in self._pending[lo - self._limit :]:
            size += len(e.data)
            if size > max_bytes:
                return False
        return True

    def _wal_due(self) -> bool:
        """Whether LMDB should now cover what the write-ahead log holds.
        Both bounds are scaled by this cycle's ``_catch_up_share`` (drawn
        after every catch-up): replicas fed the same entries would otherwise
        catch up at the same entry, so a leader's two followers stalled
        together and its commits waited for both."""
        since = self._wal_behind_s
        if since is None:
            return False
        w = self._wal
        assert w is not None
        f = self._catch_up_share
        return w.size >= WAL_MAX_BYTES * f or time.monotonic() - since >= WAL_COMMIT_INTERVAL_S * f

    def _log_batch(self) -> None:
        """Append the changes since the last record to the write-ahead log
        and make them durable."""
        w = self._wal
        assert w is not None
        lo = self._wal_from
        ents = self._pending[lo - self._limit :] if lo is not None else []
        seq = self._wal_seq + 1
        record = _wal.encode_record(seq, self._hs, lo or 0, ents, self._wal_key)
        t0 = time.perf_counter()
        try:
            w.append(record)
        except OSError as exc:
            raise self._disk_failed("append to the write-ahead log", exc) from exc
        self.fsync_seconds.observe(time.perf_counter() - t0)
        self._wal_seq = seq
        self._wal_from = None
        self._wal_hs = self._hs
        self._vote_dirty = False  # fsynced with the record
        if self._wal_behind_s is None:
            self._wal_behind_s = time.monotonic()
        self.write_txns += 1

    def _commit(self) -> None:
        """Write the whole batch (everything LMDB does not hold yet) in one
        LMDB transaction; then the write-ahead log is covered and emptied."""
        snap = self._snap_pending
        header: bytes | None = None
        name: str | None = None
        if snap is not None:
            # The file first: the meta db must never name a file that is not
            # durable. Until the commit below, the old snapshot stays in force.
            name = self._snap_pending_file or self._write_snapshot_file(snap)
            header = snapshot_header(snap.meta, len(snap.data))
        self._batch_snap_header = header
        # The side batch is taken whole now: a stage() meanwhile (the owner's
        # thread) goes to the next commit, never half into this one.
        self._batch_side, side_staged = self._side_pending, self._side_staged
        self._side_pending = {}
        t0 = time.perf_counter()
        self._write(self._apply_batch)
        if self.flush_mode == "sync":
            self.fsync_seconds.observe(time.perf_counter() - t0)
        # Only now, after a successful commit, is the batch forgotten: a new
        # buffer (a read may still hold the old one, with the old limit: a
        # consistent view, every entry of it durable now) and the limit
        # together (see _view_lock).
        with self._view_lock:
            self._pending = []
            self._limit = self._last + 1
            self._durable_last = self._last
        self._batch_side = {}
        self.side_synced = side_staged
        self._hs_dirty = self._front_dirty = False
        self._dirty_terms.clear()
        self.write_txns += 1
        self.lmdb_commits += 1
        self._unflushed = self.flush_mode == "async"
        self._wal_from = None
        self._wal_hs = self._hs
        self._wal_behind_s = None
        self._catch_up_share = _catch_up_share()
        if self._wal is not None:
            try:
                self._wal.reset()
            except OSError as exc:
                raise self._disk_failed("empty the write-ahead log", exc) from exc
        if self._vote_dirty:
            # A term or vote is never left to the flush interval, even in
            # async mode: a vote forgotten in a power loss can be granted
            # again in the same term, two leaders of one term write different
            # entries under the same (index, term), and no later check can
            # tell the replicas apart. Elections are rare; this costs nothing.
            self._vote_dirty = False
            self.flush()
        if header is not None:
            if self._unflushed:
                # Old files go next: the record naming the new one must be
                # on disk before that, even in async mode.
                self.flush()
            self._snap_header, self._snap_file = header, name
            self._snap_pending = None
            self._snap_pending_file = None
            self._batch_snap_header = None
            self._remove_stale_snapshot_files()

    def checkpoint(self) -> bool:
        """Commit to LMDB now what only the write-ahead log holds, with the
        owner's side rows staged meanwhile (they wait for the next LMDB
        commit; this is one). Not done (returns False) while changes to the
        log wait for a ``sync()``: LMDB can only take the whole batch, and
        those must stay as undurable as a crash would leave them."""
        if self._failed is not None:
            raise self._failed
        if self._wal_behind_s is None or not self._has_batch():
            return True
        if self._unsynced(side=False):
            return False
        self._commit()
        return True

    def _unsynced(self, *, side: bool = True) -> bool:
        """Whether anything changed since the last sync(): new entries or a
        cut, the hard state, a compaction, a snapshot or (``side``) side
        rows (the last three go to LMDB at once when synced, so their being
        buffered means no sync() took them yet)."""
        return (
            self._wal_from is not None
            or self._hs != self._wal_hs
            or self._front_dirty
            or self._snap_pending is not None
            or (side and bool(self._side_pending))
        )

    def small_batch(self, max_bytes: int) -> bool:
        """Whether the buffered batch is a small append: new entries and side
        rows of at most ``max_bytes`` together, and nothing deleted at either
        end of the log or a snapshot to record. Such a commit touches a few
        pages, so its caller may run :meth:`sync` without a thread hop. With
        the write-ahead log, what counts is what ``sync(catch_up=False)``
        (the node's) writes: the entries since the last record."""
        if self._loggable():
            return self._unlogged_within(max_bytes)
        if self._snap_pending is not None or self._front_dirty:
            return False
        if self._limit <= self._durable_last:
            return False  # a truncation at the back
        size = 0
        for e in self._pending:
            size += len(e.data)
            if size > max_bytes:
                return False
        for rows in self._side_pending.values():
            for v in rows.values():
                size += 32 if v is None else 32 + len(v)  # 32: a key, roughly
                if size > max_bytes:
                    return False
        return True

    def _write(self, apply: _TxnFn) -> None:
        """Run ``apply`` in one write transaction, growing the map and
        replaying on MapFullError. ``apply`` must not change any state
        outside the transaction so a replay is exact."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    apply(txn)
                return
            except lmdb.MapFullError:
                # The transaction was aborted; no reader or writer is open in
                # this process here, as set_mapsize requires.
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
                self.map_growths += 1
            except _WRITE_DAMAGE as exc:
                # A damaged page met while writing (LMDB then marks the txn
                # bad; py-lmdb may surface that as a SystemError wrapping the
                # lmdb error) is damage like a bad CRC: the operator must
                # rebuild this replica (exit code 2), not restart it blindly.
                raise StorageCorrupted(
                    f"LMDB failed a write transaction in {self.path}: "
                    f"{type(exc).__name__}: {exc}; the data file is damaged. "
                    "Do not restart this replica on this directory; rebuild it from a healthy peer."
                ) from exc
            except (lmdb.Error, OSError) as exc:
                # The disk refused the commit's writes or its fsync.
                raise self._disk_failed("commit a write transaction", exc) from exc

    def _disk_failed(self, what: str, exc: BaseException) -> StorageFailed:
        """Poison this instance (see "Disk errors" in the module doc)."""
        if self._failed is None:
            self._failed = StorageFailed(
                f"the disk under {self.path} failed to {what}: {type(exc).__name__}: {exc}. "
                "This node cannot make its log durable: it stops without acknowledging "
                "the failed writes, and will not retry the fsync (the kernel may have "
                "dropped the data). Fix the disk, then restart the node; it recovers from "
                "what it had made durable."
            )
        return self._failed

    def _apply_batch(self, txn: lmdb.Transaction[bytes]) -> None:
        cur = txn.cursor(db=self._log_db)
        pcur = txn.cursor(db=self._parts_db)
        # 1. The back: durable records at or after limit were truncated.
        if self._limit <= self._durable_last:
            _delete_from(cur, self._limit, None)
            _delete_parts(pcur, self._limit, None)
        # 2. The front: records at or before the compaction offset.
        if self._front_dirty:
            _delete_from(cur, 0, self._offset)
            _delete_parts(pcur, 0, self._offset)
            txn.put(
                _META_FRONT,
                _seal(
                    _META_FRONT,
                    _TRIPLE.pack(self._offset, self._offset_term, self._offset_pos),
                ),
                db=self._meta_db,
            )
        # 3. New entries, all above every remaining key: MDB_APPEND skips the
        # B-tree search and fills pages densely.
        if self._pending:
            records: list[tuple[bytes, bytes]] = []
            parts: list[tuple[bytes, bytes]] = []
            for e in self._pending:
                rec = encode_entry(e)
                if len(rec) <= _INLINE_MAX:
                    records.append((_KEY.pack(e.index), rec))
                    continue
                if e.type is EntryType.CONF_CHANGE:
                    # conf_entries() finds membership changes without reading
                    # parts: one is never parted (it is 48 bytes)
                    raise InvariantViolation(
                        f"entry {e.index}: a membership change of {len(rec)} bytes"
                    )
                n = -(-len(rec) // _PART_MAX)
                size = -(-len(rec) // n)
                pieces = [rec[k : k + size] for k in range(0, len(rec), size)]
                stub = _STUB.pack(_STUB_MAGIC, len(rec), len(pieces), zlib.crc32(rec))
                records.append((_KEY.pack(e.index), stub))
                parts += [(_PKEY.pack(e.index, k), p) for k, p in enumerate(pieces)]
            if parts:
                _, put = pcur.putmulti(parts, append=True)
                if put != len(parts):
                    raise InvariantViolation(
                        f"appended {put} of {len(parts)} record parts from index "
                        f"{self._pending[0].index}: parts of later entries were left behind"
                    )
            _, added = cur.putmulti(records, append=True)
            # MDB_APPEND silently skips a key that is not above the last one;
            # that would be a bookkeeping bug here, and losing an entry quietly
            # is the one thing a log must not do.
            if added != len(self._pending):
                raise InvariantViolation(
                    f"appended {added} of {len(self._pending)} entries from index "
                    f"{self._pending[0].index}: the durable log still holds keys above it"
                )
        # 4. Hard state, snapshot record, write-ahead log mark and epochs.
        if self._wal is not None:
            txn.put(_META_WAL, _seal(_META_WAL, _KEY.pack(self._wal_seq)), db=self._meta_db)
        if self._batch_snap_header is not None:
            txn.put(
                _META_SNAPSHOT,
                _seal(_META_SNAPSHOT, self._batch_snap_header),
                db=self._meta_db,
            )
        if self._hs_dirty:
            hs = self._hs
            txn.put(
                _META_HARD_STATE,
                _seal(_META_HARD_STATE, _TRIPLE.pack(hs.term, hs.vote, hs.commit)),
                db=self._meta_db,
            )
        for t in self._dirty_terms:
            key = _KEY.pack(t)
            k = bisect.bisect_left(self._ep_terms, t)
            if k < len(self._ep_terms) and self._ep_terms[k] == t:
                value = _seal(key, _EPOCH.pack(self._ep_pos[k], self._ep_idx[k]))
                txn.put(key, value, db=self._epoch_db)
            else:
                txn.delete(key, db=self._epoch_db)

        # 5. The owner's side databases (see "Side databases").
        for name, changes in self._batch_side.items():
            db = self._side[name]
            puts: list[tuple[bytes, bytes]] = []
            for skey, svalue in changes.items():
                if svalue is None:
                    txn.delete(skey, db=db)
                else:
                    puts.append((skey, svalue))
            if puts:
                puts.sort()
                txn.cursor(db=db).putmulti(puts)

    # -- side databases ----------------------------------------------------
    def side_db(self, name: bytes) -> lmdb._Database:
        """Open (creating it) the owner's database ``name`` in this
        environment; reads go through :meth:`side_read`."""
        if name in _OWN_DBS:
            raise ValueError(f"{name!r} is one of the log's own databases")
        db = self._side.get(name)
        if db is None:
            if len(self._side) >= MAX_SIDE_DBS:
                raise ValueError(f"at most {MAX_SIDE_DBS} side databases")
            db = self._side[name] = self._env.open_db(name)
        return db

    def stage(self, changes: dict[bytes, dict[bytes, bytes | None]]) -> int:
        """Hand over puts (bytes) and deletes (None) per side database, to be
        written by the next :meth:`sync` in the log's transaction. Returns a
        number: the batch is durable once :attr:`side_synced` reaches it.
        A later stage of the same key wins. The dicts become the storage's."""
        if self._failed is not None:
            raise self._failed
        for name, batch in changes.items():
            if name not in self._side:
                raise ValueError(f"side database {name!r} was not opened (side_db)")
            if not batch:
                continue
            have = self._side_pending.get(name)
            if have is None:
                self._side_pending[name] = batch
            else:
                have.update(batch)
        if not any(changes.values()):
            return self._side_staged  # nothing new: as durable as the last
        self._side_staged += 1
        return self._side_staged

    @property
    def env(self) -> lmdb.Environment:
        """The environment, for the owner's read transactions over its side
        databases (they see what the last committed ``sync()`` wrote)."""
        return self._env

    def entry_in(self, txn: lmdb.Transaction[Any], index: int) -> Entry | None:
        """Entry ``index`` as the read transaction ``txn`` (over :attr:`env`)
        sees the durable log, CRC-checked (StorageCorrupted naming it), or
        None when that transaction holds no record for it. Safe from any
        thread: it touches nothing but ``txn``."""
        value = txn.get(_KEY.pack(index), db=self._log_db)
        return None if value is None else self._decode(value, index, txn)

    @property
    def wal_bytes(self) -> int:
        """The write-ahead log's size: what LMDB has not covered yet."""
        return self._wal.size if self._wal is not None else 0

    def buffered_tail(self) -> list[Entry]:
        """A copy of the entries the view holds beyond LMDB's image (those
        only the write-ahead log holds, and any not yet synced), in index
        order. Taken on the owner's thread *before* a read transaction is
        opened, it and that transaction together hold every entry the view
        held: an LMDB commit forgets its entries only after it returned."""
        return list(self._pending)

    def side_clear(self, *names: bytes) -> None:
        """Drop every record of the side databases ``names`` now, in one
        transaction of its own (a rebuild of the owner's state; nothing
        staged for them survives)."""
        if self._failed is not None:
            raise self._failed
        dbs = [self._side[n] for n in names]
        for n in names:
            self._side_pending.pop(n, None)

        def drop(txn: lmdb.Transaction[bytes]) -> None:
            for db in dbs:
                txn.drop(db, delete=False)

        self._write(drop)

    def side_put_now(self, name: bytes, items: list[tuple[bytes, bytes]]) -> None:
        """Write ``items`` into side database ``name`` now, in a transaction
        of its own (bulk loads while the owner rebuilds; not fsynced: the
        owner's next staged batch, committed by ``sync()``, makes them
        durable along with the record that says they are complete)."""
        if self._failed is not None:
            raise self._failed
        if not items:
            return
        db = self._side[name]
        items.sort()

        def put(txn: lmdb.Transaction[bytes]) -> None:
            txn.cursor(db=db).putmulti(items)

        self._write(put)

    def maybe_flush(self, now_s: float) -> bool:
        """Async mode: fsync committed transactions if ``flush_interval_s``
        has passed since the last flush. Returns whether it flushed. A no-op
        in sync mode, where every commit is already durable."""
        if not self._unflushed:
            return False
        if self._last_flush_s is not None and now_s - self._last_flush_s < self.flush_interval_s:
            return False
        self.flush()
        self._last_flush_s = now_s
        return True

    def flush_pending(self) -> bool:
        """Async mode: whether committed transactions wait for an fsync
        (an idle node has nothing to flush and need not wake for it)."""
        return self._unflushed

    def flush(self) -> None:
        """Async mode: fsync every committed transaction now."""
        if self._failed is not None:
            raise self._failed
        if self._unflushed and not self._closed:
            t0 = time.perf_counter()
            try:
                self._env.sync(True)
            except (lmdb.Error, OSError) as exc:
                raise self._disk_failed("fsync committed transactions", exc) from exc
            self.fsync_seconds.observe(time.perf_counter() - t0)
            self._unflushed = False
            self.flushes += 1

    def close(self) -> None:
        """Flush committed transactions (async mode) and close. Buffered
        writes that were never ``sync()``-ed are dropped, as in a crash."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.checkpoint()  # a clean stop leaves LMDB covering the log
                self.flush()
        finally:
            self._closed = True
            self._close_wal()
            self._env.close()

    def __enter__(self) -> LmdbStorage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _delete_parts(cur: lmdb.Cursor[bytes], lo: int, hi: int | None) -> None:
    """Delete the parts of every record with lo <= index (<= hi when given)."""
    if not cur.set_range(_PKEY.pack(lo, 0)):
        return
    while True:
        key = cur.key()
        if not key or (hi is not None and _PKEY.unpack(key)[0] > hi):
            return
        if not cur.delete():
            return


def _delete_from(cur: lmdb.Cursor[bytes], lo: int, hi: int | None) -> None:
    """Delete every log record with lo <= index (<= hi when given)."""
    if not cur.set_range(_KEY.pack(lo)):
        return
    while True:
        key = cur.key()
        if not key or (hi is not None and _unkey(key) > hi):
            return
        # mdb_cursor_del leaves the cursor on the following record.
        if not cur.delete():
            return
