"""The produce parser's inline path for the common message shape
(``{"value": ...}`` plus at most ``encoding``) must accept and refuse exactly
what the general parser does, with the same error and field. No cluster."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from broker_adapter.errors import BrokerError
from http_api.app import _parse_message, parse_messages

SETTINGS = settings(max_examples=400, deadline=None)

_b64 = st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
_b64ish = st.text(alphabet="ABCDab01+/=\n -_é", max_size=12)
_values = st.one_of(_b64, _b64ish, st.text(max_size=20), st.none(), st.integers(), st.binary())
_encodings = st.sampled_from(["utf-8", "base64", "UTF-8", "", "latin-1", None, 5, ["utf-8"]])
_extras = st.dictionaries(
    st.sampled_from(
        ["keys", "key", "tags", "tag", "properties", "queue", "sharding_key", "born_ts_ms", "x"]
    ),
    st.one_of(st.none(), st.integers(-2, 2000), st.text(max_size=3), st.lists(st.text(max_size=2))),
    max_size=2,
)


@st.composite
def _message(draw: st.DrawFn) -> object:
    shape = draw(st.integers(0, 5))
    if shape == 0:  # not an object at all
        return draw(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.none())))
    m: dict[str, Any] = {}
    if shape != 1:  # shape 1: no value
        m["value"] = draw(_values)
    if shape in (3, 4, 5):
        m["encoding"] = draw(_encodings)
    if shape in (2, 5):
        m.update(draw(_extras))
    return m


def _outcome(fn: Any, *args: Any) -> tuple[str, object]:
    try:
        return "ok", fn(*args)
    except BrokerError as exc:
        return "refused", (type(exc).__name__, str(exc), exc.to_dict())
    except Exception as exc:  # a crash must at least be the same crash
        return "raised", (type(exc).__name__, str(exc))


@SETTINGS
@given(st.lists(_message(), min_size=1, max_size=4))
def test_inline_and_general_parsers_agree(msgs: list[object]) -> None:
    fast = _outcome(parse_messages, msgs)
    now = 1_700_000_000_000
    if fast[0] == "ok":
        # A message without born_ts_ms is born at the request's time: give
        # the general parser the time the inline path used.
        rows = fast[1]
        assert isinstance(rows, list)
        for m, row in zip(msgs, rows, strict=True):
            if isinstance(m, dict) and "born_ts_ms" not in m:
                now = row[6]

    def general(ms: list[object]) -> list[object]:
        return [_parse_message(m, k, now) for k, m in enumerate(ms)]

    assert fast == _outcome(general, msgs)


def test_common_shapes_parse_to_plain_rows() -> None:
    rows = parse_messages(
        [
            {"value": "aGk="},
            {"value": "hi", "encoding": "utf-8"},
            {"value": "aGk=", "encoding": "base64"},
        ]
    )
    assert [r[0] for r in rows] == [b"hi", b"hi", b"hi"]
    assert all(r[1:6] == ("", (), (), None, None) for r in rows)
    assert len({r[6] for r in rows}) == 1  # one arrival time per request


def test_refusals_name_the_field() -> None:
    cases: list[tuple[object, str]] = [
        ({"value": "a=b="}, "messages[1].value"),
        ({"value": "é"}, "messages[1].value"),
        ({"value": "aGk=", "encoding": "utf8"}, "messages[1].encoding"),
        ({"value": 5}, "messages[1].value"),
        ({"value": "aGk=", "tags": 3}, "messages[1].tags"),
        ("x", "messages[1]"),
    ]
    for bad, field in cases:
        outcome = _outcome(parse_messages, [{"value": "aGk="}, bad])
        assert outcome[0] == "refused", bad
        assert outcome[1][2]["field"] == field  # type: ignore[index]


@settings(max_examples=1000, deadline=None)
@given(st.one_of(_b64, _b64ish, st.text(max_size=12)))
def test_strict_a2b_base64_is_b64decode_validate(s: str) -> None:
    """The parsers call binascii.a2b_base64(strict_mode=True) directly; it
    must accept and refuse what base64.b64decode(validate=True) does."""
    try:
        want: bytes | None = base64.b64decode(s, validate=True)
    except ValueError:
        want = None
    try:
        got: bytes | None = binascii.a2b_base64(s, strict_mode=True)
    except ValueError:
        got = None
    assert got == want


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"value": _b64},
            optional={
                "tags": st.text(max_size=3),
                "properties": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=3),
                "queue": st.integers(0, 3),
            },
        ),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 7),
)
def test_stepwise_parse_and_encode_give_the_same_entry(msgs: list[object], step: int) -> None:
    """Parsing and encoding a batch in slices (yielding to the loop between
    them) gives the same rows and the same entry bytes as in one go."""
    import asyncio

    from broker_adapter import codec
    from http_api.app import encode_produce_stepwise, parse_messages_stepwise

    limits = codec.Limits()
    rows = parse_messages(msgs, now=7)

    async def stepwise() -> bytes:
        got = await parse_messages_stepwise(msgs, limits, 10_000, step)
        assert [r[:6] for r in got] == [r[:6] for r in rows]  # born: the clock
        return await encode_produce_stepwise(
            "t", rows, 5, producer_id=0, epoch=0, base_seq=-1, auto_create_queues=0,
            limits=limits, step=step,
        )  # fmt: skip

    assert asyncio.run(stepwise()) == codec.encode_produce_rows("t", rows, 5, limits=limits)


# -- the schema's shortcut for plain messages ---------------------------------


def _checked(compiler: Any, body: object, yield_every: int = 512) -> tuple[str, object]:
    import asyncio

    from http_api.schema import check_body

    ref = {"$ref": "#/components/schemas/ProduceRequest"}
    return _outcome(lambda: asyncio.run(check_body(compiler, ref, body, yield_every)) or "ok")


@SETTINGS
@given(_message())
def test_plain_message_says_yes_only_to_what_the_schema_accepts(m: object) -> None:
    from http_api.openapi import plain_message, request_schemas
    from http_api.schema import Compiler

    walk = Compiler(request_schemas()).checker({"$ref": "#/components/schemas/MessageIn"})
    if plain_message(m):
        walk(m, "messages[0]")  # raises if the schema refuses it


@SETTINGS
@given(st.lists(_message(), min_size=1, max_size=6), st.sampled_from([2, 512]))
def test_the_check_with_and_without_the_shortcut_agrees(msgs: list[object], every: int) -> None:
    """Same verdict, same error and field, on every body: in one go and in
    slices (a batch above ``yield_every`` is checked item by item)."""
    from http_api.openapi import QUICK, request_schemas
    from http_api.schema import Compiler

    quick, walk = Compiler(request_schemas(), QUICK), Compiler(request_schemas())
    body = {"messages": msgs}
    assert _checked(quick, body, every) == _checked(walk, body, every)


def test_the_shortcut_skips_the_walk_of_plain_messages() -> None:
    """Not a cosmetic: the item checker is not called for a plain message,
    and still is for the rest (which it refuses with their field)."""
    from http_api.openapi import QUICK, request_schemas
    from http_api.schema import Compiler

    c = Compiler(request_schemas(), QUICK)
    walked: list[object] = []
    real = c.ref("MessageIn")

    def spy(v: object, path: str) -> None:
        walked.append(v)
        real(v, path)

    c._refs["MessageIn"] = spy
    plain = [{"value": "aGk="}, {"value": "hi", "encoding": "utf-8"}] * 3
    assert _checked(c, {"messages": plain}) == ("ok", "ok")
    assert walked == []
    got = _checked(c, {"messages": [*plain, {"value": "x", "encodng": "utf-8"}]})
    assert got[0] == "refused" and got[1][2]["field"] == "messages[6].encodng"  # type: ignore[index]
    assert walked == [{"value": "x", "encodng": "utf-8"}]
