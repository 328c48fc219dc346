"""The master's replication rules in controller mode: SyncStateSet and
confirm offset, without I/O.

Theory of operation
-------------------
A :class:`MasterCore` is fed what the master's driver sees: its own
CommitLog reaching an offset (appended and, in sync flush, fsynced), each
slave's acknowledged offset, the controller's answers, and the time
(``now_ms`` from the caller: the core reads no clock). It answers three
questions:

* **confirm offset**: how far the log is confirmed (consumers never read
  past it; a produce is acknowledged once it is covered). With
  ``all_ack_in_sync_state_set`` it is the minimum acknowledged offset over
  the SyncStateSet (the master's own offset included); otherwise the
  ``k``-th largest over the set, ``k`` being ``in_sync_replicas``, lowered
  with the set's size down to ``min_in_sync_replicas`` when
  ``enable_auto_in_sync_replicas`` is on (adaptive degradation). The
  confirm offset never moves backwards.
* **may a write be taken**: not when the SyncStateSet is smaller than
  ``min_in_sync_replicas`` (the client fails fast instead of waiting for
  acknowledgements that cannot come).
* **should the SyncStateSet change**: a slave in the set whose
  acknowledged offset trails the master's by more than
  ``max_gap_bytes``, or has not caught up for ``max_lag_ms``, should leave
  it; a slave outside it that has caught up (acknowledged the master's
  offset as of some moment within ``max_gap_bytes``) should join. The core
  only *requests* (:meth:`poll_request`); the controller decides, checking
  the master's epoch, and the driver reports the approved set back with
  :meth:`on_sync_state_set`. Confirm offsets use the approved set only: a
  master never counts a slave the controller has not recorded, nor drops
  one before it has, so the set the controller would elect from always
  holds every confirmed byte (RocketMQ's rule: the new master comes from
  the SyncStateSet).

There is no lease: a master that the controller replaced but that has not
heard so keeps confirming with its old set (the article's dual-master case;
the comparison measures what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dledger.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CmodeConfig:
    """The seed's settings (names as in RocketMQ, units last)."""

    all_ack_in_sync_state_set: bool = False
    in_sync_replicas: int = 1
    min_in_sync_replicas: int = 1
    enable_auto_in_sync_replicas: bool = False
    enable_elect_unclean_master: bool = False
    max_gap_bytes: int = 256 << 10
    max_lag_ms: int = 3000

    def validate(self, replicas: int) -> None:
        if replicas < 1:
            raise ConfigError("a controller-mode group needs at least one replica")
        if not 1 <= self.min_in_sync_replicas <= replicas:
            raise ConfigError(
                f"min_in_sync_replicas must be within 1..{replicas}, got {self.min_in_sync_replicas}"
            )
        if not self.min_in_sync_replicas <= self.in_sync_replicas <= replicas:
            raise ConfigError(
                f"in_sync_replicas must be within min_in_sync_replicas..{replicas}, "
                f"got {self.in_sync_replicas}"
            )
        if self.max_gap_bytes <= 0 or self.max_lag_ms <= 0:
            raise ConfigError("max_gap_bytes and max_lag_ms must be positive")

    @classmethod
    def cp(cls, replicas: int) -> CmodeConfig:
        """Consistency first: every member of the set acknowledges, and the
        set may not shrink below a majority."""
        majority = replicas // 2 + 1
        return cls(
            all_ack_in_sync_state_set=True,
            in_sync_replicas=majority,
            min_in_sync_replicas=majority,
        )

    @classmethod
    def ap(cls, replicas: int) -> CmodeConfig:
        """Availability first: adaptive degradation down to the master alone,
        and unclean elections."""
        return cls(
            in_sync_replicas=replicas,
            min_in_sync_replicas=1,
            enable_auto_in_sync_replicas=True,
            enable_elect_unclean_master=True,
        )


@dataclass(frozen=True, slots=True)
class AlterRequest:
    """Ask the controller to make ``new_set`` the SyncStateSet (epochs checked)."""

    epoch: int
    sync_state_set_epoch: int
    new_set: frozenset[int]
    reason: str


@dataclass
class _Slave:
    acked: int = -1  # bytes acknowledged (the slave's log length); -1: never heard
    # Caught up: its acknowledgement reached what the master held when the
    # slave's previous acknowledgement came in (one round trip behind at
    # most, as RocketMQ counts it: under load a slave never holds exactly
    # the master's newest byte).
    target: int = 0
    caught_up_ms: int = 0


