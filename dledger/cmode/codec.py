"""Controller mode's replication messages (the HA link), as transport payloads.

Layout of every message: magic ``DLHA``, version byte, kind byte, CRC32 of
the body (4 bytes), then the body (big-endian fields, below). A message
whose magic, version, kind, CRC or length is wrong raises
:class:`HaCodecError`; the receiver drops it (the transport already
authenticated the peer when a cluster secret is set).

Offsets count entries: a log holds the entries ``(min, max]`` (``min`` is
what retention or compaction dropped, ``max`` the last index), and an
epoch's ``start`` is the log's ``max`` when its master began writing.

* ``JOIN`` slave -> master: ``epoch`` (the master's epoch the slave was told
  of), the slave's ``min``, ``max`` and epoch map: "I want to follow you".
* ``JOIN_REPLY`` master -> slave: the master's ``epoch``, ``min``, ``max``,
  ``confirm`` and epoch map: the slave decides where to truncate.
* ``PUSH`` master -> slave: ``epoch``, ``prev`` (the index before the first
  entry), ``confirm``, then entries ``(index, epoch, type, pos, data)``; with
  no entries it is a heartbeat carrying the confirm offset.
* ``ACK`` slave -> master: ``epoch`` and the slave's durable ``max`` (after
  a truncation, the point it truncated to); ``need`` > 0 asks for the
  entries from that index (a push that did not follow the slave's log).
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from dledger.cmode.epochs import EpochEntry, EpochMap
from dledger.core.types import Entry, EntryType

MAGIC = b"DLHA"
VERSION = 1
_HDR = struct.Struct(">4sBBI")
_JOIN = struct.Struct(">QQQI")  # epoch, min, max, epoch count
_REPLY = struct.Struct(">QQQQI")  # epoch, min, max, confirm, epoch count
_PAIR = struct.Struct(">QQ")
_PUSH = struct.Struct(">QQQI")  # epoch, prev, confirm, entry count
_ENTRY = struct.Struct(">QQBQI")  # index, epoch, type, pos, data length
_ACK = struct.Struct(">QQQ")  # epoch, max, need


class HaCodecError(ValueError):
    """A malformed HA message (dropped by the receiver)."""


class Kind(enum.IntEnum):
    JOIN = 1
    JOIN_REPLY = 2
    PUSH = 3
    ACK = 4


@dataclass(frozen=True, slots=True)
class Join:
    epoch: int
    min: int
    max: int
    epochs: EpochMap


@dataclass(frozen=True, slots=True)
class JoinReply:
    epoch: int
    min: int
    max: int
    confirm: int
    epochs: EpochMap


@dataclass(frozen=True, slots=True)
class Push:
    epoch: int
    prev: int
    confirm: int
    entries: tuple[Entry, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    epoch: int
    max: int
    need: int = 0


HaMessage = Join | JoinReply | Push | Ack


def _pairs(m: EpochMap) -> bytes:
    return b"".join(_PAIR.pack(e.epoch, e.start) for e in m)


def encode(msg: HaMessage) -> bytes:
    if isinstance(msg, Join):
        kind, body = (
            Kind.JOIN,
            _JOIN.pack(msg.epoch, msg.min, msg.max, len(msg.epochs)) + _pairs(msg.epochs),
        )
    elif isinstance(msg, JoinReply):
        kind = Kind.JOIN_REPLY
        body = _REPLY.pack(msg.epoch, msg.min, msg.max, msg.confirm, len(msg.epochs)) + _pairs(
            msg.epochs
        )
    elif isinstance(msg, Push):
        parts = [_PUSH.pack(msg.epoch, msg.prev, msg.confirm, len(msg.entries))]
        for e in msg.entries:
            parts.append(_ENTRY.pack(e.index, e.term, int(e.type), e.pos, len(e.data)))
            parts.append(e.data)
        kind, body = Kind.PUSH, b"".join(parts)
    else:
        kind, body = Kind.ACK, _ACK.pack(msg.epoch, msg.max, msg.need)
    return _HDR.pack(MAGIC, VERSION, kind, zlib.crc32(body)) + body


def _epochs(body: bytes, off: int, count: int) -> EpochMap:
    if off + count * _PAIR.size != len(body):
        raise HaCodecError("epoch map does not fit the message")
    try:
        return EpochMap(
            [EpochEntry(*_PAIR.unpack_from(body, off + k * _PAIR.size)) for k in range(count)]
        )
    except ValueError as exc:
        raise HaCodecError(f"bad epoch map: {exc}") from None


def decode(data: bytes) -> HaMessage:
    if len(data) < _HDR.size:
        raise HaCodecError("HA message is truncated")
    magic, version, kind, crc = _HDR.unpack_from(data, 0)
    if magic != MAGIC:
        raise HaCodecError("not an HA message")
    if version != VERSION:
        raise HaCodecError(f"HA message version {version} is not supported")
    body = bytes(data[_HDR.size :])
    if zlib.crc32(body) != crc:
        raise HaCodecError("HA message CRC mismatch")
    try:
        if kind == Kind.JOIN:
            epoch, lo, hi, n = _JOIN.unpack_from(body, 0)
            return Join(epoch, lo, hi, _epochs(body, _JOIN.size, n))
        if kind == Kind.JOIN_REPLY:
            epoch, lo, hi, confirm, n = _REPLY.unpack_from(body, 0)
            return JoinReply(epoch, lo, hi, confirm, _epochs(body, _REPLY.size, n))
        if kind == Kind.PUSH:
            epoch, prev, confirm, n = _PUSH.unpack_from(body, 0)
            off = _PUSH.size
            entries = []
            for _ in range(n):
                index, term, etype, pos, size = _ENTRY.unpack_from(body, off)
                off += _ENTRY.size
                if off + size > len(body):
                    raise HaCodecError("entry overruns the message")
                entries.append(Entry(index, term, EntryType(etype), body[off : off + size], pos))
                off += size
            if off != len(body):
                raise HaCodecError("trailing bytes after the entries")
            return Push(epoch, prev, confirm, tuple(entries))
        if kind == Kind.ACK:
            if len(body) != _ACK.size:
                raise HaCodecError("ACK has the wrong length")
            return Ack(*_ACK.unpack_from(body, 0))
    except struct.error as exc:
        raise HaCodecError(f"HA message is truncated: {exc}") from None
    except ValueError as exc:  # an unknown entry type
        raise HaCodecError(str(exc)) from None
    raise HaCodecError(f"unknown HA message kind {kind}")
