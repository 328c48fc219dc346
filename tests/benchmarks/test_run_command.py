"""``python -m benchmarks run`` keeps working: a quick run of one cheap
benchmark writes results.json with the documented structure, plus the
Markdown and HTML reports. No timing is asserted (the numbers are noise on a
shared machine); only the shape of what the command writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def test_quick_run_of_reads_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "run",
            "--quick",
            "--only",
            "reads",
            "--no-peer",
            "--no-profile",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== reads" in proc.stderr  # progress lines

    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"schema", "meta", "benchmarks", "goals"}
    assert results["meta"]["quick"] is True
    assert results["meta"]["only"] == ["reads"]
    assert list(results["benchmarks"]) == ["reads"]

    bench = results["benchmarks"]["reads"]
    assert "error" not in bench
    # the other work beside the load average (benchmarks.hostload)
    assert _number(bench["outside_cpu_pct"]) and bench["outside_cpu_pct"] >= 0
    assert _number(results["meta"]["host"]["outside_cpu_pct_max"])
    # the machine's speed that day, at both ends of the run
    host = results["meta"]["host"]
    assert host["cpu_speed_before"] > 0 and host["cpu_speed_after"] > 0
    keys = {f["key"] for f in bench["figures"]}
    for kind in ("committed", "lease", "read_index"):
        assert {f"reads.{kind}.p50_ms", f"reads.{kind}.p99_ms"} <= keys
    for f in bench["figures"]:
        assert set(f) >= {"key", "label", "unit", "median", "min", "max", "n", "config"}
        assert f["n"] >= 1
        assert _number(f["median"]) and _number(f["min"]) and _number(f["max"])
        assert f["min"] <= f["median"] <= f["max"]

    goals = {g["goal"]: g for g in results["goals"]}
    lease = goals["lease read vs committed local read latency (p50, /raft/read)"]
    assert _number(lease["value"]) and lease["met"] in (True, False)
    # Goals whose benchmarks did not run say so instead of inventing a value.
    batched = next(g for g in results["goals"] if g["goal"].startswith("batched HTTP produce"))
    assert batched["value"] is None and batched["met"] is None

    md = (out / "results.md").read_text()
    assert "## Goals" in md and "## reads" in md
    assert "processes outside this run used" in md
    assert f"CPU speed index {host['cpu_speed_before']:,}" in md
    assert "<table>" in (out / "index.html").read_text()
