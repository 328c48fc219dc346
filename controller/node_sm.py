"""What a controller node applies: :class:`ControllerState` behind the
node's ``StateMachine`` protocol (``dledger.statemachine``).

Listeners run after each applied entry (the HTTP layer uses one to wake
requests waiting for a route version); they must only schedule work.
"""

from __future__ import annotations

from collections.abc import Callable

from broker_adapter.errors import MalformedCommand
from controller.state import ControllerState
from dledger.core.types import Entry
from dledger.statemachine import SnapshotError


class ControllerStateMachine:
    def __init__(self, state: ControllerState | None = None) -> None:
        self.state = state if state is not None else ControllerState()
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def apply(self, entry: Entry) -> object:
        result = self.state.apply(entry)
        for fn in tuple(self._listeners):
            fn()
        return result

    def snapshot(self) -> bytes:
        return self.state.snapshot()

    def snapshot_builder(self) -> Callable[[], bytes]:
        # The state is small (routes and groups): encode it now; the node
        # runs the returned function in a worker thread.
        data = self.state.snapshot()
        return lambda: data

    def restore(self, data: bytes) -> None:
        try:
            self.state = ControllerState.restore(bytes(data))
        except MalformedCommand as exc:
            raise SnapshotError(f"controller snapshot: {exc}") from None
        for fn in tuple(self._listeners):
            fn()
