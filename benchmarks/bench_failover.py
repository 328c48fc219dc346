"""Failover: SIGKILL (and SIGSTOP) of the leader under steady produce load.

Each trial: producers (closed loop, batches of 10 x 100 B, short client
timeouts, following ``307`` redirects and skipping the node that just
failed) run for a baseline period; the leader is signalled; the load goes
on until the throughput has recovered (or a time limit). Measured from the
signal:

* **RTO**: to the first acknowledged produce from another node (the new
  leader);
* **time to full throughput**: to the end of the first 300 ms window whose
  acknowledged rate is at least 80% of the baseline's.

Then the old leader is restarted (SIGKILL) or continued (SIGSTOP) and the
cluster is left to catch up before the next trial.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import orjson

from benchmarks.common import cluster, produce_body, produce_url, wait_caught_up
from benchmarks.registry import BenchResult, Context, Figure, benchmark
from benchmarks.stats import percentile
from dledger.cluster import LocalCluster

WORKERS = 8
MSGS = 10
BASELINE_S = 1.5
WINDOW_S = 0.3
FULL_FRACTION = 0.8


async def _trial(
    lc: LocalCluster, leader: int, sig: signal.Signals, max_after_s: float
) -> dict[str, Any]:
    addrs = {nid: lc.http(nid) for nid in lc.ids()}
    by_addr = {a: nid for nid, a in addrs.items()}
    body = produce_body(MSGS, 100)
    acks: list[tuple[float, int]] = []
    suspect: dict[int, float] = {}
    guess = [leader]
    stop = asyncio.Event()
    errors: dict[str, int] = {}

    def pick(avoid: int) -> int:
        now = time.perf_counter()
        ok = [n for n in addrs if n != avoid and suspect.get(n, 0) < now]
        ok = ok or [n for n in addrs if n != avoid]
        return ok[(int(now * 1000)) % len(ok)]

    async def worker(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            nid = guess[0]
            try:
                async with s.post(
                    produce_url(addrs[nid]),
                    data=body,
                    allow_redirects=False,
                    headers={"content-type": "application/json"},
                ) as r:
                    raw = await r.read()
                    st = r.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                suspect[nid] = time.perf_counter() + 1.0
                guess[0] = pick(nid)
                await asyncio.sleep(0.005)
                continue
            if st == 200:
                acks.append((time.perf_counter(), nid))
                continue
            errors[str(st)] = errors.get(str(st), 0) + 1
            hint = 0
            if st == 307:
                try:
                    hint = int(orjson.loads(raw)["error"]["leader"])
                except (ValueError, KeyError, TypeError):
                    hint = 0
            if hint and suspect.get(hint, 0) < time.perf_counter() and hint in addrs:
                guess[0] = hint
            else:
                guess[0] = pick(nid)
                await asyncio.sleep(0.01)

    timeout = aiohttp.ClientTimeout(total=0.5)
    conn = aiohttp.TCPConnector(limit=WORKERS * 2)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        tasks = [asyncio.create_task(worker(s)) for _ in range(WORKERS)]
        await asyncio.sleep(BASELINE_S)
        t_kill = time.perf_counter()
        lc.send_signal(leader, sig)
        base = [t for t, _ in acks if t_kill - 1.0 <= t < t_kill]
        base_rate = len(base) / 1.0
        rto: float | None = None
        full: float | None = None
        deadline = t_kill + max_after_s
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
            after = [(t, n) for t, n in acks if t > t_kill]
            if rto is None:
                firsts = [t for t, n in after if n != leader]
                if firsts:
                    rto = min(firsts) - t_kill
            if rto is not None and full is None:
                ts = sorted(t for t, _ in after)
                # sliding windows ending every 50 ms after the first new ack
                end = t_kill + rto + WINDOW_S
                now = time.perf_counter()
                while end <= now:
                    k = sum(1 for t in ts if end - WINDOW_S <= t < end)
                    if k / WINDOW_S >= FULL_FRACTION * base_rate:
                        full = end - t_kill
                        break
                    end += 0.05
            if full is not None and time.perf_counter() > t_kill + full + 0.2:
                break
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    new_leaders = sorted({by_addr.get(addrs[n], n) for t, n in acks if t > t_kill and n != leader})
    return {
        "signal": sig.name,
        "old_leader": leader,
        "new_leaders": new_leaders,
        "baseline_msg_per_s": base_rate * MSGS,
        "rto_s": rto,
        "full_throughput_s": full,
        "errors": errors,
    }


def _recover(lc: LocalCluster, old: int, sig: signal.Signals) -> None:
    if sig is signal.SIGKILL:
        lc.wait_exit(old, 10)
        lc.start(old)
    else:
        lc.send_signal(old, signal.SIGCONT)
    lc.wait_leader(30)
    wait_caught_up(lc, 60)


@benchmark("failover", "SIGKILL / SIGSTOP of the leader under load: RTO, time to full throughput")
def run_failover(ctx: Context) -> BenchResult:
    res = BenchResult()
    trials = 3 if ctx.quick else 20
    max_after = 4.0 if ctx.quick else 6.0
    with cluster(ctx, voters=3, settings={"map_size_bytes": 2 << 30}) as (lc, _):
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            out = []
            for k in range(trials):
                leader = lc.wait_leader(30)
                r = asyncio.run(_trial(lc, leader, sig, max_after))
                out.append(r)
                rto = r["rto_s"]
                full = r["full_throughput_s"]
                ctx.log(
                    f"failover {sig.name} {k + 1}/{trials}: leader {leader} -> "
                    f"{r['new_leaders']}, RTO "
                    f"{'none' if rto is None else f'{rto * 1000:.0f} ms'}, full throughput "
                    f"{'none' if full is None else f'{full * 1000:.0f} ms'} "
                    f"(baseline {r['baseline_msg_per_s']:,.0f} msg/s)"
                )
                _recover(lc, leader, sig)
            res.raw[sig.name] = out
            rtos = [r["rto_s"] for r in out if r["rto_s"] is not None]
            fulls = [r["full_throughput_s"] for r in out if r["full_throughput_s"] is not None]
            failed = trials - len(rtos)
            name = sig.name
            cfg = {
                "trials": trials,
                "no_recovery_within_s": max_after,
                "trials_without_rto": failed,
                "workers": WORKERS,
                "msgs_per_request": MSGS,
                "client_timeout_s": 0.5,
            }
            # A trial without recovery within the limit counts as the limit.
            rto_all = rtos + [max_after] * failed
            res.figures += [
                Figure.of(
                    f"failover.{name}.rto_median_s",
                    f"leader {name}: RTO median over trials",
                    "s",
                    [percentile(rto_all, 50)] if rto_all else [],
                    higher_is_better=False,
                    config=cfg,
                ),
                Figure.of(
                    f"failover.{name}.rto_p99_s",
                    f"leader {name}: RTO p99 over trials",
                    "s",
                    [percentile(rto_all, 99)] if rto_all else [],
                    higher_is_better=False,
                    config=cfg,
                ),
                Figure.of(
                    f"failover.{name}.rto_s",
                    f"leader {name}: RTO (median of trials; min..max)",
                    "s",
                    rto_all,
                    higher_is_better=False,
                    config=cfg,
                ),
                Figure.of(
                    f"failover.{name}.full_throughput_s",
                    f"leader {name}: time to {FULL_FRACTION:.0%} of baseline throughput",
                    "s",
                    fulls,
                    higher_is_better=False,
                    config=cfg,
                ),
            ]
    res.notes.append(
        "Election timeout: election_ticks 15 x tick_ms 20 = 300 ms (randomised above "
        "that), pre-vote and check-quorum on; the client times a request out after 0.5 s."
    )
    return res
