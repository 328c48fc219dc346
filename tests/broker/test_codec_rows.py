"""The batch encoder's inline path for plain messages (no sharding key, tag,
keys, properties or queue) and its general path must give the bytes, and
refuse with the errors, of the per-record encoder as it was before either
existed (kept here as ``_reference_record``)."""

from __future__ import annotations

import struct
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from broker_adapter.codec import (
    MAX_QUEUES,
    RECORD_VERSION,
    CommandKind,
    Limits,
    Message,
    _command,
    _s8,
    encode_produce,
    encode_produce_rows,
    encode_record,
    message_row,
)
from broker_adapter.errors import (
    BrokerError,
    InvalidArgument,
    InvalidQueue,
    MessageTooLarge,
    TooManyProperties,
)

_REC_FIXED = struct.Struct(">IIBqi")
_PRODUCE_FIXED = struct.Struct(">HQIqI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
LIMITS = Limits(max_message_bytes=48, max_properties=2, max_keys=2, max_string_bytes=4)


def _reference_s16(s: str, what: str, limits: Limits) -> bytes:
    b = s.encode("utf-8")
    if len(b) > limits.max_string_bytes:
        raise InvalidArgument(
            f"{what} is {len(b)} bytes, more than {limits.max_string_bytes}", field=what
        )
    return _U16.pack(len(b)) + b


def _reference_record(m: Message, limits: Limits, index: int) -> bytes:
    where = f"messages[{index}]"
    if not isinstance(m.body, bytes | bytearray | memoryview):
        raise InvalidArgument("value must be bytes", field=f"{where}.value")
    if m.queue is not None and not 0 <= m.queue < MAX_QUEUES:
        raise InvalidQueue(
            f"queue must be within 0..{MAX_QUEUES - 1}, got {m.queue}", f"{where}.queue"
        )
    if len(m.properties) > limits.max_properties:
        raise TooManyProperties(
            f"{len(m.properties)} properties, at most {limits.max_properties} allowed",
            f"{where}.properties",
        )
    if len(m.keys) > limits.max_keys:
        raise InvalidArgument(
            f"{len(m.keys)} keys, at most {limits.max_keys} allowed", f"{where}.keys"
        )
    body = bytes(m.body)
    if len(body) > limits.max_message_bytes:
        raise MessageTooLarge(
            f"message body of {len(body)} bytes exceeds {limits.max_message_bytes}",
            f"{where}.value",
            limit_bytes=limits.max_message_bytes,
        )
    parts = [
        _reference_s16(m.sharding_key or "", f"{where}.sharding_key", limits),
        _reference_s16(m.tag, f"{where}.tags", limits),
        _U16.pack(len(m.keys)),
        *(_reference_s16(k, f"{where}.keys", limits) for k in m.keys),
        _U16.pack(len(m.properties)),
    ]
    for k, v in m.properties:
        parts.append(_reference_s16(k, f"{where}.properties", limits))
        parts.append(_reference_s16(v, f"{where}.properties", limits))
    parts.append(_U32.pack(len(body)))
    parts.append(body)
    rest = b"".join(parts)
    size = _REC_FIXED.size + len(rest)
    if size > limits.max_message_bytes + 64 * 1024:
        raise MessageTooLarge(
            f"encoded message of {size} bytes is too large", f"{where}", limit_bytes=size
        )
    queue = -1 if m.queue is None else m.queue
    tail = _REC_FIXED.pack(0, 0, RECORD_VERSION, m.born_ts_ms, queue)[8:] + rest
    return _U32.pack(size) + _U32.pack(zlib.crc32(tail)) + tail


def _reference_produce(topic: str, msgs: list[Message], ts_ms: int, limits: Limits) -> bytes:
    records = [_reference_record(m, limits, k) for k, m in enumerate(msgs)]
    body = b"".join([_s8(topic, "topic"), _PRODUCE_FIXED.pack(0, 0, 0, -1, len(records)), *records])
    return _command(CommandKind.PRODUCE, ts_ms, body)


_text = st.sampled_from(["", "a", "é", "abcd", "abcde", "ü" * 3])
_body = st.one_of(st.binary(max_size=52), st.integers(46, 50).map(lambda n: b"x" * n))
_plain = st.builds(
    Message,
    body=_body,
    born_ts_ms=st.integers(0, 1 << 62),
)
_any = st.builds(
    Message,
    body=st.one_of(_body, st.binary(max_size=8).map(bytearray)),
    tag=_text,
    keys=st.lists(_text, max_size=3).map(tuple),
    properties=st.lists(st.tuples(_text, _text), max_size=3).map(tuple),
    queue=st.one_of(st.none(), st.integers(-1, 3), st.just(MAX_QUEUES)),
    sharding_key=st.one_of(st.none(), _text),
    born_ts_ms=st.integers(0, 1 << 62),
)


def _outcome(fn: object, *args: object) -> tuple[str, object]:
    try:
        return "ok", fn(*args)  # type: ignore[operator]
    except BrokerError as exc:
        return "refused", (type(exc).__name__, str(exc), exc.to_dict())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_plain, _any), min_size=1, max_size=6))
def test_batch_encoder_matches_the_reference_record_by_record(msgs: list[Message]) -> None:
    want = _outcome(_reference_produce, "t", msgs, 7, LIMITS)
    assert _outcome(lambda: encode_produce("t", msgs, 7, limits=LIMITS)) == want
    rows = [message_row(m) for m in msgs]
    assert _outcome(lambda: encode_produce_rows("t", rows, 7, limits=LIMITS)) == want
    for k, m in enumerate(msgs):
        assert _outcome(encode_record, m, LIMITS, k) == _outcome(_reference_record, m, LIMITS, k)
