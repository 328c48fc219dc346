"""``python -m jepsen_like compare`` (issue 16): Raft and controller mode on
one seeded workload and fault schedule.

* The report's pieces on hand-made results (no cluster).
* A short live comparison, Raft with 3 voters against controller mode AP
  with 2 replicas (about 2 x 60 s, real processes in network namespaces):
  both runs complete, the report is written with its plots, each mode's
  figures come from its own run's checkers.

The live part needs root and network namespaces; skipped otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jepsen_like import net
from jepsen_like.compare import MODES, html_report, sentences, summarize_run
from tests.jepsen.harness_run import run_subcommand

pytestmark = pytest.mark.jepsen

NETNS = net.available()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"needs network namespaces: {NETNS}")


def fake_results(tmp: Path, mode: str, *, lost: int, rto_kill: float | None) -> Path:
    out = tmp / mode
    (out / "cluster" / "g1").mkdir(parents=True)
    (out / "cluster" / "g1" / "data").write_bytes(b"x" * 8192)
    windows = [{"kind": "kill", "rto_ms": rto_kill, "unrecovered": []}]
    res = {
        "verdict": "invalid" if lost else "valid",
        "checkers": {
            "queue": {"verdict": "invalid" if lost else "valid", "counts": {"lost-write": lost}},
            "linearizable": {"verdict": "valid", "invalid_keys": []},
            "recovery": {
                "verdict": "valid",
                "windows": windows,
                "latency": {"produce": {"p50_ms": 3.0, "p99_ms": 40.0}},
            },
            "groups": {"verdict": "valid", "unordered_availability": 0.9},
        },
        "run": {"ops_by_f": {"produce": [90, 0, 0]}, "time_limit_s": 1.0},
    }
    (out / "results.json").write_text(json.dumps(res))
    return out


def test_the_report_says_what_each_mode_lost_and_plots_it(tmp_path: Path) -> None:
    rows = [
        summarize_run(MODES["raft-3"], fake_results(tmp_path, "raft-3", lost=0, rto_kill=800.0), 0),
        summarize_run(MODES["ap-2"], fake_results(tmp_path, "ap-2", lost=7, rto_kill=6200.0), 1),
        summarize_run(MODES["cp-3"], tmp_path / "missing", 3),
    ]
    assert rows[0]["lost"] == 0 and rows[1]["lost"] == 7
    assert rows[0]["throughput_per_s"] == 10.0 and rows[0]["bytes_per_message"] == 91.0
    said = sentences(rows)
    assert said[0].startswith("Raft, 3 voters: no anomaly")
    assert "lost 7 acknowledged writes" in said[1] and "6.2 s after kill" in said[1]
    assert "did not complete" in said[2]
    page = html_report(rows, 1, 60)
    assert page.count("<svg") >= 6 and "acknowledged writes lost" in page


@needs_netns
@pytest.mark.timeout(900)
def test_a_short_comparison_runs_both_modes_and_writes_the_report(tmp_path: Path) -> None:
    rc, out = run_subcommand(
        [
            "compare",
            "--modes",
            "raft-3,ap-2",
            "--time-limit",
            "40",
            "--seed",
            "2",
            "--out",
            str(tmp_path),
        ],
        timeout_s=900,
    )
    assert rc == 0, out[-4000:]
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [r["mode"] for r in rows] == ["raft-3", "ap-2"]
    for r in rows:
        assert "error" not in r, r
        assert r["produce_ok"] > 0 and r["replicas"] in (2, 3)
        assert r["bytes_per_message"] is not None and r["rto_ms"], r
    # Raft with its default settings loses nothing under this schedule.
    assert rows[0]["lost"] == 0 and rows[0]["duplicated"] == 0, rows[0]
    page = (tmp_path / "compare.html").read_text()
    assert page.count("<svg") >= 6
    assert "Raft, 3 voters" in page and "controller mode AP, 2 replicas" in page
    assert "report:" in out
