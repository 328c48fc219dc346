"""Peer: a 3-member etcd cluster (Debian ``etcd-server``, etcd 3.4) on 127.0.0.1.

:func:`etcd_cluster` starts the members as child processes with free ports
and data directories under the given scratch directory, waits until every
member answers ``/health`` and a leader is known, and always stops them by
PID on the way out (``atexit`` too, see :mod:`benchmarks.peer_procs`).

etcd runs with its defaults: it fsyncs its WAL before acknowledging a write
(on the leader and on the followers that make the quorum), so it compares
with our ``flush = "sync"``. It is driven through its JSON gateway, the HTTP
face of its gRPC API: ``POST /v3/kv/put`` for one message, ``POST /v3/kv/txn``
with 100 puts in ``success`` for a batch of 100 (one Raft entry).
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import peer_procs
from dledger.cluster import free_ports

INSTALL_HINT = "etcd is not installed (Debian: apt-get install etcd-server)"
DURABILITY = "etcd defaults: the WAL is fsynced before a write is acknowledged"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def etcd_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first.split(":", 1)[-1].strip() or "unknown"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def value_of(size: int) -> bytes:
    return (b"v" * size)[:size]


def put_body(size: int, key: bytes = b"bench/0") -> bytes:
    """A ``/v3/kv/put`` body: one ``size``-byte value (a new revision each time)."""
    return json.dumps({"key": _b64(key), "value": _b64(value_of(size))}).encode()


def txn_body(n: int, size: int) -> bytes:
    """A ``/v3/kv/txn`` body: ``n`` puts of ``size`` bytes (distinct keys, as a
    transaction may not name a key twice), no compare, so ``success`` runs."""
    ops = [
        {"request_put": {"key": _b64(f"bench/{i:03d}".encode()), "value": _b64(value_of(size))}}
        for i in range(n)
    ]
    return json.dumps({"compare": [], "success": ops, "failure": []}).encode()


def _post_json(url: str, body: dict[str, Any], timeout_s: float = 2.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@dataclass
class EtcdCluster:
    binary: str
    directory: Path
    members: int = 3
    client_urls: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * self.members)
        peer_urls = [f"http://127.0.0.1:{p}" for p in ports[: self.members]]
        self.client_urls = [f"http://127.0.0.1:{p}" for p in ports[self.members :]]
        initial = ",".join(f"m{i}={u}" for i, u in enumerate(peer_urls))
        for i in range(self.members):
            log = self.directory / f"m{i}.log"
            cmd = [
                self.binary,
                "--name",
                f"m{i}",
                "--data-dir",
                str(self.directory / f"m{i}.etcd"),
                "--listen-peer-urls",
                peer_urls[i],
                "--initial-advertise-peer-urls",
                peer_urls[i],
                "--listen-client-urls",
                self.client_urls[i],
                "--advertise-client-urls",
                self.client_urls[i],
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                f"bench-{ports[0]}",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
            ]
            self.procs.append(peer_procs.spawn(cmd, log, self.directory))
            self.logs.append(log)

    def _check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"etcd member died {peer_procs.describe(proc, log)}")

    def healthy(self) -> bool:
        self._check_alive()
        for u in self.client_urls:
            try:
                st, body = peer_procs.http_get(u + "/health")
            except OSError:
                return False
            if st != 200 or json.loads(body).get("health") != "true":
                return False
        return True

    def leader_url(self) -> str | None:
        """The client URL of the member that leads (followers forward to it)."""
        for u in self.client_urls:
            try:
                st = _post_json(u + "/v3/maintenance/status", {})
            except (OSError, ValueError):
                continue
            leader = st.get("leader")
            if leader and leader == st.get("header", {}).get("member_id"):
                return u
        return None

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        peer_procs.wait_until("etcd cluster healthy", self.healthy, timeout_s)
        found: list[str] = []

        def has_leader() -> bool:
            self._check_alive()
            u = self.leader_url()
            if u:
                found.append(u)
            return u is not None

        peer_procs.wait_until("etcd leader", has_leader, timeout_s)
        return found[-1]

    def stop(self) -> None:
        for proc in self.procs:
            peer_procs.stop(proc)


@contextlib.contextmanager
def etcd_cluster(directory: Path, members: int = 3) -> Iterator[tuple[EtcdCluster, str]]:
    """A healthy etcd cluster and its leader's client URL; stopped by PID on exit."""
    binary = etcd_binary()
    if binary is None:
        raise FileNotFoundError(INSTALL_HINT)
    c = EtcdCluster(binary, directory, members)
    try:
        c.start()
        leader = c.wait_ready()
        yield c, leader
    finally:
        c.stop()
