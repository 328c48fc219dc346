"""The asyncio driver of one Raft node: ticks, persist-then-send-then-apply, futures.

Theory of operation
-------------------
One task (the *loop*) owns the :class:`RawNode` and the storage. Everything
else only queues work for it and wakes it:

* the transport's ``on_message`` decodes the frame (a bad one is counted
  and dropped) and appends the message to the inbox;
* ``propose``/``read``/``transfer_leadership``/membership calls append a
  closure to the op queue and await a future.

Each turn of the loop does, in this order:

a. **ticks**: ``elapsed // tick_ms`` on the monotonic clock minus the ticks
   already done. A process that was stopped (SIGSTOP, a long GC, a loaded
   machine) ticks the missed ones *before* it steps any message or serves
   any read, so a leader whose lease ran out while it slept sees that first.
   Past ``4 * election_ticks`` more ticks change nothing and are skipped
   (counted in ``ticks_skipped``);
b. **inputs**: every queued message is stepped, then every queued op runs
   (``raft.propose`` etc.);
c. **Ready**: while ``has_ready()``: take ``ready()``; append its entries and
   save its hard state; if it must be durable, ONE ``storage.sync()`` runs in
   a worker thread, and while it runs new messages and proposals only queue
   up, so the next Ready carries them all and one fsync covers many
   proposals (group commit); then the messages are sent; then committed
   entries are applied to the state machine in order and their proposers'
   futures resolved; then read states are answered; then ``advance()``.
   Nothing calls a RawNode input between ``ready()`` and ``advance()``,
   with one exception on a leader (``_apply_early``, ``_write_and_apply``):
   when the Ready's committed entries were all written by earlier Readies,
   they are applied before its write, and while the write runs the
   acknowledgements of its term (``MID_WRITE_TYPES``) are stepped and the
   entries they commit that are durable here are applied at once
   (``RawNode.take_durable_committed``). Under load an answer then waits
   for one group commit fewer: the one of the entries proposed after it.

Snapshots
---------
At start, a snapshot held by storage restores the state machine and the core
starts at its index (``applied = snapshot index``): nothing at or below it is
applied again. Every ``snapshot_every_entries`` applied entries, between
``advance()`` and the next ``ready()``, the loop snapshots the state machine,
saves and syncs it, and compacts the log as far as ``snapshot_taken`` allows
(keeping ``snapshot_trailing_entries``). A Ready carrying a snapshot from the
leader restores the state machine from it and resets the log
(``apply_snapshot``) in the same sync, before any message of that Ready
leaves. A SNAPSHOT message for a far-behind follower starts a chunked,
back-pressured stream of the stored snapshot to it
(:mod:`dledger.snapshot_stream`: one task per peer, go-back-N on loss, a
failed transfer is reported to the core after the next ``advance()``); the
receiving node reassembles it, checks its CRC and puts the complete SNAPSHOT
message into the inbox (past ``max_inbox_msgs``: dropping it would waste the
whole transfer). Stream frames carry their own magic and are told apart from
Raft messages before decoding; streams stop with leadership and at stop.

Proposal outcomes
-----------------
A proposal's future is keyed by its log index and remembers the term it was
proposed in. When that index is applied, the future gets ``(index, result)``
if the applied entry has that term, and :class:`ProposalDropped` if another
leader's entry took the slot. When this node stops being leader, every
pending proposal fails with :class:`OutcomeUnknown`: it may still commit
under the next leader, so the client must not treat it as failed.

Durability
----------
Entries, votes and term changes are synced before any message that depends
on them leaves (``Ready.must_sync``). A commit-index-only change of the hard
state is written with the next sync (or at a clean stop) but does not cost
an fsync of its own: a restarted node recomputes the commit index from its
peers and the core clamps a saved one to its durable log anyway. The
exception is a commit index that covers a membership change: it is synced
before the change is applied (``must_sync``), because a node that shrank the
configuration to itself has no peers left to learn it from.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dledger.config import NodeConfig
from dledger.core.codec import decode_message, encode_message
from dledger.core.raft import FAULT_LEASE_STALE_CLOCK, RawNode
from dledger.core.types import (
    EARLY_SEND_TYPES,
    MID_WRITE_TYPES,
    NONE,
    ClusterConfig,
    Compaction,
    ConfChange,
    ConfChangeType,
    Entry,
    EntryType,
    Message,
    MsgType,
    ReadMode,
    Ready,
    Role,
    Snapshot,
    SoftState,
)
from dledger.errors import (
    CodecError,
    ConfigError,
    DLedgerError,
    NotLeader,
    Overloaded,
    ProposalDropped,
    StorageCorrupted,
    StorageFailed,
    TransferInProgress,
)
from dledger.metrics import Histogram
from dledger.runtime import NodeEnv, NodeStorage, NodeTransport
from dledger.snapshot_stream import SnapshotStreams, StreamSettings, is_stream_frame
from dledger.statemachine import (
    DurableStateMachine,
    LogStateMachine,
    SnapshotError,
    StateMachine,
)

logger = logging.getLogger(__name__)

Consistency = Literal["committed", "linearizable"]

# Catch-up ticks beyond this many election timeouts have no further effect:
# the lease has expired and every timer has fired at least once.
_MAX_CATCH_UP_ELECTIONS = 4
# Loop turns a leader gives the transport after a stall before it ticks: the
# socket's callback, the connection's reader task, the delivery to the inbox.
_READ_TURNS_AFTER_STALL = 3
# Loop turns a node gives the transport after releasing held inbound
# sessions (hold_inbound) before it steps its inbox: the resumed sockets are
# read by callbacks of the next turn, queued behind this task's own wake-up.
_READ_TURNS_AFTER_HOLD = 2
_STOP_TIMEOUT_S = 10.0
# Log entries deleted per compaction step (one small write transaction each,
# between Readies), so compacting behind a snapshot never stalls the loop:
# at most this many entries and this many bytes of log (deleting costs about
# 0.5 ms per MiB of large entries here: 4,096 batched entries of 14 KB took
# 30 ms, a produce p99 of its own when retention let the log go).
_COMPACT_STEP = 4096
_COMPACT_STEP_BYTES = 4 << 20
# Queued operations (proposals, reads, admin) taken into the core per pass.
_OPS_PER_PASS = 1024
# A pass takes Readies while there are any, for at most this share of the
# election timeout; then it ends (snapshot, checkpoint and flush housekeeping
# run) and the next pass starts at once. Under steady load one pass would
# otherwise chain Readies for as long as answers bring new requests.
_PASS_BUDGET_SHARE = 1 / 16
# A state machine that lives in the storage (DurableStateMachine) is
# checkpointed into the next group commit this often (and at stop), so a
# restart replays at most about this much of the log.
_CHECKPOINT_INTERVAL_S = 1.0
_CHECKPOINT_ENTRIES = 20_000
# On a storage that catches up from a write-ahead log, a due checkpoint
# waits (at most this long after the last one) for the catch-up that
# commits LMDB anyway, after a group commit's answers: staged at once, its
# rows turned the next group commit into an LMDB commit (5-8 ms on every
# node once a second, the produce tail under light load: issue 17's note).
_CHECKPOINT_DEFER_S = 2 * _CHECKPOINT_INTERVAL_S
_PENDING_SNAPSHOT_CHECK_S = 0.1

# Node-level planted bug (simulator checker self-test; set through
# RaftConfig.faults / NodeConfig.faults, never in production): a lease read is
# decided against the tick count of the pass's start, and a stalled pass does
# not suspend the lease.
NODE_FAULTS = frozenset({FAULT_LEASE_STALE_CLOCK})


class OutcomeUnknown(DLedgerError):
    """The proposal reached the log but this node lost leadership (or stopped)
    before it committed: it may or may not commit. Retrying may duplicate it."""

    code = "OUTCOME_UNKNOWN"


class NodeStopped(DLedgerError):
    """The node is not running (not started, stopping, or failed)."""

    code = "NODE_STOPPED"


class EntryTooLarge(DLedgerError):
    code = "ENTRY_TOO_LARGE"


class TransferFailed(DLedgerError):
    """A leadership transfer was refused or did not complete in time."""

    code = "TRANSFER_FAILED"


class UnknownMember(ConfigError):
    """The node id is not in the cluster file, so nobody knows its address."""

    code = "UNKNOWN_MEMBER"


@dataclass(frozen=True, slots=True)
class Applied:
    """A proposal that committed and was applied: its slot and the state
    machine's answer."""

    index: int
    term: int
    result: object


@dataclass(frozen=True, slots=True)
class ReadResult:
    """State applied up to ``index`` may be read. ``mode``: ``lease`` or
    ``read_index`` (linearizable, on the leader) or ``local`` (committed)."""

    index: int
    applied: int
    mode: str


@dataclass(slots=True)
class _Pending:
    term: int
    future: asyncio.Future[Any]
    conf: bool


