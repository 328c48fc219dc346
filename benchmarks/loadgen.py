"""HTTP load generators (aiohttp client, keep-alive connections).

* :func:`closed_loop`: ``concurrency`` workers, each sends its next request
  when the previous one is answered. It finds the saturation rate; its
  latencies are *not* what a user at that rate sees (a stalled server slows
  the senders down: coordinated omission).
* :func:`open_loop`: request ``i`` is due at ``start + i / rate`` whatever
  happened before; latency is measured from that intended send time, so a
  stall is charged to every request that should have been sent during it.
  Requests wait for a free connection from a bounded pool (that wait is
  part of their latency, as it would be in a real client).

Both run in the benchmark process, on the same two cores as the nodes; the
client's CPU is part of what is measured (the peer's driver runs inside its
leader process and pays nothing for a client).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from benchmarks.stats import summarize

JSON = "application/json"


def _session(connections: int, timeout_s: float, content_type: str = JSON) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, force_close=False)
    return aiohttp.ClientSession(
        connector=conn,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        headers={"content-type": content_type},
    )


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(url, data=body, allow_redirects=False) as r:
        await r.read()
        return r.status


def _result(
    lat_s: list[float], errors: dict[str, int], elapsed: float, msgs_per_req: int
) -> dict[str, Any]:
    ok = len(lat_s)
    return {
        "requests_ok": ok,
        "errors": errors,
        "elapsed_s": elapsed,
        "req_per_s": ok / elapsed if elapsed > 0 else 0.0,
        "msg_per_s": ok * msgs_per_req / elapsed if elapsed > 0 else 0.0,
        "latency_ms": summarize([x * 1000.0 for x in lat_s]),
    }


async def closed_loop(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration_s: float,
    msgs_per_req: int,
    timeout_s: float = 10.0,
    total_requests: int | None = None,
    content_type: str = JSON,
) -> dict[str, Any]:
    """``total_requests``: stop after that many successful requests, or after
    ``duration_s`` (a time limit then) whichever comes first."""
    lat: list[float] = []
    claimed = 0
    errors: dict[str, int] = {}
    async with _session(concurrency, timeout_s, content_type) as s:
        stop_at = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal claimed
            while True:
                if time.perf_counter() >= stop_at:
                    return
                if total_requests is not None and claimed >= total_requests:
                    return
                claimed += 1
                t = time.perf_counter()
                try:
                    st = await _post(s, url, body)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    claimed -= 1
                    await asyncio.sleep(0.01)
                    continue
                if st == 200:
                    lat.append(time.perf_counter() - t)
                else:
                    claimed -= 1
                    errors[str(st)] = errors.get(str(st), 0) + 1
                    await asyncio.sleep(0.01)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    out = _result(lat, errors, elapsed, msgs_per_req)
    out["concurrency"] = concurrency
    return out


async def open_loop(
    url: str,
    body: bytes,
    *,
    rate: float,
    duration_s: float,
    msgs_per_req: int,
    connections: int,
    timeout_s: float = 10.0,
    max_outstanding: int = 20_000,
    content_type: str = JSON,
) -> dict[str, Any]:
    """Offered ``rate`` requests/s for ``duration_s``; see the module docstring.

    Requests that would exceed ``max_outstanding`` are not sent and count as
    ``shed`` errors (the generator itself would otherwise run out of memory
    far past saturation)."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    n_total = max(1, int(rate * duration_s))
    outstanding = 0
    last_done = 0.0
    async with _session(connections, timeout_s, content_type) as s:
        tasks: set[asyncio.Task[None]] = set()

        async def one(due: float) -> None:
            nonlocal outstanding, last_done
            try:
                st = await _post(s, url, body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                return
            finally:
                outstanding -= 1
            now = time.perf_counter()
            last_done = now
            if st == 200:
                lat.append(now - due)
            else:
                errors[str(st)] = errors.get(str(st), 0) + 1

        start = time.perf_counter() + 0.01
        i = 0
        while i < n_total:
            now = time.perf_counter()
            due = start + i / rate
            if due > now:
                await asyncio.sleep(min(due - now, 0.002))
                continue
            while i < n_total and start + i / rate <= now:
                due_i = start + i / rate
                i += 1
                if outstanding >= max_outstanding:
                    errors["shed"] = errors.get("shed", 0) + 1
                    continue
                outstanding += 1
                t = asyncio.create_task(one(due_i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = max(last_done - start, duration_s * 0.5)
    out = _result(lat, errors, elapsed, msgs_per_req)
    out["offered_req_per_s"] = rate
    out["offered_msg_per_s"] = rate * msgs_per_req
    out["connections"] = connections
    return out
