"""Unit tests of the broker state machine: each bad input has its own error
type, and each rule of issue 4 has a test that would fail without it."""

from __future__ import annotations

import pytest

from broker_adapter import (
    BrokerError,
    BrokerState,
    BrokerStateMachine,
    CommandKind,
    DuplicateSequence,
    InvalidArgument,
    InvalidGroupName,
    InvalidQueue,
    InvalidTopicName,
    Limits,
    MalformedCommand,
    Message,
    MessageTooLarge,
    OffsetOutOfRange,
    ProduceResult,
    ProducerFenced,
    ProducerResult,
    ResetMode,
    SequenceGap,
    TooManyProperties,
    TopicExists,
    UnknownProducer,
    UnknownTopic,
    encode_commit_offsets,
    encode_produce,
    encode_register_producer,
    encode_reset_group,
    encode_retention,
    encode_topic,
)
from broker_adapter.codec import decode_record, encode_record
from dledger.core.types import Entry
from dledger.errors import InvariantViolation
from tests.broker.helpers import Feed


def create(f: Feed, name: str = "t", queues: int = 4, ts: int = 1000) -> None:
    r = f(encode_topic(CommandKind.CREATE_TOPIC, name, ts, queues))
    assert not isinstance(r, BrokerError), r


def produce(f: Feed, topic: str, bodies: list[bytes], ts: int = 1000, **kw: object) -> object:
    queue = kw.pop("queue", None)
    msgs = [Message(b, queue=queue) for b in bodies]  # type: ignore[arg-type]
    return f(encode_produce(topic, msgs, ts, **kw))  # type: ignore[arg-type]


def ok(r: object) -> ProduceResult:
    assert isinstance(r, ProduceResult), r
    return r


# -- bad input: one error type each ------------------------------------------


def test_oversized_message_is_message_too_large() -> None:
    limits = Limits(max_message_bytes=100)
    with pytest.raises(MessageTooLarge) as ei:
        encode_produce("t", [Message(b"x" * 101)], 1, limits=limits)
    assert ei.value.field == "messages[0].value" and ei.value.code == "MESSAGE_TOO_LARGE"
    with pytest.raises(MessageTooLarge):
        encode_produce("t", [Message(b"x" * 90)] * 20, 1, limits=Limits(max_batch_bytes=1000))


@pytest.mark.parametrize("name", ["", "a" * 128, "bad name", "ü", "a/b"])
def test_bad_topic_name_is_invalid_topic_name(name: str) -> None:
    with pytest.raises(InvalidTopicName) as ei:
        encode_produce(name, [Message(b"x")], 1)
    assert ei.value.field == "topic"
    with pytest.raises(InvalidTopicName):
        encode_topic(CommandKind.CREATE_TOPIC, name, 1, 1)


def test_bad_group_name_is_invalid_group_name() -> None:
    with pytest.raises(InvalidGroupName) as ei:
        encode_commit_offsets("", [("t", 0, 0)], 1)
    assert ei.value.field == "group"


def test_too_many_properties() -> None:
    props = tuple((f"k{i}", "v") for i in range(65))
    with pytest.raises(TooManyProperties) as ei:
        encode_produce("t", [Message(b"x", properties=props)], 1)
    assert ei.value.field == "messages[0].properties"


@pytest.mark.parametrize("queues", [0, 1025])
def test_queue_count_out_of_range_is_invalid_queue(queues: int) -> None:
    with pytest.raises(InvalidQueue) as ei:
        encode_topic(CommandKind.CREATE_TOPIC, "t", 1, queues)
    assert ei.value.field == "queues"


def test_invalid_queue_id() -> None:
    with pytest.raises(InvalidQueue):
        encode_produce("t", [Message(b"x", queue=-2)], 1)
    f = Feed()
    create(f, queues=4)
    r = produce(f, "t", [b"a"], queue=4)
    assert isinstance(r, InvalidQueue) and r.field == "messages[0].queue"
    with pytest.raises(InvalidQueue):
        f.state.read("t", 4, 0)
    assert f.state.stats()["stored_messages"] == 0


def test_unknown_topic() -> None:
    f = Feed()
    r = produce(f, "nope", [b"a"])
    assert isinstance(r, UnknownTopic) and r.code == "UNKNOWN_TOPIC" and r.field == "topic"
    with pytest.raises(UnknownTopic):
        f.state.read("nope", 0, 0)
    with pytest.raises(UnknownTopic):
        f.state.topic("nope")
    assert isinstance(f(encode_commit_offsets("g", [("nope", 0, 0)], 1)), UnknownTopic)
    assert f.state.topic_names() == []


