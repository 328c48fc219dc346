"""The entry / message / conf-change codec: exact round trips, and every
corruption is refused with CodecError (never a wrong value, never another
exception type)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dledger.core.codec import (
    ENTRY_MAGIC,
    ENTRY_OVERHEAD,
    MSG_MAGIC,
    VERSION,
    decode_conf_change,
    decode_entry,
    decode_message,
    encode_conf_change,
    encode_entry,
    encode_message,
)
from dledger.core.types import ConfChange, ConfChangeType, Entry, EntryType, Message, MsgType
from dledger.errors import CodecError

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SMALL = st.integers(min_value=0, max_value=1000)

entries = st.builds(
    Entry,
    index=U64,
    term=U64,
    type=st.sampled_from(list(EntryType)),
    data=st.binary(max_size=200),
    pos=U64,
)


def messages(mtype: st.SearchStrategy[MsgType] | None = None) -> st.SearchStrategy[Message]:
    return st.builds(
        Message,
        type=mtype if mtype is not None else st.sampled_from(list(MsgType)),
        to=U64,
        frm=U64,
        term=U64,
        log_term=U64,
        index=U64,
        entries=st.lists(entries, max_size=4).map(tuple),
        commit=U64,
        reject=st.booleans(),
        reject_hint=U64,
        context=U64,
        force=st.booleans(),
        no_reply=st.booleans(),
    )


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENTRY_HDR = struct.Struct("<HBBQQQI")
MSG_HDR = struct.Struct("<HBBQQQQQQQQBI")


def reseal_message(body: bytes) -> bytes:
    """Give arbitrary message bytes (without CRC) a valid trailing CRC."""
    return body + struct.pack("<I", zlib.crc32(body))


def reseal_entry(rec: bytes) -> bytes:
    """Recompute an entry record's CRC after editing its header or data."""
    hdr, data = rec[: ENTRY_HDR.size], rec[ENTRY_OVERHEAD:]
    return hdr + struct.pack("<I", zlib.crc32(data, zlib.crc32(hdr))) + data


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------


@SETTINGS
@given(entries)
def test_codec_entry_round_trip(e: Entry) -> None:
    buf = encode_entry(e)
    assert len(buf) == ENTRY_OVERHEAD + len(e.data)
    for view in (buf, memoryview(buf)):
        got = decode_entry(view)
        assert got == e
        assert type(got.type) is EntryType
        assert type(got.data) is bytes
    assert encode_entry(decode_entry(buf)) == buf


@pytest.mark.parametrize("mtype", list(MsgType))
@SETTINGS
@given(data=st.data())
def test_codec_message_round_trip_every_type(mtype: MsgType, data: st.DataObject) -> None:
    m = data.draw(messages(st.just(mtype)))
    buf = encode_message(m)
    for view in (buf, memoryview(buf)):
        got = decode_message(view)
        assert got == m
        assert got.type is mtype
        assert type(got.entries) is tuple
    assert encode_message(decode_message(buf)) == buf


def test_codec_message_round_trip_examples() -> None:
    es = (Entry(5, 2, EntryType.NOOP, b"", 10), Entry(6, 2, EntryType.CONF_CHANGE, b"\x01" * 9, 10))
    for m in (
        Message(MsgType.APP, 2, 1, 3, log_term=2, index=4, entries=es, commit=4),
        Message(MsgType.APP, 2, 1, 3, log_term=2, index=6, commit=6, no_reply=True),
        Message(MsgType.APP_RESP, 1, 2, 3, index=4, reject=True, reject_hint=3, log_term=2),
        Message(MsgType.HEARTBEAT, 2, 1, 3, commit=7, context=99),
        Message(MsgType.VOTE, 2, 1, 3, log_term=2, index=6, force=True),
        Message(MsgType.PRE_VOTE_RESP, 1, 2, 4, reject=True),
        Message(MsgType.TIMEOUT_NOW, 2, 1, 3),
    ):
        assert decode_message(encode_message(m)) == m


@pytest.mark.parametrize("cc_type", list(ConfChangeType))
def test_codec_conf_change_round_trip(cc_type: ConfChangeType) -> None:
    for nid in (1, 7, 2**64 - 1):
        cc = ConfChange(cc_type, nid)
        assert decode_conf_change(encode_conf_change(cc)) == cc


# ---------------------------------------------------------------------------
# corruption
# ---------------------------------------------------------------------------


