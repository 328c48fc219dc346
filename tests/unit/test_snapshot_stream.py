"""Snapshot streaming (dledger/snapshot_stream.py): the chunk/ACK codec, the
pure receiver (Assembler) and sender window (SendWindow) state machines, a
seeded lossy channel between them, and the asyncio glue on two in-process
endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.core.codec import decode_message, encode_message
from dledger.core.types import ClusterConfig, Message, MsgType, Snapshot, SnapshotMeta
from dledger.errors import CodecError
from dledger.snapshot_stream import (
    ACK_MAGIC,
    CHUNK_MAGIC,
    AbortReason,
    Ack,
    Assembler,
    Chunk,
    SendWindow,
    SnapshotStreams,
    StreamSettings,
    decode_stream_frame,
    encode_ack,
    encode_chunk,
    is_stream_frame,
)

LEADER, FOLLOWER = 1, 2
META = SnapshotMeta(40, 3, 12345, ClusterConfig((1, 2, 3), (4,)))


def snap_msg(meta: SnapshotMeta = META, frm: int = LEADER, to: int = FOLLOWER) -> Message:
    return Message(
        MsgType.SNAPSHOT,
        to,
        frm,
        term=5,
        log_term=meta.term,
        index=meta.index,
        commit=meta.index,
        snapshot=meta,
    )


def chunks_of(
    payload: bytes, chunk: int, meta: SnapshotMeta = META, msg: Message | None = None
) -> list[Chunk]:
    """What a sender emits for ``payload``, in order."""
    m = encode_message(msg or snap_msg(meta))
    out: list[Chunk] = []
    off = 0
    while True:
        n = min(chunk, len(payload) - off)
        final = off + n == len(payload)
        out.append(
            Chunk(
                meta.index,
                meta.term,
                len(payload),
                off,
                payload[off : off + n],
                final,
                zlib.crc32(payload) if final else 0,
                m if final else b"",
            )
        )
        off += n
        if final:
            return out


# ==========================================================================
# codec
# ==========================================================================
CHUNK = Chunk(7, 2, 100, 40, b"x" * 30)
FINAL = Chunk(7, 2, 100, 70, b"y" * 30, True, 0xDEADBEEF, encode_message(snap_msg()))
ACKS = [
    Ack(7, 2, 70),
    Ack(7, 2, 40, gap=True),
    Ack(7, 2, 100, done=True),
    Ack(7, 2, 0, reason=AbortReason.TOO_LARGE),
]


@pytest.mark.parametrize("frame", [CHUNK, FINAL, *ACKS])
def test_round_trip(frame: Chunk | Ack) -> None:
    enc = encode_chunk(frame) if isinstance(frame, Chunk) else encode_ack(frame)
    assert is_stream_frame(enc)
    assert decode_stream_frame(enc) == frame


@given(
    total=st.integers(0, 5000),
    data=st.data(),
    index=st.integers(0, 2**64 - 1),
    term=st.integers(0, 2**64 - 1),
)
@settings(max_examples=200)
def test_chunk_round_trip_property(total: int, data: st.DataObject, index: int, term: int) -> None:
    off = data.draw(st.integers(0, total))
    final = off == total or data.draw(st.booleans())
    n = total - off if final else data.draw(st.integers(1, total - off))
    if not final and off + n == total:
        final = True
    c = Chunk(
        index,
        term,
        total,
        off,
        bytes(data.draw(st.binary(min_size=n, max_size=n))),
        final,
        data.draw(st.integers(0, 2**32 - 1)) if final else 0,
        b"m" * data.draw(st.integers(1, 50)) if final else b"",
    )
    assert decode_stream_frame(encode_chunk(c)) == c


def test_stream_frames_and_raft_messages_cannot_be_confused() -> None:
    raft = encode_message(snap_msg())
    assert not is_stream_frame(raft)
    assert not is_stream_frame(b"")
    assert not is_stream_frame(b"\xe5")
    for frame in (encode_chunk(FINAL), encode_ack(ACKS[0])):
        assert frame[:2] != raft[:2]
        with pytest.raises(CodecError):
            decode_message(frame)
    with pytest.raises(CodecError):
        decode_stream_frame(raft)
    assert CHUNK_MAGIC != ACK_MAGIC


@pytest.mark.parametrize("frame", [encode_chunk(CHUNK), encode_chunk(FINAL), encode_ack(ACKS[1])])
def test_every_single_bit_flip_is_rejected(frame: bytes) -> None:
    for pos in range(len(frame)):
        for bit in (0, 3, 7):
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            with pytest.raises(CodecError):
                decode_stream_frame(bytes(bad))


@pytest.mark.parametrize("frame", [encode_chunk(CHUNK), encode_chunk(FINAL), encode_ack(ACKS[2])])
def test_every_truncation_and_extension_is_rejected(frame: bytes) -> None:
    for n in range(len(frame)):
        with pytest.raises(CodecError):
            decode_stream_frame(frame[:n])
    with pytest.raises(CodecError):
        decode_stream_frame(frame + b"\x00")


@pytest.mark.parametrize(
    "c",
    [
        Chunk(1, 1, 10, 5, b"x" * 6),  # beyond the payload
        Chunk(1, 1, 10, 0, b"x" * 10),  # non-final but ends the payload
        Chunk(1, 1, 10, 0, b""),  # non-final and empty
        Chunk(1, 1, 10, 0, b"x" * 5, True, 1, b"m"),  # final not at the end
        Chunk(1, 1, 10, 5, b"x" * 5, True, 1, b""),  # final without message
        Chunk(1, 1, 10, 0, b"x" * 5, False, 0, b"m"),  # message on a non-final chunk
    ],
)
def test_inconsistent_chunks_are_rejected(c: Chunk) -> None:
    with pytest.raises(CodecError):
        decode_stream_frame(encode_chunk(c))


def test_ack_abort_flag_must_agree_with_reason() -> None:
    frame = bytearray(encode_ack(Ack(1, 1, 0, reason=AbortReason.BAD_PAYLOAD_CRC)))
    frame[-5] = 0  # reason NONE with the abort flag still set
    crc = zlib.crc32(bytes(frame[:-4]))
    frame[-4:] = crc.to_bytes(4, "little")
    with pytest.raises(CodecError):
        decode_stream_frame(bytes(frame))


# ==========================================================================
# receiver
# ==========================================================================
def new_asm(max_bytes: int = 1 << 30) -> Assembler:
    return Assembler(LEADER, FOLLOWER, max_bytes)


def test_assembler_in_order_rebuilds_the_message_with_the_payload() -> None:
    payload = random.Random(1).randbytes(10_000)
    a = new_asm()
    cs = chunks_of(payload, 1024)
    assert len(cs) == 10
    for c in cs[:-1]:
        ack, m = a.feed(c)
        assert m is None and ack == Ack(META.index, META.term, c.offset + len(c.data))
    ack, m = a.feed(cs[-1])
    assert ack == Ack(META.index, META.term, len(payload), done=True)
    assert m == dataclasses.replace(snap_msg(), snapshot_data=payload)
    assert a.key is None and a.received == 0  # memory released
    # The final chunk again (our DONE was lost): DONE again, nothing stepped twice.
    ack, m = a.feed(cs[-1])
    assert ack.done and m is None


def test_assembler_empty_payload() -> None:
    a = new_asm()
    (c,) = chunks_of(b"", 1024)
    ack, m = a.feed(c)
    assert ack.done and m is not None and m.snapshot_data == b""


def test_assembler_gap_and_duplicate() -> None:
    a = new_asm()
    cs = chunks_of(bytes(5000), 1000)
    a.feed(cs[0])
    ack, m = a.feed(cs[2])  # cs[1] lost
    assert m is None and ack == Ack(META.index, META.term, 1000, gap=True)
    ack, _ = a.feed(cs[0])  # a duplicate: not a gap, just where we are
    assert ack == Ack(META.index, META.term, 1000)
    for c in cs[1:]:
        ack, m = a.feed(c)
    assert ack.done and m is not None and m.snapshot_data == bytes(5000)


def test_assembler_restarts_for_another_snapshot() -> None:
    a = new_asm()
    old = chunks_of(b"a" * 3000, 1000)
    a.feed(old[0])
    a.feed(old[1])
    newer = SnapshotMeta(80, 4, 999, META.config)
    cs = chunks_of(b"b" * 3000, 1000, newer)
    ack, _ = a.feed(cs[1])  # joins mid-way: asks for the start of the new one
    assert ack == Ack(80, 4, 0, gap=True) and a.key == (80, 4) and a.received == 0
    for c in cs:
        ack, m = a.feed(c)
    assert ack.done and m is not None and m.snapshot == newer and m.snapshot_data == b"b" * 3000


def test_assembler_aborts_above_its_cap() -> None:
    a = new_asm(max_bytes=4096)
    cs = chunks_of(bytes(5000), 1000)
    ack, m = a.feed(cs[0])
    assert m is None and ack is not None and ack.reason is AbortReason.TOO_LARGE
    assert a.key is None
    # The rest of that window: silence, not one ABORT (and log line) per chunk.
    assert a.feed(cs[1]) == (None, None)
    # A new attempt from offset 0 is judged again.
    ack, _ = a.feed(cs[0])
    assert ack is not None and ack.reason is AbortReason.TOO_LARGE


def test_assembler_checks_the_whole_payload_crc() -> None:
    a = new_asm()
    cs = chunks_of(b"z" * 3000, 1000)
    # Each chunk is self-consistent (its own CRC is fine) but the payload's is not.
    cs[1] = dataclasses.replace(cs[1], data=b"Z" * 1000)
    for c in cs[:-1]:
        a.feed(c)
    ack, m = a.feed(cs[-1])
    assert m is None and ack is not None and ack.reason is AbortReason.BAD_PAYLOAD_CRC
    assert a.key is None


@pytest.mark.parametrize(
    "msg",
    [
        snap_msg(frm=3),  # claims another sender than the connection's peer
        snap_msg(to=9),  # not for us
        dataclasses.replace(snap_msg(), type=MsgType.APP, snapshot=None),
        snap_msg(SnapshotMeta(41, 3, 0, META.config)),  # meta disagrees with the chunks
    ],
)
def test_assembler_refuses_a_bad_final_message(msg: Message) -> None:
    a = new_asm()
    for c in chunks_of(b"q" * 2500, 1000, META, msg)[:-1]:
        a.feed(c)
    ack, m = a.feed(chunks_of(b"q" * 2500, 1000, META, msg)[-1])
    assert m is None and ack is not None and ack.reason is AbortReason.BAD_MESSAGE


def test_assembler_undecodable_final_message() -> None:
    a = new_asm()
    cs = chunks_of(b"q" * 1500, 1000)
    cs[-1] = dataclasses.replace(cs[-1], message=b"garbage")
    a.feed(cs[0])
    ack, m = a.feed(cs[1])
    assert m is None and ack is not None and ack.reason is AbortReason.BAD_MESSAGE


# ==========================================================================
# sender window
# ==========================================================================
def win(total: int = 10_000, chunk: int = 1000, window: int = 3) -> SendWindow:
    return SendWindow(total, chunk, window, now=0.0, resend_after_s=2.0, timeout_s=10.0)


def drain(w: SendWindow) -> list[tuple[int, int]]:
    out = []
    while (nxt := w.next_chunk()) is not None:
        w.mark_sent(*nxt)
        out.append(nxt)
    return out


def ack(n: int, **kw: object) -> Ack:
    return Ack(META.index, META.term, n, **kw)  # type: ignore[arg-type]


def test_window_limits_chunks_in_flight() -> None:
    w = win()
    assert drain(w) == [(0, 1000), (1000, 1000), (2000, 1000)]
    w.on_ack(ack(1000), 0.1)
    assert drain(w) == [(3000, 1000)]
    w.on_ack(ack(4000), 0.2)
    assert drain(w) == [(4000, 1000), (5000, 1000), (6000, 1000)]


def test_window_last_chunk_is_final_and_done_needs_the_done_ack() -> None:
    w = win(total=2500)
    assert drain(w) == [(0, 1000), (1000, 1000), (2000, 500)]
    assert w.is_final(2000, 500) and not w.is_final(1000, 1000)
    w.on_ack(ack(2000), 0.1)
    assert not w.done and w.next_chunk() is None
    w.on_ack(ack(2500, done=True), 0.2)
    assert w.done


def test_window_empty_payload_sends_one_final_chunk() -> None:
    w = win(total=0)
    assert drain(w) == [(0, 0)]
    assert w.next_chunk() is None
    w.on_ack(ack(0, done=True), 0.1)
    assert w.done


def test_window_refused_send_is_retried_from_that_chunk() -> None:
    w = win()
    assert w.next_chunk() == (0, 1000)
    w.mark_sent(0, 1000)
    assert w.next_chunk() == (1000, 1000)
    w.on_refused(1000)
    assert w.next_chunk() == (1000, 1000)


def test_window_gap_goes_back_once() -> None:
    w = win()
    drain(w)  # 0, 1000, 2000; 1000 is lost
    w.on_ack(ack(1000), 0.1)
    drain(w)  # 3000
    w.on_ack(ack(1000, gap=True), 0.2)  # 2000 arrived after the loss
    assert w.rewinds == 1
    assert drain(w) == [(1000, 1000), (2000, 1000), (3000, 1000)]
    w.on_ack(ack(1000, gap=True), 0.3)  # 3000 (first copy) arrived: same gap
    assert w.next_chunk() is None and w.rewinds == 1
    w.on_ack(ack(2000), 0.4)
    assert drain(w) == [(4000, 1000)]


def test_window_plain_duplicate_ack_does_not_rewind() -> None:
    w = win()
    drain(w)
    w.on_ack(ack(1000), 0.1)
    drain(w)
    w.on_ack(ack(1000), 0.2)
    assert w.rewinds == 0 and w.sent == 4000


def test_window_receiver_restart_goes_back_to_its_offset() -> None:
    w = win()
    for _ in range(3):
        drain(w)
        w.on_ack(ack(w.sent), 0.1)
    assert w.acked == 9000
    w.on_ack(ack(0, gap=True), 0.2)  # a fresh receiver process
    assert w.acked == 0 and drain(w) == [(0, 1000), (1000, 1000), (2000, 1000)]


def test_window_resumes_where_the_receiver_already_is() -> None:
    w = win()
    drain(w)
    w.on_ack(ack(6000), 0.1)  # it kept 6000 bytes of this snapshot from an earlier try
    assert drain(w) == [(6000, 1000), (7000, 1000), (8000, 1000)]


def test_window_resends_after_silence_and_times_out() -> None:
    w = win()
    drain(w)
    assert w.poll(1.0) and w.next_chunk() is None
    assert w.poll(2.0) and w.rewinds == 1
    assert drain(w) == [(0, 1000), (1000, 1000), (2000, 1000)]
    assert w.poll(3.9) and w.rewinds == 1  # 2 s since the resend, not yet
    assert w.poll(4.0) and w.rewinds == 2
    w.on_ack(ack(1000), 5.0)  # progress restarts the timeout
    assert w.poll(14.9)
    assert not w.poll(15.0)


def test_window_abort_stops_it() -> None:
    w = win()
    drain(w)
    w.on_ack(ack(0, reason=AbortReason.TOO_LARGE), 0.1)
    assert w.abort_reason is AbortReason.TOO_LARGE and w.next_chunk() is None


def test_window_ignores_nonsense_acks() -> None:
    w = win(total=3000)
    drain(w)
    w.on_ack(ack(99_999), 0.1)
    w.on_ack(ack(2000, done=True), 0.1)  # DONE must name the total
    assert w.acked == 0 and not w.done


# ==========================================================================
# sender and receiver over a seeded lossy channel (no sockets, no clock)
# ==========================================================================
@pytest.mark.parametrize("seed", range(20))
def test_lossy_channel_delivers_exactly_the_payload(seed: int) -> None:
    rng = random.Random(seed)
    payload = rng.randbytes(rng.randrange(0, 40_000))
    loss = rng.choice([0.0, 0.05, 0.2])
    refuse = rng.choice([0.0, 0.1])
    chunk = rng.choice([512, 1000, 4096])
    w = SendWindow(len(payload), chunk, rng.randrange(1, 6), 0.0, 0.5, 1e9)
    a = new_asm()
    msg = encode_message(snap_msg())
    crc = zlib.crc32(payload)
    to_rx: list[bytes] = []
    to_tx: list[bytes] = []
    delivered: list[Message] = []
    now = 0.0
    for _ in range(100_000):
        if w.done:
            break
        assert w.poll(now)
        while (nxt := w.next_chunk()) is not None:
            off, n = nxt
            if rng.random() < refuse:
                w.on_refused(off)
                break
            final = w.is_final(off, n)
            c = Chunk(40, 3, len(payload), off, payload[off : off + n], final)
            if final:
                c = dataclasses.replace(c, payload_crc=crc, message=msg)
            w.mark_sent(off, n)
            if rng.random() >= loss:
                to_rx.append(encode_chunk(c))
        # Deliver in order (a subsequence of what was sent, as the transport promises).
        for frame in to_rx:
            f = decode_stream_frame(frame)
            assert isinstance(f, Chunk)
            reply, m = a.feed(f)
            if m is not None:
                delivered.append(m)
            assert reply is not None and not reply.abort
            if rng.random() >= loss:
                to_tx.append(encode_ack(reply))
        to_rx.clear()
        for frame in to_tx:
            f = decode_stream_frame(frame)
            assert isinstance(f, Ack)
            w.on_ack(f, now)
        to_tx.clear()
        now += 0.1
    assert w.done, f"seed {seed}: not done (acked {w.acked} of {w.total})"
    assert len(delivered) == 1
    assert delivered[0].snapshot_data == payload


# ==========================================================================
# asyncio glue: two endpoints wired back to back
# ==========================================================================
class Pair:
    """A leader and a follower SnapshotStreams whose frames are delivered on
    the next loop turn; ``drop`` decides per frame whether it is lost."""

    def __init__(self, cfg: StreamSettings, drop: Callable[[int, bytes], bool] | None = None):
        self.drop = drop or (lambda to, b: False)
        self.delivered: list[Message] = []
        self.failed: list[int] = []
        self.sent: list[int] = []
        self.lc: dict[str, int] = {}
        self.fc: dict[str, int] = {}
        self.refuse = False
        self.leader = SnapshotStreams(
            LEADER,
            cfg,
            self._send(LEADER),
            lambda m: None,
            self.failed.append,
            self.lc,
            sent=self.sent.append,
        )
        self.follower = SnapshotStreams(
            FOLLOWER, cfg, self._send(FOLLOWER), self.delivered.append, lambda p: None, self.fc
        )

    def _send(self, frm: int) -> Callable[[int, bytes], bool]:
        def send(to: int, payload: bytes) -> bool:
            if self.refuse and frm == LEADER:
                return False
            if self.drop(to, payload):
                return True
            dst = self.follower if to == FOLLOWER else self.leader
            asyncio.get_running_loop().call_soon(dst.on_frame, frm, payload)
            return True

        return send

    async def wait(self, pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not pred():
                await asyncio.sleep(0.01)


async def test_glue_streams_a_many_chunk_snapshot() -> None:
    p = Pair(StreamSettings(chunk_bytes=4096, window_chunks=4, timeout_s=5.0))
    payload = random.Random(7).randbytes(300_000)
    assert p.leader.send_snapshot(snap_msg(), Snapshot(META, payload))
    # A second request for the same peer while it runs is ignored, not restarted.
    assert not p.leader.send_snapshot(snap_msg(), Snapshot(META, payload))
    await p.wait(lambda: p.lc["snapshots_sent"] == 1)
    assert [m.snapshot_data == payload for m in p.delivered] == [True]
    assert p.sent == [FOLLOWER] and p.failed == []
    assert p.delivered[0].snapshot == META and p.delivered[0].frm == LEADER
    n = -(-len(payload) // 4096)
    assert p.lc["snapshot_chunks_sent"] == n and p.fc["snapshot_chunks_received"] == n
    assert p.lc["snapshot_chunk_bytes_sent"] == len(payload)
    assert p.lc["snapshot_stream_ignored"] == 1 and p.failed == []
    assert p.leader.streaming_to() == []
    await p.leader.close()
    await p.follower.close()


async def test_glue_survives_loss_and_refusals() -> None:
    rng = random.Random(3)
    p = Pair(
        StreamSettings(chunk_bytes=2048, window_chunks=3, timeout_s=0.4),
        drop=lambda to, b: rng.random() < 0.1,
    )
    payload = bytes(range(256)) * 400
    p.refuse = True
    p.leader.send_snapshot(snap_msg(), Snapshot(META, payload))
    await asyncio.sleep(0.05)
    assert p.lc["snapshot_chunks_refused"] >= 1 and p.lc["snapshot_chunks_sent"] == 0
    p.refuse = False
    await p.wait(lambda: p.lc["snapshots_sent"] == 1, 30)
    assert len(p.delivered) == 1 and p.delivered[0].snapshot_data == payload
    assert p.lc["snapshot_chunk_rewinds"] >= 1
    await p.leader.close()


async def test_glue_times_out_and_reports_failure() -> None:
    p = Pair(StreamSettings(chunk_bytes=1024, timeout_s=0.2), drop=lambda to, b: True)
    p.leader.send_snapshot(snap_msg(), Snapshot(META, bytes(10_000)))
    await p.wait(lambda: p.failed == [FOLLOWER])
    assert p.lc["snapshot_stream_aborts"] == 1 and p.lc["snapshots_send_failed"] == 1
    assert p.leader.streaming_to() == []
    # A new request after the failure starts a new stream.
    assert p.leader.send_snapshot(snap_msg(), Snapshot(META, bytes(10_000)))
    await p.leader.close()


async def test_glue_receiver_abort_reports_failure() -> None:
    cfg = StreamSettings(chunk_bytes=1024, timeout_s=5.0)
    p = Pair(cfg)
    p.follower = SnapshotStreams(
        FOLLOWER,
        dataclasses.replace(cfg, max_snapshot_bytes=1 << 20),
        p._send(FOLLOWER),
        p.delivered.append,
        lambda x: None,
        p.fc,
    )
    p.leader.send_snapshot(snap_msg(), Snapshot(META, bytes((1 << 20) + 1)))
    await p.wait(lambda: p.failed == [FOLLOWER])
    assert p.fc["snapshot_stream_rejects"] == 1 and p.delivered == []
    await p.leader.close()


async def test_glue_stop_sending_cancels_without_reporting() -> None:
    p = Pair(StreamSettings(chunk_bytes=1024, timeout_s=5.0), drop=lambda to, b: True)
    p.leader.send_snapshot(snap_msg(), Snapshot(META, bytes(100_000)))
    await asyncio.sleep(0.05)
    assert p.leader.streaming_to() == [FOLLOWER]
    p.leader.stop_sending()
    await asyncio.sleep(0.05)
    assert p.leader.streaming_to() == [] and p.failed == []
    await p.leader.close()
    assert not p.leader.send_snapshot(snap_msg(), Snapshot(META, b"x"))  # closed


async def test_glue_counts_garbage_and_never_raises() -> None:
    p = Pair(StreamSettings())
    good = encode_chunk(chunks_of(b"abc", 1024)[0])
    for bad in (good[:-1], bytes([good[0], good[1]]) + b"\x00" * 40, good[:2]):
        p.follower.on_frame(LEADER, bad)
    assert p.fc["snapshot_stream_garbage"] == 3 and p.delivered == []
    # A chunk from a peer claiming to send for someone else is refused at the end.
    p.follower.on_frame(3, good)
    await asyncio.sleep(0)
    assert p.delivered == [] and p.fc["snapshot_stream_rejects"] == 1
    await p.follower.close()


async def test_glue_resend_of_a_delivered_snapshot_reports_sent_without_a_second_delivery() -> None:
    """The receiver already delivered this snapshot (its core's answer may
    have been lost): a resend is acknowledged as done and not delivered
    again, and the sender still reports it sent, so the leader's core probes
    past it instead of waiting for an answer that never comes."""
    p = Pair(StreamSettings(chunk_bytes=1024, window_chunks=2, timeout_s=5.0))
    payload = bytes(range(256)) * 10
    assert p.leader.send_snapshot(snap_msg(), Snapshot(META, payload))
    await p.wait(lambda: p.sent == [FOLLOWER])
    assert p.leader.send_snapshot(snap_msg(), Snapshot(META, payload))
    await p.wait(lambda: p.sent == [FOLLOWER, FOLLOWER])
    assert len(p.delivered) == 1 and p.failed == []
    await p.leader.close()