def test_offset_out_of_range_names_the_valid_range() -> None:
    f = Feed()
    create(f, queues=1)
    produce(f, "t", [b"a", b"b"])
    assert f.state.read("t", 0, 2).messages == ()  # == max: empty, not an error
    with pytest.raises(OffsetOutOfRange) as ei:
        f.state.read("t", 0, 3)
    assert (ei.value.min_offset, ei.value.max_offset) == (0, 2)
    assert ei.value.to_dict()["min_offset"] == 0 and ei.value.to_dict()["max_offset"] == 2
    r = f(encode_commit_offsets("g", [("t", 0, 3)], 1))
    assert isinstance(r, OffsetOutOfRange) and r.field == "offsets[0].offset"


def test_topic_exists_and_queue_count_only_grows() -> None:
    f = Feed()
    create(f, queues=2)
    assert isinstance(f(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 3)), TopicExists)
    assert isinstance(f(encode_topic(CommandKind.UPDATE_TOPIC, "t", 1, 1)), InvalidQueue)
    info = f(encode_topic(CommandKind.UPDATE_TOPIC, "t", 1, 3))
    assert len(f.state.topic("t").queues) == 3 and not isinstance(info, BrokerError)


def test_malformed_command_changes_nothing_but_advances_confirm_offset() -> None:
    f = Feed()
    create(f)
    snap = f.state.snapshot()
    data = bytearray(encode_produce("t", [Message(b"hello")], 5))
    data[-1] ^= 0xFF
    r = f(bytes(data))
    assert isinstance(r, MalformedCommand)
    assert f.state.confirm_offset == f.log.end
    assert f.state.stats()["stored_messages"] == 0
    assert f.state.topic("t") == BrokerState.restore(snap).topic("t")


def test_record_crc_is_checked_on_read() -> None:
    rec = bytearray(encode_record(Message(b"body", tag="x", keys=("k",), properties=(("a", "b"),))))
    assert decode_record(bytes(rec)).body == b"body"
    rec[-1] ^= 1
    with pytest.raises(MalformedCommand):
        decode_record(bytes(rec))


def test_corrupt_snapshot_is_refused() -> None:
    f = Feed()
    create(f)
    snap = bytearray(f.state.snapshot())
    snap[-1] ^= 1
    with pytest.raises(MalformedCommand):
        BrokerState.restore(bytes(snap))
    with pytest.raises(MalformedCommand):
        BrokerState.restore(b"nope")


# -- offsets ---------------------------------------------------------------


def test_physical_offsets_msg_ids_and_confirm_offset() -> None:
    f = Feed("b1")
    create(f, queues=1)
    f.log.noop()
    f.state.apply(f.log.entries[-1])
    r = ok(produce(f, "t", [b"a", b"bb"]))
    e = f.log.entries[-1]
    a0, a1 = r.acks
    assert e.pos < a0.phys_offset < a1.phys_offset < e.end_pos
    assert a0.phys_offset + a0.size == a1.phys_offset and a1.phys_offset + a1.size == e.end_pos
    # The record really is at that CommitLog position.
    rec = e.data[a1.phys_offset - e.pos : a1.phys_offset - e.pos + a1.size]
    assert decode_record(rec).body == b"bb"
    assert f.state.confirm_offset == e.end_pos
    assert a0.msg_id != a1.msg_id and a0.msg_id.endswith(f"{a0.phys_offset:016X}")
    assert [m.queue_offset for m in f.state.read("t", 0, 0).messages] == [0, 1]


def test_apply_out_of_order_or_backwards_is_an_invariant_violation() -> None:
    s = BrokerState()
    s.apply(Entry(1, 1, data=b"abc", pos=0))
    with pytest.raises(InvariantViolation):
        s.apply(Entry(1, 1, data=b"", pos=3))
    with pytest.raises(InvariantViolation):
        s.apply(Entry(2, 1, data=b"", pos=1))


def test_epoch_map_records_first_position_of_each_term() -> None:
    f = Feed()
    create(f)
    f.log.term = 3
    f(b"raw")
    assert f.state.epochs == {1: 0, 3: f.log.entries[0].end_pos}


