"""Issue 18 pieces that need no cluster: load figures, the default schedule,
the contended workload's roles, the human output of ``check``."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jepsen_like.checkers import check_history
from jepsen_like.checkers.load import load
from jepsen_like.history import History, Writer, parse_history
from jepsen_like.nemesis import REQUIRED, default_schedule, format_schedule, parse_schedule
from jepsen_like.summary import reasons, render, verdict_line
from jepsen_like.workload import Workload

HIST = Path(__file__).parent / "histories"
K = "t/0"


def _history() -> History:
    """Three clients on one key, all in flight at once, then a fault window
    in which one of two ops ends info; one op on another key."""
    buf = io.StringIO()
    w = Writer(buf)
    for p in range(3):
        w.invoke(p, "produce", K, value=f"v{p}", time_ns=10 + p)
    for p in range(3):
        w.ok(p, offset=p, time_ns=100 + p)
    w.invoke(9, "produce", "t/1", value="x", time_ns=50)
    w.ok(9, offset=0, time_ns=60)
    w.nemesis("start", "kill", [1], time_ns=200)
    w.invoke(0, "produce", K, value="a", time_ns=210)
    w.info(0, time_ns=400)
    w.invoke(1, "read", K, offset=0, consistency="linearizable", time_ns=220)
    w.fail(1, time_ns=230)
    w.nemesis("stop", "kill", [1], time_ns=500)
    return parse_history(buf.getvalue().splitlines())


def test_load_counts_overlap_per_key_and_info_in_fault_windows() -> None:
    ld = load(_history())
    assert ld["ops"] == 6
    # First three overlap each other (2 each); the two in the fault window
    # overlap each other (1 each); the other key's op overlaps nothing.
    assert ld["mean_overlap"] == round((2 * 3 + 1 * 2) / 6, 2)
    assert ld["ops_in_faults"] == 2
    assert ld["info_share_in_faults"] == 0.5
    assert ld["in_faults_by_f"] == {"produce": [0, 0, 1], "read": [0, 1, 0]}


def test_the_default_schedule_has_every_required_shape_in_a_seeded_order() -> None:
    kinds = ["kill", "pause", "partition", "clock", "corrupt"]
    a = default_schedule(kinds, random.Random(1))
    b = default_schedule(kinds, random.Random(1))
    assert a == b and sorted(a) == sorted(REQUIRED)
    orders = {tuple(default_schedule(kinds, random.Random(s))) for s in range(1, 6)}
    assert len(orders) > 1
    # A kind that is off (no netns: no partition) or restricted to other shapes drops out.
    some = default_schedule(["kill", "pause"], random.Random(1), {"kill": ["leader"]})
    assert some == [("pause", "leader")]
    assert "round robin over kill,pause" in format_schedule(some, ["kill", "pause"])


def test_schedule_option_parsing() -> None:
    assert parse_schedule("kill:all, pause , clock:step") == [
        ("kill", "all"),
        ("pause", None),
        ("clock", "step"),
    ]
    with pytest.raises(ValueError, match="unknown kill shape"):
        parse_schedule("kill:everything")
    with pytest.raises(ValueError, match="unknown nemesis kind"):
        parse_schedule("flood")


def test_contended_roles_give_each_queue_its_own_clients() -> None:
    wl = Workload.__new__(Workload)
    wl.queues, wl.clients_per_queue, wl.pollers, wl.unordered = 3, 12, 3, 0
    roles = wl.roles()
    for q in range(3):
        mine = [r for r, qq in roles if qq == q and r != "poller"]
        assert len(mine) == 12
        assert mine.count("idempotent") == 2 and mine.count("plain") == 4
        assert mine.count("reader") == 6
    assert [q for r, q in roles if r == "poller"] == [0, 1, 2]
    assert not [r for r, _ in roles if r == "unordered"]
    # A multi-group run adds producers of unordered messages, queue picked per message.
    wl.unordered = 4
    assert [(r, q) for r, q in wl.roles() if r == "unordered"] == [("unordered", None)] * 4


def test_reasons_are_sentences_naming_the_ops() -> None:
    from jepsen_like.history import read_history

    res = check_history(read_history(HIST / "lin_hole_read.jsonl"))
    why = reasons(res)
    assert set(why) == {"linearizable", "queue"}
    assert "read #6 (process 1)" in why["linearizable"][0]
    assert any("offset 2 where 1 belongs" in x for x in why["queue"])
    text = render(res, "h.jsonl")
    assert text.splitlines()[-1] == verdict_line(res, "h.jsonl")
    assert text.splitlines()[-1].startswith("VERDICT INVALID: ")


def test_check_prints_the_table_and_verdict_or_json() -> None:
    cmd = [sys.executable, "-m", "jepsen_like", "check", str(HIST / "queue_lost_write.jsonl")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["checker", "verdict", "summary"]
    assert lines[-1].startswith("VERDICT INVALID: linearizable=valid queue=invalid")
    assert "lost-write" in p.stdout and "was acknowledged at offset 1" in p.stdout
    p = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 1
    assert json.loads(p.stdout)["verdict"] == "invalid"
