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

import os
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import lmdb

from broker_adapter.errors import MalformedCommand

_KEY = struct.Struct(">Q")
_DB = b"records"


class BodyMissing(MalformedCommand):
    """The index names a record the store does not hold (a bug, or a store
    damaged outside the process): reported, never served as something else."""


class Bodies(Protocol):
    def put(self, phys: int, rec: bytes) -> None: ...

    def get(self, phys: int) -> bytes: ...

    def delete(self, phys: int) -> None: ...

    def replace_all(self, items: Iterable[tuple[int, bytes]]) -> None:
        """Drop everything and store ``items`` (a restore)."""
        ...

    def frozen_reader(self) -> Callable[[Sequence[int]], list[bytes]]:
        """The records as they are now, readable later from another thread."""
        ...

    def close(self) -> None: ...


class MemoryBodies:
    def __init__(self) -> None:
        self._d: dict[int, bytes] = {}

    def put(self, phys: int, rec: bytes) -> None:
        self._d[phys] = rec

    def get(self, phys: int) -> bytes:
        try:
            return self._d[phys]
        except KeyError:
            raise BodyMissing(f"no stored record at physical offset {phys}") from None

    def delete(self, phys: int) -> None:
        self._d.pop(phys, None)

    def replace_all(self, items: Iterable[tuple[int, bytes]]) -> None:
        self._d = dict(items)

    def frozen_reader(self) -> Callable[[Sequence[int]], list[bytes]]:
        d = dict(self._d)  # tests and benchmarks only: a plain copy will do

        def read(phys: Sequence[int]) -> list[bytes]:
            return [d[p] for p in phys]

        return read

    def close(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


class LmdbBodies:
    """See the module docstring. ``path`` is emptied on open."""

    def __init__(self, path: str, *, batch: int = 4096, map_size: int = 1 << 28) -> None:
        self.path = path
        self._batch = batch
        self._map_size = map_size
        self._env_: lmdb.Environment | None = None
        self._db_: lmdb._Database | None = None
        # phys -> record, or None for a delete not yet committed
        self._pending: dict[int, bytes | None] = {}
        self.commits = 0
        self.map_growths = 0

    def _open(self) -> tuple[lmdb.Environment, lmdb._Database]:
        """Opened (and emptied) on first use, not at construction: a node
        builds its state machine before it holds the lock on its data
        directory, and must not touch the directory before that."""
        if self._env_ is None or self._db_ is None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.makedirs(self.path)
            self._env_ = lmdb.open(
                self.path,
                map_size=self._map_size,
                max_dbs=1,
                sync=False,
                metasync=False,
                readahead=False,
                subdir=True,
            )
            self._db_ = self._env_.open_db(_DB)
        return self._env_, self._db_

    # -- writes ---------------------------------------------------------------
    def put(self, phys: int, rec: bytes) -> None:
        self._pending[phys] = rec
        if len(self._pending) >= self._batch:
            self.commit()

    def delete(self, phys: int) -> None:
        self._pending[phys] = None
        if len(self._pending) >= self._batch:
            self.commit()

    def commit(self) -> None:
        if not self._pending:
            return
        # Each key is pending once, with its last change, so the deletes and
        # the puts touch different keys and their order does not matter; the
        # puts go in one sorted putmulti (a C loop) instead of a put per record.
        pack = _KEY.pack
        puts = sorted([(pack(phys), rec) for phys, rec in self._pending.items() if rec is not None])
        deletes = [pack(phys) for phys, rec in self._pending.items() if rec is None]
        env, db = self._open()
        while True:
            try:
                with env.begin(write=True, db=db) as txn:
                    for key in deletes:
                        txn.delete(key)
                    if puts:
                        txn.cursor().putmulti(puts)
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
                self.map_growths += 1
        self._pending.clear()
        self.commits += 1

    def replace_all(self, items: Iterable[tuple[int, bytes]]) -> None:
        self._pending.clear()
        batch: list[tuple[bytes, bytes]] = []
        env, db = self._open()
        with env.begin(write=True, db=db) as txn:
            txn.drop(db, delete=False)
        for phys, rec in items:
            batch.append((_KEY.pack(phys), rec))
            if len(batch) >= 65536:
                self._put_many(batch)
                batch = []
        self._put_many(batch)

    def _put_many(self, batch: list[tuple[bytes, bytes]]) -> None:
        if not batch:
            return
        batch.sort()
        env, db = self._open()
        while True:
            try:
                with env.begin(write=True, db=db) as txn:
                    txn.cursor().putmulti(batch)
                return
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
                self.map_growths += 1

    # -- reads ----------------------------------------------------------------
    def get(self, phys: int) -> bytes:
        if phys in self._pending:
            rec = self._pending[phys]
        else:
            env, db = self._open()
            with env.begin(db=db) as txn:
                rec = txn.get(_KEY.pack(phys))
        if rec is None:
            raise BodyMissing(f"no stored record at physical offset {phys}")
        return bytes(rec)

    def frozen_reader(self) -> Callable[[Sequence[int]], list[bytes]]:
        self.commit()
        env, db = self._open()
        txn = env.begin(db=db)  # MVCC: later commits stay invisible to it

        def read(phys: Sequence[int]) -> list[bytes]:
            out: list[bytes] = []
            try:
                for p in phys:
                    rec = txn.get(_KEY.pack(p))
                    if rec is None:
                        raise BodyMissing(f"no stored record at physical offset {p}")
                    out.append(bytes(rec))
            finally:
                txn.abort()
            return out

        return read

    def close(self) -> None:
        self._pending.clear()
        if self._env_ is not None:
            self._env_.close()
            self._env_ = self._db_ = None
