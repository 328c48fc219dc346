"""The epoch file of controller mode: epoch -> start offset of the CommitLog.

Theory of operation
-------------------
In controller mode (RocketMQ 5's design, see :mod:`dledger.cmode`) a broker
group's master writes the CommitLog and the controller elects masters. Each
election gives the new master a new **epoch**, and the master records
``(epoch, start offset)`` before it appends anything: the CommitLog from
``start`` up to the next epoch's start was written by that epoch's master.
Every replica keeps the same map for the bytes it holds (a slave copies
the master's entries as it replicates past each epoch's start).

Invariants of an :class:`EpochMap`: epochs strictly increase and start
offsets never decrease (an epoch whose master wrote nothing has the same
start as the next one); the last epoch's end is the replica's max offset
(not stored: the CommitLog's length says it).

**Where two logs fork** (:func:`last_consistent_point`, RocketMQ's
``findLastConsistentPoint``): going from the newest epoch back, the first
epoch both maps hold *with the same start offset* is the newest stretch of
log both replicas received from the same master; the two logs agree up to
the smaller of the two ends of that epoch (each replica's end of an epoch
is the next epoch's start in its own map, or its max offset). Before that
point both hold the same bytes (one master per epoch, and a slave only
ever copies a prefix of its master's log); after it they may differ.

**What a slave does on joining a master** (:func:`join_decision`): the
article's six cases of the slave's ``[min, max]`` against the master's
(first digit: where the slave's min falls, second: where its max falls;
1: at or below the master's min, 2: inside the master's range, 3: past the
master's max):

* 1-1 (slave max <= master min): nothing in common is left on the master;
  the slave drops its log and copies from the master's min;
* 1-2, 2-2 (master min < slave max <= master max) and 1-3, 2-3 (slave max
  > master max): truncate to the last consistent point, then follow (1-3
  and 2-3 lose the slave's unconfirmed tail: a new master that was behind,
  an unclean election or two masters during a partition);
* 3-3 (slave min > master max): the master lost data the slave holds
  beyond anything the master has: manual intervention, the slave refuses.

Two logs with no epoch in common agree only on the empty prefix: the slave
starts over from 0 when the master's log starts there (an unclean election
of a replica that never received the old epochs), and refuses otherwise.

Encoding (the epoch file, one per replica): magic ``DLEP``, version byte,
count, then ``(epoch u64, start u64)`` pairs, then a CRC32 of everything
before it. A file that fails its CRC is damaged and is never used.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from dledger.errors import StorageCorrupted

_MAGIC = b"DLEP"
_VERSION = 1
_HEAD = struct.Struct(">4sBI")
_PAIR = struct.Struct(">QQ")
_CRC = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class EpochEntry:
    epoch: int
    start: int


class EpochMap:
    """A replica's ``epoch -> start offset`` map (see the module docstring)."""

    def __init__(self, entries: list[EpochEntry] | None = None) -> None:
        self._entries: list[EpochEntry] = []
        for e in entries or []:
            self.append(e.epoch, e.start)

    def __iter__(self) -> Iterator[EpochEntry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EpochMap) and self._entries == other._entries

    def __repr__(self) -> str:
        return "EpochMap(" + ", ".join(f"<{e.epoch},{e.start}>" for e in self._entries) + ")"

    @property
    def last(self) -> EpochEntry | None:
        return self._entries[-1] if self._entries else None

    def append(self, epoch: int, start: int) -> None:
        """A new epoch starts at ``start`` (the CommitLog's max offset when its
        master begins, or where a slave copying it reached its start)."""
        last = self.last
        if last is not None:
            if epoch <= last.epoch:
                raise ValueError(f"epoch {epoch} after epoch {last.epoch}: epochs must increase")
            if start < last.start:
                raise ValueError(f"epoch {epoch} starts at {start}, before {last.start}")
        if start < 0:
            raise ValueError(f"negative start offset {start}")
        self._entries.append(EpochEntry(epoch, start))

    def find(self, epoch: int) -> EpochEntry | None:
        for e in self._entries:
            if e.epoch == epoch:
                return e
        return None

    def end_of(self, epoch: int, max_offset: int) -> int | None:
        """Where ``epoch``'s stretch of this replica's log ends: the next
        epoch's start, or ``max_offset`` for the last one."""
        for k, e in enumerate(self._entries):
            if e.epoch == epoch:
                return self._entries[k + 1].start if k + 1 < len(self._entries) else max_offset
        return None

    def epoch_at(self, offset: int) -> int | None:
        """The epoch whose master wrote the byte at ``offset`` (None: before
        the first epoch)."""
        found = None
        for e in self._entries:
            if e.start <= offset:
                found = e.epoch
            else:
                break
        return found

    def truncate_to(self, offset: int) -> None:
        """The log was cut to ``offset`` bytes: drop every epoch that starts
        at or after it. (One starting exactly there has no bytes left, and
        the next bytes this replica receives may be another epoch's.)"""
        self._entries = [e for e in self._entries if e.start < offset]

    def copy_from(self, master: EpochMap, start: int, end: int) -> None:
        """This replica copied the master's bytes ``[start, end)``: record the
        master's epochs those bytes belong to (``start`` is where the two
        logs agree, so the epoch covering the byte before it is the same)."""
        for e in master:
            if e.start >= end:
                break
            nxt = master.end_of(e.epoch, end)
            assert nxt is not None
            if nxt <= start or nxt == e.start:
                continue  # entirely before the copied range, or no bytes
            last = self.last
            if last is not None and last.epoch == e.epoch:
                continue
            self.append(e.epoch, max(e.start, start))

    def drop_before(self, min_offset: int) -> None:
        """The log's head before ``min_offset`` was deleted (retention): keep
        the epoch that covers ``min_offset`` and every later one."""
        keep = [e for e in self._entries if e.start > min_offset]
        covering = [e for e in self._entries if e.start <= min_offset]
        self._entries = covering[-1:] + keep

    # -- the file --------------------------------------------------------------------
    def encode(self) -> bytes:
        body = _HEAD.pack(_MAGIC, _VERSION, len(self._entries)) + b"".join(
            _PAIR.pack(e.epoch, e.start) for e in self._entries
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, data: bytes, what: str = "epoch file") -> EpochMap:
        """Raises StorageCorrupted for anything but a whole, valid file."""
        if len(data) < _HEAD.size + _CRC.size:
            raise StorageCorrupted(f"{what}: truncated ({len(data)} bytes)")
        body, (crc,) = data[: -_CRC.size], _CRC.unpack_from(data, len(data) - _CRC.size)
        if zlib.crc32(body) != crc:
            raise StorageCorrupted(f"{what}: CRC mismatch")
        magic, version, count = _HEAD.unpack_from(body, 0)
        if magic != _MAGIC:
            raise StorageCorrupted(f"{what}: not an epoch file")
        if version != _VERSION:
            raise StorageCorrupted(f"{what}: version {version}, this build reads {_VERSION}")
        if len(body) != _HEAD.size + count * _PAIR.size:
            raise StorageCorrupted(f"{what}: {count} epochs do not fit {len(body)} bytes")
        try:
            return cls(
                [
                    EpochEntry(*_PAIR.unpack_from(body, _HEAD.size + k * _PAIR.size))
                    for k in range(count)
                ]
            )
        except ValueError as exc:
            raise StorageCorrupted(f"{what}: {exc}") from None


