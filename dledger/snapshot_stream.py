"""Chunked, back-pressured InstallSnapshot streaming between nodes.

Theory of operation
-------------------
The Raft core emits one SNAPSHOT message (``Ready.snapshots_to_send``) and,
on the follower, expects to step one complete SNAPSHOT message carrying the
whole state-machine payload. A payload may be far larger than a transport
frame (64 MiB), so the node layer cuts it into chunks and reassembles it;
the core never sees a chunk.

Wire (little-endian, each frame one transport payload; the u16 magics differ
from every codec magic, in particular from the Raft message's ``0xD1E1``, so
``node._on_message`` dispatches on the first two bytes)::

    CHUNK magic 0xD1E5 | version u8 | flags u8 (0x01 FINAL) | snap_index u64 |
          snap_term u64 | total_len u64 | offset u64 | data_len u32 |
          msg_len u32 | payload_crc u32 | data | msg | crc u32
    ACK   magic 0xD1E6 | version u8 | flags u8 (0x01 DONE, 0x02 ABORT, 0x04 GAP) |
          snap_index u64 | snap_term u64 | next_offset u64 | reason u8 | crc u32

``crc`` covers every byte before it. Only the FINAL chunk carries ``msg``
(the encoded SNAPSHOT Raft message *without* its data) and ``payload_crc``
(CRC32 of the whole payload); it also carries the payload's last bytes, so
``offset + data_len == total_len`` exactly for it and for no other chunk.

Receiver (:class:`Assembler`, one per sending peer): it appends only the chunk
at the next expected offset and answers every chunk with an ACK of the next
offset it expects (a cumulative acknowledgement). A chunk past that offset
means something was lost in between: the ACK has GAP set and the sender goes
back to it (go-back-N; the transport delivers in order, so losses only happen
around reconnects). A chunk of another snapshot (index, term) restarts the
assembly. The FINAL chunk is accepted only if the CRC of the whole payload
matches; then the Raft message is rebuilt with the payload and handed to the
core. Too large, CRC mismatch, undecodable or misaddressed message: ABORT.

Sender (:class:`SendWindow`, one per running stream): at most
``window_chunks`` chunks beyond the acknowledged offset are in flight; a
refused ``send`` (the transport's bounded queue is full) moves the send
position back to the refused chunk and the glue waits before retrying.
Without acknowledgement progress for ``resend_after_s`` everything
unacknowledged is sent again; for ``timeout_s`` the stream fails and the
core is told (``report_snapshot(to, False)``), which asks again later. An
ACK below the acknowledged offset means the receiver lost its assembly (it
restarted): the sender goes back to it. An ACK above it (the receiver still
holds part of this snapshot from an earlier attempt) resumes from there.

Both classes are pure (no I/O, time passed in); :class:`SnapshotStreams` is
the thin asyncio glue the node calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dledger.core.codec import decode_message, encode_message
from dledger.core.types import Message, MsgType, Snapshot, SnapshotMeta
from dledger.errors import CodecError

logger = logging.getLogger(__name__)

CHUNK_MAGIC = 0xD1E5
ACK_MAGIC = 0xD1E6
STREAM_VERSION = 1

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_WINDOW_CHUNKS = 4
DEFAULT_MAX_SNAPSHOT_BYTES = 8 << 30

_MAGIC = struct.Struct("<H")
_CHUNK_HDR = struct.Struct("<HBBQQQQIII")
_ACK_BODY = struct.Struct("<HBBQQQB")
_CRC = struct.Struct("<I")
_CHUNK_FINAL = 0x01
_ACK_DONE = 0x01
_ACK_ABORT = 0x02
_ACK_GAP = 0x04
_ACK_FLAGS = _ACK_DONE | _ACK_ABORT | _ACK_GAP
_U32_MAX = 0xFFFF_FFFF


class AbortReason(enum.IntEnum):
    NONE = 0
    TOO_LARGE = 1  # total size above the receiver's cap
    BAD_PAYLOAD_CRC = 2  # assembled payload does not match the final chunk's CRC
    BAD_MESSAGE = 3  # the final chunk's Raft message is undecodable or not ours
    INCONSISTENT = 4  # a chunk disagrees with the assembly's total size


@dataclass(frozen=True, slots=True)
class Chunk:
    """``data`` is ``payload[offset : offset + len(data)]`` of the snapshot
    ``(index, term)``, ``total`` bytes long. Only the final chunk has
    ``message`` (an encoded SNAPSHOT message without data) and ``payload_crc``."""

    index: int
    term: int
    total: int
    offset: int
    data: bytes
    final: bool = False
    payload_crc: int = 0
    message: bytes = b""


@dataclass(frozen=True, slots=True)
class Ack:
    """The receiver expects ``next_offset`` of snapshot ``(index, term)``.
    ``done``: assembled and handed to Raft; ``gap``: a chunk past
    ``next_offset`` arrived (resend from it); ``abort``: give up (see reason)."""

    index: int
    term: int
    next_offset: int
    done: bool = False
    gap: bool = False
    reason: AbortReason = AbortReason.NONE

    @property
    def abort(self) -> bool:
        return self.reason is not AbortReason.NONE


# ==========================================================================
# codec
# ==========================================================================
def is_stream_frame(payload: bytes | memoryview) -> bool:
    """True if the transport payload is a chunk or an ACK (not a Raft message)."""
    if len(payload) < _MAGIC.size:
        return False
    (magic,) = _MAGIC.unpack_from(payload, 0)
    return magic in (CHUNK_MAGIC, ACK_MAGIC)


def encode_chunk(c: Chunk) -> bytes:
    return _encode_chunk_parts(c, c.data)


def _encode_chunk_parts(c: Chunk, data: bytes | memoryview) -> bytes:
    if len(data) > _U32_MAX or len(c.message) > _U32_MAX:
        raise CodecError("chunk data or message too large for one chunk")
    hdr = _CHUNK_HDR.pack(
        CHUNK_MAGIC,
        STREAM_VERSION,
        _CHUNK_FINAL if c.final else 0,
        c.index,
        c.term,
        c.total,
        c.offset,
        len(data),
        len(c.message),
        c.payload_crc,
    )
    crc = zlib.crc32(c.message, zlib.crc32(data, zlib.crc32(hdr)))
    return b"".join((hdr, data, c.message, _CRC.pack(crc)))


def encode_ack(a: Ack) -> bytes:
    flags = (
        (_ACK_DONE if a.done else 0) | (_ACK_ABORT if a.abort else 0) | (_ACK_GAP if a.gap else 0)
    )
    body = _ACK_BODY.pack(
        ACK_MAGIC, STREAM_VERSION, flags, a.index, a.term, a.next_offset, int(a.reason)
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_stream_frame(buf: bytes | memoryview) -> Chunk | Ack:
    """Decode a chunk or an ACK; raises :class:`CodecError` on anything else,
    on a CRC mismatch, a wrong length or inconsistent fields."""
    mv = memoryview(buf)
    if len(mv) < _MAGIC.size + _CRC.size:
        raise CodecError(f"stream frame too short: {len(mv)} bytes")
    (crc,) = _CRC.unpack_from(mv, len(mv) - _CRC.size)
    if zlib.crc32(mv[: len(mv) - _CRC.size]) != crc:
        raise CodecError("stream frame failed its CRC check")
    (magic,) = _MAGIC.unpack_from(mv, 0)
    if magic == CHUNK_MAGIC:
        return _decode_chunk(mv)
    if magic == ACK_MAGIC:
        return _decode_ack(mv)
    raise CodecError(f"bad stream frame magic 0x{magic:04x}")


def _decode_chunk(mv: memoryview) -> Chunk:
    if len(mv) < _CHUNK_HDR.size + _CRC.size:
        raise CodecError(f"chunk too short: {len(mv)} bytes")
    _, version, flags, index, term, total, offset, n, mlen, pcrc = _CHUNK_HDR.unpack_from(mv, 0)
    if version != STREAM_VERSION:
        raise CodecError(f"unsupported stream version {version}")
    if flags & ~_CHUNK_FINAL:
        raise CodecError(f"unknown chunk flag bits 0x{flags & ~_CHUNK_FINAL:02x}")
    if _CHUNK_HDR.size + n + mlen + _CRC.size != len(mv):
        raise CodecError(
            f"chunk length mismatch: header says {n}+{mlen}, frame has "
            f"{len(mv) - _CHUNK_HDR.size - _CRC.size}"
        )
    final = bool(flags & _CHUNK_FINAL)
    end = offset + n
    if end > total:
        raise CodecError(f"chunk [{offset}, {end}) beyond the payload's {total} bytes")
    if final:
        if end != total:
            raise CodecError(f"final chunk ends at {end}, the payload at {total}")
        if mlen == 0:
            raise CodecError("final chunk without its Raft message")
    else:
        if end == total or n == 0:
            raise CodecError("non-final chunk that is empty or ends the payload")
        if mlen or pcrc:
            raise CodecError("non-final chunk with a message or payload CRC")
    data_at = _CHUNK_HDR.size
    return Chunk(
        index,
        term,
        total,
        offset,
        bytes(mv[data_at : data_at + n]),
        final,
        pcrc,
        bytes(mv[data_at + n : data_at + n + mlen]),
    )


def _decode_ack(mv: memoryview) -> Ack:
    if len(mv) != _ACK_BODY.size + _CRC.size:
        raise CodecError(f"ack of {len(mv)} bytes, expected {_ACK_BODY.size + _CRC.size}")
    _, version, flags, index, term, nxt, reason = _ACK_BODY.unpack_from(mv, 0)
    if version != STREAM_VERSION:
        raise CodecError(f"unsupported stream version {version}")
    if flags & ~_ACK_FLAGS:
        raise CodecError(f"unknown ack flag bits 0x{flags & ~_ACK_FLAGS:02x}")
    try:
        why = AbortReason(reason)
    except ValueError:
        raise CodecError(f"unknown abort reason {reason}") from None
    if bool(flags & _ACK_ABORT) != (why is not AbortReason.NONE):
        raise CodecError("ack abort flag and reason disagree")
    return Ack(index, term, nxt, bool(flags & _ACK_DONE), bool(flags & _ACK_GAP), why)


# ==========================================================================
# receiver
# ==========================================================================
class Assembler:
    """Reassembles the snapshots one peer streams to this node (pure).

    ``feed`` returns the ACK to send back and, once the final chunk checked
    out, the SNAPSHOT message rebuilt with the whole payload (to be stepped).
    """

    def __init__(self, peer_id: int, node_id: int, max_bytes: int) -> None:
        self.peer_id = peer_id
        self.node_id = node_id
        self.max_bytes = max_bytes
        self.key: tuple[int, int] | None = None
        self.total = 0
        self._buf = bytearray()
        self._crc = 0
        self._done: tuple[int, int, int] | None = None  # (index, term, total) last delivered
        self._rejected: tuple[int, int] | None = None  # last snapshot answered with ABORT

    @property
    def received(self) -> int:
        return len(self._buf)

    def reset(self) -> None:
        self.key = None
        self.total = 0
        self._buf = bytearray()
        self._crc = 0

    def feed(self, c: Chunk) -> tuple[Ack | None, Message | None]:
        """The ACK to send (None: say nothing) and the complete message, if any."""
        key = (c.index, c.term)
        if self.key is None and self._done == (c.index, c.term, c.total):
            # A resend of a snapshot already delivered (our DONE was lost).
            return Ack(c.index, c.term, c.total, done=True), None
        if self.key is None and self._rejected == key and c.offset > 0:
            # The rest of a window we already refused; the sender has its
            # ABORT (or times out). A new attempt starts again at offset 0.
            return None, None
        if key != self.key:
            self.reset()
            if c.total > self.max_bytes:
                return self._abort(c, AbortReason.TOO_LARGE), None
            self.key, self.total = key, c.total
        if c.total != self.total:
            self.reset()
            return self._abort(c, AbortReason.INCONSISTENT), None
        have = len(self._buf)
        if c.offset != have:
            # Before: a duplicate (or a resumed sender); after: something was lost.
            return Ack(c.index, c.term, have, gap=c.offset > have), None
        self._buf += c.data
        self._crc = zlib.crc32(c.data, self._crc)
        if not c.final:
            return Ack(c.index, c.term, len(self._buf)), None
        if self._crc != c.payload_crc:
            self.reset()
            return self._abort(c, AbortReason.BAD_PAYLOAD_CRC), None
        try:
            m = decode_message(c.message)
        except CodecError:
            self.reset()
            return self._abort(c, AbortReason.BAD_MESSAGE), None
        meta = m.snapshot
        if (
            m.type is not MsgType.SNAPSHOT
            or meta is None
            or (meta.index, meta.term) != key
            or m.snapshot_data
            or m.frm != self.peer_id
            or m.to != self.node_id
        ):
            self.reset()
            return self._abort(c, AbortReason.BAD_MESSAGE), None
        data = bytes(self._buf)
        self.reset()
        self._done = (c.index, c.term, c.total)
        return Ack(c.index, c.term, c.total, done=True), dataclasses.replace(m, snapshot_data=data)

    def _abort(self, c: Chunk, reason: AbortReason) -> Ack:
        self._rejected = (c.index, c.term)
        return Ack(c.index, c.term, 0, reason=reason)


# ==========================================================================
# sender
# ==========================================================================
class SendWindow:
    """Which chunk of one snapshot stream to send next (pure; time passed in).

    The send position ``sent`` runs ahead of the acknowledged offset
    ``acked`` by at most ``window_chunks * chunk_bytes``; ``final_out`` says
    the final chunk (which may be empty, for an empty payload) went out."""

    def __init__(
        self,
        total: int,
        chunk_bytes: int,
        window_chunks: int,
        now: float,
        resend_after_s: float,
        timeout_s: float,
    ) -> None:
        if chunk_bytes < 1 or window_chunks < 1:
            raise ValueError("chunk_bytes and window_chunks must be >= 1")
        self.total = total
        self.chunk_bytes = chunk_bytes
        self.window_bytes = chunk_bytes * window_chunks
        self.resend_after_s = resend_after_s
        self.timeout_s = timeout_s
        self.acked = 0
        self.sent = 0
        self.final_out = False
        self.done = False
        self.abort_reason = AbortReason.NONE
        self.rewinds = 0
        self._last_progress = now
        self._last_resend = now
        self._rewound_at = -1

    def next_chunk(self) -> tuple[int, int] | None:
        """``(offset, length)`` of the chunk to send now, or None (window full,
        everything out, or finished)."""
        if self.done or self.abort_reason is not AbortReason.NONE or self.final_out:
            return None
        if self.sent - self.acked >= self.window_bytes:
            return None
        return self.sent, min(self.chunk_bytes, self.total - self.sent)

    def is_final(self, offset: int, length: int) -> bool:
        return offset + length == self.total

    def mark_sent(self, offset: int, length: int) -> None:
        self.sent = offset + length
        if self.sent == self.total:
            self.final_out = True

    def on_refused(self, offset: int) -> None:
        """The transport refused the chunk at ``offset``: send it again later."""
        self._rewind(offset)

    def on_ack(self, ack: Ack, now: float) -> None:
        if self.done:
            return
        if ack.abort:
            self.abort_reason = ack.reason
            return
        n = ack.next_offset
        if n > self.total:
            return  # nonsense: ignore
        if ack.done:
            if n == self.total:
                self.done = True
            return
        if n > self.acked:
            self.acked = n
            if self.sent < n:  # the receiver already held more (resumed)
                self._rewind(n)
            self._last_progress = now
            self._rewound_at = -1
        elif n < self.acked:
            # The receiver lost its assembly (restarted): go back to what it has.
            self.acked = n
            self._rewind(n)
            self.rewinds += 1
            self._last_progress = now
            self._rewound_at = n
        elif ack.gap and self._rewound_at != n and (self.sent > n or self.final_out):
            # Lost in between: go back once per gap; the chunks already in
            # flight behind the loss will report the same gap again.
            self._rewind(n)
            self.rewinds += 1
            self._rewound_at = n

    def poll(self, now: float) -> bool:
        """Handle timers; False when the stream must be given up (no
        acknowledgement progress for ``timeout_s``)."""
        if self.done:
            return True
        if now - self._last_progress >= self.timeout_s:
            return False
        outstanding = self.sent > self.acked or self.final_out
        if outstanding and now - max(self._last_progress, self._last_resend) >= self.resend_after_s:
            self._rewind(self.acked)
            self._last_resend = now
            self.rewinds += 1
        return True

    def _rewind(self, offset: int) -> None:
        self.sent = offset
        self.final_out = False


# ==========================================================================
# asyncio glue
# ==========================================================================
@dataclass(frozen=True, slots=True)
class StreamSettings:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    window_chunks: int = DEFAULT_WINDOW_CHUNKS
    max_snapshot_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES
    timeout_s: float = 10.0

    @property
    def resend_after_s(self) -> float:
        return min(2.0, self.timeout_s / 2)


COUNTERS = (
    "snapshot_chunks_sent",
    "snapshot_chunk_bytes_sent",
    "snapshot_chunks_received",
    "snapshot_chunk_bytes_received",
    "snapshot_chunks_refused",  # transport queue full: retried after a pause
    "snapshot_chunk_rewinds",  # go-back-N resends (gap or timer)
    "snapshot_stream_aborts",  # streams this node (as sender) gave up
    "snapshot_stream_rejects",  # ABORTs this node (as receiver) answered
    "snapshot_stream_garbage",  # undecodable stream frames
    "snapshot_stream_ignored",  # requests ignored: a stream to that peer is running
    "snapshots_received",  # assembled, checked, handed to Raft
)

# How long a sender waits for an ACK before looking at its timers again, and
# before retrying after the transport refused a chunk.
_POLL_S = 0.25
_REFUSED_WAIT_S = 0.02


@dataclass(slots=True)
class _Outgoing:
    snap: Snapshot
    meta: SnapshotMeta
    window: SendWindow
    wake: asyncio.Event
    task: asyncio.Task[None] | None = None


class SnapshotStreams:
    """The node's side of snapshot streaming: one sending task per peer and
    one :class:`Assembler` per sending peer. All methods run on the loop thread.

    ``send(peer, payload) -> bool`` is the transport's send; ``deliver(m)``
    puts a complete SNAPSHOT message into the node's inbox; ``failed(peer)``
    reports a failed transfer to the core (after the next advance), and
    ``sent(peer)`` a complete one (the receiver acknowledged every byte)."""

    def __init__(
        self,
        node_id: int,
        settings: StreamSettings,
        send: Callable[[int, bytes], bool],
        deliver: Callable[[Message], None],
        failed: Callable[[int], None],
        counters: dict[str, int],
        clock: Callable[[], float] = time.monotonic,
        offload: Callable[[Callable[[bytes], int], bytes], Awaitable[int]] | None = None,
        sent: Callable[[int], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self._sent = sent
        # The node's clock and worker-thread runner (dledger/runtime.py), so
        # the simulator drives streams on virtual time too.
        self._clock = clock
        self._offload = offload
        self.settings = settings
        self._send = send
        self._deliver = deliver
        self._failed = failed
        self.counters = counters
        for k in COUNTERS:
            counters.setdefault(k, 0)
        counters.setdefault("snapshots_sent", 0)
        counters.setdefault("snapshots_send_failed", 0)
        self._out: dict[int, _Outgoing] = {}
        self._in: dict[int, Assembler] = {}
        self._expiry: dict[int, asyncio.TimerHandle] = {}
        self._crc_of: tuple[Snapshot, int] | None = None
        self._closed = False

    # -- sender --------------------------------------------------------------
    def send_snapshot(self, m: Message, snap: Snapshot) -> bool:
        """Start streaming ``snap`` to ``m.to`` (``m`` is the core's SNAPSHOT
        message for it). False if ignored: a stream to that peer is running.

        A newer snapshot for a peer that is still receiving an older one is
        ignored too: restarting would never finish whenever snapshots are
        taken faster than one transfers, while finishing the older one makes
        progress (the core asks again if the follower still needs more)."""
        if self._closed:
            return False
        cur = self._out.get(m.to)
        if cur is not None:
            self.counters["snapshot_stream_ignored"] += 1
            if cur.meta != snap.meta:
                logger.info(
                    "node %d: snapshot at %d for node %d waits: the one at %d is still streaming",
                    self.node_id,
                    snap.meta.index,
                    m.to,
                    cur.meta.index,
                )
            return False
        s = self.settings
        win = SendWindow(
            len(snap.data),
            s.chunk_bytes,
            s.window_chunks,
            self._clock(),
            s.resend_after_s,
            s.timeout_s,
        )
        out = _Outgoing(snap, snap.meta, win, asyncio.Event())
        self._out[m.to] = out
        out.task = asyncio.get_running_loop().create_task(
            self._stream(m, snap, out), name=f"snapshot-stream-{self.node_id}-to-{m.to}"
        )
        return True

    def streaming_to(self) -> list[int]:
        return sorted(self._out)

    def stop_sending(self) -> None:
        """Cancel every outgoing stream (leadership lost, or stopping)."""
        for out in list(self._out.values()):
            if out.task is not None:
                out.task.cancel()
        self._out.clear()

    async def close(self) -> None:
        self._closed = True
        tasks = [o.task for o in self._out.values() if o.task is not None]
        self.stop_sending()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for h in self._expiry.values():
            h.cancel()
        self._expiry.clear()
        self._in.clear()

    async def _payload_crc(self, snap: Snapshot) -> int:
        cached = self._crc_of
        if cached is not None and cached[0] is snap:
            return cached[1]
        if self._offload is not None:
            crc = await self._offload(zlib.crc32, snap.data)
        else:
            crc = await asyncio.to_thread(zlib.crc32, snap.data)  # releases the GIL
        self._crc_of = (snap, crc)
        return crc

    async def _stream(self, m: Message, snap: Snapshot, out: _Outgoing) -> None:
        to, meta, win = m.to, snap.meta, out.window
        t0 = self._clock()
        ok = False
        try:
            pcrc = await self._payload_crc(snap)
            msg = encode_message(dataclasses.replace(m, snapshot_data=b""))
            data = memoryview(snap.data)
            c = self.counters
            while True:
                if win.done:
                    ok = True
                    break
                if win.abort_reason is not AbortReason.NONE:
                    logger.warning(
                        "node %d: node %d refused snapshot at %d: %s",
                        self.node_id,
                        to,
                        meta.index,
                        win.abort_reason.name,
                    )
                    break
                rewinds = win.rewinds
                if not win.poll(self._clock()):
                    logger.warning(
                        "node %d: snapshot at %d to node %d: no progress for %.1fs at "
                        "%d of %d bytes; giving up",
                        self.node_id,
                        meta.index,
                        to,
                        win.timeout_s,
                        win.acked,
                        win.total,
                    )
                    break
                refused = False
                while (nxt := win.next_chunk()) is not None:
                    off, ln = nxt
                    final = win.is_final(off, ln)
                    head = Chunk(
                        meta.index,
                        meta.term,
                        win.total,
                        off,
                        b"",
                        final,
                        pcrc if final else 0,
                        msg if final else b"",
                    )
                    if not self._send(to, _encode_chunk_parts(head, data[off : off + ln])):
                        win.on_refused(off)
                        c["snapshot_chunks_refused"] += 1
                        refused = True
                        break
                    win.mark_sent(off, ln)
                    c["snapshot_chunks_sent"] += 1
                    c["snapshot_chunk_bytes_sent"] += ln
                c["snapshot_chunk_rewinds"] += win.rewinds - rewinds
                out.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_REFUSED_WAIT_S if refused else _POLL_S):
                        await out.wake.wait()
        except Exception:  # a bug here must not take the node down: Raft retries
            logger.exception("node %d: snapshot stream to node %d failed", self.node_id, to)
        finally:
            if self._out.get(to) is out:
                del self._out[to]
            cached = self._crc_of
            if cached is not None and all(o.snap is not cached[0] for o in self._out.values()):
                self._crc_of = None  # do not keep a superseded snapshot alive for its CRC
        dt = self._clock() - t0
        if ok:
            self.counters["snapshots_sent"] += 1
            logger.info(
                "node %d: streamed snapshot at %d (%d bytes) to node %d in %.2fs",
                self.node_id,
                meta.index,
                win.total,
                to,
                dt,
            )
            if self._sent is not None:
                self._sent(to)
        else:
            self.counters["snapshots_send_failed"] += 1
            self.counters["snapshot_stream_aborts"] += 1
            self._failed(to)

    # -- receiver ------------------------------------------------------------
    def on_frame(self, peer_id: int, payload: bytes) -> None:
        """A stream frame from ``peer_id`` (authenticated by the transport).
        Never raises for bad input: garbage is counted and logged."""
        try:
            f = decode_stream_frame(payload)
        except CodecError as exc:
            self.counters["snapshot_stream_garbage"] += 1
            logger.warning(
                "node %d: undecodable snapshot stream frame from %d: %s",
                self.node_id,
                peer_id,
                exc,
            )
            return
        if isinstance(f, Ack):
            out = self._out.get(peer_id)
            if out is not None and (out.meta.index, out.meta.term) == (f.index, f.term):
                out.window.on_ack(f, self._clock())
                out.wake.set()
            return
        self._on_chunk(peer_id, f)

    def _on_chunk(self, peer_id: int, c: Chunk) -> None:
        asm = self._in.get(peer_id)
        if asm is None:
            asm = self._in[peer_id] = Assembler(
                peer_id, self.node_id, self.settings.max_snapshot_bytes
            )
        self.counters["snapshot_chunks_received"] += 1
        self.counters["snapshot_chunk_bytes_received"] += len(c.data)
        ack, m = asm.feed(c)
        if ack is None:
            return
        if ack.abort:
            self.counters["snapshot_stream_rejects"] += 1
            logger.warning(
                "node %d: rejected snapshot at %d (%d bytes) from node %d: %s",
                self.node_id,
                c.index,
                c.total,
                peer_id,
                ack.reason.name,
            )
        self._send(peer_id, encode_ack(ack))  # lost: the sender's timer resends
        self._arm_expiry(peer_id, asm)
        if m is not None:
            self.counters["snapshots_received"] += 1
            logger.info(
                "node %d: received snapshot at %d (%d bytes) from node %d",
                self.node_id,
                c.index,
                c.total,
                peer_id,
            )
            self._deliver(m)

    def _arm_expiry(self, peer_id: int, asm: Assembler) -> None:
        """Drop a half-built assembly nobody continues (its sender died),
        so its memory does not stay held until the next snapshot."""
        h = self._expiry.pop(peer_id, None)
        if h is not None:
            h.cancel()
        if asm.key is None:
            return

        def expire() -> None:
            self._expiry.pop(peer_id, None)
            if asm.key is not None:
                logger.info(
                    "node %d: dropping an idle partial snapshot from node %d (%d of %d bytes)",
                    self.node_id,
                    peer_id,
                    asm.received,
                    asm.total,
                )
                asm.reset()

        self._expiry[peer_id] = asyncio.get_running_loop().call_later(
            4 * self.settings.timeout_s, expire
        )

    def status(self) -> dict[str, object]:
        return {
            "chunk_bytes": self.settings.chunk_bytes,
            "window_chunks": self.settings.window_chunks,
            "max_snapshot_bytes": self.settings.max_snapshot_bytes,
            "sending": {
                str(p): {"index": o.meta.index, "acked": o.window.acked, "total": o.window.total}
                for p, o in sorted(self._out.items())
            },
            "receiving": {
                str(p): {"index": a.key[0], "received": a.received, "total": a.total}
                for p, a in sorted(self._in.items())
                if a.key is not None
            },
            **{k: self.counters[k] for k in COUNTERS},
        }