@SETTINGS
@given(entries, st.data())
def test_codec_entry_any_bit_flip_is_rejected(e: Entry, data: st.DataObject) -> None:
    buf = bytearray(encode_entry(e))
    bit = data.draw(st.integers(min_value=0, max_value=len(buf) * 8 - 1))
    buf[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError):
        decode_entry(bytes(buf))


def test_codec_entry_every_single_bit_flip_is_rejected() -> None:
    buf = encode_entry(Entry(3, 2, EntryType.NORMAL, b"hello", 42))
    for bit in range(len(buf) * 8):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            decode_entry(bytes(bad))


@SETTINGS
@given(messages(), st.data())
def test_codec_message_any_bit_flip_is_rejected(m: Message, data: st.DataObject) -> None:
    buf = bytearray(encode_message(m))
    bit = data.draw(st.integers(min_value=0, max_value=len(buf) * 8 - 1))
    buf[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError):
        decode_message(bytes(buf))


def test_codec_message_every_single_bit_flip_is_rejected() -> None:
    m = Message(
        MsgType.APP,
        2,
        1,
        3,
        log_term=2,
        index=4,
        entries=(Entry(5, 3, EntryType.NORMAL, b"ab", 7),),
        commit=4,
    )
    buf = encode_message(m)
    for bit in range(len(buf) * 8):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            decode_message(bytes(bad))


@SETTINGS
@given(entries)
def test_codec_entry_every_truncation_is_rejected(e: Entry) -> None:
    buf = encode_entry(e)
    for n in range(len(buf)):
        with pytest.raises(CodecError):
            decode_entry(buf[:n])


@SETTINGS
@given(messages())
def test_codec_message_every_truncation_is_rejected(m: Message) -> None:
    buf = encode_message(m)
    for n in range(len(buf)):
        with pytest.raises(CodecError):
            decode_message(buf[:n])


@SETTINGS
@given(entries, st.binary(min_size=1, max_size=16))
def test_codec_entry_trailing_bytes_are_rejected(e: Entry, extra: bytes) -> None:
    with pytest.raises(CodecError):
        decode_entry(encode_entry(e) + extra)


@SETTINGS
@given(messages(), st.binary(min_size=1, max_size=16))
def test_codec_message_trailing_bytes_are_rejected(m: Message, extra: bytes) -> None:
    with pytest.raises(CodecError):
        decode_message(encode_message(m) + extra)


def test_codec_message_trailing_bytes_inside_a_valid_crc_are_rejected() -> None:
    body = encode_message(Message(MsgType.HEARTBEAT, 2, 1, 3))[:-4]
    with pytest.raises(CodecError, match="trailing"):
        decode_message(reseal_message(body + b"\x00\x00"))


def test_codec_entry_wrong_magic_or_version_is_rejected_even_with_a_valid_crc() -> None:
    rec = encode_entry(Entry(1, 1, EntryType.NORMAL, b"x", 0))
    bad_magic = reseal_entry(struct.pack("<H", ENTRY_MAGIC ^ 0xFFFF) + rec[2:])
    with pytest.raises(CodecError, match="magic"):
        decode_entry(bad_magic)
    for v in (0, VERSION + 1, 255):
        bad_version = reseal_entry(rec[:2] + bytes([v]) + rec[3:])
        with pytest.raises(CodecError, match="version"):
            decode_entry(bad_version)
    with pytest.raises(CodecError):  # a message is not an entry
        decode_entry(encode_message(Message(MsgType.TIMEOUT_NOW, 2, 1, 3)))


def test_codec_message_wrong_magic_or_version_is_rejected_even_with_a_valid_crc() -> None:
    body = encode_message(Message(MsgType.VOTE, 2, 1, 3, log_term=1, index=1))[:-4]
    with pytest.raises(CodecError, match="magic"):
        decode_message(reseal_message(struct.pack("<H", MSG_MAGIC ^ 0x0101) + body[2:]))
    with pytest.raises(CodecError, match="magic"):
        decode_message(reseal_message(struct.pack("<H", ENTRY_MAGIC) + body[2:]))
    for v in (0, VERSION + 1, 255):
        with pytest.raises(CodecError, match="version"):
            decode_message(reseal_message(body[:2] + bytes([v]) + body[3:]))


def test_codec_unknown_types_are_rejected_even_with_a_valid_crc() -> None:
    rec = encode_entry(Entry(1, 1, EntryType.NORMAL, b"x", 0))
    with pytest.raises(CodecError, match="type"):
        decode_entry(reseal_entry(rec[:3] + bytes([max(EntryType) + 1]) + rec[4:]))
    body = encode_message(Message(MsgType.VOTE, 2, 1, 3))[:-4]
    for t in (0, max(MsgType) + 1, 255):
        with pytest.raises(CodecError, match="type"):
            decode_message(reseal_message(body[:3] + bytes([t]) + body[4:]))


