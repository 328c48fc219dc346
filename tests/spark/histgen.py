"""Seeded synthetic harness histories for the analysis tests: several
processes producing, reading, polling and seeking on two queues, nemesis
windows of several kinds (one may stay open), failures and unknown outcomes
inside them, final reads at the end. ``buggy=True`` lets the simulated
server lose, duplicate, skip and serve stale data now and then, so that
every anomaly kind can appear."""

from __future__ import annotations

import heapq
from pathlib import Path
from random import Random

from jepsen_like.history import Writer

MS = 1_000_000
KEYS = ("t/0", "t/1")


def generate(path: Path, seed: int, *, ops: int = 300, buggy: bool = False) -> None:
    rng = Random(seed)
    kinds = ["kill", "partition", "pause", "clock"]
    windows: list[tuple[int, int | None, str]] = []
    t = 300 * MS
    for k in range(3):
        start = t + rng.randrange(200, 600) * MS
        stop = start + rng.randrange(200, 900) * MS
        windows.append((start, stop, kinds[(seed + k) % len(kinds)]))
        t = stop
    if seed % 2:
        windows.append((t + 400 * MS, None, "kill"))  # never healed
    # per process schedules: (invoke_ns, complete_ns or None, f, key)
    heap: list[tuple[int, int, int, str, tuple[object, ...]]] = []
    seq = 0

    def push(time_ns: int, kind: str, payload: tuple[object, ...]) -> None:
        nonlocal seq
        heapq.heappush(heap, (time_ns, seq, 0, kind, payload))
        seq += 1

    for k, (start, stop, kind) in enumerate(windows):
        push(start, "nem", ("start", kind, [f"n{k % 3 + 1}"]))
        if stop is not None:
            push(stop, "nem", ("stop", kind, [f"n{k % 3 + 1}"]))

    def in_fault(x: int) -> bool:
        return any(s <= x <= (e if e is not None else 1 << 62) for s, e, _ in windows)

    procs = 5
    clock = [rng.randrange(0, 20) * MS for _ in range(procs)]
    for n in range(ops):
        p = n % procs
        f = rng.choices(["produce", "read", "poll", "seek", "commit_offset"], [6, 3, 3, 1, 1])[0]
        key = rng.choice(KEYS)
        inv = clock[p]
        # + n: completion times are distinct (the queue checker sorts acks by
        # (time, offset) and would compare Operations on a tie)
        lat = rng.randrange(1, 40) * MS + n
        if in_fault(inv):
            lat += rng.randrange(0, 300) * MS
        status = "ok"
        if in_fault(inv) or in_fault(inv + lat):
            status = rng.choice(["ok", "fail", "info", "info"])
        elif rng.random() < 0.03:
            status = rng.choice(["fail", "info"])
        # a process's last op may never complete (then it has no later op)
        last = n >= ops - procs
        complete = None if last and status == "info" and rng.random() < 0.5 else inv + lat
        push(inv, "invoke", (p, f, key, n, status, complete))
        clock[p] = (complete if complete is not None else inv + lat) + rng.randrange(1, 30) * MS

    logs: dict[str, list[str]] = {k: [] for k in KEYS}
    positions: dict[tuple[int, str], int] = {}
    pending: dict[int, tuple[str, str, str, int, dict[str, object]]] = {}
    end = 0
    with Writer(path, metadata={"seed": seed, "buggy": buggy}) as w:
        while heap:
            time_ns, _, _, kind, payload = heapq.heappop(heap)
            end = max(end, time_ns)
            if kind == "nem":
                fn, nk, targets = payload
                w.nemesis(fn, nk, targets, time_ns=time_ns)  # type: ignore[arg-type]
            elif kind == "invoke":
                p, f, key, n, status, complete = payload
                assert isinstance(p, int) and isinstance(key, str) and isinstance(f, str)
                fields: dict[str, object] = {}
                if f == "produce":
                    fields["value"] = f"v{n}"
                elif f == "read":
                    fields["offset"] = rng.randrange(0, max(1, len(logs[key]) + 1))
                    fields["consistency"] = rng.choice(["committed", "linearizable"])
                    fields["limit"] = rng.choice([5, 50])
                elif f == "poll":
                    fields["group"] = "g"
                elif f == "seek":
                    fields["offset"] = rng.randrange(0, max(1, len(logs[key]) + 1))
                else:
                    fields["group"] = "g"
                    fields["offset"] = positions.get((p, key), 0)
                w.invoke(p, f, key, time_ns=time_ns, **fields)
                pending[p] = (f, key, str(status), n, fields)
                if complete is not None:
                    push(int(str(complete)), "complete", (p,))
            else:
                (p,) = payload
                assert isinstance(p, int)
                f, key, status, n, fields = pending.pop(p)
                log = logs[key]
                out: dict[str, object] = {}
                if f == "produce":
                    applied = status == "ok" or (status == "info" and rng.random() < 0.5)
                    if buggy and status == "fail" and rng.random() < 0.2:
                        applied = True  # aborted read later
                    if applied:
                        if buggy and status == "ok" and rng.random() < 0.05:
                            out["offset"] = len(log)  # acked, never stored: lost
                        else:
                            log.append(str(fields["value"]))
                            out["offset"] = len(log) - 1
                            if buggy and rng.random() < 0.03:
                                log.append(str(fields["value"]))  # duplicate
                    elif status == "ok":
                        out["offset"] = len(log)
                elif f == "read" and status == "ok":
                    off = int(str(fields["offset"]))
                    lim = int(str(fields["limit"]))
                    view = log
                    if buggy and rng.random() < 0.1:
                        view = log[: max(0, len(log) - 3)]  # stale
                    out["value"] = [[off + i, v] for i, v in enumerate(view[off : off + lim])]
                elif f == "poll" and status == "ok":
                    pos = positions.get((p, key), 0)
                    if buggy and rng.random() < 0.1:
                        pos += 1  # skip one
                    elif buggy and pos > 0 and rng.random() < 0.2:
                        pos -= 1  # go back one
                    got = [[pos + i, v] for i, v in enumerate(log[pos : pos + 4])]
                    out["value"] = got
                    positions[(p, key)] = pos + len(got)
                elif f == "seek" and status == "ok":
                    positions[(p, key)] = int(str(fields["offset"]))
                w.complete(status, p, time_ns=time_ns, **out)  # type: ignore[arg-type]
        t = end + 100 * MS
        for k, key in enumerate(KEYS):
            p = 100 + k
            w.invoke(
                p, "final_read", key, time_ns=t, offset=0, limit=10_000, consistency="linearizable"
            )
            vals = [[i, v] for i, v in enumerate(logs[key])]
            if buggy:
                vals = vals[:-2]  # the newest acknowledged writes are not there
            w.ok(p, time_ns=t + 5 * MS, value=vals)
            t += 10 * MS
