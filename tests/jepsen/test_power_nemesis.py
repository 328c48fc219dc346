"""Issue 20: the power-loss and disk-error nemeses in short harness runs.

Each run puts every data directory on lazyfs (FUSE): needs root, /dev/fuse,
fusermount3 and pyfuse3, and network namespaces like the other harness
runs; skips otherwise, saying which is missing. Three runs of about a
minute each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jepsen_like import net
from jepsen_like.lazyfs import why_unavailable

pytestmark = [pytest.mark.jepsen, pytest.mark.timeout(600)]

WHY = why_unavailable()
NETNS = net.available()
needs = pytest.mark.skipif(
    WHY is not None or NETNS is not None,
    reason=f"needs lazyfs ({WHY or 'ok'}) and network namespaces ({NETNS or 'ok'})",
)


def run(
    out: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    argv = [sys.executable, "-m", "jepsen_like", "run", "--out", str(out), "--time-limit", "30"]
    argv += ["--fault-seconds", "2.5", "3.5", "--quiet-seconds", "2", "3", *args]
    p = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        env=dict(os.environ, **(env or {})),
    )
    path = out / "results.json"
    if not path.exists():
        pytest.fail(
            f"no results.json (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p.returncode, json.loads(path.read_text()), p.stdout


def _events(res: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in res["run"]["nemesis_events"] if e["kind"] == kind]


@needs
def test_sync_mode_loses_nothing_through_power_losses_and_disk_errors(tmp_path: Path) -> None:
    """flush = "sync": majority and whole-cluster power losses (one torn)
    and a leader whose fsync fails: every checker valid, the failed node
    stopped by itself with exit 3 and said DISK_FAILED."""
    rc, res, out = run(
        tmp_path,
        "--nemesis",
        "power,disk",
        "--schedule",
        "power:majority,disk:fsync-eio,power:all-torn,disk:write-enospc",
    )
    assert res["verdict"] == "valid" and rc == 0, out[-4000:]
    power = _events(res, "power")
    assert {e["shape"] for e in power} >= {"majority", "all-torn"}, power
    assert all(e["dropped"] for e in power), power
    disk = _events(res, "disk")
    assert len(disk) >= 2 and all(e["stopped"] and e["exit_code"] == 3 for e in disk), disk
    assert all("DISK_FAILED" in e["said"] for e in disk), disk
    assert res["checkers"]["replicas"]["divergent_offsets"] == 0


@needs
def test_skip_fsync_is_caught_by_the_power_loss_nemesis_itself(tmp_path: Path) -> None:
    """The planted bug's simulated lost tail is switched off
    (DLEDGER_FAULT_LOST_TAIL=0): only lazyfs drops what was never fsynced."""
    _rc, res, out = run(
        tmp_path,
        "--nemesis",
        "power",
        "--schedule",
        "power:majority,power:all",
        "--fault",
        "skip_fsync",
        env={"DLEDGER_FAULT_LOST_TAIL": "0"},
    )
    assert res["verdict"] == "invalid", out[-4000:]
    q = res["checkers"]["queue"]["counts"]
    assert q.get("lost-write", 0) + q.get("unseen", 0) > 0, (q, out[-4000:])


@needs
def test_async_mode_loses_only_the_tail_and_never_diverges(tmp_path: Path) -> None:
    """flush = "async", power losses of a majority (one torn): the lost
    acknowledged writes all fall in the tail of a majority power loss, the
    replicas end identical, every replica that stopped with REPLICA_DIVERGED
    was rebuilt, and nothing else exited."""
    _rc, res, out = run(
        tmp_path,
        "--flush",
        "async",
        "--nemesis",
        "power",
        "--schedule",
        "power:majority,power:majority-torn,power:majority",
    )
    ch = res["checkers"]
    assert ch["replicas"]["verdict"] == "valid", out[-4000:]
    assert ch["replicas"]["divergent_offsets"] == 0
    assert ch["tail"]["verdict"] == "valid", ch["tail"]
    assert ch["tail"]["majority_power_losses"] >= 3
    assert ch["nodes"]["verdict"] == "valid", ch["nodes"]
    assert all(d.get("rebuilt") for d in ch["nodes"]["diverged_rebuilt"]), ch["nodes"]
    print(
        f"async: acknowledged {ch['tail']['acknowledged']}, lost in tail "
        f"{ch['tail']['lost_in_tail']}, diverged replicas rebuilt "
        f"{len(ch['nodes']['diverged_rebuilt'])}, divergent offsets 0"
    )
