"""A controller-mode group with the CP settings through the faults that
touch its disks (issue 16): power losses (lazyfs drops what was never
fsynced, one node to all of them), disk errors (failed fsyncs and writes)
and a corrupted data file (the replica refuses it and is rebuilt from its
peers once the master's SyncStateSet no longer names it).

Nothing acknowledged may be lost: the master acknowledges once every member
of the SyncStateSet has the message on disk, and a replica is only wiped
once the controller can no longer elect it. About 1.5 minutes of real
processes in network namespaces on lazyfs.

Needs root, /dev/fuse (lazyfs) and network namespaces; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jepsen_like import net
from jepsen_like.lazyfs import why_unavailable
from tests.jepsen.harness_run import run

pytestmark = [pytest.mark.jepsen, pytest.mark.timeout(600)]

WHY = why_unavailable()
NETNS = net.available()
needs = pytest.mark.skipif(
    WHY is not None or NETNS is not None,
    reason=f"needs lazyfs ({WHY or 'ok'}) and network namespaces ({NETNS or 'ok'})",
)


@needs
def test_cp_controller_mode_loses_nothing_through_power_disk_and_corrupt(tmp_path: Path) -> None:
    argv = ["--groups", "1", "--nodes", "3", "--replication", "controller", "--cmode", "cp"]
    argv += ["--nemesis", "corrupt,power,disk", "--time-limit", "60", "--seed", "2"]
    argv += ["--schedule", "power:all,corrupt,disk,power:majority-torn,corrupt"]
    rc, res, out = run(tmp_path, *argv, timeout_s=420)
    assert res["verdict"] == "valid", out[-5000:]
    assert rc == 0
    q = res["checkers"]["queue"]
    assert q["verdict"] == "valid" and not q.get("counts", {}).get("lost-write"), q
    assert res["checkers"]["replicas"]["divergent_offsets"] == 0
    events = res["run"]["nemesis_events"]
    kinds = {e["kind"] for e in events}
    assert {"power", "disk", "corrupt"} <= kinds, events
    # A whole-group power loss dropped writes that were never fsynced.
    assert any(e["kind"] == "power" and e.get("shape") == "all" for e in events), events
    # Each damaged replica refused its data and was rebuilt, only once the
    # master's SyncStateSet no longer named it, and caught up.
    corrupt = [e for e in events if e["kind"] == "corrupt" and e.get("refused")]
    assert corrupt, events
    for e in corrupt:
        assert e["rebuilt"] and e["caught_up"], e
        assert e["targets"][0] not in e["rebuild_sync_state_set"], e
        assert e["rebuild_master"] != e["targets"][0], e
    # A node whose disk failed stopped by itself, saying so.
    disk = [e for e in events if e["kind"] == "disk"]
    assert disk and all(e.get("stopped") and "DISK_FAILED" in e["said"] for e in disk), disk
