"""Harness pieces that need no cluster: grudges, outcome rules, the report."""

from __future__ import annotations

import io
import os
import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from jepsen_like import net
from jepsen_like.checkers import check_history
from jepsen_like.control import Cluster
from jepsen_like.history import Writer, parse_history
from jepsen_like.nemesis import Nemesis, set_faked_offset
from jepsen_like.report import html_report
from jepsen_like.workload import Reply, read_outcome, write_outcome


def nemesis(voters: int, tmp_path: Path) -> Nemesis:
    c = Cluster(tmp_path, voters=voters, netns=True)
    return Nemesis(c, Writer(io.StringIO()), random.Random(7), [], log=lambda _: None,
                   libfaketime=None)  # fmt: skip


def sees(grudge: dict[int, set[int]], a: int, b: int) -> bool:
    return b not in grudge.get(a, set()) and a not in grudge.get(b, set())


def test_complete_grudge_splits_into_components() -> None:
    g = net.complete_grudge([[1, 2], [3, 4, 5]], range(1, 6))
    assert g[1] == {3, 4, 5} and g[4] == {1, 2}
    assert net.complete_grudge([[3]], [1, 2, 3]) == {1: {3}, 2: {3}, 3: {1, 2}}


@pytest.mark.parametrize("voters", [3, 5])
def test_bridge_node_sees_both_sides_that_do_not_see_each_other(
    voters: int, tmp_path: Path
) -> None:
    g, (bridge,) = nemesis(voters, tmp_path)._grudge("bridge", None)
    others = [i for i in range(1, voters + 1) if i != bridge]
    assert all(sees(g, bridge, o) for o in others)
    cut = [(a, b) for a in others for b in others if a < b and not sees(g, a, b)]
    assert cut, "a bridge must cut something"


def test_majorities_ring_gives_every_node_a_different_majority(tmp_path: Path) -> None:
    g, ring = nemesis(5, tmp_path)._grudge("majorities-ring", None)
    views = []
    for n in ring:
        visible = {m for m in ring if m == n or sees(g, n, m)}
        assert len(visible) == 3  # itself and its two ring neighbours: a majority
        views.append(frozenset(visible))
    assert len(set(views)) == 5


def test_isolating_the_leader_cuts_it_from_every_node(tmp_path: Path) -> None:
    g, targets = nemesis(5, tmp_path)._grudge("isolate-leader", 4)
    assert targets == [4] and g[4] == {1, 2, 3, 5}


def test_leader_minority_keeps_the_leader_with_one_follower_of_five(tmp_path: Path) -> None:
    g, side = nemesis(5, tmp_path)._grudge("leader-minority", 2)
    assert 2 in side and len(side) == 2
    (f,) = [x for x in side if x != 2]
    assert sees(g, 2, f) and g[2] == {1, 2, 3, 4, 5} - {2, f}


def test_shapes_can_be_restricted_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    n = nemesis(3, tmp_path)
    n.shapes = {"kill": ["majority", "all"]}
    assert [n._pick("kill", ["one", "majority", "all"], k) for k in range(3)] == [
        "majority", "all", "majority",
    ]  # fmt: skip
    n.shapes = {"kill": ["sideways"]}
    with pytest.raises(ValueError, match="sideways"):
        n._pick("kill", ["one"], 0)


@pytest.mark.parametrize(
    ("reply", "write", "read"),
    [
        (Reply(200, {}), "ok", "ok"),
        (Reply(None, error="timeout"), "info", "info"),
        (Reply(None, error="connect", sent=False), "fail", "fail"),
        (Reply(504, {}), "info", "info"),
        (Reply(503, {"error": {"code": "NOT_LEADER"}}), "fail", "fail"),
        (Reply(503, {"error": {"code": "STORAGE_CORRUPTED"}}), "info", "fail"),
        (Reply(409, {"error": {"code": "PROPOSAL_DROPPED"}}), "fail", "fail"),
        (Reply(500, {}), "info", "info"),
    ],
)
def test_outcomes_are_fail_only_when_nothing_can_have_happened(
    reply: Reply, write: str, read: str
) -> None:
    assert write_outcome(reply) == write
    assert read_outcome(reply) == read


def test_report_is_self_contained_html_with_well_formed_svg() -> None:
    buf = io.StringIO()
    w = Writer(buf)
    t = 1_000_000_000
    for k in range(40):
        w.invoke(0, "produce", "t/0", value=f"v{k}", time_ns=t)
        if k == 20:
            w.nemesis("start", "kill", [1], time_ns=t + 1)
            w.info(0, time_ns=t + 5_000_000)
            w.nemesis("stop", "kill", [1], time_ns=t + 300_000_000)
        else:
            w.ok(0, offset=k - (k > 20), time_ns=t + 5_000_000)
        t += 50_000_000
    h = parse_history(buf.getvalue().splitlines())
    res: dict[str, Any] = check_history(h)
    page = html_report(res, h)
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 3
    for s in svgs:
        ET.fromstring(s)
    assert "RTO per fault" in page and "kill" in page


