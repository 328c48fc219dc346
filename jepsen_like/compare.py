"""``python -m jepsen_like compare``: one seeded workload and one fault
schedule against each replication mode in turn, and one report.

Theory of operation
-------------------
Every mode runs as a multi-group harness run (:mod:`jepsen_like.groups`)
with one broker group and the controller group, so the topology is the
same for all: a raft group elects its own leader (the controller only
holds routes), a controller-mode group is run by the controller. Same
seed, same workload (per queue: ordered producers, a third idempotent,
head readers, a poller; plus unordered producers), same schedule:

    kill:leader, partition:isolate-leader, pause:leader, kill:majority,
    controller:majority, clock:step, power:all, corrupt, disk, then round
    robin over kill, pause, partition, clock, controller, power, corrupt,
    disk

("leader" is each mode's writer: the Raft leader, the controller-mode
master). ``power`` and ``disk`` need the broker group's data directories
on lazyfs (FUSE; :mod:`jepsen_like.lazyfs`): every mode then runs on it,
so throughput and latency here are below what ``benchmarks`` measures on a
plain disk, equally for all modes. Where FUSE is unavailable those steps are
dropped (the run says so) and the report records it. ``corrupt`` damages a
stopped replica's data file; it refuses to start and is rebuilt from its
peers, by the Raft procedure or, in controller mode, once the master's
SyncStateSet no longer names it
(:func:`jepsen_like.nemesis.rebuild_cmode_replica`).

The isolated leader is the case the modes differ on most: a Raft
leader cut off from its group stops confirming at once (and loses its
lease); a master cut off from the controller and its slaves keeps its role
(no lease) while the controller elects another.

Modes (``--modes``): ``raft-3``, ``raft-5`` (Raft voters), ``cp-3``,
``cp-2``, ``ap-3``, ``ap-2`` (controller mode, replicas, the CP or AP
settings of docs/controller-mode.md).

Per mode the report gives, from each run's own checkers: acknowledged
writes lost, duplicated, stale or non-monotonic reads (the queue and
linearizability checkers), the verdict, the RTO per fault kind (the
recovery checker), throughput and produce latency over the run, and bytes
on disk per acknowledged message with the replica count. Plots first, then
a table, then sentences saying which fault cost which mode what.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jepsen_like.runner import RunConfig

COMPARE_SCHEDULE: list[tuple[str, str | None]] = [
    ("kill", "leader"),
    ("partition", "isolate-leader"),
    ("pause", "leader"),
    ("kill", "majority"),
    ("controller", "majority"),
    ("clock", "step"),
    ("power", "all"),
    ("corrupt", None),
    ("disk", None),
]
KINDS = ["kill", "pause", "partition", "clock", "controller", "power", "corrupt", "disk"]
RECOVERY_S = 8.0  # RunConfig.recovery_s: the workload runs this long after the last heal


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    replication: str
    nodes: int
    cmode: str = "cp"

    @property
    def label(self) -> str:
        if self.replication == "raft":
            return f"Raft, {self.nodes} voters"
        return f"controller mode {self.cmode.upper()}, {self.nodes} replicas"


MODES = {
    m.name: m
    for m in (
        Mode("raft-3", "raft", 3),
        Mode("raft-5", "raft", 5),
        Mode("cp-3", "controller", 3, "cp"),
        Mode("cp-2", "controller", 2, "cp"),
        Mode("ap-3", "controller", 3, "ap"),
        Mode("ap-2", "controller", 2, "ap"),
    )
}
DEFAULT_MODES = ["raft-3", "raft-5", "cp-3", "ap-3", "cp-2", "ap-2"]


def _disk_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def losses_by_fault(history: Path, examples: list[dict[str, Any]]) -> dict[str, int]:
    """Each lost write (a queue checker example) by the fault it was
    acknowledged in: ``"during <kind>"`` when the last fault to start before
    its acknowledgement had not healed yet, ``"after <kind>"`` when it had,
    ``"before any fault"`` otherwise."""
    starts: list[tuple[int, str]] = []
    stops: list[int] = []
    try:
        with open(history, "rb") as fh:
            for line in fh:
                if b'"nemesis"' not in line:
                    continue
                o = json.loads(line)
                if o.get("type") != "nemesis":
                    continue
                if o.get("f") == "start":
                    starts.append((int(o["index"]), str(o.get("kind"))))
                elif o.get("f") == "stop":
                    stops.append(int(o["index"]))
    except (OSError, ValueError):
        return {}
    out: dict[str, int] = {}
    for ex in examples:
        at = int((ex.get("produce") or {}).get("complete_index", -1))
        before = [(i, k) for i, k in starts if i <= at]
        if not before:
            tag = "before any fault"
        else:
            i, k = before[-1]
            tag = f"{'after' if any(i < j <= at for j in stops) else 'during'} {k}"
        out[tag] = out.get(tag, 0) + 1
    return out


def _fault_counts(events: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        k = str(e.get("kind", "?"))
        out[k] = out.get(k, 0) + 1
    return out


def summarize_run(mode: Mode, out: Path, rc: int) -> dict[str, Any]:
    """The figures the report compares, from one run's results.json."""
    try:
        res = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {"mode": mode.name, "label": mode.label, "error": f"no results (exit {rc})"}
    ch = res["checkers"]
    q = ch.get("queue", {})
    counts = q.get("counts", {})
    lin = ch.get("linearizable", {})
    rec = ch.get("recovery", {})
    rto: dict[str, float] = {}
    for w in rec.get("windows", []):
        if w.get("rto_ms") is not None:
            rto[w["kind"]] = max(rto.get(w["kind"], 0.0), float(w["rto_ms"]))
        if w.get("unrecovered"):
            rto[w["kind"]] = float("inf")
    ops = res["run"].get("ops_by_f", {})
    produce_ok = int(ops.get("produce", [0, 0, 0])[0])
    # The load runs for the time limit plus the recovery time after the last heal.
    wall = float(res["run"].get("time_limit_s") or 0) + RECOVERY_S or 1.0
    lat = rec.get("latency", {}).get("produce", {})
    g1 = out / "cluster" / "g1"
    disk = _disk_bytes(g1) if g1.exists() else 0
    return {
        "mode": mode.name,
        "label": mode.label,
        "replicas": mode.nodes,
        "verdict": res["verdict"],
        "checkers": {k: v.get("verdict") for k, v in ch.items()},
        "lost": int(counts.get("lost-write", 0)),
        "duplicated": int(counts.get("duplicate", 0)),
        "stale_reads": int(counts.get("stale-read", 0)) + len(lin.get("invalid_keys", [])),
        # Controller mode: entries replicas cut from their logs when they
        # joined a new master (forked or unconfirmed tails; never acknowledged
        # writes unless "lost" says so).
        "truncated": sum(res["run"].get("truncated_entries", {}).values()),
        "other_anomalies": {
            k: v for k, v in counts.items() if k not in ("lost-write", "duplicate", "stale-read")
        },
        "rto_ms": rto,
        "produce_ok": produce_ok,
        "throughput_per_s": round(produce_ok / wall, 1),
        "p50_ms": lat.get("p50_ms"),
        "p99_ms": lat.get("p99_ms"),
        "disk_bytes": disk,
        "bytes_per_message": round(disk / produce_ok, 1) if produce_ok else None,
        "unordered_availability": ch.get("groups", {}).get("unordered_availability"),
        # What the run actually did: steps whose nemesis was unavailable are dropped.
        "lazyfs": bool(res["run"].get("lazyfs")),
        "faults": _fault_counts(res["run"].get("nemesis_events", [])),
        # Where the lost writes were acknowledged (of the examples the queue
        # checker keeps): which fault they are the price of.
        "lost_when": losses_by_fault(
            out / "history.jsonl", q.get("examples", {}).get("lost-write", [])
        )
        if counts.get("lost-write")
        else {},
        "report": str(out / "report.html"),
    }


