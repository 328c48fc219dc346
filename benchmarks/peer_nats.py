"""Peer: a 3-node NATS JetStream cluster (Debian ``nats-server``, 2.9) on 127.0.0.1.

:func:`nats_cluster` writes one config file per server (client, route and
monitoring ports free on 127.0.0.1, the JetStream store under the given
scratch directory), starts the servers as child processes, waits for every
``/healthz``, creates an R3 file-backed stream and returns the client URL of
the server that leads the stream. The servers are always stopped by PID on
the way out (``atexit`` too, see :mod:`benchmarks.peer_procs`).

Durability: JetStream acknowledges a publish once a quorum of the stream's
replicas has the message, *before* it is fsynced: its file store syncs in the
background every 60 s in nats-server 2.9 (a fixed interval there;
``sync_interval`` became a setting in 2.10, default 2 min). It therefore
compares with our ``flush = "async"`` (fsync every ``flush_interval_ms``),
not with ``sync``.

It is driven with ``nats-py`` (the ``bench`` extra, imported when used), the
official asyncio client: one connection in
the benchmark process, ``concurrency`` tasks each publishing and awaiting the
stream's acknowledgement (:func:`closed_loop`, the same shape and result as
:func:`benchmarks.loadgen.closed_loop`). JetStream 2.9 has no batch publish: a
"request" of 100 messages is 100 ``publish_async`` calls (the client's
pipelined publish, one acknowledgement per message) sent together, done when
all 100 are acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import peer_procs
from benchmarks.loadgen import _result
from dledger.cluster import free_ports

INSTALL_HINT = "nats-server is not installed (Debian: apt-get install nats-server)"
STREAM = "BENCH"
SUBJECT = "bench.msgs"
SYNC_INTERVAL_S = 60  # nats-server 2.9's file store: fixed background fsync interval
DURABILITY = (
    "JetStream acknowledges after a quorum of the R3 stream stored the message, before "
    f"fsync (nats-server 2.9 syncs its file store every {SYNC_INTERVAL_S} s): "
    'compare with our flush = "async"'
)


def nats_binary() -> str | None:
    return shutil.which("nats-server")


def missing() -> str | None:
    """Why the peer cannot run here (server or client missing), or None."""
    if nats_binary() is None:
        return INSTALL_HINT
    if importlib.util.find_spec("nats") is None:
        return "nats-py is not installed (pip install -e '.[bench]')"
    return None


def nats_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().rsplit(" ", 1)[-1] or "unknown"


@dataclass
class NatsCluster:
    binary: str
    directory: Path
    servers: int = 3
    client_urls: list[str] = field(default_factory=list)
    monitor_urls: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        n = self.servers
        ports = free_ports(3 * n)
        client, route, monitor = ports[:n], ports[n : 2 * n], ports[2 * n :]
        self.client_urls = [f"nats://127.0.0.1:{p}" for p in client]
        self.monitor_urls = [f"http://127.0.0.1:{p}" for p in monitor]
        for i in range(n):
            conf = self.directory / f"n{i}.conf"
            routes = ", ".join(f'"nats-route://127.0.0.1:{route[j]}"' for j in range(n) if j != i)
            store = json.dumps(str(self.directory / f"n{i}.js"))
            conf.write_text(
                f"server_name: n{i}\n"
                f"listen: 127.0.0.1:{client[i]}\n"
                f"http: 127.0.0.1:{monitor[i]}\n"
                f"jetstream {{ store_dir: {store} }}\n"
                f"cluster {{ name: bench, listen: 127.0.0.1:{route[i]}, routes: [{routes}] }}\n"
            )
            log = self.directory / f"n{i}.log"
            self.procs.append(peer_procs.spawn([self.binary, "-c", str(conf)], log, self.directory))
            self.logs.append(log)

    def _check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server died {peer_procs.describe(proc, log)}")

    def healthy(self) -> bool:
        self._check_alive()
        for u in self.monitor_urls:
            try:
                st, _ = peer_procs.http_get(u + "/healthz")
            except OSError:
                return False
            if st != 200:
                return False
        return True

    def stop(self) -> None:
        for proc in self.procs:
            peer_procs.stop(proc)


async def create_stream(servers: list[str], timeout_s: float = 60.0) -> str:
    """Create the R3 file stream (retrying until the meta leader is elected);
    returns the name of the server that leads it."""
    import nats
    from nats.errors import Error as NatsError
    from nats.js.api import StorageType
    from nats.js.errors import Error as JsError

    nc = await nats.connect(servers=servers, connect_timeout=5, max_reconnect_attempts=3)
    try:
        js = nc.jetstream(timeout=5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await js.add_stream(
                    name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE, num_replicas=3
                )
                info = await js.stream_info(STREAM)
                if info.cluster is not None and info.cluster.leader:
                    return info.cluster.leader
            except (NatsError, JsError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no R3 stream {STREAM} within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


@contextlib.contextmanager
def nats_cluster(directory: Path, servers: int = 3) -> Iterator[tuple[NatsCluster, str]]:
    """A healthy cluster with the stream, and the client URL of the stream's
    leader; stopped by PID on exit."""
    binary = nats_binary()
    if binary is None or missing():
        raise FileNotFoundError(missing())
    c = NatsCluster(binary, directory, servers)
    try:
        c.start()
        peer_procs.wait_until("nats cluster healthy", c.healthy, 60)
        leader = asyncio.run(create_stream(c.client_urls))
        yield c, c.client_urls[int(leader.removeprefix("n"))]
    finally:
        c.stop()


async def closed_loop(
    url: str,
    payload: bytes,
    *,
    concurrency: int,
    duration_s: float,
    msgs_per_req: int,
    timeout_s: float = 10.0,
    total_requests: int | None = None,
) -> dict[str, Any]:
    """Like :func:`benchmarks.loadgen.closed_loop`: ``concurrency`` workers,
    each publishes its next "request" (``msgs_per_req`` messages, all
    acknowledged) when the previous one is done."""
    import nats
    from nats.errors import Error as NatsError
    from nats.js.errors import Error as JsError

    lat: list[float] = []
    errors: dict[str, int] = {}
    claimed = 0
    nc = await nats.connect(servers=[url], connect_timeout=5, max_reconnect_attempts=3)
    try:
        js = nc.jetstream(timeout=timeout_s, publish_async_max_pending=100 * concurrency + 100)
        stop_at = time.perf_counter() + duration_s

        async def one_request() -> None:
            if msgs_per_req == 1:
                await js.publish(SUBJECT, payload)
                return
            # The client's pipelined API: send all, then await every acknowledgement.
            acks = [await js.publish_async(SUBJECT, payload) for _ in range(msgs_per_req)]
            await asyncio.wait_for(asyncio.gather(*acks), timeout_s)

        async def worker() -> None:
            nonlocal claimed
            while time.perf_counter() < stop_at:
                if total_requests is not None and claimed >= total_requests:
                    return
                claimed += 1
                t = time.perf_counter()
                try:
                    await one_request()
                except (NatsError, JsError, TimeoutError) as exc:
                    claimed -= 1
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    await asyncio.sleep(0.01)
                    continue
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    finally:
        await nc.close()
    out = _result(lat, errors, elapsed, msgs_per_req)
    out["concurrency"] = concurrency
    return out
