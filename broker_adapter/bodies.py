"""Where the broker keeps stored message records: in memory, or on disk.

Theory of operation
-------------------
:class:`~broker_adapter.state.BrokerState` keeps the ConsumeQueue index
(physical offset, size, tag hash, store time per message) in arrays and asks a
:class:`Bodies` store for the record bytes by physical offset. The store is
part of the state machine's state, fed only by ``apply`` and ``restore``, so
it never changes what any replica answers; it only decides where the bytes
live:

* :class:`MemoryBodies`: a dict (tests, the simulator, benchmarks of the pure
  adapter).
* :class:`LmdbBodies`: an LMDB environment in the node's data directory, so a
  node's memory holds the index (about 24 bytes per message), not the
  messages. Puts and deletes are buffered and committed in one write
  transaction every ``batch`` changes (and whenever a snapshot freezes the
  state), without fsync: the store is never the durable copy. The Raft log
  and the snapshot are; at start the store is emptied and refilled from the
  snapshot and the replayed log, so a store damaged by a crash is never read.

Snapshots still carry every retained record (a follower installing one needs
them). :meth:`Bodies.frozen_reader` gives the snapshot builder a consistent
view as of the freeze (an LMDB read transaction, MVCC), usable from a worker
thread while the loop keeps applying.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import os
import shutil
import struct
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

import lmdb

from broker_adapter.errors import MalformedCommand
from dledger.core.types import Entry
from dledger.errors import Compacted
from dledger.statemachine import from_big_endian

_KEY = struct.Struct(">Q")
_IKEY = struct.Struct(">IQ")  # queue id, queue offset
_IVAL = struct.Struct(">qiIq")  # physical offset, size, tag hash, store time


def _ival_columns(raw: bytes) -> tuple[array[int], array[int], array[int], array[int]]:
    """Packed ``_IVAL`` rows as four ``q`` arrays, with no Python loop per row
    (a snapshot decodes every retained row of every queue; the row loop held
    the GIL for about 100 ms per 26,000 rows, stalling the event loop).

    A row is three big-endian 8-byte words: the physical offset, size and tag
    hash together, the store time; and six 4-byte words, of which the third
    is the size (signed) and the fourth the tag hash (unsigned)."""
    if len(raw) % _IVAL.size:
        raise ValueError(f"{len(raw)} bytes is not a whole number of index rows")
    q = from_big_endian("q", raw)
    w = from_big_endian("I", raw)
    sizes = array("i")
    sizes.frombytes(w[2::6].tobytes())
    return q[0::3], array("q", sizes), array("q", w[3::6]), q[2::3]


_DB = b"records"
_IDX_DB = b"consumequeue"


class BodyMissing(MalformedCommand):
    """The index names a record the store does not hold (a bug, or a store
    damaged outside the process): reported, never served as something else."""


class IndexDamaged(BodyMissing):
    """A ConsumeQueue entry failed its CRC: reported (503), never followed."""


class RecordNotHere(BodyMissing):
    """The index names a record that lives in no log entry this replica
    holds: it installed a snapshot (index only) after the record was
    written, and the record was dropped by retention since (the entry that
    dropped it is still ahead of this replica). Not damage: catching up."""


IndexEntry = tuple[int, int, int, int]  # physical offset, size, tag hash, store time


class Frozen(Protocol):
    """The store as it was when frozen, read once from a worker thread."""

    def records(self, phys: Sequence[int]) -> list[bytes]: ...

    def columns(self, qid: int, lo: int, hi: int) -> tuple[array[int], ...]:
        """Index entries [lo, hi) of queue ``qid`` as four arrays (physical
        offsets, sizes, tag hashes, store times)."""
        ...

    def close(self) -> None: ...


class Bodies(Protocol):
    # True: records stay in the log entries that carry them (put_entry);
    # False: each record is stored here (put).
    log_backed: bool

    def put_entry(self, index: int, pos: int) -> None:
        """Log entry ``index`` at CommitLog position ``pos`` holds records
        (a log-backed store only)."""
        ...

    # records by physical offset
    def put(self, phys: int, rec: bytes) -> None: ...

    def get(self, phys: int) -> bytes: ...

    def delete(self, phys: int) -> None: ...

    # the ConsumeQueue index: queue ``qid``'s entry at queue offset ``off``
    def index_put(self, qid: int, off: int, entry: IndexEntry) -> None: ...

    def index_put_run(self, qid: int, off: int, flat: Sequence[int]) -> None:
        """Queue ``qid``'s entries at offsets ``off``, ``off + 1``, ...: the
        fields of each :data:`IndexEntry` one after the other in ``flat``
        (four per entry), as :meth:`index_put` of each would store them."""
        ...

    def index_get(self, qid: int, off: int) -> IndexEntry: ...

    def index_delete(self, qid: int, lo: int, hi: int) -> None: ...

    # bulk reads of one consume page (raise BodyMissing as get/index_get do)
    def get_many(self, phys: Sequence[int], sizes: Sequence[int] | None = None) -> list[bytes]:
        """Records by physical offset; ``sizes``: their sizes per the index
        (a store may use them to read adjacent records together)."""
        ...

    def index_many(self, qid: int, lo: int, hi: int) -> list[IndexEntry]: ...

    def replace_all(
        self,
        records: Iterable[tuple[int, bytes]],
        index: Iterable[tuple[int, int, tuple[array[int], ...]]],
    ) -> None:
        """Drop everything and store ``records`` and ``index`` entries
        (``(qid, first offset, four columns)``): a restore."""
        ...

    def freeze(self) -> Frozen:
        """The store as it is now, readable later from another thread."""
        ...

    def reading(self) -> AbstractContextManager[None]:
        """Reads inside share one read transaction (a consume page)."""
        ...

    def close(self) -> None: ...


class _MemFrozen:
    def __init__(self, recs: dict[int, bytes], idx: dict[tuple[int, int], IndexEntry]) -> None:
        self._recs, self._idx = recs, idx

    def records(self, phys: Sequence[int]) -> list[bytes]:
        return [self._recs[p] for p in phys]

    def columns(self, qid: int, lo: int, hi: int) -> tuple[array[int], ...]:
        cols = (array("q"), array("q"), array("q"), array("q"))
        for off in range(lo, hi):
            for c, v in zip(cols, self._idx[(qid, off)], strict=True):
                c.append(v)
        return cols

    def close(self) -> None:
        pass


def _put_each(b: Bodies, qid: int, off: int, flat: Sequence[int]) -> None:
    """index_put_run as index_put of each entry (stores without a faster way)."""
    for k in range(len(flat) // 4):
        f = flat[4 * k : 4 * k + 4]
        b.index_put(qid, off + k, (f[0], f[1], f[2], f[3]))


class MemoryBodies:
    """Dicts (tests, the simulator, the pure adapter's benchmarks)."""

    log_backed = False

    def put_entry(self, index: int, pos: int) -> None:
        raise TypeError("records are stored here: put, not put_entry")

    def __init__(self) -> None:
        self._d: dict[int, bytes] = {}
        self._idx: dict[tuple[int, int], IndexEntry] = {}

    def put(self, phys: int, rec: bytes) -> None:
        self._d[phys] = rec

    def get(self, phys: int) -> bytes:
        try:
            return self._d[phys]
        except KeyError:
            raise BodyMissing(f"no stored record at physical offset {phys}") from None

    def delete(self, phys: int) -> None:
        self._d.pop(phys, None)

    def index_put(self, qid: int, off: int, entry: IndexEntry) -> None:
        self._idx[(qid, off)] = entry

    def index_put_run(self, qid: int, off: int, flat: Sequence[int]) -> None:
        _put_each(self, qid, off, flat)

    def index_get(self, qid: int, off: int) -> IndexEntry:
        try:
            return self._idx[(qid, off)]
        except KeyError:
            raise BodyMissing(f"no index entry for queue {qid} offset {off}") from None

    def index_delete(self, qid: int, lo: int, hi: int) -> None:
        for off in range(lo, hi):
            self._idx.pop((qid, off), None)

    def get_many(self, phys: Sequence[int], sizes: Sequence[int] | None = None) -> list[bytes]:
        try:
            return [self._d[p] for p in phys]
        except KeyError as exc:
            raise BodyMissing(f"no stored record at physical offset {exc.args[0]}") from None

    def index_many(self, qid: int, lo: int, hi: int) -> list[IndexEntry]:
        try:
            return [self._idx[(qid, off)] for off in range(lo, hi)]
        except KeyError as exc:
            raise BodyMissing(f"no index entry for queue {qid} offset {exc.args[0][1]}") from None

    def replace_all(
        self,
        records: Iterable[tuple[int, bytes]],
        index: Iterable[tuple[int, int, tuple[array[int], ...]]],
    ) -> None:
        self._d = dict(records)
        self._idx = {}
        for qid, lo, cols in index:
            for k, e in enumerate(zip(*cols, strict=True)):
                self._idx[(qid, lo + k)] = (e[0], e[1], e[2], e[3])

    def freeze(self) -> Frozen:
        return _MemFrozen(dict(self._d), dict(self._idx))

    def reading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        self._d.clear()
        self._idx.clear()

    def __len__(self) -> int:
        return len(self._d)


class _LmdbFrozen:
    def __init__(self, txn: lmdb.Transaction, recs: lmdb._Database, idx: lmdb._Database) -> None:
        self._txn, self._recs, self._idx = txn, recs, idx

    def records(self, phys: Sequence[int]) -> list[bytes]:
        out: list[bytes] = []
        get, pack = self._txn.get, _KEY.pack
        for p in phys:
            rec = get(pack(p), db=self._recs)
            if rec is None:
                raise BodyMissing(f"no stored record at physical offset {p}")
            out.append(bytes(rec))
        return out

    def columns(self, qid: int, lo: int, hi: int) -> tuple[array[int], ...]:
        cols = (array("q"), array("q"), array("q"), array("q"))
        if lo >= hi:
            return cols
        cur = self._txn.cursor(db=self._idx)
        off = lo
        if cur.set_key(_IKEY.pack(qid, lo)):
            for key, value in cur:
                if off >= hi:
                    break
                if key != _IKEY.pack(qid, off):
                    break
                for c, v in zip(cols, _IVAL.unpack(value), strict=True):
                    c.append(v)
                off += 1
        if off != hi:
            raise BodyMissing(f"index of queue {qid} lacks offset {off} (wanted {lo}..{hi})")
        return cols

    def close(self) -> None:
        self._txn.abort()


class LmdbBodies:
    """See the module docstring. ``path`` is emptied when first used."""

    log_backed = False

    def put_entry(self, index: int, pos: int) -> None:
        raise TypeError("records are stored here: put, not put_entry")

    # The map is address space, not memory or disk (the file grows as pages
    # are written), so it starts huge: growing it needs no transaction open in
    # the process, and a snapshot's frozen read transaction may be open for
    # seconds in a worker thread.
    def __init__(self, path: str, *, batch: int = 4096, map_size: int = 1 << 40) -> None:
        self.path = path
        self._batch = batch
        self._map_size = map_size
        self._env_: lmdb.Environment | None = None
        self._dbs: tuple[lmdb._Database, lmdb._Database] | None = None
        # Buffered changes, committed together: key -> value, None = delete.
        self._pending: dict[bytes, bytes | None] = {}
        self._pending_idx: dict[bytes, bytes | None] = {}
        self.commits = 0
        self.map_growths = 0
        self._rtxn: lmdb.Transaction | None = None

    def _open(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database]:
        """Opened (and emptied) on first use, not at construction: a node
        builds its state machine before it holds the lock on its data
        directory, and must not touch the directory before that."""
        if self._env_ is None or self._dbs is None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.makedirs(self.path)
            self._env_ = lmdb.open(
                self.path,
                map_size=self._map_size,
                max_dbs=2,
                sync=False,
                metasync=False,
                readahead=False,
                subdir=True,
            )
            self._dbs = (self._env_.open_db(_DB), self._env_.open_db(_IDX_DB))
        return self._env_, self._dbs[0], self._dbs[1]

    def _changed(self) -> None:
        if len(self._pending) + len(self._pending_idx) >= self._batch:
            self.commit()

    # -- writes ---------------------------------------------------------------
    def put(self, phys: int, rec: bytes) -> None:
        self._pending[_KEY.pack(phys)] = rec
        self._changed()

    def delete(self, phys: int) -> None:
        self._pending[_KEY.pack(phys)] = None
        self._changed()

    def index_put(self, qid: int, off: int, entry: IndexEntry) -> None:
        self._pending_idx[_IKEY.pack(qid, off)] = _IVAL.pack(*entry)
        self._changed()

    def index_put_run(self, qid: int, off: int, flat: Sequence[int]) -> None:
        _put_each(self, qid, off, flat)

    def index_delete(self, qid: int, lo: int, hi: int) -> None:
        for off in range(lo, hi):
            self._pending_idx[_IKEY.pack(qid, off)] = None
            self._changed()

    def commit(self) -> None:
        if not self._pending and not self._pending_idx:
            return
        env, recs, idx = self._open()
        batches = []
        for db, pending in ((recs, self._pending), (idx, self._pending_idx)):
            puts = sorted((k, v) for k, v in pending.items() if v is not None)
            dels = [k for k, v in pending.items() if v is None]
            batches.append((db, puts, dels))
        while True:
            try:
                with env.begin(write=True) as txn:
                    for db, puts, dels in batches:
                        for key in dels:
                            txn.delete(key, db=db)
                        if puts:
                            txn.cursor(db=db).putmulti(puts)
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
                self.map_growths += 1
        self._pending.clear()
        self._pending_idx.clear()
        self.commits += 1

    def replace_all(
        self,
        records: Iterable[tuple[int, bytes]],
        index: Iterable[tuple[int, int, tuple[array[int], ...]]],
    ) -> None:
        self._pending.clear()
        self._pending_idx.clear()
        env, recs, idx = self._open()
        with env.begin(write=True) as txn:
            txn.drop(recs, delete=False)
            txn.drop(idx, delete=False)
        batch: list[tuple[bytes, bytes]] = []
        for phys, rec in records:
            batch.append((_KEY.pack(phys), rec))
            if len(batch) >= 65536:
                self._put_many(recs, batch)
                batch = []
        self._put_many(recs, batch)
        batch = []
        for qid, lo, cols in index:
            for k, e in enumerate(zip(*cols, strict=True)):
                batch.append((_IKEY.pack(qid, lo + k), _IVAL.pack(*e)))
                if len(batch) >= 65536:
                    self._put_many(idx, batch)
                    batch = []
        self._put_many(idx, batch)

    def _put_many(self, db: lmdb._Database, batch: list[tuple[bytes, bytes]]) -> None:
        if not batch:
            return
        batch.sort()
        env, _, _ = self._open()
        while True:
            try:
                with env.begin(write=True, db=db) as txn:
                    txn.cursor(db=db).putmulti(batch)
                return
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
                self.map_growths += 1

    # -- reads ----------------------------------------------------------------
    def _read(self, key: bytes, pending: dict[bytes, bytes | None], which: int) -> bytes | None:
        if key in pending:
            return pending[key]
        env, recs, idx = self._open()
        db = recs if which == 0 else idx
        if self._rtxn is not None:
            value = self._rtxn.get(key, db=db)
        else:
            with env.begin() as txn:
                value = txn.get(key, db=db)
        return None if value is None else bytes(value)

    def _read_many(
        self, keys: list[bytes], pending: dict[bytes, bytes | None], which: int
    ) -> list[bytes | None]:
        """:meth:`_read` of every key, in one LMDB call for those not pending."""
        env, recs, idx = self._open()
        db = recs if which == 0 else idx
        ask = [k for k in keys if k not in pending] if pending else keys
        txn = self._rtxn if self._rtxn is not None else env.begin()
        try:
            got = txn.cursor(db=db).getmulti(ask)
        finally:
            if txn is not self._rtxn:
                txn.abort()
        # values are bytes: the cursor was not asked for buffers
        if not pending and len(got) == len(keys):  # all there, in order
            return [v for _, v in got]  # type: ignore[misc]
        found: dict[bytes, bytes] = dict(got)  # type: ignore[arg-type]
        return [pending[k] if k in pending else found.get(k) for k in keys]

    def _scan(self, which: int, first: bytes, last: bytes, n: int) -> list[bytes] | None:
        """The ``n`` values from key ``first`` to key ``last`` in one cursor
        pass, or None when the store does not hold exactly that many there."""
        env, recs, idx = self._open()
        txn = self._rtxn if self._rtxn is not None else env.begin()
        try:
            cur = txn.cursor(db=recs if which == 0 else idx)
            if not cur.set_key(first):
                return None
            # bytes, not buffers: the transaction was not opened with buffers=True
            it = cast(Iterator[bytes], cur.iternext(keys=False, values=True))
            vals = list(itertools.islice(it, n))
            return vals if len(vals) == n and cur.key() == last else None
        finally:
            if txn is not self._rtxn:
                txn.abort()

    def get_many(self, phys: Sequence[int], sizes: Sequence[int] | None = None) -> list[bytes]:
        """With ``sizes`` (the index's), runs of adjacent records (each one
        starting where the last one ends: nothing else can be stored between
        them) are read in one cursor pass each, and every record's length
        must be its size; pending (uncommitted) ones are read one by one."""
        n = len(phys)
        if sizes is not None and n:
            pack, pending = _KEY.pack, self._pending
            if not (pending and pack(phys[-1]) in pending):
                out: list[bytes] = []
                start = 0
                while start < n:
                    end = start + 1
                    while end < n and phys[end] == phys[end - 1] + sizes[end - 1]:
                        end += 1
                    vals = self._scan(0, pack(phys[start]), pack(phys[end - 1]), end - start)
                    if vals is None or list(map(len, vals)) != list(sizes[start:end]):
                        break
                    out += vals
                    start = end
                else:
                    return out
        pack = _KEY.pack
        recs = self._read_many([pack(p) for p in phys], self._pending, 0)
        if None in recs:
            raise BodyMissing(f"no stored record at physical offset {phys[recs.index(None)]}")
        return recs  # type: ignore[return-value]  # no None left

    def index_many(self, qid: int, lo: int, hi: int) -> list[IndexEntry]:
        """Queue offsets are adjacent keys: one cursor pass, unless the last
        one is still pending (appends since the last commit are a suffix)."""
        if hi <= lo:
            return []
        pack = _IKEY.pack
        last = pack(qid, hi - 1)
        if not (self._pending_idx and last in self._pending_idx):
            vals = self._scan(1, pack(qid, lo), last, hi - lo)
            if vals is not None:
                return list(_IVAL.iter_unpack(b"".join(vals)))
        values = self._read_many([pack(qid, off) for off in range(lo, hi)], self._pending_idx, 1)
        if None in values:
            raise BodyMissing(f"no index entry for queue {qid} offset {lo + values.index(None)}")
        return list(_IVAL.iter_unpack(b"".join(values)))  # type: ignore[arg-type]

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        if self._rtxn is not None:  # nested: the outer one serves
            yield
            return
        env, _, _ = self._open()
        self._rtxn = env.begin()
        try:
            yield
        finally:
            self._rtxn.abort()
            self._rtxn = None

    def get(self, phys: int) -> bytes:
        rec = self._read(_KEY.pack(phys), self._pending, 0)
        if rec is None:
            raise BodyMissing(f"no stored record at physical offset {phys}")
        return rec

    def index_get(self, qid: int, off: int) -> IndexEntry:
        value = self._read(_IKEY.pack(qid, off), self._pending_idx, 1)
        if value is None:
            raise BodyMissing(f"no index entry for queue {qid} offset {off}")
        p, size, tag, ts = _IVAL.unpack(value)
        return p, size, tag, ts

    def freeze(self) -> Frozen:
        self.commit()
        env, recs, idx = self._open()
        return _LmdbFrozen(env.begin(), recs, idx)  # MVCC: later commits stay invisible

    def close(self) -> None:
        self._pending.clear()
        self._pending_idx.clear()
        if self._rtxn is not None:
            self._rtxn.abort()
            self._rtxn = None
        if self._env_ is not None:
            self._env_.close()
            self._env_ = self._dbs = None


class SideStorage(Protocol):
    """What :class:`DurableBodies` needs of the node's log storage
    (:class:`dledger.storage.lmdb_store.LmdbStorage`): side databases written
    in the log's own transactions, and the log's entries."""

    side_synced: int

    @property
    def env(self) -> lmdb.Environment: ...

    def side_db(self, name: bytes) -> lmdb._Database: ...

    def stage(self, changes: dict[bytes, dict[bytes, bytes | None]]) -> int: ...

    def side_clear(self, *names: bytes) -> None: ...

    def side_put_now(self, name: bytes, items: list[tuple[bytes, bytes]]) -> None: ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]: ...

    def entry_in(self, txn: lmdb.Transaction[Any], index: int) -> Entry | None: ...

    def buffered_tail(self) -> list[Entry]: ...


