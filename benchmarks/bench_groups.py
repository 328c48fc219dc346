"""Produce throughput over 1, 2 and 3 broker groups (3 voters each, plus a
3-node controller group), and the proxy's overhead against client-side
routing (issue #15).

Load: ``WORKERS`` threads, each a closed loop of produce requests of
``BATCH`` messages of 100 bytes, unordered, through
:class:`http_api.routing.RoutingClient` (one queue per request, round robin
over a 12-queue topic). Figures per group count: messages/s, and
messages per CPU-second of all node processes (utime + stime over the
window: the per-core efficiency, since every group adds 3 processes that
share this machine's cores). Then, on the 3-group cluster, the same load
through a ``dledger proxy`` process: messages/s and the median request
latency, next to client-side routing's.

On one machine more groups do not go faster: every group's leader and
followers compete for the same cores and the same disk (each commit is an
fsync on a quorum). On one machine per node, groups share nothing, and
throughput is expected to grow with the number of groups until the clients
or the network are the limit.
"""

from __future__ import annotations

import base64
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.registry import BenchResult, Context, Figure, benchmark
from dledger.cluster import cpu_ticks, free_ports, http_request
from dledger_app.groups import MultiCluster
from dledger_app.multi_cli import wait_groups_live
from http_api.client import ApiError, Client, OutMessage
from http_api.routing import RoutingClient

TOPIC = "bench"
QUEUES = 12
BATCH = 32
WORKERS = 8
VALUE = b"x" * 100


def _node_pids(mc: MultiCluster) -> list[int]:
    return [p for lc in mc.all().values() for n in lc.ids() if (p := lc.pid(n)) is not None]


def _cpu_s(pids: list[int]) -> float:
    hz = os.sysconf("SC_CLK_TCK")
    return sum((cpu_ticks(p) or 0) for p in pids) / hz


def _load(send: Any, seconds: float) -> tuple[float, list[float]]:
    """(messages/s, request latencies) of WORKERS closed loops for ``seconds``."""
    stop = time.monotonic() + seconds
    lat: list[float] = []
    count = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def loop() -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                send()
            except ApiError as exc:
                with lock:
                    errors.append(str(exc))
                continue
            dt = time.perf_counter() - t0
            with lock:
                count[0] += BATCH
                lat.append(dt)

    threads = [threading.Thread(target=loop) for _ in range(WORKERS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and not lat:
        raise RuntimeError(f"every request failed, e.g. {errors[0]}")
    return count[0] / (time.monotonic() - t0), lat


def _client_sender(rc: RoutingClient) -> Any:
    msgs = [OutMessage(VALUE) for _ in range(BATCH)]
    return lambda: rc.produce(TOPIC, msgs)


def _proxy_sender(addr: str) -> Any:
    body = {"messages": [{"value": base64.b64encode(VALUE).decode()} for _ in range(BATCH)]}

    def send() -> None:
        Client([addr], timeout_s=10.0, retry_for_s=5.0).request(
            "POST", f"/v1/topics/{TOPIC}/messages", body, safe=False
        )

    return send


@benchmark("groups", "Produce over 1, 2, 3 broker groups; the proxy's overhead (issue #15)")
def run_groups(ctx: Context) -> BenchResult:
    res = BenchResult()
    seconds = 5.0 if ctx.quick else 15.0
    repeats = ctx.repeats(3, 1)
    raw: dict[str, Any] = {"batch": BATCH, "workers": WORKERS, "seconds": seconds}
    for n in (1, 2, 3):
        mc = MultiCluster.create(ctx.work_dir / f"groups-{n}", groups=n, nodes=3)
        proxy: subprocess.Popen[bytes] | None = None
        try:
            for lc in mc.all().values():
                lc.start_all()
            for lc in mc.all().values():
                lc.wait_leader(90)
            wait_groups_live(mc, 90)
            rc = RoutingClient(mc.endpoints())
            rc.create_topic(TOPIC, QUEUES)
            pids = _node_pids(mc)
            rates, effs = [], []
            ctx.log(f"groups: {n} group(s), {seconds:.0f} s x {repeats}")
            lat_client: list[float] = []
            for _ in range(repeats):
                c0 = _cpu_s(pids)
                rate, lat_client = _load(_client_sender(rc), seconds)
                cpu = _cpu_s(pids) - c0
                rates.append(rate)
                effs.append(rate * seconds / cpu if cpu > 0 else float("nan"))
            conf = {"groups": n, "nodes_per_group": 3, "batch": BATCH, "workers": WORKERS}
            res.figures += [
                Figure.of(f"groups.{n}.msg_per_s", f"produce, {n} group(s)", "msg/s", rates,
                          config=conf),
                Figure.of(f"groups.{n}.msg_per_cpu_s", f"produce per node CPU-second, {n} group(s)",
                          "msg/CPU-s", effs, config=conf),
            ]  # fmt: skip
            raw[f"groups_{n}"] = {"rates": rates, "msg_per_cpu_s": effs}
            if n == 3:
                mc.wait_serving(60)
                (port,) = free_ports(1)
                addr = f"127.0.0.1:{port}"
                proxy = subprocess.Popen(
                    [sys.executable, "-m", "dledger_app.cli", "proxy", "--dir", str(mc.dir),
                     "--listen", addr, "--log-level", "warning"],
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                deadline = time.monotonic() + 30
                while True:
                    try:
                        r = http_request(addr, "GET", "/healthz", timeout_s=1)
                        if r.status == 200 and r.json().get("role") == "proxy":
                            break
                    except (OSError, ValueError):
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the proxy did not start")
                    time.sleep(0.1)
                p_rates, p_lat = [], []
                for _ in range(repeats):
                    rate, lat = _load(_proxy_sender(addr), seconds)
                    p_rates.append(rate)
                    p_lat.append(statistics.median(lat) * 1000 if lat else float("nan"))
                c_lat = statistics.median(lat_client) * 1000 if lat_client else float("nan")
                pconf = {"groups": 3, "batch": BATCH, "workers": WORKERS}
                res.figures += [
                    Figure.of("groups.proxy.msg_per_s", "produce through the proxy, 3 groups",
                              "msg/s", p_rates, config=pconf),
                    Figure.of("groups.proxy.median_ms", "proxy: median request latency", "ms",
                              p_lat, higher_is_better=False, config=pconf),
                    Figure.of("groups.client.median_ms", "client-side routing: median latency",
                              "ms", [c_lat], higher_is_better=False, config=pconf),
                ]  # fmt: skip
                raw["proxy"] = {"rates": p_rates, "median_ms": p_lat, "client_median_ms": c_lat}
        finally:
            mc.down(proxy)
    res.raw = raw
    res.notes.append(
        "One machine: every group's nodes share its cores and disk, so more groups do not "
        "go faster here; see msg/CPU-s for the per-core efficiency. On one machine per node "
        "the groups share nothing and throughput should grow with their number."
    )
    return res
