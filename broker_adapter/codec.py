"""Byte encodings of the broker: commands (one per Raft entry), message
records (many per produce command) and the snapshot value format.

Command (one Raft entry's data), big-endian::

    magic    4s  b"\\xd1BRK"
    version  u8  COMMAND_VERSION
    kind     u8  CommandKind
    flags    u16 0 (reserved)
    ts_ms    u64 the leader's wall clock when it proposed (the store timestamp)
    crc      u32 crc32 of body
    body     ...  per kind (see the encode_* functions)

A produce body is a small header followed by ``count`` message records laid
out back to back; record ``k`` starts at byte ``o_k`` of the entry, so its
CommitLog physical offset is ``entry.pos + o_k`` and its size is its length::

    length   u32 whole record, this field included
    crc      u32 crc32 of bytes [8:length]
    version  u8  RECORD_VERSION
    born_ts  i64 producer's timestamp (ms)
    queue    i32 requested queue, -1 = let the broker choose
    shard    u16 len + UTF-8  sharding key ("" = none)
    tag      u16 len + UTF-8
    keys     u16 count, each u16 len + UTF-8
    props    u16 count, each (u16 len + UTF-8 key, u16 len + UTF-8 value)
    body     u32 len + bytes

Everything is ``struct``; there is no pickle and no JSON in the log. The
command CRC is checked at apply; a record's own CRC is checked whenever the
record is decoded for a consumer.

Snapshots use a tiny self-describing value format (:func:`dump_value`):
None, bool, int (i64), bytes, str, list and dict with keys emitted in sorted
encoded order, so equal states give equal bytes whatever their insertion order.
"""

from __future__ import annotations

import enum
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker_adapter.errors import (
    InvalidArgument,
    InvalidGroupName,
    InvalidQueue,
    InvalidTopicName,
    MalformedCommand,
    MessageTooLarge,
    TooManyProperties,
)

MAGIC = b"\xd1BRK"
COMMAND_VERSION = 1
RECORD_VERSION = 1
MAX_QUEUES = 1024
NAME_MAX_LEN = 127
_NAME_RE = re.compile(r"^[A-Za-z0-9_.%|-]+$")

_HDR = struct.Struct(">4sBBHQI")
HEADER_SIZE = _HDR.size
_REC_FIXED = struct.Struct(">IIBqi")
RECORD_FIXED_SIZE = _REC_FIXED.size
# The fixed fields plus the sharding key's length and, when that length is 0,
# the tag's length: the whole header of a common record in one unpack (apply).
RECORD_SCAN = struct.Struct(">IIBqiHH")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_PRODUCE_FIXED = struct.Struct(">HQIqI")  # auto_create_queues, pid, epoch, base_seq, count
_OFFSET_ITEM = struct.Struct(">iq")
_RESET_FIXED = struct.Struct(">Bq")
_RETENTION = struct.Struct(">qqq")
_Q = struct.Struct(">Q")
_H = struct.Struct(">H")


class CommandKind(enum.IntEnum):
    PRODUCE = 1
    CREATE_TOPIC = 2
    UPDATE_TOPIC = 3
    DELETE_TOPIC = 4
    COMMIT_OFFSETS = 5
    RESET_GROUP = 6
    REGISTER_PRODUCER = 7
    SET_RETENTION = 8


class ResetMode(enum.IntEnum):
    EARLIEST = 0
    LATEST = 1
    TIMESTAMP = 2


@dataclass(frozen=True, slots=True)
class Limits:
    """What the leader's encoder accepts. Units last (TigerBeetle style)."""

    max_message_bytes: int = 1 << 20  # one encoded record
    max_batch_bytes: int = (4 << 20) - 4096  # one entry; below the node's max_entry_bytes
    max_batch_messages: int = 10_000
    max_properties: int = 64
    max_keys: int = 32
    max_string_bytes: int = 4096


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Message:
    """A message as a producer hands it to the encoder."""

    body: bytes
    tag: str = ""
    keys: tuple[str, ...] = ()
    properties: tuple[tuple[str, str], ...] = ()
    queue: int | None = None
    sharding_key: str | None = None
    born_ts_ms: int = 0


# A message as the batch encoder takes it: ``Message``'s fields, in order, in
# a plain tuple. The HTTP layer builds these directly: a tuple allocates in a
# few dozen nanoseconds, a frozen dataclass in about a microsecond.
MessageRow = tuple[
    bytes, str, tuple[str, ...], tuple[tuple[str, str], ...], int | None, str | None, int
]


def message_row(m: Message) -> MessageRow:
    return (m.body, m.tag, m.keys, m.properties, m.queue, m.sharding_key, m.born_ts_ms)


@dataclass(frozen=True, slots=True)
class Record:
    """A decoded message record (what a consumer gets, before offsets)."""

    born_ts_ms: int
    queue: int
    sharding_key: str
    tag: str
    keys: tuple[str, ...]
    properties: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Produce:
    topic: str
    auto_create_queues: int
    producer_id: int
    epoch: int
    base_seq: int  # -1: not idempotent
    count: int
    records_start: int  # byte offset of the first record in the entry data


