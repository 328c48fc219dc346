"""The Raft state machine: pure, deterministic, driven by ticks and messages.

Theory of operation
-------------------
``RawNode`` owns terms, votes, roles, the log's commit index, replication
progress, the leader lease, read requests, leadership transfer and
membership. It performs no I/O: inputs are ``tick()``, ``step(msg)``,
``propose()``, ``read_index()``, ``transfer_leadership()`` and
``propose_conf_change()``; every output is collected into a :class:`Ready`
that the driver must handle in order (persist, send, apply, then
``advance``). The driver must not call any input method between ``ready()``
and ``advance()``: inputs that arrive meanwhile are queued by the driver and
stepped afterwards, which is what makes one fsync cover many proposals
(group commit).

Roles are step functions chosen on transition (``_become_*`` sets
``self._step_role``); term handling happens once, in :meth:`step`.
Randomness comes only from the injected ``random.Random``; peers are always
visited in sorted order, so a seed reproduces a run exactly.

Stickiness, lease and their soundness
-------------------------------------
A node that heard from a leader less than ``election_ticks`` ago (or booted
less than ``election_ticks`` ago, because a restart forgets whom it heard)
ignores pre-vote and vote requests, unless the request is forced by a
leadership transfer. The leader counts its lease from the tick at which it
*sent* a heartbeat round that a quorum of voters acknowledged; it lasts
``election_ticks - lease_drift_ticks``. Every voter that acknowledged that
round reset its election timer on receipt (after the send), so no quorum can
elect another leader before the lease ends, up to the drift margin between
tick rates. A transfer gives the lease up at once (the transferee's forced
campaign bypasses stickiness), and an aborted transfer leaves the lease off
for the rest of the term, because a delayed TimeoutNow could still arrive.

Snapshots
---------
The application owns snapshots: after applying, it may save its state at
the applied index together with :meth:`RawNode.snapshot_meta` and then call
:meth:`RawNode.snapshot_taken`, which answers how far the driver may compact
the stored log (keeping ``snapshot_trailing_entries`` behind the snapshot so
slightly-behind followers still get entries). A leader that needs compacted
entries for a follower puts a SNAPSHOT message for it into
``Ready.snapshots_to_send`` (the driver attaches the payload) and stops
replicating to it until it answers (or ``snapshot_retry_ticks`` pass, or
``report_snapshot(failed)``). A follower whose commit index is at or past the
snapshot acknowledges and ignores it, so a stale or duplicated snapshot never
rolls anything back; otherwise its log becomes the snapshot (``Ready.snapshot``,
persisted before the acknowledgement leaves) and commit = applied = its index.
A restart passes the latest durable snapshot back in: its config is the base
membership and nothing at or below its index is applied again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dledger.core.codec import decode_conf_change, encode_conf_change
from dledger.core.log import RaftLog
from dledger.core.progress import Progress, ProgressState
from dledger.core.types import (
    EARLY_SEND_TYPES,
    NONE,
    ClusterConfig,
    Compaction,
    ConfChange,
    ConfChangeType,
    Entry,
    EntryType,
    HardState,
    Message,
    MsgType,
    RaftConfig,
    ReadFailed,
    ReadMode,
    ReadState,
    Ready,
    Role,
    Snapshot,
    SnapshotMeta,
    SoftState,
)
from dledger.errors import (
    Compacted,
    DLedgerError,
    InvariantViolation,
    NotLeader,
    ProposalDropped,
    ReplicaDiverged,
    TransferInProgress,
)
from dledger.storage.base import LogStorage, StableStore

if TYPE_CHECKING:
    from random import Random  # the injected generator's type only

# Fault switches (for the simulator's "the checker can fail" tests). Each one
# breaks exactly one protocol rule; production configs never set them.
FAULT_COMMIT_OLD_TERM = "commit_old_term"  # commit earlier-term entries by counting
FAULT_SKIP_VOTE_PERSIST = "skip_vote_persist"  # vote not written to stable storage
FAULT_VOTE_DESPITE_LEADER = "vote_despite_leader"  # no stickiness
FAULT_LEASE_IGNORES_EXPIRY = "lease_ignores_expiry"  # serve reads under an expired lease
FAULT_TRUNCATE_WITHOUT_CONFLICT = "truncate_without_conflict"  # SCENARIOS 6
FAULT_INSTALL_STALE_SNAPSHOT = "install_stale_snapshot"  # SCENARIOS 9: roll back to it
FAULT_FOLLOWER_COMMITS_AHEAD = "follower_commits_ahead"  # SCENARIOS 16 (dledger/faults.py)
FAULT_CAMPAIGN_UNAPPLIED_CONF = "campaign_unapplied_conf"  # campaign with a conf change unapplied
FAULT_LEARNER_IGNORES_VOTES = "learner_ignores_votes"  # a not-yet-promoted learner never votes
FAULT_HEARTBEAT_COMMIT_UNCHECKED = "heartbeat_commit_unchecked"  # commit what we hold, unconfirmed
FAULT_LEASE_STALE_CLOCK = "lease_stale_clock"  # node.py: lease decided on the pass's old ticks
FAULT_ACK_BELOW_COMMIT = "ack_below_commit"  # answer appends below commit with it, unchecked
CORE_FAULTS = frozenset(
    {
        FAULT_ACK_BELOW_COMMIT,
        FAULT_CAMPAIGN_UNAPPLIED_CONF,
        FAULT_LEARNER_IGNORES_VOTES,
        FAULT_HEARTBEAT_COMMIT_UNCHECKED,
        FAULT_LEASE_STALE_CLOCK,
        FAULT_COMMIT_OLD_TERM,
        FAULT_SKIP_VOTE_PERSIST,
        FAULT_VOTE_DESPITE_LEADER,
        FAULT_LEASE_IGNORES_EXPIRY,
        FAULT_TRUNCATE_WITHOUT_CONFLICT,
        FAULT_INSTALL_STALE_SNAPSHOT,
        FAULT_FOLLOWER_COMMITS_AHEAD,
    }
)

_VOTE_RESP = {MsgType.VOTE: MsgType.VOTE_RESP, MsgType.PRE_VOTE: MsgType.PRE_VOTE_RESP}


@dataclass(frozen=True, slots=True)
class PeerStatus:
    match: int
    next: int
    state: str
    learner: bool
    recent_active: bool


@dataclass(frozen=True, slots=True)
class Status:
    id: int
    role: Role
    term: int
    leader: int
    vote: int
    commit: int
    applied: int
    last_index: int
    lease_remaining_ticks: int
    transferee: int
    config: ClusterConfig
    peers: dict[int, PeerStatus]


class RawNode:
    """One Raft participant. See the module docstring for the contract."""

    def __init__(
        self,
        cfg: RaftConfig,
        log_storage: LogStorage,
        stable: StableStore,
        rng: Random,
        applied: int = 0,
        snapshot: SnapshotMeta | None = None,
    ) -> None:
        """``snapshot`` is the latest snapshot the application durably holds
        (and restored its state machine from), if any; ``applied`` the index
        its state machine has applied (at least the snapshot's)."""
        cfg.validate()
        if snapshot is None and log_storage.first_index() > 1:
            # Without the snapshot the membership (and the state) before the
            # stored log are unknown: refuse instead of silently using
            # cfg.peers.
            raise InvariantViolation(
                f"the stored log starts at {log_storage.first_index()} but no snapshot was given"
            )
        self.cfg = cfg
        self.id = cfg.node_id
        self._rng = rng
        self._faults = cfg.faults
        hs = stable.hard_state()
        self.term = hs.term
        self.vote = hs.vote
        self.log = RaftLog(
            log_storage,
            hs.commit,
            applied,
            cfg.log_cache_entries_max,
            cfg.log_cache_bytes_max,
            snapshot,
        )
        self._snapshot = snapshot  # the latest durable snapshot (what we send)
        self._installing: Snapshot | None = None  # received, in the next Ready
        self._snap_msgs: list[Message] = []
        self._prev_hs = HardState(hs.term, hs.vote, self.log.committed)
        self.config = self._config_at(self.log.applied)
        self.lead = NONE
        self.role = Role.FOLLOWER
        self._prev_soft = SoftState(self._visible_role(), NONE, self.term)
        self._step_role: Callable[[Message], None] = self._step_follower
        self._msgs: list[Message] = []
        self._read_states: list[ReadState] = []
        self._read_failures: list[ReadFailed] = []
        self._tick_count = 0
        self._last_leader_contact = 0  # boot counts as contact (see _in_stickiness)
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = cfg.election_ticks
        self._votes: dict[int, bool] = {}
        self._progress: dict[int, Progress] = {}
        self._pending_conf_index = 0
        self._transferee = NONE
        self._pending_bcast = False
        self._commit_notify_at = -1  # leader: tick to tell lagging followers the commit
        # lease / ReadIndex bookkeeping (leader only)
        self._hb_round = 0
        self._hb_sent_tick: dict[int, int] = {}
        self._acked_round: dict[int, int] = {}
        self._lease_expiry_tick = -1
        self._lease_disabled = False
        self._lease_min_round = 0  # rounds before it cannot give a lease
        self._need_read_round = False
        self._active_tick = 0  # leader: the last tick with work in flight (idle heartbeats)
        self.idle_rounds = 0  # heartbeat rounds sent at the idle interval (a statistic)
        self._pending_reads: list[tuple[int, int, int]] = []  # (ctx, round, index)
        self._reads_before_commit: list[int] = []  # ctx waiting for the no-op
        self._taken: tuple[int, int, int] | None = None  # (last entry idx, term, applied)
        self._reset_randomized_timeout()

    # ======================================================================
    # Public inputs
    # ======================================================================
    def tick(self) -> None:
        """Advance logical time by one tick."""
        self._tick_count += 1
        if self.role is Role.LEADER:
            self._tick_leader()
        else:
            self._tick_election()

    def ticks_until_due(self) -> int:
        """How many ticks from now the next tick can change anything (a
        heartbeat, a check-quorum round, an election timeout): a driver with
        nothing else to do may sleep that long and then tick the missed ticks
        at once, which has the same effect as ticking each one. Inputs (a
        message, a proposal) change it; ask again after each."""
        if self.role is Role.LEADER:
            idle = self._idle()
            hb = self.cfg.idle_heartbeat_ticks if idle else self.cfg.heartbeat_ticks
            hb_due = hb - self._heartbeat_elapsed
            if self._commit_notify_at >= 0:
                hb_due = min(hb_due, self._commit_notify_at - self._tick_count)
            if idle:
                # An idle leader wakes for its rounds only: the check-quorum
                # tick in between waits for the next wake, when the missed
                # ticks run in order (a step-down at most one round late; the
                # lease never outlives its own expiry tick, which the driver
                # checks against the clock before every lease read).
                return max(1, hb_due)
            return max(1, min(hb_due, self.cfg.election_ticks - self._election_elapsed))
        if not self._promotable():
            return max(1, self.cfg.election_ticks)  # a learner never campaigns
        return max(1, self._randomized_timeout - self._election_elapsed)

    def step(self, m: Message) -> None:
        """Feed one message from a peer. Term rules are applied here, once."""
        if m.to != self.id:
            return
        if m.term > self.term:
            if m.type in (MsgType.VOTE, MsgType.PRE_VOTE) and self._sticky_refusal(m):
                return  # heard from a live leader recently: ignore, no reply
            if m.type is MsgType.PRE_VOTE or (m.type is MsgType.PRE_VOTE_RESP and not m.reject):
                pass  # a pre-vote never changes anyone's term
            elif m.type in (MsgType.APP, MsgType.HEARTBEAT, MsgType.SNAPSHOT):
                self._become_follower(m.term, m.frm)
            else:
                self._become_follower(m.term, NONE)
        elif m.term < self.term:
            if m.type in (MsgType.APP, MsgType.HEARTBEAT, MsgType.SNAPSHOT):
                # A stale leader (e.g. healed after a partition) must learn the
                # new term, or with pre-vote it could wait forever.
                self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term))
            elif m.type is MsgType.PRE_VOTE:
                self._send(Message(MsgType.PRE_VOTE_RESP, m.frm, self.id, self.term, reject=True))
            return

        if m.type in (MsgType.VOTE, MsgType.PRE_VOTE):
            self._handle_vote_request(m)
            return
        if m.type in (MsgType.VOTE_RESP, MsgType.PRE_VOTE_RESP):
            self._learn_commit(m)
        self._step_role(m)

    def propose(self, data: bytes) -> int:
        """Append ``data`` as a new entry; returns its index (not yet committed)."""
        return self._propose(EntryType.NORMAL, data)

    def propose_conf_change(self, cc: ConfChange) -> int:
        """Single-server membership change, one at a time, through the log."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.lead)
        if self._pending_conf_index > self.log.applied:
            raise ProposalDropped("a membership change is already in progress")
        cur = self.config
        nid = cc.node_id
        if nid <= 0:
            raise ProposalDropped("node id must be >= 1")
        if cc.type is ConfChangeType.ADD_VOTER and cur.is_voter(nid):
            raise ProposalDropped(f"node {nid} is already a voter")
        if cc.type is ConfChangeType.ADD_LEARNER and nid in cur.members():
            raise ProposalDropped(f"node {nid} is already a member")
        if cc.type is ConfChangeType.PROMOTE_LEARNER and not cur.is_learner(nid):
            raise ProposalDropped(f"node {nid} is not a learner")
        if cc.type in (ConfChangeType.PROMOTE_LEARNER, ConfChangeType.ADD_VOTER) and cur.is_learner(
            nid
        ):
            # A learner becomes a voter only once it has (nearly) caught up.
            pr = self._progress.get(nid)
            if pr is None or self.log.last_index() - pr.match > self.cfg.transfer_max_lag:
                raise ProposalDropped(f"learner {nid} is not caught up yet")
        if cc.type is ConfChangeType.REMOVE_NODE:
            if nid not in cur.members():
                raise ProposalDropped(f"node {nid} is not a member")
            if cur.voters == (nid,):
                raise ProposalDropped("cannot remove the last voter")
        idx = self._propose(EntryType.CONF_CHANGE, encode_conf_change(cc))
        self._pending_conf_index = idx
        return idx

    def read_index(self, ctx: int) -> None:
        """Ask for a linearizable read. The answer comes back in a later Ready as
        ``ReadState(ctx, index, mode)`` (serve once applied >= index) or as
        ``ReadFailed(ctx)``. Raises NotLeader on a non-leader."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.lead)
        self._active_tick = self._tick_count
        if not self._committed_in_term():
            self._reads_before_commit.append(ctx)  # wait for our no-op to commit
            return
        self._serve_read(ctx)

    def transfer_leadership(self, to: int) -> None:
        """Hand leadership to voter ``to`` (TimeoutNow once it is caught up).

        The lease ends at once; proposals are refused until the transfer
        completes or aborts after an election timeout."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.lead)
        if to == self.id:
            return
        if not self.config.is_voter(to):
            raise DLedgerError(f"node {to} is not a voter; only voters can lead")
        pr = self._progress[to]
        if self.log.last_index() - pr.match > self.cfg.transfer_max_lag or not pr.recent_active:
            raise DLedgerError(
                f"node {to} is not caught up (match {pr.match}, last {self.log.last_index()})"
            )
        if self._transferee == to:
            return
        self._transferee = to
        self._election_elapsed = 0  # the transfer aborts after one election timeout
        self._lease_expiry_tick = -1
        self._lease_disabled = True
        if pr.match == self.log.last_index():
            self._send(Message(MsgType.TIMEOUT_NOW, to, self.id, self.term))
        else:
            self._send_append(to, want_reply=True)

    def snapshot_meta(self) -> SnapshotMeta:
        """Meta for a snapshot of the state machine as of the applied index
        (call between ``advance`` and the next ``ready``)."""
        i = self.log.applied
        return SnapshotMeta(i, self.log.term(i), self.log.end_pos(i), self.config)

    def snapshot_taken(self, meta: SnapshotMeta) -> Compaction | None:
        """The application durably saved a snapshot at ``meta`` (from
        :meth:`snapshot_meta`). Returns how far the driver may now compact the
        stored log (``LogStorage.compact(c.upto, c.term, c.pos)``), if at all."""
        if meta.index > self.log.applied:
            raise InvariantViolation(f"snapshot {meta.index} beyond applied {self.log.applied}")
        if self._snapshot is not None and meta.index <= self._snapshot.index:
            return None  # older than what we already hold
        self._snapshot = meta
        upto = meta.index + 1 - self.cfg.snapshot_trailing_entries
        if upto <= self.log.first_index():
            return None
        return Compaction(upto, self.log.term(upto - 1), self.log.end_pos(upto - 1))

    def latest_snapshot(self) -> SnapshotMeta | None:
        return self._snapshot

    def report_snapshot(self, to: int, ok: bool) -> None:
        """The driver delivered (``ok=True``) or failed to deliver a snapshot.

        Failed: try again. Delivered: probe just past it, so the follower's
        answer to that probe moves it on even if its answer to the snapshot
        itself was lost (a resent snapshot it already holds is acknowledged
        by the stream but never reaches its core again: without this probe
        the leader would wait for that answer for ever)."""
        pr = self._progress.get(to)
        if self.role is Role.LEADER and pr is not None and pr.state is ProgressState.SNAPSHOT:
            pr.become_probe(after_snapshot=pr.pending_snapshot if ok else 0)

    def campaign(self) -> None:
        """Start an election now (used by tests and by a single-node bootstrap)."""
        if self.role is not Role.LEADER and self._may_campaign():
            self._campaign(pre=self.cfg.pre_vote, force=False)

    # ======================================================================
    # Ready / advance
    # ======================================================================
    def has_ready(self) -> bool:
        self._flush_pending()
        return bool(
            self._msgs
            or self._snap_msgs
            or self._installing is not None
            or self._read_states
            or self._read_failures
            or self.log.unstable_entries()
            or self.log.has_next_committed()
            or self._hard_state() != self._prev_hs
            or self._soft_state() != self._prev_soft
        )

    def ready(self) -> Ready:
        """Collect pending work. See :class:`Ready` for the order the driver must keep."""
        self._flush_pending()
        hs = self._hard_state()
        soft = self._soft_state()
        entries = self.log.unstable_entries()
        committed = tuple(self.log.next_committed(self.cfg.max_apply_bytes))
        msgs = self._msgs
        held: list[Message] = []
        if hs.term != self._prev_hs.term or hs.vote != self._prev_hs.vote:
            # A driver may send a leader's APP/HEARTBEAT before persisting
            # (EARLY_SEND_TYPES), which is sound only when the term and vote
            # they depend on are already durable. A lone voter wins its
            # election within one step, so its first appends would share a
            # Ready with its new term: hold them for the next Ready, which
            # the driver handles only after this one's sync.
            held = [m for m in msgs if m.type in EARLY_SEND_TYPES]
            if held:
                msgs = [m for m in msgs if m.type not in EARLY_SEND_TYPES]
        rd = Ready(
            soft_state=soft if soft != self._prev_soft else None,
            hard_state=hs if hs != self._prev_hs else None,
            entries=entries,
            messages=tuple(msgs),
            committed_entries=committed,
            read_states=tuple(self._read_states),
            read_failures=tuple(self._read_failures),
            must_sync=bool(entries)
            or self._installing is not None
            or hs.term != self._prev_hs.term
            or hs.vote != self._prev_hs.vote
            # A commit index that covers a membership change is made durable
            # before the change is applied: a restarted node learns its
            # commit index from its peers, but a node that just shrank the
            # configuration to itself has none left to learn it from, and
            # with the old commit index it would wait for the vote of a
            # removed node for ever (found by the node-driven simulator).
            or any(e.type is EntryType.CONF_CHANGE for e in committed),
            snapshot=self._installing,
            snapshots_to_send=tuple(self._snap_msgs),
        )
        self._installing = None
        self._snap_msgs = []
        self._msgs = held
        self._read_states = []
        self._read_failures = []
        self._prev_soft = soft
        self._prev_hs = hs
        return rd

    def take_durable_committed(self, rd: Ready, max_bytes: int) -> tuple[Entry, ...]:
        """Leader only, while ``rd`` (the Ready last taken) is being written:
        committed entries after ``rd.committed_entries`` that are durable here
        already (written by earlier Readies), up to the first membership
        change. The driver applies them at once, in order, after
        ``rd.committed_entries``; they are not handed out again. The only
        input a driver may step meanwhile: same-term APP_RESP and
        HEARTBEAT_RESP messages (``MID_WRITE_TYPES``)."""
        if self.role is not Role.LEADER or rd.snapshot is not None:
            return ()
        lo = max(self.log.applied, rd.committed_entries[-1].index if rd.committed_entries else 0)
        hi = min(self.log.committed, self.log.stable_last_index())
        if hi <= lo:
            return ()
        out: list[Entry] = []
        for e in self.log.entries(lo + 1, hi + 1, max_bytes):
            if e.type is EntryType.CONF_CHANGE:
                break
            out.append(e)
        if out:
            self.log.applied_to(out[-1].index)
        return tuple(out)

    def advance(self, rd: Ready) -> None:
        """The driver persisted, sent and applied ``rd``."""
        if rd.snapshot is not None:
            self.log.snapshot_persisted(rd.snapshot.meta)
            if self._snapshot is None or rd.snapshot.meta.index > self._snapshot.index:
                self._snapshot = rd.snapshot.meta
        if rd.entries:
            last = rd.entries[-1]
            self.log.stable_to(last.index, last.term)
        if rd.committed_entries:
            for e in rd.committed_entries:
                if e.type is EntryType.CONF_CHANGE:
                    self._apply_conf_change(decode_conf_change(e.data))
            last_applied = rd.committed_entries[-1].index
            if last_applied > self.log.applied:  # take_durable_committed went past it
                self.log.applied_to(last_applied)
        if self.role is Role.LEADER:
            # Our own copy counts toward commit only once it is durable.
            self._progress[self.id].maybe_update(self.log.stable_last_index())
            if self._maybe_commit():
                self._commit_moved()

    # ======================================================================
    # Introspection
    # ======================================================================
    @property
    def tick_count(self) -> int:
        return self._tick_count

    @property
    def transferee(self) -> int:
        return self._transferee

    def leader_ready(self) -> bool:
        """Leader whose no-op (an entry of its own term) has committed: only
        then does it serve reads and accept membership changes."""
        return self.role is Role.LEADER and self._committed_in_term()

    def lease_valid(self) -> bool:
        """True when a linearizable read may be served locally right now."""
        return self._lease_valid_at(self._tick_count)

    def _lease_valid_at(self, tick: int) -> bool:
        if self.role is not Role.LEADER or not self.cfg.check_quorum:
            return False
        if self._lease_disabled or self._transferee != NONE or not self._committed_in_term():
            return False
        if FAULT_LEASE_IGNORES_EXPIRY in self._faults:
            return self._lease_expiry_tick >= 0
        return tick < self._lease_expiry_tick

    def lease_read_index(self, behind: int = 0) -> int | None:
        """The index a linearizable read may be served at by the lease when
        ``behind`` ticks are due but not delivered yet (the driver ticks at
        the start of a loop pass; its clock runs on meanwhile): the commit
        index, or None when the lease would not hold after those ticks (then
        ask :meth:`read_index`). Ticking could only end the lease (expiry, a
        check-quorum step-down), never start one, so the answer is the one
        :meth:`read_index` would give after them. It changes nothing but the
        activity mark that keeps heartbeat rounds short while reads come in,
        so a driver may ask it between its loop passes, even between
        ``ready()`` and ``advance()``."""
        if not self._lease_valid_at(self._tick_count + max(0, behind)):
            return None
        self._active_tick = self._tick_count
        return self.log.committed

    def suspend_lease(self) -> None:
        """The driver's loop stalled longer than the lease's safety margin
        (:meth:`RaftConfig.lease_margin_ticks`): drop the lease, and take a
        new one only from a heartbeat round sent after this call and
        acknowledged by a quorum. Reads go by ReadIndex meanwhile."""
        self._lease_expiry_tick = -1
        self._lease_min_round = self._hb_round + 1

    def lease_remaining_ticks(self) -> int:
        return max(0, self._lease_expiry_tick - self._tick_count) if self.lease_valid() else 0

    def status(self) -> Status:
        peers = {
            pid: PeerStatus(pr.match, pr.next, pr.state.name, pr.is_learner, pr.recent_active)
            for pid, pr in sorted(self._progress.items())
        }
        return Status(
            id=self.id,
            role=self._visible_role(),
            term=self.term,
            leader=self.lead,
            vote=self.vote,
            commit=self.log.committed,
            applied=self.log.applied,
            last_index=self.log.last_index(),
            lease_remaining_ticks=self.lease_remaining_ticks(),
            transferee=self._transferee,
            config=self.config,
            peers=peers,
        )

    # ======================================================================
    # Roles
    # ======================================================================
    def _reset(self, term: int) -> None:
        if self.term != term:
            self.term = term
            self.vote = NONE
        self.lead = NONE
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._reset_randomized_timeout()
        self._votes = {}
        self._transferee = NONE
        self._pending_bcast = False
        self._commit_notify_at = -1
        self._lease_expiry_tick = -1
        self._lease_disabled = False
        self._hb_sent_tick = {}
        self._acked_round = {}
        self._need_read_round = False

    def _become_follower(self, term: int, lead: int) -> None:
        self._reset(term)
        self.lead = lead
        self._fail_pending_reads()  # only a leader has any; tell them who leads now
        self.role = Role.FOLLOWER
        self._step_role = self._step_follower
        self._progress = {}

    def _become_pre_candidate(self) -> None:
        if self.role is Role.LEADER:
            raise InvariantViolation("leader cannot become pre-candidate")
        # No term change and no vote: a pre-vote must not disturb anyone.
        self._votes = {}
        self.lead = NONE
        self.role = Role.PRE_CANDIDATE
        self._step_role = self._step_candidate

    def _become_candidate(self) -> None:
        if self.role is Role.LEADER:
            raise InvariantViolation("leader cannot become candidate")
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = Role.CANDIDATE
        self._step_role = self._step_candidate

    def _become_leader(self) -> None:
        if self.role is Role.FOLLOWER:
            raise InvariantViolation("follower cannot become leader directly")
        self._reset(self.term)
        self.lead = self.id
        self.role = Role.LEADER
        self._step_role = self._step_leader
        self._init_progress()
        self._active_tick = self._tick_count
        # Raft section 8: a no-op of our term commits everything before it; no
        # read, membership change or lease until it has committed.
        self._append_entry(EntryType.NOOP, b"")
        self._pending_conf_index = self.log.last_index()
        self._bcast_append()

    def _init_progress(self) -> None:
        nxt = self.log.last_index() + 1
        self._progress = {}
        for nid in self.config.members():
            pr = Progress(
                nxt,
                self.cfg.max_inflight_msgs,
                self.config.is_learner(nid),
                self.cfg.max_inflight_bytes,
            )
            if nid == self.id:
                pr.match = self.log.stable_last_index()
                pr.next = nxt
                pr.recent_active = True
            self._progress[nid] = pr

    # ======================================================================
    # Timers
    # ======================================================================
    def _tick_election(self) -> None:
        self._election_elapsed += 1
        if self._election_elapsed >= self._randomized_timeout and self._promotable():
            self._election_elapsed = 0
            if self._may_campaign():
                self._campaign(pre=self.cfg.pre_vote, force=False)

    def _tick_leader(self) -> None:
        if self.cfg.idle_heartbeat_ticks and self._busy():
            self._active_tick = self._tick_count
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self.cfg.election_ticks:
            self._election_elapsed = 0
            if self.cfg.check_quorum and not self._quorum_active():
                self._become_follower(self.term, NONE)
                return
            for nid, pr in self._progress.items():
                if nid != self.id:
                    pr.recent_active = False
            if self._transferee != NONE:
                self._transferee = NONE  # abort; the lease stays off this term
        if self._heartbeat_elapsed >= self._heartbeat_interval():
            self._heartbeat_elapsed = 0
            self._bcast_heartbeat()
        if 0 <= self._commit_notify_at <= self._tick_count:
            self._notify_commit()

    # An idle leader (nothing proposed, read or transferred, every peer
    # caught up, for IDLE_AFTER_ELECTIONS election timeouts) sends its rounds
    # every ``idle_heartbeat_ticks`` instead of every ``heartbeat_ticks``:
    # what an idle cluster costs is mostly these rounds. Still more than one
    # round per election timeout, so followers stay sticky and the lease is
    # renewed (both count from rounds, whatever their spacing); the first
    # proposal or read brings the short interval back at once.
    IDLE_AFTER_ELECTIONS = 3

    def idle_leader(self) -> bool:
        """A leader in its idle rounds with nothing in flight: its followers'
        answers can wait for its next round (a driver may leave them unread
        until then)."""
        return self.role is Role.LEADER and self._idle() and not self._busy()

    def _heartbeat_interval(self) -> int:
        return self.cfg.idle_heartbeat_ticks if self._idle() else self.cfg.heartbeat_ticks

    def _idle(self) -> bool:
        return bool(self.cfg.idle_heartbeat_ticks) and (
            self._tick_count - self._active_tick
            >= self.IDLE_AFTER_ELECTIONS * self.cfg.election_ticks
        )

    def _busy(self) -> bool:
        """Work in flight: a read waiting, a transfer, a peer not caught up."""
        if self._pending_reads or self._reads_before_commit or self._transferee != NONE:
            return True
        last = self.log.last_index()
        return any(pr.match < last for nid, pr in self._progress.items() if nid != self.id)

    def _reset_randomized_timeout(self) -> None:
        e = self.cfg.election_ticks
        self._randomized_timeout = e + self._rng.randrange(e)

    def _in_stickiness(self) -> bool:
        """Heard from a live leader (or booted) less than an election timeout ago.

        Measured on our own tick clock from the last AppendEntries/heartbeat
        accepted from a leader, and deliberately NOT cleared when our term
        moves: any higher-term message (a delayed pre-vote rejection, say) may
        raise our term, but the leader whose lease our acknowledgement helped
        establish may still be serving reads. Boot counts as contact, because
        a restart forgets whom we heard."""
        if self.role is Role.LEADER:
            return True  # check-quorum steps us down if we lose the quorum
        return self._tick_count - self._last_leader_contact < self.cfg.election_ticks

    def _sticky_refusal(self, m: Message) -> bool:
        """Must this (pre-)vote request be refused because a leader is alive?"""
        return (
            not m.force
            and self.cfg.check_quorum
            and FAULT_VOTE_DESPITE_LEADER not in self._faults
            and self._in_stickiness()
        )

    # ======================================================================
    # Elections
    # ======================================================================
    def _promotable(self) -> bool:
        return self.config.is_voter(self.id)

    def _may_campaign(self) -> bool:
        """A voter may stand for election only once every configuration change
        it knows to be committed is applied (etcd's ``hasUnappliedConfChanges``).

        Membership takes effect at apply time and the driver applies a bounded
        amount per Ready, so a node replaying a backlog can be behind its own
        commit index for many ticks. Counting votes (or granting itself a
        quorum) with the configuration before a committed change would let two
        disjoint majorities each elect a leader: with voters {1,2,3} that
        committed "promote 4" and "promote 5", nodes 1 and 2 still replaying
        would form a quorum of the old {1,2,3} while {3,4,5} is a quorum of
        the new one."""
        if not self._promotable():
            return False
        if FAULT_CAMPAIGN_UNAPPLIED_CONF in self._faults:
            return True  # planted bug: campaign with the stale configuration
        return not self._has_unapplied_conf_changes()

    def _has_unapplied_conf_changes(self) -> bool:
        lo, hi = self.log.applied + 1, self.log.committed + 1
        page = 1 << 20
        while lo < hi:
            ents = self.log.entries(lo, hi, page)
            if not ents:
                break
            if any(e.type is EntryType.CONF_CHANGE for e in ents):
                return True
            lo = ents[-1].index + 1
        return False

    def _campaign(self, *, pre: bool, force: bool) -> None:
        if pre:
            self._become_pre_candidate()
            term = self.term + 1
            mtype = MsgType.PRE_VOTE
        else:
            self._become_candidate()
            term = self.term
            mtype = MsgType.VOTE
        self._votes[self.id] = True
        if self._tally() == "won":
            self._after_win(pre)
            return
        for nid in self.config.voters:
            if nid == self.id:
                continue
            self._send(
                Message(
                    mtype,
                    nid,
                    self.id,
                    term,
                    log_term=self.log.last_term(),
                    index=self.log.last_index(),
                    force=force,
                )
            )

    def _after_win(self, pre: bool) -> None:
        if pre:
            self._campaign(pre=False, force=False)
        else:
            self._become_leader()

    def _tally(self) -> str:
        q = self.config.quorum()
        granted = sum(1 for nid, v in self._votes.items() if v and self.config.is_voter(nid))
        rejected = sum(1 for nid, v in self._votes.items() if not v and self.config.is_voter(nid))
        if granted >= q:
            return "won"
        if rejected >= q:
            return "lost"
        return "pending"

    def _handle_vote_request(self, m: Message) -> None:
        resp_type = _VOTE_RESP[m.type]
        # A node answers even while it believes it is a learner: it may have
        # been promoted by a committed change it has not applied yet, and the
        # candidate's configuration decides whose votes count (etcd does the
        # same). Without this, voters {2,3} + learner 1 that committed "promote
        # 1" on {2,3} and then lost 2 could never elect anyone.
        if FAULT_LEARNER_IGNORES_VOTES in self._faults and not self.config.is_voter(self.id):
            return  # planted bug: the old rule
        if (
            m.frm not in self.config.members()
            and self.config.is_voter(self.id)
            and not self.log.is_newer(m.index, m.log_term)
        ):
            # A removed (or never added) node must not disrupt the members.
            # A learner candidate is answered: it may hold a promotion we
            # have not applied yet. And a node that is not a voter in its own
            # view (a learner, or a new node that has applied nothing yet)
            # answers everyone: its configuration is the stale one (a new
            # node added and promoted before it applied anything refused the
            # only candidate that could win; node-driven simulator, 2 of 2000
            # seeds). Nor is a stranger refused whose log is strictly newer
            # than ours: it may hold the changes that made it a voter, which
            # we missed, and we may be the vote it needs. Voters {1,2,3}, 3
            # down; 4 added and promoted, 1 and 2 removed: {3,4}. Back, 3
            # refused 4 as a stranger and could not win with {1,2,3} itself:
            # no leader ever again (node-driven simulator, seed 174). Voting
            # for it is safe whatever it is: it counts votes with its own
            # configuration, and single-server changes keep the quorums of
            # consecutive configurations overlapping (Raft, section 4.1).
            self._send(self._vote_resp(resp_type, m.frm, self.term, reject=True))
            return
        can_vote = (
            self.vote == m.frm
            or (self.vote == NONE and self.lead == NONE)
            or (m.type is MsgType.PRE_VOTE and m.term > self.term)
        ) and not self._sticky_refusal(m)
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            # A pre-vote reply carries the term asked about so the
            # pre-candidate recognises it; a real vote is persisted (hard
            # state in the next Ready) before this reply leaves.
            self._send(self._vote_resp(resp_type, m.frm, m.term))
            if m.type is MsgType.VOTE:
                self._election_elapsed = 0
                self.vote = m.frm
        else:
            self._send(self._vote_resp(resp_type, m.frm, self.term, reject=True))

    def _vote_resp(self, t: MsgType, to: int, term: int, reject: bool = False) -> Message:
        """A vote answer, with our commit index and the term there: a
        candidate that lost its commit index in a crash learns it back
        (``_learn_commit``)."""
        c = self.log.committed
        return Message(t, to, self.id, term, log_term=self._safe_term(c), commit=c, reject=reject)

    def _learn_commit(self, m: Message) -> None:
        """A vote answer says entry ``m.commit`` (of term ``m.log_term``) is
        committed. Where our log holds that same entry, it holds the same
        prefix (Log Matching), so that prefix is committed here too.

        Without this a survivor could wait for ever: voters {1,2}, leader 2
        commits its own removal (and holds one more entry), tells 1, and 1
        crashes before that commit index is durable. 1 restarts with {1,2}
        and needs 2's vote; 2's longer log refuses it, and 2, no longer a
        member, never sends anything else (node-driven simulator, seed 33).
        A leader counts its commit index itself and learns nothing here."""
        c = m.commit
        if self.role is Role.LEADER or c <= self.log.committed or c > self.log.last_index():
            return
        if m.log_term > 0 and self._safe_term(c) == m.log_term:
            self.log.commit_to(c)

    def _step_candidate(self, m: Message) -> None:
        my_resp = MsgType.PRE_VOTE_RESP if self.role is Role.PRE_CANDIDATE else MsgType.VOTE_RESP
        if m.type in (MsgType.APP, MsgType.HEARTBEAT, MsgType.SNAPSHOT):
            # A leader of our term exists (term equal here).
            self._become_follower(m.term, m.frm)
            self._step_follower(m)
        elif m.type is my_resp:
            self._votes.setdefault(m.frm, not m.reject)
            res = self._tally()
            if res == "won":
                self._after_win(self.role is Role.PRE_CANDIDATE)
            elif res == "lost":
                self._become_follower(self.term, NONE)
        elif m.type is MsgType.TIMEOUT_NOW:
            pass  # not a follower of the sender: ignore

    # ======================================================================
    # Follower
    # ======================================================================
    def _step_follower(self, m: Message) -> None:
        if m.type is MsgType.APP:
            self._election_elapsed = 0
            self._last_leader_contact = self._tick_count
            self.lead = m.frm
            self._handle_append(m)
        elif m.type is MsgType.HEARTBEAT:
            self._election_elapsed = 0
            self._last_leader_contact = self._tick_count
            self.lead = m.frm
            missing = False
            if FAULT_HEARTBEAT_COMMIT_UNCHECKED in self._faults:
                self.log.commit_to(min(m.commit, self.log.last_index()))  # planted bug
            elif m.commit > self.log.committed:
                if self.log.match_term(m.commit, m.log_term):
                    # Only an entry the leader confirmed we hold, at the term
                    # it holds there: after losing unsynced writes our log may
                    # end with other entries at those indexes (async flush).
                    self.log.commit_to(m.commit)
                elif m.log_term:
                    # We acknowledged that entry and no longer hold it (an
                    # async-mode tail lost to a crash, a replica rebuilt in
                    # place): say so, or a leader with nothing new to send
                    # would believe our acknowledgement for ever. (Term 0:
                    # the leader compacted that entry and cannot tell.)
                    missing = True
            self._send(
                Message(
                    MsgType.HEARTBEAT_RESP,
                    m.frm,
                    self.id,
                    self.term,
                    context=m.context,
                    reject=missing,
                    index=m.commit if missing else 0,
                )
            )
        elif m.type is MsgType.SNAPSHOT:
            self._election_elapsed = 0
            self._last_leader_contact = self._tick_count
            self.lead = m.frm
            self._handle_snapshot(m)
        elif m.type is MsgType.TIMEOUT_NOW and m.frm == self.lead and self._may_campaign():
            # Transfer: campaign at once, bypassing pre-vote and stickiness.
            self._campaign(pre=False, force=True)

    def _handle_append(self, m: Message) -> None:
        committed = self.log.committed
        if m.index < committed and FAULT_ACK_BELOW_COMMIT in self._faults:
            # planted bug (the old rule): acknowledge our commit index blindly
            self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term, index=committed))
            return
        if m.index < committed:
            # A delayed or duplicated append, or a probe below our commit
            # index. Everything we committed must agree with the leader: check
            # the part of the message we can (a mismatch means this replica
            # diverged, e.g. a leader that lost acknowledged but unsynced
            # writes in async flush mode, and must not be hidden by an
            # acknowledgement), then acknowledge only what the message proved.
            self._check_committed_prefix(m)
            verified = min(committed, m.index + len(m.entries))
            if m.index + len(m.entries) <= committed:
                self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term, index=verified))
                return
            k = committed - m.index  # entries[k - 1] is our committed entry
            m = Message(
                MsgType.APP,
                m.to,
                m.frm,
                m.term,
                log_term=m.entries[k - 1].term,
                index=committed,
                entries=m.entries[k:],
                commit=m.commit,
            )
        if self.log.match_term(m.index, m.log_term):
            last_new = m.index + len(m.entries)
            if (
                FAULT_TRUNCATE_WITHOUT_CONFLICT in self._faults
                and m.entries
                and m.entries[0].index > self.log.committed
            ):
                # Broken on purpose: replace the whole suffix even when nothing
                # conflicts, so a delayed append shortens an acknowledged log.
                self.log.append(m.entries)
            else:
                conflict = self._find_conflict(m.entries)
                if conflict:
                    if conflict <= self.log.committed:
                        raise InvariantViolation(
                            f"entry {conflict} conflicts with a committed entry"
                        )
                    self.log.append(m.entries[conflict - m.index - 1 :])
            ahead = FAULT_FOLLOWER_COMMITS_AHEAD in self._faults  # planted bug: no leader commit
            self.log.commit_to(last_new if ahead else min(m.commit, last_new))
            if not (m.no_reply and not m.entries):
                self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term, index=last_new))
        else:
            # Point the leader at the last entry of ours whose term is at most
            # the term it expected at m.index: every entry after it belongs to
            # a term the leader's log cannot agree with there, so the leader
            # can skip all of them in one round trip (etcd's
            # findConflictByTerm; Raft thesis 5.3's "optimization").
            hint, hint_term = self.log.find_conflict_by_term(
                min(m.index, self.log.last_index()), m.log_term
            )
            self._send(
                Message(
                    MsgType.APP_RESP,
                    m.frm,
                    self.id,
                    self.term,
                    index=m.index,
                    reject=True,
                    reject_hint=hint,
                    log_term=hint_term,
                )
            )

    def _handle_snapshot(self, m: Message) -> None:
        meta = m.snapshot
        if meta is None:
            return
        stale_ok = FAULT_INSTALL_STALE_SNAPSHOT in self._faults
        if meta.index <= self.log.committed and not stale_ok:
            # Stale or duplicated: we already hold (and may have applied) more;
            # installing it would roll the state machine back. Acknowledge
            # only what the snapshot proves we share with the leader (its
            # last entry, when we still hold it, must be ours), never our
            # whole commit index unchecked: in async flush mode a leader may
            # hold another history below it, which the appends that follow
            # from ``meta.index`` then reveal (_check_committed_prefix).
            try:
                mine = self.log.term(meta.index)
            except Compacted:
                mine = meta.term  # inside our own snapshot: nothing to compare
            if meta.index > 0 and mine != meta.term:
                raise ReplicaDiverged(
                    f"node {self.id}: the leader {m.frm} (term {m.term}) sent a snapshot at "
                    f"{meta.index}@t{meta.term} but this replica committed "
                    f"{meta.index}@t{mine}: the replicas diverged; rebuild this replica "
                    "from the leader"
                )
            self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term, index=meta.index))
            return
        if self.log.match_term(meta.index, meta.term) and not stale_ok:
            # Our log already holds the snapshot's last entry: it is committed,
            # so just commit up to it and keep our (matching) entries.
            self.log.commit_to(meta.index)
        else:
            self.log.restore(meta, allow_rollback=stale_ok)
            self._installing = Snapshot(meta, m.snapshot_data)
            self.config = meta.config
        self._send(Message(MsgType.APP_RESP, m.frm, self.id, self.term, index=meta.index))

    def _check_committed_prefix(self, m: Message) -> None:
        """Raise ReplicaDiverged if ``m`` shows that the leader's log differs
        from ours at or below our commit index."""
        committed = self.log.committed
        checks = [(m.index, m.log_term)]
        checks += [(e.index, e.term) for e in m.entries if e.index <= committed]
        for index, term in checks:
            try:
                mine = self.log.term(index)
            except Compacted:
                continue  # inside our snapshot: applied, nothing to compare
            if index > 0 and mine != term:
                raise ReplicaDiverged(
                    f"node {self.id}: the leader {m.frm} (term {m.term}) holds "
                    f"{index}@t{term} but this replica committed {index}@t{mine}: "
                    "the replicas diverged; rebuild this replica from the leader"
                )

    def _find_conflict(self, ents: tuple[Entry, ...]) -> int:
        """Index of the first entry that is new or conflicts; 0 if all present."""
        for e in ents:
            if not self.log.match_term(e.index, e.term):
                return e.index
        return 0

    def _safe_term(self, index: int) -> int:
        try:
            return self.log.term(index)
        except Compacted:
            return 0

    # ======================================================================
    # Leader
    # ======================================================================
    def _step_leader(self, m: Message) -> None:
        pr = self._progress.get(m.frm)
        if pr is None:
            return  # not a member (removed): ignore
        if m.type is MsgType.APP_RESP:
            pr.recent_active = True
            if m.reject:
                hint = m.reject_hint
                if m.log_term > 0:
                    # The follower holds at ``hint`` an entry of term
                    # ``m.log_term``: our own last entry of a term <= that is
                    # the furthest point where the two logs can still agree.
                    hint = self.log.find_conflict_by_term(hint, m.log_term)[0]
                if pr.maybe_decr_to(m.index, hint):
                    if pr.state is ProgressState.REPLICATE:
                        pr.become_probe()
                    self._send_append(m.frm)
                return
            was_paused = pr.is_paused()
            if m.index > self.log.last_index():
                # Acknowledging entries we do not have: a replica whose log is
                # longer than ours at a commit we never made. Never record it.
                return
            if pr.maybe_update(m.index):
                if pr.state is ProgressState.PROBE:
                    pr.become_replicate()
                elif pr.state is ProgressState.SNAPSHOT:
                    if pr.match + 1 >= self.log.first_index():
                        pr.become_replicate()  # installed (or caught up otherwise)
                else:
                    pr.free_inflight_to(m.index)
                if self._maybe_commit() and self._commit_moved():
                    pass  # every follower got an append
                elif was_paused:
                    self._send_append(m.frm)
                while self._send_append(m.frm, send_empty=False):
                    pass
                if m.frm == self._transferee and pr.match == self.log.last_index():
                    self._send(Message(MsgType.TIMEOUT_NOW, m.frm, self.id, self.term))
        elif m.type is MsgType.HEARTBEAT_RESP:
            pr.recent_active = True
            pr.probe_sent = False
            if (
                pr.state is ProgressState.SNAPSHOT
                and self._tick_count - pr.snapshot_sent_tick >= self.cfg.snapshot_retry_ticks
            ):
                pr.become_probe()  # the snapshot or its answer was lost: try again
            # The follower lacks an entry it acknowledged (see the
            # follower's side): probe from its acknowledgement down, the
            # probe's rejection moves ``match`` back (maybe_decr_to).
            lost = m.reject and m.index <= pr.match and pr.state is not ProgressState.SNAPSHOT
            if lost:
                pr.become_probe()
            elif pr.state is ProgressState.REPLICATE and pr.is_paused():
                pr.free_first_inflight()
            if lost or pr.match < self.log.last_index():
                # Entries sent and never acknowledged (or an answer lost, or
                # the probe): this append asks for an answer even when it
                # carries no entries.
                self._send_append(m.frm, want_reply=True)
            if m.context > self._acked_round.get(m.frm, 0):
                self._acked_round[m.frm] = m.context
                self._update_lease()

    def _propose(self, etype: EntryType, data: bytes) -> int:
        if self.role is not Role.LEADER:
            raise NotLeader(self.lead)
        if self._transferee != NONE:
            raise TransferInProgress(f"leadership is being transferred to node {self._transferee}")
        idx = self._append_entry(etype, data)
        self._pending_bcast = True
        self._active_tick = self._tick_count
        return idx

    def _append_entry(self, etype: EntryType, data: bytes) -> int:
        idx = self.log.last_index() + 1
        self.log.append([Entry(idx, self.term, etype, data, self.log.last_end_pos())])
        return idx

    def _flush_pending(self) -> None:
        if self._pending_bcast and self.role is Role.LEADER:
            self._bcast_append()
        self._pending_bcast = False
        if self._need_read_round and self.role is Role.LEADER:
            self._bcast_heartbeat()
        self._need_read_round = False

    def _commit_moved(self) -> bool:
        """The commit index moved: tell the followers now (a commit-only
        append each, True) or, with ``commit_notify_ticks``, let the next
        append or heartbeat carry it and arm the notice for the followers
        that get neither (False). With one request at a time the next
        request's append carries it, and the commit-only append (one frame,
        one loop pass per follower and message) is never sent."""
        if not self.cfg.commit_notify_ticks:
            self._bcast_append()
            return True
        if self._commit_notify_at < 0:
            self._commit_notify_at = self._tick_count + self.cfg.commit_notify_ticks
        return False

    def _notify_commit(self) -> None:
        """Due: whatever is due (a commit-only append at least) to each
        follower not yet told the commit index; under steady load that is
        one frame per follower and tick instead of one per commit."""
        self._commit_notify_at = -1
        committed = self.log.committed
        for nid in sorted(self._progress):
            if nid != self.id and self._progress[nid].commit_sent < committed:
                self._send_append(nid)

    def _bcast_append(self) -> None:
        for nid in sorted(self._progress):
            if nid != self.id:
                self._send_append(nid)

    def _send_append(self, to: int, send_empty: bool = True, want_reply: bool = False) -> bool:
        pr = self._progress[to]
        if pr.is_paused():
            return False
        prev = pr.next - 1
        try:
            prev_term = self.log.term(prev)
            ents = self.log.entries(pr.next, self.log.last_index() + 1, self.cfg.max_msg_bytes)
        except Compacted:
            # The follower needs entries we dropped: send our snapshot.
            self._send_snapshot(to, pr)
            return False
        if not ents and not send_empty:
            return False
        self._send(
            Message(
                MsgType.APP,
                to,
                self.id,
                self.term,
                log_term=prev_term,
                index=prev,
                entries=tuple(ents),
                commit=self.log.committed,
                # Nothing to append to a replicating follower: the message
                # only moves its commit index, and its answer would tell us
                # nothing (heartbeats keep the follower's activity and the
                # lease). Either everything is acknowledged, or the answer to
                # the entries already sent is on its way: asking again made
                # the slower follower of a one-message commit answer twice
                # (0.57 extra frames per message with one client). A lost
                # answer is asked for on the next heartbeat answer that shows
                # the follower behind (``want_reply``). With one message per
                # request this is one frame less per follower per request,
                # and one loop pass less on the leader. A follower that
                # rejects it (its log lost the tail it acknowledged) still
                # answers.
                no_reply=not ents
                and pr.state is ProgressState.REPLICATE
                and (pr.match == prev or not want_reply),
            )
        )
        pr.sent_entries(
            ents[-1].index if ents else None, sum(len(e.data) for e in ents) + 32 * len(ents)
        )
        pr.commit_sent = self.log.committed
        return True

    def _send_snapshot(self, to: int, pr: Progress) -> None:
        snap = self._snapshot
        if snap is None or snap.index + 1 < self.log.first_index():
            # Compacted without a snapshot that covers the gap (retention
            # outside the core): nothing we can send; keep probing.
            return
        pr.become_snapshot(snap.index, self._tick_count)
        self._snap_msgs.append(
            Message(
                MsgType.SNAPSHOT,
                to,
                self.id,
                self.term,
                log_term=snap.term,
                index=snap.index,
                commit=self.log.committed,
                snapshot=snap,
            )
        )

    def _bcast_heartbeat(self) -> None:
        if self._idle():
            self.idle_rounds += 1
        self._hb_round += 1
        self._hb_sent_tick[self._hb_round] = self._tick_count
        for nid in sorted(self._progress):
            if nid == self.id:
                continue
            pr = self._progress[nid]
            commit = min(pr.match, self.log.committed)
            pr.commit_sent = max(pr.commit_sent, commit)
            self._send(
                Message(
                    MsgType.HEARTBEAT,
                    nid,
                    self.id,
                    self.term,
                    commit=commit,
                    # The follower commits only if it holds this very entry:
                    # ``pr.match`` may be stale (an async-mode follower that
                    # lost its unsynced tail since it acknowledged it).
                    log_term=self._safe_term(commit),
                    context=self._hb_round,
                )
            )
        self._update_lease()  # a single-voter cluster is its own quorum

    def _update_lease(self) -> None:
        rounds = sorted(
            (
                self._hb_round if nid == self.id else self._acked_round.get(nid, 0)
                for nid in self.config.voters
            ),
            reverse=True,
        )
        if not rounds or self.config.quorum() > len(rounds):
            return
        q_round = rounds[self.config.quorum() - 1]
        if q_round <= 0 or q_round not in self._hb_sent_tick:
            return
        start = self._hb_sent_tick[q_round]
        for r in [r for r in self._hb_sent_tick if r < q_round]:
            del self._hb_sent_tick[r]
        if (
            not self._lease_disabled
            and self._transferee == NONE
            and q_round >= self._lease_min_round
        ):
            self._lease_expiry_tick = max(self._lease_expiry_tick, start + self.cfg.lease_ticks)
        if self._pending_reads:
            done = [p for p in self._pending_reads if p[1] <= q_round]
            self._pending_reads = [p for p in self._pending_reads if p[1] > q_round]
            for ctx, _, index in done:
                self._read_states.append(ReadState(ctx, index, ReadMode.READ_INDEX))

    def _serve_read(self, ctx: int) -> None:
        if self.lease_valid():
            self._read_states.append(ReadState(ctx, self.log.committed, ReadMode.LEASE))
            return
        # ReadIndex: the commit index now, confirmed by a quorum acknowledging
        # a heartbeat round sent after this request (batched per Ready).
        self._pending_reads.append((ctx, self._hb_round + 1, self.log.committed))
        self._need_read_round = True
        if len(self.config.voters) == 1 and self.config.is_voter(self.id):
            self._flush_pending()

    def _fail_pending_reads(self) -> None:
        for ctx, _, _ in self._pending_reads:
            self._read_failures.append(ReadFailed(ctx, self.lead))
        for ctx in self._reads_before_commit:
            self._read_failures.append(ReadFailed(ctx, self.lead))
        self._pending_reads = []
        self._reads_before_commit = []

    def _committed_in_term(self) -> bool:
        return self._safe_term(self.log.committed) == self.term

    def _maybe_commit(self) -> bool:
        matches = sorted(
            (self._progress[nid].match for nid in self.config.voters if nid in self._progress),
            reverse=True,
        )
        q = self.config.quorum()
        if len(matches) < q:
            return False
        n = matches[q - 1]
        if n <= self.log.committed:
            return False
        if FAULT_COMMIT_OLD_TERM not in self._faults and self._safe_term(n) != self.term:
            # Raft section 5.4.2: only entries of the current term are committed
            # by counting replicas (figure 8).
            return False
        self.log.commit_to(n)
        if self._reads_before_commit and self._committed_in_term():
            waiting, self._reads_before_commit = self._reads_before_commit, []
            for ctx in waiting:
                self._serve_read(ctx)
        return True

    def _quorum_active(self) -> bool:
        active = sum(
            1
            for nid in self.config.voters
            if nid in self._progress and (nid == self.id or self._progress[nid].recent_active)
        )
        return active >= self.config.quorum()

    # ======================================================================
    # Membership
    # ======================================================================
    def _config_at(self, applied: int) -> ClusterConfig:
        cfg = self.cfg.peers
        lo = self.log.first_index()
        if self._snapshot is not None:
            # The snapshot records the membership as of its index; only the
            # changes after it are replayed from the log.
            cfg = self._snapshot.config
            lo = self._snapshot.index + 1
        if applied >= lo:
            for e in self.log.conf_entries(lo, applied + 1):
                cfg = cfg.apply(decode_conf_change(e.data))
        return cfg

    def _apply_conf_change(self, cc: ConfChange) -> None:
        self.config = self.config.apply(cc)
        if self.role is not Role.LEADER:
            if not self._promotable() and self.role in (Role.PRE_CANDIDATE, Role.CANDIDATE):
                self._become_follower(self.term, NONE)
            return
        if not self._promotable():
            # We were removed (or demoted): step down; the rest elect a leader.
            # Membership takes effect at apply time, so the others can elect
            # one only once they know our removal committed: tell them now
            # (a heartbeat carries the commit index each one is confirmed to
            # hold), or a survivor left with the old configuration could wait
            # for our vote for ever once we are shut down (found by the
            # simulator). An operator still waits for the others to apply it
            # (or transfers leadership first) before stopping this node.
            self._bcast_heartbeat()
            self._become_follower(self.term, NONE)
            return
        members = set(self.config.members())
        for nid in list(self._progress):
            if nid not in members:
                del self._progress[nid]
                self._acked_round.pop(nid, None)
        for nid in sorted(members):
            if nid not in self._progress:
                pr = Progress(
                    self.log.last_index() + 1,
                    self.cfg.max_inflight_msgs,
                    True,
                    self.cfg.max_inflight_bytes,
                )
                self._progress[nid] = pr
            self._progress[nid].is_learner = self.config.is_learner(nid)
        if self._transferee != NONE and not self.config.is_voter(self._transferee):
            self._transferee = NONE
        self._maybe_commit()
        self._bcast_append()

    # ======================================================================
    # Helpers
    # ======================================================================
    def _send(self, m: Message) -> None:
        self._msgs.append(m)

    def _hard_state(self) -> HardState:
        vote = self.vote
        if FAULT_SKIP_VOTE_PERSIST in self._faults:
            vote = NONE
        return HardState(self.term, vote, self.log.committed)

    def _visible_role(self) -> Role:
        if self.role is Role.FOLLOWER and not self.config.is_voter(self.id):
            return Role.LEARNER
        return self.role

    def _soft_state(self) -> SoftState:
        return SoftState(self._visible_role(), self.lead, self.term)