def run_compare(
    modes: list[str],
    *,
    out: Path,
    seed: int,
    time_limit_s: float,
    log: Any = print,
) -> list[dict[str, Any]]:
    from jepsen_like.groups import GroupsRunner

    rows = []
    for k, name in enumerate(modes):
        mode = MODES[name]
        log(f"[{k + 1}/{len(modes)}] {mode.label}: {time_limit_s:.0f} s, seed {seed}")
        t0 = time.monotonic()
        kinds = list(KINDS)
        cfg = RunConfig(
            nodes=mode.nodes,
            learners=0,
            nemesis=kinds,
            time_limit_s=time_limit_s,
            out=out / name,
            seed=seed,
            queues=2,
            producers=4,
            idempotent_producers=2,
            readers=2,
            pollers=2,
            clients_per_queue=6,
            groups=1,
            unordered=2,
            schedule=list(COMPARE_SCHEDULE),
            replication=mode.replication,
            cmode=mode.cmode,
            quiet=False,  # the run's progress lines: each mode takes a minute or two
        )
        try:
            rc = GroupsRunner(cfg).run()
        except RuntimeError as exc:
            log(f"    {name}: the harness failed: {exc}")
            rc = 3
        row = summarize_run(mode, out / name, rc)
        rows.append(row)
        log(
            f"    {name}: {row.get('verdict', row.get('error'))} in {time.monotonic() - t0:.0f} s; "
            f"lost {row.get('lost')}, duplicated {row.get('duplicated')}, stale reads "
            f"{row.get('stale_reads')}, {row.get('throughput_per_s')} acknowledged produces/s"
        )
    return rows


