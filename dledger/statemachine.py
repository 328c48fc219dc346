"""What the node applies committed entries to.

Contract: the node calls :meth:`StateMachine.apply` once per committed entry,
in log order, on the event loop thread, for every entry type (NORMAL, NOOP,
CONF_CHANGE); a state machine that only cares about data ignores the others.
The node replays the log from index 1 at every start (no snapshots yet), so
``apply`` must build its state from nothing but the entries it is given. The
return value of ``apply`` for a NORMAL entry is handed back to the proposer.
"""

from __future__ import annotations

import bisect
import zlib
from collections import deque
from typing import Protocol

from dledger.core.types import Entry, EntryType


class StateMachine(Protocol):
    def apply(self, entry: Entry) -> object: ...


class LogStateMachine:
    """Records ``(index, term, crc32(data))`` of every NORMAL entry applied.

    It keeps no payloads, only what tests and operators need to compare
    replicas: two nodes applied the same log iff their records agree.
    ``apply`` returns the CRC, so a proposer can check what was applied.
    """

    def __init__(self, recent_payloads: int = 10_000, payload_bytes_max: int = 4096) -> None:
        self._indexes: list[int] = []
        self._records: list[tuple[int, int, int]] = []
        self.last_applied = 0
        # The most recent small payloads, so an operator (and the demo) can
        # read back what was written; bounded so memory stays flat.
        self._recent: deque[tuple[int, int, bytes]] = deque(maxlen=recent_payloads)
        self._payload_bytes_max = payload_bytes_max

    def apply(self, entry: Entry) -> object:
        if entry.index <= self.last_applied:
            raise AssertionError(
                f"entry {entry.index} applied after {self.last_applied}: apply order broken"
            )
        self.last_applied = entry.index
        if entry.type is not EntryType.NORMAL:
            return None
        crc = zlib.crc32(entry.data)
        if len(entry.data) <= self._payload_bytes_max:
            self._recent.append((entry.index, entry.term, entry.data))
        self._indexes.append(entry.index)
        self._records.append((entry.index, entry.term, crc))
        return crc

    def records(self, start: int = 1, limit: int = 1000) -> list[tuple[int, int, int]]:
        """Up to ``limit`` records of entries with ``index >= start``, in order."""
        k = bisect.bisect_left(self._indexes, start)
        return self._records[k : k + max(0, limit)]

    def recent(self, start: int = 1, limit: int = 100) -> list[tuple[int, int, bytes]]:
        """Payloads of recent NORMAL entries with ``index >= start`` (bounded window)."""
        out = [r for r in self._recent if r[0] >= start]
        return out[: max(0, limit)]

    def __len__(self) -> int:
        return len(self._records)
