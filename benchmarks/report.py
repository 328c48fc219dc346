"""results.md, PNG plots and index.html from one run's results.json data.

matplotlib is imported lazily (the bench extra installs it) and drawn with
the non-interactive Agg backend; without it the run still writes the JSON
and the Markdown and says the plots were skipped.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from benchmarks.goals import load_warning as goals_load_warning


def _num(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    a = abs(v)
    if unit in ("ms", "s", "x") or a < 10:
        s = f"{v:.3f}" if a < 1 else f"{v:.2f}"
    else:
        s = f"{v:,.0f}"
    return s


def _ratio(fig: dict[str, Any], figs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    pk = fig.get("peer_key")
    peer = figs.get(pk) if pk else None
    if not peer or not peer["median"] or peer["median"] != peer["median"]:
        return "", ""
    r = fig["median"] / peer["median"]
    return f"{_num(peer['median'], peer['unit'])} {peer['unit']}", f"{r:.2f}x"


def figure_rows(results: dict[str, Any]) -> dict[str, list[list[str]]]:
    figs = {f["key"]: f for b in results["benchmarks"].values() for f in b["figures"]}
    out: dict[str, list[list[str]]] = {}
    for name, b in results["benchmarks"].items():
        rows = []
        for f in b["figures"]:
            peer, ratio = _ratio(f, figs)
            rows.append(
                [
                    f["label"],
                    f"{_num(f['median'], f['unit'])} {f['unit']}",
                    f"{_num(f['min'], f['unit'])} - {_num(f['max'], f['unit'])}",
                    str(f["n"]),
                    peer,
                    ratio,
                ]
            )
        out[name] = rows
    return out


HEAD = ["figure", "median", "min - max", "n", "peer (same run)", "ratio"]


def load_warning(results: dict[str, Any]) -> str | None:
    """The run's load warning in words, or None (see benchmarks.goals)."""
    host = results["meta"].get("host", {})
    load1, cpus = host.get("loadavg_max_1m"), host.get("cpus")
    words = goals_load_warning(load1, cpus, host.get("outside_cpu_pct_max"))
    if words is None:
        return None
    return f"**Warning: {words}.**"


def speed_line(host: dict[str, Any]) -> str | None:
    """The machine's speed that day, in words (benchmarks.hostload.cpu_speed)."""
    a, b = host.get("cpu_speed_before"), host.get("cpu_speed_after")
    if not a or not b:
        return None
    return (
        f"CPU speed index {a:,} at the start and {b:,} at the end (a fixed Python "
        "workload on one core, best of 3). Figures that are not ratios to a peer "
        "(Spark's messages/s, latencies in ms) have differed by up to 2x between days "
        "on the same machine and code; compare them only between runs of similar speed."
    )


def _met(g: dict[str, Any]) -> str:
    return {True: "met", False: "NOT met", None: "n/a"}[g["met"]]


