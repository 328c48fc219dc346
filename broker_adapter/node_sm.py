"""What a node applies when it runs the broker: the broker state plus the
replica records (``LogStateMachine``) that ``/raft/applied`` and
``/raft/messages`` serve.

Entries that are broker commands go to :class:`BrokerState` and its result
(or refusal) is the proposal's answer; any other NORMAL entry (raw
``/raft/propose`` payloads) keeps its old answer, the CRC. Listeners are
called after each applied entry (the HTTP layer wakes long-polls with one);
they run on the node's loop and must only schedule work, never block.

A snapshot is the replica records' snapshot (length-prefixed) followed by
the broker state's own deterministic snapshot; restoring replaces both.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from broker_adapter.bodies import Bodies
from broker_adapter.codec import is_command
from broker_adapter.errors import MalformedCommand
from broker_adapter.state import BrokerState
from dledger.core.types import Entry
from dledger.statemachine import LogStateMachine, SnapshotError

_LEN = struct.Struct(">Q")


class BrokerStateMachine(LogStateMachine):
    def __init__(
        self,
        broker: BrokerState | None = None,
        broker_name: str = "dledger",
        bodies: Bodies | None = None,
    ) -> None:
        """``bodies``: where records live (default: memory); a node passes an
        :class:`~broker_adapter.bodies.LmdbBodies` in its data directory."""
        super().__init__()
        self.broker = broker if broker is not None else BrokerState(broker_name, bodies)
        self._listeners: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        # LogStateMachine has __len__ (0 when empty); a state machine object
        # must stay truthy (Node uses ``state_machine or LogStateMachine()``).
        return True

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def apply(self, entry: Entry) -> object:
        crc = super().apply(entry)
        result = self.broker.apply(entry)
        for fn in tuple(self._listeners):
            fn()
        return result if is_command(entry.data) else crc

    def snapshot(self) -> bytes:
        return self.snapshot_builder()()

    def snapshot_builder(self) -> Callable[[], bytes]:
        records = super().snapshot_builder()
        broker = self.broker.snapshot_chunks_builder()

        def build() -> bytes:
            r = records()
            return b"".join([_LEN.pack(len(r)), r, *broker()])

        return build

    def restore(self, data: bytes) -> None:
        data = bytes(data)
        if len(data) < _LEN.size:
            raise SnapshotError("broker state machine snapshot is truncated")
        (n,) = _LEN.unpack_from(data, 0)
        if _LEN.size + n > len(data):
            raise SnapshotError("broker state machine snapshot is truncated")
        try:
            broker = BrokerState.restore(data[_LEN.size + n :], self.broker.bodies)
        except MalformedCommand as exc:
            raise SnapshotError(f"broker snapshot: {exc}") from None
        super().restore(data[_LEN.size : _LEN.size + n])
        self.broker = broker
        for fn in tuple(self._listeners):
            fn()
