"""The shape every peer transport has, so the runtime can swap TCP for memory.

Contract:

* payloads are opaque bytes; a transport never interprets them;
* ``send`` never blocks and never raises for a network problem: it returns
  ``False`` when the message was refused locally (unknown peer, full queue,
  stopped) and ``True`` when it was accepted, which still does not promise
  delivery. Raft retries, so losing a message is always allowed;
* messages accepted for one peer arrive at most once and in send order; what
  arrives is a subsequence of what was sent (messages around a reconnect,
  or sent during a partition, may be missing);
* ``on_message(from_id, payload)`` runs on the event loop thread and should
  only hand the payload off (an exception it raises is logged and counted,
  never fatal to the connection);
* ``send``, ``update_peers`` and ``stats`` are called from the loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

Address = tuple[str, int]
OnMessage = Callable[[int, bytes], None]


class Transport(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def send(self, to: int, payload: bytes) -> bool: ...

    def update_peers(self, peers: Mapping[int, Address]) -> None: ...

    @property
    def stats(self) -> dict[str, int]: ...
