"""``python -m dledger_app.demo_groups`` (the README's multi-group demo) runs
end to end: unordered messages go on while g2's majority is dead, ordered
ones for g2 fail clearly, every acknowledged message is on every replica of
its group exactly once, and every process it started is stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dledger.cluster import process_alive
from dledger_app.groups import MultiCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_demo_groups_runs_end_to_end_and_stops_its_processes(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "dledger_app.demo_groups", "--dir", str(d)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = r.stdout
    shown = f"stdout:\n{out[-4000:]}\nstderr:\n{r.stderr[-3000:]}"
    try:
        assert r.returncode == 0, shown
        outage = re.search(r"60 more unordered messages .* all acknowledged: (\{.*\})", out)
        assert outage and "g2" not in outage[1], shown
        assert "for g2: 503 GROUP_UNAVAILABLE" in out and "through the proxy: 503" in out, shown
        assert out.count("every acknowledged one exactly once: yes") == 9, shown
        assert "stopped every process it started" in out, shown
    finally:
        # whatever happened (a timeout included), nothing the demo started survives
        left = []
        if MultiCluster.is_multi(d):
            for name, lc in MultiCluster(d).all().items():
                left += [f"{name}/{n}" for n in lc.ids() if lc.running(n)]
                lc.down(10)
        pid_file = d / "proxy.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            if process_alive(pid):
                left.append(f"proxy {pid}")
                os.kill(pid, signal.SIGKILL)
    assert not left, f"the demo left these running: {left}"
