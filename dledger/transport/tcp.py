"""Asyncio TCP transport between Raft peers.

Topology: every node dials every peer for its *outbound* traffic and accepts
connections for its *inbound* traffic, so each ordered pair of nodes has its
own connection, written by exactly one side. That keeps ordering per peer
trivial (one writer, one stream) and avoids tie-breaking when two nodes dial
each other at the same time. The listener never sends anything after the
handshake; the dialer learns that a connection died from EOF or a failed write.

Back-pressure: ``send`` appends to a bounded per-peer queue and returns
``False`` once the queue is full. What a loop turn queued for a connected
peer whose socket keeps up is written in one batch by a callback at the end
of that turn (no task switch, no timer: the common case, and most of what a
one-message entry or an idle heartbeat round costs to send). When the
socket's buffer is not empty, a dedicated task per peer drains the queue
instead, in batches (many frames, one ``drain`` under ``write_timeout``).
While a peer is unreachable its queue fills and further sends are refused,
so memory stays bounded by ``max_queue_bytes`` per peer plus one batch in
flight.

Liveness: one timer per transport sweeps the sessions every
``keepalive_interval``: it sends PING on each outbound one that wrote nothing
for half of it (a link is silent at most 1.5 intervals) and drops each
inbound one silent for ``idle_timeout`` (so between that and one interval
more); one wake-up per interval whatever the number of peers, none per busy
link or per read; a write that cannot drain
within ``write_timeout`` drops the connection. The dialer then reconnects with
exponential backoff and jitter.

Holding: :meth:`TcpTransport.hold_inbound` stops reading the inbound
sessions until :meth:`TcpTransport.release_inbound`; what peers send waits
in the kernel's socket buffers and wakes nobody. An idle leader holds while
it sleeps between heartbeat rounds: its followers' answers wait for its next
round either way, and reading each one as it came was most of the wake-ups
an idle leader had (issue 17).

Security: with a secret, every frame after the handshake carries an HMAC with
a per-connection, per-direction key (see :mod:`.handshake`); there is no
encryption, payloads are readable on the wire. The secret is shared by the
whole cluster, so it authenticates membership, not individual node ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import SupportsIndex

from dledger.errors import ConfigError
from dledger.transport.base import Address, OnMessage
from dledger.transport.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    Frame,
    FrameDecoder,
    FrameEncoder,
    FrameError,
    FrameKind,
)
from dledger.transport.handshake import (
    MAX_CLUSTER_ID_BYTES,
    MAX_HANDSHAKE_FRAME,
    MAX_NODE_ID,
    HandshakeError,
    Hello,
    Role,
    check_hello,
    decode_hello,
    derive_session,
    encode_hello,
    proof_matches,
)

logger = logging.getLogger(__name__)

COUNTERS = (
    "frames_sent",  # DATA frames handed to a socket
    "frames_received",  # DATA frames delivered to on_message
    "bytes_sent",  # payload bytes of frames_sent
    "bytes_received",  # payload bytes of frames_received
    "pings_sent",
    "dropped_full_queue",  # send() refused: the peer's queue is at its limit
    "dropped_unknown_peer",  # send() refused: not a configured peer
    "dropped_oversize",  # send() refused: payload above max_frame_size
    "dropped_stopped",  # send() refused: transport stopped
    "dropped_in_flight",  # in a batch whose write failed (approximate: the kernel
    # may have sent some of it, and frames buffered by a dying peer go unseen)
    "connects",  # outbound sessions established (handshake done)
    "reconnects",  # ... of which not the first one to that peer
    "connect_failures",  # outbound TCP connect failed or timed out
    "failed_handshakes",  # outbound handshake did not complete
    "accepted",  # inbound sessions established
    "rejected_handshakes",  # inbound handshake refused (identity, secret, garbage, timeout)
    "bad_frames",  # undecodable / unauthenticated frames, either direction
    "idle_timeouts",  # inbound connections closed for silence
    "holds",  # hold_inbound() calls that paused the inbound sessions
    "write_timeouts",  # outbound connections closed because writes stalled
    "callback_errors",  # on_message raised
)

_SETTLE_TURNS = 8


@dataclass(frozen=True, slots=True)
class PeerStatus:
    node_id: int
    address: Address
    outbound_connected: bool
    inbound_connected: bool
    queued_frames: int
    queued_bytes: int


class _Peer:
    __slots__ = (
        "addr",
        "connected",
        "enc",
        "flush_due",
        "last_write",
        "node_id",
        "queue",
        "queued_bytes",
        "sessions",
        "task",
        "wakeup",
        "writer",
    )

    def __init__(self, node_id: int, addr: Address) -> None:
        self.node_id = node_id
        self.addr = addr
        self.queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.sessions = 0
        self.connected = False
        # The live session's stream and encoder (None between sessions),
        # for the end-of-turn flush; only the session's pump sets them.
        self.writer: asyncio.StreamWriter | None = None
        self.enc: FrameEncoder | None = None
        self.flush_due = False  # a flush callback is scheduled
        self.last_write = 0.0  # loop time of the last frames written


def _check_node_id(nid: int, what: str) -> None:
    if not 1 <= nid <= MAX_NODE_ID:
        raise ConfigError(f"{what} {nid} is not a valid node id (1..2**64-1)")


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    # Raft messages are small and latency-bound; we batch ourselves.
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _abort(writer: asyncio.StreamWriter) -> None:
    # abort() rather than close(): close() waits for the send buffer to
    # flush, which never happens when the peer is the reason we are closing.
    writer.transport.abort()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _read_frame(reader: asyncio.StreamReader, dec: FrameDecoder) -> Frame:
    while (frame := dec.next_frame()) is None:
        data = await reader.read(4096)
        if not data:
            raise HandshakeError("peer closed the connection during the handshake")
        dec.push(data)
    return frame


class _InSession:
    """An inbound session past its handshake, as the transport's sweep and
    hold see it: when it last delivered bytes, how to end it, and the
    socket's transport to pause (None if it has none)."""

    __slots__ = ("end", "last", "transport")

    def __init__(
        self,
        last: float,
        end: Callable[[BaseException | None], None],
        transport: asyncio.ReadTransport | None,
    ) -> None:
        self.last = last
        self.end = end
        self.transport = transport


