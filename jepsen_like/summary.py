"""The human verdict of a run or a history check: one VERDICT line, a table, reasons.

``python -m jepsen_like run`` and ``python -m jepsen_like check`` both print
:func:`render` (``check --json`` prints the raw results instead). Every
invalid checker gets its reason in words, naming the operations involved
(:func:`reasons`); the HTML report shows the same sentences.
"""

from __future__ import annotations

from typing import Any

from jepsen_like.history import READ_FS


def _op(op: dict[str, Any]) -> str:
    """A compact op reference from a ``to_json``/``_brief`` dict."""
    f = op.get("f", "?")
    idx = op.get("invoke_index")
    head = f"{f} #{idx}" if idx is not None else f
    bits = [f"process {op.get('process')}"]
    if op.get("type") not in (None, "ok"):
        bits.append(str(op["type"]))
    out = f"{head} ({', '.join(bits)})"
    if f == "produce" and "value" in op:
        out += f" of {op['value']!r}"
        if "offset" in op:
            out += f" at offset {op['offset']}"
    elif f in READ_FS and "results" in op:
        res = op["results"]
        shown = str(res) if len(res) <= 4 else f"{res[:2]} ... {res[-1:]} ({len(res)} entries)"
        out += f" from offset {op.get('offset')} -> {shown}"
    return out


def queue_sentence(name: str, ex: dict[str, Any]) -> str:
    key = ex.get("key", "?")
    if name == "lost-write":
        return (
            f"{key}: {_op(ex['produce'])} of {ex['value']!r} was acknowledged at offset "
            f"{ex['offset']}, but no read ever returned it and the final reads reach offset "
            f"{ex['final_max_offset']}"
        )
    if name == "unseen":
        return (
            f"{key}: {_op(ex['produce'])} of {ex['value']!r} was acknowledged at offset "
            f"{ex['offset']} but is missing from the final reads"
        )
    if name == "inconsistent-offsets":
        vals = "; ".join(f"{v['value']!r} seen by {_op(v['seen_by'])}" for v in ex["values"])
        return f"{key}: offset {ex['offset']} holds different values: {vals}"
    if name == "duplicate":
        return f"{key}: value {ex['value']!r} appears at offsets {ex['offsets']}"
    if name == "aborted-read":
        return (
            f"{key}: {ex['value']!r} was read at offsets {ex['offsets']} although its "
            f"produce {_op(ex['produce'])} failed"
        )
    if name in ("poll-skip", "nonmonotonic-poll"):
        return (
            f"{key}: consumer process {ex['process']} expected offset {ex['expected']} and "
            f"got {ex['got']} in {_op(ex['poll'])}"
        )
    if name == "stale-read":
        return (
            f"{key}: {_op(ex['read'])} ends at offset {ex['read_max_offset']} (end of log) "
            f"although {_op(ex['acked_by'])} was acknowledged at offset {ex['acked_offset']} "
            "before the read was invoked"
        )
    if name == "offset-regression":
        return (
            f"{key}: group {ex['group']} read back offset {ex['read_back']} in "
            f"{_op(ex['seek'])} after {_op(ex['commit'])} committed {ex['committed']}"
        )
    if name == "non-contiguous-read":
        return (
            f"{key}: {_op(ex['read'])} asked for offset {ex['asked_offset']} and returned "
            f"offsets {ex['offsets']}: offset {ex['got']} where {ex['expected']} belongs "
            "(no state of a log returns that)"
        )
    return f"{key}: {ex}"