def test_codec_corrupt_embedded_entry_is_rejected_even_with_a_valid_outer_crc() -> None:
    m = Message(MsgType.APP, 2, 1, 3, entries=(Entry(1, 3, EntryType.NORMAL, b"abc", 0),))
    body = bytearray(encode_message(m)[:-4])
    body[-1] ^= 0x01  # last data byte of the embedded entry
    with pytest.raises(CodecError, match="CRC"):
        decode_message(reseal_message(bytes(body)))


@pytest.mark.parametrize("delta", [-1, 1, 1000, 2**32 - 2])
def test_codec_wrong_entry_count_is_rejected_even_with_a_valid_crc(delta: int) -> None:
    m = Message(MsgType.APP, 2, 1, 3, entries=(Entry(1, 3, EntryType.NORMAL, b"abc", 0),))
    body = encode_message(m)[:-4]
    fields = list(MSG_HDR.unpack_from(body, 0))
    fields[-1] = (fields[-1] + delta) % 2**32
    bad = MSG_HDR.pack(*fields) + body[MSG_HDR.size :]
    with pytest.raises(CodecError):
        decode_message(reseal_message(bad))


@pytest.mark.parametrize("ln", [0, 1, ENTRY_OVERHEAD - 1, 10_000])
def test_codec_wrong_embedded_length_is_rejected(ln: int) -> None:
    m = Message(MsgType.APP, 2, 1, 3, entries=(Entry(1, 3, EntryType.NORMAL, b"abc", 0),))
    body = encode_message(m)[:-4]
    bad = body[: MSG_HDR.size] + struct.pack("<I", ln) + body[MSG_HDR.size + 4 :]
    with pytest.raises(CodecError):
        decode_message(reseal_message(bad))


@pytest.mark.parametrize("buf", [b"", b"\x00", b"\xe0\xd1", bytes(ENTRY_OVERHEAD - 1)])
def test_codec_short_inputs_are_rejected(buf: bytes) -> None:
    with pytest.raises(CodecError):
        decode_entry(buf)
    with pytest.raises(CodecError):
        decode_message(buf)


EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(messages(), EDITS)
def test_codec_message_structural_fuzz_behind_a_valid_crc(
    m: Message, edits: list[tuple[int, int]]
) -> None:
    """Edit bytes of a valid message and recompute its CRC (so only the
    structural checks stand between the bytes and a value): decoding raises
    CodecError (never struct.error, ValueError, IndexError...) or returns a
    value whose encoding is exactly those bytes."""
    body = bytearray(encode_message(m)[:-4])
    for pos, val in edits:
        body[pos % len(body)] = val
    buf = reseal_message(bytes(body))
    try:
        got = decode_message(buf)
    except CodecError:
        return
    assert encode_message(got) == buf


@settings(max_examples=200, deadline=None)
@given(entries, EDITS)
def test_codec_entry_structural_fuzz_behind_a_valid_crc(
    e: Entry, edits: list[tuple[int, int]]
) -> None:
    rec = bytearray(encode_entry(e))
    for pos, val in edits:
        rec[pos % len(rec)] = val
    buf = reseal_entry(bytes(rec))
    try:
        got = decode_entry(buf)
    except CodecError:
        return
    assert encode_entry(got) == buf


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_codec_random_bytes_raise_codec_error(buf: bytes) -> None:
    with pytest.raises(CodecError):
        decode_message(buf)
    with pytest.raises(CodecError):
        decode_entry(buf)


def test_codec_conf_change_corruption_is_rejected() -> None:
    good = encode_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    for bad in (b"", good[:-1], good + b"\x00", bytes([0]) + good[1:], bytes([99]) + good[1:]):
        with pytest.raises(CodecError):
            decode_conf_change(bad)


@pytest.mark.parametrize("flags", [0x10, 0x80, 0xF8])
def test_codec_unknown_flag_bits_are_rejected(flags: int) -> None:
    """One encoding per value: flag bits other than reject (1), force (2),
    snapshot (4) and no_reply (8) are refused even behind a valid CRC. (Regression: 29faa4f ignored them, so
    two byte strings decoded to the same message.)"""
    body = bytearray(encode_message(Message(MsgType.VOTE, 2, 1, 3))[:-4])
    body[MSG_HDR.size - 5] = flags  # the u8 before n_entries (u32)
    with pytest.raises(CodecError):
        decode_message(reseal_message(bytes(body)))
