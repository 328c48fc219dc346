"""The Kafka-workload anomalies (Jepsen's names) computed from one history.

Theory of operation
-------------------
Every observation of the log is a pair ``(offset, value)`` on one key: the
offset of an ``ok`` produce, and every pair returned by an ``ok`` read,
final read or poll (any consistency). From those the checker derives, per
key:

* ``inconsistent-offsets``: one offset observed with two different values.
* ``duplicate``: one value observed at two different offsets.
* ``aborted-read``: a value whose every produce ``fail``ed was observed by a
  read or poll (a failed produce became visible).
* ``lost-write``: an acknowledged produce whose offset is not above the
  highest offset the final reads of its key returned, and whose value no
  read, poll or final read ever returned.
* ``unseen``: an acknowledged produce whose value the final reads of its key
  do not contain (and that is not already a lost write). Both need final
  reads: a history without any ``final_read`` skips them.
* ``poll-skip`` / ``nonmonotonic-poll``: per consumer process and key, the
  offsets a consumer receives must be contiguous and increasing — each next
  offset is the previous one + 1. A ``seek`` sets the expected next offset;
  an ``info`` poll or seek forgets it (the server may have moved the
  position); the first poll of a session sets it.
* ``offset-regression``: a consumer group's committed offset, read back
  by an ``ok`` ``seek`` that names the group, is below an offset the
  group committed (``ok`` ``commit_offset``) before that seek was invoked
  (SCENARIOS 15: offsets committed through the log never jump back). The
  seek must read the offsets linearizably (the harness does): a committed
  read may come from a replica still catching up.
* ``non-contiguous-read``: a read, final read or poll whose result is not a
  contiguous run of offsets starting at the offset it asked for (offsets 0
  and 2 without 1): no state of a log returns that, whatever the consistency.
* ``stale-read``: a linearizable read whose result reaches the end of the
  log (``Operation.reached_end``) but ends below an offset whose produce
  was acknowledged before the read was invoked.

Each anomaly has a count and up to ``max_examples`` examples. The verdict is
``invalid`` when any anomaly is present, ``valid`` otherwise. Values are
assumed unique per key (the harness makes them so); ``duplicate`` reports
the ones that are not, by design.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from jepsen_like.history import History, Operation, Value

ANOMALIES = (
    "lost-write",
    "duplicate",
    "inconsistent-offsets",
    "aborted-read",
    "poll-skip",
    "nonmonotonic-poll",
    "unseen",
    "stale-read",
    "offset-regression",
    "non-contiguous-read",
)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max_examples: int = 10


class _Anomalies:
    def __init__(self, max_examples: int) -> None:
        self.max_examples = max_examples
        self.counts: dict[str, int] = {name: 0 for name in ANOMALIES}
        self.examples: dict[str, list[dict[str, Any]]] = {name: [] for name in ANOMALIES}

    def add(self, name: str, example: dict[str, Any]) -> None:
        self.counts[name] += 1
        if len(self.examples[name]) < self.max_examples:
            self.examples[name].append(example)


def _observations(ops: list[Operation]) -> list[tuple[int, Value, Operation]]:
    out: list[tuple[int, Value, Operation]] = []
    for op in ops:
        if op.status != "ok":
            continue
        if op.f == "produce" and op.offset is not None and op.value is not None:
            out.append((op.offset, op.value, op))
        elif op.f in ("read", "final_read", "poll"):
            out.extend((off, v, op) for off, v in op.results)
    return out


def _brief(op: Operation) -> dict[str, Any]:
    return {
        "process": op.process,
        "f": op.f,
        "type": op.status,
        "invoke_index": op.invoke_index,
        "complete_index": op.complete_index,
    }


def _check_key(key: str, ops: list[Operation], any_final: bool, out: _Anomalies) -> None:
    obs = _observations(ops)
    values_at: dict[int, dict[Value, Operation]] = defaultdict(dict)
    offsets_of: dict[Value, dict[int, Operation]] = defaultdict(dict)
    read_values: set[Value] = set()
    for off, v, op in obs:
        values_at[off].setdefault(v, op)
        offsets_of[v].setdefault(off, op)
        if op.f != "produce":
            read_values.add(v)

    for off in sorted(values_at):
        seen = values_at[off]
        if len(seen) > 1:
            out.add(
                "inconsistent-offsets",
                {
                    "key": key,
                    "offset": off,
                    "values": [{"value": v, "seen_by": _brief(op)} for v, op in seen.items()],
                },
            )
    for v, where in offsets_of.items():
        if len(where) > 1:
            out.add(
                "duplicate",
                {
                    "key": key,
                    "value": v,
                    "offsets": sorted(where),
                },
            )

    produces: dict[Value, list[Operation]] = defaultdict(list)
    for op in ops:
        if op.f == "produce" and op.value is not None:
            produces[op.value].append(op)
    for v, prods in produces.items():
        if all(p.status == "fail" for p in prods) and v in read_values:
            out.add(
                "aborted-read",
                {
                    "key": key,
                    "value": v,
                    "produce": _brief(prods[0]),
                    "offsets": sorted(offsets_of[v]),
                },
            )

    finals = [op for op in ops if op.f == "final_read" and op.status == "ok"]
    if any_final:
        final_values = {v for op in finals for _, v in op.results}
        final_max = max((off for op in finals for off, _ in op.results), default=-1)
        for op in ops:
            if op.f != "produce" or op.status != "ok" or op.value is None:
                continue
            assert op.offset is not None
            if op.offset <= final_max and op.value not in read_values:
                out.add(
                    "lost-write",
                    {
                        "key": key,
                        "value": op.value,
                        "offset": op.offset,
                        "produce": _brief(op),
                        "final_max_offset": final_max,
                    },
                )
            elif op.value not in final_values:
                out.add(
                    "unseen",
                    {"key": key, "value": op.value, "offset": op.offset, "produce": _brief(op)},
                )

    _check_contiguous(key, ops, out)
    _check_polls(key, ops, out)
    _check_stale(key, ops, out)
    _check_group_offsets(key, ops, out)


def _check_contiguous(key: str, ops: list[Operation], out: _Anomalies) -> None:
    for op in ops:
        if op.f not in ("read", "final_read", "poll") or op.status != "ok" or not op.results:
            continue
        expected = op.offset if op.offset is not None else op.results[0][0]
        for off, _ in op.results:
            if off != expected:
                out.add(
                    "non-contiguous-read",
                    {
                        "key": key,
                        "read": _brief(op),
                        "asked_offset": op.offset,
                        "expected": expected,
                        "got": off,
                        "offsets": [o for o, _ in op.results][:20],
                    },
                )
                break
            expected += 1


def _check_polls(key: str, ops: list[Operation], out: _Anomalies) -> None:
    by_process: dict[int, list[Operation]] = defaultdict(list)
    for op in ops:
        if op.f in ("poll", "seek"):
            by_process[op.process].append(op)
    for process, pops in sorted(by_process.items()):
        pops.sort(key=lambda o: o.invoke_index)
        expected: int | None = None  # the next offset this consumer should receive
        for op in pops:
            if op.f == "seek":
                if op.status == "ok":
                    expected = op.offset
                elif op.status == "info":
                    expected = None
                continue
            if op.status == "info":
                expected = None
                continue
            if op.status != "ok":
                continue
            for off, _ in op.results:
                if expected is not None and off != expected:
                    name = "poll-skip" if off > expected else "nonmonotonic-poll"
                    out.add(
                        name,
                        {
                            "key": key,
                            "process": process,
                            "expected": expected,
                            "got": off,
                            "poll": _brief(op),
                        },
                    )
                expected = off + 1


def _check_stale(key: str, ops: list[Operation], out: _Anomalies) -> None:
    acks = sorted(
        (
            (op.complete_ns, op.offset, op)
            for op in ops
            if op.f == "produce"
            and op.status == "ok"
            and op.complete_ns is not None
            and op.offset is not None
        ),
        # never compare the Operation itself: two acks may share a completion
        # time and an offset (a duplicate, reported elsewhere)
        key=lambda a: (a[0], a[1]),
    )
    if not acks:
        return
    # prefix maximum of acknowledged offsets by completion time
    times = [a[0] for a in acks]
    prefix_max: list[tuple[int, Operation]] = []
    best: tuple[int, Operation] | None = None
    for _, off, op in acks:
        assert off is not None
        if best is None or off > best[0]:
            best = (off, op)
        prefix_max.append(best)
    for op in ops:
        if (
            op.f not in ("read", "final_read")
            or op.status != "ok"
            or op.consistency != "linearizable"
            or not op.reached_end
        ):
            continue
        i = bisect.bisect_left(times, op.invoke_ns) - 1  # acked strictly before invoke
        if i < 0:
            continue
        acked_off, acked_op = prefix_max[i]
        start = op.offset if op.offset is not None else 0
        seen_max = max((o for o, _ in op.results), default=start - 1)
        if acked_off > seen_max and acked_off >= start:
            out.add(
                "stale-read",
                {
                    "key": key,
                    "read": _brief(op),
                    "read_max_offset": seen_max,
                    "acked_offset": acked_off,
                    "acked_by": _brief(acked_op),
                },
            )


def _check_group_offsets(key: str, ops: list[Operation], out: _Anomalies) -> None:
    commits: dict[str, list[tuple[int, int, Operation]]] = defaultdict(list)
    for op in ops:
        if (
            op.f == "commit_offset"
            and op.status == "ok"
            and op.group is not None
            and op.offset is not None
            and op.complete_ns is not None
        ):
            commits[op.group].append((op.complete_ns, op.offset, op))
    for group_commits in commits.values():
        group_commits.sort(key=lambda c: c[0])
    for op in ops:
        if op.f != "seek" or op.status != "ok" or op.group is None or op.offset is None:
            continue
        before = [c for c in commits.get(op.group, []) if c[0] < op.invoke_ns]
        if not before:
            continue
        _, high, by = max(before, key=lambda c: c[1])
        if op.offset < high:
            out.add(
                "offset-regression",
                {
                    "key": key,
                    "group": op.group,
                    "read_back": op.offset,
                    "committed": high,
                    "seek": _brief(op),
                    "commit": _brief(by),
                },
            )


def check(history: History, config: QueueConfig | None = None) -> dict[str, Any]:
    cfg = config or QueueConfig()
    out = _Anomalies(cfg.max_examples)
    any_final = any(op.f == "final_read" for op in history.ops)
    for key, ops in sorted(history.by_key().items()):
        _check_key(key, ops, any_final, out)
    found = {name: n for name, n in out.counts.items() if n}
    return {
        "checker": "queue",
        "verdict": "invalid" if found else "valid",
        "anomaly_types": sorted(found),
        "counts": out.counts,
        "examples": {name: ex for name, ex in out.examples.items() if ex},
        "final_reads": any_final,
    }
