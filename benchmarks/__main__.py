"""``python -m benchmarks run [--quick] [--only NAME[,NAME]] [--out DIR] [--big]``

Runs the registered benchmarks in order (the peer first), printing progress
to stderr, and writes into ``benchmarks/results/<timestamp>/`` (or
``--out``): ``results.json`` (every figure, series, goal and the raw
detail), ``results.md`` (Markdown tables), ``plots/*.png`` and
``index.html``. ``python -m benchmarks list`` names the benchmarks.

A benchmark that fails is recorded with its error and the run goes on; the
exit code is 1 when any failed. A benchmark that cannot run here (a peer's
server not installed) is recorded as ``skipped`` with the reason and does not
fail the run. The 1-minute load average is recorded at the start and end of
every benchmark; when it exceeds the number of cores, the report and the goals
say that the ratios of this run are not trustworthy. Beside it, each benchmark
records the share of the machine that processes outside this run used
(:mod:`benchmarks.hostload`): the load average counts this run's own nodes
and load generator too, the outside share is the other work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Importing the modules registers their benchmarks, in this order.
from benchmarks import (  # noqa: F401
    bench_cmode,
    bench_core,
    bench_cost,
    bench_failover,
    bench_groups,
    bench_http,
    bench_looplag,
    bench_peers,
    bench_read,
    bench_spark,
    hostload,
)
from benchmarks.goals import evaluate, fmt_value, max_load1
from benchmarks.registry import REGISTRY, Context, Figure, Skipped
from benchmarks.report import write_html, write_markdown, write_plots

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA = 1


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _clean(v: Any) -> Any:
    """NaN/inf -> None, so results.json is strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def select(only: str | None, with_peer: bool) -> list[str]:
    if not only:
        return list(REGISTRY)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in REGISTRY]
    if unknown:
        raise SystemExit(
            f"unknown benchmark(s): {', '.join(unknown)} (known: {', '.join(REGISTRY)})"
        )
    if with_peer:
        for w in list(wanted):
            wanted += [n for n in REGISTRY[w].needs if n not in wanted]
    return [n for n in REGISTRY if n in wanted]  # registry order: the peer first


def run(args: argparse.Namespace) -> int:
    names = select(args.only, not args.no_peer)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else RESULTS_DIR / stamp
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dledger-benchrun-"))
    ctx = Context(
        quick=args.quick,
        big=args.big,
        out_dir=out,
        work_dir=work,
        profile=args.profile if args.profile is not None else not args.quick,
    )
    load_before = list(os.getloadavg())
    speed_before = hostload.cpu_speed()
    ctx.log(f"CPU speed index (benchmarks.hostload.cpu_speed): {speed_before:,.0f}")
    ctx.log(
        f"benchmarks: {', '.join(names)} ({'quick' if args.quick else 'full'}"
        f"{', big' if args.big else ''}); results in {out}"
    )
    t0 = time.monotonic()
    benches: dict[str, Any] = {}
    failed = []
    try:
        for name in names:
            b = REGISTRY[name]
            ctx.log(f"== {name}: {b.summary}")
            tb = time.monotonic()
            hs0 = hostload.sample()
            entry: dict[str, Any] = {"summary": b.summary, "loadavg_start": list(os.getloadavg())}
            try:
                r = b.fn(ctx)
                entry.update(
                    figures=[f.to_json() for f in r.figures],
                    series=[s.to_json() for s in r.series],
                    notes=r.notes,
                    raw=r.raw,
                )
            except Skipped as exc:
                ctx.log(f"-- {name} skipped: {exc}")
                entry.update(figures=[], series=[], notes=[], raw={}, skipped=str(exc))
            except Exception as exc:
                failed.append(name)
                ctx.log(f"!! {name} failed: {type(exc).__name__}: {exc}")
                entry.update(
                    figures=[],
                    series=[],
                    notes=[],
                    raw={"traceback": traceback.format_exc()},
                    error=f"{type(exc).__name__}: {exc}",
                )
            entry["wall_s"] = time.monotonic() - tb
            entry["loadavg_end"] = list(os.getloadavg())
            entry["outside_cpu_pct"] = hostload.outside_share(
                hs0, hostload.sample(), entry["wall_s"]
            )
            ctx.log(f"== {name} done in {entry['wall_s']:.1f}s")
            benches[name] = entry
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figs = {
        f["key"]: Figure(**{fld.name: f[fld.name] for fld in dataclasses.fields(Figure)})
        for b in benches.values()
        for f in b["figures"]
    }
    load_after = list(os.getloadavg())
    speed_after = hostload.cpu_speed()
    load1 = max_load1([load_before, load_after], benches)
    outside = max(
        (
            float(b["outside_cpu_pct"])
            for b in benches.values()
            if b.get("outside_cpu_pct") is not None
        ),
        default=None,
    )
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {
            "started": stamp,
            "quick": args.quick,
            "big": args.big,
            "only": names,
            "wall_s": time.monotonic() - t0,
            "git_commit": _git_commit(),
            "python": sys.version.split()[0],
            "host": {
                "cpus": os.cpu_count(),
                "loadavg_before": load_before,
                "loadavg_after": load_after,
                "loadavg_max_1m": load1,
                "load_trustworthy": load1 <= (os.cpu_count() or 1),
                "outside_cpu_pct_max": outside,
                "cpu_speed_before": round(speed_before),
                "cpu_speed_after": round(speed_after),
            },
        },
        "benchmarks": benches,
        "goals": evaluate(figs, load1=load1, cpus=os.cpu_count(), outside_pct=outside),
    }
    write_plots(results, out / "plots")
    results = _clean(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False))
    write_markdown(results, out / "results.md")
    write_html(results, out / "index.html")
    ctx.log(f"wrote {out / 'results.json'}, results.md, index.html, plots/")
    ctx.log(
        f"load average (1 min): before {load_before[0]:.2f}, after {load_after[0]:.2f}, "
        f"highest recorded {load1:.2f} on {os.cpu_count()} cores; "
        f"CPU speed index {speed_before:,.0f} before, {speed_after:,.0f} after"
        + (
            f"; processes outside this run used at most {outside:.1f}% of the machine "
            "during one benchmark"
            if outside is not None
            else ""
        )
    )
    for g in results["goals"]:
        status = {True: "met", False: "NOT MET", None: "n/a"}[g["met"]]
        v = "-" if g["value"] is None else f"{fmt_value(g['value'])} {g['unit']}"
        ctx.log(f"goal {status:7s} {g['goal']}: {v} (target {g['target']})")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmarks and write a report")
    r.add_argument("--quick", action="store_true", help="smoke run (< 3 minutes)")
    r.add_argument("--only", help="comma-separated benchmark names (see `list`)")
    r.add_argument("--out", help="output directory (default benchmarks/results/<timestamp>)")
    r.add_argument(
        "--big", action="store_true", help="cost_growth up to 10M messages (long; needs RAM)"
    )
    r.add_argument(
        "--no-peer",
        action="store_true",
        help="with --only: do not add the peer baseline the selected benchmarks compare with",
    )
    r.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cProfile the leader under HTTP produce load (default: on in full runs, "
        "off with --quick)",
    )
    sub.add_parser("list", help="list the benchmarks")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for b in REGISTRY.values():
            needs = f" (compares with: {', '.join(b.needs)})" if b.needs else ""
            print(f"{b.name:14s} {b.summary}{needs}")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
