"""How hard a history is: unknown outcomes and concurrency (figures, no verdict).

* ``info_share``: the fraction of client operations whose outcome is unknown
  (``info``, including invokes never completed);
* ``info_share_in_faults``: the same among operations invoked while a fault
  window was open (the share the short client timeouts aim at, 5-20 %);
* ``mean_overlap``: for each operation, how many other operations *on the
  same key* were in flight at some instant of its own [invoke, complete]
  interval (an op never completed stays in flight to the end of the
  history), averaged over all operations; ``mean_overlap_lin`` the same
  among the operations the linearizability checker constrains (ok/info
  produces, ok linearizable reads), against each other.

Counting is a sort and two binary searches per op: the ops overlapping ``x``
are all ops of the key minus those that completed before ``x`` was invoked
and those invoked after ``x`` completed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from jepsen_like.history import History, Operation


def _overlaps(ops: Sequence[Operation], end_ns: int) -> list[int]:
    starts = sorted(op.invoke_ns for op in ops)
    ends = sorted(op.complete_ns if op.complete_ns is not None else end_ns for op in ops)
    out = []
    for op in ops:
        a = op.invoke_ns
        b = op.complete_ns if op.complete_ns is not None else end_ns
        before = bisect.bisect_left(ends, a)  # completed strictly before a
        after = len(starts) - bisect.bisect_right(starts, b)  # invoked strictly after b
        out.append(len(ops) - before - after - 1)
    return out


def _lin(op: Operation) -> bool:
    if op.f == "produce":
        return op.status in ("ok", "info")
    return op.f in ("read", "final_read") and op.status == "ok" and op.consistency == "linearizable"


def load(history: History) -> dict[str, Any]:
    ops = [op for op in history.ops if op.f != "final_read"]
    if not history.ops:
        return {"ops": 0, "info_share": 0.0, "info_share_in_faults": None, "mean_overlap": 0.0}
    end_ns = max(
        max(op.complete_ns or op.invoke_ns for op in history.ops),
        max((w.stop_ns or w.start_ns for w in history.faults), default=0),
    )
    by_key: dict[str, list[Operation]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)
    total = 0
    total_lin = 0
    n_lin = 0
    max_overlap = 0
    for kops in by_key.values():
        ov = _overlaps(kops, end_ns)
        total += sum(ov)
        max_overlap = max(max_overlap, max(ov, default=0))
        lin = [op for op in kops if _lin(op)]
        total_lin += sum(_overlaps(lin, end_ns))
        n_lin += len(lin)
    windows = sorted(
        (w.start_ns, w.stop_ns if w.stop_ns is not None else end_ns) for w in history.faults
    )
    starts = [a for a, _ in windows]

    def in_fault(t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        # windows never overlap (one fault at a time), but be safe: look back a little
        return any(windows[j][0] <= t <= windows[j][1] for j in range(max(0, i - 2), i + 1))

    faulted = [op for op in ops if windows and in_fault(op.invoke_ns)]
    n_info = sum(op.status == "info" for op in ops)
    f_info = sum(op.status == "info" for op in faulted)
    by_f: dict[str, list[int]] = {}
    for op in faulted:
        row = by_f.setdefault(op.f, [0, 0, 0])
        row[("ok", "fail", "info").index(op.status)] += 1
    return {
        "ops": len(ops),
        "info_ops": n_info,
        "info_share": round(n_info / len(ops), 4) if ops else 0.0,
        "ops_in_faults": len(faulted),
        "info_ops_in_faults": f_info,
        "info_share_in_faults": round(f_info / len(faulted), 4) if faulted else None,
        "in_faults_by_f": by_f,
        "mean_overlap": round(total / len(ops), 2) if ops else 0.0,
        "max_overlap": max_overlap,
        "mean_overlap_lin": round(total_lin / n_lin, 2) if n_lin else 0.0,
    }