# How often a quiet node (nothing due) still looks at a waiting snapshot or
# an unwritten checkpoint.
_QUIET_HOUSEKEEPING_S = 1.0


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _resolve(fut: asyncio.Future[Any], value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class Node:
    """One node: storage, transport and the Raft loop. See the module docstring."""

    def __init__(
        self,
        cfg: NodeConfig,
        state_machine: StateMachine | None = None,
        env: NodeEnv | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        # Clock, worker threads, randomness, storage, transport and the work
        # hook (dledger/runtime.py): production defaults, or the simulator's.
        self.env = env if env is not None else NodeEnv()
        self._clock = self.env.clock
        self._work = self.env.work
        self._faults = cfg.raft_config().faults
        self.state_machine: StateMachine = (
            state_machine if state_machine is not None else LogStateMachine()
        )
        self._storage: NodeStorage | None = None
        self._raft: RawNode | None = None
        self._transport: NodeTransport | None = None
        self._task: asyncio.Task[None] | None = None
        self._release: Callable[[], None] | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # replaced on every soft-state change
        self._inbox: deque[Message] = deque()
        self._ops: deque[tuple[asyncio.Future[Any], Callable[[], None]]] = deque()
        self._queued_proposals = 0
        self._pending: dict[int, _Pending] = {}
        self._reads: dict[int, asyncio.Future[ReadResult]] = {}
        self._parked_reads: list[tuple[int, int, str, asyncio.Future[ReadResult]]] = []
        self._read_ctx = 0
        self._role = Role.FOLLOWER
        self._leader = NONE
        self._campaign_term = 0  # last term this node campaigned in (counts elections)
        self.applied = 0
        self._running = False
        self._stopping = False
        self.fatal: BaseException | None = None
        self.failed = asyncio.Event()  # set when the loop died on an error
        self._t0 = 0.0
        self._ticks = 0
        self._last_flush_s = 0.0
        self._peer_ids: tuple[int, ...] = ()
        self._started_at = 0.0
        self.counters: dict[str, int] = {
            "ticks_skipped": 0,
            "lease_suspended": 0,
            "stalled_leader_reads_first": 0,  # a stalled leader stepped its inbox before ticking
            "lease_reads_direct": 0,  # linearizable reads the lease answered without a loop turn
            "slow_passes": 0,
            "decode_errors": 0,
            "misaddressed": 0,
            "inbox_dropped": 0,
            "send_refused": 0,
            "readies": 0,
            "syncs": 0,
            "inline_syncs": 0,
            "deferred_catch_ups": 0,  # LMDB catch-ups after a Ready's answers (_catch_up)
            "early_applies": 0,
            "mid_write_applies": 0,
            "synced_entries": 0,
            "applied_entries": 0,
            "proposals_ok": 0,
            "proposals_unknown": 0,
            "proposals_dropped": 0,
            "leader_changes": 0,
            "elections": 0,  # terms this node campaigned in (pre-votes excluded)
            "snapshots_taken": 0,
            "snapshots_installed": 0,
            "snapshots_sent": 0,
            "snapshots_send_failed": 0,
            "checkpoints": 0,
            "checkpoints_discarded": 0,
        }
        # The latest durable snapshot (payload included, for sending), its
        # index at start, and snapshot sends to report as failed after advance().
        self._snap: Snapshot | None = None
        self.restored_from_snapshot = 0
        # A durable state machine: the applied index of the checkpoint it
        # came back from at start (0: none), of the last one staged, when,
        # and the storage's number for it (None once durable).
        sm = self.state_machine
        self._durable_sm: DurableStateMachine | None = (
            sm if isinstance(sm, DurableStateMachine) and sm.durable else None
        )
        self.restored_from_checkpoint = 0
        self._ckpt_applied = 0
        self._ckpt_at_s = 0.0
        self._ckpt_seq: int | None = None
        # A durable state machine's snapshot built but not yet handed to the
        # core (see _snapshot_housekeeping), and when that was last checked.
        self._pending_snap: tuple[Snapshot, str] | None = None
        self._pending_checked_s = 0.0
        self._floor_checked_s = 0.0
        # Snapshot streams that ended, reported to the core after advance():
        # (peer, delivered).
        self._snap_reports: list[tuple[int, bool]] = []
        self._streams = SnapshotStreams(
            cfg.node_id,
            StreamSettings(
                chunk_bytes=cfg.snapshot_chunk_bytes,
                window_chunks=cfg.snapshot_window_chunks,
                max_snapshot_bytes=cfg.snapshot_max_bytes,
                timeout_s=cfg.snapshot_stream_timeout_ms / 1000,
            ),
            send=self._send_frame,
            deliver=self._deliver_snapshot,
            failed=self._stream_failed,
            sent=self._stream_sent,
            counters=self.counters,
            clock=self._clock,
            offload=self.env.offload,
        )
        # A local snapshot in the making: built and written by a background
        # task (off the loop), recorded by the loop; then the log is compacted
        # behind it a bounded step per loop pass.
        self._snap_task: asyncio.Task[tuple[Snapshot, str]] | None = None
        self._compact_to: Compaction | None = None
        self._sync_s_total = 0.0
        self._sync_s_max = 0.0
        self._loop_lag_s_max = 0.0
        # CPU time of the loop thread from the end of one pass to the end of
        # the next (what ran in between, HTTP handlers included, plus the
        # pass): unlike the lag, it does not grow when the machine is
        # loaded, so it tells a request that hogs the loop from a busy host.
        # A metric only; nothing decides on it.
        self._cpu_mark = self.env.cpu_clock()
        self._loop_cpu_s_max = 0.0
        # The last pass stopped at its budget with Readies left: no waiting.
        self._pass_cut = False
        # Per pass: how late it started (vs. the tick it was due for) plus how
        # long it ran; a long one means ticks, heartbeats and lease checks
        # waited that long.
        self.loop_lag_seconds = Histogram()
        self._last_catch_up_s = 0.0
        self._planned_wake_s = 0.0  # when the loop last meant to wake up
        # A stall between two tick catch-ups longer than the lease's safety
        # margin (RaftConfig.lease_margin_ticks: what is left of the
        # stickiness window after the lease and clock drift) drops the lease
        # (r.suspend_lease): a heartbeat round made before the stall may have
        # left only after it.
        self._lease_margin_s = cfg.raft_config().lease_margin_ticks() * cfg.tick_ms / 1000
        self._pass_msgs = self._pass_ops = self._pass_persisted = self._pass_applied = 0

    # ======================================================================
    # lifecycle
    # ======================================================================
    async def start(self) -> None:
        """Open storage (raises StorageCorrupted on a damaged log), build the
        Raft core, start the transport and the loop."""
        if self._running or self._stopping:
            raise RuntimeError("a Node can be started once")
        cfg = self.cfg
        env = self.env
        storage, self._release = env.open_storage(cfg)
        started = False
        try:
            snap = storage.snapshot()
            applied = self._load_checkpoint(storage, snap)
            if applied is not None:
                # The state machine came back from its own checkpoint in the
                # storage: the core replays only what follows it.
                self.applied = self.restored_from_checkpoint = applied
                self._snap = snap
            elif snap is not None:
                # The state machine comes back from the snapshot; the core
                # replays only what follows it.
                self.state_machine.restore(snap.data)
                self.applied = self.restored_from_snapshot = snap.meta.index
                self._snap = snap
            else:
                applied = 0
            self._ckpt_applied = self.applied
            raft = RawNode(
                cfg.raft_config(),
                storage,
                storage,
                env.rng,
                applied=self.applied,
                snapshot=snap.meta if snap is not None else None,
            )
            transport = env.make_transport(
                cfg.node_id,
                cfg.cluster_id,
                cfg.raft_host,
                cfg.raft_port,
                self._addresses(raft.config),
                cfg.secret_bytes,
                self._on_message,
            )
            await transport.start()
            started = True
        finally:
            if not started:
                storage.close()
                self._unlock()
        self._storage, self._raft, self._transport = storage, raft, transport
        self._peer_ids = tuple(sorted(set(raft.config.members()) - {cfg.node_id}))
        hs = storage.hard_state()
        logger.info(
            "node %d: opened %s (entries %d..%d, term %d, vote %d, commit %d, flush=%s, "
            "restored from snapshot at index %d, from checkpoint at index %d)",
            cfg.node_id,
            cfg.data_dir,
            storage.first_index(),
            storage.last_index(),
            hs.term,
            hs.vote,
            hs.commit,
            cfg.flush,
            self.restored_from_snapshot,
            self.restored_from_checkpoint,
        )
        self._t0 = self._started_at = self._last_flush_s = self._clock()
        self._last_catch_up_s = self._t0
        self._running = True
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"dledger-node-{cfg.node_id}"
        )

    def _load_checkpoint(self, storage: NodeStorage, snap: Snapshot | None) -> int | None:
        """A durable state machine's last checkpoint, if it can be used: its
        applied index must lie between the snapshot's index and the durable
        commit index (it can only be behind the commit: it is written in a
        later transaction than the entries it applied). Anything else, a
        damaged checkpoint included, is discarded and the state rebuilt from
        the snapshot and the log, never served."""
        sm = self._durable_sm
        if sm is None:
            return None
        sm.attach_storage(storage)
        nid = self.cfg.node_id
        try:
            applied = sm.load_checkpoint()
        except SnapshotError as exc:
            logger.warning("node %d: the state checkpoint is damaged (%s): rebuilding", nid, exc)
            applied = None
            self.counters["checkpoints_discarded"] += 1
        else:
            lo = snap.meta.index if snap is not None else 0
            hi = min(storage.hard_state().commit, storage.last_index())
            if applied is not None and not lo <= applied <= hi:
                logger.warning(
                    "node %d: the state checkpoint at %d is outside [%d, %d]: rebuilding",
                    nid,
                    applied,
                    lo,
                    hi,
                )
                applied = None
                self.counters["checkpoints_discarded"] += 1
        if applied is None:
            sm.discard_checkpoint()  # whatever a crash mid-rebuild left
            return None
        return applied

    def _floor(self, r: RawNode) -> int:
        """The lowest log index a durable state machine still reads from
        (past the applied index when it reads none)."""
        sm = self._durable_sm
        assert sm is not None
        floor = sm.compact_floor()
        return floor if floor is not None else r.log.applied + 1

    def _maybe_checkpoint(self, catch_up: bool = False) -> None:
        """Stage a checkpoint of a durable state machine once enough was
        applied or enough time passed: into the LMDB catch-up about to run
        (``catch_up``); not yet (up to ``_CHECKPOINT_DEFER_S`` after the
        last) on a storage that catches up from a write-ahead log
        (``catches_up``: one will come with activity); else into the next
        group commit (a quiet node's housekeeping writes it at once)."""
        sm = self._durable_sm
        if sm is None:
            return
        if self._ckpt_seq is not None and sm.checkpoint_durable(self._ckpt_seq):
            self._ckpt_seq = None
        if self.applied == self._ckpt_applied:
            return
        now = self._clock()
        since = now - self._ckpt_at_s
        if (
            self.applied - self._ckpt_applied < _CHECKPOINT_ENTRIES
            and since < _CHECKPOINT_INTERVAL_S
        ):
            return
        st = self._storage
        if not catch_up and since < _CHECKPOINT_DEFER_S and st is not None and st.catches_up():
            return
        self._stage_checkpoint(now)

    def _stage_checkpoint(self, now: float) -> None:
        sm = self._durable_sm
        assert sm is not None
        self._ckpt_seq = sm.checkpoint()
        self._ckpt_applied = self.applied
        self._ckpt_at_s = now
        self.counters["checkpoints"] += 1

    async def stop(self) -> None:
        """Finish the current Ready, fail what is pending, close everything.

        Pending proposals fail with OutcomeUnknown (they may commit on the
        others); queued ops that never reached the log fail with NodeStopped."""
        if not self._running or self._stopping:
            return
        self._stopping = True
        self._wake.set()
        clean = True
        if self._snap_task is not None:
            # Its thread writes only its own file; let it finish so no file
            # is written after the store closes.
            await asyncio.wait({self._snap_task}, timeout=_STOP_TIMEOUT_S)
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=_STOP_TIMEOUT_S)
            if not done:
                # Stuck in a storage sync: do not close storage under a
                # running thread; the process exit releases it.
                logger.error("node %d: the loop did not stop in time", self.cfg.node_id)
                self._task.cancel()
                clean = False
        self._fail_all(OutcomeUnknown("the node stopped before the proposal committed"))
        await self._streams.close()
        if self._transport is not None:
            await self._transport.stop()
        if self._storage is not None and clean:
            if self.fatal is None:
                with contextlib.suppress(DLedgerError):
                    if self._durable_sm is not None and self.applied != self._ckpt_applied:
                        self._stage_checkpoint(self._clock())  # a clean restart replays nothing
                    self._storage.sync()  # a commit-index-only hard state, if any
            self._storage.close()
            self._unlock()
        self._running = False
        logger.info("node %d: stopped", self.cfg.node_id)

    @property
    def running(self) -> bool:
        return self._running and not self._stopping and self.fatal is None

    def _unlock(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()  # production: closing the lock descriptor releases the flock

    def fail_stop(self, exc: StorageCorrupted) -> None:
        """Stop on damage found outside the loop: a read met a record of this
        replica's store that fails its checks (the loop's own reads stop it
        the same way). From now on nothing is served; the loop ends at its
        next pass through the same path as a damaged record it read itself,
        so the process exits 2 and the replica is rebuilt from a healthy
        peer. A replica that knows part of its log is unreadable must not go
        on voting, leading or serving the rest as if whole."""
        if self.fatal is not None or not self._running or self._stopping:
            return
        self.fatal = exc
        self._wake.set()

    def _r(self) -> RawNode:
        if self._raft is None or not self.running:
            raise NodeStopped(f"node {self.cfg.node_id} is not running")
        return self._raft

    # ======================================================================
    # public API
    # ======================================================================
    async def propose(self, data: bytes) -> tuple[int, object]:
        """Replicate ``data``; returns ``(index, result of apply)`` once applied here.

        Raises NotLeader(leader_hint), Overloaded, TransferInProgress,
        EntryTooLarge, ProposalDropped, or OutcomeUnknown (see module doc)."""
        a = await self.propose_entry(data)
        return a.index, a.result

    async def propose_entry(self, data: bytes) -> Applied:
        """:meth:`propose`, also returning the term the entry committed in."""
        return await self.submit(data)

    def submit(self, data: bytes) -> asyncio.Future[Applied]:
        """Start a proposal without awaiting it: the future resolves as
        :meth:`propose_entry` returns (pipelining callers use callbacks).
        Raises at once when the proposal cannot even be queued."""
        if len(data) > self.cfg.max_entry_bytes:
            raise EntryTooLarge(
                f"entry of {len(data)} bytes exceeds max_entry_bytes={self.cfg.max_entry_bytes}"
            )
        r = self._r()
        if r.role is not Role.LEADER:
            raise NotLeader(r.lead)
        if r.transferee != NONE:
            raise TransferInProgress(f"leadership is being transferred to node {r.transferee}")
        if self._queued_proposals + len(self._pending) >= self.cfg.max_inflight_proposals:
            raise Overloaded(
                f"{self.cfg.max_inflight_proposals} proposals in flight (max_inflight_proposals)"
            )
        fut: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        self._queued_proposals += 1

        def op() -> None:
            self._queued_proposals -= 1
            if fut.done():
                return  # the caller gave up before it reached the log
            try:
                idx = r.propose(data)
            except DLedgerError as exc:
                fut.set_exception(exc)
                return
            self._pending[idx] = _Pending(r.term, fut, conf=False)

        self._enqueue(fut, op)
        return fut

    async def read(self, consistency: Consistency = "linearizable") -> ReadResult:
        """A read barrier: once it returns, the local state machine reflects
        every write acknowledged before the call (``linearizable``, leader
        only: lease or ReadIndex) or at least everything this node applied
        (``committed``, any node, never beyond the commit index)."""
        if consistency == "committed":
            self._r()
            return ReadResult(self.applied, self.applied, "local")
        if consistency != "linearizable":
            raise ConfigError(
                f"consistency must be 'committed' or 'linearizable', not {consistency!r}"
            )
        r = self._r()
        if r.role is not Role.LEADER:
            raise NotLeader(r.lead)
        index = self._lease_read_now(r)
        if index is not None and self.applied >= index:
            # The lease holds and the state is applied up to the commit
            # index: the answer the loop would give, without a loop turn.
            self.counters["lease_reads_direct"] += 1
            return ReadResult(index, self.applied, "lease")
        fut: asyncio.Future[ReadResult] = asyncio.get_running_loop().create_future()

        def op() -> None:
            if fut.done():
                return
            self._read_ctx += 1
            ctx = self._read_ctx
            self._reads[ctx] = fut
            if FAULT_LEASE_STALE_CLOCK not in self._faults:
                # A lease read is decided against the clock as it is now, not
                # as it was when this pass began (it may have stalled since).
                self._catch_up_ticks(r)
            try:
                r.read_index(ctx)
            except DLedgerError as exc:
                del self._reads[ctx]
                fut.set_exception(exc)

        self._enqueue(fut, op)
        return await fut

    def _lease_read_now(self, r: RawNode) -> int | None:
        """The commit index when the lease holds by the clock as it is now
        (RawNode.lease_read_index), else None. None too when the ticks stood
        still beyond the lease's safety margin (the process was paused, a
        pass is blocked): the loop's next pass must see that stall first and
        suspend the lease (_catch_up_ticks), so the read goes through it."""
        if FAULT_LEASE_STALE_CLOCK in self._faults:
            return None  # the planted bug lives in the loop's path
        now = self._clock()
        if self._stall_s(now) > self._lease_margin_s:
            return None
        return r.lease_read_index(self._tick_at(now) - self._ticks)

    def _stall_s(self, now: float) -> float:
        """How long the ticks stood still beyond what the loop chose to sleep."""
        return now - max(self._last_catch_up_s + self.cfg.tick_ms / 1000, self._planned_wake_s)

    def _tick_at(self, now: float) -> int:
        """The tick due at clock time ``now``."""
        return int((now - self._t0) * 1000 // self.cfg.tick_ms)

    async def transfer_leadership(self, to: int, timeout_s: float | None = None) -> None:
        """Hand leadership to voter ``to`` and wait until it leads.

        Raises NotLeader, TransferFailed (refused: not a voter, not caught
        up; or not done within ``timeout_s``, default two election timeouts)."""
        r = self._r()
        if r.role is not Role.LEADER:
            raise NotLeader(r.lead)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def op() -> None:
            if fut.done():
                return
            try:
                r.transfer_leadership(to)
            except NotLeader as exc:
                fut.set_exception(exc)
            except DLedgerError as exc:
                fut.set_exception(TransferFailed(str(exc)))
            else:
                fut.set_result(None)

        self._enqueue(fut, op)
        await fut
        limit = timeout_s if timeout_s is not None else 2 * self.cfg.election_timeout_ms / 1000
        if not await self._wait_changed(lambda: self._leader == to, limit):
            raise TransferFailed(
                f"node {to} did not take over within {limit:.3f}s (leader: {self._leader or 'none'})"
            )

    async def add_learner(self, node_id: int) -> ClusterConfig:
        return await self._conf_change(ConfChange(ConfChangeType.ADD_LEARNER, node_id))

    async def promote(self, node_id: int) -> ClusterConfig:
        return await self._conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, node_id))

    async def remove(self, node_id: int) -> ClusterConfig:
        return await self._conf_change(ConfChange(ConfChangeType.REMOVE_NODE, node_id))

    async def _conf_change(self, cc: ConfChange) -> ClusterConfig:
        if cc.type is not ConfChangeType.REMOVE_NODE and self.cfg.member(cc.node_id) is None:
            raise UnknownMember(
                f"node {cc.node_id} is not in the cluster file; add it there (on every "
                "node) first so its address is known"
            )
        r = self._r()
        if r.role is not Role.LEADER:
            raise NotLeader(r.lead)
        fut: asyncio.Future[ClusterConfig] = asyncio.get_running_loop().create_future()

        def op() -> None:
            if fut.done():
                return
            try:
                idx = r.propose_conf_change(cc)
            except DLedgerError as exc:
                fut.set_exception(exc)
                return
            self._pending[idx] = _Pending(r.term, fut, conf=True)

        self._enqueue(fut, op)
        return await fut

    # -- introspection -------------------------------------------------------
    @property
    def role(self) -> Role:
        return self._role

    @property
    def leader(self) -> int:
        return self._leader

    @property
    def fsync_seconds(self) -> Histogram | None:
        """The storage's fsync-duration histogram (None before start)."""
        return self._storage.fsync_seconds if self._storage is not None else None

    def http_address_of(self, node_id: int) -> str | None:
        m = self.cfg.member(node_id)
        return m.http_address if m is not None else None

    def status(self) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {
            "id": cfg.node_id,
            "cluster_id": cfg.cluster_id,
            "running": self.running,
            "pid": os.getpid(),
            "uptime_s": round(self._clock() - self._started_at, 3) if self._started_at else 0,
        }
        if self.fatal is not None:
            out["fatal"] = f"{type(self.fatal).__name__}: {self.fatal}"
        r = self._raft
        if r is None:
            return out
        st = r.status()
        last = st.last_index
        peers: dict[str, Any] = {}
        for pid in sorted(set(st.peers) | set(self._peer_ids)):
            if pid == cfg.node_id:
                continue
            entry: dict[str, Any] = {}
            m = cfg.member(pid)
            if m is not None:
                entry["raft"] = m.raft_address
                entry["http"] = m.http_address
            pr = st.peers.get(pid)
            if pr is not None:
                entry.update(
                    match=pr.match,
                    next=pr.next,
                    lag=max(0, last - pr.match),
                    state=pr.state.lower(),
                    learner=pr.learner,
                    recent_active=pr.recent_active,
                )
            if self._transport is not None:
                ps = self._transport.peer_status(pid)
                if ps is not None:
                    entry["outbound_connected"] = ps.outbound_connected
                    entry["inbound_connected"] = ps.inbound_connected
                    entry["queued_frames"] = ps.queued_frames
            peers[str(pid)] = entry
        storage = self._storage
        out.update(
            role=st.role.name.lower(),
            term=st.term,
            leader=st.leader,
            leader_http=self.http_address_of(st.leader) if st.leader else None,
            leader_ready=st.role is Role.LEADER and self._committed_in_term(r),
            vote=st.vote,
            commit=st.commit,
            applied=self.applied,
            last_index=last,
            lease_remaining_ms=st.lease_remaining_ticks * cfg.tick_ms,
            transferee=st.transferee,
            config={"voters": list(st.config.voters), "learners": list(st.config.learners)},
            peers=peers,
            transport=self._transport.stats if self._transport is not None else {},
            epochs={str(t): pos for t, pos in storage.epoch_map().items()} if storage else {},
            storage={
                "data_dir": cfg.data_dir,
                "flush": cfg.flush,
                "first_index": storage.first_index() if storage else 0,
                "write_txns": storage.write_txns if storage else 0,
                # LmdbStorage's write-ahead log (sync mode): how many of those
                # were LMDB commits, the log's size now, and how many records
                # the start replayed from it
                "lmdb_commits": getattr(storage, "lmdb_commits", 0),
                "wal_bytes": getattr(storage, "wal_bytes", 0),
                "wal_replayed": getattr(storage, "wal_replayed", 0),
                "flushes": storage.flushes if storage else 0,
                "map_growths": storage.map_growths if storage else 0,
            },
            snapshot={
                "index": self._snap.meta.index if self._snap is not None else 0,
                "term": self._snap.meta.term if self._snap is not None else 0,
                "bytes": len(self._snap.data) if self._snap is not None else 0,
                "restored_from": self.restored_from_snapshot,
                # a state machine kept in the storage: the checkpoint it came
                # back from at start (0: none; it came from the snapshot)
                "restored_from_checkpoint": self.restored_from_checkpoint,
                # a snapshot built and waiting for retention to drop every
                # record in the entries it covers (0: none waiting)
                "pending_index": (
                    self._pending_snap[0].meta.index if self._pending_snap is not None else 0
                ),
                "every_entries": cfg.snapshot_every_entries,
                "trailing_entries": cfg.snapshot_trailing_entries,
                "taken": self.counters["snapshots_taken"],
                "installed": self.counters["snapshots_installed"],
                "sent": self.counters["snapshots_sent"],
                "send_failed": self.counters["snapshots_send_failed"],
                "received": self.counters["snapshots_received"],
                "stream": self._streams.status(),
            },
            node={
                **self.counters,
                "ticks": self._ticks,
                "inflight_proposals": self._queued_proposals + len(self._pending),
                "pending_reads": len(self._reads) + len(self._parked_reads),
                "inbox": len(self._inbox),
                "sync_ms_total": round(self._sync_s_total * 1000, 3),
                "sync_ms_max": round(self._sync_s_max * 1000, 3),
                "loop_lag_ms_max": round(self._loop_lag_s_max * 1000, 3),
                "loop_cpu_ms_max": round(self._loop_cpu_s_max * 1000, 3),
            },
            settings={
                "tick_ms": cfg.tick_ms,
                "election_ticks": cfg.election_ticks,
                "heartbeat_ticks": cfg.heartbeat_ticks,
                "lease_drift_ticks": cfg.lease_drift_ticks,
                "flush": cfg.flush,
                "flush_interval_ms": cfg.flush_interval_ms,
                "max_inflight_proposals": cfg.max_inflight_proposals,
                "max_entry_bytes": cfg.max_entry_bytes,
            },
        )
        return out

    def leader_ready(self) -> bool:
        """Leader that has committed and applied an entry of its own term (its
        no-op), so its applied state includes every earlier committed entry."""
        r = self._raft
        if r is None or not self.running or r.role is not Role.LEADER:
            return False
        try:
            return r.log.term(self.applied) == r.term
        except DLedgerError:
            return False

    @staticmethod
    def _committed_in_term(r: RawNode) -> bool:
        try:
            return r.log.term(r.log.committed) == r.term
        except DLedgerError:
            return False

    # ======================================================================
    # inputs (called on the loop thread from outside the loop task)
    # ======================================================================
    def _on_message(self, peer_id: int, payload: bytes) -> None:
        if is_stream_frame(payload):
            self._streams.on_frame(peer_id, payload)
            return
        try:
            m = decode_message(payload)
        except CodecError as exc:
            self.counters["decode_errors"] += 1
            logger.warning(
                "node %d: undecodable message from %d: %s", self.cfg.node_id, peer_id, exc
            )
            return
        if m.frm != peer_id or m.to != self.cfg.node_id:
            # The transport authenticated peer_id's connection; a message
            # claiming another sender or receiver is not ours to step.
            self.counters["misaddressed"] += 1
            return
        if len(self._inbox) >= self.cfg.max_inbox_msgs:
            self.counters["inbox_dropped"] += 1  # Raft retries; memory stays bounded
            return
        self._inbox.append(m)
        if self._quiet_input(m):
            return
        self._wake.set()

    def _quiet_input(self, m: Message) -> bool:
        """Whether ``m`` may wait in the inbox for the loop's next wake-up
        instead of causing one: a same-term HEARTBEAT_RESP to a leader with
        no read waiting for a heartbeat round. The leader's next heartbeat
        is at most ``heartbeat_ticks`` away and the loop steps the inbox, in
        order, before anything else on that wake-up; the lease it renews
        counts from the round's send time, not from when the answer is
        stepped, so one round late it still never lapses (rounds every 100
        ms, lease 240 ms). An idle leader then runs one loop pass per
        heartbeat round instead of one per round and per follower (issue 17:
        idle CPU). ReadIndex and leadership transfer still step answers at
        once."""
        r = self._raft
        return (
            m.type is MsgType.HEARTBEAT_RESP
            and r is not None
            and r.role is Role.LEADER
            and m.term == r.term
            and not self._reads
            and r.transferee == NONE
        )

    def _send_frame(self, to: int, payload: bytes) -> bool:
        tr = self._transport
        return tr is not None and self.running and tr.send(to, payload)

    def _deliver_snapshot(self, m: Message) -> None:
        """A reassembled SNAPSHOT message: stepped like any other, but never
        dropped for a full inbox (it is one message that cost a transfer)."""
        if not self.running:
            return
        self._inbox.append(m)
        self._wake.set()

    def _stream_failed(self, to: int) -> None:
        self._snap_reports.append((to, False))  # report_snapshot after advance()
        self._wake.set()

    def _stream_sent(self, to: int) -> None:
        self._snap_reports.append((to, True))
        self._wake.set()

    def _enqueue(self, fut: asyncio.Future[Any], op: Callable[[], None]) -> None:
        self._ops.append((fut, op))
        self._wake.set()

    # ======================================================================
    # the loop
    # ======================================================================
    async def _run(self) -> None:
        r = self._raft
        assert r is not None
        budget_s = self.cfg.election_timeout_ms / 1000 * _PASS_BUDGET_SHARE
        try:
            while not self._stopping:
                await self._wait_for_work()
                if self.fatal is not None:
                    raise self.fatal  # fail_stop(): damage a read found
                start = self._clock()
                due = self._due_s()
                self._pass_msgs = self._pass_ops = self._pass_persisted = self._pass_applied = 0
                await self._time_and_inputs(r)
                more = r.has_ready()
                while more:
                    rd = r.ready()
                    # Replication leaves while our own fsync runs (EARLY_SEND_TYPES):
                    # one fsync less on the commit path; votes and acks still wait.
                    # A Ready installing a snapshot sends nothing before its sync.
                    # A Ready with no entries of its own (a leader's commit
                    # moving) has no fsync to overlap: it applies first, so the
                    # answers it resolves are written before the commit-only
                    # appends (the transport writes those at the end of the
                    # turn, after the handlers woken first) wake the followers.
                    if rd.snapshot is None and rd.entries:
                        self._send(rd, early=True)
                    early = self._apply_early(rd, r)
                    if rd.snapshot is None and not rd.entries:
                        self._send(rd, early=True)
                    turned = await self._persist(rd, r if early else None)
                    if rd.snapshot is not None:
                        self._send(rd, early=True)
                    self._send(rd, early=False)
                    self._send_snapshots(rd)
                    conf_applied = self._apply(rd, entries=not early)
                    r.advance(rd)
                    self._after_advance(r, rd, conf_applied)
                    # Asked before a checkpoint is staged (its rows make the
                    # storage say no): a due one then rides this catch-up.
                    catch_up = self._storage is not None and self._storage.catch_up_due()
                    self._maybe_checkpoint(catch_up)
                    if catch_up:
                        await self._catch_up(r, rd)  # after the Ready's answers
                    if rd.snapshot is not None:
                        self._update_peers(r)
                    for to, ok in self._snap_reports:
                        r.report_snapshot(to, ok)
                    self._snap_reports.clear()
                    self._maybe_start_snapshot(r)
                    # Time passed during the fsync: tick, then take what
                    # queued meanwhile, so the next Ready batches it.
                    await self._time_and_inputs(r)
                    # Asked once per Ready: nothing that runs during the
                    # sleep below touches the core (inputs wait in the inbox
                    # for _step_inputs), so the answer cannot change there.
                    more = r.has_ready()
                    if not more:
                        break  # no turn of the loop to give up: the pass ends here
                    if not turned:
                        # Give the loop a turn between Readies. A Ready whose
                        # write ran in a thread gave it turns already: the
                        # next Ready (typically the commit its acknowledgements
                        # moved, which answers the writes) follows at once.
                        await asyncio.sleep(0)
                    if self._clock() - start > budget_s:
                        self._pass_cut = True  # the rest in the next pass, after housekeeping
                        break
                await self._snapshot_housekeeping(r)
                await self._checkpoint_housekeeping()
                await self._maybe_flush()
                self._end_pass(start, due)
        except Exception as exc:
            self.fatal = exc
            logger.critical(
                "node %d: stopping on %s: %s",
                self.cfg.node_id,
                type(exc).__name__ if not isinstance(exc, StorageFailed) else "DISK_FAILED",
                exc,
                exc_info=not isinstance(exc, DLedgerError),
            )
            self._fail_all(OutcomeUnknown(f"the node failed: {exc}"))
            self.failed.set()

    def _end_pass(self, start: float, due: float) -> None:
        """Loop lag of one pass: how late it began plus how long it ran."""
        ran = self._clock() - start
        lag = max(0.0, start - due) + ran
        self.loop_lag_seconds.observe(lag)
        self._loop_lag_s_max = max(self._loop_lag_s_max, lag)
        cpu = self.env.cpu_clock()
        self._loop_cpu_s_max = max(self._loop_cpu_s_max, cpu - self._cpu_mark)
        self._cpu_mark = cpu
        if ran * 4 > self.cfg.election_timeout_ms / 1000:
            self.counters["slow_passes"] += 1
            logger.warning(
                "node %d: a loop pass ran %.0f ms (over a quarter of the election timeout): "
                "%d messages stepped, %d ops, %d entries persisted, %d applied",
                self.cfg.node_id,
                ran * 1000,
                self._pass_msgs,
                self._pass_ops,
                self._pass_persisted,
                self._pass_applied,
            )

    async def _wait_for_work(self) -> None:
        if self._inbox or self._ops or self._stopping or self.fatal is not None:
            return
        if self._pass_cut:
            self._pass_cut = False
            return  # the last pass ran out of its budget with work left
        loop = asyncio.get_running_loop()
        due = self._due_s()
        st = self._storage
        if self.cfg.flush == "async" and st is not None and st.flush_pending():
            # the interval fsync runs between passes: never sleep through it
            # (with nothing to flush, nothing to wake for: an idle node)
            due = min(due, self._flush_due_s())
        if self._pending_snap is not None or self._ckpt_seq is not None:
            # a snapshot waiting for retention, a checkpoint not yet written:
            # a quiet node still gets to them, once a second
            due = min(due, self._clock() + _QUIET_HOUSEKEEPING_S)
        self._planned_wake_s = due
        delay = due - self._clock()
        if delay <= 0:
            return
        held = self._transport if self._may_hold() else None
        if held is not None:
            held.hold_inbound()
        self._wake.clear()
        handle = loop.call_later(delay, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            handle.cancel()
            if held is not None:
                held.release_inbound()
        if held is not None:
            for _ in range(_READ_TURNS_AFTER_HOLD):
                await asyncio.sleep(0)

    def _may_hold(self) -> bool:
        """Whether the sleep ahead may leave the peers' messages unread: an
        idle leader's (RawNode.idle_leader, no read or transfer waiting).
        What its followers send meanwhile is their answers to its last round,
        which would wait in the inbox for its next round anyway
        (_quiet_input); held in the sockets they cause no wake-up either (an
        idle leader woke about twice per round for them, issue 17). Anything
        else a peer sends waits at most until that round, which an idle
        cluster can afford; the first proposal or read wakes the loop, which
        reads everything before it steps anything."""
        r = self._raft
        return r is not None and not self._reads and r.transferee == NONE and r.idle_leader()

    def _due_s(self) -> float:
        """When the next tick that can change anything is due: an idle node
        sleeps until then (RawNode.ticks_until_due) instead of waking every
        tick, and ticks the ticks it slept through at once."""
        r = self._raft
        k = r.ticks_until_due() if r is not None else 1
        return self._t0 + (self._ticks + k) * self.cfg.tick_ms / 1000

    async def _time_and_inputs(self, r: RawNode) -> None:
        """The ticks due and the queued inputs, in the order that is honest
        for this node's role when the loop stood still for a while (a long
        pass, a collection, CPU starvation) and both piled up.

        A follower ticks first: a leader's message that waited in the inbox
        counts as heard now, so its election timer never runs out earlier
        than it would have in real time (the leader's lease relies on that).
        A leader steps first: the acknowledgements that waited are its
        followers' answers from during the stall, and ticking past a
        check-quorum boundary before seeing them would depose a leader that
        a quorum is following (a 300 ms stall, one election timeout, was
        enough). Its lease is suspended before anything is stepped, so no
        acknowledgement of a round sent before the stall renews it. After a
        stall inside the loop the answers may still be in the sockets (the
        transport reads them on the loop too): a stalled leader gives the
        loop a few turns first (socket callback, reader task, delivery)."""
        if r.role is Role.LEADER:
            if self._stall_s(self._clock()) > self._lease_margin_s:
                for _ in range(_READ_TURNS_AFTER_STALL):
                    await asyncio.sleep(0)
                self.counters["stalled_leader_reads_first"] += 1
            now = self._note_stall(r)
            self._step_inputs(r)
            self._tick_to(r, now)
        else:
            self._catch_up_ticks(r)
            self._step_inputs(r)

    def _catch_up_ticks(self, r: RawNode) -> None:
        self._tick_to(r, self._note_stall(r))

    def _note_stall(self, r: RawNode) -> float:
        """Suspend the lease if the ticks stood still beyond its safety
        margin; returns the time the ticks are then due for."""
        now = self._clock()
        stall = self._stall_s(now)
        self._last_catch_up_s = now
        if stall > self._lease_margin_s and FAULT_LEASE_STALE_CLOCK not in self._faults:
            # Ticks (so heartbeats and lease expiry) stood still for longer
            # than the lease's safety margin: a heartbeat round counted from
            # before the stall may have left only now, so its followers'
            # timers started late. No lease until a round sent from now on
            # is acknowledged (reads fall back to ReadIndex meanwhile).
            r.suspend_lease()
            self.counters["lease_suspended"] += 1
        return now

    def _tick_to(self, r: RawNode, now: float) -> None:
        due = self._tick_at(now)
        n = due - self._ticks
        if n <= 0:
            return
        cap = _MAX_CATCH_UP_ELECTIONS * self.cfg.election_ticks
        if n > cap:
            self.counters["ticks_skipped"] += n - cap
            logger.warning(
                "node %d: the loop stalled for %.0f ms; ticking %d of %d missed ticks",
                self.cfg.node_id,
                n * self.cfg.tick_ms,
                cap,
                n,
            )
            n = cap
        for _ in range(n):
            r.tick()
        self._ticks = due

    def _step_inputs(self, r: RawNode) -> None:
        inbox = self._inbox
        work = self._work
        while inbox:
            work("step", 1)
            self._pass_msgs += 1
            r.step(inbox.popleft())
        # Bounded work per pass: a burst of queued proposals becomes several
        # Readies of at most _OPS_PER_PASS each, with ticks and peer messages
        # handled between them, instead of one huge Ready that stalls the loop
        # past an election timeout (seen with 5000 x 1 KiB in flight, 5 voters).
        ops = self._ops
        for _ in range(min(len(ops), _OPS_PER_PASS)):
            work("op", 1)
            self._pass_ops += 1
            ops.popleft()[1]()

    async def _persist(self, rd: Ready, r: RawNode | None = None) -> bool:
        """Write ``rd``'s entries and state; returns whether the loop turned
        meanwhile (the write ran in a thread)."""
        st = self._storage
        assert st is not None
        self.counters["readies"] += 1
        if rd.snapshot is not None:
            if self._durable_sm is not None:
                # A big store is filled off the loop (reads of it answer
                # 503 meanwhile); the swap itself runs here.
                finish = await self.env.offload(self._durable_sm.prepare_restore, rd.snapshot.data)
                self._install_snapshot(st, rd.snapshot, finish)
            else:
                self._install_snapshot(st, rd.snapshot)
        if rd.entries:
            self._work("persist", len(rd.entries))
            self._pass_persisted += len(rd.entries)
            st.append(rd.entries)
        # In async mode a new term or vote is still fsynced at once, before
        # anything that depends on it leaves: the storage's sync() does it
        # (LmdbStorage, SimStorage), so a node never votes twice in a term.
        if rd.hard_state is not None:
            st.save_hard_state(rd.hard_state)
        if not rd.must_sync:
            return False
        t = self._clock()
        inline = self._sync_inline(rd)
        if inline:
            st.sync(catch_up=False)
            await self._maybe_flush()
            self.counters["inline_syncs"] += 1
        elif r is not None:
            await self._write_and_apply(st, r, rd)
        else:
            await self.env.offload(self._sync_blocking, st)
        dt = self._clock() - t
        self._sync_s_total += dt
        self._sync_s_max = max(self._sync_s_max, dt)
        self.counters["syncs"] += 1
        self.counters["synced_entries"] += len(rd.entries)
        return not inline

    async def _write_and_apply(
        self,
        st: NodeStorage,
        r: RawNode,
        rd: Ready,
        job: Callable[[], None] | None = None,
    ) -> None:
        """A leader's group commit, with acknowledgements taken in meanwhile.

        While the write runs in its thread, same-term APP_RESP and
        HEARTBEAT_RESP messages at the head of the inbox are stepped (the
        only input the core takes between ``ready()`` and ``advance()``,
        ``MID_WRITE_TYPES``), and the entries they commit that earlier
        Readies made durable here are applied and answered at once
        (``take_durable_committed``): an answer no longer waits for the
        group commit of the entries proposed after it. ``rd``'s own
        committed entries were applied before the write (``_apply_early``),
        so the order of application holds. ``job``: what runs in the thread
        instead of the Ready's write (``_catch_up``, after ``advance``)."""
        outcome: list[BaseException | None] = []

        def written(exc: BaseException | None) -> None:
            outcome.append(exc)
            self._wake.set()

        # Started here, before the loop turns: the fsync runs while this
        # turn's appends are written to the followers (the transport
        # writes them after this task yields), not after them.
        self.env.submit(job or functools.partial(self._sync_blocking, st), written)
        inbox = self._inbox
        max_bytes = self.cfg.max_apply_bytes
        # After advance (a catch-up), what advance itself committed (our own
        # copy counting now) is answered at once, before any new message.
        look = job is not None
        while True:
            self._wake.clear()  # before looking: a message or the write's end wakes us
            stepped = 0
            while inbox and _mid_write_input(inbox[0], r):
                r.step(inbox.popleft())
                stepped += 1
            if stepped or look:
                look = False
                self._pass_msgs += stepped
                ents = r.take_durable_committed(rd, max_bytes)
                if ents:
                    self._apply_entries(ents)
                    self._release_parked_reads()
                    self.counters["mid_write_applies"] += 1
            if outcome:
                break
            await self._wake.wait()
        if outcome[0] is not None:
            raise outcome[0]

    def _sync_inline(self, rd: Ready) -> bool:
        """Whether this Ready's group commit runs on the loop itself.

        Only on a follower, whose fsync is on every write's commit path and
        which has nothing to overlap with it: a small batch costs one LMDB
        commit of a few pages (about 0.3 ms with its fsync here), and the
        hand-off to a thread and back cost about as much again in wake-ups
        and CPU. The leader keeps its thread: its fsync runs beside the
        followers' and overlaps HTTP parsing (a leader syncing on the loop
        whenever its Ready held every proposal in flight measured 10-12%
        less throughput under load and no gain with one client: issue 17's
        note). A snapshot, a staged checkpoint or a batch over
        ``env.inline_sync_bytes`` goes to a thread anyway (``small_batch``:
        retention's deletions and the state's checkpoint rows count too), so
        the loop never blocks on writing megabytes. ``inline_syncs`` counts
        them."""
        limit = self.env.inline_sync_bytes
        if limit <= 0 or self.role is Role.LEADER or rd.snapshot is not None:
            return False
        st = self._storage
        return st is not None and st.small_batch(limit)

    def _install_snapshot(
        self, st: NodeStorage, snap: Snapshot, restored: Callable[[], None] | None = None
    ) -> None:
        """Restore the state machine from a leader's snapshot and reset the
        log to it (durable with this Ready's sync, before anything is sent)."""
        meta = snap.meta
        # A refused payload raises: the loop stops rather than diverge.
        if restored is not None:
            restored()  # the state was filled off the loop (prepare_restore)
        else:
            self.state_machine.restore(snap.data)
        st.apply_snapshot(snap)
        self.applied = meta.index
        if self._durable_sm is not None:
            # The restored state goes into this Ready's commit with the snapshot.
            self._stage_checkpoint(self._clock())
            self._pending_snap = None  # older than what the leader sent
        self._snap = snap
        self.counters["snapshots_installed"] += 1
        for idx in [i for i in self._pending if i <= meta.index]:
            _fail(
                self._pending.pop(idx).future,
                OutcomeUnknown(f"entry {idx} was replaced by a snapshot at {meta.index}"),
            )
        logger.info(
            "node %d: installed snapshot at index %d (term %d, %d bytes) from the leader",
            self.cfg.node_id,
            meta.index,
            meta.term,
            len(snap.data),
        )

    def _send_snapshots(self, rd: Ready) -> None:
        """Stream the stored snapshot to each follower the core asked for
        (:class:`SnapshotStreams`; a request for a peer already receiving
        one is ignored). One that cannot start is reported to the core after
        advance(); a stream that fails later reports the same way."""
        for m in rd.snapshots_to_send:
            snap = self._snap
            if snap is None or m.snapshot is None or snap.meta != m.snapshot:
                logger.warning(
                    "node %d: asked to send snapshot %s to %d but holds %s",
                    self.cfg.node_id,
                    m.snapshot,
                    m.to,
                    snap.meta if snap is not None else None,
                )
                self.counters["snapshots_send_failed"] += 1
                self._snap_reports.append((m.to, False))
                continue
            if self._streams.send_snapshot(m, snap):
                logger.info(
                    "node %d: streaming snapshot at %d (%d bytes) to node %d",
                    self.cfg.node_id,
                    snap.meta.index,
                    len(snap.data),
                    m.to,
                )

    def _maybe_start_snapshot(self, r: RawNode) -> None:
        """Between advance() and the next ready(): once ``snapshot_every_entries``
        entries were applied since the last snapshot, freeze the state machine
        (cheap copies, on the loop, so it is exactly the state at the core's
        applied index) and hand encoding and the file write to a background
        task. Raft keeps running meanwhile; see ``_snapshot_housekeeping``."""
        every = self.cfg.snapshot_every_entries
        if every <= 0 or self._snap_task is not None or self._compact_to is not None:
            return
        latest = r.latest_snapshot()
        if r.log.applied - (latest.index if latest is not None else 0) < every:
            return
        if self._durable_sm is not None:
            # The state reads its records from the log, so a snapshot only
            # helps once the log can be compacted past the current one: that
            # is retention's call (compact_floor). One waits at a time.
            if self._pending_snap is not None:
                return
            now = self._clock()
            if now - self._floor_checked_s < _PENDING_SNAPSHOT_CHECK_S:
                return  # the floor costs a lookup per queue: not every Ready
            self._floor_checked_s = now
            # Only once retention has let go of at least ``every`` entries
            # past the current snapshot: a snapshot waits (its bytes in
            # memory, its file on disk) until retention passes its index,
            # which with nothing dropped is never (a log of 5M retained
            # messages built one of 120 MB and kept it).
            if self._floor(r) - 1 - (latest.index if latest is not None else 0) < every:
                return
        st = self._storage
        assert st is not None
        meta = r.snapshot_meta()
        if meta.index != self.applied:
            raise DLedgerError(
                f"core applied {meta.index} but the state machine applied {self.applied}"
            )
        build = self.state_machine.snapshot_builder()

        async def make() -> tuple[Snapshot, str]:
            snap = Snapshot(meta, await self.env.offload(build))
            name = await self.env.offload(st.write_snapshot_file, snap)
            self._wake.set()
            return snap, name

        self._snap_task = asyncio.create_task(make())

    async def _snapshot_housekeeping(self, r: RawNode) -> None:
        """Record a snapshot whose file is durable (one small sync), tell the
        core, then compact the log behind it at most ``_COMPACT_STEP`` entries
        per pass, each step riding on the next group commit."""
        st = self._storage
        assert st is not None
        task = self._snap_task
        ready: tuple[Snapshot, str] | None = None
        if task is not None and task.done():
            self._snap_task = None
            ready = task.result()  # a failed write raises: the loop stops
            if self._durable_sm is not None:
                # Handed to the core only once retention has dropped every
                # record in the entries it covers: the core's snapshot then
                # sits at the front of the retained log, and a follower that
                # installs it gets every retained record by replication.
                self._pending_snap, ready = ready, None
        pending = self._pending_snap
        now = self._clock()
        if pending is not None and now - self._pending_checked_s >= _PENDING_SNAPSHOT_CHECK_S:
            self._pending_checked_s = now
            if self._floor(r) > pending[0].meta.index:
                self._pending_snap, ready = None, pending
        if ready is not None:
            snap, name = ready
            if st.record_snapshot(snap, name):
                if self._durable_sm is not None and self._ckpt_applied < snap.meta.index:
                    # A start takes a state checkpoint only at or after the
                    # snapshot it finds ([snapshot, commit], _load_checkpoint):
                    # this record would leave every older one unusable, and a
                    # crash before the next checkpoint rebuilt the whole
                    # state from the snapshot and the log. A fresh one rides
                    # the record's LMDB commit (which a snapshot needs anyway).
                    self._stage_checkpoint(self._clock())
                await self.env.offload(self._sync_blocking, st)
                self._snap = snap
                self.counters["snapshots_taken"] += 1
                self._compact_to = r.snapshot_taken(snap.meta)
                logger.info(
                    "node %d: snapshot at index %d (%d bytes)",
                    self.cfg.node_id,
                    snap.meta.index,
                    len(snap.data),
                )
        c = self._compact_to
        if c is None:
            return
        first = st.first_index()
        upto = min(c.upto, first + _COMPACT_STEP)
        final = upto == c.upto
        sm = self._durable_sm
        if sm is not None:
            # The state reads records from the log: keep every entry from
            # the one holding the oldest retained record (retention, not
            # snapshots, decides how far the log is dropped). The next
            # snapshot tries again.
            floor = sm.compact_floor()
            if floor is not None and floor < upto:
                upto, final = floor, True
        if upto <= first or c.upto - 1 > st.last_index():
            self._compact_to = None  # reset meanwhile (a snapshot from the leader)
            return
        bounded = _compact_step_end(st, first, upto)
        if bounded < upto:
            upto, final = bounded, False
        if upto == c.upto:
            term, pos = c.term, c.pos
        else:
            term, pos = st.term(upto - 1), st.entries(upto - 1, upto)[0].end_pos
        if final:
            self._compact_to = None
        st.compact(upto, term, pos)
        if sm is not None:
            sm.log_compacted(pos)
        await self.env.offload(self._sync_blocking, st)
        if self._compact_to is None:
            logger.info(
                "node %d: log compacted; it now starts at %d", self.cfg.node_id, st.first_index()
            )
        else:
            self._wake.set()  # the next step comes after whatever queued meanwhile

    async def _checkpoint_housekeeping(self) -> None:
        """A checkpoint staged but not yet written (no Ready came to carry
        it: the node went quiet) gets a group commit of its own; one that
        is due on a quiet node is staged first (on a storage that catches
        up, once ``_CHECKPOINT_DEFER_S`` has passed without a catch-up)."""
        sm = self._durable_sm
        if sm is None:
            return
        self._maybe_checkpoint()
        if self._ckpt_seq is None:
            return
        st = self._storage
        assert st is not None
        await self.env.offload(self._sync_blocking, st)
        if sm.checkpoint_durable(self._ckpt_seq):
            self._ckpt_seq = None

    def _sync_blocking(self, st: NodeStorage) -> None:
        # Never LMDB's catch-up here: _catch_up runs it after the answers.
        st.sync(catch_up=False)
        st.maybe_flush(self._clock())  # async mode: fsync once per interval

    async def _catch_up(self, r: RawNode, rd: Ready) -> None:
        """LMDB's catch-up (taking what only the storage's write-ahead log
        holds, a commit of up to a mebibyte: 5-8 ms here under load, several
        times a second), which group commits leave (``sync(catch_up=False)``)
        until their Ready's answers are out: a follower's acknowledgement is
        on the commit path of every write, and a leader's answers to the
        clients whose entries the Ready wrote. It runs in a thread after
        ``advance``, the pass waiting for it, so nothing else writes to the
        storage meanwhile (as during any group commit in a thread). A leader
        steps acknowledgements and applies and answers what they commit
        meanwhile (``_write_and_apply``: every entry is durable here now).
        Before, a follower's small batch synced on the loop took the catch-up
        along whenever its record made the log due: its loop stood still for
        7-12 ms and its acknowledgement waited (issue 17's note)."""
        st = self._storage
        assert st is not None
        if r.role is Role.LEADER and rd.snapshot is None:
            await self._write_and_apply(st, r, rd, functools.partial(_catch_up_blocking, st))
        else:
            await self.env.offload(_catch_up_blocking, st)
        self.counters["deferred_catch_ups"] += 1

    async def _maybe_flush(self) -> None:
        st = self._storage
        if st is None or self.cfg.flush != "async":
            return
        now = self._clock()
        # The same expression as the wake-up time in _wait_for_work: written
        # as ``now - last >= interval`` it can be false by a rounding error
        # when the loop wakes exactly at ``last + interval``, and the loop
        # then spins without sleeping or flushing.
        if now >= self._flush_due_s() and st.flush_pending():
            self._last_flush_s = now
            await self.env.offload(st.maybe_flush, now)

    def _flush_due_s(self) -> float:
        return self._last_flush_s + self.cfg.flush_interval_ms / 1000

    def _send(self, rd: Ready, early: bool) -> None:
        tr = self._transport
        assert tr is not None
        for m in rd.messages:
            if (m.type in EARLY_SEND_TYPES) is not early:
                continue
            if not tr.send(m.to, encode_message(m)):
                self.counters["send_refused"] += 1

    def _apply_early(self, rd: Ready, r: RawNode) -> bool:
        """A leader applies its Ready's committed entries before the Ready's
        write when they are all durable here already (below its new entries:
        earlier Readies wrote them) and hold no membership change: their
        answers then do not wait for the group commit of the entries proposed
        since. Returns whether the Ready's committed entries are all applied
        now (True when it has none), which lets the write run with
        ``_write_and_apply``."""
        if rd.snapshot is not None or r.role is not Role.LEADER:
            return False
        ce = rd.committed_entries
        if not ce:
            return True
        if rd.entries and ce[-1].index >= rd.entries[0].index:
            return False
        if any(e.type is EntryType.CONF_CHANGE for e in ce):
            return False
        self._apply_entries(ce)
        self.counters["early_applies"] += 1
        return True

    def _apply(self, rd: Ready, entries: bool = True) -> list[_Pending]:
        """Apply committed entries in order; resolve their proposals. Returns
        the pending membership changes applied, resolved after advance()."""
        conf_applied = self._apply_entries(rd.committed_entries) if entries else []
        self._answer_reads(rd)
        return conf_applied

    def _apply_entries(self, committed: Sequence[Entry]) -> list[_Pending]:
        sm = self.state_machine
        conf_applied: list[_Pending] = []
        work = self._work
        for e in committed:
            work("apply", 1)
            result = sm.apply(e)
            self.applied = e.index
            p = self._pending.pop(e.index, None)
            if p is None:
                continue
            if p.term != e.term:
                self.counters["proposals_dropped"] += 1
                _fail(
                    p.future,
                    ProposalDropped(
                        f"index {e.index} was taken by term {e.term}, proposed in term {p.term}"
                    ),
                )
            elif p.conf:
                conf_applied.append(p)
            else:
                self.counters["proposals_ok"] += 1
                _resolve(p.future, Applied(e.index, e.term, result))
        self.counters["applied_entries"] += len(committed)
        self._pass_applied += len(committed)
        return conf_applied

    def _answer_reads(self, rd: Ready) -> None:
        for rs in rd.read_states:
            fut = self._reads.pop(rs.ctx, None)
            if fut is None:
                continue
            mode = "lease" if rs.mode is ReadMode.LEASE else "read_index"
            heapq.heappush(self._parked_reads, (rs.index, rs.ctx, mode, fut))
        for rf in rd.read_failures:
            fut = self._reads.pop(rf.ctx, None)
            if fut is not None:
                _fail(fut, NotLeader(rf.leader_hint))
        self._release_parked_reads()

    def _release_parked_reads(self) -> None:
        parked = self._parked_reads
        while parked and parked[0][0] <= self.applied:
            index, _, mode, fut = heapq.heappop(parked)
            _resolve(fut, ReadResult(index, self.applied, mode))

    def _after_advance(self, r: RawNode, rd: Ready, conf_applied: list[_Pending]) -> None:
        for p in conf_applied:
            _resolve(p.future, r.config)
        if any(e.type is EntryType.CONF_CHANGE for e in rd.committed_entries):
            self._update_peers(r)
        if rd.soft_state is not None:
            self._on_soft_state(rd.soft_state)

    def _on_soft_state(self, ss: SoftState) -> None:
        was_leader = self._role is Role.LEADER
        if ss.leader != self._leader or ss.role is not self._role:
            logger.info(
                "node %d: %s in term %d, leader %s",
                self.cfg.node_id,
                ss.role.name.lower(),
                ss.term,
                ss.leader or "unknown",
            )
        if ss.leader != self._leader:
            self.counters["leader_changes"] += 1
        # One election per term this node stood in: a quick win may go from
        # follower to leader within one Ready without showing the candidate.
        if ss.role in (Role.CANDIDATE, Role.LEADER) and ss.term != self._campaign_term:
            self._campaign_term = ss.term
            self.counters["elections"] += 1
        self._role, self._leader = ss.role, ss.leader
        if was_leader and ss.role is not Role.LEADER:
            self._streams.stop_sending()  # the core no longer waits for them
        if was_leader and ss.role is not Role.LEADER and self._pending:
            n = len(self._pending)
            self.counters["proposals_unknown"] += n
            for p in self._pending.values():
                _fail(
                    p.future,
                    OutcomeUnknown(
                        f"node {self.cfg.node_id} lost leadership in term {ss.term}; "
                        "the proposal may still commit"
                    ),
                )
            self._pending.clear()
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def _wait_changed(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while not pred():
            left = deadline - self._clock()
            if left <= 0 or not self.running:
                return pred()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()
        return True

    # ======================================================================
    # helpers
    # ======================================================================
    def _addresses(self, conf: ClusterConfig) -> dict[int, tuple[str, int]]:
        """The transport's peers: every member of the configuration, and
        every other node of the cluster file. A node that has not yet applied
        the change that added the current leader (a new learner replaying, a
        restart from an old snapshot) must still accept that leader's
        connection, or it could never catch up (found by the simulator)."""
        out: dict[int, tuple[str, int]] = {}
        known = set(conf.members()) | {m.id for m in self.cfg.members}
        for nid in sorted(known):
            if nid == self.cfg.node_id:
                continue
            m = self.cfg.member(nid)
            if m is None:
                logger.warning(
                    "node %d: member %d is not in the cluster file; it cannot be reached",
                    self.cfg.node_id,
                    nid,
                )
                continue
            out[nid] = (m.raft_host, m.raft_port)
        return out

    def _update_peers(self, r: RawNode) -> None:
        peers = self._addresses(r.config)
        ids = tuple(sorted(peers))
        if ids != self._peer_ids and self._transport is not None:
            logger.info(
                "node %d: membership now voters=%s learners=%s",
                self.cfg.node_id,
                list(r.config.voters),
                list(r.config.learners),
            )
            self._transport.update_peers(peers)
            self._peer_ids = ids

    def _fail_all(self, exc: DLedgerError) -> None:
        for p in self._pending.values():
            _fail(p.future, exc)
        self._pending.clear()
        stopped = NodeStopped(f"node {self.cfg.node_id} stopped")
        for fut in self._reads.values():
            _fail(fut, stopped)
        self._reads.clear()
        for _, _, _, fut in self._parked_reads:
            _fail(fut, stopped)
        self._parked_reads.clear()
        self._inbox.clear()
        # Queued ops never reached the log: they certainly did not happen.
        for fut, _ in self._ops:
            _fail(fut, stopped)
        self._ops.clear()
        self._queued_proposals = 0


def _compact_step_end(st: NodeStorage, first: int, upto: int) -> int:
    """The furthest ``end`` in ``(first, upto]`` such that compacting up to
    ``end`` (dropping entries ``first .. end - 1``) drops at most
    ``_COMPACT_STEP_BYTES`` of log, and at least one entry. A bisection over
    entry end positions: a few single-entry reads. A damaged record among
    them (it is about to be deleted) leaves the step as the count bound made
    it, as before the byte bound."""
    front = st.front_pos()

    def end_pos(index: int) -> int:
        return st.entries(index, index + 1)[0].end_pos

    lo, hi = first + 1, upto  # the answer is in [lo, hi]; lo: one entry at least
    try:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if end_pos(mid - 1) - front <= _COMPACT_STEP_BYTES:
                lo = mid
            else:
                hi = mid - 1
    except StorageCorrupted:
        return upto
    return lo


def _catch_up_blocking(st: NodeStorage) -> None:
    # False: writes are buffered that no sync() took yet (side rows the
    # checkpoint staged): that sync() commits LMDB itself (they are not
    # loggable), or the next Ready asks catch_up_due() again.
    st.checkpoint()


def _mid_write_input(m: Message, r: RawNode) -> bool:
    """Whether a leader may step ``m`` while its Ready's write is running."""
    return m.type in MID_WRITE_TYPES and m.term == r.term and r.role is Role.LEADER
