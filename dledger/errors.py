"""The dledger error hierarchy. The HTTP layer maps these to status codes."""

from __future__ import annotations


class DLedgerError(Exception):
    """Base class of every error the replicated log raises on purpose."""

    code = "DLEDGER_ERROR"


class ConfigError(DLedgerError):
    code = "CONFIG_ERROR"


class NotLeader(DLedgerError):
    """This node cannot serve the request; ``leader_hint`` is 0 when unknown."""

    code = "NOT_LEADER"

    def __init__(self, leader_hint: int, message: str = "") -> None:
        self.leader_hint = leader_hint
        super().__init__(message or f"not the leader (leader hint: {leader_hint or 'unknown'})")


class ProposalDropped(DLedgerError):
    """The proposal was refused (for example during a leadership transfer)."""

    code = "PROPOSAL_DROPPED"


class TransferInProgress(ProposalDropped):
    code = "TRANSFER_IN_PROGRESS"


class Overloaded(DLedgerError):
    code = "OVERLOADED"


class Unavailable(DLedgerError):
    """The group cannot take this write now, and said so before taking it
    (for example: controller mode's SyncStateSet is below
    ``min_in_sync_replicas``). 503, retry later."""

    code = "UNAVAILABLE"


class CatchingUp(Unavailable):
    """This replica installed a snapshot after the record was written and
    has not yet applied the entry that dropped it from the cluster (the
    record is in no entry it holds). 503: ask another replica, or again."""

    code = "CATCHING_UP"


class Compacted(DLedgerError):
    """The requested log index was removed by front truncation."""

    code = "COMPACTED"


class StorageCorrupted(DLedgerError):
    """A record failed its CRC or structural check; it is never served."""

    code = "STORAGE_CORRUPTED"

    def __init__(self, message: str, index: int | None = None) -> None:
        self.index = index
        super().__init__(message)


class ReplicaDiverged(StorageCorrupted):
    """This replica's committed log disagrees with the leader's: it holds an
    entry at or below its commit index that the leader's log does not. Raft
    never lets that happen while every acknowledged write is durable; it can
    after a power loss of a majority in ``flush = "async"`` mode. The node
    stops (exit 2, as for corruption) and must be rebuilt from the leader
    rather than serve a history the leader does not have."""

    code = "REPLICA_DIVERGED"


class StorageFailed(DLedgerError):
    """The disk refused a write or an fsync (EIO, ENOSPC, ...): this node
    cannot make its log durable. The storage refuses every later write and
    fsync (it never retries a failed fsync: after one, Linux may have
    dropped the data and report the next fsync as a success, PostgreSQL's
    "fsyncgate"); the node stops without acknowledging anything of the
    failed batch (exit code 3). Restart it once the disk is healthy: it
    recovers from what it had made durable."""

    code = "DISK_FAILED"


class CodecError(DLedgerError):
    """Bytes that do not decode: wrong magic, version, length or CRC."""

    code = "CODEC_ERROR"


class InvariantViolation(AssertionError):
    """A protocol invariant broke. Raised, never swallowed."""