# -- the report ------------------------------------------------------------------------------
_W, _H = 640, 220


def _bars(title: str, rows: list[dict[str, Any]], key: str, unit: str = "") -> str:
    vals = []
    for r in rows:
        v = r.get(key)
        vals.append(None if v is None else float(v))
    finite = [v for v in vals if v is not None and v != float("inf")]
    top = max([*finite, 1.0])
    n = max(len(rows), 1)
    bw = (_W - 60) / n
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{_W / 2}" y="14" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
        f'<line x1="40" y1="{_H - 40}" x2="{_W - 10}" y2="{_H - 40}" stroke="#333"/>',
    ]
    for k, (r, v) in enumerate(zip(rows, vals, strict=True)):
        x = 45 + k * bw
        h = 0.0 if v is None else (_H - 70) * (1.0 if v == float("inf") else v / top)
        color = "#d62728" if (key in ("lost", "duplicated", "stale_reads") and v) else "#1f77b4"
        out.append(
            f'<rect x="{x:.1f}" y="{_H - 40 - h:.1f}" width="{bw - 10:.1f}" height="{h:.1f}" '
            f'fill="{color}"/>'
        )
        tag = "-" if v is None else ("never" if v == float("inf") else f"{v:g}{unit}")
        out.append(
            f'<text x="{x + (bw - 10) / 2:.1f}" y="{_H - 44 - h:.1f}" text-anchor="middle">'
            f"{html.escape(tag)}</text>"
            f'<text x="{x + (bw - 10) / 2:.1f}" y="{_H - 26}" text-anchor="middle">'
            f"{html.escape(r['mode'])}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def sentences(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['label']}: the run did not complete ({r['error']}).")
            continue
        cost = []
        if r["lost"]:
            when = r.get("lost_when") or {}
            cost.append(
                f"lost {r['lost']} acknowledged writes"
                + (
                    " (acknowledged "
                    + ", ".join(f"{k}: {n}" for k, n in sorted(when.items()))
                    + (
                        f", of {sum(when.values())} examined)"
                        if sum(when.values()) < r["lost"]
                        else ")"
                    )
                    if when
                    else ""
                )
            )
        if r["duplicated"]:
            cost.append(f"stored {r['duplicated']} writes twice")
        if r.get("truncated"):
            cost.append(f"cut {r['truncated']} unconfirmed entries from replicas' logs")
        if r["stale_reads"]:
            cost.append(f"served {r['stale_reads']} stale reads or invalid read keys")
        slow = {k: v for k, v in r["rto_ms"].items() if v == float("inf") or v > 3000}
        if slow:
            cost.append(
                "stayed unavailable "
                + ", ".join(
                    f"{'until the end' if v == float('inf') else f'{v / 1000:.1f} s'} after {k}"
                    for k, v in sorted(slow.items())
                )
            )
        out.append(
            f"{r['label']}: "
            + ("; ".join(cost) if cost else "no anomaly, and recovered within 3 s of every fault")
            + f" (verdict {r['verdict']}; {r['replicas']} copies of each message)."
        )
    return out


