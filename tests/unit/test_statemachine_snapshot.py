"""snapshot()/restore() of LogStateMachine and BrokerStateMachine: a
restored state machine is indistinguishable from one that applied the log."""

from __future__ import annotations

import struct
import zlib

import pytest

from broker_adapter.codec import CommandKind, encode_topic
from broker_adapter.node_sm import BrokerStateMachine
from dledger.core.types import Entry, EntryType
from dledger.statemachine import LogStateMachine, SnapshotError


def entries(n: int, start: int = 1, pos: int = 0) -> list[Entry]:
    out = []
    for i in range(start, start + n):
        kind = EntryType.NOOP if i % 7 == 0 else EntryType.NORMAL
        data = b"" if kind is EntryType.NOOP else f"payload-{i}".encode() * (i % 3 + 1)
        e = Entry(index=i, term=1 + i // 10, data=data, type=kind, pos=pos)
        out.append(e)
        pos = e.end_pos
    return out


def test_log_state_machine_round_trip() -> None:
    a = LogStateMachine(recent_payloads=5)
    for e in entries(30):
        a.apply(e)
    b = LogStateMachine(recent_payloads=5)
    b.restore(a.snapshot())
    assert b.last_applied == a.last_applied == 30
    assert b.records(1, 100) == a.records(1, 100)
    assert b.recent(1, 100) == a.recent(1, 100)
    assert len(b) == len(a)
    assert b.snapshot() == a.snapshot()
    # Both continue identically.
    for e in entries(5, 31):
        assert a.apply(e) == b.apply(e)
    assert a.snapshot() == b.snapshot()
    with pytest.raises(AssertionError):
        b.apply(entries(1, 3)[0])  # nothing at or below the snapshot again


def test_log_state_machine_empty_and_damaged() -> None:
    a = LogStateMachine()
    b = LogStateMachine()
    b.restore(a.snapshot())
    assert b.last_applied == 0 and len(b) == 0
    for e in entries(4):
        a.apply(e)
    raw = bytearray(a.snapshot())
    raw[10] ^= 1
    with pytest.raises(SnapshotError):
        b.restore(bytes(raw))
    with pytest.raises(SnapshotError):
        b.restore(b"short")
    assert b.last_applied == 0  # a refused snapshot changes nothing


def test_broker_state_machine_round_trip() -> None:
    a = BrokerStateMachine(broker_name="b1")
    es = entries(6)
    for e in es:
        a.apply(e)
    cmd = encode_topic(CommandKind.CREATE_TOPIC, "t", 1000, 4)
    a.apply(Entry(index=7, term=2, data=cmd, pos=es[-1].end_pos))
    b = BrokerStateMachine(broker_name="other")
    woke: list[int] = []
    b.add_listener(lambda: woke.append(1))
    b.restore(a.snapshot())
    assert woke == [1]
    assert b.broker.snapshot() == a.broker.snapshot()
    assert b.broker.broker_name == "b1"
    assert b.records(1, 100) == a.records(1, 100)
    assert b.snapshot() == a.snapshot()
    with pytest.raises(SnapshotError):
        b.restore(a.snapshot()[:-3])


def test_capped_records_stay_bounded_and_identical_across_a_restore() -> None:
    """With ``max_records`` the records (and the snapshot) stay bounded, and
    a replica restored from a snapshot midway drops exactly the records the
    one that applied everything drops."""
    ents = entries(2000)
    a = LogStateMachine(recent_payloads=50, max_records=100)
    sizes = []
    for e in ents[:1000]:
        a.apply(e)
        sizes.append(len(a))
    assert max(sizes) <= 125 and len(a) >= 100
    b = LogStateMachine(recent_payloads=50, max_records=100)
    b.restore(a.snapshot())
    for e in ents[1000:]:
        assert a.apply(e) == b.apply(e)
    assert a.records(1, 1000) == b.records(1, 1000)
    assert a.snapshot() == b.snapshot()
    newest = [e.index for e in ents if e.type is EntryType.NORMAL][-100:]
    assert [r[0] for r in a.records(1, 1000)][-100:] == newest
    assert len(a.snapshot()) < 125 * 20 + 50 * (20 + 40) + 100


def _v1_snapshot(applied: int, records: list[tuple[int, int, int]]) -> bytes:
    """A snapshot in the first layout (one big-endian row per record), as
    nodes before the columnar layout wrote them into checkpoints."""
    body = struct.pack(">8sQQQ", b"DLLSM\x00\x00\x01", applied, len(records), 0)
    body += b"".join(struct.pack(">QQI", *r) for r in records)
    return body + struct.pack(">I", zlib.crc32(body))


def test_records_are_big_endian_columns_and_the_row_layout_still_restores() -> None:
    a = LogStateMachine(recent_payloads=0)
    for e in entries(40):
        a.apply(e)
    recs = a.records(1, 100)
    assert any(c >= 1 << 31 for _, _, c in recs)  # CRCs above 2**31 survive
    raw = a.snapshot()
    n = len(recs)
    head = struct.calcsize(">8sQQQ")
    assert raw[:8] == b"DLLSM\x00\x00\x02"
    cols = raw[head : head + 20 * n]
    assert list(struct.unpack(f">{n}q", cols[: 8 * n])) == [r[0] for r in recs]
    assert list(struct.unpack(f">{n}q", cols[8 * n : 16 * n])) == [r[1] for r in recs]
    assert list(struct.unpack(f">{n}I", cols[16 * n :])) == [r[2] for r in recs]
    old = LogStateMachine(recent_payloads=0)
    old.restore(_v1_snapshot(a.last_applied, recs))
    assert old.records(1, 100) == recs and old.last_applied == a.last_applied
    assert old.snapshot() == raw  # written back in the columnar layout
    # A count of records past the data is refused, in both layouts.
    bad = bytearray(raw[:-4])
    struct.pack_into(">Q", bad, 16, n + 1)
    with pytest.raises(SnapshotError, match="overruns"):
        old.restore(bytes(bad) + struct.pack(">I", zlib.crc32(bytes(bad))))
    v1 = bytearray(_v1_snapshot(a.last_applied, recs)[:-4])
    struct.pack_into(">Q", v1, 16, n + 1)
    with pytest.raises(SnapshotError, match="overruns"):
        old.restore(bytes(v1) + struct.pack(">I", zlib.crc32(bytes(v1))))
    assert old.records(1, 100) == recs  # refused snapshots changed nothing