@dataclass
class MasterCore:
    me: int
    epoch: int
    members: frozenset[int]  # every replica of the group, the master included
    sync_state_set: frozenset[int]
    cfg: CmodeConfig
    sync_state_set_epoch: int = 0
    max_offset: int = 0  # the master's own log, as far as it counts (flushed in sync mode)
    confirm: int = 0
    started_ms: int = 0  # a slave not heard from counts as caught up until max_lag_ms after this
    # Planted bug cmode_confirm_from_master (dledger/faults.py), tests only.
    confirm_from_master: bool = False
    _slaves: dict[int, _Slave] = field(default_factory=dict)
    _pending: AlterRequest | None = None

    def __post_init__(self) -> None:
        assert self.me in self.members and self.me in self.sync_state_set
        self._slaves = {
            m: _Slave(caught_up_ms=self.started_ms) for m in sorted(self.members) if m != self.me
        }

    # -- inputs --------------------------------------------------------------------------
    def on_local(self, offset: int) -> None:
        """The master's own log now counts up to ``offset``."""
        assert offset >= self.max_offset, "the master's log moved backwards"
        self.max_offset = offset
        self._recompute()

    def on_ack(self, slave: int, offset: int, now_ms: int) -> None:
        """``slave`` holds the log up to ``offset`` (its report; never beyond
        what the master sent it)."""
        s = self._slaves.get(slave)
        if s is None:
            return  # not a member (a stale connection): ignored
        if offset > self.max_offset:
            raise AssertionError(
                f"slave {slave} acknowledged {offset} past the master's {self.max_offset}"
            )
        s.acked = max(s.acked, offset)
        if s.acked >= s.target:
            s.caught_up_ms = now_ms
            s.target = self.max_offset
        self._recompute()

    def on_sync_state_set(self, sync_state_set_epoch: int, new_set: frozenset[int]) -> None:
        """The controller recorded ``new_set`` (for this master's epoch)."""
        if sync_state_set_epoch <= self.sync_state_set_epoch:
            return
        assert self.me in new_set, "a SyncStateSet without its master"
        self.sync_state_set = new_set
        self.sync_state_set_epoch = sync_state_set_epoch
        self._pending = None
        self._recompute()

    def on_request_failed(self) -> None:
        """The controller refused or did not answer: the next poll asks again."""
        self._pending = None

    # -- outputs -------------------------------------------------------------------------
    def required_acks(self) -> int:
        """How many members of the set (the master included) must hold a byte
        for it to be confirmed."""
        n = len(self.sync_state_set)
        if self.cfg.all_ack_in_sync_state_set:
            return n
        k = self.cfg.in_sync_replicas
        if self.cfg.enable_auto_in_sync_replicas:
            k = max(self.cfg.min_in_sync_replicas, min(k, n))
        return k

    def write_refusal(self) -> str | None:
        """Why a new write must fail fast now, or None when it may be taken."""
        n = len(self.sync_state_set)
        if n < self.cfg.min_in_sync_replicas:
            return (
                f"the SyncStateSet has {n} replica(s), fewer than min_in_sync_replicas "
                f"({self.cfg.min_in_sync_replicas})"
            )
        if self.required_acks() > n:
            return (
                f"{self.required_acks()} acknowledgements needed but the SyncStateSet has {n} "
                "replica(s) (enable_auto_in_sync_replicas is off)"
            )
        return None

    def acked(self, member: int) -> int:
        return self.max_offset if member == self.me else self._slaves[member].acked

    def poll_request(self, now_ms: int) -> AlterRequest | None:
        """A SyncStateSet change to ask the controller for (at most one in flight)."""
        if self._pending is not None:
            return None
        out = [m for m in sorted(self.sync_state_set - {self.me}) if self._lagging(m, now_ms)]
        # Joining makes a slave electable: it must hold every confirmed byte.
        into = [
            m
            for m in sorted(self.members - self.sync_state_set)
            if self._slaves[m].acked >= 0
            and self._slaves[m].acked >= self.confirm
            and not self._lagging(m, now_ms)
        ]
        if not out and not into:
            return None
        new = (self.sync_state_set - set(out)) | set(into)
        why = []
        if out:
            why.append(
                f"shrink: {out} behind by more than {self.cfg.max_gap_bytes} B or {self.cfg.max_lag_ms} ms"
            )
        if into:
            why.append(f"expand: {into} caught up")
        self._pending = AlterRequest(
            self.epoch, self.sync_state_set_epoch, frozenset(new), "; ".join(why)
        )
        return self._pending

    # -- internals -----------------------------------------------------------------------
    def _lagging(self, m: int, now_ms: int) -> bool:
        s = self._slaves[m]
        if s.acked >= self.max_offset:
            return False  # holds everything the master has: caught up now
        if s.acked >= 0 and self.max_offset - s.acked > self.cfg.max_gap_bytes:
            return True
        return now_ms - s.caught_up_ms > self.cfg.max_lag_ms

    def _recompute(self) -> None:
        if self.confirm_from_master:  # planted bug: the set's acknowledgements ignored
            self.confirm = max(self.confirm, self.max_offset)
            return
        offs = sorted((self.acked(m) for m in self.sync_state_set), reverse=True)
        k = self.required_acks()
        if k > len(offs):
            return  # cannot confirm anything more with this set
        c = offs[k - 1]
        if c > self.confirm:
            self.confirm = c
