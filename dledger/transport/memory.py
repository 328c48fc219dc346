"""In-process transport for runtime tests: same shape as :class:`TcpTransport`.

A :class:`MemoryNetwork` connects :class:`MemoryTransport` endpoints on one
event loop. Delivery goes through ``loop.call_soon`` so ``on_message`` never
runs inside ``send`` (as with a real network, a handler can send without
re-entering itself) and FIFO scheduling keeps per-link order.

Failure model, mirroring TCP as seen by ``send``:

* a partitioned link, or a destination that is configured but stopped, loses
  the message silently: ``send`` still returns ``True`` (the sender cannot
  tell), the loss is counted in the sender's ``dropped_partition`` /
  ``dropped_unreachable``; a partition also drops messages already in flight;
* an unknown destination, or a link with ``max_in_flight`` undelivered
  messages, makes ``send`` return ``False`` (``dropped_unknown_peer`` /
  ``dropped_full_queue``), like an unknown peer or a full outbound queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from dledger.errors import ConfigError
from dledger.transport.base import OnMessage

logger = logging.getLogger(__name__)

MEMORY_COUNTERS = (
    "frames_sent",
    "frames_received",
    "bytes_sent",
    "bytes_received",
    "dropped_full_queue",
    "dropped_unknown_peer",
    "dropped_stopped",
    "dropped_partition",
    "dropped_unreachable",
    "rejected_unknown_sender",
    "callback_errors",
    "holds",
)


class MemoryNetwork:
    def __init__(self, *, max_in_flight: int = 10_000) -> None:
        if max_in_flight < 1:
            raise ConfigError("max_in_flight must be positive")
        self.max_in_flight = max_in_flight
        self._nodes: dict[int, MemoryTransport] = {}
        self._cuts: set[frozenset[int]] = set()
        self._in_flight: dict[tuple[int, int], int] = {}

    def transport(
        self, node_id: int, on_message: OnMessage, peers: Iterable[int] | None = None
    ) -> MemoryTransport:
        return MemoryTransport(self, node_id, on_message, peers)

    def partition(self, a: int, b: int) -> None:
        """Cut the link between ``a`` and ``b`` in both directions."""
        if a != b:
            self._cuts.add(frozenset((a, b)))

    def isolate(self, node: int) -> None:
        """Cut ``node`` from every node currently attached."""
        for other in self._nodes:
            self.partition(node, other)

    def heal(self, a: int | None = None, b: int | None = None) -> None:
        """Restore the link between ``a`` and ``b``, or every link if none given."""
        if a is None and b is None:
            self._cuts.clear()
        elif a is not None and b is not None:
            self._cuts.discard(frozenset((a, b)))
        else:
            raise ValueError("heal() takes both node ids or neither")

    def connected(self, a: int, b: int) -> bool:
        return frozenset((a, b)) not in self._cuts

    def _attach(self, t: MemoryTransport) -> None:
        old = self._nodes.get(t.node_id)
        if old is not None and not old._stopped:
            raise ConfigError(f"node {t.node_id} is already attached to this network")
        self._nodes[t.node_id] = t

    def _detach(self, t: MemoryTransport) -> None:
        if self._nodes.get(t.node_id) is t:
            del self._nodes[t.node_id]


class MemoryTransport:
    def __init__(
        self,
        network: MemoryNetwork,
        node_id: int,
        on_message: OnMessage,
        peers: Iterable[int] | None = None,
    ) -> None:
        self.node_id = node_id
        self._net = network
        self._on_message = on_message
        # None means "anyone on the network", convenient for ad-hoc tests.
        self._peers: set[int] | None = None if peers is None else self._normalize(peers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._stopped = False
        self._c: dict[str, int] = dict.fromkeys(MEMORY_COUNTERS, 0)
        # hold_inbound: what arrived meanwhile, delivered after the release
        self._holding = False
        self._waiting: list[tuple[int, bytes]] = []
        network._attach(self)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._c)

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        if self._running or self._stopped:
            raise RuntimeError("a MemoryTransport can be started once")
        self._loop = asyncio.get_running_loop()
        self._running = True

    async def stop(self) -> None:
        # Messages already scheduled to us are dropped on arrival; nothing
        # needs awaiting because call_soon handles are callbacks, not tasks.
        # Detaching lets a "restarted" node attach a fresh transport.
        self._running = False
        self._stopped = True
        self._holding = False
        self._waiting = []
        self._net._detach(self)

    def hold_inbound(self) -> None:
        """Keep what arrives until :meth:`release_inbound` (TcpTransport's
        contract: a held socket is not read)."""
        if not self._holding and self._running:
            self._holding = True
            self._c["holds"] += 1

    def release_inbound(self) -> None:
        """What waited is delivered by a callback of the loop's next turn;
        what arrives before that callback queues behind it."""
        if self._holding:
            self._holding = False
            if self._waiting and self._loop is not None:
                self._loop.call_soon(self._deliver_waiting)

    def _deliver_waiting(self) -> None:
        if self._holding:
            return  # held again first: the next release delivers them
        frames, self._waiting = self._waiting, []
        for frm, payload in frames:
            if self._running:
                self._receive(frm, payload)

    def peer_status(self, peer_id: int) -> None:
        """No connection state to report (the node's status leaves it out):
        in-process delivery has no sockets to be up or down."""
        return None

    def update_peers(self, peers: Iterable[int]) -> None:
        """Accepts the same mapping as TcpTransport (only the ids matter)."""
        self._peers = self._normalize(peers)

    def send(self, to: int, payload: bytes) -> bool:
        if not self._running or self._loop is None:
            self._c["dropped_stopped"] += 1
            return False
        known = to in self._peers if self._peers is not None else to in self._net._nodes
        if not known or to == self.node_id:
            self._c["dropped_unknown_peer"] += 1
            return False
        link = (self.node_id, to)
        pending = self._net._in_flight.get(link, 0)
        if pending >= self._net.max_in_flight:
            self._c["dropped_full_queue"] += 1
            return False
        self._c["frames_sent"] += 1
        self._c["bytes_sent"] += len(payload)
        if not self._net.connected(self.node_id, to):
            self._c["dropped_partition"] += 1
            return True
        self._net._in_flight[link] = pending + 1
        self._loop.call_soon(self._arrive, to, payload)
        return True

    def _arrive(self, to: int, payload: bytes) -> None:
        link = (self.node_id, to)
        self._net._in_flight[link] -= 1
        if not self._net.connected(self.node_id, to):
            self._c["dropped_partition"] += 1
            return
        dst = self._net._nodes.get(to)
        if dst is None or not dst._running:
            self._c["dropped_unreachable"] += 1
            return
        dst._receive(self.node_id, payload)

    def _receive(self, frm: int, payload: bytes) -> None:
        if self._peers is not None and frm not in self._peers:
            # Same rule as the TCP handshake: only configured peers get in.
            self._c["rejected_unknown_sender"] += 1
            return
        if self._holding or self._waiting:
            self._waiting.append((frm, payload))
            return
        self._c["frames_received"] += 1
        self._c["bytes_received"] += len(payload)
        try:
            self._on_message(frm, payload)
        except Exception:
            self._c["callback_errors"] += 1
            logger.exception("on_message raised for a message from node %d", frm)

    def _normalize(self, peers: Iterable[int]) -> set[int]:
        return {p for p in peers if p != self.node_id}
