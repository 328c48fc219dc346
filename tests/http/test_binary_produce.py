"""The binary produce body (``application/vnd.dledger.batch``): the records
a client encodes are checked (CRC, layout, the JSON path's caps) and
proposed as they are. What must hold: the entry is byte for byte what the
JSON path makes of the same messages; every corruption or cap violation is
a 422 naming the message, by the express lane and by aiohttp's path alike;
the clients send it and fall back to JSON where a node answers 415."""

from __future__ import annotations

import asyncio
import base64
import random
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from broker_adapter import codec
from broker_adapter.codec import BATCH_CONTENT_TYPE, BATCH_HEAD_SIZE, Limits, MessageRow
from broker_adapter.errors import InvalidArgument, MalformedCommand
from http_api.client import AsyncClient, Client, OutMessage
from tests.http.onenode import serve_one_node
from tests.http.test_edges import _cfg
from tests.http.test_express import Conn, api_of

BORN = 1_700_000_000_000
SEED = random.randrange(1 << 30)


def row(body: bytes = b"v", **kw: Any) -> MessageRow:
    return (
        body,
        kw.get("tag", ""),
        tuple(kw.get("keys", ())),
        tuple(sorted(kw.get("props", {}).items())),
        kw.get("queue"),
        kw.get("shard"),
        kw.get("born", BORN),
    )


def check(raw: bytes, limits: Limits = codec.DEFAULT_LIMITS) -> codec.BatchHead:
    """What the leader checks of a body: head, records, nothing after them."""
    head = codec.batch_head(raw)
    pos, _props = codec.check_batch_records(raw, BATCH_HEAD_SIZE, 0, head.count, limits)
    if pos != len(raw):
        raise InvalidArgument("bytes after the records", field="messages")
    return head


def recrc(rec: bytes) -> bytes:
    return rec[:4] + struct.pack(">I", zlib.crc32(rec[8:])) + rec[8:]


def batch_of(records: list[bytes], count: int | None = None, pid: int = 0, seq: int = -1) -> bytes:
    n = len(records) if count is None else count
    return struct.pack(">4sQIqI", b"DLB1", pid, 0, seq, n) + b"".join(records)


def random_row(rng: random.Random) -> MessageRow:
    def s(n: int) -> str:
        return "".join(rng.choice("abcé漢_-") for _ in range(rng.randrange(n)))

    return row(
        rng.randbytes(rng.randrange(300)),
        tag=s(6) if rng.random() < 0.4 else "",
        keys=[s(5) for _ in range(rng.randrange(3))],
        props={s(4): s(8) for _ in range(rng.randrange(4))},
        queue=rng.randrange(8) if rng.random() < 0.3 else None,
        shard=s(6) or None if rng.random() < 0.3 else None,
        born=rng.randrange(1 << 62),
    )


# -- the codec ------------------------------------------------------------------------
def test_a_binary_batch_is_the_json_path_s_entry_byte_for_byte() -> None:
    rng = random.Random(SEED)
    for _ in range(200):
        rows = [random_row(rng) for _ in range(rng.randrange(1, 20))]
        raw = codec.encode_batch(rows)
        # the encoder's fast path gives the bytes of its general one
        assert raw[BATCH_HEAD_SIZE:] == b"".join(
            codec._encode_row(r, codec.DEFAULT_LIMITS, 0) for r in rows
        ), f"seed {SEED}"
        head = check(raw)
        assert head.count == len(rows), f"seed {SEED}"
        via_json = codec.encode_produce_rows("t", rows, 5)
        via_binary = codec.assemble_produce("t", head.count, [raw[BATCH_HEAD_SIZE:]], 5)
        assert via_binary == via_json, f"seed {SEED}"


def test_idempotent_fields_travel_in_the_head() -> None:
    head = check(codec.encode_batch([row()], producer_id=7, epoch=3, sequence=41))
    assert (head.producer_id, head.epoch, head.sequence, head.count) == (7, 3, 41, 1)
    with pytest.raises(InvalidArgument) as e:
        codec.batch_head(batch_of([], pid=7, seq=-1))
    assert e.value.field == "sequence"


