"""Binary codec for entries and peer messages: struct headers, raw payloads, CRC.

Theory of operation: one encoding per value, versioned by a leading byte and
protected by a CRC32 over everything before it, so that storage and the
transport reuse exactly the same bytes. Decoding checks length, magic,
version and CRC and raises :class:`CodecError`; it never guesses. No pickle.

Entry record (little-endian header, 40 bytes + data):
  magic u16 | version u8 | type u8 | index u64 | term u64 | pos u64 |
  data_len u32 | crc u32 (over header bytes before it + data) | data
Message record:
  magic u16 | version u8 | type u8 | to u64 | frm u64 | term u64 |
  log_term u64 | index u64 | commit u64 | reject_hint u64 | context u64 |
  flags u8 | n_entries u32 | entries (each an entry record prefixed by u32
  length) | [snapshot section, when flag 0x04] | crc u32 (over everything
  before it)
Flags: 0x01 reject, 0x02 force, 0x04 a snapshot section follows the entries:
  index u64 | term u64 | end_pos u64 | n_voters u32 | n_learners u32 |
  voter ids u64... | learner ids u64... | data_len u32 | data
Messages without a snapshot encode exactly as before the flag existed.
"""

from __future__ import annotations

import struct
import zlib

from dledger.core.types import (
    ClusterConfig,
    ConfChange,
    ConfChangeType,
    Entry,
    EntryType,
    Message,
    MsgType,
    SnapshotMeta,
)
from dledger.errors import CodecError

ENTRY_MAGIC = 0xD1E0
MSG_MAGIC = 0xD1E1
VERSION = 1

_ENTRY_HDR = struct.Struct("<HBBQQQI")
_CRC = struct.Struct("<I")
_MSG_HDR = struct.Struct("<HBBQQQQQQQQBI")
_U32 = struct.Struct("<I")
_CONF = struct.Struct("<BQ")
_SNAP_HDR = struct.Struct("<QQQII")
_U64 = struct.Struct("<Q")
_FLAG_REJECT = 0x01
_FLAG_FORCE = 0x02
_FLAG_SNAPSHOT = 0x04
_FLAG_NO_REPLY = 0x08
_KNOWN_FLAGS = _FLAG_REJECT | _FLAG_FORCE | _FLAG_SNAPSHOT | _FLAG_NO_REPLY

ENTRY_OVERHEAD = _ENTRY_HDR.size + _CRC.size
_ENTRY_TYPES: dict[int, EntryType] = {int(t): t for t in EntryType}
_HDR_CRC = struct.Struct("<HBBQQQII")  # entry header + its CRC, in one unpack


def encode_entry(e: Entry) -> bytes:
    hdr = _ENTRY_HDR.pack(ENTRY_MAGIC, VERSION, int(e.type), e.index, e.term, e.pos, len(e.data))
    crc = zlib.crc32(e.data, zlib.crc32(hdr))
    return b"".join((hdr, _CRC.pack(crc), e.data))


def decode_entry(buf: bytes | memoryview) -> Entry:
    mv = memoryview(buf)
    if len(mv) < ENTRY_OVERHEAD:
        raise CodecError(f"entry record too short: {len(mv)} bytes")
    return _decode_entry_at(mv, 0, len(mv))


def _decode_entry_at(mv: memoryview, off: int, length: int) -> Entry:
    """Decode the entry record occupying ``mv[off : off + length]``."""
    if length < ENTRY_OVERHEAD:
        raise CodecError(f"entry record too short: {length} bytes")
    magic, version, etype, index, term, pos, n, crc = _HDR_CRC.unpack_from(mv, off)
    if magic != ENTRY_MAGIC:
        raise CodecError(f"bad entry magic 0x{magic:04x}")
    if version != VERSION:
        raise CodecError(f"unsupported entry version {version}")
    if length != ENTRY_OVERHEAD + n:
        raise CodecError(f"entry length mismatch: header says {n}, have {length - ENTRY_OVERHEAD}")
    data = bytes(mv[off + ENTRY_OVERHEAD : off + length])
    if zlib.crc32(data, zlib.crc32(mv[off : off + _ENTRY_HDR.size])) != crc:
        raise CodecError(f"entry {index} failed its CRC check")
    et = _ENTRY_TYPES.get(etype)
    if et is None:
        raise CodecError(f"unknown entry type {etype}")
    return Entry(index, term, et, data, pos)


