"""Peer transport: moves opaque Raft message bytes between nodes.

:class:`TcpTransport` for real nodes, :class:`MemoryTransport` on a
:class:`MemoryNetwork` for in-process tests; both satisfy :class:`Transport`.
"""

from dledger.transport.base import Address, OnMessage, Transport
from dledger.transport.frames import Frame, FrameDecoder, FrameEncoder, FrameError, FrameKind
from dledger.transport.handshake import HandshakeError
from dledger.transport.memory import MemoryNetwork, MemoryTransport
from dledger.transport.tcp import PeerStatus, TcpTransport

__all__ = [
    "Address",
    "Frame",
    "FrameDecoder",
    "FrameEncoder",
    "FrameError",
    "FrameKind",
    "HandshakeError",
    "MemoryNetwork",
    "MemoryTransport",
    "OnMessage",
    "PeerStatus",
    "TcpTransport",
    "Transport",
]
