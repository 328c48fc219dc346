"""The HTML summary of an analysis: small aggregates collected to the driver,
plotted with matplotlib (Agg backend, PNG in memory), and written with
Hadoop's FileSystem API so that ``--out`` may be any Spark-writable path."""

from __future__ import annotations

import html
import io
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession

if TYPE_CHECKING:
    from pipeline.analyze import Analysis

MAX_TIMELINE_RUNS = 12


def write_bytes(spark: SparkSession, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through Hadoop's FileSystem (any scheme)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    out = fs.create(hpath, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.3f}"
    return str(v)


def write_report(spark: SparkSession, a: Analysis, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out.rstrip("/")
    t = a.tables
    by_type = [r.asDict() for r in t["ops_by_type"].orderBy("run", "f", "status").collect()]
    lat_kind = [r.asDict() for r in t["latency_by_kind"].orderBy("f", "phase", "nemesis").collect()]
    rto = [r.asDict() for r in t["rto_by_kind"].orderBy("kind").collect()]
    anom = [r.asDict() for r in t["anomalies"].filter("count > 0").orderBy("run").collect()]
    results = [r.asDict() for r in t["results"].orderBy("run").collect()]
    bench = [r.asDict() for r in t["bench"].orderBy("run", "voters", "flush").collect()]
    runs = sorted({r["run"] for r in by_type})
    sections: list[str] = []
    images: dict[str, bytes] = {}

    # operations by type and outcome, over all runs
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"ok": 0, "fail": 0, "info": 0})
    for r in by_type:
        totals[r["f"]][r["status"]] += r["count"]
    if totals:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        fs = sorted(totals)
        bottom = [0] * len(fs)
        for status, color in (("ok", "#4c9a2a"), ("fail", "#c0392b"), ("info", "#e6a23c")):
            vals = [totals[f][status] for f in fs]
            ax.bar(fs, vals, bottom=bottom, label=status, color=color)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("operations")
        ax.set_title(f"operations by type and outcome ({len(runs)} runs)")
        ax.legend()
        images["ops_by_type.png"] = _png(fig)
    sections.append(
        "<h2>Operations by type and outcome</h2><img src='ops_by_type.png'>"
        + _table([{"f": f, **c} for f, c in sorted(totals.items())], ["f", "ok", "fail", "info"])
    )

    # latency inside vs outside fault windows
    if lat_kind:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{r['f']}\n{r['phase']} {r['nemesis'] or ''}".strip() for r in lat_kind]
        xs = range(len(lat_kind))
        ax.bar([x - 0.2 for x in xs], [r["p50_ms"] or 0 for r in lat_kind], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r["p99_ms"] or 0 for r in lat_kind], 0.4, label="p99")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_yscale("symlog")
        ax.set_title("ok latency inside vs outside fault windows")
        ax.legend()
        images["latency.png"] = _png(fig)
    sections.append(
        "<h2>Latency inside and outside fault windows</h2><img src='latency.png'>"
        + _table(
            lat_kind, ["f", "phase", "nemesis", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms"]
        )
    )

    # RTO per nemesis kind
    if rto:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        data = [[v for v in r["rto_ms"] if v is not None] for r in rto]
        ax.boxplot([d or [0.0] for d in data], tick_labels=[r["kind"] for r in rto])
        ax.set_ylabel("RTO ms")
        ax.set_title("recovery time per nemesis kind")
        images["rto.png"] = _png(fig)
    sections.append(
        "<h2>RTO per nemesis kind</h2><img src='rto.png'>"
        + _table(
            rto,
            ["kind", "windows", "impacted", "unrecovered", "p50_ms", "p95_ms", "p99_ms", "max_ms"],
        )
    )

    # availability timeline of the first runs, fault windows shaded
    shown = runs[:MAX_TIMELINE_RUNS]
    if shown:
        tl: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for row in (
            t["timeline"]
            .filter(t["timeline"]["run"].isin(shown))
            .groupBy("run", "t_ms")
            .sum("ok", "fail", "info")
            .orderBy("run", "t_ms")
            .collect()
        ):
            tl[row["run"]].append(
                (row["t_ms"], row["sum(ok)"], row["sum(fail)"] + row["sum(info)"])
            )
        t0s = {
            r["run"]: r["t0"]
            for r in a.ops.filter(a.ops["f"] != "final_read")
            .groupBy("run")
            .agg({"invoke_ns": "min"})
            .withColumnRenamed("min(invoke_ns)", "t0")
            .collect()
        }
        wins = a.faults.filter(a.faults["run"].isin(shown)).collect()
        fig, axes = plt.subplots(len(shown), 1, figsize=(8, 1.6 * len(shown)), squeeze=False)
        for ax, run in zip(axes[:, 0], shown, strict=True):
            pts = tl.get(run, [])
            ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], label="ok", color="#4c9a2a")
            ax.plot(
                [p[0] / 1000 for p in pts], [p[2] for p in pts], label="fail+info", color="#c0392b"
            )
            for w in wins:
                if w["run"] == run and run in t0s:
                    ax.axvspan(
                        (w["start_ns"] - t0s[run]) / 1e9,
                        (w["end_ns"] - t0s[run]) / 1e9,
                        alpha=0.2,
                        color="grey",
                    )
            ax.set_ylabel(run, fontsize=7, rotation=0, ha="right")
        axes[0, 0].legend(fontsize=7)
        axes[-1, 0].set_xlabel("seconds from the first invoke (grey: fault windows)")
        images["timeline.png"] = _png(fig)
        sections.append(
            "<h2>Availability timeline</h2>"
            f"<p>ops per bucket, first {len(shown)} of {len(runs)} runs</p>"
            "<img src='timeline.png'>"
        )

    sections.append(
        "<h2>Anomalies (queue checker definitions)</h2>"
        + (_table(anom, ["run", "anomaly", "count"]) if anom else "<p>none</p>")
    )
    if results:
        sections.append(
            "<h2>Checker verdicts from results.json</h2>"
            + _table(
                results,
                ["run", "verdict", "linearizable", "queue", "recovery", "max_rto_ms", "ops"],
            )
        )
    if bench:
        sections.append(
            "<h2>Benchmarks from results.json</h2>"
            + _table(bench, ["run", "voters", "flush", "ops_per_s", "p50_ms", "p99_ms"])
        )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>dledger harness analysis</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>Harness analysis: {len(runs)} runs</h1>" + "".join(sections) + "</body></html>"
    )
    for name, png in images.items():
        write_bytes(spark, f"{out}/{name}", png)
    write_bytes(spark, f"{out}/index.html", page.encode("utf-8"))
