"""The HTML report: verdicts, plots as inline SVG, RTO per fault, anomalies.

No plotting dependency: the three plots (latency over time with fault
windows shaded, throughput over time, RTO per fault window) are drawn as
inline SVG, so the page is one self-contained file a browser opens.
"""

from __future__ import annotations

import html
import json
from typing import Any

from jepsen_like.history import History

_W, _H, _PAD = 960, 260, 44
_COLORS = {
    "produce": "#1f77b4",
    "read": "#2ca02c",
    "poll": "#9467bd",
    "commit_offset": "#8c564b",
    "seek": "#7f7f7f",
    "final_read": "#17becf",
}
_FAULT_COLORS = {
    "kill": "#d62728",
    "pause": "#ff7f0e",
    "partition": "#bcbd22",
    "clock": "#17becf",
    "corrupt": "#e377c2",
}
_MS = 1_000_000


def _esc(x: object) -> str:
    return html.escape(str(x))


def _frame(title: str, body: list[str], xmax: float, ylabel: str, ymax: float, log: bool) -> str:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">',
        f'<text x="{_W / 2}" y="14" text-anchor="middle" font-size="13">{_esc(title)}</text>',
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - 10}" y2="{_H - _PAD}" stroke="#333"/>',
        f'<line x1="{_PAD}" y1="20" x2="{_PAD}" y2="{_H - _PAD}" stroke="#333"/>',
    ]
    for k in range(6):
        t = xmax * k / 5
        x = _PAD + (_W - _PAD - 10) * k / 5
        out.append(f'<text x="{x:.1f}" y="{_H - _PAD + 14}" text-anchor="middle">{t:.0f}s</text>')
    for k in range(5):
        frac = k / 4
        y = _H - _PAD - (_H - _PAD - 20) * frac
        v = (10 ** (frac * _log10(ymax))) if log else ymax * frac
        out.append(f'<text x="{_PAD - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    out.append(
        f'<text x="12" y="{_H / 2}" transform="rotate(-90 12 {_H / 2})" '
        f'text-anchor="middle">{_esc(ylabel)}</text>'
    )
    out += body
    out.append("</svg>")
    return "\n".join(out)


def _log10(x: float) -> float:
    import math

    return math.log10(max(x, 1.0))


def _sx(t_s: float, xmax: float) -> float:
    return _PAD + (_W - _PAD - 10) * (t_s / xmax if xmax > 0 else 0)


def _windows(history: History, t0: int, xmax: float) -> list[str]:
    out = []
    end_ns = t0 + int(xmax * 1e9)
    for w in history.faults:
        a = _sx((w.start_ns - t0) / 1e9, xmax)
        b = _sx(((w.stop_ns if w.stop_ns is not None else end_ns) - t0) / 1e9, xmax)
        color = _FAULT_COLORS.get(w.kind, "#999")
        out.append(
            f'<rect x="{a:.1f}" y="20" width="{max(1.0, b - a):.1f}" height="{_H - _PAD - 20}" '
            f'fill="{color}" fill-opacity="0.15"><title>{_esc(w.kind)} '
            f"{_esc(list(w.targets))}</title></rect>"
        )
    return out