_CKPT_DB = b"broker"
_CKPT_KEY = b"checkpoint"
_POS_DB = b"entrypos"  # CommitLog position of a produce entry -> its log index + CRC
_POS_VAL = struct.Struct(">QI")


def _seal_pos(key: bytes, index: int) -> bytes:
    return _POS_VAL.pack(index, zlib.crc32(_KEY.pack(index), zlib.crc32(key)))


def _unseal_pos(key: bytes, value: bytes | memoryview) -> int:
    raw = bytes(value)
    if len(raw) == _POS_VAL.size and len(key) == _KEY.size:
        index, crc = _POS_VAL.unpack(raw)
        if crc == zlib.crc32(_KEY.pack(index), zlib.crc32(key)):
            return int(index)
    raise IndexDamaged(f"the entry map's row for position {bytes(key).hex()} fails its CRC")


_ICRC = struct.Struct(">I")
_SEALED_IVAL = _IVAL.size + _ICRC.size


_BLOCK_DB = b"cqblocks"  # (queue id, block number) -> index entries + CRC
# Index entries per block: 680 x 24 bytes + a CRC fill four LMDB overflow
# pages (16,384 bytes less the page header) with nothing to spare, so a
# retained message costs 24 bytes of index on disk.
BLOCK_UNITS = 680
_UNIT = _IVAL.size
_BKEY = struct.Struct(">IQ")


