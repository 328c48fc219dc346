"""The JSONL history format: Writer round trips, Reader pairing and validation."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jepsen_like.history import (
    SCHEMA_VERSION,
    HistoryError,
    Writer,
    parse_history,
    read_history,
)

HIST = Path(__file__).parent / "histories"
K = "t/0"


def _lines(*records: dict[str, object]) -> list[str]:
    return [json.dumps(r) for r in records]


def _inv(process: int, f: str, index: int, **kw: object) -> dict[str, object]:
    return {
        "type": "invoke",
        "process": process,
        "f": f,
        "key": K,
        "time_ns": index,
        "index": index,
        **kw,
    }


def _done(type_: str, process: int, f: str, index: int, **kw: object) -> dict[str, object]:
    return {"type": type_, "process": process, "f": f, "time_ns": index, "index": index, **kw}


def test_writer_reader_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    clock = iter(range(100, 10_000, 10))
    with Writer(path, metadata={"run": "x"}, clock=lambda: next(clock)) as w:
        w.invoke(0, "produce", K, value="a", producer_id=7, sequence=0)
        w.invoke(1, "read", K, offset=0, consistency="linearizable", limit=5)
        w.ok(0, offset=0)
        w.ok(1, value=[[0, "a"]])
        w.nemesis("start", "partition", ["n1", "n2"])
        w.invoke(0, "produce", K, value="b")
        w.info(0, error="timeout")
        w.nemesis("stop", "partition", ["n1", "n2"])
        w.invoke(2, "produce", K, value="c")  # never completed
    h = read_history(path)
    assert h.header["version"] == SCHEMA_VERSION and h.header["run"] == "x"
    assert [(op.f, op.status, op.value) for op in h.ops] == [
        ("produce", "ok", "a"),
        ("read", "ok", None),
        ("produce", "info", "b"),
        ("produce", "info", "c"),
    ]
    a, r, b, c = h.ops
    assert (a.offset, a.producer_id, a.sequence, a.invoke_ns, a.complete_ns) == (0, 7, 0, 100, 120)
    assert r.results == ((0, "a"),) and r.consistency == "linearizable" and r.limit == 5
    assert r.reached_end  # fewer than the limit came back: the log ends there
    assert b.error == "timeout" and b.complete_ns is not None
    assert c.complete_ns is None and c.complete_index is None
    (fault,) = h.faults
    assert (fault.kind, fault.targets, fault.start_ns, fault.stop_ns) == (
        "partition",
        ("n1", "n2"),
        140,
        170,
    )


def test_writer_continues_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with Writer(path) as w:
        w.invoke(0, "produce", K, value="a", time_ns=1)
        w.ok(0, offset=0, time_ns=2)
    with Writer(path) as w:
        rec = w.invoke(0, "produce", K, value="b", time_ns=3)
        w.fail(0, time_ns=4)
    assert rec["index"] == 2
    text = path.read_text().splitlines()
    assert sum(1 for line in text if '"header"' in line) == 1
    assert [op.status for op in read_history(path).ops] == ["ok", "fail"]


def test_writer_refuses_two_outstanding_ops_and_orphan_completions() -> None:
    w = Writer(io.StringIO())
    w.invoke(0, "produce", K, value="a")
    with pytest.raises(ValueError, match="outstanding"):
        w.invoke(0, "produce", K, value="b")
    w.ok(0, offset=0)
    with pytest.raises(ValueError, match="no outstanding"):
        w.ok(0, offset=1)
    with pytest.raises(ValueError, match="unknown f"):
        w.invoke(1, "delete", K)


def test_completion_fields_override_invoke_and_unfinished_is_info() -> None:
    h = parse_history(
        _lines(
            _inv(0, "read", 0, offset=3, consistency="linearizable"),
            _done("ok", 0, "read", 1, value=[]),
            _inv(1, "poll", 2, group="g"),
        )
    )
    read, poll = h.ops
    assert read.status == "ok" and read.results == () and read.reached_end
    assert poll.status == "info" and poll.results == ()


def test_header_is_optional_and_blank_lines_are_skipped() -> None:
    h = parse_history(["", *_lines(_inv(0, "produce", 0, value=1)), "   "])
    assert h.header == {} and h.ops[0].value == 1


def test_fixtures_parse() -> None:
    files = sorted(HIST.glob("*.jsonl"))
    assert files
    for path in files:
        h = read_history(path)
        assert h.ops, path.name


MALFORMED = [
    ("not json", ['{"type": "invoke",'], 1, "not valid JSON"),
    ("not an object", ["[1, 2]"], 1, "JSON object"),
    ("unknown type", _lines({"type": "oops", "time_ns": 0, "index": 0}), 1, "unknown record type"),
    ("missing time", _lines({"type": "invoke", "index": 0}), 1, "time_ns"),
    ("bool index", _lines({"type": "invoke", "time_ns": 0, "index": True}), 1, "index"),
    (
        "index goes back",
        _lines(_inv(0, "produce", 5, value="a"), _done("ok", 0, "produce", 4, offset=0)),
        2,
        "not greater",
    ),
    ("negative process", _lines(_inv(-1, "produce", 0, value="a")), 1, "process"),
    ("unknown f", _lines(_inv(0, "delete", 0)), 1, "unknown f"),
    ("produce without value", _lines(_inv(0, "produce", 0)), 1, "needs 'value'"),
    ("read without offset", _lines(_inv(0, "read", 0)), 1, "needs 'offset'"),
    (
        "bad consistency",
        _lines(_inv(0, "read", 0, offset=0, consistency="eventual")),
        1,
        "consistency",
    ),
    (
        "double invoke",
        _lines(_inv(0, "produce", 0, value="a"), _inv(0, "produce", 1, value="b")),
        2,
        "outstanding",
    ),
    (
        "orphan completion",
        _lines(_done("ok", 0, "produce", 0, offset=0)),
        1,
        "without an outstanding invoke",
    ),
    ("f mismatch", _lines(_inv(0, "produce", 0, value="a"), _done("ok", 0, "read", 1)), 2, "f="),
    (
        "ok produce without offset",
        _lines(_inv(0, "produce", 0, value="a"), _done("ok", 0, "produce", 1)),
        2,
        "offset",
    ),
    (
        "completion before invoke",
        _lines(
            _inv(0, "produce", 5, value="a"),
            {"type": "ok", "process": 0, "f": "produce", "offset": 0, "time_ns": 1, "index": 6},
        ),
        2,
        "before its invoke",
    ),
    (
        "bad result pair",
        _lines(_inv(0, "read", 0, offset=0), _done("ok", 0, "read", 1, value=[[0]])),
        2,
        "result #0",
    ),
    (
        "result not a list",
        _lines(_inv(0, "poll", 0), _done("ok", 0, "poll", 1, value="x")),
        2,
        "list of",
    ),
    (
        "bad version",
        _lines({"type": "header", "schema": "jepsen_like.history", "version": 99}),
        1,
        "unsupported history version",
    ),
    (
        "late header",
        _lines(_inv(0, "produce", 0, value="a"), {"type": "header", "version": 1}),
        2,
        "first record",
    ),
    (
        "nemesis stop without start",
        _lines(
            {
                "type": "nemesis",
                "f": "stop",
                "kind": "kill",
                "targets": ["n1"],
                "time_ns": 0,
                "index": 0,
            }
        ),
        1,
        "without a start",
    ),
    (
        "unknown nemesis kind",
        _lines(
            {
                "type": "nemesis",
                "f": "start",
                "kind": "flood",
                "targets": [],
                "time_ns": 0,
                "index": 0,
            }
        ),
        1,
        "kind",
    ),
]


@pytest.mark.parametrize(
    ("lines", "line", "fragment"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_reader_rejects_malformed_lines_naming_the_line(
    lines: list[str], line: int, fragment: str
) -> None:
    with pytest.raises(HistoryError) as err:
        parse_history(lines)
    assert err.value.line == line
    assert f"line {line}:" in str(err.value)
    assert fragment in str(err.value)


def test_reader_reports_missing_file_and_bad_encoding(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="cannot read"):
        read_history(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(HistoryError, match="not UTF-8"):
        read_history(bad)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=4,
)
_field_values = {
    "type": st.sampled_from(["invoke", "ok", "fail", "info", "nemesis", "header"]) | _json,
    "process": st.integers(0, 2) | _json,
    "f": st.sampled_from(["produce", "read", "poll", "seek", "start", "stop"]) | _json,
    "key": st.just(K) | _json,
    "value": st.sampled_from(["a", 1, [[0, "a"]], []]) | _json,
    "offset": st.integers(0, 2) | _json,
    "consistency": st.sampled_from(["linearizable", "committed"]) | _json,
    "kind": st.sampled_from(["kill", "pause"]) | _json,
    "targets": st.just(["n1"]) | _json,
    "version": st.just(1) | _json,
    "limit": st.integers(1, 3) | _json,
    "end": st.booleans() | _json,
    "time_ns": st.integers(0, 5) | _json,
}


@st.composite
def _records(draw: st.DrawFn) -> list[str]:
    lines = []
    for i in range(draw(st.integers(1, 6))):
        names = draw(st.lists(st.sampled_from(sorted(_field_values)), unique=True))
        rec = {name: draw(_field_values[name]) for name in names}
        rec.setdefault("index", i)
        lines.append(json.dumps(rec))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=5)))
    return lines


@settings(max_examples=300, deadline=None)
@given(_records())
def test_reader_never_raises_anything_but_history_error(lines: list[str]) -> None:
    try:
        parse_history(lines)
    except HistoryError as e:
        assert e.line >= 1