def test_every_flipped_bit_of_a_record_is_refused() -> None:
    raw = codec.encode_batch([row(b"hello", tag="t", keys=["k"], props={"a": "b"}), row(b"x")])
    for i in range(BATCH_HEAD_SIZE, len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            with pytest.raises(InvalidArgument) as e:
                check(bytes(bad))
            assert e.value.field.startswith("messages"), (i, bit, e.value.field)


def _refusal(raw: bytes, limits: Limits = codec.DEFAULT_LIMITS) -> str:
    with pytest.raises(InvalidArgument) as e:
        check(raw, limits)
    return str(e.value.field)


def test_bad_heads_and_counts_are_refused_naming_the_field() -> None:
    one = codec.encode_records([row()])[0:3]
    rec = b"".join(one)
    assert _refusal(b"") == "body"
    assert _refusal(b"DLB1" + b"\0" * 10) == "body"
    assert _refusal(b"XXXX" + batch_of([rec])[4:]) == "body"
    assert _refusal(batch_of([rec], count=2)) == "messages[1]"  # fewer records than announced
    assert _refusal(batch_of([rec, rec], count=1)) == "messages"  # bytes after them
    assert _refusal(batch_of([rec[:-1]])) == "messages[0]"  # truncated
    assert _refusal(batch_of([rec + b"\0"], count=1)) == "messages"


def _rec(r: MessageRow) -> bytes:
    return b"".join(codec.encode_records([r]))


def _patched(rec: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(rec)
    struct.pack_into(fmt, b, at, value)
    return recrc(bytes(b))


def test_records_with_a_right_crc_but_a_wrong_layout_are_refused() -> None:
    plain = _rec(row(b"abc"))
    # version, born, queue (offsets 8, 9, 17 of the record)
    assert _refusal(batch_of([_patched(plain, 8, ">B", 2)])) == "messages[0]"
    assert _refusal(batch_of([_patched(plain, 9, ">q", -1)])) == "messages[0].born_ts_ms"
    assert _refusal(batch_of([_patched(plain, 17, ">i", codec.MAX_QUEUES)])) == "messages[0].queue"
    assert _refusal(batch_of([_patched(plain, 17, ">i", -2)])) == "messages[0].queue"
    # a body length that disagrees with the record's
    assert _refusal(batch_of([_patched(plain, len(plain) - 7, ">I", 2)])) == "messages[0]"
    # bytes after the body, length and CRC made right
    longer = recrc(struct.pack(">I", len(plain) + 2) + plain[4:] + b"zz")
    assert _refusal(batch_of([longer])) == "messages[0]"
    # a tag that is not UTF-8
    tagged = _rec(row(b"abc", tag="ab"))
    bad_utf8 = recrc(tagged.replace(b"\x00\x02ab", b"\x00\x02\xff\xfe", 1))
    assert _refusal(batch_of([bad_utf8])) == "messages[0].tags"
    # properties out of order, or a key twice
    props = _rec(row(b"abc", props={"a": "1", "b": "2"}))
    swapped = recrc(props.replace(b"\x00\x01a\x00\x011\x00\x01b\x00\x012",
                                  b"\x00\x01b\x00\x012\x00\x01a\x00\x011", 1))  # fmt: skip
    twice = recrc(props.replace(b"\x00\x01b\x00\x012", b"\x00\x01a\x00\x012", 1))
    assert _refusal(batch_of([swapped])) == "messages[0].properties"
    assert _refusal(batch_of([twice])) == "messages[0].properties"


def canonical_record(rec: bytes, limits: Limits) -> bool:
    """The reference the checker is held to: ``rec`` is exactly what the
    JSON path's encoder makes of the message it holds (decoded, encoded
    again, compared)."""
    try:
        r = codec.decode_record(rec)
        if not 0 <= r.born_ts_ms < 1 << 62 or list(r.properties) != sorted(r.properties):
            return False
        if len({key for key, _ in r.properties}) != len(r.properties):
            return False
        queue = None if r.queue == -1 else r.queue
        again: MessageRow = (r.body, r.tag, r.keys, r.properties, queue,
                             r.sharding_key or None, r.born_ts_ms)  # fmt: skip
        return codec._encode_row(again, limits, 0) == rec
    except (MalformedCommand, InvalidArgument):  # InvalidQueue, MessageTooLarge, ...
        return False


def _mutate(rng: random.Random, rec: bytes) -> bytes:
    """A record changed at random, its length field (mostly) and CRC made
    right again: what a careful but wrong encoder could send."""
    b = bytearray(rec)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(8, len(b))
        if op == 0:
            b[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[at] = rng.choice((0, 1, 2, 0x7F, 0x80, 0xC3, 0xFF))
        elif op == 2:
            b[at:at] = bytes(rng.randrange(1, 4))
        elif op == 3 and len(b) > 34:
            del b[at : at + rng.randrange(1, 3)]
        else:  # a field length one off
            fld = rng.choice((21, 23))
            if len(b) > fld + 1:
                n = struct.unpack_from(">H", b, fld)[0]
                struct.pack_into(">H", b, fld, min(65535, max(0, n + rng.choice((-1, 1)))))
    if rng.random() < 0.9:
        struct.pack_into(">I", b, 0, len(b))
    return recrc(bytes(b))


def test_the_fast_checks_agree_with_decoding_and_encoding_again() -> None:
    """check_batch_records accepts a record exactly when decoding it and
    encoding the message again gives the same bytes (canonical_record),
    over random records and random damage to them, under two sets of caps."""
    rng = random.Random(SEED)
    small = Limits(max_message_bytes=200, max_keys=2, max_properties=2, max_string_bytes=4)
    accepted = refused = 0
    for i in range(6000):
        limits = small if i % 3 == 0 else codec.DEFAULT_LIMITS
        rec = _rec(random_row(rng))
        if rng.random() < 0.8:
            rec = _mutate(rng, rec)
        try:
            check(batch_of([rec]), limits)
            ok = True
        except (InvalidArgument, codec.MessageTooLarge):
            ok = False
        assert ok == canonical_record(rec, limits), f"seed {SEED}, case {i}: {rec!r}"
        accepted += ok
        refused += not ok
    assert accepted > 500 and refused > 500, (accepted, refused)


def test_the_json_path_s_caps_hold() -> None:
    small = Limits(max_message_bytes=10, max_keys=1, max_properties=1, max_string_bytes=3)
    assert _refusal(batch_of([_rec(row(b"x" * 11))]), small) == "messages[0].value"
    assert _refusal(batch_of([_rec(row(keys=["a", "b"]))]), small) == "messages[0].keys"
    two = {"a": "1", "b": "2"}
    assert _refusal(batch_of([_rec(row(props=two))]), small) == "messages[0].properties"
    assert _refusal(batch_of([_rec(row(tag="abcd"))]), small) == "messages[0].tags"
    check(batch_of([_rec(row(b"x" * 10, tag="abc", keys=["k"]))]), small)  # at the caps


# -- over HTTP -------------------------------------------------------------------------
HEAD = (
    b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
    + BATCH_CONTENT_TYPE.encode()
)


def request(body: bytes, extra: bytes = b"") -> bytes:
    return HEAD + b"\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve_one_node(_cfg(tmp_path)) as c:
        assert (await c.post("/v1/topics", json={"name": "t", "queues": 2})).status == 201
        yield c


async def read_all(c: TestClient[Any, Any], queue: int) -> list[dict[str, Any]]:
    r = await c.get(f"/v1/topics/t/queues/{queue}/messages?offset=0&max_messages=100")
    assert r.status == 200
    msgs: list[dict[str, Any]] = (await r.json())["messages"]
    return msgs


# the lane, and aiohttp's path (a header field the lane does not take)
PATHS = {"lane": b"", "aiohttp": b"X-Trace: 1\r\n"}


@pytest.mark.parametrize("path", PATHS)
async def test_a_binary_batch_is_stored_as_sent(client: TestClient[Any, Any], path: str) -> None:
    rows = [
        row(b"\x00\xffbinary", tag="tg", keys=["k1", "k2"], props={"a": "1", "z": "2"}, queue=1),
        row(b"plain", queue=1),
        row(b"sharded", shard="s1", queue=1),
    ]
    before = api_of(client).express_answers
    conn = await Conn.open(client)
    try:
        await conn.send(request(codec.encode_batch(rows), PATHS[path]))
        st, _, doc = await conn.answer()
    finally:
        conn.close()
    assert st == 200, doc
    assert [(m["queue"], m["queue_offset"]) for m in doc["messages"]] == [(1, 0), (1, 1), (1, 2)]
    assert api_of(client).express_answers - before == (1 if path == "lane" else 0)
    got = await read_all(client, 1)
    assert [base64.b64decode(m["value"]) for m in got] == [b"\x00\xffbinary", b"plain", b"sharded"]
    assert got[0]["tags"] == "tg" and got[0]["keys"] == ["k1", "k2"]
    assert got[0]["properties"] == {"a": "1", "z": "2"} and got[0]["born_ts_ms"] == BORN


@pytest.mark.parametrize("path", PATHS)
async def test_a_bad_binary_batch_is_422_and_nothing_is_stored(
    client: TestClient[Any, Any], path: str
) -> None:
    good = codec.encode_batch([row(b"a", queue=0), row(b"b", queue=0)])
    flipped = bytearray(good)
    flipped[-1] ^= 1  # the second record's last byte: its CRC fails
    too_many = batch_of([_rec(row(props={f"p{i}": "v" for i in range(64)}))] * 300)
    cases: list[tuple[bytes, int, str]] = [
        (bytes(flipped), 422, "messages[1]"),
        (good[:-3], 422, "messages[1]"),
        (b"{}", 422, "body"),
        (batch_of([], count=0), 422, "messages"),
        (too_many, 422, "messages"),  # max_batch_properties (16,384)
    ]
    conn = await Conn.open(client)
    try:
        for body, status, field in cases:
            await conn.send(request(body, PATHS[path]))
            st, _, doc = await conn.answer()
            assert (st, doc["error"]["field"]) == (status, field), doc
        await conn.send(request(codec.encode_batch([row(b"after", queue=0)]), PATHS[path]))
        assert (await conn.answer())[0] == 200  # the connection stays
    finally:
        conn.close()
    assert [base64.b64decode(m["value"]) for m in await read_all(client, 0)] == [b"after"]


async def test_unknown_topic_and_other_routes(client: TestClient[Any, Any]) -> None:
    body = codec.encode_batch([row()])
    hdr = {"Content-Type": BATCH_CONTENT_TYPE}
    r = await client.post("/v1/topics/nope/messages", data=body, headers=hdr)
    assert r.status == 404 and (await r.json())["error"]["code"] == "UNKNOWN_TOPIC"
    r = await client.post("/v1/topics", data=body, headers=hdr)  # takes JSON only
    assert r.status == 415 and (await r.json())["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    doc = await (await client.get("/openapi.json")).json()
    content = doc["paths"]["/v1/topics/{topic}/messages"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", BATCH_CONTENT_TYPE}


async def test_an_idempotent_binary_batch_sent_twice_is_stored_once(
    client: TestClient[Any, Any],
) -> None:
    reg = await (await client.post("/v1/producers", json={})).json()
    body = codec.encode_batch(
        [row(b"once", queue=0)], producer_id=reg["producer_id"], epoch=reg["epoch"], sequence=0
    )
    hdr = {"Content-Type": BATCH_CONTENT_TYPE}
    first = await (await client.post("/v1/topics/t/messages", data=body, headers=hdr)).json()
    again = await (await client.post("/v1/topics/t/messages", data=body, headers=hdr)).json()
    assert again["messages"][0]["duplicate"] is True
    assert again["messages"][0]["queue_offset"] == first["messages"][0]["queue_offset"]
    assert len(await read_all(client, 0)) == 1


async def test_the_clients_send_binary_and_read_back_what_they_sent(
    client: TestClient[Any, Any],
) -> None:
    addr = f"127.0.0.1:{client.server.port}"
    msgs = [OutMessage(b"one", tags="x", keys=["k"], properties={"b": "2", "a": "1"}, queue=1),
            OutMessage(b"two", queue=1)]  # fmt: skip
    before = api_of(client).express_answers
    async with AsyncClient([addr]) as ac:
        acks = await ac.produce("t", msgs)
        assert ac.binary
    sync = Client([addr])
    acks += await asyncio.to_thread(sync.produce, "t", [OutMessage(b"three", queue=1)])
    assert sync.binary and api_of(client).express_answers - before == 2
    assert [a.queue_offset for a in acks] == [0, 1, 2]
    got = await read_all(client, 1)
    assert [base64.b64decode(m["value"]) for m in got] == [b"one", b"two", b"three"]
    assert got[0]["properties"] == {"a": "1", "b": "2"} and got[0]["keys"] == ["k"]


async def test_the_clients_fall_back_to_json_where_a_node_answers_415(tmp_path: Path) -> None:
    """A broker group's node takes JSON only (its agent routes each message):
    the clients resend as JSON once refused, and stay on JSON."""
    from broker_adapter.codec import BATCH_CONTENT_TYPE as BATCH
    from http_api.errors import BATCH_REFUSED, UnsupportedMediaType, error_response
    from http_api.server import PRODUCE_HOOKS

    refused: list[str] = []

    @web.middleware
    async def agent(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.content_type == BATCH:
            refused.append("aiohttp")
            return error_response(UnsupportedMediaType(BATCH_REFUSED))
        return await handler(request)

    def compose(app: web.Application) -> None:
        app.middlewares.append(agent)
        hook: Callable[[str, dict[str, Any]], None] = lambda topic, body: None  # noqa: E731
        app[PRODUCE_HOOKS] = {agent: hook}

    async with serve_one_node(_cfg(tmp_path), compose) as c:
        assert (await c.post("/v1/topics", json={"name": "t", "queues": 1})).status == 201
        addr = f"127.0.0.1:{c.server.port}"
        async with AsyncClient([addr]) as ac:
            await ac.produce("t", [b"a"])  # the lane refuses (a hook is on)
            assert not ac.binary
            await ac.produce("t", [b"b"])
        sync = Client([addr])
        await asyncio.to_thread(sync.produce, "t", [b"c"])
        assert not sync.binary
        values = [base64.b64decode(m["value"]) for m in await read_all(c, 0)]
        assert values == [b"a", b"b", b"c"]
