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
from collections.abc import Callable
from typing import Any

from dledger.errors import DLedgerError


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = min(len(sorted_ms) - 1, max(0, round(p / 100 * (len(sorted_ms) - 1))))
    return sorted_ms[k]


class _Run:
    """What both load shapes share: payloads, submission with a completion
    callback, per-proposal latency from a given start time, error counts."""

    def __init__(self, node: Any, n: int, size: int) -> None:
        self.node, self.n, self.size = node, n, size
        self._payload = os.urandom(max(size, 8))
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.next = 0  # proposals submitted (or refused)
        self.finished = 0
        self.in_flight = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_finish: Callable[[], None] = lambda: None

    def submit_next(self, since: float) -> None:
        """Submit proposal ``self.next``; its latency counts from ``since``."""
        i = self.next
        self.next += 1
        data = (
            i.to_bytes(8, "big") + self._payload[8 : self.size]
            if self.size >= 8
            else (self._payload[: self.size])
        )
        try:
            fut = self.node.submit(data)
        except DLedgerError as exc:
            # Refused at once (not the leader, overloaded...): the rest would
            # be refused the same way. Count them all as refused here rather
            # than through _finish -> on_finish -> submit_next, which recursed
            # once per remaining proposal (RecursionError on a lost leadership).
            remaining = self.n - i
            self.next = self.n
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + remaining
            self.finished += remaining
            if self.finished >= self.n and not self.done.done():
                self.done.set_result(None)
            return
        self.in_flight += 1
        fut.add_done_callback(functools.partial(self._completed, since))

    def _completed(self, since: float, fut: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        exc = fut.exception()
        if exc is None:
            self.latencies.append((time.perf_counter() - since) * 1000.0)
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if exc is not None:
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
        self.finished += 1
        if self.finished >= self.n and not self.done.done():
            self.done.set_result(None)
        self.on_finish()

    def summary(self, elapsed: float) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "ops": len(lat),
            "errors": self.errors,
            "elapsed_s": elapsed,
            "ops_per_s": len(lat) / elapsed if elapsed > 0 else 0.0,
            "latency_ms": {
                "p50": _pct(lat, 50),
                "p99": _pct(lat, 99),
                "max": lat[-1] if lat else float("nan"),
            },
        }


async def pipelined(node: Any, n: int, size: int, window: int) -> dict[str, Any]:
    """Propose ``n`` entries of ``size`` bytes with at most ``window`` in flight.

    Completion callbacks (no task per proposal), as the PySyncObj driver
    uses its commit callbacks, so the harness costs little next to the log."""
    run = _Run(node, n, size)

    def fill() -> None:
        while run.in_flight < window and run.next < n:
            run.submit_next(time.perf_counter())

    run.on_finish = fill
    cpu0 = time.process_time()
    start = time.perf_counter()
    fill()
    await run.done
    out = run.summary(time.perf_counter() - start)
    out["leader_cpu_s"] = time.process_time() - cpu0
    return out


async def paced(node: Any, n: int, size: int, rate: float) -> dict[str, Any]:
    """Open-loop load: entry ``i`` is due at ``start + i / rate``; latency is
    measured from that due time, so a stall is charged to every entry that
    should have been sent during it (no coordinated omission). Entries are
    released by a 1 ms timer, each with a completion callback."""
    run = _Run(node, n, size)
    loop = asyncio.get_running_loop()
    start = time.perf_counter()

    def release() -> None:
        now = time.perf_counter()
        while run.next < n and start + run.next / rate <= now:
            run.submit_next(start + run.next / rate)
        if run.next < n:
            loop.call_later(0.001, release)

    release()
    await run.done
    out = run.summary(time.perf_counter() - start)
    out["offered_per_s"] = rate
    return out
