"""Short harness runs against real node processes with real faults.

Each planted bug (``dledger/faults.py``) must be reported by the checker
that watches for it; a run of the same length without one must be valid.
The runs need root and ``ip netns`` for partitions (skipped otherwise, with
the reason) and libfaketime for the clock nemesis (the harness skips that
nemesis and says so when it is missing).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dledger import faults
from dledger.errors import ConfigError
from jepsen_like import net
from tests.jepsen.harness_run import run

pytestmark = pytest.mark.jepsen

NETNS = net.available()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"needs network namespaces: {NETNS}")


def anomalies(res: dict[str, Any]) -> set[str]:
    return set(res["checkers"]["queue"]["anomaly_types"])


# --------------------------------------------------------------------------- switches


def test_fault_switches_need_the_enable_variable() -> None:
    assert faults.parse({}) == frozenset()
    with pytest.raises(ConfigError, match="DLEDGER_ENABLE_FAULTS"):
        faults.parse({"DLEDGER_FAULTS": "skip_fsync"})
    with pytest.raises(ConfigError, match="unknown"):
        faults.parse({"DLEDGER_FAULTS": "no_such_bug", "DLEDGER_ENABLE_FAULTS": "1"})
    got = faults.parse(
        {"DLEDGER_FAULTS": "skip_fsync, ack_before_commit", "DLEDGER_ENABLE_FAULTS": "1"}
    )
    assert got == {"skip_fsync", "ack_before_commit"}


def test_a_node_refuses_fault_switches_without_the_enable_variable(tmp_path: Path) -> None:
    cf = tmp_path / "c.toml"
    cf.write_text(
        '[cluster]\nid = "t"\n\n[[members]]\nid = 1\nraft = "127.0.0.1:1"\n'
        f'http = "127.0.0.1:2"\ndata_dir = "{tmp_path / "d"}"\n'
    )
    p = subprocess.run(
        [sys.executable, "-m", "dledger_app.cli", "node", "--cluster", str(cf), "--id", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "DLEDGER_FAULTS": "skip_fsync"},
        check=False,
    )
    assert p.returncode == 2, p.stderr
    assert "DLEDGER_ENABLE_FAULTS" in p.stderr


# --------------------------------------------------------------------------- runs


def test_a_clean_run_with_every_nemesis_is_valid(tmp_path: Path) -> None:
    args = ["--nodes", "3", "--nemesis", "all", "--time-limit", "30", "--seed", "1"]
    if NETNS is not None:
        args.append("--no-netns")
    rc, res, out = run(tmp_path, *args)
    assert res["verdict"] == "valid", out[-4000:]
    assert rc == 0
    for name in ("linearizable", "queue", "recovery", "nodes"):
        assert res["checkers"][name]["verdict"] == "valid", name
    assert res["faults"] >= 4
    assert "VERDICT VALID" in out
    html = (tmp_path / "report.html").read_text()
    assert "<svg" in html and "RTO per fault" in html


@needs_netns
def test_ack_before_commit_loses_acknowledged_writes(tmp_path: Path) -> None:
    rc, res, out = run(
        tmp_path,
        "--nodes", "3",
        "--nemesis", "partition,kill",
        "--shapes", "partition=isolate-leader",
        "--shapes", "kill=leader",
        "--time-limit", "25",
        "--fault", "ack_before_commit",
    )  # fmt: skip
    assert rc == 1, out[-3000:]
    found = anomalies(res)
    assert found & {"lost-write", "inconsistent-offsets"}, found
    assert res["checkers"]["linearizable"]["verdict"] == "invalid"


@needs_netns
def test_lin_read_without_lease_gives_stale_reads(tmp_path: Path) -> None:
    rc, res, out = run(
        tmp_path,
        "--nodes", "3",
        "--nemesis", "partition,pause",
        "--shapes", "partition=isolate-one,isolate-leader",
        "--shapes", "pause=one",
        "--time-limit", "25",
        "--fault", "lin_read_no_lease",
    )  # fmt: skip
    assert rc == 1, out[-3000:]
    assert "stale-read" in anomalies(res)
    assert res["checkers"]["linearizable"]["verdict"] == "invalid"


def test_skip_fsync_loses_writes_when_a_majority_crashes(tmp_path: Path) -> None:
    args = ["--nodes", "3", "--nemesis", "kill", "--shapes", "kill=all,majority"]
    args += ["--time-limit", "20", "--fault", "skip_fsync"]
    if NETNS is not None:
        args.append("--no-netns")
    rc, res, out = run(tmp_path, *args)
    assert rc == 1, out[-3000:]
    found = anomalies(res)
    assert found & {"lost-write", "inconsistent-offsets", "unseen"}, found


@needs_netns
def test_follower_serving_uncommitted_entries_is_caught(tmp_path: Path) -> None:
    rc, res, out = run(
        tmp_path,
        "--nodes", "5",
        "--nemesis", "partition",
        "--shapes", "partition=leader-minority",
        "--time-limit", "30",
        "--fault", "follower_reads_uncommitted",
    )  # fmt: skip
    assert rc == 1, out[-3000:]
    bad = {n for n, r in res["checkers"].items() if r["verdict"] == "invalid"}
    assert bad & {"queue", "linearizable"}, (bad, anomalies(res))
