"""The goals against etcd and NATS JetStream, evaluated on hand-made figures:
met, not met, not measured, and a run whose load average makes its ratios
untrustworthy (said in the goals and in the report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.goals import evaluate, load_warning, max_load1
from benchmarks.registry import Figure
from benchmarks.report import write_html, write_markdown

REPO = Path(__file__).resolve().parents[2]


def _fig(key: str, vals: list[float], **config: object) -> Figure:
    return Figure.of(key, key, "x", vals, config=dict(config))


def _figs(ours: dict[str, float], etcd: dict[str, float]) -> dict[str, Figure]:
    out = {}
    for who, vals in (("ours", ours), ("etcd", etcd)):
        for suffix, v in vals.items():
            k = f"vs_etcd.{who}.{suffix}"
            out[k] = _fig(k, [v * 0.9, v, v * 1.1])
    return out


def _by_goal(goals: list[dict[str, object]], start: str) -> dict[str, object]:
    return next(g for g in goals if str(g["goal"]).startswith(start))


GOOD_OURS = {
    "single32.msg_per_s": 3000.0,
    "single1.p50_ms": 1.0,
    "single1.cpu_us_per_msg": 200.0,
    "batched.msg_per_s": 40000.0,
    "idle_cpu_pct": 0.5,
}
ETCD = {
    "single32.msg_per_s": 1500.0,
    "single1.p50_ms": 2.0,
    "single1.cpu_us_per_msg": 400.0,
    "batched.msg_per_s": 10000.0,
    "idle_cpu_pct": 0.8,
}


def test_goals_met_against_etcd() -> None:
    goals = evaluate(_figs(GOOD_OURS, ETCD), load1=0.5, cpus=2)
    g = _by_goal(goals, "one message per request, 32 clients: ours (sync) vs etcd")
    assert g["value"] == pytest.approx(2.0) and g["met"] is True
    # the ratio range over repeats: min/max .. max/min
    assert f"{2700 / 1650:.2f}-{3300 / 1350:.2f}" in str(g["detail"])
    assert _by_goal(goals, "one message per request, 1 client: p50")["met"] is True
    assert _by_goal(goals, "server CPU per message")["met"] is True
    b = _by_goal(goals, "batched (100 x 100 B, 8 in flight): ours (sync) vs etcd")
    assert b["value"] == pytest.approx(4.0) and b["met"] is True
    idle = _by_goal(goals, "idle CPU per server process")
    assert idle["value"] == pytest.approx(0.5) and idle["met"] is True
    assert "etcd 0.80%" in str(idle["detail"])
    load = _by_goal(goals, "machine not overloaded")
    assert load["met"] is True
    assert not any("TRUSTWORTHY" in str(g["detail"]) for g in goals)


def test_goals_not_met_against_etcd() -> None:
    bad = {
        "single32.msg_per_s": 1800.0,  # 1.2x < 1.5x
        "single1.p50_ms": 2.5,  # slower than etcd
        "single1.cpu_us_per_msg": 900.0,
        "batched.msg_per_s": 20000.0,  # 2x < 3x
        "idle_cpu_pct": 3.0,
    }
    goals = evaluate(_figs(bad, ETCD))
    for start in (
        "one message per request, 32 clients: ours (sync) vs etcd",
        "one message per request, 1 client: p50",
        "server CPU per message",
        "batched (100 x 100 B, 8 in flight): ours (sync) vs etcd",
        "idle CPU per server process",
    ):
        g = _by_goal(goals, start)
        assert g["met"] is False, g
        assert g["value"] is not None


def test_goals_not_measured_say_so() -> None:
    goals = evaluate({})
    # no load recorded: no load row
    assert not any(str(g["goal"]).startswith("machine not overloaded") for g in goals)
    for start in (
        "one message per request, 32 clients: ours (sync) vs etcd",
        "server CPU per message",
        "idle CPU per server process",
        "batched (100 x 100 B, 8 in flight): ours (async) vs NATS",
    ):
        g = _by_goal(goals, start)
        assert g["value"] is None and g["met"] is None
        assert "not measured" in str(g["detail"])


def test_nats_goals_are_information_with_durability() -> None:
    dur = "JetStream acknowledges before fsync"
    figs = {
        "vs_nats.ours.batched.msg_per_s": _fig("vs_nats.ours.batched.msg_per_s", [5000]),
        "vs_nats.nats.batched.msg_per_s": _fig(
            "vs_nats.nats.batched.msg_per_s", [10000], durability=dur
        ),
    }
    g = _by_goal(evaluate(figs), "batched (100 x 100 B, 8 in flight): ours (async) vs NATS")
    assert g["value"] == pytest.approx(0.5)
    assert g["met"] is None and g["target"] == "no target"
    assert dur in str(g["detail"])


def test_overloaded_run_is_not_trustworthy(tmp_path: Path) -> None:
    benches = {
        "vs_etcd": {
            "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [1.5, 1.0, 1.0],
            "raw": {"rounds": [{"loadavg_start": [3.4, 2, 2], "loadavg_end": [1.2, 2, 2]}]},
        }
    }
    load1 = max_load1([[0.5, 0, 0], [0.7, 0, 0]], benches)
    assert load1 == pytest.approx(3.4)  # a round's start, the highest
    assert load_warning(load1, 2) is not None and load_warning(1.9, 2) is None
    goals = evaluate(_figs(GOOD_OURS, ETCD), load1=load1, cpus=2)
    load = _by_goal(goals, "machine not overloaded")
    assert load["met"] is False and "not trustworthy" in str(load["detail"])
    g = _by_goal(goals, "one message per request, 32 clients: ours (sync) vs etcd")
    assert g["met"] is True  # still evaluated, but flagged
    assert "NOT TRUSTWORTHY" in str(g["detail"])
    unmeasured = _by_goal(goals, "batched (100 x 100 B, 8 in flight): ours (async) vs NATS")
    assert "TRUSTWORTHY" not in str(unmeasured["detail"])

    results = {
        "meta": {
            "started": "t",
            "quick": True,
            "big": False,
            "wall_s": 1.0,
            "git_commit": "x",
            "host": {
                "cpus": 2,
                "loadavg_before": [0.5, 0, 0],
                "loadavg_after": [0.7, 0, 0],
                "loadavg_max_1m": load1,
            },
        },
        "benchmarks": {
            "vs_etcd": {
                "summary": "s",
                "wall_s": 1.0,
                "figures": [],
                "series": [],
                "notes": [],
                **benches["vs_etcd"],
            },
            "vs_nats": {
                "summary": "s",
                "wall_s": 0.0,
                "figures": [],
                "series": [],
                "notes": [],
                "skipped": "nats-server is not installed",
            },
        },
        "goals": goals,
    }
    write_markdown(results, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "ratios of this run are not trustworthy" in md
    assert "**skipped**: nats-server is not installed" in md
    write_html(results, tmp_path / "r.html")
    assert "not trustworthy" in (tmp_path / "r.html").read_text()


@pytest.mark.timeout(120)
def test_runner_records_a_skipped_peer(tmp_path: Path) -> None:
    """Without etcd/nats-server on PATH the two benchmarks are skipped with
    the install command, and the run does not fail."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks", "run", "--quick"),
            *("--only", "vs_etcd,vs_nats", "--no-profile", "--out", str(out)),
        ],
        cwd=REPO,
        env={"PATH": str(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs_etcd skipped: etcd is not installed" in proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert "apt-get install etcd-server" in results["benchmarks"]["vs_etcd"]["skipped"]
    assert "apt-get install nats-server" in results["benchmarks"]["vs_nats"]["skipped"]
    for b in results["benchmarks"].values():
        assert "error" not in b and b["figures"] == []
        assert len(b["loadavg_start"]) == 3 and len(b["loadavg_end"]) == 3
    assert isinstance(results["meta"]["host"]["loadavg_max_1m"], float)


def test_a_figure_of_runs_without_a_latency_is_empty_not_a_crash() -> None:
    """A run in which no operation succeeded reports latencies of None (the
    5-voter 1 KiB log_append run that lost its leader under overload): the
    figure drops them like NaN instead of failing the whole benchmark."""
    f = Figure.of("k", "k", "ms", [None, 3.0, float("nan"), 5.0])
    assert (f.n, f.min, f.max) == (2, 3.0, 5.0)
    empty = Figure.of("k", "k", "ms", [None])
    assert empty.n == 0 and empty.median != empty.median


def test_who_goes_first_alternates_from_round_to_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This machine's speed drifts over minutes: a fixed order would hand
    the drift to the same side in every round."""
    from benchmarks import bench_peers
    from benchmarks.registry import Context

    order: list[str] = []

    def fake_round(ctx: Context, who: str, system: object, d: object) -> dict[str, object]:
        order.append(who)
        return {"who": who}

    monkeypatch.setattr(bench_peers, "_round", fake_round)
    monkeypatch.setattr(bench_peers, "_figures", lambda *a, **k: [])
    ctx = Context(quick=False, big=False, out_dir=tmp_path, work_dir=tmp_path)
    res = bench_peers._compare(
        ctx, "vs_x", "sync", "peer", "Peer", bench_peers._ours(ctx, "sync"), {}
    )
    assert order == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert [r["who"] for r in res.raw["rounds"]] == order
