"""The ``groups`` checker: a multi-group run (several broker groups and a
controller group; ``python -m jepsen_like run --groups N``).

The per-key checkers (linearizable, queue) already cover every queue of
every group: a queue belongs to exactly one group, and its key's history is
checked as in a single-group run. What this checker adds needs to know the
layout, which the history's header records: ``groups`` (group -> node ids),
``controller`` (node ids), ``queue_groups`` (queue -> group) and
``unordered_processes`` (the producers whose messages may move to another
group's queue).

* **Recovery per group.** The recovery checker runs on each group's own
  history: the ops on its queues and the faults that touched its nodes.
  Faults of other groups and of the controller are *not* excused there:
  a group that stalls while the controller's majority is dead (routes are
  cached; nothing on the produce or consume path needs the controller) or
  while another group is down shows as unavailability outside faults, and
  the run is invalid.
* **Whole-group outages.** A fault that kills, pauses or powers off a
  majority of one group's voters. During each: the *availability* of
  unordered produces (acknowledged / invoked in the window, all groups),
  next to the naive figure a producer that never moves would get
  ((groups - 1) / groups); and the ordered produces aimed at the dead
  group's queues, which must *fail cleanly*: every one that was not
  acknowledged ended with a refusal or an unknown outcome from the
  documented set (no answer: refused, reset or timed out; ``503``,
  ``504``, ``429``, ``421``), never a ``500`` or a malformed answer.
* **Controller outages** (a majority of the controller group): produce
  and consume on the groups must go on; recovery per group covers it, and
  the checker reports the produces acknowledged during each.

Verdict: ``invalid`` when a group's recovery is invalid or an ordered
produce failed uncleanly; else ``valid``. The availability figures are
reported, not judged (they depend on the machine's load).
"""

from __future__ import annotations

from typing import Any

from jepsen_like.checkers import recovery
from jepsen_like.checkers.recovery import RecoveryConfig
from jepsen_like.history import FaultWindow, History, Operation

# Kinds that take a node out while they last.
OUTAGE_KINDS = ("kill", "pause", "power")


def _queue(key: str) -> int | None:
    _, _, q = key.rpartition("/")
    return int(q) if q.isdigit() else None


def clean_failure(error: str | None) -> bool:
    """An ordered produce's refusal or unknown outcome from the documented set:
    no answer at all (refused, reset, timed out: the node is down), or an
    answer of ``503``, ``504``, ``429`` or ``421``. Any other status (a
    ``500``, a ``502``) or a malformed success body is not."""
    e = (error or "").strip()
    head = e.split(" ", 1)[0]
    if head.isdigit():
        return head in ("503", "504", "429", "421")
    return e != "bad ok body"


def _in(op: Operation, w: FaultWindow) -> bool:
    stop = w.stop_ns if w.stop_ns is not None else op.invoke_ns + 1
    return w.start_ns <= op.invoke_ns <= stop


def _majority_of(targets: set[int], voters: list[int]) -> bool:
    return len(targets & set(voters)) > len(voters) // 2


