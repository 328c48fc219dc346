"""In-process load for benchmarks: pipelined proposals measured at the leader.

Runs inside a node process (reached through the admin route
``POST /raft/bench``) so that our log and PySyncObj are measured the same way:
both drive their leader from inside the leader process, keep a bounded window
of proposals outstanding, and time each one from submission to its commit
callback (here: applied on the leader, after a quorum fsynced it).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from dledger.errors import DLedgerError


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = min(len(sorted_ms) - 1, max(0, round(p / 100 * (len(sorted_ms) - 1))))
    return sorted_ms[k]


async def pipelined(node: Any, n: int, size: int, window: int) -> dict[str, Any]:
    """Propose ``n`` entries of ``size`` bytes with at most ``window`` in flight."""
    payload_base = os.urandom(max(size, 8))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    sem = asyncio.Semaphore(window)

    async def one(i: int) -> None:
        data = i.to_bytes(8, "big") + payload_base[8:size] if size >= 8 else payload_base[:size]
        t0 = time.perf_counter()
        try:
            await node.propose(data)
            latencies.append((time.perf_counter() - t0) * 1000.0)
        except DLedgerError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        finally:
            sem.release()

    tasks: list[asyncio.Task[None]] = []
    cpu0 = time.process_time()
    start = time.perf_counter()
    for i in range(n):
        await sem.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    latencies.sort()
    return {
        "ops": len(latencies),
        "errors": errors,
        "elapsed_s": elapsed,
        "ops_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "latency_ms": {
            "p50": _pct(latencies, 50),
            "p99": _pct(latencies, 99),
            "max": latencies[-1] if latencies else float("nan"),
        },
        "leader_cpu_s": cpu,
    }


async def sequential(node: Any, n: int, size: int) -> dict[str, Any]:
    """One proposal at a time (the synchronous mode)."""
    return await pipelined(node, n, size, 1)


async def paced(node: Any, n: int, size: int, rate: float) -> dict[str, Any]:
    """Open-loop load: entry ``i`` is due at ``start + i / rate``; latency is
    measured from that due time, so a stall is charged to every entry that
    should have been sent during it (no coordinated omission)."""
    payload_base = os.urandom(max(size, 8))
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one(i: int, due: float) -> None:
        data = i.to_bytes(8, "big") + payload_base[8:size] if size >= 8 else payload_base[:size]
        try:
            await node.propose(data)
            latencies.append((time.perf_counter() - due) * 1000.0)
        except DLedgerError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "ops": len(latencies),
        "errors": errors,
        "offered_per_s": rate,
        "ops_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "latency_ms": {
            "p50": _pct(latencies, 50),
            "p99": _pct(latencies, 99),
            "max": latencies[-1] if latencies else float("nan"),
        },
    }