class _DirectReader(asyncio.StreamReader):
    """An inbound connection's reader: a plain :class:`asyncio.StreamReader`
    for the handshake, then (:meth:`direct`) one that hands every chunk the
    socket delivers to a callback at once, inside the protocol's
    ``data_received``, instead of buffering it for a task to await. That
    is one loop turn and one task switch less for every chunk a node
    receives (the reader task's wake-up): a heartbeat's answer, an append,
    an acknowledgement. What arrived before the switch is handed over
    first, in order."""

    _sink: Callable[[bytes], None] | None = None
    _on_end: Callable[[BaseException | None], None] | None = None
    # StreamReader's own state, which typeshed does not declare
    _buffer: bytearray
    _paused: bool
    _transport: asyncio.BaseTransport | None
    _eof: bool
    _exception: BaseException | None

    def direct(
        self, sink: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]
    ) -> None:
        """From now on: data to ``sink``; end of stream (None) or the
        connection's error to ``on_end``."""
        buffered = bytes(self._buffer)
        self._buffer.clear()
        self._sink, self._on_end = sink, on_end
        if self._paused and self._transport is not None:
            # paused by a burst that arrived before the switch: nothing
            # buffers from now on, so nothing needs to pause it again
            self._paused = False
            assert isinstance(self._transport, asyncio.ReadTransport)
            self._transport.resume_reading()
        if buffered:
            sink(buffered)
        if self._exception is not None:
            on_end(self._exception)
        elif self._eof:
            on_end(None)

    def transport_for_hold(self) -> asyncio.ReadTransport | None:
        """The socket's transport, for TcpTransport.hold_inbound to pause."""
        t = self._transport
        return t if isinstance(t, asyncio.ReadTransport) else None

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        sink = self._sink
        if sink is None:
            super().feed_data(data)
        elif data:
            sink(bytes(data))

    def feed_eof(self) -> None:
        end = self._on_end
        if end is None:
            super().feed_eof()
        else:
            self._eof = True
            end(None)

    def set_exception(self, exc: Exception) -> None:
        end = self._on_end
        if end is None:
            super().set_exception(exc)
        else:
            self._exception = exc
            end(exc)