def html_report(
    rows: list[dict[str, Any]], seed: int, time_limit_s: float, *, links: bool = True
) -> str:
    """The comparison page; ``links``: link each mode's own run report (off
    for a copy kept without the runs' directories)."""
    ok = [r for r in rows if "error" not in r]
    kinds = sorted({k for r in ok for k in r["rto_ms"]})
    rto_plots = "".join(
        _bars(
            f"RTO after {k} (ms)", [{**r, f"rto_{k}": r["rto_ms"].get(k)} for r in ok], f"rto_{k}"
        )
        for k in kinds
    )
    table_rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                r["label"],
                r.get("verdict", r.get("error")),
                r.get("lost"),
                r.get("duplicated"),
                r.get("truncated"),
                r.get("stale_reads"),
                r.get("throughput_per_s"),
                r.get("p50_ms"),
                r.get("p99_ms"),
                r.get("replicas"),
                r.get("bytes_per_message"),
                r.get("unordered_availability"),
                ", ".join(f"{k} {n}" for k, n in sorted(r.get("faults", {}).items())),
            )
        )
        + (
            f'<td><a href="{html.escape(os.path.join(r["mode"], "report.html"))}">run report</a></td>'
            if links
            else "<td></td>"
        )
        + "</tr>"
        if "report" in r
        else f"<tr><td>{html.escape(r['label'])}</td><td colspan=13>{html.escape(r['error'])}</td></tr>"
        for r in rows
    )
    said = "".join(f"<li>{html.escape(s)}</li>" for s in sentences(rows))
    sched = ", ".join(f"{k}:{s or '*'}" for k, s in COMPARE_SCHEDULE)
    on_lazyfs = [r["mode"] for r in ok if r.get("lazyfs")]
    if len(on_lazyfs) == len(ok):
        lazy = (
            "The broker group's data directories were on lazyfs (FUSE), for the power and disk "
            "faults, in every mode: throughput and latency are below a plain disk's, equally."
        )
    else:
        lazy = (
            "lazyfs (FUSE) was unavailable for "
            + ", ".join(r["mode"] for r in ok if not r.get("lazyfs"))
            + ": the power and disk steps were dropped there (see faults injected)."
        )
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>jepsen_like compare</title>
<style>body{{font-family:sans-serif;margin:20px;max-width:1000px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}
th{{background:#f3f3f3}}</style></head><body>
<h1>Raft against controller mode: one workload, one fault schedule</h1>
<p>Seed {seed}, {time_limit_s:.0f} s of load per mode, one broker group and the controller
group; schedule {html.escape(sched)}, then round robin over {", ".join(KINDS)}.
{lazy}</p>
{_bars("acknowledged writes lost", ok, "lost")}
{_bars("writes stored twice", ok, "duplicated")}
{_bars("entries truncated from replicas' logs (forked or unconfirmed tails)", ok, "truncated")}
{_bars("stale reads / invalid read keys", ok, "stale_reads")}
{_bars("acknowledged produces per second (whole run)", ok, "throughput_per_s")}
{_bars("produce p99 latency (ms)", ok, "p99_ms")}
{_bars("bytes on disk per acknowledged message (all replicas)", ok, "bytes_per_message")}
{rto_plots}
<h2>What each fault cost each mode</h2><ul>{said}</ul>
<h2>Table</h2>
<table><tr><th>mode</th><th>verdict</th><th>lost</th><th>duplicated</th><th>truncated</th><th>stale reads</th>
<th>produces/s</th><th>p50 ms</th><th>p99 ms</th><th>replicas</th><th>bytes/message</th>
<th>unordered availability in outages</th><th>faults injected</th><th></th></tr>{table_rows}</table>
</body></html>
"""


def main(modes: list[str], out: Path, seed: int, time_limit_s: float) -> int:
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"unknown modes {bad} (known: {', '.join(MODES)})")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = run_compare(modes, out=out, seed=seed, time_limit_s=time_limit_s)
    (out / "compare.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "compare.html").write_text(html_report(rows, seed, time_limit_s))
    for s in sentences(rows):
        print(s)
    print(f"report: {out / 'compare.html'}")
    return 0 if all("error" not in r for r in rows) else 3
