"""Planted bugs in controller mode (issue 16), each caught by the harness's
unchanged checkers on a real controller-mode group (3 replicas, CP
settings, the controller group beside it, network namespaces):

* ``ack_before_commit``: a produce is acknowledged before the SyncStateSet
  holds it (before the master even appended it): killing or isolating the
  master loses acknowledged writes (queue checker);
* ``cmode_confirm_from_master``: the confirm offset follows the master's own
  log, not the set's acknowledgements: the same loss (queue checker);
* ``cmode_skip_truncation``: a slave joining a new master keeps its forked
  tail and applies it: it serves messages the group never confirmed, which
  vanish (queue and linearizability checkers: stale reads), replicas hold
  different messages at one offset (replicas checker), or the slave's log
  store refuses the master's next entry, whose CommitLog position does not
  follow the forked tail's, and the node stops (nodes checker).

The schedule isolates and kills the master again and again, each time for
longer than the controller's 5 s liveness timeout, so that the controller
elects another master: an isolated master keeps taking writes without a
lease (the bugs acknowledge them; a correct CP master cannot confirm them
and leaves a forked tail behind), and a killed one had writes in flight.
About 1.5 minutes each.
Needs root and network namespaces; skipped otherwise, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jepsen_like import net
from tests.jepsen.harness_run import run

pytestmark = [pytest.mark.jepsen, pytest.mark.timeout(600)]

NETNS = net.available()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"needs network namespaces: {NETNS}")

SCHEDULE = "partition:isolate-leader,kill:leader,partition:isolate-leader,kill:leader"


@needs_netns
@pytest.mark.parametrize(
    ("fault", "checkers"),
    [
        ("ack_before_commit", {"queue"}),
        ("cmode_confirm_from_master", {"queue"}),
        ("cmode_skip_truncation", {"queue", "replicas", "nodes"}),
    ],
)
def test_a_planted_controller_mode_bug_is_caught(
    tmp_path: Path, fault: str, checkers: set[str]
) -> None:
    argv = ["--groups", "1", "--nodes", "3", "--replication", "controller", "--cmode", "cp"]
    argv += ["--nemesis", "kill,partition", "--time-limit", "50", "--seed", "4"]
    argv += ["--fault-seconds", "7", "8", "--quiet-seconds", "3", "4"]
    argv += ["--schedule", SCHEDULE, "--fault", fault]
    rc, res, out = run(tmp_path, *argv, timeout_s=420, short_faults=False)
    assert res["verdict"] == "invalid", f"{fault} was not caught:\n{out[-4000:]}"
    assert rc == 1
    caught = {k for k, v in res["checkers"].items() if v.get("verdict") == "invalid"}
    assert caught & checkers, f"{fault}: caught by {caught}, expected one of {checkers}"