def test_a_run_inherits_the_machine_lock_its_parent_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test takes the lock before its clock starts; the run it starts
    passes straight through; anyone else still waits, also after that run
    ended (the run does not release its parent's lock)."""
    import subprocess
    import sys

    from jepsen_like import control

    monkeypatch.setattr(control, "STATE_DIR", tmp_path)
    parent = control.RunLock()
    assert parent.acquire(0, print)
    probe = (
        "import sys; from jepsen_like.control import RunLock; "
        "sys.exit(0 if RunLock().acquire(0, lambda m: None) else 1)"
    )
    env = dict(os.environ, JEPSEN_LIKE_STATE=str(tmp_path))

    def child(inherit: bool) -> int:
        e = dict(env, **{control.LOCK_FD_ENV: str(parent.fileno())}) if inherit else env
        fds = (parent.fileno(),) if inherit else ()
        return subprocess.run(
            [sys.executable, "-c", probe], env=e, pass_fds=fds, timeout=60, check=False
        ).returncode

    try:
        assert child(inherit=False) == 1  # held: another run would wait
        assert child(inherit=True) == 0  # the parent's own run goes ahead
        assert child(inherit=False) == 1  # and did not release it on exit
    finally:
        parent.release()
    assert child(inherit=False) == 0


class _RebuildCluster:
    """Three voters; node 2 is down. The leader (1) was elected in term 5,
    after the fault's start recorded term 4, so it may hold node 2's old
    match index; node 2 catches up a few polls after it is started."""

    voters = ids = [1, 2, 3]

    def __init__(self) -> None:
        self.node_settings: dict[str, Any] = {}  # a Raft group
        self.term, self.leader = 5, 1
        self.events: list[tuple[Any, ...]] = []
        self.polls_after_start = 0
        self.up = False

    async def statuses(self) -> dict[int, dict[str, Any]]:
        return {
            n: {"term": self.term, "commit": 100, "role": "leader" if n == self.leader else "f"}
            for n in (1, 3)
        }

    async def transfer_leadership(self, lead: int, to: int) -> bool:
        self.events.append(("transfer", self.term, to))
        self.term, self.leader = self.term + 1, to
        return True

    def wipe(self, node: int) -> None:
        self.events.append(("wipe", self.term, self.leader))

    def start(self, node: int) -> None:
        self.events.append(("start", self.term, self.leader))
        self.up = True

    def alive(self, node: int) -> bool:
        return self.up

    async def status(self, node: int) -> dict[str, Any] | None:
        self.polls_after_start += 1
        return {"applied": 100 if self.polls_after_start >= 3 else 0}


async def test_a_rebuilt_replica_joins_a_leader_elected_while_it_was_down() -> None:
    c = _RebuildCluster()
    n = Nemesis(c, Writer(io.StringIO()), random.Random(7), [], log=lambda _: None,  # type: ignore[arg-type]
                libfaketime=None)  # fmt: skip
    info: dict[str, Any] = {}
    await n.rebuild(2, 4, info)
    # a transfer even though the term (5) is already above the recorded one
    # (4): the leader of term 5 may have heard node 2 before it went down
    assert c.events[0] == ("transfer", 5, 3)
    assert [e[0] for e in c.events] == ["transfer", "wipe", "start"]
    assert info["rebuilt"] and info["caught_up"]  # and the heal waited for its catch-up
    assert c.polls_after_start >= 3


class _CmodeRebuildCluster(_RebuildCluster):
    """A controller-mode group: node 2 (damaged, down) is still in master 1's
    SyncStateSet for the first polls, until the master shrinks the set."""

    def __init__(self) -> None:
        super().__init__()
        self.node_settings = {"replication": "controller"}
        self.polls = 0

    async def statuses(self) -> dict[int, dict[str, Any]]:
        self.polls += 1
        sss = [1, 2, 3] if self.polls < 4 else [1, 3]
        return {
            1: {"cmode_role": "master", "sync_state_set": sss, "confirm": 100},
            3: {"cmode_role": "slave", "sync_state_set": [], "confirm": 100},
        }


async def test_a_controller_mode_replica_is_wiped_only_once_out_of_the_sync_state_set() -> None:
    c = _CmodeRebuildCluster()
    n = Nemesis(c, Writer(io.StringIO()), random.Random(7), [], log=lambda _: None,  # type: ignore[arg-type]
                libfaketime=None)  # fmt: skip
    info: dict[str, Any] = {}
    await n.rebuild(2, 4, info)
    # no leadership transfers (no votes to outlive); the wipe came after the
    # poll at which the master's set stopped naming node 2
    assert [e[0] for e in c.events] == ["wipe", "start"]
    assert c.polls == 4
    assert info["rebuild_sync_state_set"] == [1, 3] and info["rebuild_master"] == 1
    assert info["rebuilt"] and info["caught_up"] and info["rebuild_commit_floor"] == 100


def test_a_faked_clock_offset_is_never_seen_empty(tmp_path: Path) -> None:
    """libfaketime re-reads FAKETIME_TIMESTAMP_FILE while the node runs; an
    empty read (the file truncated, not yet written) is parsed as a
    timestamp, fails and exits the node (libfaketime 0.9.11 on). A reader
    racing 3,000 rewrites must see a whole offset every time."""
    import threading

    path = tmp_path / "faketime-1.txt"
    set_faked_offset(path, "+0s")
    seen: set[str] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with open(path) as f:  # a new open each time, as libfaketime does
                seen.add(f.read())

    t = threading.Thread(target=read)
    t.start()
    try:
        for k in range(3000):
            set_faked_offset(path, f"+{k % 7}s" if k % 2 else f"-{k % 5}s")
    finally:
        done.set()
        t.join()
    assert seen and all(re.fullmatch(r"[+-]\d+s\n", s) for s in seen), sorted(seen)[:5]
    assert not list(tmp_path.glob("*.new"))