@functools.lru_cache(maxsize=BLOCK_UNITS)
def _ivals(n: int) -> struct.Struct:
    """``n`` index entries back to back (:data:`_IVAL` repeated)."""
    return struct.Struct(">" + _IVAL.format.lstrip(">") * n)


# Durable index blocks kept in memory after a read or a checkpoint (16 KiB
# each at most: 4 MiB).
_CACHED_BLOCKS = 256


class _BlockIndex:
    """The ConsumeQueue in blocks of :data:`BLOCK_UNITS` entries per LMDB
    value, each block CRC-checked as a whole (one flipped bit anywhere in it
    is :class:`IndexDamaged`, never a read of the wrong message).

    Changed blocks live in :attr:`over` (read through) until a checkpoint
    stages them; durable blocks read back are kept in a small cache (their
    CRC checked once). A block is dropped when retention has passed its
    last entry; entries before a queue's min offset inside a kept block are
    simply never read."""

    def __init__(self, owner: DurableBodies) -> None:
        self._owner = owner
        self.over: dict[bytes, bytearray | None] = {}
        self._cache: dict[bytes, bytes] = {}

    @staticmethod
    def key(qid: int, off: int) -> tuple[bytes, int]:
        b, i = divmod(off, BLOCK_UNITS)
        return _BKEY.pack(qid, b), i

    @staticmethod
    def seal(key: bytes, content: bytes | bytearray) -> bytes:
        return bytes(content) + _ICRC.pack(zlib.crc32(content, zlib.crc32(key)))

    @staticmethod
    def unseal(key: bytes, value: bytes | memoryview) -> bytes:
        raw = bytes(value)
        body = raw[: -_ICRC.size]
        if (
            len(raw) < _ICRC.size
            or len(body) % _UNIT
            or _ICRC.unpack_from(raw, len(body))[0] != zlib.crc32(body, zlib.crc32(key))
        ):
            qid, b = _BKEY.unpack(key)
            raise IndexDamaged(
                f"the index block of queue {qid} offsets {b * BLOCK_UNITS}.."
                f"{(b + 1) * BLOCK_UNITS - 1} fails its CRC"
            )
        return body

    def _durable(self, key: bytes) -> bytes | None:
        got = self._cache.get(key)
        if got is not None:
            return got
        env, _, idx = self._owner._open()
        txn = self._owner._rtxn if self._owner._rtxn is not None else env.begin()
        try:
            value = txn.get(key, db=idx)
        finally:
            if txn is not self._owner._rtxn:
                txn.abort()
        if value is None:
            return None
        body = self.unseal(key, value)
        self._remember(key, body)
        return body

    def _remember(self, key: bytes, body: bytes) -> None:
        """Keep a durable block read back (or just written): at most
        ``_CACHED_BLOCKS``, the oldest inserted going first."""
        cache = self._cache
        cache.pop(key, None)
        while len(cache) >= _CACHED_BLOCKS:
            cache.pop(next(iter(cache)))
        cache[key] = body

    def _block(self, key: bytes) -> bytes | bytearray | None:
        if key in self.over:
            return self.over[key]
        return self._durable(key)

    def _writable(self, key: bytes, at: int) -> bytearray:
        """Block ``key`` in :attr:`over` (copied from the durable one on
        first change), at least ``at`` bytes long."""
        blk = self.over.get(key)
        if blk is None:
            old = None if key in self.over else self._durable(key)
            blk = self.over[key] = bytearray(old or b"")
        if len(blk) < at:
            blk.extend(bytes(at - len(blk)))  # a gap: never read (below min or a restore)
        return blk

    def put(self, qid: int, off: int, entry: IndexEntry) -> None:
        key, i = self.key(qid, off)
        at = i * _UNIT
        self._writable(key, at)[at : at + _UNIT] = _IVAL.pack(*entry)

    def put_run(self, qid: int, off: int, flat: Sequence[int]) -> None:
        """:meth:`put` of consecutive entries (``flat``: four fields each),
        one slice of a block at a time: a produce of a hundred messages to
        one queue packs and stores one slice instead of a hundred."""
        n = len(flat) // 4
        k = 0
        while k < n:
            key, i = self.key(qid, off + k)
            m = min(n - k, BLOCK_UNITS - i)
            at = i * _UNIT
            self._writable(key, at)[at : at + m * _UNIT] = _ivals(m).pack(
                *flat[4 * k : 4 * (k + m)]
            )
            k += m

    def get(self, qid: int, off: int) -> IndexEntry:
        key, i = self.key(qid, off)
        blk = self._block(key)
        at = i * _UNIT
        if blk is None or len(blk) < at + _UNIT:
            raise BodyMissing(f"no index entry for queue {qid} offset {off}")
        p, size, tag, ts = _IVAL.unpack_from(blk, at)
        return p, size, tag, ts

    def many(self, qid: int, lo: int, hi: int) -> list[IndexEntry]:
        return list(_IVAL.iter_unpack(self.many_raw(qid, lo, hi)))

    def many_raw(self, qid: int, lo: int, hi: int) -> bytes:
        """Entries [lo, hi) as their packed rows (:data:`_IVAL`), joined."""
        parts: list[bytes] = []
        off = lo
        while off < hi:
            key, i = self.key(qid, off)
            n = min(hi - off, BLOCK_UNITS - i)
            blk = self._block(key)
            if blk is None or len(blk) < (i + n) * _UNIT:
                raise BodyMissing(f"no index entry for queue {qid} offset {off}")
            parts.append(bytes(blk[i * _UNIT : (i + n) * _UNIT]))
            off += n
        return b"".join(parts)

    def delete(self, qid: int, lo: int, hi: int) -> None:
        """Entries [lo, hi) are gone, and (retention drops from the head,
        a deleted topic goes whole) so is everything before ``lo``: drop
        each block touched that holds nothing past ``hi``."""
        if hi <= lo:
            return
        for b in range(lo // BLOCK_UNITS, -(-hi // BLOCK_UNITS)):
            key = _BKEY.pack(qid, b)
            if (b + 1) * BLOCK_UNITS > hi:
                blk = self._block(key)
                if blk is not None and b * BLOCK_UNITS + len(blk) // _UNIT > hi:
                    continue  # live entries past hi
            self.over[key] = None
            self._cache.pop(key, None)

    def staged(self) -> dict[bytes, bytes | None]:
        return {k: (None if v is None else self.seal(k, v)) for k, v in self.over.items()}

    def prune(self, staged: dict[bytes, bytes | None]) -> None:
        for key, value in staged.items():
            if key not in self.over:
                continue
            cur = self.over[key]
            if value is None and cur is None:
                del self.over[key]
                self._cache.pop(key, None)
            elif value is not None and cur is not None and self.seal(key, cur) == value:
                del self.over[key]
                self._remember(key, value[: -_ICRC.size])

    def frozen(self) -> dict[bytes, bytes | None]:
        return {k: (None if v is None else bytes(v)) for k, v in self.over.items()}

    def clear(self) -> None:
        self.over.clear()
        self._cache.clear()


class _EntryCache:
    """The last log entry a read used: a page of adjacent messages is one
    entry read, not one per message."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: Entry | None = None


def _slice(entry: Entry, phys: int, size: int | None) -> bytes:
    """The record at CommitLog position ``phys`` inside ``entry``."""
    off = phys - entry.pos
    if size is None:
        # The record's own length prefix (codec: a u32 size first).
        if off + 4 > len(entry.data):
            raise BodyMissing(f"entry {entry.index} holds no record at physical offset {phys}")
        size = int.from_bytes(entry.data[off : off + 4], "big")
    if off < 0 or size <= 0 or off + size > len(entry.data):
        raise BodyMissing(f"entry {entry.index} holds no record at physical offset {phys}")
    return entry.data[off : off + size]


class _OverlayFrozen(_LmdbFrozen):
    """A frozen view: the archive and index as committed, the changes not yet
    written on top, and records of log entries read from the log as the same
    read transaction sees it (applied entries are always in the log's
    committed image)."""

    def __init__(
        self,
        txn: lmdb.Transaction,
        owner: DurableBodies,
        over: dict[bytes, bytes | None],
        over_idx: dict[bytes, bytes | None],
        pos_rows: list[tuple[int, int]],
        tail: list[Entry],
    ) -> None:
        _env, recs, idx = owner._open()
        super().__init__(txn, recs, idx)
        # Entries the log holds beyond its LMDB image (its write-ahead log
        # part), taken before ``txn`` was opened.
        self._tail = tail
        self._tail_first = tail[0].index if tail else 0
        self._owner = owner
        self._over, self._over_idx = over, over_idx
        self._pos_rows = pos_rows
        self._pos_deletes = dict(owner._pos_deletes)
        self._archive_end = owner._archive_end

    def records(self, phys: Sequence[int]) -> list[bytes]:
        out: list[bytes] = []
        cache = _EntryCache()
        st = self._owner._storage
        assert st is not None
        for p in phys:
            if p < self._archive_end:
                key = _KEY.pack(p)
                rec = self._over[key] if key in self._over else self._txn.get(key, db=self._recs)
                if rec is None:
                    raise BodyMissing(f"no stored record at physical offset {p}")
                out.append(bytes(rec))
                continue
            e = cache.entry
            if e is None or not e.pos <= p < e.end_pos:
                index = self._owner._index_of(p, self._txn, self._pos_rows, self._pos_deletes)
                e = None
                if index is not None:
                    k = index - self._tail_first
                    if self._tail and 0 <= k < len(self._tail):
                        e = self._tail[k]
                    else:
                        e = st.entry_in(self._txn, index)
                if e is None:
                    raise RecordNotHere(f"no log entry here holds physical offset {p}")
                if not e.pos <= p < e.end_pos:
                    raise IndexDamaged(f"the entry map names entry {e.index} for offset {p}")
                cache.entry = e
            out.append(_slice(e, p, None))
        return out

    def columns(self, qid: int, lo: int, hi: int) -> tuple[array[int], ...]:
        parts: list[bytes] = []
        off = lo
        while off < hi:
            key, i = _BlockIndex.key(qid, off)
            n = min(hi - off, BLOCK_UNITS - i)
            if key in self._over_idx:
                blk: bytes | None = self._over_idx[key]
            else:
                value = self._txn.get(key, db=self._idx)
                blk = None if value is None else _BlockIndex.unseal(key, value)
            if blk is None or len(blk) < (i + n) * _UNIT:
                raise BodyMissing(f"index of queue {qid} lacks offset {off} (wanted {lo}..{hi})")
            parts.append(blk[i * _UNIT : (i + n) * _UNIT])
            off += n
        return _ival_columns(b"".join(parts))


class DurableBodies(LmdbBodies):
    """The broker's store inside the node's own log environment
    (:class:`SideStorage`): one copy of each record.

    * **Records are read from the log.** A produce entry's records stay in
      the log entry that carries them; the store keeps only the entry's
      CommitLog position -> log index (``entrypos``, CRC per row), and a
      read finds the entry holding a physical offset, checks that it spans
      it and slices the record out (the entry's CRC checked on every read).
      Records restored from a snapshot of format 1 (their entries are not
      in this node's log) are kept in ``records``, below :attr:`_archive_end`.
    * **The ConsumeQueue** is in ``cqblocks``, 680 entries to a CRC-checked
      block (:class:`_BlockIndex`).
    * **Checkpoints.** Changes stay in memory (read through) until
      :meth:`stage_checkpoint` hands them, and a blob with the rest of the
      state as of the same moment, to the storage's next group commit; once
      that is durable, :meth:`prune` forgets what it wrote. What is on disk
      is therefore always a whole checkpoint, never a mix.

    The log must keep every entry that holds a retained record: the node
    compacts it no further than :meth:`index_of` the oldest one.
    """

    log_backed = True

    def __init__(self) -> None:
        super().__init__("", batch=1 << 62)
        self._storage: SideStorage | None = None
        self._staged: list[tuple[int, dict[bytes, bytes | None], dict[bytes, bytes | None]]] = []
        # Produce entries applied since the last durable checkpoint, in order:
        # (position, index); rows before _pos_done are durable (dropped here).
        self._pos_rows: list[tuple[int, int]] = []
        self._pos_done = 0  # rows ever dropped from the front of _pos_rows
        self._pos_staged: list[tuple[int, int]] = []  # (seq, rows up to)
        self._pos_deletes: dict[bytes, bytes | None] = {}
        self._archive_end = 0
        self._pos_db: lmdb._Database | None = None
        self._cq = _BlockIndex(self)
        self._cq_staged: list[tuple[int, dict[bytes, bytes | None]]] = []
        self._read_cache: _EntryCache | None = None  # inside reading()
        # Set while a snapshot is restored into this store from a worker
        # thread: reads answer "catching up" instead of seeing it half done.
        self.restoring = False

    def attach(self, storage: SideStorage) -> None:
        """Bind to the node's open storage (before any other call)."""
        self._storage = storage
        self._dbs = (storage.side_db(_DB), storage.side_db(_BLOCK_DB))
        storage.side_db(_CKPT_DB)
        self._pos_db = storage.side_db(_POS_DB)
        self._env_ = storage.env
        with self._env_.begin() as txn:
            cur = txn.cursor(db=self._dbs[0])
            if cur.last():
                self._archive_end = _KEY.unpack(cur.key())[0] + len(cur.value())

    def _open(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database]:
        if self._env_ is None or self._dbs is None:
            raise RuntimeError("DurableBodies used before attach(storage)")
        return self._env_, self._dbs[0], self._dbs[1]

    def _changed(self) -> None:
        pass  # written only by stage_checkpoint, in the log's transactions

    def commit(self) -> None:
        pass

    # -- records: in the log (or the archive) -------------------------------------
    def put_entry(self, index: int, pos: int) -> None:
        """Entry ``index`` at CommitLog position ``pos`` holds records."""
        self._pos_rows.append((pos, index))

    def put(self, phys: int, rec: bytes) -> None:
        raise TypeError("records stay in the log: put_entry, not put")

    def delete(self, phys: int) -> None:
        """Retention dropped the record at ``phys``. One in the log goes with
        its entry when the log is compacted: only the archive (records
        restored from a format-1 snapshot) has a row to delete. Before, every
        dropped message staged a delete of a row that never existed, and
        each checkpoint's commit looked each one up (issue 17: a third of the
        leader's commit time with retention dropping 20,000 messages/s)."""
        if phys < self._archive_end:
            super().delete(phys)

    # -- the ConsumeQueue: CRC-checked blocks ------------------------------------
    def index_put(self, qid: int, off: int, entry: IndexEntry) -> None:
        self._cq.put(qid, off, entry)

    def index_put_run(self, qid: int, off: int, flat: Sequence[int]) -> None:
        self._cq.put_run(qid, off, flat)

    def _not_restoring(self) -> None:
        if self.restoring:
            raise RecordNotHere("this replica is installing a snapshot")

    def index_get(self, qid: int, off: int) -> IndexEntry:
        self._not_restoring()
        return self._cq.get(qid, off)

    def index_many(self, qid: int, lo: int, hi: int) -> list[IndexEntry]:
        self._not_restoring()
        return self._cq.many(qid, lo, hi)

    def index_raw(self, qid: int, lo: int, hi: int) -> bytes:
        """:meth:`index_many` as the packed rows (:data:`_IVAL`, joined),
        for a columnar read."""
        self._not_restoring()
        return self._cq.many_raw(qid, lo, hi)

    def index_delete(self, qid: int, lo: int, hi: int) -> None:
        self._cq.delete(qid, lo, hi)

    def _index_of(
        self,
        phys: int,
        txn: lmdb.Transaction,
        rows: list[tuple[int, int]],
        deletes: dict[bytes, bytes | None] | None = None,
    ) -> int | None:
        if rows and phys >= rows[0][0]:
            k = bisect.bisect_right(rows, (phys, 1 << 63)) - 1
            return rows[k][1]
        cur = txn.cursor(db=self._pos_db)
        if cur.set_range(_KEY.pack(phys + 1)):
            if not cur.prev():
                return None
        elif not cur.last():
            return None
        key = cur.key()
        if key in (self._pos_deletes if deletes is None else deletes):
            return None
        return _unseal_pos(bytes(key), cur.value())

    def index_of(self, phys: int) -> int | None:
        """The log index of the entry holding the record at ``phys``, or None
        for a record kept in the archive."""
        if phys < self._archive_end:
            return None
        env, _, _ = self._open()
        txn = self._rtxn if self._rtxn is not None else env.begin()
        try:
            return self._index_of(phys, txn, self._pos_rows)
        finally:
            if txn is not self._rtxn:
                txn.abort()

    def _from_log(self, phys: int, size: int | None, cache: _EntryCache) -> bytes:
        return _slice(self._entry_at(phys, cache), phys, size)

    def _entry_at(self, phys: int, cache: _EntryCache) -> Entry:
        """The log entry holding CommitLog position ``phys`` (the cached one
        when it does), read and CRC-checked by the storage."""
        e = cache.entry
        if e is None or not e.pos <= phys < e.end_pos:
            index = self.index_of(phys)
            st = self._storage
            assert st is not None
            try:
                got = st.entries(index, index + 1) if index is not None else []
            except Compacted:
                got = []
            if not got:
                raise RecordNotHere(f"no log entry here holds physical offset {phys}")
            e = cache.entry = got[0]
            if not e.pos <= phys < e.end_pos:
                # the position map named the wrong entry: damage, not a read
                raise IndexDamaged(
                    f"the entry map names entry {e.index} [{e.pos}, {e.end_pos}) "
                    f"for physical offset {phys}"
                )
        return e

    def page_entries(
        self, phys: Sequence[int], max_bytes: int = 1 << 62
    ) -> list[tuple[Entry, int]] | None:
        """The log entries holding the records at ``phys`` (ascending), in
        order, each with the end of its run: entry ``j`` holds
        ``phys[k[j-1]:k[j]]``. One entry read per entry, not per record (a
        columnar page slices the records itself). The entries are held
        together, so they stop once they add up to ``max_bytes`` (after
        the first): the last one's end may then fall short of ``len(phys)``
        and the page is shorter. None when a record is in the archive (a
        row of its own, not in the log): read those one by one. Raises as
        :meth:`get_many` does."""
        self._not_restoring()
        if not len(phys) or phys[0] < self._archive_end:
            return None
        out: list[tuple[Entry, int]] = []
        held = 0
        with self.reading():
            cache = self._read_cache
            assert cache is not None
            k, n = 0, len(phys)
            while k < n:
                e = self._entry_at(int(phys[k]), cache)
                held += len(e.data)
                if out and held > max_bytes:
                    break
                k = bisect.bisect_left(phys, e.end_pos, k + 1)
                out.append((e, k))
        return out

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """One read transaction and one entry cache for every read inside:
        a page of messages read one by one (``get``) decodes each log entry
        once. Before, every message of a JSON page re-read, re-joined and
        re-checked its whole entry: 1,000 messages of one produce cost 1,000
        entry reads (issue 17: 5,500 messages/s for JSON pages)."""
        if self._read_cache is not None:  # nested: the outer one serves
            yield
            return
        self._read_cache = _EntryCache()
        try:
            with super().reading():
                yield
        finally:
            self._read_cache = None

    def get(self, phys: int) -> bytes:
        self._not_restoring()
        if phys < self._archive_end:
            return super().get(phys)
        cache = self._read_cache
        return self._from_log(phys, None, cache if cache is not None else _EntryCache())

    def get_many(self, phys: Sequence[int], sizes: Sequence[int] | None = None) -> list[bytes]:
        self._not_restoring()
        out: list[bytes] = []
        with self.reading():
            cache = self._read_cache
            assert cache is not None
            for k, p in enumerate(phys):
                size = sizes[k] if sizes is not None else None
                if p < self._archive_end:
                    rec = super().get(p)
                    if size is not None and len(rec) != size:
                        raise BodyMissing(f"the record at physical offset {p} has the wrong size")
                    out.append(rec)
                else:
                    out.append(self._from_log(p, size, cache))
        return out

    def drop_entries_below(self, pos: int) -> None:
        """The log was compacted to CommitLog position ``pos``: forget the
        entries before it (the next checkpoint deletes their rows)."""
        env, _, _ = self._open()
        with env.begin() as txn:
            cur = txn.cursor(db=self._pos_db)
            if cur.first():
                for key in cur.iternext(keys=True, values=False):
                    if _KEY.unpack(key)[0] >= pos:
                        break
                    self._pos_deletes[bytes(key)] = None
        rows = self._pos_rows
        k = bisect.bisect_left(rows, (pos, -1))
        if k:
            # Not yet durable: their rows go with the next checkpoint anyway;
            # record deletes so a staged put of them is undone too.
            for p, _i in rows[:k]:
                self._pos_deletes[_KEY.pack(p)] = None

    # -- checkpoints ------------------------------------------------------------
    def stage_checkpoint(self, blob: bytes) -> int:
        """Hand the changes so far and ``blob`` (the rest of the state as of
        the same moment) to the storage's next group commit."""
        st = self._storage
        assert st is not None
        self.prune()
        recs, idx = dict(self._pending), self._cq.staged()
        pos: dict[bytes, bytes | None] = {}
        for p, i in self._pos_rows:
            k = _KEY.pack(p)
            pos[k] = _seal_pos(k, i)
        pos.update(self._pos_deletes)
        self._pos_deletes = {}
        seq = st.stage(
            {
                _DB: dict(recs),
                _BLOCK_DB: idx,
                _POS_DB: pos,
                _CKPT_DB: {_CKPT_KEY: blob},
            }
        )
        self._staged.append((seq, recs, {}))
        self._cq_staged.append((seq, idx))
        self._pos_staged.append((seq, self._pos_done + len(self._pos_rows)))
        return seq

    def durable(self, seq: int) -> bool:
        st = self._storage
        return st is not None and st.side_synced >= seq

    def prune(self) -> None:
        """Forget overlay entries that a durable checkpoint wrote."""
        st = self._storage
        if st is None:
            return
        done = st.side_synced
        while self._staged and self._staged[0][0] <= done:
            _, recs, idx = self._staged.pop(0)
            for pending, staged in ((self._pending, recs), (self._pending_idx, idx)):
                for key, value in staged.items():
                    if key in pending and pending[key] is value:
                        del pending[key]
        while self._cq_staged and self._cq_staged[0][0] <= done:
            self._cq.prune(self._cq_staged.pop(0)[1])
        while self._pos_staged and self._pos_staged[0][0] <= done:
            _, upto = self._pos_staged.pop(0)
            n = upto - self._pos_done
            if n > 0:
                del self._pos_rows[:n]
                self._pos_done = upto

    def verify(self) -> int:
        """Check every index block and entry-map row on disk against its CRC
        (at start, so a store damaged while the node was down is rebuilt
        from the log rather than found by a read later); raises
        :class:`IndexDamaged`. Returns how many it checked."""
        env, _, idx = self._open()
        n = 0
        # The checks of unseal() and _unseal_pos(), without copying each
        # value out of the map: a start at 10M messages checks about 15,000
        # blocks and 100,000 rows.
        crc32, pack_key, unpack_pos, icrc = zlib.crc32, _KEY.pack, _POS_VAL.unpack, _ICRC.unpack
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=idx).iternext():
                body_len = len(value) - _ICRC.size
                if (
                    body_len < 0
                    or body_len % _UNIT
                    or icrc(value[body_len:])[0] != crc32(value[:body_len], crc32(key))
                ):
                    _BlockIndex.unseal(bytes(key), value)  # raises, naming the block
                n += 1
            for key, value in txn.cursor(db=self._pos_db).iternext():
                if len(value) != _POS_VAL.size or len(key) != _KEY.size:
                    _unseal_pos(bytes(key), value)  # raises
                index, crc = unpack_pos(value)
                if crc != crc32(pack_key(index), crc32(key)):
                    _unseal_pos(bytes(key), value)  # raises
                n += 1
        return n

    def load_checkpoint(self) -> bytes | None:
        """The last durable checkpoint blob, or None."""
        env, _, _ = self._open()
        st = self._storage
        assert st is not None
        with env.begin() as txn:
            value = txn.get(_CKPT_KEY, db=st.side_db(_CKPT_DB))
        return None if value is None else bytes(value)

    def discard(self) -> None:
        """Drop everything stored (the checkpoint first, in the same
        transaction): the state will be rebuilt."""
        st = self._storage
        assert st is not None
        self._pending.clear()
        self._pending_idx.clear()
        self._staged.clear()
        self._pos_rows.clear()
        self._pos_staged.clear()
        self._pos_deletes.clear()
        self._pos_done = 0
        self._archive_end = 0
        self._cq.clear()
        self._cq_staged.clear()
        st.side_clear(_CKPT_DB, _DB, _BLOCK_DB, _POS_DB)

    def replace_all(
        self,
        records: Iterable[tuple[int, bytes]],
        index: Iterable[tuple[int, int, tuple[array[int], ...]]],
    ) -> None:
        """A restore: the old checkpoint goes with everything else (so a
        crash before the next checkpoint rebuilds rather than mixes), then
        the records (into the archive: their entries are not in this log)
        and the index entries are written in bulk transactions."""
        st = self._storage
        assert st is not None
        self.discard()
        batch: list[tuple[bytes, bytes]] = []
        end = 0
        for phys, rec in records:
            batch.append((_KEY.pack(phys), rec))
            end = max(end, phys + len(rec))
            if len(batch) >= 65536:
                st.side_put_now(_DB, batch)
                batch = []
        st.side_put_now(_DB, batch)
        self._archive_end = end

        def flush() -> None:
            blocks = [
                (k, _BlockIndex.seal(k, v)) for k, v in self._cq.over.items() if v is not None
            ]
            self._cq.clear()  # a block flushed half-filled is read back to go on
            st.side_put_now(_BLOCK_DB, blocks)

        for qid, lo, cols in index:
            for k, e in enumerate(zip(*cols, strict=True)):
                self._cq.put(qid, lo + k, (e[0], e[1], e[2], e[3]))
                if len(self._cq.over) >= 64:
                    flush()
        flush()

    def freeze(self) -> Frozen:
        env, _, _ = self._open()
        st = self._storage
        assert st is not None
        tail = st.buffered_tail()  # before the transaction: see buffered_tail
        return _OverlayFrozen(
            env.begin(),
            self,
            dict(self._pending),
            self._cq.frozen(),
            list(self._pos_rows),
            tail,
        )

    def close(self) -> None:
        self._pending.clear()
        self._pending_idx.clear()
        self._staged.clear()
        self._pos_rows.clear()
        self._cq.clear()
        if self._rtxn is not None:
            self._rtxn.abort()
            self._rtxn = None
        self._env_ = self._dbs = None  # the storage's: not closed here
