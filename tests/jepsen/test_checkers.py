"""Checkers on hand-written and generated histories with known anomalies."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jepsen_like.checkers import check, check_history, linearizable, queue, recovery
from jepsen_like.checkers.__main__ import main
from jepsen_like.checkers.linearizable import LinConfig
from jepsen_like.checkers.recovery import RecoveryConfig, percentile
from jepsen_like.history import History, Operation, Writer, parse_history

HIST = Path(__file__).parent / "histories"
K = "orders/0"
LIN = "linearizable"
MS = 1_000_000


def build(fn: Callable[[Writer], None]) -> History:
    buf = io.StringIO()
    fn(Writer(buf))
    return parse_history(buf.getvalue().splitlines())


def lin_key(h: History, key: str = K, **cfg: Any) -> dict[str, Any]:
    result = linearizable.check(h, LinConfig(**cfg))
    return dict(result["keys"][key])


# --------------------------------------------------------------------------- fixtures


FIXTURES = {
    # name: (overall, linearizable, queue anomalies)
    "valid": ("valid", "valid", set()),
    "lin_future_read": ("invalid", "invalid", set()),
    "lin_stale_read": ("invalid", "invalid", {"stale-read"}),
    "lin_same_offset": ("invalid", "invalid", {"inconsistent-offsets"}),
    "lin_info_needed": ("valid", "valid", set()),
    "queue_lost_write": ("invalid", "valid", {"lost-write", "inconsistent-offsets"}),
    "queue_duplicate": ("invalid", "valid", {"duplicate"}),
    "queue_inconsistent_offsets": ("invalid", "valid", {"inconsistent-offsets"}),
    "queue_aborted_read": ("invalid", "valid", {"aborted-read"}),
    "queue_polls": ("invalid", "valid", {"poll-skip", "nonmonotonic-poll"}),
    "queue_unseen": ("invalid", "valid", {"unseen"}),
    "lin_end_false": ("invalid", "invalid", set()),
    "lin_end_false_info": ("valid", "valid", set()),
    "lin_hole_read": ("invalid", "invalid", {"non-contiguous-read"}),
}


def test_every_fixture_is_covered() -> None:
    assert {p.stem for p in HIST.glob("*.jsonl")} == set(FIXTURES)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_verdicts(name: str) -> None:
    overall, lin, anomalies = FIXTURES[name]
    result = check(HIST / f"{name}.jsonl")
    assert result["verdict"] == overall
    assert result["checkers"]["linearizable"]["verdict"] == lin
    assert set(result["checkers"]["queue"]["anomaly_types"]) == anomalies
    assert result["checkers"]["recovery"]["verdict"] == "valid"


# --------------------------------------------------------------------------- linearizability


def _window_shape(res: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(op["f"], op.get("value", op.get("results"))) for op in res["window"]]


def test_read_before_its_append_was_invoked_is_not_linearizable() -> None:
    res = lin_key(parse_history((HIST / "lin_future_read.jsonl").read_text().splitlines()))
    assert res["verdict"] == "invalid"
    assert _window_shape(res) == [("read", [[0, "x"]]), ("produce", "x")]


def test_read_missing_a_completed_append_is_not_linearizable() -> None:
    res = lin_key(parse_history((HIST / "lin_stale_read.jsonl").read_text().splitlines()))
    assert res["verdict"] == "invalid"
    assert res["stuck_at"]["f"] == "read"
    assert _window_shape(res) == [("produce", "a"), ("read", [])]


def test_two_appends_acknowledged_at_one_offset_are_not_linearizable() -> None:
    res = lin_key(parse_history((HIST / "lin_same_offset.jsonl").read_text().splitlines()))
    assert res["verdict"] == "invalid"
    assert sorted(op["value"] for op in res["window"]) == ["a", "b"]


def test_end_false_bounds_the_log_from_below() -> None:
    res = lin_key(parse_history((HIST / "lin_end_false.jsonl").read_text().splitlines()))
    assert res["verdict"] == "invalid"
    assert "no order of the operations fits" in res["explanation"]
    assert "end=false" in res["explanation"]
    # An info produce invoked before the read returned may be the entry it saw past its result.
    ok = lin_key(parse_history((HIST / "lin_end_false_info.jsonl").read_text().splitlines()))
    assert ok["verdict"] == "valid"


def test_end_false_needs_the_entry_before_the_read_returns() -> None:
    def hist(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.ok(0, offset=0, time_ns=10)
        w.invoke(1, "read", K, offset=0, consistency=LIN, limit=1, time_ns=20)
        w.ok(1, value=[[0, "a"]], end=False, time_ns=30)
        w.invoke(0, "produce", K, value="b", time_ns=40)  # too late to be the "more"
        w.ok(0, offset=1, time_ns=50)

    assert lin_key(build(hist))["verdict"] == "invalid"

    def concurrent(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.ok(0, offset=0, time_ns=10)
        w.invoke(2, "produce", K, value="b", time_ns=15)
        w.invoke(1, "read", K, offset=0, consistency=LIN, limit=1, time_ns=20)
        w.ok(1, value=[[0, "a"]], end=False, time_ns=30)
        w.ok(2, offset=1, time_ns=50)

    assert lin_key(build(concurrent))["verdict"] == "valid"


def test_an_empty_result_that_says_there_is_more_is_impossible() -> None:
    def hist(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.invoke(1, "read", K, offset=0, consistency=LIN, limit=4, time_ns=20)
        w.ok(1, value=[], end=False, time_ns=30)
        w.ok(0, offset=0, time_ns=40)

    res = lin_key(build(hist))
    assert res["verdict"] == "invalid"
    assert res["states"] == 0  # decided without a search


def test_a_result_with_a_hole_is_invalid_in_every_state() -> None:
    res = lin_key(parse_history((HIST / "lin_hole_read.jsonl").read_text().splitlines()))
    assert res["verdict"] == "invalid"
    assert res["states"] == 0
    assert "offset 2 follows 0" in res["explanation"]
    assert _window_shape(res) == [("read", [[0, "a"], [2, "c"]])]


def test_a_result_not_starting_at_the_requested_offset_is_invalid() -> None:
    def hist(w: Writer) -> None:
        for k, v in enumerate("abc"):
            w.invoke(0, "produce", K, value=v, time_ns=10 * k)
            w.ok(0, offset=k, time_ns=10 * k + 5)
        w.invoke(1, "read", K, offset=1, consistency=LIN, limit=8, time_ns=40)
        w.ok(1, value=[[2, "c"]], end=True, time_ns=50)
        w.invoke(2, "read", K, offset=0, consistency="committed", limit=8, time_ns=40)
        w.ok(2, value=[[1, "b"], [0, "a"]], end=True, time_ns=50)

    h = build(hist)
    res = lin_key(h)
    assert res["verdict"] == "invalid"
    assert "starts at offset 2, not at the requested 1" in res["explanation"]
    q = queue.check(h)
    # The committed read is out of the linearizability check, but the queue checker sees both.
    assert q["counts"]["non-contiguous-read"] == 2


def _info_needed(status: str) -> History:
    text = (HIST / "lin_info_needed.jsonl").read_text()
    return parse_history(text.replace('"type":"info"', f'"type":"{status}"').splitlines())


def test_an_info_append_makes_an_otherwise_impossible_history_linearizable() -> None:
    assert lin_key(_info_needed("info"))["verdict"] == "valid"
    bad = lin_key(_info_needed("fail"))
    assert bad["verdict"] == "invalid"
    # A failed produce did not happen, so nothing explains offset 1 ...
    assert queue.check(_info_needed("fail"))["anomaly_types"] == ["aborted-read"]


def test_an_info_append_may_take_effect_long_after_its_invoke() -> None:
    def hist(w: Writer) -> None:
        w.invoke(9, "produce", K, value="late", time_ns=0)  # never completes
        w.invoke(0, "read", K, offset=0, consistency=LIN, time_ns=10)
        w.ok(0, value=[], time_ns=20)
        w.invoke(1, "produce", K, value="a", time_ns=30)
        w.ok(1, offset=0, time_ns=40)
        w.invoke(0, "read", K, offset=0, consistency=LIN, time_ns=50)
        w.ok(0, value=[[0, "a"]], time_ns=60)
        w.invoke(0, "read", K, offset=0, consistency=LIN, time_ns=1000)
        w.ok(0, value=[[0, "a"], [1, "late"]], time_ns=1010)

    assert lin_key(build(hist))["verdict"] == "valid"


def test_info_that_never_happens_is_fine_but_cannot_happen_twice() -> None:
    def hist(w: Writer) -> None:
        w.invoke(9, "produce", K, value="x", time_ns=0)
        w.info(9, time_ns=5)
        w.invoke(0, "read", K, offset=0, consistency=LIN, time_ns=10)
        w.ok(0, value=[[0, "x"]], time_ns=20)
        w.invoke(0, "read", K, offset=0, consistency=LIN, limit=5, time_ns=30)
        w.ok(0, value=[[0, "x"], [1, "x"]], time_ns=40)

    res = lin_key(build(hist))
    assert res["verdict"] == "invalid"
    assert "no subset fails on its own" in res["note"]


def test_reads_that_only_constrain_the_length() -> None:
    def hist(end_value: bool) -> History:
        def fn(w: Writer) -> None:
            w.invoke(0, "produce", K, value="a", time_ns=0)
            w.ok(0, offset=0, time_ns=5)
            w.invoke(0, "produce", K, value="b", time_ns=10)
            w.ok(0, offset=1, time_ns=15)
            w.invoke(1, "read", K, offset=0, consistency=LIN, time_ns=20)
            w.ok(1, value=[[0, "a"]], end=end_value, time_ns=25)

        return build(fn)

    assert lin_key(hist(False))["verdict"] == "valid"
    assert lin_key(hist(True))["verdict"] == "invalid"  # claims the log ends at 0


def test_committed_reads_do_not_take_part() -> None:
    text = (HIST / "lin_stale_read.jsonl").read_text().replace('"linearizable"', '"committed"')
    h = parse_history(text.splitlines())
    res = lin_key(h)
    assert res["verdict"] == "valid" and res["ops"] == 1
    assert queue.check(h)["verdict"] == "valid"  # a committed read may lag


def test_keys_are_checked_independently() -> None:
    def hist(w: Writer) -> None:
        for key, read in (("a/0", [[0, "a0"]]), ("b/0", [[0, "zz"]])):
            p = 0 if key == "a/0" else 2
            w.invoke(p, "produce", key, value=f"{key[0]}0", time_ns=0)
            w.ok(p, offset=0, time_ns=10)
            w.invoke(p + 1, "read", key, offset=0, consistency=LIN, time_ns=20)
            w.ok(p + 1, value=read, time_ns=30)

    result = linearizable.check(build(hist))
    assert result["verdict"] == "invalid"
    assert result["invalid_keys"] == ["b/0"]
    assert result["keys"]["a/0"]["verdict"] == "valid"


def test_closed_world_violation_has_no_open_window() -> None:
    def hist(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.ok(0, offset=0, time_ns=10)
        w.invoke(0, "produce", K, value="c", time_ns=20)
        w.ok(0, offset=2, time_ns=30)

    res = lin_key(build(hist))
    assert res["verdict"] == "invalid"
    assert "window" not in res and "closed-world" in res["note"]


def _explosive(w: Writer) -> None:
    """21 concurrent info appends, 20 of them of two read (so not interchangeable)
    values, and a read that no order can satisfy: z cannot reach offset 24.
    About 2**20 configurations to rule out; the queue checker sees nothing."""
    for p in range(20):
        w.invoke(p, "produce", K, value="x" if p % 2 else "y", time_ns=p)
    w.invoke(20, "produce", K, value="z", time_ns=20)
    for p, (offset, value) in enumerate([(0, "x"), (1, "y"), (24, "z")], start=100):
        w.invoke(p, "read", K, offset=offset, consistency=LIN, time_ns=100 + p)
        w.ok(p, value=[[offset, value]], time_ns=300 + p)


def test_a_spent_state_budget_gives_unknown_not_a_guess() -> None:
    res = lin_key(build(_explosive), max_states=2000)
    assert res["verdict"] == "unknown"
    assert "state budget" in res["reason"] and "window" not in res
    overall = check_history(build(_explosive), lin=LinConfig(max_states=2000))
    assert overall["verdict"] == "unknown"


def test_a_spent_time_budget_gives_unknown() -> None:
    res = lin_key(build(_explosive), max_seconds=0.0)
    assert res["verdict"] == "unknown" and "time budget" in res["reason"]


# --------------------------------------------------------------------------- generated


@dataclass
class GenOp:
    process: int
    f: str
    invoke_ns: int
    complete_ns: int | None
    status: str  # ok | fail | info (completion type; "open": never completed)
    value: str | None = None
    offset: int | None = None
    results: list[list[Any]] = field(default_factory=list)
    consistency: str = LIN
    limit: int | None = None
    took_effect: bool = False


@st.composite
def sequential_histories(draw: st.DrawFn) -> list[GenOp]:
    """A real sequential log, each op given a random window around its point."""
    log: list[str] = []
    ops: list[GenOp] = []
    for i in range(draw(st.integers(1, 12))):
        point = i * 100 + 50
        inv = point - draw(st.integers(0, 350))
        comp = point + draw(st.integers(0, 350))
        if draw(st.booleans()):
            kind = draw(st.sampled_from(["ok", "ok", "ok", "info", "open", "lost", "fail"]))
            op = GenOp(i, "produce", inv, comp, kind, value=f"v{i}")
            if kind in ("ok", "info", "open"):
                op.took_effect = True
                if kind == "ok":
                    op.offset = len(log)
                log.append(f"v{i}")
            if kind == "lost":
                op.status = "info"
            ops.append(op)
        else:
            offset = draw(st.integers(0, len(log) + 1))
            limit = draw(st.sampled_from([None, 1, 2, 3]))
            consistency = draw(st.sampled_from([LIN, LIN, LIN, "committed"]))
            status = draw(st.sampled_from(["ok", "ok", "ok", "ok", "info", "fail"]))
            if limit is None:
                res = [[offset, log[offset]]] if offset < len(log) else []
            else:
                res = [[o, log[o]] for o in range(offset, min(len(log), offset + limit))]
            ops.append(
                GenOp(
                    i,
                    "read",
                    inv,
                    comp,
                    status,
                    offset=offset,
                    limit=limit,
                    results=res if status == "ok" else [],
                    consistency=consistency,
                )
            )
    return ops


def to_history(ops: list[GenOp], final_log: list[str] | None = None) -> History:
    events: list[tuple[int, int, dict[str, Any]]] = []
    for op in ops:
        inv: dict[str, Any] = {"type": "invoke", "process": op.process, "f": op.f, "key": K}
        if op.f == "produce":
            inv["value"] = op.value
        else:
            inv.update(offset=op.offset, consistency=op.consistency)
            if op.limit is not None:
                inv["limit"] = op.limit
        events.append((op.invoke_ns, 0, inv))
        if op.status == "open":
            continue
        done: dict[str, Any] = {"type": op.status, "process": op.process, "f": op.f}
        if op.f == "produce" and op.status == "ok":
            done["offset"] = op.offset
        if op.f == "read" and op.status == "ok":
            done["value"] = op.results
        events.append((op.complete_ns or op.invoke_ns, 1, done))
    if final_log is not None:
        end = max(t for t, _, _ in events) + 1000
        events.append(
            (
                end,
                0,
                {"type": "invoke", "process": 10_000, "f": "final_read", "key": K, "offset": 0},
            )
        )
        events.append(
            (
                end + 1,
                1,
                {
                    "type": "ok",
                    "process": 10_000,
                    "f": "final_read",
                    "value": [[i, v] for i, v in enumerate(final_log)],
                },
            )
        )
    events.sort(key=lambda e: (e[0], e[1]))
    lines = []
    for index, (t, _, rec) in enumerate(events):
        lines.append(json.dumps({**rec, "time_ns": t, "index": index}))
    return parse_history(lines)


def _final_log(ops: list[GenOp]) -> list[str]:
    return [op.value for op in ops if op.f == "produce" and op.took_effect and op.value]


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(sequential_histories())
def test_generated_histories_from_a_real_log_are_valid(ops: list[GenOp]) -> None:
    h = to_history(ops, _final_log(ops))
    assert lin_key(h)["verdict"] == "valid"
    q = queue.check(h)
    assert q["verdict"] == "valid", q["examples"]


def _corruptible(ops: list[GenOp]) -> list[int]:
    return [
        i
        for i, op in enumerate(ops)
        if op.f == "read" and op.status == "ok" and op.consistency == LIN and op.results
    ]


@st.composite
def corrupted_histories(draw: st.DrawFn) -> tuple[list[GenOp], int, bool]:
    """(ops, index of the corrupted read, whether the corruption is observable)."""
    ops = draw(sequential_histories().filter(lambda o: bool(_corruptible(o))))
    i = draw(st.sampled_from(_corruptible(ops)))
    read = ops[i]
    j = draw(st.integers(0, len(read.results) - 1))
    at = read.results[j][0]
    others = [op for op in ops if op.f == "produce" and op.status == "ok" and op.offset != at]
    kind = draw(st.sampled_from(["fresh", "swap", "empty"] if others else ["fresh", "empty"]))
    results = [list(r) for r in read.results]
    if kind == "fresh":
        results[j][1] = "never-written"
        observable = True
    elif kind == "swap":
        other = draw(st.sampled_from(others))
        results[j][1] = other.value
        observable = True
    else:
        results = []
        start = read.offset if read.offset is not None else 0
        observable = any(
            op.f == "produce"
            and op.status == "ok"
            and op.offset is not None
            and op.offset >= start
            and op.complete_ns is not None
            and op.complete_ns < read.invoke_ns
            for op in ops
        )
    ops = [*ops[:i], replace(read, results=results), *ops[i + 1 :]]
    return ops, i, observable


@PROPS
@given(corrupted_histories())
def test_an_observable_corrupted_read_is_never_valid(case: tuple[list[GenOp], int, bool]) -> None:
    ops, i, observable = case
    h = to_history(ops)
    res = lin_key(h)
    tight = lin_key(h, max_states=3, shrink=False)["verdict"]
    if observable:
        assert res["verdict"] == "invalid"
        assert tight in ("invalid", "unknown")
    if res["verdict"] == "invalid" and "window" in res:
        # Everything but the corrupted read is linearizable, so every failing
        # window must contain it.
        assert any(w["f"] == "read" and w["process"] == ops[i].process for w in res["window"])


def _read_fits(read: Operation, log: list[Any]) -> bool:
    """The log model's read rule, stated on its own: the result is the log's
    contiguous run from the requested offset, up to its end when the read says
    so (``reached_end``) or when it is empty, and ``end=false`` means an entry
    past the result."""
    start = read.offset if read.offset is not None else 0
    want = [(off, log[off]) for off in range(start, len(log))]
    got = list(read.results)
    if got != want[: len(got)]:
        return False
    if read.end is False and len(want) <= len(got):
        return False
    # An empty result means nothing at the offset yet, whatever ``end`` says.
    return not ((read.reached_end or not got) and len(want) > len(got))


def brute_force_linearizable(ops: list[Operation]) -> bool:
    """The log model by exhaustion: every subset of info appends, every order."""
    parts = linearizable.participants(ops)
    done = [p for p in parts if p.ret is not None]
    maybe = [p for p in parts if p.ret is None]
    for r in range(len(maybe) + 1):
        for extra in itertools.combinations(maybe, r):
            chosen = [*done, *extra]
            for order in itertools.permutations(chosen):
                pos = {id(o): i for i, o in enumerate(order)}
                if any(
                    a.ret is not None and a.ret < b.call and pos[id(a)] > pos[id(b)]
                    for a in chosen
                    for b in chosen
                ):
                    continue
                log: list[Any] = []
                for o in order:
                    if o.append:
                        if o.offset is not None and len(log) != o.offset:
                            break
                        log.append(o.value)
                    elif not _read_fits(o.src, log):
                        break
                else:
                    return True
    return False


@st.composite
def small_random_histories(draw: st.DrawFn) -> list[Operation]:
    """Arbitrary (mostly non-linearizable) histories over few values and offsets,
    with duplicate values, conflicting reads and every completion type."""
    ops: list[Operation] = []
    for i in range(draw(st.integers(1, 6))):
        inv = draw(st.integers(0, 30))
        comp = inv + draw(st.integers(0, 15))
        if draw(st.booleans()):
            status = draw(st.sampled_from(["ok", "ok", "info", "open", "fail"]))
            ops.append(
                Operation(
                    id=i,
                    process=i,
                    f="produce",
                    key=K,
                    status="info" if status == "open" else status,  # type: ignore[arg-type]
                    invoke_ns=inv,
                    complete_ns=None if status == "open" else comp,
                    invoke_index=i,
                    complete_index=None,
                    value=draw(st.sampled_from("abc")),
                    offset=draw(st.integers(0, 3)) if status == "ok" else None,
                )
            )
        else:
            start = draw(st.integers(0, 2))
            pool = [o.value for o in ops if o.value is not None] or ["a"]
            n = draw(st.integers(0, 2))
            ops.append(
                Operation(
                    id=i,
                    process=i,
                    f="read",
                    key=K,
                    status="ok",
                    invoke_ns=inv,
                    complete_ns=comp,
                    invoke_index=i,
                    complete_index=None,
                    offset=start,
                    results=tuple((start + j, draw(st.sampled_from(pool))) for j in range(n)),
                    consistency=LIN,
                    limit=draw(st.sampled_from([None, 1, 2, 3])),
                    end=draw(st.sampled_from([None, True, False])),
                )
            )
    return ops


@settings(max_examples=300, deadline=None)
@given(small_random_histories())
def test_search_agrees_with_brute_force(ops: list[Operation]) -> None:
    expected = "valid" if brute_force_linearizable(ops) else "invalid"
    assert linearizable.check_key(K, ops).verdict == expected


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(small_random_histories(), st.lists(st.booleans(), min_size=6, max_size=6))
def test_no_window_of_a_linearizable_history_fails(ops: list[Operation], keep: list[bool]) -> None:
    """The shrinker's relaxed model is weaker than the real one: a window it
    reports as failing is a real explanation."""
    assume(brute_force_linearizable(ops))
    parts = linearizable.participants(ops)
    window = [p for p, k in zip(parts, keep, strict=False) if k]
    assert linearizable._relaxed_check(window, parts, 100_000, None) != "invalid"


# --------------------------------------------------------------------------- queue


def test_queue_examples_name_the_ops() -> None:
    q = queue.check(parse_history((HIST / "queue_lost_write.jsonl").read_text().splitlines()))
    assert q["counts"]["lost-write"] == 1
    (ex,) = q["examples"]["lost-write"]
    assert (ex["value"], ex["offset"], ex["final_max_offset"]) == ("b", 1, 2)
    polls = queue.check(parse_history((HIST / "queue_polls.jsonl").read_text().splitlines()))
    assert polls["counts"]["poll-skip"] == 1 and polls["counts"]["nonmonotonic-poll"] == 1
    assert polls["examples"]["poll-skip"][0]["expected"] == 2
    assert polls["examples"]["nonmonotonic-poll"][0]["got"] == 2


def test_queue_examples_are_capped_but_counts_are_not() -> None:
    def hist(w: Writer) -> None:
        for i in range(30):
            w.invoke(0, "produce", K, value=f"v{i}", time_ns=2 * i)
            w.ok(0, offset=i, time_ns=2 * i + 1)
        w.invoke(1, "final_read", K, offset=0, time_ns=100)
        w.ok(1, value=[], time_ns=101)

    q = queue.check(build(hist), queue.QueueConfig(max_examples=3))
    assert q["counts"]["unseen"] == 30 and len(q["examples"]["unseen"]) == 3


def test_an_info_poll_forgets_the_position_and_reads_at_the_limit_are_not_stale() -> None:
    def hist(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.ok(0, offset=0, time_ns=1)
        w.invoke(0, "produce", K, value="b", time_ns=2)
        w.ok(0, offset=1, time_ns=3)
        w.invoke(1, "poll", K, time_ns=4)
        w.ok(1, value=[[0, "a"]], time_ns=5)
        w.invoke(1, "poll", K, time_ns=6)
        w.info(1, time_ns=7)
        w.invoke(1, "poll", K, time_ns=8)
        w.ok(1, value=[[5, "f"]], time_ns=9)
        w.invoke(2, "read", K, offset=0, consistency=LIN, limit=1, time_ns=10)
        w.ok(2, value=[[0, "a"]], time_ns=11)

    assert queue.check(build(hist))["verdict"] == "valid"


def test_lost_and_unseen_need_final_reads() -> None:
    def hist(w: Writer) -> None:
        w.invoke(0, "produce", K, value="a", time_ns=0)
        w.ok(0, offset=0, time_ns=1)

    q = queue.check(build(hist))
    assert q["verdict"] == "valid" and q["final_reads"] is False


# --------------------------------------------------------------------------- recovery


def _fault_history(recover: bool, idle_gap_ms: int = 0) -> History:
    def hist(w: Writer) -> None:
        t = 0
        for i in range(5):  # steady state, one op every 100 ms
            w.invoke(0, "produce", K, value=f"a{i}", time_ns=t)
            w.ok(0, offset=i, time_ns=t + 2 * MS)
            t += 100 * MS
        t += idle_gap_ms * MS
        w.nemesis("start", "partition", ["n1"], time_ns=t)
        w.invoke(0, "produce", K, value="b0", time_ns=t + 10 * MS)
        w.info(0, error="timeout", time_ns=t + 1010 * MS)
        w.invoke(0, "produce", K, value="b1", time_ns=t + 1020 * MS)
        w.fail(0, error="NO_LEADER", time_ns=t + 1030 * MS)
        w.nemesis("stop", "partition", ["n1"], time_ns=t + 1500 * MS)
        if recover:
            w.invoke(0, "produce", K, value="c", time_ns=t + 1600 * MS)
            w.ok(0, offset=5, time_ns=t + 1610 * MS)

    return build(hist)


def test_rto_is_measured_per_fault_window() -> None:
    r = recovery.check(_fault_history(recover=True))
    assert r["verdict"] == "valid" and r["unavailability"] == []
    (w,) = r["windows"]
    assert w["kind"] == "partition" and w["duration_ms"] == 1500.0
    assert w["by_f"]["produce"] == {
        "impacted": True,
        "rto_ms": 1600.0,
        "recovered": True,
        "first_failure_index": 11,
    }
    assert r["max_rto_ms"] == 1600.0
    assert r["latency"]["produce"]["count"] == 6 and r["latency"]["produce"]["p50_ms"] == 2.0
    buckets = r["timeline"]["buckets"]
    assert sum(b["f"].get("produce", {}).get("ok", 0) for b in buckets) == 6
    assert buckets[0]["f"]["produce"]["ok_per_s"] == 5.0  # 5 ok in the first second


def test_an_unrecovered_window_is_invalid() -> None:
    r = recovery.check(_fault_history(recover=False))
    assert r["verdict"] == "invalid" and r["unrecovered_windows"] == 1
    assert r["windows"][0]["by_f"]["produce"]["recovered"] is False
    assert (
        recovery.check(_fault_history(recover=False), RecoveryConfig(fail_on_unrecovered=False))[
            "verdict"
        ]
        == "valid"
    )


def test_unavailability_outside_fault_windows_is_invalid() -> None:
    r = recovery.check(_fault_history(recover=True, idle_gap_ms=5000))
    assert r["verdict"] == "invalid"
    (gap,) = r["unavailability"]
    assert 5000 <= gap["duration_ms"] <= 5100


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None


_OUTCOMES: list[Literal["ok", "fail", "info"]] = ["ok", "ok", "fail", "info"]
_pairs = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from(["a", "b", "c", 1])).map(list), max_size=3
)


@st.composite
def arbitrary_histories(draw: st.DrawFn) -> History:
    """Any well-formed history: random ops, outcomes, results and faults."""
    buf = io.StringIO()
    w = Writer(buf)
    t = 0
    outstanding: dict[int, str] = {}
    open_faults: list[str] = []
    for _ in range(draw(st.integers(0, 25))):
        t += draw(st.integers(0, 3)) * 400 * MS
        p = draw(st.integers(0, 3))
        if draw(st.integers(0, 9)) == 0:
            stop = draw(st.booleans())
            if open_faults and stop:
                w.nemesis("stop", open_faults.pop(0), ["n1"], time_ns=t)
            else:
                kind = draw(st.sampled_from(["kill", "pause", "partition", "clock", "corrupt"]))
                open_faults.append(kind)
                w.nemesis("start", kind, ["n1"], time_ns=t)
        elif p in outstanding:
            f = outstanding.pop(p)
            outcome = draw(st.sampled_from(_OUTCOMES))
            fields: dict[str, Any] = {}
            if outcome == "ok" and f == "produce":
                fields["offset"] = draw(st.integers(0, 4))
            if outcome == "ok" and f in ("read", "final_read", "poll"):
                fields["value"] = draw(_pairs)
                fields["end"] = draw(st.sampled_from([None, True, False]))
            w.complete(outcome, p, time_ns=t, **fields)
        else:
            f = draw(st.sampled_from(["produce", "read", "poll", "seek", "final_read"]))
            key = draw(st.sampled_from(["a/0", "b/0"]))
            fields = {}
            if f == "produce":
                fields["value"] = draw(st.sampled_from(["a", "b", "c", 1]))
            else:
                fields["offset"] = draw(st.integers(0, 3))
                fields["consistency"] = draw(st.sampled_from([LIN, "committed"]))
                fields["limit"] = draw(st.sampled_from([None, 1, 2]))
            w.invoke(p, f, key, time_ns=t, **fields)
            outstanding[p] = f
    return parse_history(buf.getvalue().splitlines())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arbitrary_histories())
def test_checkers_decide_any_well_formed_history(h: History) -> None:
    result = check_history(h, lin=LinConfig(max_states=20_000))
    assert result["verdict"] in ("valid", "invalid", "unknown")
    for name, res in result["checkers"].items():
        assert res["verdict"] in ("valid", "invalid", "unknown"), name
    json.dumps(result)


# --------------------------------------------------------------------------- CLI


def test_cli_prints_json_and_exits_by_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(HIST / "valid.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "valid"
    assert main([str(HIST / "queue_duplicate.jsonl"), "--no-timeline"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "invalid" and "timeline" not in out["checkers"]["recovery"]


def test_cli_exits_2_on_unknown_and_3_on_a_malformed_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "h.jsonl"
    with Writer(path) as w:
        _explosive(w)
    assert main([str(path), "--max-states", "500"]) == 2
    assert json.loads(capsys.readouterr().out)["verdict"] == "unknown"
    bad_line = len(path.read_text().splitlines()) + 1
    with path.open("a") as fh:
        fh.write("{oops\n")
    assert main([str(path)]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "error" and out["line"] == bad_line


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jepsen_like.checkers", str(HIST / "lin_stale_read.jsonl")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["checkers"]["linearizable"]["invalid_keys"] == [K]


# --------------------------------------------------------------------------- generated at scale


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_multi_key_histories_with_info_ops_are_valid(seed: int) -> None:
    from jepsen_like.bench import generate

    h = parse_history(generate(3000, keys=4, info=0.2, concurrency=8, seed=seed))
    assert sum(op.status == "info" for op in h.ops) > 300
    res = linearizable.check(h, LinConfig(max_seconds=None))
    assert res["verdict"] == "valid", res["invalid_keys"]
    assert queue.check(h)["verdict"] == "valid"


@pytest.mark.parametrize("seed", [1, 2])
def test_one_corrupted_read_in_a_generated_history_is_found(seed: int) -> None:
    from jepsen_like.bench import generate

    lines = generate(2000, keys=4, info=0.1, concurrency=8, seed=seed)
    recs = [json.loads(x) for x in lines]
    # Change the value of one ok read result that is not the last one of its op.
    victim = next(
        r for r in recs[len(recs) // 2 :] if r["type"] == "ok" and r["f"] == "read" and r["value"]
    )
    victim["value"][0][1] = "never-written"
    h = parse_history(json.dumps(r) for r in recs)
    res = linearizable.check(h, LinConfig(max_seconds=None))
    assert res["verdict"] == "invalid"
    bad = res["keys"][res["invalid_keys"][0]]
    assert bad["window"] is not None and len(bad["window"]) <= 4, bad


def test_a_group_offset_read_back_below_an_acknowledged_commit_is_a_regression() -> None:
    def hist(read_back: int) -> History:
        def fn(w: Writer) -> None:
            w.invoke(1, "commit_offset", K, offset=12, group="g", time_ns=10)
            w.ok(1, time_ns=20)
            w.invoke(1, "commit_offset", K, offset=20, group="g", time_ns=30)
            w.info(1, time_ns=40)  # may or may not have landed
            w.invoke(1, "seek", K, offset=0, group="g", time_ns=50)
            w.ok(1, offset=read_back, time_ns=60)

        return build(fn)

    assert queue.check(hist(12))["verdict"] == "valid"
    assert queue.check(hist(20))["verdict"] == "valid"
    q = queue.check(hist(7))
    assert q["anomaly_types"] == ["offset-regression"]
    assert q["examples"]["offset-regression"][0]["committed"] == 12


def test_two_acks_with_the_same_completion_time_and_offset_are_reported_not_a_crash() -> None:
    """The stale-read scan sorts acknowledged writes by completion time and
    offset; a tie on both (two values acknowledged at one offset) must be
    reported as inconsistent offsets, not crash on comparing operations."""

    def hist(w: Writer) -> None:
        w.invoke(1, "produce", K, value="a", time_ns=10)
        w.invoke(2, "produce", K, value="b", time_ns=11)
        w.ok(1, offset=0, time_ns=20)
        w.ok(2, offset=0, time_ns=20)
        w.invoke(0, "read", K, offset=0, consistency=LIN, time_ns=30)
        w.ok(0, value=[[0, "a"]], time_ns=40)

    result = queue.check(build(hist))  # raised TypeError before the fix
    assert result["verdict"] == "invalid"
    assert result["counts"]["inconsistent-offsets"] == 1
