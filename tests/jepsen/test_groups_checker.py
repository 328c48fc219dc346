"""The multi-group checker (jepsen_like.checkers.groups) on hand-built histories.

Layout of every history here: controller nodes 1-3, group g1 nodes 4-6
owning queues 0 and 2, group g2 nodes 7-9 owning queues 1 and 3; process
100 is an unordered producer, the others keep their queue.
"""

from __future__ import annotations

import io
from typing import Any

from jepsen_like.checkers import check_history
from jepsen_like.checkers import groups as groups_checker
from jepsen_like.history import History, Writer, parse_history
from jepsen_like.summary import render

MS = 1_000_000
LAYOUT: dict[str, Any] = {
    "groups": {"g1": [4, 5, 6], "g2": [7, 8, 9]},
    "controller": [1, 2, 3],
    "queue_groups": {"0": "g1", "1": "g2", "2": "g1", "3": "g2"},
    "unordered_processes": [100],
}
UNORDERED = 100


class Ops:
    """Builds a history: produces every 100 ms on queue 0 (process 10, g1) and
    queue 1 (process 11, g2) unless silenced, and the faults given."""

    def __init__(self, layout: dict[str, Any] | None = None) -> None:
        self.buf = io.StringIO()
        self.w = Writer(self.buf, metadata=dict(LAYOUT if layout is None else layout))
        self.n = 0

    def produce(
        self, process: int, q: int, t_ms: int, status: str = "ok", error: str | None = None
    ) -> None:
        self.n += 1
        value = f"v{self.n}"
        self.w.invoke(process, "produce", f"jepsen/{q}", value=value, time_ns=t_ms * MS)
        fields: dict[str, Any] = {"offset": self.n} if status == "ok" else {"error": error}
        self.w.complete(status, process, time_ns=(t_ms + 5) * MS, **fields)  # type: ignore[arg-type]

    def steady(self, until_ms: int, silent: dict[int, tuple[int, int]] | None = None) -> None:
        """Queue 0 and 1 produce every 100 ms; ``silent``: queue -> (from, to) ms."""
        silent = silent or {}
        for t in range(0, until_ms, 100):
            for proc, q in ((10, 0), (11, 1)):
                lo, hi = silent.get(q, (-1, -1))
                if not lo <= t < hi:
                    self.produce(proc, q, t)

    def fault(self, kind: str, targets: list[int], start_ms: int, stop_ms: int) -> None:
        self.w.nemesis("start", kind, targets, time_ns=start_ms * MS)
        self.w.nemesis("stop", kind, targets, time_ns=stop_ms * MS)

    def history(self) -> History:
        # Records were appended out of time order (faults after ops): sort by time.
        import json

        lines = self.buf.getvalue().splitlines()
        head, rest = lines[0], [json.loads(x) for x in lines[1:]]
        rest.sort(key=lambda r: (r["time_ns"], r["index"]))
        for k, r in enumerate(rest):
            r["index"] = k
        return parse_history([head, *(json.dumps(r) for r in rest)])


def test_a_group_that_stalls_while_the_controller_is_down_is_invalid() -> None:
    """Routes are cached: nothing on the produce path needs the controller,
    so a group's gap during a controller outage is not excused."""
    b = Ops()
    b.fault("kill", [2, 3], 3000, 7000)
    b.steady(10_000, silent={1: (3000, 7500)})  # g2 stops producing
    res = groups_checker.check(b.history())
    assert res["verdict"] == "invalid"
    assert res["groups"]["g1"]["verdict"] == "valid"
    assert res["groups"]["g2"]["verdict"] == "invalid"
    assert res["groups"]["g2"]["unavailability"], res["groups"]["g2"]
    (ctl,) = [o for o in res["outages"] if o["group"] == "controller"]
    assert ctl["produces"]["ok"] > 0
    # ... while the service-wide recovery checker sees no gap (g1 went on).
    assert check_history(b.history())["checkers"]["recovery"]["unavailability"] == []


