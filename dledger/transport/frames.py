"""Sans-I/O framing for the peer transport.

The transport moves opaque payloads (already encoded by
:mod:`dledger.core.codec`); this module only delimits and protects them.
Nothing here touches a socket, so the decoder can be fuzzed on its own.

Frame layout (little-endian, 9-byte header)::

    magic u16 | version u8 | kind u8 | flags u8 | payload_len u32 | payload | trailer

The trailer is either a CRC32 (4 bytes, over header + payload) or, once a
connection has authenticated, a 16-byte truncated HMAC-SHA256 over
``seq u64 | header | payload``. ``seq`` is never sent: each direction counts
its MAC'd frames from 0, so a frame that is replayed, dropped or reordered
inside a session fails its MAC just like a forged one. ``FLAG_MAC`` says which
trailer follows; a frame whose flag disagrees with what the decoder expects is
an error rather than a downgrade.

Any violation raises :class:`FrameError` and poisons the decoder: after
garbage there is no reliable way to find the next frame boundary, so the only
sane reaction is to drop the connection.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

from dledger.errors import CodecError

FRAME_MAGIC = 0xD1E2
FRAME_VERSION = 1

FLAG_MAC = 0x01
_KNOWN_FLAGS = FLAG_MAC

HEADER = struct.Struct("<HBBBI")
HEADER_SIZE = HEADER.size
CRC_SIZE = 4
MAC_SIZE = 16
_CRC = struct.Struct("<I")
_SEQ = struct.Struct("<Q")

DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
_U32_MAX = 0xFFFF_FFFF


class FrameError(CodecError):
    """Bytes on a connection that cannot be trusted; the connection must close."""

    code = "FRAME_ERROR"


class FrameKind(enum.IntEnum):
    HELLO = 1  # handshake: identity, version, nonce
    AUTH = 2  # handshake: proof of the shared secret (secret mode only)
    DATA = 3  # one opaque payload for on_message
    PING = 4  # keepalive from an idle dialer; carries nothing


@dataclass(frozen=True, slots=True)
class Frame:
    kind: FrameKind
    payload: bytes
    flags: int = 0


def _mac(key: bytes, seq: int, header: bytes, payload: bytes) -> bytes:
    h = hmac.new(key, _SEQ.pack(seq), hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()[:MAC_SIZE]


def _check_key(key: bytes) -> None:
    if len(key) < 16:
        raise ValueError("a frame MAC key must be at least 16 bytes")


class FrameEncoder:
    """Turns payloads into frames for one direction of one connection."""

    def __init__(self, mac_key: bytes | None = None) -> None:
        self._key: bytes | None = None
        self._seq = 0
        if mac_key is not None:
            self.set_mac_key(mac_key)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def set_mac_key(self, key: bytes) -> None:
        """Switch to MAC trailers from the next frame on (sequence restarts at 0)."""
        _check_key(key)
        self._key = key
        self._seq = 0

    def encode(self, kind: FrameKind, payload: bytes = b"") -> bytes:
        if len(payload) > _U32_MAX:
            raise FrameError(f"payload of {len(payload)} bytes does not fit a frame")
        if self._key is None:
            header = HEADER.pack(FRAME_MAGIC, FRAME_VERSION, int(kind), 0, len(payload))
            trailer = _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))
        else:
            header = HEADER.pack(FRAME_MAGIC, FRAME_VERSION, int(kind), FLAG_MAC, len(payload))
            trailer = _mac(self._key, self._seq, header, payload)
            self._seq += 1
        return b"".join((header, payload, trailer))


class FrameDecoder:
    """Incremental decoder for one direction of one connection.

    ``feed`` buffers partial input and returns every complete frame. For
    handshakes, where the trailer mode changes between two frames that may
    arrive in the same read, use ``push`` + ``next_frame`` to take frames one
    at a time and call ``set_mac_key`` in between.
    """

    def __init__(
        self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, mac_key: bytes | None = None
    ) -> None:
        if not 0 <= max_frame_size <= _U32_MAX:
            raise ValueError(f"max_frame_size must be within 0..{_U32_MAX}")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._off = 0
        self._key: bytes | None = None
        self._seq = 0
        self._failed: FrameError | None = None
        if mac_key is not None:
            self.set_mac_key(mac_key)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._off

    def set_mac_key(self, key: bytes) -> None:
        _check_key(key)
        self._key = key
        self._seq = 0

    def push(self, data: bytes | bytearray | memoryview) -> None:
        self._check_not_failed()
        self._buf += data

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        self.push(data)
        frames = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def next_frame(self) -> Frame | None:
        self._check_not_failed()
        try:
            frame = self._parse()
        except FrameError as e:
            self._failed = e
            self._buf = bytearray()
            self._off = 0
            raise
        if self._off and self._off * 2 >= len(self._buf):
            # Compact lazily: deleting the consumed prefix after every frame
            # would make a burst of small frames quadratic.
            del self._buf[: self._off]
            self._off = 0
        return frame

    def _check_not_failed(self) -> None:
        if self._failed is not None:
            raise FrameError(f"decoder already failed: {self._failed}")

    def _parse(self) -> Frame | None:
        buf, start = self._buf, self._off
        if len(buf) - start < HEADER_SIZE:
            return None
        magic, version, kind, flags, length = HEADER.unpack_from(buf, start)
        # Header checks happen before the payload arrives so that a bogus
        # length cannot make us buffer up to 4 GiB first.
        if magic != FRAME_MAGIC:
            raise FrameError(f"bad frame magic 0x{magic:04x}")
        if version != FRAME_VERSION:
            raise FrameError(f"unsupported frame version {version}")
        try:
            fkind = FrameKind(kind)
        except ValueError:
            raise FrameError(f"unknown frame kind {kind}") from None
        if flags & ~_KNOWN_FLAGS:
            raise FrameError(f"unknown frame flags 0x{flags:02x}")
        if length > self.max_frame_size:
            raise FrameError(f"frame of {length} bytes exceeds the {self.max_frame_size} limit")
        want_mac = self._key is not None
        if bool(flags & FLAG_MAC) != want_mac:
            raise FrameError(
                "frame is not authenticated" if want_mac else "unexpected authenticated frame"
            )
        body_end = start + HEADER_SIZE + length
        end = body_end + (MAC_SIZE if want_mac else CRC_SIZE)
        if len(buf) < end:
            return None
        header = bytes(buf[start : start + HEADER_SIZE])
        payload = bytes(buf[start + HEADER_SIZE : body_end])
        trailer = bytes(buf[body_end:end])
        if self._key is not None:
            if not hmac.compare_digest(_mac(self._key, self._seq, header, payload), trailer):
                raise FrameError("frame failed its MAC check")
            self._seq += 1
        elif zlib.crc32(payload, zlib.crc32(header)) != _CRC.unpack(trailer)[0]:
            raise FrameError("frame failed its CRC check")
        self._off = end
        return Frame(kind=fkind, payload=payload, flags=flags)