@dataclass(frozen=True, slots=True)
class TopicCmd:
    topic: str
    queues: int = 0


@dataclass(frozen=True, slots=True)
class CommitOffsets:
    group: str
    offsets: tuple[tuple[str, int, int], ...]  # (topic, queue, offset)


@dataclass(frozen=True, slots=True)
class ResetGroup:
    group: str
    topic: str
    mode: ResetMode
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class RegisterProducer:
    producer_id: int  # 0: assign a new one


@dataclass(frozen=True, slots=True)
class SetRetention:
    max_bytes: int  # 0: unlimited
    max_age_ms: int  # 0: unlimited
    producer_idle_ms: int  # 0: keep the current setting


Body = Produce | TopicCmd | CommitOffsets | ResetGroup | RegisterProducer | SetRetention


@dataclass(frozen=True, slots=True)
class Command:
    kind: CommandKind
    ts_ms: int
    body: Body = field(default_factory=lambda: RegisterProducer(0))


# ---------------------------------------------------------------------------
# validation shared by encoders and the HTTP layer


def check_name(name: object, what: str = "topic") -> str:
    err = InvalidTopicName if what == "topic" else InvalidGroupName
    if not isinstance(name, str) or not name:
        raise err(f"{what} name must be a non-empty string", field=what)
    if len(name) > NAME_MAX_LEN or not _NAME_RE.match(name):
        raise err(
            f"{what} name {name[:40]!r} must be 1..{NAME_MAX_LEN} characters of "
            "A-Z a-z 0-9 _ - . % |",
            field=what,
        )
    return name


def check_queue_count(queues: object) -> int:
    if not isinstance(queues, int) or isinstance(queues, bool) or not 1 <= queues <= MAX_QUEUES:
        raise InvalidQueue(f"queue count must be within 1..{MAX_QUEUES}, got {queues!r}", "queues")
    return queues