def check(history: History, config: RecoveryConfig | None = None) -> dict[str, Any]:
    h = history.header
    groups: dict[str, list[int]] = {str(g): [int(i) for i in ids] for g, ids in h["groups"].items()}
    controller = [int(i) for i in h.get("controller", [])]
    queue_groups = {int(q): str(g) for q, g in h["queue_groups"].items()}
    unordered = {int(p) for p in h.get("unordered_processes", [])}
    produces = [op for op in history.ops if op.f == "produce"]

    per_group: dict[str, Any] = {}
    verdict = "valid"
    for g, ids in sorted(groups.items()):
        mine = {q for q, owner in queue_groups.items() if owner == g}
        ops = tuple(op for op in history.ops if _queue(op.key) in mine)
        faults = tuple(
            w for w in history.faults if {int(t) for t in w.targets if str(t).isdigit()} & set(ids)
        )
        res = recovery.check(History(ops, faults, h), config)
        gaps = res["unavailability"]
        unrecovered = [w for w in res["windows"] if w.get("unrecovered")]
        per_group[g] = {
            "verdict": res["verdict"],
            "queues": sorted(mine),
            "ops": len(ops),
            "faults": len(faults),
            "unavailability": gaps,
            "unrecovered": unrecovered,
            "max_rto_ms": max(
                (w["rto_ms"] for w in res["windows"] if w.get("rto_ms")), default=None
            ),
        }
        if res["verdict"] != "valid":
            verdict = "invalid"

    outages: list[dict[str, Any]] = []
    unclean: list[dict[str, Any]] = []
    tot_ok = tot_n = 0
    live_ok = live_n = 0
    for w in history.faults:
        if w.kind not in OUTAGE_KINDS:
            continue
        targets = {int(t) for t in w.targets if str(t).isdigit()}
        down = [g for g, ids in groups.items() if _majority_of(targets, ids)]
        if down:
            g = down[0]
            dead_queues = {q for q, owner in queue_groups.items() if owner == g}
            un = [op for op in produces if op.process in unordered and _in(op, w)]
            ok = sum(op.status == "ok" for op in un)
            tot_ok += ok
            tot_n += len(un)
            ordered = [
                op
                for op in produces
                if op.process not in unordered and _in(op, w) and _queue(op.key) in dead_queues
            ]
            # A producer that stays on a live group: what the live groups gave
            # the ordered producers in the same window (the same deadlines,
            # the same load) is what a never-moving producer would get there.
            live = [
                op
                for op in produces
                if op.process not in unordered and _in(op, w) and _queue(op.key) not in dead_queues
            ]
            live_ok += sum(op.status == "ok" for op in live)
            live_n += len(live)
            bad = [op for op in ordered if op.status != "ok" and not clean_failure(op.error)]
            unclean += [{**op.to_json(), "error": op.error, "group": g} for op in bad]
            outages.append(
                {
                    "group": g,
                    "kind": w.kind,
                    "targets": sorted(targets),
                    "start_ns": w.start_ns,
                    "duration_ms": None
                    if w.stop_ns is None
                    else round((w.stop_ns - w.start_ns) / 1e6, 1),
                    "unordered": {"invoked": len(un), "ok": ok},
                    "unordered_availability": None if not un else round(ok / len(un), 4),
                    "ordered_on_dead_group": {
                        s: sum(op.status == s for op in ordered) for s in ("ok", "fail", "info")
                    },
                    "ordered_errors": sorted({op.error or "" for op in ordered if op.error}),
                }
            )
        elif controller and _majority_of(targets, controller):
            during = [op for op in produces if _in(op, w)]
            outages.append(
                {
                    "group": "controller",
                    "kind": w.kind,
                    "targets": sorted(targets),
                    "start_ns": w.start_ns,
                    "duration_ms": None
                    if w.stop_ns is None
                    else round((w.stop_ns - w.start_ns) / 1e6, 1),
                    "produces": {
                        s: sum(op.status == s for op in during) for s in ("ok", "fail", "info")
                    },
                }
            )
    if unclean:
        verdict = "invalid"
    n = len(groups)
    return {
        "checker": "groups",
        "verdict": verdict,
        "groups": per_group,
        "outages": outages,
        "unordered_availability": None if not tot_n else round(tot_ok / tot_n, 4),
        "unordered_in_outages": {"invoked": tot_n, "ok": tot_ok},
        # A producer that never moves: nothing on the dead group, and on the
        # live ones what they gave the ordered producers during the outages
        # ((n - 1) / n when they answered everything). Comparing with the
        # ideal (n - 1) / n alone made a slow machine, whose live groups miss
        # some of the harness's short client deadlines, look like producers
        # that do not move.
        "naive_availability": (
            round((n - 1) / n * (live_ok / live_n if live_n else 1.0), 4) if n else None
        ),
        "live_group_success": None if not live_n else round(live_ok / live_n, 4),
        "unclean_ordered_failures": unclean[:20],
        "unclean_count": len(unclean),
    }