def reasons(results: dict[str, Any], max_per: int = 3) -> dict[str, list[str]]:
    """checker -> sentences saying why it is not valid (empty for a valid one)."""
    out: dict[str, list[str]] = {}
    for name, r in results.get("checkers", {}).items():
        v = r.get("verdict")
        if v == "valid":
            continue
        lines: list[str] = []
        if name == "linearizable":
            for key in r.get("invalid_keys", []):
                k = r["keys"][key]
                lines.append(f"{key}: {k.get('explanation') or 'not linearizable'}")
                if k.get("note"):
                    lines.append(f"{key}: {k['note']}")
            for key in r.get("unknown_keys", []):
                lines.append(f"{key}: undecided ({r['keys'][key].get('reason')})")
        elif name == "queue":
            for a in r.get("anomaly_types", []):
                n = r.get("counts", {}).get(a, 0)
                exs = r.get("examples", {}).get(a, [])
                lines.append(f"{a}: {n} case(s)")
                lines += [f"  {queue_sentence(a, ex)}" for ex in exs[:max_per]]
        elif name == "recovery":
            for w in [w for w in r.get("windows", []) if w.get("unrecovered")][:max_per]:
                fs = w.get("unrecovered")
                what = ", ".join(fs) if isinstance(fs, list) else "some operations"
                lines.append(
                    f"the {w.get('kind')} window on {w.get('targets')} never recovered: "
                    f"{what} failed in it and never succeeded again"
                )
            for g in r.get("unavailability", [])[:max_per]:
                lines.append(
                    f"no operation succeeded for {g.get('duration_ms'):.0f} ms outside any "
                    "fault window"
                )
        elif name == "nodes":
            for e in r.get("unexpected_exits", [])[:max_per]:
                tail = (e.get("log_tail") or "").strip().splitlines()
                telling = [
                    x
                    for x in tail
                    if any(w in x for w in ("CRITICAL", "ERROR", "Error", "Violation", "Diverged"))
                ]
                last = (telling or tail or [""])[-1][:240]
                lines.append(
                    f"node {e.get('node')} exited on its own with code {e.get('exit_code')}"
                    + (f": {last}" if last else "")
                )
        if name == "nodes":
            for w in r.get("warnings", [])[:max_per]:
                lines.append(f"node {w.get('node')}: {w.get('warning')}")
            if r.get("flush") == "sync":
                for d in r.get("diverged_rebuilt", [])[:max_per]:
                    lines.append(
                        f"node {d.get('node')} stopped with REPLICA_DIVERGED in sync mode, "
                        "where no acknowledged write may be lost"
                    )
        elif name == "tail":
            for ex in r.get("outside_examples", [])[:max_per]:
                lines.append(
                    f"{ex['key']}: acknowledged {ex['value']!r} at offset {ex['offset']} was "
                    "lost, and no power loss of a majority followed it within the tail"
                )
        elif name == "groups":
            for g, gr in r.get("groups", {}).items():
                if gr.get("verdict") != "valid":
                    lines.append(
                        f"group {g}: {len(gr.get('unavailability', []))} gaps outside its faults, "
                        f"{len(gr.get('unrecovered', []))} unrecovered windows"
                    )
            for op in r.get("unclean_ordered_failures", [])[:max_per]:
                lines.append(
                    f"ordered produce to {op.get('key')} (group {op.get('group')}) failed "
                    f"with {op.get('error')!r}, not a documented refusal"
                )
        elif name == "replicas":
            for ex in r.get("examples", [])[:max_per]:
                held = "; ".join(f"{v!r} on nodes {ns}" for v, ns in ex["values"].items())
                lines.append(f"queue {ex['queue']} offset {ex['offset']} differs: {held}")
            if r.get("unreadable_nodes"):
                lines.append(f"nodes {r['unreadable_nodes']} could not be read")
            if r.get("refused_damaged_nodes"):
                lines.append(
                    f"nodes {r['refused_damaged_nodes']} found the damage the corrupt nemesis "
                    "made and refused to serve it (stopped, to be rebuilt)"
                )
        if not lines:
            lines.append(f"verdict {v}")
        out[name] = lines
    return out


