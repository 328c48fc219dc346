"""The Spark analysis of harness runs gives the harness checkers' own figures:
recorded histories (tests/jepsen/histories) and seeded synthetic runs with
fault windows, failures, unknown outcomes and (in the buggy ones) every
anomaly kind."""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from jepsen_like.checkers import check_history
from jepsen_like.history import read_history
from pipeline.analyze import ANOMALIES, AnalyzeConfig, analyze, write
from tests.spark.histgen import generate

pytestmark = pytest.mark.spark

RECORDED = Path(__file__).parents[1] / "jepsen" / "histories"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("runs")
    rec = d / "recorded"
    rec.mkdir()
    for p in sorted(RECORDED.glob("*.jsonl")):
        shutil.copy(p, rec / p.name)
    for seed in range(4):
        rd = d / f"run-{seed}"
        rd.mkdir()
        generate(rd / "history.jsonl", seed, buggy=seed >= 2)
        # a result file as the checkers' CLI writes it
        res = check_history(read_history(rd / "history.jsonl"))
        (rd / "results.json").write_text(json.dumps(res))
    bench = d / "bench-1"
    bench.mkdir()
    (bench / "results.json").write_text(
        json.dumps(
            {
                "dledger": [
                    {
                        "voters": 3,
                        "flush": "sync",
                        "pipelined": {
                            "ops_per_s": {"median": 1234.5},
                            "latency_ms": {"p50": 2.0, "p99": 9.5},
                        },
                    }
                ],
                "pysyncobj": [],
            }
        )
    )
    return d


def _expected(runs: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(runs.rglob("*.jsonl")):
        name = p.parent.name if p.stem == "history" else f"{p.parent.name}/{p.stem}"
        h = read_history(p)
        out[name] = {"history": h, "check": check_history(h)}
    return out


def _rows(df: Any) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.collect()]


def test_analysis_matches_the_harness_checkers(
    spark: SparkSession, runs: Path, tmp_path: Path
) -> None:
    want = _expected(runs)
    assert len(want) == len(list(RECORDED.glob("*.jsonl"))) + 4
    a = analyze(spark, str(runs), AnalyzeConfig(bucket_ms=1000, grace_ms=2000))
    out = tmp_path / "analysis"
    write(spark, a, str(out))  # the figures below are read back from its Parquet
    t = a.tables

    # operations by type and outcome
    got_types: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for r in _rows(t["ops_by_type"]):
        got_types[r["run"]][(r["f"], r["status"])] = r["count"]
    for run, w in want.items():
        assert got_types[run] == Counter((op.f, op.status) for op in w["history"].ops), run

    # anomaly counts (queue checker)
    got_anom: dict[str, dict[str, int]] = defaultdict(dict)
    for r in _rows(t["anomalies"]):
        got_anom[r["run"]][r["anomaly"]] = r["count"]
    seen_kinds = set()
    for run, w in want.items():
        counts = w["check"]["checkers"]["queue"]["counts"]
        assert got_anom[run] == {a: counts[a] for a in ANOMALIES}, run
        seen_kinds |= {a for a, n in counts.items() if n}
    assert seen_kinds == set(ANOMALIES), "the fixtures exercise every anomaly kind"

    # RTO per fault window (recovery checker)
    got_win: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(_rows(t["windows"]), key=lambda r: (r["run"], r["window"])):
        got_win[r["run"]].append(r)
    n_windows = 0
    for run, w in want.items():
        exp = w["check"]["checkers"]["recovery"]["windows"]
        got = got_win.get(run, [])
        assert len(got) == len(exp), run
        for g, e in zip(got, exp, strict=True):
            n_windows += 1
            assert g["kind"] == e["kind"]
            assert g["impacted"] == any(v["impacted"] for v in e["by_f"].values())
            assert sorted(g["unrecovered"]) == sorted(e["unrecovered"])
            if e["rto_ms"] is None:
                assert g["rto_ms"] is None, (run, g)
            else:
                assert g["rto_ms"] == pytest.approx(e["rto_ms"], abs=1e-3), (run, g, e)
            for f, v in e["by_f"].items():
                gv = (g["rto_ms_by_f"] or {}).get(f)
                assert (gv is None) == (v["rto_ms"] is None), (run, f)
                if gv is not None:
                    assert gv == pytest.approx(v["rto_ms"], abs=1e-3)
    assert n_windows >= 10

    # RTO distribution per nemesis kind over all runs
    by_kind: dict[str, list[float]] = defaultdict(list)
    for w in want.values():
        for e in w["check"]["checkers"]["recovery"]["windows"]:
            by_kind[e["kind"]].append(e["rto_ms"])
    for r in _rows(t["rto_by_kind"]):
        assert r["windows"] == len(by_kind[r["kind"]])
        assert sorted(v for v in r["rto_ms"] if v is not None) == pytest.approx(
            sorted(v for v in by_kind[r["kind"]] if v is not None), abs=1e-3
        )

    # latency percentiles per f (phase "all" is the recovery checker's figure)
    got_lat = {(r["run"], r["f"]): r for r in _rows(t["latency"].filter("phase = 'all'"))}
    for run, w in want.items():
        for f, e in w["check"]["checkers"]["recovery"]["latency"].items():
            g = got_lat.get((run, f))
            if e["count"] == 0:
                assert g is None
                continue
            assert g is not None and g["count"] == e["count"], (run, f)
            for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms"):
                assert g[k] == pytest.approx(e[k], abs=1e-3), (run, f, k)
    # inside + outside windows cover every ok op, split by the windows' times
    got_outside = Counter[str]()
    for r in _rows(t["latency"].filter("phase = 'outside'")):
        got_outside[r["run"]] += r["count"]
    for run, w in want.items():
        h = w["history"]
        ok = [o for o in h.ops if o.status == "ok" and o.f != "final_read"]
        end = max((o.complete_ns or o.invoke_ns) for o in h.ops if o.f != "final_read")
        outside = [
            o
            for o in ok
            if not any(
                fw.start_ns <= (o.complete_ns or 0) <= (fw.stop_ns or end) for fw in h.faults
            )
        ]
        assert got_outside[run] == len(outside), run

    # availability timeline
    got_tl: dict[str, dict[tuple[int, str], tuple[int, int, int]]] = defaultdict(dict)
    for r in _rows(t["timeline"]):
        got_tl[r["run"]][(r["t_ms"], r["f"])] = (r["ok"], r["fail"], r["info"])
    for run, w in want.items():
        exp_tl = {
            (b["t_ms"], f): (c["ok"], c["fail"], c["info"])
            for b in w["check"]["checkers"]["recovery"]["timeline"]["buckets"]
            for f, c in b["f"].items()
        }
        assert got_tl.get(run, {}) == exp_tl, run

    # result files
    verdicts = {r["run"]: r for r in _rows(t["results"])}
    for seed in range(4):
        e = want[f"run-{seed}"]["check"]
        assert verdicts[f"run-{seed}"]["verdict"] == e["verdict"]
        assert verdicts[f"run-{seed}"]["queue"] == e["checkers"]["queue"]["verdict"]
    assert [(r["run"], r["ops_per_s"]) for r in _rows(t["bench"])] == [("bench-1", 1234.5)]

    # Parquet tables and the HTML report
    for name in t:
        assert (out / name / "_SUCCESS").exists(), name
    assert spark.read.parquet(str(out / "anomalies")).count() == len(want) * len(ANOMALIES)
    page = (out / "index.html").read_text()
    for png in ("ops_by_type.png", "latency.png", "rto.png", "timeline.png"):
        assert f"src='{png}'" in page
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
