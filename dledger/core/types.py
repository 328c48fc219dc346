"""Value types shared by the Raft core, storage, transport and runtime.

Everything here is an immutable value: entries, messages, hard state, the
cluster configuration and the ``Ready`` batch the core hands to its driver.
The byte encodings live in :mod:`dledger.core.codec`; nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dledger.errors import ConfigError

NONE = 0
"""Node id meaning "nobody" (no vote, no known leader). Real ids are >= 1."""


class EntryType(enum.IntEnum):
    NORMAL = 0
    NOOP = 1  # appended by every new leader (Raft section 8)
    CONF_CHANGE = 2


@dataclass(frozen=True, slots=True)
class Entry:
    """One Raft log entry.

    ``pos`` is the CommitLog position of the entry's first byte: entry ``i``
    occupies ``[pos, pos + len(data))``. The leader assigns it on append as the
    end of the previous entry, so every replica agrees on it (log matching).
    """

    index: int
    term: int
    type: EntryType = EntryType.NORMAL
    data: bytes = b""
    pos: int = 0

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def end_pos(self) -> int:
        return self.pos + len(self.data)


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be durable before any message that depends on it is sent."""

    term: int = 0
    vote: int = NONE
    commit: int = 0


class MsgType(enum.IntEnum):
    APP = 1  # AppendEntries
    APP_RESP = 2
    HEARTBEAT = 3
    HEARTBEAT_RESP = 4
    VOTE = 5
    VOTE_RESP = 6
    PRE_VOTE = 7
    PRE_VOTE_RESP = 8
    TIMEOUT_NOW = 9  # leadership transfer: campaign at once
    SNAPSHOT = 10  # InstallSnapshot: the follower needs entries the leader compacted


@dataclass(frozen=True, slots=True)
class Message:
    """A peer message. One flat shape for every kind, as etcd's raftpb does.

    Field use by kind:
      APP:            index/log_term = the entry before ``entries``; commit;
                      no_reply = an append without entries that only carries
                      the commit index to a follower that acknowledged
                      everything before it: answered only if rejected
      APP_RESP:       index = last index the sender now matches (success) or
                      the rejected ``index`` (reject); reject_hint = the
                      sender's last index; log_term = term at reject_hint
      HEARTBEAT:      commit (clamped to the receiver's match); context =
                      heartbeat round number (the lease and ReadIndex clock)
      HEARTBEAT_RESP: context echoed
      VOTE/PRE_VOTE:  index/log_term = candidate's last entry; force = sent
                      because of a leadership transfer (bypasses stickiness)
      SNAPSHOT:       snapshot = its meta, snapshot_data = the application's
                      opaque state (filled in by the driver, see Ready);
                      commit; answered with APP_RESP(index = snapshot index)
      *_RESP:         reject
    """

    type: MsgType
    to: int
    frm: int
    term: int
    log_term: int = 0
    index: int = 0
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0
    context: int = 0
    force: bool = False
    snapshot: SnapshotMeta | None = None
    snapshot_data: bytes = b""
    no_reply: bool = False


class ConfChangeType(enum.IntEnum):
    ADD_VOTER = 1
    ADD_LEARNER = 2
    REMOVE_NODE = 3
    PROMOTE_LEARNER = 4


@dataclass(frozen=True, slots=True)
class ConfChange:
    type: ConfChangeType
    node_id: int


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Membership: who votes and who only listens. Ids are sorted tuples."""

    voters: tuple[int, ...]
    learners: tuple[int, ...] = ()

    def quorum(self) -> int:
        return len(self.voters) // 2 + 1

    def is_voter(self, node_id: int) -> bool:
        return node_id in self.voters

    def is_learner(self, node_id: int) -> bool:
        return node_id in self.learners

    def members(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.voters) | set(self.learners)))

    def apply(self, cc: ConfChange) -> ClusterConfig:
        voters = set(self.voters)
        learners = set(self.learners)
        nid = cc.node_id
        if cc.type is ConfChangeType.ADD_VOTER:
            learners.discard(nid)
            voters.add(nid)
        elif cc.type is ConfChangeType.ADD_LEARNER:
            if nid not in voters:
                learners.add(nid)
        elif cc.type is ConfChangeType.REMOVE_NODE:
            voters.discard(nid)
            learners.discard(nid)
        elif cc.type is ConfChangeType.PROMOTE_LEARNER and nid in learners:
            learners.discard(nid)
            voters.add(nid)
        return ClusterConfig(tuple(sorted(voters)), tuple(sorted(learners)))


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    """Describes an application snapshot taken at applied index ``index``.

    ``term`` and ``end_pos`` are the term and end CommitLog position of entry
    ``index`` (so the log can be matched and continued right after it);
    ``config`` is the membership in force once ``index`` is applied. The
    snapshot payload itself is opaque bytes owned by the application."""

    index: int
    term: int
    end_pos: int
    config: ClusterConfig


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot to install: its meta and the application's opaque payload."""

    meta: SnapshotMeta
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class Compaction:
    """The driver may drop log entries below ``upto`` (``LogStorage.compact``);
    ``term`` and ``pos`` describe entry ``upto - 1``."""

    upto: int
    term: int
    pos: int


