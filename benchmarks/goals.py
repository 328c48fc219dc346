"""The issue's goals, evaluated on the figures of one run.

Each goal is a ratio or a bound measured in the same run; a goal whose
figures were not measured (``--only``, or 10M messages without ``--big``)
is reported with ``met: None`` and says why.

The ratios only mean something when the machine was not busy with other
work: when the 1-minute load average recorded during the run exceeds the
number of cores, the first goal says so (not met) and every measured goal's
detail says its ratio is not trustworthy.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.bench_core import peer_key
from benchmarks.registry import Figure


def _goal(
    goal: str, target: str, value: float | None, unit: str, met: bool | None, detail: str
) -> dict[str, Any]:
    if value is not None and not math.isfinite(value):
        value, met = None, None
    return {
        "goal": goal,
        "target": target,
        "value": value,
        "unit": unit,
        "met": met,
        "detail": detail,
    }


def fmt_value(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _ratio(
    figs: dict[str, Figure], ours: str, peer: str, peer_name: str = "peer"
) -> tuple[float | None, str]:
    a, b = figs.get(ours), figs.get(peer)
    if a is None or b is None or not b.median or b.median != b.median:
        return None, f"not measured in this run ({ours if a is None else peer} missing)"
    r = a.median / b.median
    lo = a.min / b.max if b.max else float("nan")
    hi = a.max / b.min if b.min else float("nan")
    return r, (
        f"{fmt_value(a.median)} {a.unit} vs {peer_name} {fmt_value(b.median)} {b.unit} "
        f"(ratio range over repeats {lo:.2f}-{hi:.2f}, n={min(a.n, b.n)})"
    )


def max_load1(samples: list[list[float]], benches: dict[str, Any]) -> float:
    """The highest 1-minute load average recorded: ``samples`` (the run's
    before/after), each benchmark's start/end and each of its rounds'."""
    vals = [s[0] for s in samples if s]
    for b in benches.values():
        recs: list[Any] = [b]
        rounds = (b.get("raw") or {}).get("rounds")
        if isinstance(rounds, list):
            recs += [r for r in rounds if isinstance(r, dict)]
        for r in recs:
            for k in ("loadavg_start", "loadavg_end"):
                if r.get(k):
                    vals.append(float(r[k][0]))
    return max(vals) if vals else 0.0


def load_warning(
    load1: float | None, cpus: int | None, outside_pct: float | None = None
) -> str | None:
    """Words for a run whose ratios cannot be trusted, or None.
    ``outside_pct``: the most of the machine processes outside the run used
    during one benchmark (benchmarks.hostload), said beside the load."""
    if load1 is None or not cpus or load1 <= cpus:
        return None
    who = (
        f"processes outside this run used at most {outside_pct:.1f}% of the machine "
        "during one benchmark; the rest of the load was the run's own"
        if outside_pct is not None
        else "other work may have competed for the CPU"
    )
    return (
        f"the 1-minute load average reached {load1:.2f} on {cpus} cores ({who}): "
        "the ratios of this run are not trustworthy"
    )


def evaluate(
    figs: dict[str, Figure],
    load1: float | None = None,
    cpus: int | None = None,
    outside_pct: float | None = None,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if load1 is not None and cpus:
        warn = load_warning(load1, cpus, outside_pct)
        out.append(
            _goal(
                "machine not overloaded during the run (highest 1-minute load average)",
                f"<= {cpus} (cores)",
                load1,
                "",
                warn is None,
                warn or "load within the core count: ratios comparable",
            )
        )
    r, d = _ratio(figs, "http_produce.batched.msg_per_s", peer_key(3, 100, "pipelined"))
    out.append(
        _goal(
            "batched HTTP produce (100 x 100 B), 3 voters sync vs PySyncObj pipelined",
            ">= 3x",
            r,
            "x",
            None if r is None else r >= 3.0,
            d,
        )
    )
    r, d = _ratio(figs, "http_produce.single.msg_per_s", peer_key(3, 100, "best_sync"))
    out.append(
        _goal(
            "one message per request vs PySyncObj synchronous one-at-a-time",
            ">= 1.5x",
            r,
            "x",
            None if r is None else r >= 1.5,
            d,
        )
    )
    for shape in ("batched", "single"):
        f = figs.get(f"http_produce.{shape}.half_sat_snap_p99_ms")
        v = f.median if f else None
        seen = ""
        if f is not None:
            snaps = f.config.get("snapshots_in_window")
            comps = f.config.get("compactions_in_window")
            seen = f"; snapshots {snaps} and log compactions {comps} (node counts) inside"
        out.append(
            _goal(
                f"p99 produce latency at half saturation, snapshots and compaction inside ({shape})",
                "< 10 ms",
                v,
                "ms",
                None if v is None else v < 10.0,
                "open loop, latency from the intended send time"
                + (f"; repeats {f.min:.1f}-{f.max:.1f} ms{seen}" if f else "; not measured"),
            )
        )
    med = figs.get("failover.SIGKILL.rto_median_s")
    p99 = figs.get("failover.SIGKILL.rto_p99_s")
    out.append(
        _goal(
            "leader SIGKILL: median RTO",
            "< 1 s",
            med.median if med else None,
            "s",
            None if med is None else med.median < 1.0,
            f"{med.config.get('trials')} trials" if med else "not measured",
        )
    )
    out.append(
        _goal(
            "leader SIGKILL: p99 RTO",
            "< 2 s",
            p99.median if p99 else None,
            "s",
            None if p99 is None else p99.median < 2.0,
            f"{p99.config.get('trials')} trials (p99 of 20 is close to the max)" if p99 else "",
        )
    )
    for pct in ("p50", "p99"):
        lease = figs.get(f"reads.lease.{pct}_ms")
        comm = figs.get(f"reads.committed.{pct}_ms")
        v = lease.median / comm.median if lease and comm and comm.median else None
        out.append(
            _goal(
                f"lease read vs committed local read latency ({pct}, /raft/read)",
                "<= 1.2x",
                v,
                "x",
                None if v is None else v <= 1.2,
                f"{lease.median:.3f} ms vs {comm.median:.3f} ms" if lease and comm else "",
            )
        )
    lease = figs.get("reads.v1_lease.p50_ms")
    comm = figs.get("reads.v1_committed.p50_ms")
    v = lease.median / comm.median if lease and comm and comm.median else None
    out.append(
        _goal(
            "lease read vs committed read latency (p50, GET /v1 one message)",
            "<= 1.2x",
            v,
            "x",
            None if v is None else v <= 1.2,
            f"{lease.median:.3f} ms vs {comm.median:.3f} ms" if lease and comm else "",
        )
    )
    out.append(_memory_goal(figs))
    out.append(
        _memory_goal(
            figs,
            "rss_anon_mb",
            "per-node anonymous RSS (heap; VmRSS minus mapped LMDB pages) flat from 1M to 10M",
        )
    )
    out += _peer_goals(figs)
    warn = load_warning(load1, cpus, outside_pct)
    if warn:
        for g in out:
            if g["value"] is not None and not g["goal"].startswith("machine not overloaded"):
                g["detail"] += f"; NOT TRUSTWORTHY: {warn}"
    return out


def _peer_goals(figs: dict[str, Figure]) -> list[dict[str, Any]]:
    """Ours against etcd (flush=sync) and NATS JetStream (flush=async)."""
    out: list[dict[str, Any]] = []
    e = "vs_etcd"
    for shape, goal, target, bound, higher in (
        ("single32.msg_per_s", "one message per request, 32 clients", ">= 1.5x", 1.5, True),
        ("single1.p50_ms", "one message per request, 1 client: p50 latency", "<= 1x", 1.0, False),
        (
            "single1.cpu_us_per_msg",
            "server CPU per message (3 servers, 1 client)",
            "<= 1x",
            1.0,
            False,
        ),
        ("batched.msg_per_s", "batched (100 x 100 B, 8 in flight)", ">= 3x", 3.0, True),
    ):
        r, d = _ratio(figs, f"{e}.ours.{shape}", f"{e}.etcd.{shape}", "etcd")
        met = None if r is None else (r >= bound if higher else r <= bound)
        out.append(_goal(f"{goal}: ours (sync) vs etcd", target, r, "x", met, d))
    idle = figs.get(f"{e}.ours.idle_cpu_pct") or figs.get("vs_nats.ours.idle_cpu_pct")
    refs = [
        f"{name} {f.median:.2f}%"
        for name, key in (("etcd", f"{e}.etcd.idle_cpu_pct"), ("NATS", "vs_nats.nats.idle_cpu_pct"))
        if (f := figs.get(key)) is not None and f.n
    ]
    out.append(
        _goal(
            "idle CPU per server process, ours (busiest of 3, no load)",
            "<= 1 % of a core",
            idle.median if idle else None,
            "% core",
            None if idle is None or not idle.n else idle.median <= 1.0,
            (
                f"{idle.key}; range over repeats {idle.min:.2f}-{idle.max:.2f}%"
                + (f"; for reference {', '.join(refs)}" if refs else "")
            )
            if idle
            else "not measured in this run",
        )
    )
    sp = figs.get("spark_read.arrow.count_msg_per_s")
    sp1 = figs.get("spark_read.arrow.count_one_column_msg_per_s")
    out.append(
        _goal(
            "Spark batch source: messages/s into df.count() (Arrow pages)",
            ">= 500,000 msg/s",
            sp.median if sp and sp.n else None,
            "msg/s",
            None if sp is None or not sp.n else sp.median >= 500_000,
            (
                f"{sp.config.get('messages'):,} messages, {sp.config.get('partitions')} "
                f"partitions; repeats {sp.min:,.0f}-{sp.max:,.0f} msg/s"
                + (
                    f'; judged on the full schema (11 columns); with .schema("queue int") '
                    f"{sp1.median:,.0f} msg/s"
                    if sp1 and sp1.n
                    else ""
                )
            )
            if sp and sp.n
            else "not measured in this run",
        )
    )
    for shape in ("batched", "single"):
        bj = figs.get(f"http_produce.{shape}.binary_over_json")
        out.append(
            _goal(
                f"binary produce body over JSON, {shape}: saturation (information, the lever)",
                "no target",
                bj.median if bj and bj.n else None,
                "x",
                None,
                f"http_produce.{shape}.binary_over_json; repeats {bj.min:.2f}-{bj.max:.2f}x"
                if bj and bj.n
                else "not measured in this run",
            )
        )
    n = "vs_nats"
    nf = figs.get(f"{n}.nats.batched.msg_per_s")
    durability = str(nf.config.get("durability", "")) if nf else ""
    for shape, goal in (
        ("batched.msg_per_s", "batched (100 x 100 B, 8 in flight)"),
        ("single32.msg_per_s", "one message per request, 32 clients"),
        ("single1.msg_per_s", "one message per request, 1 client"),
        ("single1.p50_ms", "one message per request, 1 client: p50 latency"),
    ):
        r, d = _ratio(figs, f"{n}.ours.{shape}", f"{n}.nats.{shape}", "NATS")
        if r is not None and durability:
            d += f"; {durability}"
        out.append(
            _goal(
                f"{goal}: ours (async) vs NATS JetStream (information)",
                "no target",
                r,
                "x",
                None,
                d,
            )
        )
    return out


def _memory_goal(
    figs: dict[str, Figure],
    metric: str = "rss_mb",
    goal: str = "per-node RSS flat from 1M to 10M stored messages",
) -> dict[str, Any]:
    a = figs.get(f"cost_growth.1000000.{metric}")
    b = figs.get(f"cost_growth.10000000.{metric}")
    if a and b:
        g = b.median - a.median
        return _goal(
            goal, "< 50 MB growth", g, "MB", g < 50, f"{a.median:,.0f} -> {b.median:,.0f} MB"
        )
    pts = sorted(
        (int(k.split(".")[1]), f.median)
        for k, f in figs.items()
        if k.startswith("cost_growth.") and k.endswith(f".{metric}") and k.split(".")[1].isdigit()
    )
    if len(pts) >= 2:
        (m0, r0), (m1, r1) = pts[0], pts[-1]
        slope = (r1 - r0) / (m1 - m0) if m1 > m0 else 0.0
        proj = slope * 9_000_000
        return _goal(
            goal,
            "< 50 MB growth",
            proj,
            "MB (projected)",
            None,
            f"10M needs --big; RSS grew {r0:,.0f} -> {r1:,.0f} MB from {m0:,} to {m1:,} "
            f"messages ({slope * 1e6:,.0f} MB per million): projected {proj:,.0f} MB for 1M->10M",
        )
    return _goal(goal, "< 50 MB growth", None, "MB", None, "not measured")
