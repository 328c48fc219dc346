"""The asyncio driver of one controller-mode replica: CommitLog storage, the
HA link over the peer transport, apply up to the confirm offset.

Theory of operation
-------------------
The node does not decide who is master. Its owner (the broker agent, which
heartbeats to the controller) calls :meth:`CmodeNode.assign` with the
controller's word: master, epoch, SyncStateSet. Then:

* **Master of a new epoch**: record ``(epoch, last index)`` in the epoch
  file (fsynced) before anything else; raise the confirm offset to its
  whole log (RocketMQ's rule: a new master confirms what it holds, the
  previous master's unconfirmed tail included, before it takes traffic);
  apply up to there; then take writes. A write is appended to the
  CommitLog (the same LMDB log storage a Raft node uses; ``term`` holds the
  epoch), made durable by the next group commit (one fsync per loop pass,
  off the loop), counted by :class:`~dledger.cmode.master.MasterCore`,
  pushed to the slaves; it is applied and answered once the confirm offset
  covers it. A write the SyncStateSet cannot confirm fails at once
  (``min_in_sync_replicas``).
* **Slave**: joins the master (:class:`~dledger.cmode.replication.SlaveLink`),
  truncates to the last consistent point (durably, with its epoch file),
  then appends what the master pushes, fsyncs, acknowledges, and applies up
  to the master's confirm offset capped by what it holds.
* A truncation below what the state machine already applied (possible only
  after an unclean election, or two masters) resets the state machine and
  replays the log from the start: this first version keeps no snapshot of a
  controller-mode log, so its logs are never compacted.
* **No lease.** A master that the controller replaced keeps taking writes
  until it hears otherwise; whether it can confirm them depends on its
  SyncStateSet (its slaves stop following it once they follow the new one).

Order of one loop pass: handle received messages, pump pushes and
retries, make appends and truncations durable (one ``sync`` in a worker
thread), report durability to the links (acks go out), apply up to the
confirm offset and answer the writes it covers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from dledger import faults
from dledger.cmode import codec
from dledger.cmode.epochs import EpochMap
from dledger.cmode.master import AlterRequest, CmodeConfig, MasterCore
from dledger.cmode.replication import Action, Append, MasterLink, Refuse, Send, SlaveLink, Truncate
from dledger.config import NodeConfig
from dledger.core.types import Entry, EntryType, Role
from dledger.errors import (
    ConfigError,
    DLedgerError,
    NotLeader,
    StorageCorrupted,
    StorageFailed,
    Unavailable,
)
from dledger.node import Applied, NodeStopped, OutcomeUnknown, ReadResult
from dledger.runtime import NodeEnv, NodeStorage, NodeTransport
from dledger.statemachine import StateMachine

logger = logging.getLogger(__name__)

EPOCH_FILE = "cmode-epochs.bin"


class NotInSync(Unavailable):
    """The SyncStateSet cannot confirm a write now (503)."""

    code = "NOT_IN_SYNC"


class NotInControllerMode(ConfigError):
    """A Raft-only operation (leadership transfer, membership change) asked
    of a controller-mode node (422)."""

    code = "NOT_IN_CONTROLLER_MODE"


class CmodeNode:
    def __init__(
        self,
        cfg: NodeConfig,
        state_machine: StateMachine,
        cmode: CmodeConfig | None = None,
        env: NodeEnv | None = None,
    ) -> None:
        """``state_machine`` must be empty: its snapshot now is what a replay
        from the start restores (the HTTP layer keeps a reference to it, so
        it is reset in place, never replaced)."""
        cfg.validate()
        cmode = cmode if cmode is not None else cfg.cmode_config()
        cmode.validate(len(cfg.members) or 1)
        self.cfg = cfg
        self.cmode = cmode
        self.env = env if env is not None else NodeEnv()
        self._clock = self.env.clock
        self.state_machine = state_machine
        self._empty = state_machine.snapshot()
        self.applied = 0
        self.epochs = EpochMap()
        self.master_id = 0
        self.epoch = 0  # the epoch this node serves (master) or follows (slave)
        self.sync_state_set: frozenset[int] = frozenset()
        self.sync_state_set_epoch = 0
        self._mlink: MasterLink | None = None
        self._slink: SlaveLink | None = None
        self._serving_from = 0  # a master serves once applied reaches this
        self._storage: NodeStorage | None = None
        self._transport: NodeTransport | None = None
        self._release: Callable[[], None] | None = None
        self._inbox: deque[tuple[int, bytes]] = deque()
        self._proposals: deque[tuple[bytes, asyncio.Future[Applied]]] = deque()
        # The controller's latest word, taken by the loop (see assign).
        self._assignment: tuple[int, int, frozenset[int], int] | None = None
        self._pending: dict[int, asyncio.Future[Applied]] = {}
        self._dirty = False  # appends or truncations not yet synced
        # A slave's truncation or append awaits the next sync; the link hears
        # of it once per sync (one acknowledgement, however many pushes).
        self._slave_sync_due = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._stopping = False
        self.fatal: BaseException | None = None
        self.failed = asyncio.Event()
        self.refusal = ""
        self.counters: dict[str, int] = {
            "decode_errors": 0,
            "syncs": 0,
            "applied_entries": 0,
            "writes_ok": 0,
            "writes_refused": 0,
            "resets": 0,
            "truncated_entries": 0,
        }
        self._end_pos = 0
        self._epochs_on_disk = b""

    # -- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._running or self._stopping:
            raise RuntimeError("a CmodeNode can be started once")
        cfg = self.cfg
        storage, self._release = self.env.open_storage(cfg)
        try:
            self.epochs = self._load_epochs()
            self._reconcile_epochs(storage)
            last = storage.last_index()
            if last:
                e = storage.entries(last, last + 1)[0]
                self._end_pos = e.pos + len(e.data)
            peers = {m.id: (m.raft_host, m.raft_port) for m in cfg.members if m.id != cfg.node_id}
            transport = self.env.make_transport(
                cfg.node_id,
                cfg.cluster_id,
                cfg.raft_host,
                cfg.raft_port,
                peers,
                cfg.secret_bytes,
                self._on_message,
            )
            await transport.start()
        except BaseException:
            storage.close()
            self._unlock()
            raise
        self._storage, self._transport = storage, transport
        self._running = True
        logger.info(
            "cmode node %d: opened %s (entries up to %d, epochs %s)",
            cfg.node_id,
            cfg.data_dir,
            storage.last_index(),
            self.epochs,
        )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if not self._running or self._stopping:
            return
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({self._task}, timeout=5)
        self._fail_pending(OutcomeUnknown("the node stopped before the write was confirmed"))
        if self._transport is not None:
            await self._transport.stop()
        if self._storage is not None:
            with contextlib.suppress(DLedgerError):
                self._storage.sync()
            self._storage.close()
        self._unlock()
        self._running = False

    def _unlock(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    @property
    def running(self) -> bool:
        return self._running and not self._stopping and self.fatal is None

    # -- the epoch file ------------------------------------------------------------------
    def _epoch_path(self) -> str:
        return os.path.join(self.cfg.data_dir, EPOCH_FILE)

    def _load_epochs(self) -> EpochMap:
        try:
            with open(self._epoch_path(), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return EpochMap()
        m = EpochMap.decode(data, f"{self._epoch_path()}")
        self._epochs_on_disk = data
        return m

    def _reconcile_epochs(self, st: NodeStorage) -> None:
        """Make the epoch map agree with the log: a crash can leave the file
        behind the log (entries of an epoch appended, the file not yet
        rewritten) or ahead of it (a truncation not yet synced). The log's
        entry terms are the truth; terms never decrease along the log."""
        last = st.last_index()
        self.epochs.truncate_to(last + 1)
        lo = st.first_index()
        while last >= lo:
            cur = self.epochs.last
            if cur is not None and st.term(last) <= cur.epoch:
                break
            # The first index after the last known epoch's start whose term is newer.
            a = max(lo, (cur.start + 1) if cur is not None else lo)
            b = last
            known = cur.epoch if cur is not None else -1
            while a < b:
                mid = (a + b) // 2
                if st.term(mid) > known:
                    b = mid
                else:
                    a = mid + 1
            self.epochs.append(st.term(a), a - 1)
        self._save_epochs()

    def _save_epochs(self) -> None:
        data = self.epochs.encode()
        if data == self._epochs_on_disk:
            return
        path = self._epoch_path()
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            dfd = os.open(self.cfg.data_dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            # A failed write of the epoch file is a failed disk, as for the
            # log: the node stops rather than go on with an unknown file.
            raise StorageFailed(f"writing the epoch file {path}: {exc}") from exc
        self._epochs_on_disk = data

    # -- the controller's word -----------------------------------------------------------
    def assign(
        self, master: int, epoch: int, sync_state_set: frozenset[int], sync_state_set_epoch: int
    ) -> None:
        """What the controller says now (from a heartbeat answer); the loop
        takes it at the start of its next pass, when no sync is running."""
        self._assignment = (master, epoch, sync_state_set, sync_state_set_epoch)
        self._wake.set()

    def _take_assignment(self) -> None:
        if self._assignment is None:
            return
        master, epoch, sync_state_set, sync_state_set_epoch = self._assignment
        self._assignment = None
        if not self.running or epoch < self.epoch:
            return
        me = self.cfg.node_id
        now_ms = int(self._clock() * 1000)
        if master == me and (epoch > self.epoch or self._mlink is None):
            self._become_master(epoch, sync_state_set, sync_state_set_epoch, now_ms)
        elif master == me and self._mlink is not None:
            self._mlink.core.on_sync_state_set(sync_state_set_epoch, sync_state_set)
        elif master != me and master != 0 and (epoch > self.epoch or self._slink is None):
            self._become_slave(master, epoch, now_ms)
        self.sync_state_set, self.sync_state_set_epoch = sync_state_set, sync_state_set_epoch

    def _become_master(self, epoch: int, sss: frozenset[int], sss_epoch: int, now_ms: int) -> None:
        st = self._st()
        last = st.last_index()
        mine = self.epochs.last
        if mine is not None and mine.epoch > epoch:
            logger.warning(
                "cmode node %d: told to be master of epoch %d, but its log has epoch %d",
                self.cfg.node_id,
                epoch,
                mine.epoch,
            )
            return
        if mine is None or mine.epoch < epoch:
            self.epochs.append(epoch, last)
            self._save_epochs()
        # else: this node was already master of this epoch and restarted
        # before the controller noticed: it goes on with the same epoch.
        members = frozenset(m.id for m in self.cfg.members) or frozenset({self.cfg.node_id})
        core = MasterCore(
            me=self.cfg.node_id,
            epoch=epoch,
            members=members,
            sync_state_set=sss if self.cfg.node_id in sss else frozenset({self.cfg.node_id}),
            cfg=self.cmode,
            sync_state_set_epoch=sss_epoch,
            max_offset=last,
            confirm=last,
            started_ms=now_ms,
            confirm_from_master=faults.on(faults.CMODE_CONFIRM_FROM_MASTER),  # planted bug
        )
        self._mlink = MasterLink(core, st, self.epochs)
        self._slink = None
        self.master_id, self.epoch = self.cfg.node_id, epoch
        self._serving_from = last
        logger.info(
            "cmode node %d: master of epoch %d from index %d", self.cfg.node_id, epoch, last
        )

    def _become_slave(self, master: int, epoch: int, now_ms: int) -> None:
        if self._mlink is not None:
            logger.warning(
                "cmode node %d: no longer master (epoch %d has master %d)",
                self.cfg.node_id,
                epoch,
                master,
            )
            self._fail_pending(
                OutcomeUnknown("this master was replaced before the write was confirmed")
            )
        self._mlink = None
        self.master_id, self.epoch = master, epoch
        self._slink = SlaveLink(
            self.cfg.node_id,
            master,
            epoch,
            self._st(),
            self.epochs,
            skip_truncation=faults.on(faults.CMODE_SKIP_TRUNCATION),  # planted bug
        )
        self.refusal = ""
        self._do(self._slink.start(now_ms))

    # -- what the owner asks -------------------------------------------------------------
    def replica_info(self) -> dict[str, Any]:
        """The ``replica`` part of this node's heartbeat to the controller."""
        st = self._storage
        return {
            "epoch": self.epoch,
            "max_offset": st.last_index() if st is not None else 0,
            "unclean": self.cmode.enable_elect_unclean_master,
        }

    def poll_alter_request(self) -> AlterRequest | None:
        if self._mlink is None:
            return None
        return self._mlink.core.poll_request(int(self._clock() * 1000))

    def alter_failed(self) -> None:
        if self._mlink is not None:
            self._mlink.core.on_request_failed()

    @property
    def role(self) -> Role:
        return Role.LEADER if self._mlink is not None else Role.FOLLOWER

    @property
    def leader(self) -> int:
        return self.master_id

    def leader_ready(self) -> bool:
        return self._mlink is not None and self.applied >= self._serving_from and self.running

    def http_address_of(self, node_id: int) -> str | None:
        m = self.cfg.member(node_id)
        return m.http_address if m is not None else None

    @property
    def confirm(self) -> int:
        if self._mlink is not None:
            return self._mlink.core.confirm
        if self._slink is not None:
            return self._slink.confirm
        return 0

    async def propose_entry(self, data: bytes) -> Applied:
        """Append ``data`` as master; answered once confirmed and applied."""
        if not self.running:
            raise NodeStopped(f"node {self.cfg.node_id} is not running")
        m = self._mlink
        if m is None and self._assignment is None:
            raise NotLeader(self.master_id)
        why = m.core.write_refusal() if m is not None else None
        if why is not None:
            self.counters["writes_refused"] += 1
            raise NotInSync(why)
        # Appended by the loop, between two syncs: the storage must never be
        # written while a sync runs in its worker thread (a batch appended
        # then would be forgotten with the one being committed).
        fut: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        self._proposals.append((data, fut))
        self._wake.set()
        return await fut

    async def read(self, consistency: str = "linearizable") -> ReadResult:
        """Controller mode has no linearizable read: a master serves what it
        applied (a deposed master that does not know it may serve stale
        data: no lease), a slave what it applied up to the confirm offset."""
        if consistency == "linearizable" and self._mlink is None:
            raise NotLeader(self.master_id)
        return ReadResult(self.applied, self.applied, "master" if self._mlink else "local")

    # What the HTTP layer asks of any node; Raft-only operations are refused.
    fsync_seconds = None

    async def transfer_leadership(self, to: int, timeout_s: float | None = None) -> None:
        raise NotInControllerMode("controller mode: the controller group elects masters")

    async def add_learner(self, node_id: int) -> Any:
        raise NotInControllerMode("controller mode: the members are the group file's")

    promote = remove = add_learner

    def status(self) -> dict[str, Any]:
        st = self._storage
        out: dict[str, Any] = {
            "id": self.cfg.node_id,
            "cluster_id": self.cfg.cluster_id,
            "mode": "controller",
            "running": self.running,
            # The names a Raft node's status uses, for tools that read both.
            "role": "leader" if self._mlink is not None else "follower",
            "term": self.epoch,
            "leader": self.master_id,
            "leader_http": self.http_address_of(self.master_id) if self.master_id else None,
            "leader_ready": self.leader_ready(),
            "commit": self.confirm,
            "cmode_role": "master"
            if self._mlink is not None
            else ("slave" if self._slink else "none"),
            "master": self.master_id,
            "epoch": self.epoch,
            "epochs": [[e.epoch, e.start] for e in self.epochs],
            "confirm": self.confirm,
            "applied": self.applied,
            "last_index": st.last_index() if st is not None else 0,
            "sync_state_set": sorted(self.sync_state_set),
            "counters": dict(self.counters),
        }
        if self._slink is not None:
            out["link"] = self._slink.state
        if self.refusal:
            out["refusal"] = self.refusal
        if self._mlink is not None:
            core = self._mlink.core
            out["required_acks"] = core.required_acks()
            out["write_refusal"] = core.write_refusal()
            out["acked"] = {str(m): core.acked(m) for m in sorted(core.members)}
        return out

    # -- the loop ------------------------------------------------------------------------
    def _st(self) -> NodeStorage:
        if self._storage is None:
            raise NodeStopped(f"node {self.cfg.node_id} is not running")
        return self._storage

    def _on_message(self, frm: int, payload: bytes) -> None:
        self._inbox.append((frm, payload))
        self._wake.set()

    def _do(self, actions: list[Action]) -> None:
        st = self._st()
        for a in actions:
            if isinstance(a, Send):
                if self._transport is not None:
                    self._transport.send(a.to, codec.encode(a.msg))
            elif isinstance(a, Truncate):
                last = st.last_index()
                if a.to < last:
                    self.counters["truncated_entries"] += last - a.to
                    # The words jepsen_like counts (node logs outlive restarts).
                    logger.warning(
                        "cmode node %d: TRUNCATED %d entries after index %d to follow master %d "
                        "(epoch %d)",
                        self.cfg.node_id,
                        last - a.to,
                        a.to,
                        self.master_id,
                        self.epoch,
                    )
                    st.truncate_from(a.to + 1)
                    ends = st.entries(a.to, a.to + 1) if a.to >= st.first_index() else []
                    self._end_pos = ends[0].pos + len(ends[0].data) if ends else 0
                if a.to < self.applied:
                    self._reset_state_machine()
                self._dirty = True
                self._save_epochs()
                self._slave_sync_due = self._slink is not None
            elif isinstance(a, Append):
                st.append(list(a.entries))
                last_e = a.entries[-1]
                self._end_pos = last_e.pos + len(last_e.data)
                self._dirty = True
                self._save_epochs()  # the link noted a new epoch's start, if any
                self._slave_sync_due = self._slink is not None
            elif isinstance(a, Refuse):
                self.refusal = a.reason
                logger.error(
                    "cmode node %d: cannot follow master %d: %s",
                    self.cfg.node_id,
                    self.master_id,
                    a.reason,
                )

    def _reset_state_machine(self) -> None:
        logger.warning(
            "cmode node %d: truncated below what it applied (%d): replaying from the start",
            self.cfg.node_id,
            self.applied,
        )
        self.counters["resets"] += 1
        self.state_machine.restore(self._empty)
        self.applied = 0

    async def _run(self) -> None:
        tick_s = self.cfg.tick_ms / 1000
        try:
            while not self._stopping:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(tick_s):
                        await self._wake.wait()
                self._wake.clear()
                await self._pass()
        except Exception as exc:  # the node stops on any failure, loudly
            # The same words as a Raft node's: operators and the harness's
            # disk nemesis look for DISK_FAILED when a write or fsync failed.
            logger.critical(
                "cmode node %d: stopping on %s: %s",
                self.cfg.node_id,
                "DISK_FAILED" if isinstance(exc, StorageFailed) else type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, DLedgerError),
            )
            self.fatal = exc
            self._fail_pending(OutcomeUnknown(f"the node failed: {exc!r}"))
            self.failed.set()

    async def _pass(self) -> None:
        now_ms = int(self._clock() * 1000)
        self._take_assignment()
        while self._inbox:
            frm, payload = self._inbox.popleft()
            try:
                msg = codec.decode(payload)
            except codec.HaCodecError:
                self.counters["decode_errors"] += 1
                continue
            if self._mlink is not None:
                self._do(self._mlink.on_message(frm, msg, now_ms))
            elif self._slink is not None:
                self._do(self._slink.on_message(frm, msg, now_ms))
        if self._slink is not None:
            self._do(self._slink.tick(now_ms))
        self._append_proposals()
        if self._dirty:
            st = self._st()
            self._dirty = False
            await self.env.offload(st.sync)
            self.counters["syncs"] += 1
            last = st.last_index()
            if self._mlink is not None:
                self._mlink.core.on_local(last)
            if self._slave_sync_due and self._slink is not None:
                self._slave_sync_due = False
                self._do(self._slink.on_durable(last))
        if self.cfg.flush == "async":
            # Acknowledged before fsync (RocketMQ's ASYNC_FLUSH); the page
            # cache is flushed once per flush_interval_ms, off the loop.
            await self.env.offload(self._st().maybe_flush, self._clock())
        if self._mlink is not None:
            self._do(self._mlink.pump(now_ms))
        self._apply()

    def _append_proposals(self) -> None:
        if not self._proposals:
            return
        m = self._mlink
        why = None if m is None else m.core.write_refusal()
        st = self._st()
        batch: list[Entry] = []
        while self._proposals:
            data, fut = self._proposals.popleft()
            if fut.done():
                continue  # the caller gave up before it was appended
            if m is None:
                fut.set_exception(NotLeader(self.master_id))
                continue
            if why is not None:
                self.counters["writes_refused"] += 1
                fut.set_exception(NotInSync(why))
                continue
            e = Entry(
                st.last_index() + len(batch) + 1, self.epoch, EntryType.NORMAL, data, self._end_pos
            )
            self._end_pos += len(data)
            batch.append(e)
            self._pending[e.index] = fut
        if batch:
            st.append(batch)
            self._dirty = True

    def _apply(self) -> None:
        upto = self.confirm
        st = self._st()
        while self.applied < upto:
            hi = min(upto, self.applied + 256) + 1
            for e in st.entries(self.applied + 1, hi):
                result = self.state_machine.apply(e)
                self.applied = e.index
                self.counters["applied_entries"] += 1
                fut = self._pending.pop(e.index, None)
                if fut is not None and not fut.done():
                    self.counters["writes_ok"] += 1
                    fut.set_result(Applied(e.index, e.term, result))

    def _fail_pending(self, exc: BaseException) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
        # Queued writes were never appended: certainly not written.
        while self._proposals:
            _data, fut = self._proposals.popleft()
            if not fut.done():
                fut.set_exception(NotLeader(self.master_id if self.running else 0))


__all__ = ["CmodeNode", "NotInSync", "StorageCorrupted"]
