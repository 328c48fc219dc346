"""Per-follower replication progress, kept by the leader (etcd's tracker).

A follower is in one of two states:

* PROBE: we do not know where its log matches ours. Send one AppendEntries
  and wait (``probe_sent``) until it answers or a heartbeat response arrives;
  a rejection moves ``next`` back (using the follower's hint).
* REPLICATE: the follower matched recently; stream entries optimistically,
  advancing ``next`` as we send, with at most ``max_inflight`` unacknowledged
  messages and ``max_inflight_bytes`` of entries in flight (pipelining with a
  bounded window; the byte bound keeps the leader's work per acknowledgement
  small when a far-behind follower is caught up with large messages).
* SNAPSHOT: the follower needs entries we compacted; a snapshot at
  ``pending_snapshot`` was sent. Nothing else is sent until a reply shows it
  matched (then REPLICATE) or the transfer is given up (then PROBE, which
  hits the compacted log again and sends a fresh snapshot).

``match`` never moves backwards: a stale success reply (delayed or
duplicated) carries a lower index and is ignored (SCENARIOS 7).
"""

from __future__ import annotations

import enum
from collections import deque


class ProgressState(enum.IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Progress:
    __slots__ = (
        "commit_sent",
        "inflight",
        "inflight_bytes",
        "is_learner",
        "match",
        "max_inflight",
        "max_inflight_bytes",
        "next",
        "pending_snapshot",
        "probe_sent",
        "recent_active",
        "snapshot_sent_tick",
        "state",
    )

    def __init__(
        self,
        next_index: int,
        max_inflight: int,
        is_learner: bool,
        max_inflight_bytes: int = 0,
    ) -> None:
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.inflight: deque[tuple[int, int]] = deque()  # (last index, bytes)
        self.inflight_bytes = 0
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes  # 0: no byte bound
        self.recent_active = False
        self.is_learner = is_learner
        self.pending_snapshot = 0
        self.snapshot_sent_tick = 0
        # the highest commit index an append or heartbeat told the follower
        # (RaftConfig.commit_notify_ticks)
        self.commit_sent = 0

    def __repr__(self) -> str:
        return (
            f"Progress(match={self.match}, next={self.next}, state={self.state.name}, "
            f"inflight={len(self.inflight)}, learner={self.is_learner})"
        )

    def _clear_inflight(self) -> None:
        self.inflight.clear()
        self.inflight_bytes = 0

    def become_probe(self, after_snapshot: int = 0) -> None:
        """Probe from ``match + 1``; or, when the snapshot at ``after_snapshot``
        was delivered, from just past it (its answer may still be coming, or
        was lost: the probe asks again)."""
        self.state = ProgressState.PROBE
        self.next = max(self.match, after_snapshot) + 1
        self.probe_sent = False
        self.pending_snapshot = 0
        self._clear_inflight()

    def become_snapshot(self, index: int, tick: int) -> None:
        self.state = ProgressState.SNAPSHOT
        self.pending_snapshot = index
        self.snapshot_sent_tick = tick
        self.probe_sent = False
        self._clear_inflight()

    def become_replicate(self) -> None:
        self.state = ProgressState.REPLICATE
        self.next = self.match + 1
        self.probe_sent = False
        self._clear_inflight()

    def maybe_update(self, index: int) -> bool:
        """A success reply acknowledging ``index``. True if match advanced."""
        updated = False
        if index > self.match:
            self.match = index
            self.probe_sent = False
            updated = True
        self.next = max(self.next, index + 1)
        return updated

    def maybe_decr_to(self, rejected: int, hint: int) -> bool:
        """A rejection of the append whose previous index was ``rejected``.

        Returns False for a stale rejection (one that no longer matches what we
        last sent), which must be ignored. While a snapshot is in flight no
        append was sent, so every rejection is stale."""
        if self.state is ProgressState.SNAPSHOT:
            return False
        if self.state is ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        if hint < self.match and rejected == self.match:
            # It rejects the very entry it once acknowledged: the replica
            # lost its log (rebuilt in place from an empty directory after
            # corruption or divergence). Believe it, or we would probe at
            # match + 1 for ever and it would never catch up. Commit never
            # moves back, so a lower match only means resending entries.
            self.match = hint
        self.next = max(min(rejected, hint + 1), self.match + 1, 1)
        self.probe_sent = False
        return True

    def is_paused(self) -> bool:
        if self.state is ProgressState.PROBE:
            return self.probe_sent
        if self.state is ProgressState.SNAPSHOT:
            return True
        if len(self.inflight) >= self.max_inflight:
            return True
        return 0 < self.max_inflight_bytes <= self.inflight_bytes

    def sent_entries(self, last_index: int | None, nbytes: int = 0) -> None:
        """Record an AppendEntries sent; ``last_index`` is its last entry, if
        any, and ``nbytes`` the size of its entries."""
        if self.state is ProgressState.REPLICATE:
            if last_index is not None:
                self.next = last_index + 1
                self.inflight.append((last_index, nbytes))
                self.inflight_bytes += nbytes
        else:
            self.probe_sent = True

    def free_inflight_to(self, index: int) -> None:
        while self.inflight and self.inflight[0][0] <= index:
            self.inflight_bytes -= self.inflight.popleft()[1]

    def free_first_inflight(self) -> None:
        if self.inflight:
            self.inflight_bytes -= self.inflight.popleft()[1]