def _s8(s: str, what: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 255:
        raise InvalidArgument(f"{what} is longer than 255 bytes", field=what)
    return _U8.pack(len(b)) + b


def _s16(s: str, what: str, limits: Limits) -> bytes:
    b = s.encode("utf-8")
    if len(b) > limits.max_string_bytes:
        raise InvalidArgument(
            f"{what} is {len(b)} bytes, more than {limits.max_string_bytes}", field=what
        )
    return _U16.pack(len(b)) + b


def _command(kind: CommandKind, ts_ms: int, body: bytes) -> bytes:
    if ts_ms < 0:
        raise InvalidArgument("timestamp must be >= 0", field="ts_ms")
    return _HDR.pack(MAGIC, COMMAND_VERSION, kind, 0, ts_ms, zlib.crc32(body)) + body


# ---------------------------------------------------------------------------
# encoders (run on the leader before proposing; they raise on bad input)


def _s16_checked(s: str, k: int, what: str, limits: Limits) -> bytes:
    b = s.encode("utf-8")
    if len(b) > limits.max_string_bytes:
        name = f"messages[{k}].{what}"  # built only on error: this runs per string
        raise InvalidArgument(
            f"{name} is {len(b)} bytes, more than {limits.max_string_bytes}", field=name
        )
    return _U16.pack(len(b)) + b


def encode_record(m: Message, limits: Limits = DEFAULT_LIMITS, index: int = 0) -> bytes:
    return _encode_row(message_row(m), limits, index)


def _encode_row(row: MessageRow, limits: Limits, index: int) -> bytes:
    """One record, every field checked (the general path of
    :func:`encode_produce_rows`, and the reference for its fast path)."""
    body_in, tag, keys, props, queue_in, shard, born = row
    if not isinstance(body_in, bytes | bytearray | memoryview):
        raise InvalidArgument("value must be bytes", field=f"messages[{index}].value")
    if queue_in is not None and not 0 <= queue_in < MAX_QUEUES:
        raise InvalidQueue(
            f"queue must be within 0..{MAX_QUEUES - 1}, got {queue_in}",
            f"messages[{index}].queue",
        )
    if len(props) > limits.max_properties:
        raise TooManyProperties(
            f"{len(props)} properties, at most {limits.max_properties} allowed",
            f"messages[{index}].properties",
        )
    if len(keys) > limits.max_keys:
        raise InvalidArgument(
            f"{len(keys)} keys, at most {limits.max_keys} allowed", f"messages[{index}].keys"
        )
    body = bytes(body_in)
    if len(body) > limits.max_message_bytes:
        raise MessageTooLarge(
            f"message body of {len(body)} bytes exceeds {limits.max_message_bytes}",
            f"messages[{index}].value",
            limit_bytes=limits.max_message_bytes,
        )
    parts = [
        _s16_checked(shard or "", index, "sharding_key", limits),
        _s16_checked(tag, index, "tags", limits),
        _U16.pack(len(keys)),
        *(_s16_checked(k, index, "keys", limits) for k in keys),
        _U16.pack(len(props)),
    ]
    for k, v in props:
        parts.append(_s16_checked(k, index, "properties", limits))
        parts.append(_s16_checked(v, index, "properties", limits))
    parts.append(_U32.pack(len(body)))
    parts.append(body)
    rest = b"".join(parts)
    size = _REC_FIXED.size + len(rest)
    if size > limits.max_message_bytes + 64 * 1024:
        raise MessageTooLarge(
            f"encoded message of {size} bytes is too large",
            f"messages[{index}]",
            limit_bytes=size,
        )
    queue = -1 if queue_in is None else queue_in
    tail = _REC_FIXED.pack(0, 0, RECORD_VERSION, born, queue)[8:] + rest
    return _U32.pack(size) + _U32.pack(zlib.crc32(tail)) + tail


# A record with no sharding key, tag, keys or properties: length and CRC,
# then (version, born, queue or -1, four zero-length fields, body length)
# and the body. Same bytes as _encode_row gives it.
_PLAIN_HEAD = struct.Struct(">II")
_PLAIN_TAIL = struct.Struct(">BqiHHHHI")
_PLAIN_OVERHEAD = _PLAIN_HEAD.size + _PLAIN_TAIL.size


def encode_produce(
    topic: str,
    messages: Sequence[Message],
    ts_ms: int,
    *,
    producer_id: int = 0,
    epoch: int = 0,
    base_seq: int = -1,
    auto_create_queues: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """One produce entry. ``base_seq >= 0`` with ``producer_id > 0`` makes it
    idempotent: message ``k`` has sequence ``base_seq + k`` in its queue."""
    return encode_produce_rows(
        topic,
        [message_row(m) for m in messages],
        ts_ms,
        producer_id=producer_id,
        epoch=epoch,
        base_seq=base_seq,
        auto_create_queues=auto_create_queues,
        limits=limits,
    )


def encode_produce_rows(
    topic: str,
    rows: Sequence[MessageRow],
    ts_ms: int,
    *,
    producer_id: int = 0,
    epoch: int = 0,
    base_seq: int = -1,
    auto_create_queues: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """:func:`encode_produce` of messages given as :data:`MessageRow` tuples."""
    check_produce(topic, len(rows), producer_id, epoch, base_seq, auto_create_queues, limits)
    return assemble_produce(
        topic,
        len(rows),
        encode_records(rows, limits),
        ts_ms,
        producer_id=producer_id,
        epoch=epoch,
        base_seq=base_seq,
        auto_create_queues=auto_create_queues,
        limits=limits,
    )


def check_produce(
    topic: str,
    count: int,
    producer_id: int = 0,
    epoch: int = 0,
    base_seq: int = -1,
    auto_create_queues: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """The batch-level checks of :func:`encode_produce_rows` (before any record)."""
    check_name(topic)
    if not count:
        raise InvalidArgument("a batch needs at least one message", field="messages")
    if count > limits.max_batch_messages:
        raise InvalidArgument(
            f"{count} messages, at most {limits.max_batch_messages} per batch",
            field="messages",
        )
    if not 0 <= auto_create_queues <= MAX_QUEUES:
        raise InvalidQueue("auto_create_queues must be within 0..1024", "auto_create_queues")
    if producer_id < 0 or producer_id >= 1 << 64:
        raise InvalidArgument("producer_id must be within 0..2^64-1", field="producer_id")
    if not 0 <= epoch < 1 << 32:
        raise InvalidArgument("epoch must be within 0..2^32-1", field="epoch")
    if base_seq < -1 or base_seq >= 1 << 62:
        raise InvalidArgument("sequence must be >= 0", field="sequence")
    if base_seq >= 0 and producer_id == 0:
        raise InvalidArgument("a sequence needs a producer_id", field="producer_id")


def encode_records(
    rows: Sequence[MessageRow], limits: Limits = DEFAULT_LIMITS, first: int = 0
) -> list[bytes]:
    """The records of ``rows`` (message indexes from ``first`` in errors), as
    parts to join: a caller may encode a big batch in slices (the HTTP layer
    yields to the event loop between them) and :func:`assemble_produce` them."""
    parts: list[bytes] = []
    add = parts.append
    head = _PLAIN_HEAD.pack
    tail = _PLAIN_TAIL.pack
    crc32 = zlib.crc32
    max_body = limits.max_message_bytes
    for k, row in enumerate(rows, first):
        body, tag, keys, props, queue, shard, born = row
        if (
            (queue is None or (type(queue) is int and 0 <= queue < MAX_QUEUES))
            and tag == ""
            and keys == ()
            and props == ()
            and not shard
            and type(body) is bytes
            and len(body) <= max_body
        ):
            n = len(body)
            t = tail(RECORD_VERSION, born, -1 if queue is None else queue, 0, 0, 0, 0, n)
            add(head(_PLAIN_OVERHEAD + n, crc32(body, crc32(t))))
            add(t)
            add(body)
        else:
            add(_encode_row(row, limits, k))
    return parts


def assemble_produce(
    topic: str,
    count: int,
    record_parts: list[bytes],
    ts_ms: int,
    *,
    producer_id: int = 0,
    epoch: int = 0,
    base_seq: int = -1,
    auto_create_queues: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """The PRODUCE command of ``count`` records already encoded by
    :func:`encode_records` (after :func:`check_produce`)."""
    head = _s8(topic, "topic") + _PRODUCE_FIXED.pack(
        auto_create_queues, producer_id, epoch, base_seq, count
    )
    record_parts.insert(0, head)
    body_bytes = b"".join(record_parts)
    del record_parts[0]
    if len(body_bytes) + HEADER_SIZE > limits.max_batch_bytes:
        raise MessageTooLarge(
            f"batch of {len(body_bytes) + HEADER_SIZE} bytes exceeds {limits.max_batch_bytes}",
            "messages",
            limit_bytes=limits.max_batch_bytes,
        )
    return _command(CommandKind.PRODUCE, ts_ms, body_bytes)


# ---------------------------------------------------------------------------
# The binary produce body (``Content-Type: application/vnd.dledger.batch``):
# the records of a PRODUCE command as a client encodes them, so the leader
# checks them and proposes them as they are (no JSON, no base64, no
# re-encoding). Big-endian::
#
#     magic        4s  b"DLB1"
#     producer_id  u64 0 = not idempotent
#     epoch        u32
#     sequence     i64 the first message's sequence; -1 = not idempotent
#     count        u32 messages that follow
#     records      ``count`` records in the record format (module docstring),
#                  back to back, nothing after them
#
# A record is accepted only in the form the JSON path's encoder gives the
# same message (properties sorted by key, each key once; the CRC right).

BATCH_CONTENT_TYPE = "application/vnd.dledger.batch"
BATCH_MAGIC = b"DLB1"
_BATCH_HEAD = struct.Struct(">4sQIqI")
BATCH_HEAD_SIZE = _BATCH_HEAD.size
_BORN_MAX = 1 << 62


@dataclass(frozen=True, slots=True)
class BatchHead:
    producer_id: int
    epoch: int
    sequence: int
    count: int


def encode_batch(
    rows: Sequence[MessageRow],
    *,
    producer_id: int = 0,
    epoch: int = 0,
    sequence: int = -1,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """A binary produce body of ``rows`` (what the Python client sends)."""
    head = _BATCH_HEAD.pack(BATCH_MAGIC, producer_id, epoch, sequence, len(rows))
    return head + b"".join(encode_records(rows, limits))


def batch_head(raw: bytes) -> BatchHead:
    """The head of a binary produce body; its batch-level checks are
    :func:`check_produce`'s, done by the caller with the topic."""
    if len(raw) < _BATCH_HEAD.size:
        raise InvalidArgument(
            f"a binary produce body starts with a {_BATCH_HEAD.size}-byte head, "
            f"this one has {len(raw)} bytes",
            field="body",
        )
    magic, pid, epoch, seq, count = _BATCH_HEAD.unpack_from(raw, 0)
    if magic != BATCH_MAGIC:
        raise InvalidArgument(
            f"a binary produce body starts with {BATCH_MAGIC!r}, not {bytes(magic)!r}",
            field="body",
        )
    if seq == -1 and pid != 0:
        raise InvalidArgument(
            "producer_id and sequence go together (idempotent produce)", field="sequence"
        )
    return BatchHead(pid, epoch, seq, count)


def check_batch_records(
    raw: bytes, pos: int, first: int, n: int, limits: Limits = DEFAULT_LIMITS
) -> tuple[int, int]:
    """Check records ``first .. first + n - 1`` of a binary produce body,
    the first at byte ``pos``: ``(where the next starts, properties seen)``.
    Raises InvalidArgument naming ``messages[k]`` (422). A record passes
    exactly when it is what the JSON path's encoder makes of its message
    (tests/http/test_binary_produce.py holds this check to decoding the
    record and encoding its message again)."""
    crc32 = zlib.crc32
    head = _PLAIN_HEAD.unpack_from
    tail = _PLAIN_TAIL.unpack_from
    mv = memoryview(raw)
    end = len(raw)
    max_body = limits.max_message_bytes
    props = 0
    for k in range(first, first + n):
        if pos + _PLAIN_OVERHEAD > end:
            raise _bad_record(k, "is truncated (the body ends inside it)")
        size, crc = head(raw, pos)
        if size < _PLAIN_OVERHEAD or pos + size > end:
            raise _bad_record(k, f"has a length of {size} that does not fit the body")
        if crc32(mv[pos + 8 : pos + size]) != crc:
            raise _bad_record(k, "fails its CRC")
        ver, born, queue, shard, tag, nkeys, nprops, nbody = tail(raw, pos + 8)
        if ver != RECORD_VERSION:
            raise _bad_record(k, f"has record version {ver}, not {RECORD_VERSION}")
        if not 0 <= born < _BORN_MAX:
            raise _bad_record(k, f"has born_ts_ms {born}, not within 0..2^62-1", ".born_ts_ms")
        if not -1 <= queue < MAX_QUEUES:
            raise _bad_record(k, f"has queue {queue}, not within 0..{MAX_QUEUES - 1}", ".queue")
        if not (shard or tag or nkeys or nprops):  # a value (and a queue) only
            if nbody != size - _PLAIN_OVERHEAD:
                raise _bad_record(k, "has a value length that does not match its length")
            if nbody > max_body:
                raise _value_too_large(k, nbody, max_body)
        else:
            props += _check_fields(raw, pos, size, k, limits)
        pos += size
    return pos, props


def _bad_record(k: int, why: str, sub: str = "") -> InvalidArgument:
    return InvalidArgument(f"messages[{k}]{sub} {why}", field=f"messages[{k}]{sub}")


def _value_too_large(k: int, n: int, cap: int) -> MessageTooLarge:
    return MessageTooLarge(
        f"message body of {n} bytes exceeds {cap}", f"messages[{k}].value", limit_bytes=cap
    )


_FIELD_NAMES = ("sharding_key", "tags")


def _check_fields(raw: bytes, pos: int, size: int, k: int, limits: Limits) -> int:
    """The variable fields of the record at ``pos`` (length, CRC, version,
    born and queue checked): every string UTF-8 and within the caps, the
    counts within theirs, properties sorted by key with each key once, the
    value ending the record exactly. The number of properties."""
    end = pos + size
    p = pos + _REC_FIXED.size
    u16 = _U16.unpack_from
    cap = limits.max_string_bytes
    props = 0

    def string(what: str) -> bytes:
        nonlocal p
        if p + 2 > end:
            raise _bad_record(k, f"is truncated inside {what}")
        (n,) = u16(raw, p)
        b = raw[p + 2 : p + 2 + n]
        if len(b) != n:
            raise _bad_record(k, f"is truncated inside {what}")
        if n > cap:
            raise _bad_record(k, f"{what} is {n} bytes, more than {cap}", f".{what}")
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad_record(k, f"{what} is not UTF-8", f".{what}") from None
        p += 2 + n
        return b

    for what in _FIELD_NAMES:
        string(what)
    for what, limit in (("keys", limits.max_keys), ("properties", limits.max_properties)):
        if p + 2 > end:
            raise _bad_record(k, f"is truncated at its {what}")
        (count,) = u16(raw, p)
        p += 2
        if count > limit:
            raise _bad_record(k, f"has {count} {what}, at most {limit} allowed", f".{what}")
        if what == "keys":
            for _ in range(count):
                string(what)
            continue
        last = None
        for _ in range(count):
            key = string(what)
            if last is not None and key <= last:  # UTF-8 order is code point order
                raise _bad_record(
                    k, "has properties not sorted by key or a key twice", ".properties"
                )
            last = key
            string(what)
        props = int(count)
    if p + 4 > end:
        raise _bad_record(k, "is truncated at its value")
    (nbody,) = _U32.unpack_from(raw, p)
    if p + 4 + nbody != end:
        raise _bad_record(k, "has a value length that does not match its length")
    if nbody > limits.max_message_bytes:
        raise _value_too_large(k, nbody, limits.max_message_bytes)
    if size > limits.max_message_bytes + 64 * 1024:
        raise MessageTooLarge(
            f"encoded message of {size} bytes is too large", f"messages[{k}]", limit_bytes=size
        )
    return props


def encode_topic(kind: CommandKind, topic: str, ts_ms: int, queues: int = 0) -> bytes:
    check_name(topic)
    if kind in (CommandKind.CREATE_TOPIC, CommandKind.UPDATE_TOPIC):
        check_queue_count(queues)
    elif kind is not CommandKind.DELETE_TOPIC:
        raise ValueError(f"not a topic command: {kind!r}")
    return _command(kind, ts_ms, _s8(topic, "topic") + _H.pack(queues))


def encode_commit_offsets(group: str, offsets: Sequence[tuple[str, int, int]], ts_ms: int) -> bytes:
    check_name(group, "group")
    if not offsets or len(offsets) > 65535:
        raise InvalidArgument("offsets must list 1..65535 items", field="offsets")
    parts = [_s8(group, "group"), _H.pack(len(offsets))]
    for k, (topic, queue, offset) in enumerate(offsets):
        check_name(topic)
        if not 0 <= queue < MAX_QUEUES:
            raise InvalidQueue(f"queue must be within 0..{MAX_QUEUES - 1}", f"offsets[{k}].queue")
        if not 0 <= offset < 1 << 62:
            raise InvalidArgument("offset must be >= 0", field=f"offsets[{k}].offset")
        parts.append(_s8(topic, "topic"))
        parts.append(_OFFSET_ITEM.pack(queue, offset))
    return _command(CommandKind.COMMIT_OFFSETS, ts_ms, b"".join(parts))


def encode_reset_group(
    group: str, topic: str, mode: ResetMode, ts_ms: int, timestamp_ms: int = 0
) -> bytes:
    check_name(group, "group")
    check_name(topic)
    return _command(
        CommandKind.RESET_GROUP,
        ts_ms,
        _s8(group, "group") + _s8(topic, "topic") + _RESET_FIXED.pack(mode, timestamp_ms),
    )


def encode_register_producer(ts_ms: int, producer_id: int = 0) -> bytes:
    if not 0 <= producer_id < 1 << 64:
        raise InvalidArgument("producer_id must be within 0..2^64-1", field="producer_id")
    return _command(CommandKind.REGISTER_PRODUCER, ts_ms, _Q.pack(producer_id))


def encode_retention(
    ts_ms: int, max_bytes: int = 0, max_age_ms: int = 0, producer_idle_ms: int = 0
) -> bytes:
    """Retention and producer-expiry policy, through the log so every replica
    enforces the same one at the same entry."""
    for name, v in (
        ("max_bytes", max_bytes),
        ("max_age_ms", max_age_ms),
        ("producer_idle_ms", producer_idle_ms),
    ):
        if not 0 <= v < 1 << 62:
            raise InvalidArgument(f"{name} must be >= 0 (0 = unlimited / unchanged)", field=name)
    return _command(
        CommandKind.SET_RETENTION, ts_ms, _RETENTION.pack(max_bytes, max_age_ms, producer_idle_ms)
    )


# ---------------------------------------------------------------------------
# decoders (run at apply on every replica; they raise MalformedCommand)


def is_command(data: bytes) -> bool:
    return len(data) >= HEADER_SIZE and data[:4] == MAGIC


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise MalformedCommand("truncated command")
        b = self.data[self.pos : end]
        self.pos = end
        return b

    def unpack(self, st: struct.Struct) -> tuple[int, ...]:
        if self.pos + st.size > len(self.data):
            raise MalformedCommand("truncated command")
        v = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return v

    def s8(self) -> str:
        (n,) = self.unpack(_U8)
        return self._str(n)

    def s16(self) -> str:
        (n,) = self.unpack(_U16)
        return self._str(n)

    def _str(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedCommand("a string is not UTF-8") from None


def decode_command(data: bytes) -> Command:
    """Header, CRC and body of a command (records of a produce stay raw)."""
    if not is_command(data):
        raise MalformedCommand("not a broker command")
    _, version, kind_raw, _flags, ts_ms, crc = _HDR.unpack_from(data, 0)
    if version != COMMAND_VERSION:
        raise MalformedCommand(f"command version {version} is not supported")
    if zlib.crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        raise MalformedCommand("command CRC mismatch")
    try:
        kind = CommandKind(kind_raw)
    except ValueError:
        raise MalformedCommand(f"unknown command kind {kind_raw}") from None
    r = _Reader(data, HEADER_SIZE)
    body: Body
    if kind is CommandKind.PRODUCE:
        topic = r.s8()
        auto, pid, epoch, base_seq, count = r.unpack(_PRODUCE_FIXED)
        body = Produce(topic, auto, pid, epoch, base_seq, count, r.pos)
    elif kind in (CommandKind.CREATE_TOPIC, CommandKind.UPDATE_TOPIC, CommandKind.DELETE_TOPIC):
        topic = r.s8()
        (queues,) = r.unpack(_H)
        body = TopicCmd(topic, queues)
    elif kind is CommandKind.COMMIT_OFFSETS:
        group = r.s8()
        (n,) = r.unpack(_H)
        items = []
        for _ in range(n):
            t = r.s8()
            q, off = r.unpack(_OFFSET_ITEM)
            items.append((t, q, off))
        body = CommitOffsets(group, tuple(items))
    elif kind is CommandKind.RESET_GROUP:
        group = r.s8()
        topic = r.s8()
        mode_raw, tsv = r.unpack(_RESET_FIXED)
        try:
            mode = ResetMode(mode_raw)
        except ValueError:
            raise MalformedCommand(f"unknown reset mode {mode_raw}") from None
        body = ResetGroup(group, topic, mode, tsv)
    elif kind is CommandKind.REGISTER_PRODUCER:
        (pid,) = r.unpack(_Q)
        body = RegisterProducer(pid)
    else:
        mb, ma, idle = r.unpack(_RETENTION)
        body = SetRetention(mb, ma, idle)
    if kind is not CommandKind.PRODUCE and r.pos != len(data):
        raise MalformedCommand("trailing bytes after the command")
    return Command(kind, ts_ms, body)


def record_header(data: bytes, pos: int) -> tuple[int, int, str, int]:
    """(size, requested queue, sharding key, crc32 of tag) of the record at
    ``pos``, without checking its CRC: the apply fast path."""
    if pos + _REC_FIXED.size > len(data):
        raise MalformedCommand("truncated record")
    size, _crc, _ver, _born, queue = _REC_FIXED.unpack_from(data, pos)
    if size < _REC_FIXED.size or pos + size > len(data):
        raise MalformedCommand("record length out of bounds")
    p = pos + _REC_FIXED.size
    (n,) = _U16.unpack_from(data, p)
    shard = data[p + 2 : p + 2 + n].decode("utf-8", "replace") if n else ""
    p += 2 + n
    (n,) = _U16.unpack_from(data, p)
    tag_hash = zlib.crc32(data[p + 2 : p + 2 + n]) if n else 0
    return size, queue, shard, tag_hash


def tag_hash(tag: str) -> int:
    return zlib.crc32(tag.encode("utf-8")) if tag else 0


def check_record(rec: bytes) -> tuple[int, int]:
    """Length, CRC and version of a whole stored record (every read checks
    them before serving it); ``(born_ts_ms, requested queue)``."""
    if len(rec) < _REC_FIXED.size:
        raise MalformedCommand("truncated record")
    size, crc, ver, born, queue = _REC_FIXED.unpack_from(rec, 0)
    if size != len(rec) or zlib.crc32(memoryview(rec)[8:]) != crc:
        raise MalformedCommand("record CRC or length mismatch")
    if ver != RECORD_VERSION:
        raise MalformedCommand(f"record version {ver} is not supported")
    return born, queue


def decode_record(rec: bytes) -> Record:
    """A whole record; checks its length, version and CRC."""
    born, queue = check_record(rec)
    r = _Reader(rec, _REC_FIXED.size)
    shard = r.s16()
    tag = r.s16()
    (nk,) = r.unpack(_U16)
    keys = tuple(r.s16() for _ in range(nk))
    (np_,) = r.unpack(_U16)
    props = tuple((r.s16(), r.s16()) for _ in range(np_))
    (nb,) = r.unpack(_U32)
    body = r.take(nb)
    return Record(born, queue, shard, tag, keys, props, body)


def body_at(rec: bytes) -> int:
    """Where the body of ``rec`` starts (a record :func:`decode_record`
    has read: every length in it is in bounds)."""
    p = _REC_FIXED.size
    for _ in range(2):  # sharding key, tag
        p += 2 + _U16.unpack_from(rec, p)[0]
    for pairs in (1, 2):  # keys, then properties (a key and a value each)
        (count,) = _U16.unpack_from(rec, p)
        p += 2
        for _ in range(count * pairs):
            p += 2 + _U16.unpack_from(rec, p)[0]
    return p + _U32.size


class BadRecord(MalformedCommand):
    """:func:`decode_columns`: the record at ``index`` fails its checks."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index


@dataclass(slots=True)
class RecordColumns:
    """Records decoded column by column (:func:`decode_columns`): list and
    map columns as offsets into flat value lists, Arrow's layout."""

    born_ts_ms: list[int] = field(default_factory=list)
    tags: list[str | None] = field(default_factory=list)  # None: no tag
    key_offsets: list[int] = field(default_factory=lambda: [0])
    keys: list[str] = field(default_factory=list)
    prop_offsets: list[int] = field(default_factory=lambda: [0])
    prop_keys: list[str] = field(default_factory=list)
    prop_values: list[str] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    # A page decoded by broker_adapter.columnar: bodies and tags in Arrow's
    # layout instead of ``bodies`` and ``tags`` (n + 1 offsets into the
    # data; ``tag_valid`` False where a record has no tag), the other
    # columns as numpy arrays.
    body_offsets: Sequence[int] | None = None
    body_data: bytes | None = None
    tag_offsets: Sequence[int] | None = None
    tag_data: bytes = b""
    tag_valid: Sequence[bool] | None = None

    @property
    def columnar(self) -> bool:
        return self.body_data is not None

    def body_list(self) -> list[bytes]:
        """The bodies, one ``bytes`` each, whichever way they are held."""
        if self.body_data is None or self.body_offsets is None:
            return self.bodies
        return _split(self.body_offsets, self.body_data)

    def tag_list(self) -> list[str | None]:
        """The tags (None: no tag), whichever way they are held."""
        if self.tag_offsets is None or self.tag_valid is None:
            return self.tags
        raw = _split(self.tag_offsets, self.tag_data)
        return [t.decode() if ok else None for t, ok in zip(raw, self.tag_valid, strict=True)]

    def add(self, rec: Record) -> None:
        self.born_ts_ms.append(rec.born_ts_ms)
        self.tags.append(rec.tag or None)
        self.keys.extend(rec.keys)
        self.key_offsets.append(len(self.keys))
        for k, v in rec.properties:
            self.prop_keys.append(k)
            self.prop_values.append(v)
        self.prop_offsets.append(len(self.prop_keys))
        self.bodies.append(rec.body)


# After the fixed fields: sharding key length, tag length, key count,
# property count, body length: the whole header of a record that has none
# of them, in one unpack.
_REC_PLAIN = struct.Struct(">HHHHI")
_PLAIN_AT = _REC_FIXED.size
_PLAIN_BODY_AT = _REC_FIXED.size + _REC_PLAIN.size
PLAIN_BODY_AT = _PLAIN_BODY_AT  # where a plain record's body starts (broker_adapter.columnar)


def _split(offsets: Sequence[int], data: bytes) -> list[bytes]:
    o = [int(x) for x in offsets]
    return [data[o[i] : o[i + 1]] for i in range(len(o) - 1)]


def decode_columns(recs: Sequence[bytes]) -> RecordColumns:
    """:func:`decode_record` of every record, as columns and without an
    object per record: each one's length, CRC and version are checked
    (:func:`check_record`); a record with no sharding key, tag, keys or
    properties takes a one-unpack path, any other the full decoder. Raises
    :class:`BadRecord` naming the first record that fails."""
    out = RecordColumns()
    born_col, tags, bodies = out.born_ts_ms, out.tags, out.bodies
    key_offs, prop_offs = out.key_offsets, out.prop_offsets
    plain = _REC_PLAIN.unpack_from
    check = check_record
    nk = np_ = 0
    for k, rec in enumerate(recs):
        try:
            born, _queue = check(rec)
            if len(rec) >= _PLAIN_BODY_AT:
                n_shard, n_tag, n_keys, n_props, n_body = plain(rec, _PLAIN_AT)
                if not (n_shard or n_tag or n_keys or n_props):
                    if _PLAIN_BODY_AT + n_body > len(rec):
                        raise MalformedCommand("truncated command")
                    born_col.append(born)
                    tags.append(None)
                    key_offs.append(nk)
                    prop_offs.append(np_)
                    bodies.append(rec[_PLAIN_BODY_AT : _PLAIN_BODY_AT + n_body])
                    continue
            out.add(decode_record(rec))
            nk, np_ = len(out.keys), len(out.prop_keys)
        except MalformedCommand as exc:
            raise BadRecord(k, str(exc)) from None
    return out


# ---------------------------------------------------------------------------
# snapshot value format

Value = None | bool | int | bytes | str | list["Value"] | dict[object, "Value"]
_I64 = struct.Struct(">q")


def dump_value(v: object, out: list[bytes]) -> None:
    if v is None:
        out.append(b"N")
    elif v is True:
        out.append(b"T")
    elif v is False:
        out.append(b"F")
    elif isinstance(v, int):
        if -(1 << 63) <= v < 1 << 63:
            out.append(b"i" + _I64.pack(v))
        else:
            raw = str(v).encode()
            out.append(b"I" + _U32.pack(len(raw)) + raw)
    elif isinstance(v, bytes | bytearray | memoryview):
        b = bytes(v)
        out.append(b"b" + _U32.pack(len(b)) + b)
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out.append(b"s" + _U32.pack(len(b)) + b)
    elif isinstance(v, list | tuple):
        out.append(b"l" + _U32.pack(len(v)))
        for x in v:
            dump_value(x, out)
    elif isinstance(v, Mapping):
        items = []
        for k, x in v.items():
            kb: list[bytes] = []
            dump_value(k, kb)
            items.append((b"".join(kb), x))
        items.sort(key=lambda kv: kv[0])
        out.append(b"d" + _U32.pack(len(items)))
        for kb2, x in items:
            out.append(kb2)
            dump_value(x, out)
    else:
        raise TypeError(f"cannot snapshot a {type(v).__name__}")


def load_value(data: bytes, pos: int = 0) -> tuple[object, int]:
    try:
        t = data[pos : pos + 1]
        pos += 1
        if t == b"N":
            return None, pos
        if t == b"T":
            return True, pos
        if t == b"F":
            return False, pos
        if t == b"i":
            return _I64.unpack_from(data, pos)[0], pos + 8
        if t in (b"I", b"b", b"s"):
            (n,) = _U32.unpack_from(data, pos)
            pos += 4
            raw = data[pos : pos + n]
            if len(raw) != n:
                raise MalformedCommand("truncated snapshot")
            pos += n
            if t == b"b":
                return raw, pos
            return (int(raw) if t == b"I" else raw.decode("utf-8")), pos
        if t == b"l":
            (n,) = _U32.unpack_from(data, pos)
            pos += 4
            lst: list[object] = []
            for _ in range(n):
                x, pos = load_value(data, pos)
                lst.append(x)
            return lst, pos
        if t == b"d":
            (n,) = _U32.unpack_from(data, pos)
            pos += 4
            d: dict[object, object] = {}
            for _ in range(n):
                k, pos = load_value(data, pos)
                x, pos = load_value(data, pos)
                if isinstance(k, list):
                    k = tuple(k)
                d[k] = x
            return d, pos
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise MalformedCommand(f"snapshot does not decode: {exc}") from None
    raise MalformedCommand(f"unknown snapshot value tag {t!r}")
