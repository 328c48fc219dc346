"""The HTML report: verdicts, plots as inline SVG, RTO per fault, anomalies.

No plotting dependency: the three plots (latency over time with fault
windows shaded, throughput over time, RTO per fault window) are drawn as
inline SVG, so the page is one self-contained file a browser opens.
"""

from __future__ import annotations

import html
import math
from typing import Any

from jepsen_like.history import History
from jepsen_like.summary import detail, queue_sentence, reasons, verdict_line

_W, _H, _PAD = 960, 280, 64  # _PAD: room for the y labels on the left, ticks below
_TOP = 34  # room for the title and the legend
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
    "power": "#8c564b",
    "disk": "#7f7f7f",
}
_MS = 1_000_000


def _esc(x: object) -> str:
    return html.escape(str(x))


def _ms_label(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g} s"
    return f"{v:g} ms"


def _frame(
    title: str,
    body: list[str],
    xmax: float,
    ylabel: str,
    ymax: float,
    log: bool,
    *,
    xticks: bool = True,
    legend: str = "",
) -> str:
    plot_h = _H - _PAD - _TOP
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">',
        f'<text x="{_W / 2}" y="14" text-anchor="middle" font-size="13">{_esc(title)}</text>',
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - 10}" y2="{_H - _PAD}" stroke="#333"/>',
        f'<line x1="{_PAD}" y1="{_TOP}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#333"/>',
    ]
    if legend:
        out.append(f'<text x="{_PAD + 4}" y="{_TOP - 6}" font-size="10">{legend}</text>')
    if xticks:
        step = _nice_step(xmax / 8) if xmax > 0 else 1.0
        t = 0.0
        while t <= xmax + 1e-9:
            x = _sx(t, xmax)
            out.append(
                f'<line x1="{x:.1f}" y1="{_H - _PAD}" x2="{x:.1f}" y2="{_H - _PAD + 4}" '
                'stroke="#333"/>'
                f'<text x="{x:.1f}" y="{_H - _PAD + 16}" text-anchor="middle">{t:g} s</text>'
            )
            t += step
    if log:
        # Powers of ten only: 1 ms, 10 ms, 100 ms, 1 s, 10 s.
        top = _log10(ymax)
        e = 0
        while e <= top + 1e-9:
            y = _H - _PAD - plot_h * (e / top if top > 0 else 0)
            out.append(
                f'<line x1="{_PAD - 4}" y1="{y:.1f}" x2="{_W - 10}" y2="{y:.1f}" '
                'stroke="#eee"/>'
                f'<text x="{_PAD - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{_esc(_ms_label(10.0**e))}</text>"
            )
            e += 1
    else:
        step = _nice_step(ymax / 4) if ymax > 0 else 1.0
        v = 0.0
        while v <= ymax + 1e-9:
            y = _H - _PAD - plot_h * (v / ymax if ymax > 0 else 0)
            out.append(
                f'<line x1="{_PAD - 4}" y1="{y:.1f}" x2="{_W - 10}" y2="{y:.1f}" '
                'stroke="#eee"/>'
                f'<text x="{_PAD - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>'
            )
            v += step
    out.append(
        f'<text x="12" y="{(_TOP + _H - _PAD) / 2}" '
        f'transform="rotate(-90 12 {(_TOP + _H - _PAD) / 2})" '
        f'text-anchor="middle">{_esc(ylabel)}</text>'
    )
    out += body
    out.append("</svg>")
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``."""
    import math

    if raw <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * p >= raw:
            return float(m * p)
    return float(10 * p)


def _fault_legend(history: History) -> str:
    kinds = sorted({w.kind for w in history.faults})
    if not kinds:
        return ""
    items = " ".join(
        f'<tspan fill="{_FAULT_COLORS.get(k, "#999")}" fill-opacity="0.6">&#9608;</tspan>'
        f"<tspan> {_esc(k)}  </tspan>"
        for k in kinds
    )
    return f"shaded fault windows: {items}"


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
            f'<rect x="{a:.1f}" y="{_TOP}" width="{max(1.0, b - a):.1f}" height="{_H - _PAD - _TOP}" '
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
    lmax = float(math.ceil(_log10(max(lat_max, 10.0))))  # the top is a power of ten
    body = _windows(history, t0, xmax)
    step = max(1, len(ops) // 6000)  # keep the page light
    for o in ops[::step]:
        assert o.complete_ns is not None
        lat = max((o.complete_ns - o.invoke_ns) / _MS, 1.0)
        x = _sx((o.complete_ns - t0) / 1e9, xmax)
        y = _H - _PAD - (_H - _PAD - _TOP) * (_log10(lat) / lmax)
        color = _COLORS.get(o.f, "#000")
        shape = (
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.6" fill="{color}"/>'
            if o.status == "ok"
            else f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="4" height="4" '
            f'fill="{"#d62728" if o.status == "info" else "#ff7f0e"}"/>'
        )
        body.append(shape)
    marks = (
        " ".join(
            f'<tspan fill="{_COLORS[f]}">&#9679;</tspan><tspan> {_esc(f)} ok  </tspan>'
            for f in sorted({o.f for o in ops} & set(_COLORS))
        )
        + '<tspan fill="#ff7f0e">&#9632;</tspan><tspan> fail  </tspan>'
        + '<tspan fill="#d62728">&#9632;</tspan><tspan> info</tspan>'
    )
    legend = marks + "   " + _fault_legend(history)
    return _frame(
        "latency by completion time (log scale)",
        body,
        xmax,
        "latency",
        10**lmax,
        True,
        legend=legend,
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
            y = _H - _PAD - (_H - _PAD - _TOP) * ok / ymax
            pts.append(f"{x:.1f},{y:.1f}")
        body.append(
            f'<polyline fill="none" stroke="{_COLORS.get(f, "#000")}" stroke-width="1.4" '
            f'points="{" ".join(pts)}"><title>{_esc(f)}</title></polyline>'
        )
    legend = " ".join(
        f'<tspan fill="{_COLORS.get(f, "#000")}">&#9644;</tspan><tspan> {_esc(f)}  </tspan>'
        for f in fs
    )
    legend += "   " + _fault_legend(history)
    ymax = _nice_step(ymax / 4) * 4 if ymax > 0 else 1.0
    return _frame("ok operations per second", body, xmax, "ops/s", ymax, False, legend=legend)


def rto_svg(recovery: dict[str, Any], events: list[dict[str, Any]] | None = None) -> str:
    windows = recovery.get("windows", [])
    if not windows:
        return "<p>no fault windows</p>"
    vals = [w.get("rto_ms") or 0.0 for w in windows]
    ymax = _nice_step(max(max(vals), 1.0) / 4) * 4
    n = len(windows)
    plot_h = _H - _PAD - _TOP
    bw = (_W - _PAD - 10) / max(n, 1)
    body = []
    for k, w in enumerate(windows):
        v = w.get("rto_ms")
        h = plot_h * ((v or 0.0) / ymax)
        x = _PAD + k * bw
        color = _FAULT_COLORS.get(w["kind"], "#999")
        value = "not impacted" if v is None else f"{v:.0f} ms"
        shape = _shape_of(events, k, w)
        body.append(
            f'<rect x="{x + 1:.1f}" y="{_H - _PAD - h:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="{color}"><title>#{k} {_esc(w["kind"])} {_esc(shape)} '
            f"{_esc(w.get('targets'))}: {value}</title></rect>"
        )
        cx = x + bw / 2
        # Labels only where they fit: about 6 px per character at 10 px.
        label = f"{w['kind']} {shape}".strip()
        if bw >= 6 * len(label):
            body.append(
                f'<text x="{cx:.1f}" y="{_H - _PAD + 14}" text-anchor="middle" '
                f'font-size="10">{_esc(label)}</text>'
            )
        elif bw >= 14:
            # Vertical, under the axis, clipped to the room there is.
            short = label[:10]
            body.append(
                f'<text x="{cx + 3:.1f}" y="{_H - _PAD + 6}" font-size="9" '
                f'transform="rotate(90 {cx + 3:.1f} {_H - _PAD + 6})">{_esc(short)}</text>'
            )
        tag = "-" if v is None else f"{v:.0f}"
        if bw >= 7 * len(tag):
            body.append(
                f'<text x="{cx:.1f}" y="{_H - _PAD - h - 3:.1f}" text-anchor="middle" '
                f'font-size="10">{_esc(tag)}</text>'
            )
    legend = " ".join(
        f'<tspan fill="{_FAULT_COLORS.get(k, "#999")}">&#9608;</tspan><tspan> {_esc(k)}  </tspan>'
        for k in sorted({w["kind"] for w in windows})
    )
    return _frame(
        "RTO per fault window (ms; the number above a bar; no bar: not impacted)",
        body,
        float(n),
        "RTO ms",
        ymax,
        False,
        xticks=False,
        legend=legend,
    )


def groups_svg(g: dict[str, Any]) -> str:
    """Unordered produces acknowledged during each whole-group outage, with
    the figure a producer that never moves would get (dashed)."""
    outs = [o for o in g.get("outages", []) if o.get("group") != "controller"]
    if not outs:
        return "<p>no whole-group outage</p>"
    n = len(outs)
    plot_h = _H - _PAD - _TOP
    bw = (_W - _PAD - 10) / n
    body = []
    for k, o in enumerate(outs):
        v = o.get("unordered_availability")
        h = plot_h * (v or 0.0)
        x = _PAD + k * bw
        u = o.get("unordered", {})
        body.append(
            f'<rect x="{x + 2:.1f}" y="{_H - _PAD - h:.1f}" width="{max(bw - 4, 1):.1f}" '
            f'height="{h:.1f}" fill="#1f77b4"><title>{_esc(o["group"])} {_esc(o["kind"])} '
            f"{_esc(o['targets'])}: {u.get('ok', 0)}/{u.get('invoked', 0)} acknowledged"
            "</title></rect>"
        )
        cx = x + bw / 2
        tag = "-" if v is None else f"{v * 100:.0f}%"
        body.append(
            f'<text x="{cx:.1f}" y="{_H - _PAD - h - 3:.1f}" text-anchor="middle" '
            f'font-size="10">{_esc(tag)}</text>'
            f'<text x="{cx:.1f}" y="{_H - _PAD + 14}" text-anchor="middle" font-size="10">'
            f"{_esc(o['group'])} down</text>"
        )
    naive = g.get("naive_availability")
    if naive is not None:
        y = _H - _PAD - plot_h * naive
        body.append(
            f'<line x1="{_PAD}" y1="{y:.1f}" x2="{_W - 10}" y2="{y:.1f}" stroke="#d62728" '
            f'stroke-dasharray="5,4"><title>never moving: {naive * 100:.0f}%</title></line>'
        )
    return _frame(
        "Unordered produces acknowledged during each whole-group outage "
        "(dashed: a producer that never moves to another group)",
        body,
        float(n),
        "acknowledged",
        1.0,
        False,
        xticks=False,
    )


def groups_html(g: dict[str, Any] | None) -> str:
    if not g:
        return ""
    rows = [
        [
            _esc(name),
            _esc(r.get("verdict")),
            _esc(r.get("queues")),
            _esc(r.get("ops")),
            _esc(r.get("faults")),
            _esc(r.get("max_rto_ms")),
            _esc(len(r.get("unavailability", []))),
        ]
        for name, r in g.get("groups", {}).items()
    ]
    orows = [
        [
            _esc(o["group"]),
            _esc(o["kind"]),
            _esc(o["targets"]),
            _esc(o.get("duration_ms")),
            _esc(o.get("unordered", o.get("produces"))),
            _esc(o.get("ordered_on_dead_group", "-")),
            _esc(", ".join(o.get("ordered_errors", [])[:6]) or "-"),
        ]
        for o in g.get("outages", [])
    ]
    return (
        "<h2>Broker groups</h2>"
        + groups_svg(g)
        + "<p>Recovery per group: its queues' operations and the faults on its nodes "
        "only (a fault elsewhere, the controller's included, excuses no gap).</p>"
        + _table(
            ["group", "verdict", "queues", "ops", "faults", "max RTO ms", "gaps outside faults"],
            rows,
        )
        + "<p>Outages of a whole group or of the controller's majority.</p>"
        + _table(
            [
                "group",
                "fault",
                "targets",
                "duration ms",
                "unordered produces (or all, controller)",
                "ordered produces to the dead group",
                "their errors",
            ],
            orows,
        )
    )


def _shape_of(events: list[dict[str, Any]] | None, k: int, w: dict[str, Any]) -> str:
    if not events or k >= len(events) or events[k].get("kind") != w.get("kind"):
        return ""
    e = events[k]
    damage = e.get("damage") if isinstance(e.get("damage"), dict) else {}
    return str(e.get("shape") or e.get("mode") or (damage or {}).get("mode") or "")


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _op_cells(op: dict[str, Any]) -> list[str]:
    res = op.get("results")
    if res is not None and len(res) > 8:
        shown = f"{res[:4]} ... {res[-2:]} ({len(res)})"
    else:
        shown = "" if res is None else str(res)
    return [
        _esc(op.get("invoke_index")),
        _esc(op.get("process")),
        _esc(op.get("f")),
        _esc(op.get("type")),
        _esc(op.get("value", "")),
        _esc(op.get("offset", "")),
        _esc(shown),
        _esc(op.get("consistency", "")),
    ]


_OP_HEAD = ["#", "process", "f", "type", "value", "offset", "result", "consistency"]


def html_report(results: dict[str, Any], history: History) -> str:
    checkers = results.get("checkers", {})
    rec = checkers.get("recovery", {})
    why = reasons(results, max_per=5)
    rows = []
    for name, r in checkers.items():
        v = r.get("verdict", "?")
        color = {"valid": "#2ca02c", "invalid": "#d62728"}.get(v, "#ff7f0e")
        rows.append(
            [
                _esc(name),
                f'<span style="color:{color};font-weight:bold">{_esc(v)}</span>',
                _esc(detail(name, r)),
            ]
        )
    why_html = "".join(
        f"<h3>why {_esc(name)} is {_esc(checkers[name]['verdict'])}</h3><ul>"
        + "".join(f"<li>{_esc(x.strip())}</li>" for x in lines)
        + "</ul>"
        for name, lines in why.items()
    )
    wrows = []
    events = [
        e for e in results.get("run", {}).get("nemesis_events", []) if e["kind"] != "corrupt-late"
    ]
    for k, w in enumerate(rec.get("windows", [])):
        e = events[k] if k < len(events) and events[k]["kind"] == w["kind"] else {}
        shape = _shape_of(events, k, w)
        if e.get("refused"):
            shape += ", refused at start, rebuilt" if e.get("rebuilt") else ", refused at start"
        wrows.append(
            [
                _esc(k),
                _esc(w["kind"]),
                _esc(shape),
                _esc(w.get("targets")),
                _esc(w.get("duration_ms")),
                _esc(w.get("rto_ms")),
                _esc(w.get("unrecovered")),
            ]
        )
    gaps = [
        [_esc(g.get("from_ns")), _esc(g.get("to_ns")), _esc(g.get("duration_ms"))]
        for g in rec.get("unavailability", [])
    ]
    queue = checkers.get("queue", {})
    qrows = []
    for a in queue.get("anomaly_types", []):
        exs = queue.get("examples", {}).get(a, [])
        qrows.append(
            [
                _esc(a),
                _esc(queue.get("counts", {}).get(a, 0)),
                "<br>".join(_esc(queue_sentence(a, ex)) for ex in exs),
            ]
        )
    lin = checkers.get("linearizable", {})
    lin_html = []
    for key, v in sorted(lin.get("keys", {}).items()):
        if v.get("verdict") == "valid":
            continue
        lin_html.append(
            f"<h3>{_esc(key)}: {_esc(v.get('verdict'))}</h3>"
            f"<p>{_esc(v.get('explanation') or v.get('reason') or '')}</p>"
        )
        if v.get("note"):
            lin_html.append(f"<p><i>{_esc(v['note'])}</i></p>")
        if v.get("window"):
            lin_html.append("<p>smallest failing window:</p>")
            lin_html.append(_table(_OP_HEAD, [_op_cells(op) for op in v["window"]]))
        elif v.get("stuck_at"):
            lin_html.append("<p>stuck at:</p>")
            lin_html.append(_table(_OP_HEAD, [_op_cells(v["stuck_at"])]))
    ld = results.get("load") or {}
    load_rows = []
    if ld:
        share = ld.get("info_share_in_faults")
        load_rows = [
            ["operations", _esc(ld.get("ops"))],
            ["info (unknown outcome)", f"{ld.get('info_share', 0) * 100:.1f}%"],
            [
                "info among ops invoked in fault windows",
                "-" if share is None else f"{share * 100:.1f}% of {_esc(ld.get('ops_in_faults'))}",
            ],
            ["mean ops overlapping an op (same queue)", _esc(ld.get("mean_overlap"))],
            ["... among linearizability participants", _esc(ld.get("mean_overlap_lin"))],
            ["max overlap", _esc(ld.get("max_overlap"))],
        ]
    run = results.get("run", {})
    verdict = results.get("verdict", "?")
    sched = ", ".join(run.get("schedule", [])) or "-"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jepsen_like: {_esc(verdict)}</title>
<style>body{{font-family:sans-serif;margin:20px;max-width:1000px}}
table{{border-collapse:collapse;margin:6px 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;vertical-align:top}}
th{{background:#f3f3f3;text-align:left}}</style></head>
<body>
<h1>jepsen_like run: <span style="color:{"#2ca02c" if verdict == "valid" else "#d62728"}">
{_esc(verdict)}</span></h1>
<p><code>{_esc(verdict_line(results))}</code></p>
<p>{_esc(run.get("nodes"))} voters, {_esc(run.get("learners"))} learners, nemeses
{_esc(run.get("nemesis"))}, {_esc(run.get("time_limit_s"))} s, seed {_esc(run.get("seed"))},
network namespaces: {_esc(run.get("netns"))}, {_esc(results.get("ops"))} operations,
{_esc(results.get("faults"))} fault windows; schedule: {_esc(sched)}.
{_esc(run.get("notes", ""))}</p>
<h2>Checkers</h2>{_table(["checker", "verdict", "summary"], rows)}
{why_html}
<h2>Load</h2>{_table(["figure", "value"], load_rows) if load_rows else "<p>-</p>"}
<h2>Latency</h2>{latency_svg(history)}
<h2>Throughput</h2>{throughput_svg(history, rec)}
<h2>Recovery</h2>{rto_svg(rec, events)}
{_table(["#", "fault", "shape", "targets", "duration ms", "RTO ms", "unrecovered"], wrows)}
<p>Unavailability outside fault windows:</p>
{_table(["from ns", "to ns", "duration ms"], gaps) if gaps else "<p>none</p>"}
{groups_html(checkers.get("groups"))}
<h2>Queue anomalies</h2>
{_table(["anomaly", "count", "examples"], qrows) if qrows else "<p>none</p>"}
<h2>Linearizability: keys not valid</h2>{"".join(lin_html) or "<p>none</p>"}
</body></html>
"""