def write_markdown(results: dict[str, Any], path: Path) -> None:
    m = results["meta"]
    lines = [
        f"# DLedger-py benchmarks, {m['started']}",
        "",
        f"Mode: {'quick' if m['quick'] else 'full'}{' + big' if m['big'] else ''}; "
        f"benchmarks: {', '.join(results['benchmarks'])}; wall {m['wall_s']:.0f} s; "
        f"commit `{m['git_commit']}`; {m['host']['cpus']} CPUs, load average before "
        f"{m['host']['loadavg_before'][0]:.2f}, after {m['host']['loadavg_after'][0]:.2f}.",
        "",
        *([sl, ""] if (sl := speed_line(m["host"])) else []),
        "Every figure is the median over repeats with min and max (n = repeats). "
        "The machine is shared, so absolute numbers are noisy; ratios to the peer "
        "(PySyncObj, etcd or NATS JetStream, measured in this same run) are the figures "
        "to compare.",
        "",
        *([w, ""] if (w := load_warning(results)) else []),
        "## Goals",
        "",
        "| goal | target | value | status | detail |",
        "|---|---|---|---|---|",
    ]
    for g in results["goals"]:
        v = "-" if g["value"] is None else f"{_num(g['value'], g['unit'])} {g['unit']}"
        lines.append(f"| {g['goal']} | {g['target']} | {v} | {_met(g)} | {g['detail']} |")
    rows = figure_rows(results)
    for name, b in results["benchmarks"].items():
        lines += ["", f"## {name}", "", f"{b['summary']} ({b['wall_s']:.0f} s)", ""]
        if b.get("error"):
            lines += [f"**failed**: `{b['error']}`", ""]
        if b.get("skipped"):
            lines += [f"**skipped**: {b['skipped']}", ""]
        if b.get("loadavg_start"):
            outside = b.get("outside_cpu_pct")
            lines += [
                f"Load average (1 min) at start {b['loadavg_start'][0]:.2f}, "
                f"at end {b['loadavg_end'][0]:.2f}"
                + (
                    f"; processes outside this run used {outside:.1f}% of the machine."
                    if outside is not None
                    else "."
                ),
                "",
            ]
        if rows[name]:
            lines.append("| " + " | ".join(HEAD) + " |")
            lines.append("|" + "---|" * len(HEAD))
            lines += ["| " + " | ".join(r) + " |" for r in rows[name]]
        for n in b.get("notes", []):
            lines += ["", f"- {n}"]
        for p in b.get("plots", []):
            lines += ["", f"![{p}](plots/{p})"]
        prof = b.get("raw", {}).get("profiles")
        if prof:
            lines += ["", "Leader profiles (cProfile, event-loop thread, top by own time):", ""]
            for shape, pr in prof.items():
                if "by_own" not in pr:
                    lines.append(f"- {shape}: {pr.get('error')}")
                    continue
                tops = ", ".join(
                    f"`{r['function']}` {r['own_s'] / pr['total_own_s']:.0%}"
                    for r in pr["by_own"][:8]
                )
                lines.append(f"- {shape}: {tops}")
    path.write_text("\n".join(lines) + "\n")


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """One PNG per series group, plus one bar chart of ours vs the peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    for _name, b in results["benchmarks"].items():
        groups: dict[str, list[dict[str, Any]]] = {}
        for s in b["series"]:
            groups.setdefault(s["plot"], []).append(s)
        b["plots"] = []
        for plot, series in groups.items():
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for s in series:
                ax.plot(s["x"], s["y"], marker="o", label=s["label"])
            ax.set_xlabel(series[0]["x_label"])
            ax.set_ylabel(series[0]["y_label"])
            if series[0]["log_y"]:
                ax.set_yscale("log")
            ax.set_title(plot.replace("_", " "))
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fn = f"{plot}.png"
            fig.savefig(out / fn, dpi=100)
            plt.close(fig)
            b["plots"].append(fn)
            made.append(fn)
    figs = {f["key"]: f for b in results["benchmarks"].values() for f in b["figures"]}
    pairs = [
        (f, figs[f["peer_key"]])
        for f in figs.values()
        if f.get("peer_key") in figs and f["unit"] in ("msg/s", "ops/s")
    ]
    if pairs:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(pairs) + 1.5))
        labels = [p[0]["label"][:70] for p in pairs]
        ys = list(range(len(pairs)))
        for off, idx, color, lab in (
            (-0.2, 0, "tab:blue", "dledger-py"),
            (0.2, 1, "tab:gray", "peer (PySyncObj, etcd, NATS)"),
        ):
            med = [p[idx]["median"] for p in pairs]
            lo = [p[idx]["median"] - p[idx]["min"] for p in pairs]
            hi = [p[idx]["max"] - p[idx]["median"] for p in pairs]
            ax.barh([y + off for y in ys], med, height=0.4, xerr=[lo, hi], color=color, label=lab)
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("per second (median, min-max)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "vs_peer.png", dpi=100)
        plt.close(fig)
        made.append("vs_peer.png")
        results.setdefault("plots", []).append("vs_peer.png")
    return made


def write_html(results: dict[str, Any], path: Path) -> None:
    m = results["meta"]
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>DLedger-py benchmarks {e(m['started'])}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        "padding:3px 6px}.met{color:green}.not{color:#b00;font-weight:bold}</style>",
        "</head><body>",
        f"<h1>DLedger-py benchmarks, {e(m['started'])}</h1>",
        f"<p>{'quick' if m['quick'] else 'full'} run, commit <code>{e(m['git_commit'])}</code>, "
        f"{m['wall_s']:.0f} s. Medians over repeats with min-max; the peers (PySyncObj, "
        "etcd, NATS JetStream) were "
        "measured in this same run on the same shared, noisy machine. "
        "Raw data: <a href='results.json'>results.json</a>, "
        "<a href='results.md'>results.md</a>.</p>",
        *([f"<p>{e(sl)}</p>"] if (sl := speed_line(m["host"])) else []),
        *([f"<p class='not'>{e(w.strip('*'))}</p>"] if (w := load_warning(results)) else []),
        "<h2>Goals</h2><table><tr><th>goal</th><th>target</th><th>value</th><th>status</th>"
        "<th>detail</th></tr>",
    ]
    for g in results["goals"]:
        cls = {True: "met", False: "not", None: ""}[g["met"]]
        v = "-" if g["value"] is None else f"{_num(g['value'], g['unit'])} {g['unit']}"
        parts.append(
            f"<tr><td>{e(g['goal'])}</td><td>{e(g['target'])}</td><td>{e(v)}</td>"
            f"<td class='{cls}'>{_met(g)}</td><td>{e(g['detail'])}</td></tr>"
        )
    parts.append("</table>")
    for p in results.get("plots", []):
        parts.append(f"<p><img src='plots/{e(p)}'></p>")
    rows = figure_rows(results)
    for name, b in results["benchmarks"].items():
        parts.append(f"<h2>{e(name)}</h2><p>{e(b['summary'])}</p>")
        if b.get("error"):
            parts.append(f"<p class='not'>failed: {e(b['error'])}</p>")
        if b.get("skipped"):
            parts.append(f"<p>skipped: {e(b['skipped'])}</p>")
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in HEAD) + "</tr>")
        for r in rows[name]:
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>")
        parts.append("</table>")
        for n in b.get("notes", []):
            parts.append(f"<p>{e(n)}</p>")
        for p in b.get("plots", []):
            parts.append(f"<p><img src='plots/{e(p)}'></p>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