def encode_message(m: Message) -> bytes:
    flags = (
        (_FLAG_REJECT if m.reject else 0)
        | (_FLAG_FORCE if m.force else 0)
        | (_FLAG_SNAPSHOT if m.snapshot is not None else 0)
        | (_FLAG_NO_REPLY if m.no_reply else 0)
    )
    parts = [
        _MSG_HDR.pack(
            MSG_MAGIC,
            VERSION,
            int(m.type),
            m.to,
            m.frm,
            m.term,
            m.log_term,
            m.index,
            m.commit,
            m.reject_hint,
            m.context,
            flags,
            len(m.entries),
        )
    ]
    for e in m.entries:
        rec = encode_entry(e)
        parts.append(_U32.pack(len(rec)))
        parts.append(rec)
    snap = m.snapshot
    if snap is not None:
        cfg = snap.config
        parts.append(
            _SNAP_HDR.pack(snap.index, snap.term, snap.end_pos, len(cfg.voters), len(cfg.learners))
        )
        parts.extend(_U64.pack(i) for i in (*cfg.voters, *cfg.learners))
        parts.append(_U32.pack(len(m.snapshot_data)))
        parts.append(m.snapshot_data)
    elif m.snapshot_data:
        raise CodecError("snapshot data without snapshot meta")
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode_message(buf: bytes | memoryview) -> Message:
    mv = memoryview(buf)
    if len(mv) < _MSG_HDR.size + _CRC.size:
        raise CodecError(f"message too short: {len(mv)} bytes")
    (crc,) = _CRC.unpack_from(mv, len(mv) - _CRC.size)
    if zlib.crc32(mv[: len(mv) - _CRC.size]) != crc:
        raise CodecError("message failed its CRC check")
    (magic, version, mtype, to, frm, term, log_term, index, commit, hint, ctx, flags, n) = (
        _MSG_HDR.unpack_from(mv, 0)
    )
    if magic != MSG_MAGIC:
        raise CodecError(f"bad message magic 0x{magic:04x}")
    if version != VERSION:
        raise CodecError(f"unsupported message version {version}")
    try:
        mt = MsgType(mtype)
    except ValueError:
        raise CodecError(f"unknown message type {mtype}") from None
    if flags & ~_KNOWN_FLAGS:
        raise CodecError(f"unknown message flag bits 0x{flags & ~_KNOWN_FLAGS:02x}")
    off = _MSG_HDR.size
    end = len(mv) - _CRC.size
    entries = []
    for _ in range(n):
        if off + 4 > end:
            raise CodecError("message truncated inside its entries")
        (ln,) = _U32.unpack_from(mv, off)
        off += 4
        if off + ln > end:
            raise CodecError("message truncated inside an entry")
        entries.append(_decode_entry_at(mv, off, ln))
        off += ln
    snap: SnapshotMeta | None = None
    data = b""
    if flags & _FLAG_SNAPSHOT:
        snap, data, off = _decode_snapshot_at(mv, off, end)
    if off != end:
        raise CodecError(f"{end - off} trailing bytes after the message's entries")
    return Message(
        type=mt,
        to=to,
        frm=frm,
        term=term,
        log_term=log_term,
        index=index,
        entries=tuple(entries),
        commit=commit,
        reject=bool(flags & _FLAG_REJECT),
        reject_hint=hint,
        context=ctx,
        force=bool(flags & _FLAG_FORCE),
        snapshot=snap,
        snapshot_data=data,
        no_reply=bool(flags & _FLAG_NO_REPLY),
    )


def _decode_snapshot_at(mv: memoryview, off: int, end: int) -> tuple[SnapshotMeta, bytes, int]:
    if off + _SNAP_HDR.size > end:
        raise CodecError("message truncated inside its snapshot header")
    index, term, end_pos, nv, nl = _SNAP_HDR.unpack_from(mv, off)
    off += _SNAP_HDR.size
    if off + 8 * (nv + nl) + 4 > end:
        raise CodecError("message truncated inside its snapshot config")
    ids = [_U64.unpack_from(mv, off + 8 * k)[0] for k in range(nv + nl)]
    off += 8 * (nv + nl)
    (ln,) = _U32.unpack_from(mv, off)
    off += 4
    if off + ln > end:
        raise CodecError("message truncated inside its snapshot data")
    data = bytes(mv[off : off + ln])
    off += ln
    voters, learners = tuple(ids[:nv]), tuple(ids[nv:])
    if list(voters) != sorted(set(voters)) or list(learners) != sorted(set(learners)):
        raise CodecError("snapshot config ids are not sorted and unique")
    return SnapshotMeta(index, term, end_pos, ClusterConfig(voters, learners)), data, off


def encode_conf_change(cc: ConfChange) -> bytes:
    return _CONF.pack(int(cc.type), cc.node_id)


def decode_conf_change(data: bytes) -> ConfChange:
    if len(data) != _CONF.size:
        raise CodecError(f"conf change record has {len(data)} bytes, expected {_CONF.size}")
    t, nid = _CONF.unpack(data)
    try:
        return ConfChange(ConfChangeType(t), nid)
    except ValueError:
        raise CodecError(f"unknown conf change type {t}") from None