class TcpTransport:
    """Peer transport over TCP. See the module docstring for the design."""

    def __init__(
        self,
        node_id: int,
        cluster_id: str,
        listen_host: str,
        listen_port: int,
        peers: Mapping[int, Address],
        secret: bytes | None,
        on_message: OnMessage,
        *,
        max_queue_frames: int = 4096,
        max_queue_bytes: int = 64 * 1024 * 1024,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_batch_bytes: int = 1024 * 1024,
        connect_timeout: float = 1.0,
        handshake_timeout: float = 2.0,
        write_timeout: float = 5.0,
        keepalive_interval: float = 2.0,
        idle_timeout: float = 5.0,
        backoff_initial: float = 0.02,
        backoff_max: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        _check_node_id(node_id, "node_id")
        if not cluster_id or len(cluster_id.encode("utf-8")) > MAX_CLUSTER_ID_BYTES:
            raise ConfigError(f"cluster_id must be 1..{MAX_CLUSTER_ID_BYTES} UTF-8 bytes")
        if secret is not None and not secret:
            raise ConfigError("secret must be None (no authentication) or non-empty")
        if not 0 <= listen_port <= 65535:
            raise ConfigError(f"listen_port {listen_port} out of range")
        if max_queue_frames < 1 or max_queue_bytes < 1 or max_batch_bytes < 1:
            raise ConfigError("queue and batch limits must be positive")
        if not 1 <= max_frame_size <= 0xFFFF_FFFF:
            raise ConfigError("max_frame_size must be within 1..2**32-1")
        timeouts = (connect_timeout, handshake_timeout, write_timeout, keepalive_interval)
        if min(timeouts) <= 0 or backoff_initial <= 0 or backoff_max < backoff_initial:
            raise ConfigError("timeouts and backoff must be positive, backoff_max >= initial")
        if idle_timeout <= keepalive_interval * 1.5:
            raise ConfigError(
                "idle_timeout must exceed 1.5 x keepalive_interval (the longest a link is silent)"
            )

        self.node_id = node_id
        self.cluster_id = cluster_id
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._secret = secret
        self._on_message = on_message
        self._max_queue_frames = max_queue_frames
        self._max_queue_bytes = max_queue_bytes
        self._max_frame_size = max_frame_size
        self._max_batch_bytes = max_batch_bytes
        self._connect_timeout = connect_timeout
        self._handshake_timeout = handshake_timeout
        self._write_timeout = write_timeout
        self._keepalive_interval = keepalive_interval
        self._idle_timeout = idle_timeout
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._rng = rng if rng is not None else random.Random()

        self._peers: dict[int, _Peer] = {
            nid: _Peer(nid, addr) for nid, addr in self._normalize(peers).items()
        }
        self._inbound: dict[int, asyncio.Task[None]] = {}
        # inbound sessions past their handshake: what hold_inbound pauses
        # and the sweep checks for silence
        self._reading: dict[int, _InSession] = {}
        self._held = False
        self._sweep: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._bound: Address | None = None
        self._closed = False
        self._c: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- public API ---------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._c)

    @property
    def listen_address(self) -> Address:
        """The bound (host, port); with ``listen_port=0`` the port the OS chose."""
        if self._bound is None:
            raise RuntimeError("transport not started")
        return self._bound

    @property
    def port(self) -> int:
        return self.listen_address[1]

    @property
    def peers(self) -> dict[int, Address]:
        return {nid: p.addr for nid, p in self._peers.items()}

    def peer_status(self, node_id: int) -> PeerStatus | None:
        p = self._peers.get(node_id)
        if p is None:
            return None
        return PeerStatus(
            node_id=node_id,
            address=p.addr,
            outbound_connected=p.connected,
            inbound_connected=node_id in self._inbound,
            queued_frames=len(p.queue),
            queued_bytes=p.queued_bytes,
        )

    async def start(self) -> None:
        if self._server is not None or self._closed:
            raise RuntimeError("a TcpTransport can be started once")
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.StreamReaderProtocol:
            # asyncio.start_server's factory, with our reader
            return asyncio.StreamReaderProtocol(_DirectReader(), self._accept)

        self._server = await loop.create_server(
            protocol, self._listen_host, self._listen_port, reuse_address=True
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self._bound = (host, port)
        for peer in self._peers.values():
            self._spawn_dialer(peer)
        self._sweep = loop.call_later(self._keepalive_interval, self._sweep_links)

    def _sweep_links(self) -> None:
        """Every ``keepalive_interval``, one timer for the whole transport
        (an idle node wakes once per interval for it, whatever the number of
        peers): PING each outbound session that wrote nothing for half an
        interval (with nothing queued, and a socket that keeps up: a stuck
        one is the write timeout's), and end each inbound session silent for
        ``idle_timeout`` (a held one is silent because we hold it: it
        counts as heard now)."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        quiet = self._keepalive_interval / 2
        for peer in self._peers.values():
            w, enc = peer.writer, peer.enc
            if w is None or enc is None or peer.queue or now - peer.last_write < quiet:
                continue
            t = w.transport
            if t.is_closing() or t.get_write_buffer_size():
                continue
            w.write(enc.encode(FrameKind.PING))
            peer.last_write = now
            self._c["pings_sent"] += 1
        for sess in list(self._reading.values()):
            if self._held:
                sess.last = now
            elif now - sess.last >= self._idle_timeout:
                sess.end(TimeoutError())
        self._sweep = loop.call_later(self._keepalive_interval, self._sweep_links)

    def hold_inbound(self) -> None:
        """Stop reading the inbound sessions until :meth:`release_inbound`:
        bytes peers send meanwhile wait in the socket buffers (no wake-up,
        nothing delivered). A session that begins while held is not held; a
        held session is not closed for silence."""
        if self._held or self._closed:
            return
        self._held = True
        self._c["holds"] += 1
        for sess in self._reading.values():
            if sess.transport is not None:
                sess.transport.pause_reading()

    def release_inbound(self) -> None:
        """Read the held sessions again. Their buffered bytes are read and
        delivered by callbacks of the loop's next turn, so a task that
        releases and then yields twice (``await asyncio.sleep(0)``) resumes
        after they were delivered."""
        if not self._held:
            return
        self._held = False
        for sess in self._reading.values():
            if sess.transport is not None:
                sess.transport.resume_reading()

    async def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
        if self._server is not None:
            self._server.close()
        # Cancelled sessions may still be finishing their cleanup; loop until
        # nothing we own is left so no task outlives stop().
        while self._tasks:
            pending = list(self._tasks)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # On 3.11 Server.wait_closed() does not wait for connections: one
        # accepted just before close() still reaches _accept (which aborts
        # it), and an aborted socket is closed one callback later. A few loop
        # turns let that chain finish so no socket outlives stop().
        for _ in range(_SETTLE_TURNS):
            await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()
        for p in self._peers.values():
            p.queue.clear()
            p.queued_bytes = 0

    def send(self, to: int, payload: bytes) -> bool:
        if self._closed:
            self._c["dropped_stopped"] += 1
            return False
        peer = self._peers.get(to)
        if peer is None:
            self._c["dropped_unknown_peer"] += 1
            return False
        n = len(payload)
        if n > self._max_frame_size:
            self._c["dropped_oversize"] += 1
            return False
        if (
            len(peer.queue) >= self._max_queue_frames
            or peer.queued_bytes + n > self._max_queue_bytes
        ):
            self._c["dropped_full_queue"] += 1
            return False
        peer.queue.append(payload)
        peer.queued_bytes += n
        if peer.writer is None:
            peer.wakeup.set()  # the next session's pump takes the queue
        elif not peer.flush_due:
            peer.flush_due = True
            asyncio.get_running_loop().call_soon(self._flush, peer)
        return True

    def _flush(self, peer: _Peer) -> None:
        """End of a loop turn: write what ``send`` queued for ``peer`` in one
        batch when its socket keeps up; otherwise (bytes still buffered, or
        no session) leave the queue to the pump, which drains under
        ``write_timeout``."""
        peer.flush_due = False
        writer, enc = peer.writer, peer.enc
        if not peer.queue:
            return
        if (
            writer is None
            or enc is None
            or writer.transport.is_closing()
            or writer.transport.get_write_buffer_size()
        ):
            peer.wakeup.set()
            return
        self._write_batch(peer, writer, enc)

    def _write_batch(self, peer: _Peer, writer: asyncio.StreamWriter, enc: FrameEncoder) -> int:
        """Encode and write queued frames, up to ``max_batch_bytes``; the
        number of frames written."""
        chunks: list[bytes] = []
        size = 0
        queue = peer.queue
        while queue and size < self._max_batch_bytes:
            payload = queue.popleft()
            chunks.append(enc.encode(FrameKind.DATA, payload))
            size += len(payload)
        peer.queued_bytes -= size
        writer.writelines(chunks)
        peer.last_write = asyncio.get_running_loop().time()
        self._c["frames_sent"] += len(chunks)
        self._c["bytes_sent"] += size
        return len(chunks)

    def update_peers(self, peers: Mapping[int, Address]) -> None:
        """Replace the peer set (membership change).

        Removed peers lose their queue, outbound and inbound connections and
        can no longer connect; a changed address restarts the dialer but keeps
        the queue. Our own id may appear in ``peers`` and is ignored.
        """
        if self._closed:
            raise RuntimeError("transport stopped")
        new = self._normalize(peers)
        for nid in [n for n in self._peers if n not in new]:
            peer = self._peers.pop(nid)
            if peer.task is not None:
                peer.task.cancel()
            peer.queue.clear()
            peer.queued_bytes = 0
            inbound = self._inbound.pop(nid, None)
            if inbound is not None:
                inbound.cancel()
        for nid, addr in new.items():
            existing = self._peers.get(nid)
            if existing is not None and existing.addr == addr:
                continue
            if existing is not None:
                if existing.task is not None:
                    existing.task.cancel()
                existing.addr = addr
                existing.connected = False
                peer = existing
            else:
                peer = self._peers[nid] = _Peer(nid, addr)
            if self._server is not None:
                self._spawn_dialer(peer)

    # -- internals ----------------------------------------------------------

    def _normalize(self, peers: Mapping[int, Address]) -> dict[int, Address]:
        out: dict[int, Address] = {}
        for nid, (host, port) in peers.items():
            _check_node_id(nid, "peer id")
            if nid == self.node_id:
                continue
            if not 0 < port <= 65535:
                raise ConfigError(f"peer {nid} has invalid port {port}")
            out[nid] = (host, port)
        return out

    def _track(self, task: asyncio.Task[None], *, owned: bool = False) -> asyncio.Task[None]:
        """Register a task so stop() can cancel and await it.

        ``owned`` tasks have a parent that awaits them and judges their
        exception; every other task is expected never to fail, so a failure
        there is a bug worth an error log.
        """
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if not owned:
            task.add_done_callback(self._report_crash)
        return task

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("transport task %s crashed", task.get_name(), exc_info=exc)

    def _spawn_dialer(self, peer: _Peer) -> None:
        peer.task = self._track(
            asyncio.get_running_loop().create_task(
                self._dial_loop(peer), name=f"dledger-transport-{self.node_id}->{peer.node_id}"
            )
        )

    def _backoff(self, failures: int) -> float:
        base = min(self._backoff_max, self._backoff_initial * float(2 ** min(failures, 30)))
        # Jitter keeps a cluster that lost a node from reconnecting in lockstep.
        return base * self._rng.uniform(0.5, 1.0)

    def _deliver(self, frm: int, payload: bytes) -> None:
        self._c["frames_received"] += 1
        self._c["bytes_received"] += len(payload)
        try:
            self._on_message(frm, payload)
        except Exception:
            self._c["callback_errors"] += 1
            logger.exception("on_message raised for a message from node %d", frm)

    # -- outbound -----------------------------------------------------------

    async def _dial_loop(self, peer: _Peer) -> None:
        failures = 0
        while not self._closed:
            try:
                established = await self._dial_once(peer)
            except Exception:
                logger.exception("unexpected error dialing node %d", peer.node_id)
                established = False
            failures = 0 if established else failures + 1
            await asyncio.sleep(self._backoff(failures))

    async def _dial_once(self, peer: _Peer) -> bool:
        host, port = peer.addr
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as e:
            self._c["connect_failures"] += 1
            logger.debug(
                "node %d: connect to %d at %s:%d failed: %r",
                self.node_id,
                peer.node_id,
                host,
                port,
                e,
            )
            return False
        try:
            _set_nodelay(writer)
            try:
                async with asyncio.timeout(self._handshake_timeout):
                    enc = await self._dialer_handshake(peer, reader, writer)
            except (HandshakeError, FrameError, TimeoutError, OSError) as e:
                self._c["failed_handshakes"] += 1
                if isinstance(e, FrameError):
                    self._c["bad_frames"] += 1
                logger.info(
                    "node %d: handshake with node %d failed: %s",
                    self.node_id,
                    peer.node_id,
                    str(e) or type(e).__name__,
                )
                return False
            peer.sessions += 1
            self._c["connects"] += 1
            if peer.sessions > 1:
                self._c["reconnects"] += 1
            peer.connected = True
            try:
                await self._run_session(peer, reader, writer, enc)
            finally:
                # After an address change a successor task may already own
                # the flag; only the current dialer may clear it.
                if peer.task is asyncio.current_task():
                    peer.connected = False
            return True
        finally:
            await _abort(writer)

    async def _dialer_handshake(
        self, peer: _Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> FrameEncoder:
        enc, dec = FrameEncoder(), FrameDecoder(MAX_HANDSHAKE_FRAME)
        has_secret = self._secret is not None
        mine = encode_hello(Hello.fresh(self.cluster_id, self.node_id, peer.node_id, has_secret))
        writer.write(enc.encode(FrameKind.HELLO, mine))
        await writer.drain()
        frame = await _read_frame(reader, dec)
        if frame.kind is not FrameKind.HELLO:
            raise HandshakeError(f"expected HELLO, got {frame.kind.name}")
        theirs = decode_hello(frame.payload)
        check_hello(
            theirs,
            cluster_id=self.cluster_id,
            node_id=self.node_id,
            has_secret=has_secret,
            expect_node=peer.node_id,
        )
        if self._secret is not None:
            keys = derive_session(self._secret, Role.DIALER, mine, frame.payload)
            enc.set_mac_key(keys.send_key)
            dec.set_mac_key(keys.recv_key)
            writer.write(enc.encode(FrameKind.AUTH, keys.local_proof))
            await writer.drain()
            try:
                frame = await _read_frame(reader, dec)
            except FrameError as e:
                raise HandshakeError(f"listener failed authentication ({e})") from e
            if frame.kind is not FrameKind.AUTH or not proof_matches(
                keys.peer_proof, frame.payload
            ):
                raise HandshakeError("listener failed authentication")
        if dec.buffered:
            raise FrameError("listener sent data after its handshake")
        return enc

    async def _run_session(
        self,
        peer: _Peer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        enc: FrameEncoder,
    ) -> None:
        loop = asyncio.get_running_loop()
        pump = self._track(loop.create_task(self._pump(peer, writer, enc)), owned=True)
        watch = self._track(loop.create_task(self._watch(reader)), owned=True)
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            watch.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
        for r in results:
            if isinstance(r, asyncio.CancelledError) or r is None:
                continue
            if isinstance(r, FrameError):
                self._c["bad_frames"] += 1
            elif isinstance(r, TimeoutError):
                self._c["write_timeouts"] += 1
            elif not isinstance(r, OSError):
                logger.error("session to node %d failed", peer.node_id, exc_info=r)
                continue
            logger.info("node %d: connection to node %d lost: %r", self.node_id, peer.node_id, r)

    async def _pump(self, peer: _Peer, writer: asyncio.StreamWriter, enc: FrameEncoder) -> None:
        """The session's writer of last resort: takes the queue when the
        end-of-turn flush cannot (the socket's buffer is not empty, or the
        session just began) and drains under ``write_timeout``. PINGs are
        the sweep's (:meth:`_sweep_links`)."""
        loop = asyncio.get_running_loop()
        peer.writer, peer.enc = writer, enc
        peer.last_write = loop.time()
        try:
            while True:
                if not peer.queue:
                    peer.wakeup.clear()
                    await peer.wakeup.wait()
                    continue
                frames = self._write_batch(peer, writer, enc)
                await self._drain(writer, frames)
        finally:
            if peer.writer is writer:
                peer.writer = peer.enc = None

    async def _drain(self, writer: asyncio.StreamWriter, frames: int) -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await writer.drain()
        except BaseException:
            # Some of these frames may still be in the kernel or our buffer;
            # counting the whole batch is an upper bound on what was lost.
            self._c["dropped_in_flight"] += frames
            raise

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        # The listener never talks after the handshake: a byte is a protocol
        # violation and EOF means the connection is gone.
        if await reader.read(1):
            raise FrameError("listener sent data after the handshake")

    # -- inbound ------------------------------------------------------------

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine) so the serving task is ours to
        # track and cancel; asyncio's own wrapper task would escape stop().
        if self._closed:
            writer.transport.abort()
            return
        task = self._track(
            asyncio.get_running_loop().create_task(self._serve_inbound(reader, writer))
        )
        # A task cancelled before its first step never runs its finally
        # block (stop() can do that to a connection accepted an instant
        # earlier), so the socket's closing must not depend on it.
        task.add_done_callback(lambda _t: writer.transport.abort())

    async def _serve_inbound(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        me = asyncio.current_task()
        peer_id = 0
        try:
            _set_nodelay(writer)
            try:
                async with asyncio.timeout(self._handshake_timeout):
                    peer_id, dec = await self._listener_handshake(reader, writer)
            except (HandshakeError, FrameError, TimeoutError, OSError) as e:
                self._c["rejected_handshakes"] += 1
                if isinstance(e, FrameError):
                    self._c["bad_frames"] += 1
                logger.info(
                    "node %d: rejected connection from %s: %s",
                    self.node_id,
                    writer.get_extra_info("peername"),
                    str(e) or type(e).__name__,
                )
                return
            self._c["accepted"] += 1
            # A fresh session from the same peer means the old one is dead
            # (or half-open); retire it so two streams never interleave.
            old = self._inbound.get(peer_id)
            if old is not None:
                old.cancel()
            assert me is not None
            self._inbound[peer_id] = me
            await self._receive(peer_id, reader, dec)
        except FrameError as e:
            self._c["bad_frames"] += 1
            logger.info("node %d: bad frame from node %d: %s", self.node_id, peer_id, e)
        except TimeoutError:
            self._c["idle_timeouts"] += 1
        except OSError as e:
            logger.debug("node %d: inbound connection from %d lost: %r", self.node_id, peer_id, e)
        finally:
            if peer_id and self._inbound.get(peer_id) is me:
                del self._inbound[peer_id]
            await _abort(writer)

    async def _listener_handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, FrameDecoder]:
        enc, dec = FrameEncoder(), FrameDecoder(MAX_HANDSHAKE_FRAME)
        frame = await _read_frame(reader, dec)
        if frame.kind is not FrameKind.HELLO:
            raise HandshakeError(f"expected HELLO, got {frame.kind.name}")
        theirs = decode_hello(frame.payload)
        has_secret = self._secret is not None
        check_hello(
            theirs,
            cluster_id=self.cluster_id,
            node_id=self.node_id,
            has_secret=has_secret,
            expect_node=None,
        )
        if theirs.node_id not in self._peers:
            raise HandshakeError(f"node {theirs.node_id} is not a configured peer")
        mine = encode_hello(Hello.fresh(self.cluster_id, self.node_id, theirs.node_id, has_secret))
        writer.write(enc.encode(FrameKind.HELLO, mine))
        await writer.drain()
        if self._secret is not None:
            keys = derive_session(self._secret, Role.LISTENER, frame.payload, mine)
            enc.set_mac_key(keys.send_key)
            dec.set_mac_key(keys.recv_key)
            try:
                frame = await _read_frame(reader, dec)
            except FrameError as e:
                raise HandshakeError(f"dialer failed authentication ({e})") from e
            if frame.kind is not FrameKind.AUTH or not proof_matches(
                keys.peer_proof, frame.payload
            ):
                raise HandshakeError("dialer failed authentication")
            writer.write(enc.encode(FrameKind.AUTH, keys.local_proof))
            await writer.drain()
        dec.max_frame_size = self._max_frame_size
        return theirs.node_id, dec

    async def _receive(self, peer_id: int, reader: asyncio.StreamReader, dec: FrameDecoder) -> None:
        """Deliver frames until the peer closes or is silent for
        ``idle_timeout``. Frames are decoded and delivered in the socket's
        own callback (:class:`_DirectReader`), not by this task, which only
        waits for the end. Silence is the transport's sweep's to find
        (:meth:`_sweep_links`, every ``keepalive_interval``): no timer per
        session or per read. A silent link is closed between
        ``idle_timeout`` and that plus ``keepalive_interval`` after its last
        byte."""
        if not isinstance(reader, _DirectReader):  # pragma: no cover - our server makes them
            raise TypeError("inbound connections read through a _DirectReader")
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[BaseException | None] = loop.create_future()
        me = asyncio.current_task()

        def end(why: BaseException | None) -> None:
            if not ended.done():
                ended.set_result(why)

        sess = _InSession(loop.time(), end, reader.transport_for_hold())

        def take(frames: list[Frame]) -> None:
            for frame in frames:
                if ended.done():
                    return  # ended by an earlier frame or retired meanwhile
                if self._closed or self._inbound.get(peer_id) is not me:
                    # stopped, or retired by a newer session from the peer or
                    # by update_peers (which drops a removed peer's session):
                    # not one frame more from here, even before this
                    # session's task gets to run its cancellation
                    end(None)
                    return
                if frame.kind is FrameKind.DATA:
                    self._deliver(peer_id, frame.payload)
                elif frame.kind is not FrameKind.PING:
                    end(FrameError(f"unexpected {frame.kind.name} frame after the handshake"))
                    return

        def sink(data: bytes) -> None:
            if ended.done():
                return
            sess.last = loop.time()
            try:
                frames = dec.feed(data)
            except FrameError as e:
                end(e)
                return
            take(frames)

        self._reading[peer_id] = sess
        try:
            take(dec.feed(b""))  # anything pipelined behind the handshake
            if not ended.done():
                reader.direct(sink, end)
            why = await ended
        finally:
            end(None)  # a cancelled session delivers nothing more
            if self._reading.get(peer_id) is sess:
                del self._reading[peer_id]
        if why is not None:
            raise why  # FrameError, TimeoutError (silence) or the socket's OSError