class Role(enum.IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3
    LEARNER = 4  # a follower that is not a voter in its current config


@dataclass(frozen=True, slots=True)
class SoftState:
    role: Role
    leader: int
    term: int


class ReadMode(enum.IntEnum):
    LEASE = 1  # answered locally: the leader held a valid lease
    READ_INDEX = 2  # answered after a quorum acknowledged a heartbeat round


@dataclass(frozen=True, slots=True)
class ReadState:
    """A read request the leader may now serve once ``applied >= index``."""

    ctx: int
    index: int
    mode: ReadMode


@dataclass(frozen=True, slots=True)
class ReadFailed:
    """A read request the leader can no longer serve (it stepped down)."""

    ctx: int
    leader_hint: int


EARLY_SEND_TYPES = frozenset({MsgType.APP, MsgType.HEARTBEAT})
"""Message kinds a driver may send before persisting the Ready (see Ready)."""

MID_WRITE_TYPES = frozenset({MsgType.APP_RESP, MsgType.HEARTBEAT_RESP})
"""Message kinds a leader's driver may step, when of the leader's term, while
the last Ready's write runs (see ``RawNode.take_durable_committed``)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """One batch of work for the driver. The order is the contract:

    1. ``entries`` (to append, replacing any conflicting suffix of the stored
       log) and ``hard_state`` (when not None) are written to stable storage
       and synced, in one transaction, BEFORE any message is sent, with one
       exception: a leader's APP and HEARTBEAT messages (``EARLY_SEND_TYPES``)
       may go out before or while the write happens (Raft thesis 10.2.1). The
       leader counts its own copy toward commit only after ``advance``, so an
       entry still commits only once a quorum holds it durably; and the core
       never puts such a message into a Ready that changes the term or vote
       (it holds them for the next Ready), so the term and vote they depend
       on are durable before they leave;
    2. then the other ``messages`` are sent;
    3. then ``committed_entries`` are applied to the state machine in order
       (they are already durable on a quorum; some may be in ``entries`` of
       this same Ready, which step 1 made durable here too). A leader may
       apply them before step 1 instead when all are below ``entries``
       (durable here since earlier Readies), and then, while step 1 runs,
       step messages of ``MID_WRITE_TYPES`` of its term and apply what
       :meth:`RawNode.take_durable_committed` returns, in that order;
    4. ``read_states`` may be answered once the state machine has applied
       ``index``; ``read_failures`` are answered with an error at once;
    5. then ``advance(ready)`` is called.

    Snapshots. ``snapshot`` (when not None) is a snapshot received from the
    leader that replaces this node's log: in step 1, BEFORE ``entries`` are
    appended, the driver restores its state machine from ``snapshot.data``,
    saves the snapshot durably and resets the stored log to it (first index
    ``meta.index + 1``, term of ``meta.index`` = ``meta.term``, front position
    ``meta.end_pos``), all synced before any message is sent: the
    acknowledgement to the leader is among ``messages``.
    ``snapshots_to_send`` are SNAPSHOT messages for followers that need
    entries the leader compacted; the driver sends each (step 2) with
    ``snapshot_data`` set to the application's snapshot payload at
    ``m.snapshot.index``.
    """

    soft_state: SoftState | None = None
    hard_state: HardState | None = None
    entries: tuple[Entry, ...] = ()
    messages: tuple[Message, ...] = ()
    committed_entries: tuple[Entry, ...] = ()
    read_states: tuple[ReadState, ...] = ()
    read_failures: tuple[ReadFailed, ...] = ()
    # entries, a snapshot, a new term or vote, or a commit index covering a
    # membership change to make durable before anything of this Ready goes on
    must_sync: bool = False
    snapshot: Snapshot | None = None
    snapshots_to_send: tuple[Message, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.snapshot is not None
            or self.snapshots_to_send
            or self.soft_state
            or self.hard_state
            or self.entries
            or self.messages
            or self.committed_entries
            or self.read_states
            or self.read_failures
        )


@dataclass(frozen=True, slots=True)
class RaftConfig:
    """Core configuration, in logical ticks. ``validate()`` raises ConfigError."""

    node_id: int
    peers: ClusterConfig
    election_ticks: int = 10
    heartbeat_ticks: int = 1
    # An idle leader's round interval (0: always heartbeat_ticks); see
    # RawNode._idle. Between heartbeat_ticks and election_ticks - 1.
    idle_heartbeat_ticks: int = 0
    lease_drift_ticks: int = 2
    # A commit index that moved reaches the followers on the next append or
    # heartbeat sent to them; one that got neither within this many ticks
    # gets a commit-only append then. 0: a commit-only append to every
    # follower at once (etcd's way), one more frame per follower and message
    # when requests come one at a time.
    commit_notify_ticks: int = 0
    max_inflight_msgs: int = 256
    max_inflight_bytes: int = 8 << 20  # entry bytes in flight per follower (0: unbounded)
    max_msg_bytes: int = 1 << 20
    max_apply_bytes: int = 8 << 20
    transfer_max_lag: int = 1024
    log_cache_entries_max: int = 65536  # recently persisted entries kept in memory
    log_cache_bytes_max: int = 64 << 20
    snapshot_trailing_entries: int = 1024  # kept behind a snapshot for slow followers
    snapshot_retry_ticks: int = 20  # resend a snapshot nobody acknowledged
    check_quorum: bool = True
    pre_vote: bool = True
    clock_drift_max: float = 0.01  # bound on any node's tick-rate error (1 = 100%)
    faults: frozenset[str] = field(default_factory=frozenset)

    @property
    def lease_ticks(self) -> int:
        return self.election_ticks - self.lease_drift_ticks

    def lease_margin_ticks(self) -> float:
        """How much real time, in nominal ticks, is left between the end of a
        leader's lease and the earliest moment another leader can be elected:

            (election_ticks - 1) * (1 - d)  -  lease_ticks * (1 + d)

        with ``d = clock_drift_max``. Both ends count from the send of the
        heartbeat round a quorum acknowledged. A follower that received it
        refuses votes until its own tick count has moved ``election_ticks``
        past the tick it received it in, i.e. for at least ``election_ticks -
        1`` of its ticks, which a fast clock makes as short as ``(E - 1)(1 -
        d)`` nominal ticks. The leader stops serving lease reads once its tick
        count reaches ``send tick + lease_ticks``, at most ``lease_ticks (1 +
        d)`` nominal ticks after the send if its clock is slow. A lease read is
        safe if the leader decides it within that margin of reading its
        clock: the driver ticks up to the clock right before each lease
        decision, and a driver whose loop stalled longer than the margin (a
        pause between reading the clock and acting on it) calls
        ``RawNode.suspend_lease()``. ``validate()`` refuses a configuration
        whose margin is not positive. Defaults (E=15, drift ticks 3, d=1%):
        1.74 ticks, 35 ms at 20 ms per tick."""
        d = self.clock_drift_max
        return (self.election_ticks - 1) * (1 - d) - self.lease_ticks * (1 + d)

    def validate(self) -> None:
        if self.node_id <= 0:
            raise ConfigError("node_id must be >= 1")
        if self.heartbeat_ticks <= 0:
            raise ConfigError("heartbeat_ticks must be >= 1")
        if self.election_ticks <= self.heartbeat_ticks:
            raise ConfigError("election_ticks must be greater than heartbeat_ticks")
        if self.idle_heartbeat_ticks and not (
            self.heartbeat_ticks <= self.idle_heartbeat_ticks < self.election_ticks
        ):
            raise ConfigError(
                "idle_heartbeat_ticks must be 0 (off), -1 (auto, in a cluster file) or within "
                "heartbeat_ticks..election_ticks - 1"
            )
        if self.lease_drift_ticks < 1 or self.lease_ticks < 1:
            raise ConfigError("lease_drift_ticks must be in [1, election_ticks)")
        if not 0 <= self.commit_notify_ticks <= self.heartbeat_ticks:
            raise ConfigError("commit_notify_ticks must be in [0, heartbeat_ticks]")
        if not 0 <= self.clock_drift_max < 0.5:
            raise ConfigError("clock_drift_max must be in [0, 0.5)")
        if self.check_quorum and self.lease_margin_ticks() <= 0:
            raise ConfigError(
                f"the lease has no safety margin: (election_ticks - 1) * (1 - clock_drift_max) "
                f"must exceed lease_ticks * (1 + clock_drift_max) "
                f"({self.election_ticks - 1} * {1 - self.clock_drift_max:g} <= "
                f"{self.lease_ticks} * {1 + self.clock_drift_max:g}); raise lease_drift_ticks"
            )
        if self.max_inflight_msgs < 1 or self.max_msg_bytes < 1:
            raise ConfigError("max_inflight_msgs and max_msg_bytes must be >= 1")
        if self.max_inflight_bytes < 0:
            raise ConfigError("max_inflight_bytes must be >= 0 (0: no byte bound)")
        if self.snapshot_trailing_entries < 0 or self.snapshot_retry_ticks < 1:
            raise ConfigError("snapshot_trailing_entries >= 0 and snapshot_retry_ticks >= 1")
        if self.transfer_max_lag < 0:
            raise ConfigError("transfer_max_lag must be >= 0")
        if not self.peers.voters:
            raise ConfigError("the initial configuration needs at least one voter")
        if set(self.peers.voters) & set(self.peers.learners):
            raise ConfigError("a node cannot be both voter and learner")
