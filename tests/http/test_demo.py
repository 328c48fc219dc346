"""The README's first command runs `python -m dledger_app.demo`: it must start a
real 3-node cluster, produce and consume with offsets, survive a leader
kill, print the CLI's consume output, and stop every process it started."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dledger.cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_demo_runs_end_to_end_and_stops_its_processes(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "dledger_app.demo", "--dir", str(d)],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    out = r.stdout
    shown = f"stdout:\n{out[-4000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, shown
    assert re.search(r"customer-\d: queue \d offset \d, CommitLog offset \d+, msg id \w+", out), (
        shown
    )
    assert "group offsets survived" in out, shown
    cli_row = r"^\d\s+\d+\s+\d+\s+\w{16,}\s+order #9, after the failover$"
    assert re.search(cli_row, out, re.M), shown
    assert "stopped every node process" in out, shown
    lc = LocalCluster(d)
    assert not any(lc.running(n) for n in lc.ids())