def test_a_fault_in_one_group_excuses_no_gap_in_another() -> None:
    b = Ops()
    b.fault("kill", [4, 5], 3000, 6000)  # g1's majority
    b.steady(10_000, silent={0: (3000, 6200), 1: (3000, 6200)})
    res = groups_checker.check(b.history())
    assert res["groups"]["g1"]["verdict"] == "valid"  # its own outage covers it
    assert res["groups"]["g2"]["verdict"] == "invalid"


def test_whole_group_outage_availability_and_clean_ordered_failures() -> None:
    b = Ops()
    b.steady(3000)
    b.fault("kill", [4, 5, 6], 3000, 6000)
    # The unordered producer: one refusal from g1, then it moves to g2's queues.
    b.produce(UNORDERED, 0, 3100, "fail", "connect: [Errno 111] Connect call failed")
    for t in range(3200, 6000, 100):
        b.produce(UNORDERED, 1 if t % 200 else 3, t)
    # Ordered produces to g1's queue fail, with documented errors only.
    b.produce(10, 0, 3100, "fail", "connect: [Errno 111] Connect call failed")
    b.produce(10, 2, 3400, "fail", "503 NO_LEADER")
    b.produce(10, 0, 3700, "info", "timeout")
    b.produce(10, 2, 4000, "info", "ServerDisconnectedError: Server disconnected")
    b.produce(11, 1, 3300, "ok")
    for t in range(6200, 9000, 100):
        b.produce(10, 0, t)
        b.produce(11, 1, t)
    res = groups_checker.check(b.history())
    assert res["verdict"] == "valid", res
    (out,) = [o for o in res["outages"] if o["group"] == "g1"]
    assert out["unordered"] == {"invoked": 29, "ok": 28}
    assert res["unordered_availability"] == round(28 / 29, 4)
    assert res["naive_availability"] == 0.5
    assert out["ordered_on_dead_group"] == {"ok": 0, "fail": 2, "info": 2}
    text = render({"verdict": res["verdict"], "checkers": {"groups": res}})
    assert "acknowledged (28/29; never moving: 50%)" in text


def test_an_ordered_produce_failing_with_a_500_is_an_unclean_failure() -> None:
    b = Ops()
    b.steady(3000)
    b.fault("pause", [7, 8], 3000, 5000)  # g2's majority
    b.produce(11, 1, 3100, "info", "500 INTERNAL")
    b.produce(11, 3, 3300, "fail", "421 WRONG_GROUP")
    for t in range(5200, 8000, 100):
        b.produce(10, 0, t)
        b.produce(11, 1, t)
    res = groups_checker.check(b.history())
    assert res["verdict"] == "invalid"
    assert res["unclean_count"] == 1
    assert res["unclean_ordered_failures"][0]["error"] == "500 INTERNAL"
    why = render({"verdict": "invalid", "checkers": {"groups": res}})
    assert "not a documented refusal" in why


def test_clean_failure_rules() -> None:
    ok = ["503 NO_LEADER", "504 OUTCOME_UNKNOWN", "429 OVERLOADED", "421 WRONG_GROUP"]
    ok += ["timeout", "connect: [Errno 111] refused", "ClientOSError: reset", "no response"]
    bad = ["500 INTERNAL", "502 PARTIALLY_WRITTEN", "400 BAD_REQUEST", "bad ok body"]
    assert all(groups_checker.clean_failure(e) for e in ok)
    assert not any(groups_checker.clean_failure(e) for e in bad)


def test_a_single_group_history_has_no_groups_checker() -> None:
    b = Ops(layout={})
    b.steady(2000)
    assert "groups" not in check_history(b.history())["checkers"]
    b2 = Ops()
    b2.steady(2000)
    assert check_history(b2.history())["checkers"]["groups"]["verdict"] == "valid"
