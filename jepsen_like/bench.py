"""Checker speed on generated histories (a benchmark, not a test).

    python -m jepsen_like.bench [--ops 100000] [--profile contended|legacy]
        [--keys K] [--info F] [--concurrency C]
        [--growth 25000,50000,100000,200000] [--seed 1]

:func:`generate` simulates ``concurrency`` clients per key against a real
linearizable log: each op takes effect at one instant inside its
[invoke, complete] window; a fraction ``info`` of the ops gets an unknown
outcome (an ``info`` produce took effect or not, at random; an ``info``
read carries nothing), the rest are acknowledged appends and linearizable
reads of a few offsets near the end. Every generated history is valid, so
the figures are the cost of *deciding valid*, the common case of a run.
The whole history goes through the JSONL writer and the validating reader,
as a real run's does; reading and checking are timed separately.
"""

from __future__ import annotations

import argparse
import heapq
import io
import json
import random
import sys
import time
from typing import Any

from jepsen_like.checkers import linearizable, queue
from jepsen_like.checkers.linearizable import LinConfig
from jepsen_like.checkers.load import load
from jepsen_like.history import History, parse_history


def generate(
    n_ops: int,
    *,
    keys: int = 16,
    info: float = 0.05,
    concurrency: int = 20,
    seed: int = 1,
    contended: bool = False,
) -> list[str]:
    """JSONL lines of a valid history of about ``n_ops`` operations.

    ``contended`` mimics the harness's contended workload (issue 18): reads
    at the head of the log with small limits (``end=false`` when more
    entries follow), and an ``info`` produce that happened may take effect
    after its client gave up (up to 5 ms of simulated time later)."""
    rng = random.Random(seed)
    per_key = max(1, n_ops // keys)
    events: list[tuple[int, int, dict[str, Any]]] = []
    proc = 0
    for k in range(keys):
        key = f"bench/{k}"
        log: list[str] = []
        # Each client: a sequence of ops; op i of a client starts after its op
        # i-1 completed. Effects are applied in effect-time order via a heap.
        clients = [(rng.randint(0, 1000), proc + c) for c in range(concurrency)]
        proc += concurrency
        heap: list[tuple[int, int, int, int]] = []  # (effect_t, seq, client, invoke_t)
        late: dict[int, str] = {}  # seq -> value of a deferred info effect (client -1)
        seq = 0
        for t, c in clients:
            heapq.heappush(heap, (t + rng.randint(100, 3000), seq, c, t))
            seq += 1
        made = 0
        while made < per_key and heap:
            eff, _, c, inv = heapq.heappop(heap)
            if c < 0:  # a late effect of an info produce
                log.append(late.pop(inv))
                continue
            comp = eff + rng.randint(100, 3000)
            unknown = rng.random() < info
            if rng.random() < 0.5:
                value = f"v{k}-{made}"
                happened = not unknown or rng.random() < 0.5
                rec: dict[str, Any] = {
                    "type": "invoke", "process": c, "f": "produce", "key": key, "value": value,
                }  # fmt: skip
                events.append((inv, 0, rec))
                if happened and unknown and contended and rng.random() < 0.5:
                    late[seq] = value
                    heapq.heappush(heap, (comp + rng.randint(0, 5000), seq, -1, seq))
                    seq += 1
                elif happened:
                    log.append(value)
                if unknown:
                    events.append((comp, 1, {"type": "info", "process": c, "f": "produce"}))
                else:
                    events.append(
                        (comp, 1, {"type": "ok", "process": c, "f": "produce",
                                   "offset": len(log) - 1})
                    )  # fmt: skip
            else:
                limit = rng.choice((2, 4, 8)) if contended else 8
                start = max(0, len(log) - rng.randint(-1 if contended else 0, 4))
                res = [[o, log[o]] for o in range(start, min(len(log), start + limit))]
                events.append(
                    (inv, 0, {"type": "invoke", "process": c, "f": "read", "key": key,
                              "offset": start, "consistency": "linearizable", "limit": limit})
                )  # fmt: skip
                if unknown:
                    events.append((comp, 1, {"type": "info", "process": c, "f": "read"}))
                else:
                    events.append(
                        (comp, 1, {"type": "ok", "process": c, "f": "read", "value": res,
                                   "end": start + len(res) >= len(log)})
                    )  # fmt: skip
            made += 1
            nxt = comp + rng.randint(1, 500)
            heapq.heappush(heap, (nxt + rng.randint(100, 3000), seq, c, nxt))
            seq += 1
    events.sort(key=lambda e: (e[0], e[1]))
    out = io.StringIO()
    for index, (t, _, rec) in enumerate(events):
        out.write(json.dumps({**rec, "time_ns": t * 1000, "index": index}) + "\n")
    return out.getvalue().splitlines()


def measure(n_ops: int, args: argparse.Namespace) -> dict[str, Any]:
    lines = generate(
        n_ops,
        keys=args.keys,
        info=args.info,
        concurrency=args.concurrency,
        seed=args.seed,
        contended=args.profile == "contended",
    )
    t0 = time.process_time()
    h: History = parse_history(lines)
    t1 = time.process_time()
    lin = linearizable.check(h, LinConfig(max_seconds=None))
    t2 = time.process_time()
    q = queue.check(h)
    t3 = time.process_time()
    n_info = sum(op.status == "info" for op in h.ops)
    ld = load(h)
    return {
        "profile": args.profile,
        "ops": len(h.ops),
        "info_ops": n_info,
        "info_share": ld["info_share"],
        "mean_overlap": ld["mean_overlap"],
        "mean_overlap_lin": ld["mean_overlap_lin"],
        "keys": args.keys,
        "read_s": round(t1 - t0, 3),
        "linearizable_s": round(t2 - t1, 3),
        "linearizable_verdict": lin["verdict"],
        "queue_s": round(t3 - t2, 3),
        "queue_verdict": q["verdict"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jepsen_like.bench", description=__doc__)
    p.add_argument("--ops", type=int, default=100_000)
    p.add_argument(
        "--profile",
        choices=("contended", "legacy"),
        default="contended",
        help="contended (default): the harness's contended workload, 3 keys x 12 clients, "
        "12%% info, head reads with end=false, late info effects; legacy: 16 keys x 20 "
        "clients, 5%% info, reads of 8 near the end",
    )
    p.add_argument("--keys", type=int, default=None)
    p.add_argument("--info", type=float, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--growth", default="", help="comma-separated op counts to measure too")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    contended = args.profile == "contended"
    if args.keys is None:
        args.keys = 3 if contended else 16
    if args.info is None:
        args.info = 0.12 if contended else 0.05
    if args.concurrency is None:
        args.concurrency = 12 if contended else 20
    sizes = sorted({args.ops, *(int(x) for x in args.growth.split(",") if x)})
    rows = []
    for n in sizes:
        row = measure(n, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["linearizable_verdict"] == "valid" for r in rows)
    if not ok:
        print("a generated (valid) history was not decided valid", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