# -- queue selection -------------------------------------------------------------


def test_round_robin_and_sharding_key() -> None:
    f = Feed()
    create(f, queues=3)
    r = ok(f(encode_produce("t", [Message(b"x")] * 6, 1)))
    assert [a.queue for a in r.acks] == [0, 1, 2, 0, 1, 2]
    r2 = ok(f(encode_produce("t", [Message(b"y")], 1)))
    assert r2.acks[0].queue == 0  # the counter is state, not per batch
    keyed = [Message(str(i).encode(), sharding_key="order-7") for i in range(5)]
    r3 = ok(f(encode_produce("t", keyed, 1)))
    q = {a.queue for a in r3.acks}
    assert len(q) == 1
    got = [m.body for m in f.state.read("t", q.pop(), 0, 100).messages if m.body.isdigit()]
    assert got == [b"0", b"1", b"2", b"3", b"4"]


def test_auto_create_uses_the_count_carried_in_the_entry() -> None:
    f = Feed()
    ok(produce(f, "auto", [b"x"], auto_create_queues=5))
    assert len(f.state.topic("auto").queues) == 5


# -- reads ------------------------------------------------------------------------


def test_read_limits_and_tag_filter() -> None:
    f = Feed()
    create(f, queues=1)
    msgs = [Message(bytes([65 + i]) * 10, tag="a" if i % 2 else "b") for i in range(10)]
    ok(f(encode_produce("t", msgs, 1)))
    r = f.state.read("t", 0, 0, max_messages=3)
    assert len(r.messages) == 3 and r.next_offset == 3
    size = r.messages[0].size
    r = f.state.read("t", 0, 0, max_bytes=size * 2)
    assert len(r.messages) == 2
    r = f.state.read("t", 0, 0, max_bytes=1)
    assert len(r.messages) == 1  # always at least one
    r = f.state.read("t", 0, 0, tag="a")
    assert [m.queue_offset for m in r.messages] == [1, 3, 5, 7, 9]
    assert r.next_offset == 10
    r = f.state.read("t", 0, 0, tag="a||b")
    assert len(r.messages) == 10


# -- consumer groups --------------------------------------------------------------


def test_group_offsets_commit_and_reset() -> None:
    f = Feed()
    create(f, queues=2)
    for ts in (1000, 2000, 3000):
        ok(f(encode_produce("t", [Message(b"x", queue=0), Message(b"y", queue=1)], ts)))
    f(encode_commit_offsets("g", [("t", 0, 2), ("t", 1, 1)], 3001))
    assert f.state.group_offsets("g") == {("t", 0): 2, ("t", 1): 1}
    f(encode_reset_group("g", "t", ResetMode.EARLIEST, 3002))
    assert f.state.group_offsets("g") == {("t", 0): 0, ("t", 1): 0}
    f(encode_reset_group("g", "t", ResetMode.LATEST, 3003))
    assert f.state.group_offsets("g") == {("t", 0): 3, ("t", 1): 3}
    f(encode_reset_group("g", "t", ResetMode.TIMESTAMP, 3004, 2000))
    assert f.state.group_offsets("g") == {("t", 0): 1, ("t", 1): 1}
    f(encode_topic(CommandKind.DELETE_TOPIC, "t", 3005))
    assert f.state.group_offsets("g") == {}


# -- idempotent producers ------------------------------------------------------------


def test_idempotent_producer_dedup_gap_fence_and_expiry() -> None:
    f = Feed()
    create(f, queues=4)
    reg = f(encode_register_producer(1000))
    assert reg == ProducerResult(1, 0)
    first = ok(produce(f, "t", [b"a", b"b"], producer_id=1, epoch=0, base_seq=0))
    again = ok(produce(f, "t", [b"a", b"b"], producer_id=1, epoch=0, base_seq=0))
    assert again.duplicate and again.acks == first.acks
    assert f.state.stats()["stored_messages"] == 2
    gap = produce(f, "t", [b"c"], producer_id=1, epoch=0, base_seq=5)
    assert isinstance(gap, SequenceGap) and gap.details["expected_sequence"] == 2
    assert isinstance(
        produce(f, "t", [b"c"], producer_id=1, epoch=0, base_seq=1), DuplicateSequence
    )
    ok(produce(f, "t", [b"c"], producer_id=1, epoch=0, base_seq=2))
    # A new epoch fences the old one.
    assert f(encode_register_producer(1001, 1)) == ProducerResult(1, 1)
    fenced = produce(f, "t", [b"d"], producer_id=1, epoch=0, base_seq=3)
    assert isinstance(fenced, ProducerFenced) and fenced.field == "epoch"
    ok(produce(f, "t", [b"d"], producer_id=1, epoch=1, base_seq=0))
    assert isinstance(produce(f, "t", [b"e"], producer_id=9, base_seq=0), UnknownProducer)
    # Expiry uses entry timestamps: idle longer than producer_idle_ms.
    f(encode_retention(1002, producer_idle_ms=5000))
    ok(produce(f, "t", [b"f"], ts=4000, producer_id=1, epoch=1, base_seq=1))
    assert f.state.producer(1) is not None
    r = produce(f, "t", [b"g"], ts=9001 + 1, producer_id=1, epoch=1, base_seq=2)
    assert isinstance(r, UnknownProducer)


