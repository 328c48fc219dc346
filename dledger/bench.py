"""In-process load for benchmarks: pipelined proposals measured at the leader.

Runs inside a node process (reached through the admin route
``POST /raft/bench``) so that our log and PySyncObj are measured the same way:
both drive their leader from inside the leader process, keep a bounded window
of proposals outstanding, and time each one from submission to its commit
callback (here: applied on the leader, after a quorum fsynced it).
"""

from __future__ import annotations

import asyncio
import functools
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
    """Propose ``n`` entries of ``size`` bytes with at most ``window`` in flight.

    Completion callbacks (no task per proposal), as the PySyncObj driver
    uses its commit callbacks, so the harness costs little next to the log."""
    payload_base = os.urandom(max(size, 8))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    state = {"next": 0, "finished": 0, "in_flight": 0}

    def data_for(i: int) -> bytes:
        return i.to_bytes(8, "big") + payload_base[8:size] if size >= 8 else payload_base[:size]

    def on_done(t0: float, fut: asyncio.Future[Any]) -> None:
        state["in_flight"] -= 1
        state["finished"] += 1
        exc = fut.exception()
        if exc is None:
            latencies.append((time.perf_counter() - t0) * 1000.0)
        else:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        fill()

    def fill() -> None:
        while state["in_flight"] < window and state["next"] < n:
            i = state["next"]
            state["next"] += 1
            t0 = time.perf_counter()
            try:
                fut = node.submit(data_for(i))
            except DLedgerError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                state["finished"] += 1
                continue
            state["in_flight"] += 1
            fut.add_done_callback(functools.partial(on_done, t0))
        if state["finished"] >= n and not done.done():
            done.set_result(None)

    cpu0 = time.process_time()
    start = time.perf_counter()
    fill()
    await done
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
    should have been sent during it (no coordinated omission). Entries are
    released by a 1 ms timer, each with a completion callback."""
    payload_base = os.urandom(max(size, 8))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    state = {"next": 0, "finished": 0}

    def data_for(i: int) -> bytes:
        return i.to_bytes(8, "big") + payload_base[8:size] if size >= 8 else payload_base[:size]

    def finish_one() -> None:
        state["finished"] += 1
        if state["finished"] >= n and not done.done():
            done.set_result(None)

    def on_done(due: float, fut: asyncio.Future[Any]) -> None:
        exc = fut.exception()
        if exc is None:
            latencies.append((time.perf_counter() - due) * 1000.0)
        else:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        finish_one()

    def release() -> None:
        now = time.perf_counter()
        while state["next"] < n and start + state["next"] / rate <= now:
            i = state["next"]
            state["next"] += 1
            due = start + i / rate
            try:
                node.submit(data_for(i)).add_done_callback(functools.partial(on_done, due))
            except DLedgerError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                finish_one()
        if state["next"] < n:
            loop.call_later(0.001, release)

    start = time.perf_counter()
    release()
    await done
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