def last_consistent_point(
    local: EpochMap, local_max: int, remote: EpochMap, remote_max: int | None
) -> int:
    """The offset up to which ``local`` and ``remote`` hold the same bytes,
    -1 when they share no epoch. ``remote_max`` None: the remote is the
    master of its last epoch and still writing it (its end is open)."""
    for e in reversed(list(local)):
        other = remote.find(e.epoch)
        if other is None or other.start != e.start:
            continue
        mine = local.end_of(e.epoch, local_max)
        assert mine is not None
        last_remote = remote.last
        if remote_max is None and last_remote is not None and last_remote.epoch == e.epoch:
            return mine
        theirs = remote.end_of(e.epoch, remote_max if remote_max is not None else 0)
        assert theirs is not None
        return min(mine, theirs)
    return -1


class JoinAction(enum.Enum):
    FOLLOW = "follow"  # truncate to ``offset`` (maybe a no-op), then copy from there
    RESET = "reset"  # drop the whole log, copy from the master's min (case 1-1)
    REFUSE = "refuse"  # case 3-3, or no common point: an operator must decide


@dataclass(frozen=True, slots=True)
class JoinDecision:
    case: str  # "1-1", "1-2", "2-2", "1-3", "2-3", "3-3", or "empty"
    action: JoinAction
    offset: int  # where the slave's log ends after truncation / starts after a reset
    lost_bytes: int  # how much of the slave's log the decision drops
    reason: str


def _where(x: int, lo: int, hi: int) -> int:
    return 1 if x <= lo else (2 if x <= hi else 3)


def join_decision(
    slave_min: int,
    slave_max: int,
    slave_epochs: EpochMap,
    master_min: int,
    master_max: int,
    master_epochs: EpochMap,
) -> JoinDecision:
    """What a slave does with its log when it (re)joins a master; see the
    module docstring for the six cases."""
    if slave_max <= slave_min:
        # Nothing stored: copy from the master's min (its whole retained log).
        return JoinDecision(
            "empty", JoinAction.RESET, master_min, 0, "the slave holds no log: copy from min"
        )
    case = (
        f"{_where(slave_min, master_min, master_max)}-{_where(slave_max, master_min, master_max)}"
    )
    if case == "1-1":
        return JoinDecision(
            case,
            JoinAction.RESET,
            master_min,
            slave_max - slave_min,
            "the slave's log ends before the master's retained log begins",
        )
    if case == "3-3":
        return JoinDecision(
            case,
            JoinAction.REFUSE,
            slave_max,
            0,
            "the slave's whole log lies beyond the master's max: the master lost data; "
            "manual intervention",
        )
    point = last_consistent_point(slave_epochs, slave_max, master_epochs, None)
    if point < 0:
        # No epoch in common: the logs agree on nothing but the empty prefix
        # (the master was elected unclean, or came back empty). From a
        # master that still holds its log from the start, the slave starts
        # over, losing all it held; otherwise nothing is safe to decide.
        if master_min == 0:
            return JoinDecision(
                case,
                JoinAction.FOLLOW,
                0,
                slave_max,
                "the slave and the master share no epoch: the slave's log is dropped",
            )
        return JoinDecision(
            case,
            JoinAction.REFUSE,
            slave_max,
            0,
            "the slave and the master share no epoch, and the master's log does not start "
            "at 0: manual intervention",
        )
    point = min(point, slave_max, master_max)
    if point < slave_min:
        # The agreement ends before anything the slave still holds.
        return JoinDecision(
            case,
            JoinAction.RESET,
            master_min,
            slave_max - slave_min,
            "the logs agree only before the slave's retained log",
        )
    return JoinDecision(
        case,
        JoinAction.FOLLOW,
        point,
        slave_max - point,
        "follow the master from the last consistent point"
        if point == slave_max
        else f"truncate {slave_max - point} bytes the master does not hold, then follow",
    )