def test_idempotent_batch_must_target_one_queue() -> None:
    f = Feed()
    create(f, queues=4)
    f(encode_register_producer(1))
    msgs = [Message(b"a", queue=0), Message(b"b", queue=1)]
    r = f(encode_produce("t", msgs, 1, producer_id=1, base_seq=0))
    assert isinstance(r, InvalidQueue) and r.field == "messages"


def test_sequence_needs_a_producer_id() -> None:
    with pytest.raises(InvalidArgument):
        encode_produce("t", [Message(b"x")], 1, base_seq=0)


# -- retention --------------------------------------------------------------------


def test_retention_by_size_keeps_offsets_and_reports_range() -> None:
    f = Feed()
    create(f, queues=2)
    for i in range(20):
        ok(f(encode_produce("t", [Message(bytes(50), queue=i % 2)], 1000 + i)))
    size = f.state.read("t", 0, 0).messages[0].size
    r = f(encode_retention(2000, max_bytes=size * 6))
    assert not isinstance(r, BrokerError)
    assert f.state.stored_bytes <= size * 6
    info = f.state.topic("t")
    assert [(q.min_offset, q.max_offset) for q in info.queues] == [(7, 10), (7, 10)]
    with pytest.raises(OffsetOutOfRange) as ei:
        f.state.read("t", 0, 3)
    assert (ei.value.min_offset, ei.value.max_offset) == (7, 10)
    assert f.state.read("t", 0, 7).messages[0].queue_offset == 7
    ok(f(encode_produce("t", [Message(bytes(50), queue=0)], 3000)))
    assert f.state.topic("t").queues[0].max_offset == 11


def test_retention_by_age_uses_entry_time() -> None:
    f = Feed()
    create(f, queues=1)
    for i in range(5):
        ok(f(encode_produce("t", [Message(b"x")], 10_000 + i * 1000)))
    f(encode_retention(14_000, max_age_ms=2500))
    assert f.state.topic("t").queues[0].min_offset == 2  # ts 10000, 11000 dropped


def test_retention_compaction_keeps_reads_right() -> None:
    f = Feed()
    create(f, queues=1)
    f(encode_retention(1, max_bytes=100_000))
    for i in range(300):
        ok(f(encode_produce("t", [Message(str(k).encode() * 20) for k in range(10)], 2 + i)))
    q = f.state.topic("t").queues[0]
    assert q.max_offset == 3000 and q.min_offset > 1024
    m = f.state.read("t", 0, q.min_offset).messages[0]
    assert m.queue_offset == q.min_offset and m.body == str(q.min_offset % 10).encode() * 20
    snap = f.state.snapshot()
    assert BrokerState.restore(snap).snapshot() == snap


# -- node state machine ---------------------------------------------------------------


def test_node_state_machine_keeps_records_and_answers() -> None:
    sm = BrokerStateMachine()
    assert sm  # Node uses ``state_machine or LogStateMachine()``
    calls: list[int] = []
    sm.add_listener(lambda: calls.append(1))
    assert isinstance(sm.apply(Entry(1, 1, data=b"raw", pos=0)), int)  # the CRC, as before
    data = encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 1)
    assert not isinstance(sm.apply(Entry(2, 1, data=data, pos=3)), int)
    assert [r[0] for r in sm.records()] == [1, 2] and calls == [1, 1]
    assert sm.broker.topic_names() == ["t"]