def detail(name: str, r: dict[str, Any]) -> str:
    if name == "linearizable":
        keys = r.get("keys", {})
        ops = sum(k.get("ops", 0) for k in keys.values())
        secs = sum(k.get("elapsed_s", 0.0) for k in keys.values())
        bad = r.get("invalid_keys", []) + r.get("unknown_keys", [])
        extra = f"; not valid: {', '.join(bad)}" if bad else ""
        return f"{r.get('keys_checked', 0)} keys, {ops} ops, {secs:.2f} s{extra}"
    if name == "queue":
        found = r.get("anomaly_types", [])
        counts = r.get("counts", {})
        return ", ".join(f"{a} x{counts.get(a, 0)}" for a in found) or "no anomalies"
    if name == "recovery":
        rto = r.get("max_rto_ms")
        return (
            f"{len(r.get('windows', []))} windows, max RTO "
            f"{'-' if rto is None else f'{rto:.0f} ms'}, "
            f"{r.get('unrecovered_windows', 0)} unrecovered, "
            f"{len(r.get('unavailability', []))} gaps outside faults"
        )
    if name == "nodes":
        out = f"{len(r.get('unexpected_exits', []))} unexpected exits"
        if r.get("diverged_rebuilt"):
            out += f", {len(r['diverged_rebuilt'])} diverged replica(s) rebuilt"
        return out
    if name == "tail":
        return (
            f"{r.get('lost_in_tail', 0)} of {r.get('acknowledged', 0)} acknowledged writes lost "
            f"in the unsynced tail of {r.get('majority_power_losses', 0)} majority power "
            f"loss(es) (oldest {r.get('max_ack_age_ms')} ms before it), "
            f"{r.get('lost_outside_tail', 0)} outside it"
        )
    if name == "groups":
        av = r.get("unordered_availability")
        un = r.get("unordered_in_outages", {})
        outs = [o for o in r.get("outages", []) if o.get("group") != "controller"]
        return (
            f"{len(r.get('groups', {}))} groups, {len(outs)} whole-group outages: unordered "
            f"produces {'-' if av is None else f'{av * 100:.1f}%'} acknowledged "
            f"({un.get('ok', 0)}/{un.get('invoked', 0)}; never moving: "
            f"{(r.get('naive_availability') or 0) * 100:.0f}%), "
            f"{r.get('unclean_count', 0)} unclean ordered failures"
        )
    if name == "replicas":
        per = r.get("messages_per_node", {})
        return (
            f"{r.get('divergent_offsets', 0)} divergent offsets across {len(per)} replicas "
            f"(messages per node: {', '.join(f'{i}: {sum(q.values())}' for i, q in per.items())})"
        )
    return ""


def load_line(results: dict[str, Any]) -> str:
    ld = results.get("load") or {}
    if not ld:
        return ""
    share = ld.get("info_share_in_faults")
    in_f = "-" if share is None else f"{share * 100:.1f}%"
    return (
        f"info {ld.get('info_share', 0) * 100:.1f}% of ops, {in_f} of the "
        f"{ld.get('ops_in_faults', 0)} ops in fault windows; mean overlap "
        f"{ld.get('mean_overlap', 0):.1f} ops (linearizable ops: "
        f"{ld.get('mean_overlap_lin', 0):.1f})"
    )


def verdict_line(results: dict[str, Any], where: str | None = None) -> str:
    per = " ".join(f"{n}={r['verdict']}" for n, r in results.get("checkers", {}).items())
    rec = results.get("checkers", {}).get("recovery", {})
    rtos = [w["rto_ms"] for w in rec.get("windows", []) if w.get("rto_ms") is not None]
    ld = results.get("load") or {}
    share = ld.get("info_share_in_faults")
    line = (
        f"VERDICT {str(results.get('verdict', '?')).upper()}: {per}; {results.get('ops')} ops, "
        f"{results.get('faults')} faults, max RTO {max(rtos) if rtos else 0:.0f} ms; "
        f"info in faults {'-' if share is None else f'{share * 100:.1f}%'}, "
        f"mean overlap {ld.get('mean_overlap', 0):.1f}"
    )
    return f"{line}; {where}" if where else line


def table(results: dict[str, Any]) -> str:
    rows = [("checker", "verdict", "summary")]
    for name, r in results.get("checkers", {}).items():
        rows.append((name, str(r.get("verdict")), detail(name, r)))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * 7}")
    ll = load_line(results)
    if ll:
        lines.append(f"{'load':<{w0}}  {'':<{w1}}  {ll}")
    return "\n".join(lines)


def render(results: dict[str, Any], where: str | None = None) -> str:
    out = [table(results)]
    why = reasons(results)
    for name, lines in why.items():
        out.append(f"why {name} is {results['checkers'][name]['verdict']}:")
        out += [f"  {x}" for x in lines]
    out.append(verdict_line(results, where))
    return "\n".join(out)