def latency_svg(history: History) -> str:
    ops = [o for o in history.ops if o.complete_ns is not None]
    if not ops:
        return "<p>no completed operations</p>"
    t0 = min(o.invoke_ns for o in history.ops)
    xmax = max((o.complete_ns or o.invoke_ns) - t0 for o in history.ops) / 1e9 or 1.0
    lat_max = max((o.complete_ns or 0) - o.invoke_ns for o in ops) / _MS
    lmax = _log10(max(lat_max, 10.0))
    body = _windows(history, t0, xmax)
    step = max(1, len(ops) // 6000)  # keep the page light
    for o in ops[::step]:
        assert o.complete_ns is not None
        lat = max((o.complete_ns - o.invoke_ns) / _MS, 1.0)
        x = _sx((o.complete_ns - t0) / 1e9, xmax)
        y = _H - _PAD - (_H - _PAD - 20) * (_log10(lat) / lmax)
        color = _COLORS.get(o.f, "#000")
        shape = (
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.6" fill="{color}"/>'
            if o.status == "ok"
            else f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="4" height="4" '
            f'fill="{"#d62728" if o.status == "info" else "#ff7f0e"}"/>'
        )
        body.append(shape)
    return _frame(
        "latency by completion time (log scale; squares: fail orange, info red; "
        "shaded: fault windows)",
        body,
        xmax,
        "latency ms",
        10**lmax,
        True,
    )


def throughput_svg(history: History, recovery: dict[str, Any]) -> str:
    tl = recovery.get("timeline", {})
    buckets = tl.get("buckets", [])
    if not buckets:
        return "<p>no timeline</p>"
    bucket_s = tl.get("bucket_ms", 1000) / 1000
    t0 = tl.get("t0_ns", 0)
    xmax = len(buckets) * bucket_s
    fs = sorted({f for b in buckets for f in b["f"]})
    ymax = max((b["f"][f]["ok"] / bucket_s for b in buckets for f in b["f"]), default=1.0) or 1.0
    body = _windows(history, t0, xmax)
    for f in fs:
        pts = []
        for k, b in enumerate(buckets):
            ok = b["f"].get(f, {}).get("ok", 0) / bucket_s
            x = _sx(k * bucket_s + bucket_s / 2, xmax)
            y = _H - _PAD - (_H - _PAD - 20) * ok / ymax
            pts.append(f"{x:.1f},{y:.1f}")
        body.append(
            f'<polyline fill="none" stroke="{_COLORS.get(f, "#000")}" stroke-width="1.4" '
            f'points="{" ".join(pts)}"><title>{_esc(f)}</title></polyline>'
        )
    legend = " ".join(
        f'<tspan fill="{_COLORS.get(f, "#000")}">&#9632; {_esc(f)}</tspan>' for f in fs
    )
    body.append(f'<text x="{_PAD + 8}" y="32">{legend}</text>')
    return _frame("ok operations per second", body, xmax, "ops/s", ymax, False)


def rto_svg(recovery: dict[str, Any]) -> str:
    windows = recovery.get("windows", [])
    if not windows:
        return "<p>no fault windows</p>"
    vals = [w.get("rto_ms") or 0.0 for w in windows]
    ymax = max(max(vals), 1.0)
    n = len(windows)
    bw = (_W - _PAD - 10) / max(n, 1)
    body = []
    for k, w in enumerate(windows):
        v = w.get("rto_ms")
        h = (_H - _PAD - 20) * ((v or 0.0) / ymax)
        x = _PAD + k * bw
        color = _FAULT_COLORS.get(w["kind"], "#999")
        label = "not impacted" if v is None else f"{v:.0f} ms"
        body.append(
            f'<rect x="{x + 1:.1f}" y="{_H - _PAD - h:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="{color}"><title>#{k} {_esc(w["kind"])} '
            f"{_esc(w.get('targets'))}: {label}</title></rect>"
        )
        if n <= 40:
            body.append(
                f'<text x="{x + bw / 2:.1f}" y="{_H - _PAD + 26}" text-anchor="middle" '
                f'font-size="9">{_esc(w["kind"][:5])}</text>'
            )
    out = _frame("RTO per fault window (ms)", body, float(n), "RTO ms", ymax, False)
    # the x axis of the bar chart is the window number, not seconds
    return out.replace("s</text>", "</text>")


def html_report(results: dict[str, Any], history: History) -> str:
    checkers = results.get("checkers", {})
    rec = checkers.get("recovery", {})
    rows = []
    for name, r in checkers.items():
        v = r.get("verdict", "?")
        color = {"valid": "#2ca02c", "invalid": "#d62728"}.get(v, "#ff7f0e")
        summary = {
            k: r[k]
            for k in (
                "anomaly_types",
                "invalid_keys",
                "unknown_keys",
                "max_rto_ms",
                "unrecovered_windows",
                "unexpected_exits",
                "warnings",
            )
            if k in r
        }
        rows.append(
            f'<tr><td>{_esc(name)}</td><td style="color:{color};font-weight:bold">{_esc(v)}'
            f"</td><td><code>{_esc(json.dumps(summary))}</code></td></tr>"
        )
    wrows = []
    events = [
        e for e in results.get("run", {}).get("nemesis_events", []) if e["kind"] != "corrupt-late"
    ]
    for k, w in enumerate(rec.get("windows", [])):
        e = events[k] if k < len(events) and events[k]["kind"] == w["kind"] else {}
        damage: dict[str, Any] = e["damage"] if isinstance(e.get("damage"), dict) else {}
        shape = e.get("shape") or e.get("mode") or damage.get("mode") or ""
        if e.get("refused"):
            shape += ", refused at start, rebuilt" if e.get("rebuilt") else ", refused at start"
        wrows.append(
            f"<tr><td>{k}</td><td>{_esc(w['kind'])}</td><td>{_esc(shape)}</td>"
            f"<td>{_esc(w.get('targets'))}</td>"
            f"<td>{_esc(w.get('duration_ms'))}</td><td>{_esc(w.get('rto_ms'))}</td>"
            f"<td>{_esc(w.get('unrecovered'))}</td></tr>"
        )
    queue = checkers.get("queue", {})
    examples = json.dumps(queue.get("examples", {}), indent=1)[:20000]
    lin_bad = {
        k: v
        for k, v in checkers.get("linearizable", {}).get("keys", {}).items()
        if v.get("verdict") != "valid"
    }
    run = results.get("run", {})
    verdict = results.get("verdict", "?")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jepsen_like: {_esc(verdict)}</title>
<style>body{{font-family:sans-serif;margin:20px;max-width:1000px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}
pre{{background:#f6f6f6;padding:8px;overflow:auto;max-height:400px}}</style></head>
<body>
<h1>jepsen_like run: <span style="color:{"#2ca02c" if verdict == "valid" else "#d62728"}">
{_esc(verdict)}</span></h1>
<p>{_esc(run.get("nodes"))} voters, {_esc(run.get("learners"))} learners, nemeses
{_esc(run.get("nemesis"))}, {_esc(run.get("time_limit_s"))} s, network namespaces:
{_esc(run.get("netns"))}, {_esc(results.get("ops"))} operations,
{_esc(results.get("faults"))} fault windows. {_esc(run.get("notes", ""))}</p>
<h2>Checkers</h2><table><tr><th>checker</th><th>verdict</th><th>summary</th></tr>
{"".join(rows)}</table>
<h2>Latency</h2>{latency_svg(history)}
<h2>Throughput</h2>{throughput_svg(history, rec)}
<h2>Recovery</h2>{rto_svg(rec)}
<table><tr><th>#</th><th>fault</th><th>shape</th><th>targets</th><th>duration ms</th><th>RTO ms</th>
<th>unrecovered</th></tr>{"".join(wrows)}</table>
<p>Unavailability outside fault windows: <code>{_esc(json.dumps(rec.get("unavailability", [])))}</code></p>
<h2>Queue anomalies (examples)</h2><pre>{_esc(examples)}</pre>
<h2>Linearizability: keys not valid</h2><pre>{_esc(json.dumps(lin_bad, indent=1)[:20000])}</pre>
</body></html>
"""
