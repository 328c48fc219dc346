"""The lost tail of ``flush = "async"`` runs: which acknowledged writes a power loss took.

Theory of operation
-------------------
In async mode a write is acknowledged once a quorum has it in the page
cache; a power loss of a majority within one flush interval of the ack may
lose it (README, "Durability and reads"). This checker lists every
acknowledged produce whose value no final read returned (the queue
checker's ``lost-write`` and ``unseen`` together) and assigns each to the
``power`` window of a majority of the voters that could have lost it: the
first such window starting at or after the ack (or up to 0.5 s before the
client saw it), no later than
``tail_s`` after it. A loss with no such window is *outside the tail*:
something other than the unsynced tail lost it, and the verdict is
``invalid``. ``max_ack_age_ms`` is the largest gap between a lost ack and
the power loss that took it: the measured length of the tail.

Only meaningful for async runs; in sync mode nothing acknowledged may be
lost at all, which the queue checker already holds.
"""

from __future__ import annotations

from typing import Any

from jepsen_like.history import History

_CLIENT_LAG_NS = 500_000_000


def check(history: History, *, voters: int, tail_s: float) -> dict[str, Any]:
    finals: dict[str, set[Any]] = {}
    any_final = False
    for op in history.ops:
        if op.f == "final_read" and op.status == "ok":
            any_final = True
            finals.setdefault(op.key, set()).update(v for _, v in op.results)
    majority = voters // 2 + 1
    windows = sorted(
        w.start_ns
        for w in history.faults
        if w.kind == "power"
        and len({t for t in w.targets if isinstance(t, int) and t <= voters}) >= majority
    )
    lost: list[dict[str, Any]] = []
    outside: list[dict[str, Any]] = []
    ages: list[float] = []
    acked = 0
    for op in history.ops:
        if op.f != "produce" or op.status != "ok" or op.value is None or op.complete_ns is None:
            continue
        acked += 1
        if not any_final or op.value in finals.get(op.key, set()):
            continue
        rec = {"key": op.key, "value": op.value, "offset": op.offset}
        # The client sees an ack a little after the node sent it: a power loss
        # starting just before that still took it.
        took = next((s for s in windows if s >= op.complete_ns - _CLIENT_LAG_NS), None)
        if took is not None and (took - op.complete_ns) / 1e9 <= tail_s:
            age = (took - op.complete_ns) / 1e6  # < 0: the client saw the ack after the loss began
            ages.append(age)
            lost.append({**rec, "ack_age_ms": round(age, 1)})
        else:
            outside.append(rec)
    return {
        "checker": "tail",
        "verdict": "invalid" if outside else "valid",
        "acknowledged": acked,
        "lost_in_tail": len(lost),
        "lost_outside_tail": len(outside),
        "majority_power_losses": len(windows),
        "max_ack_age_ms": round(max(ages), 1) if ages else None,
        "tail_s": tail_s,
        "examples": lost[:10],
        "outside_examples": outside[:10],
    }
