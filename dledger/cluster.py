"""Local clusters: a cluster file plus one OS process per member on 127.0.0.1.

:class:`LocalCluster` is what ``dledger cluster ...`` and the integration
tests use. A cluster lives in one directory::

    DIR/cluster.toml      the cluster file (see dledger.config)
    DIR/pids.json         {"<id>": {"pid": ..., "start": ...}} of the running nodes
    DIR/node-<id>.log     each node's stdout and stderr
    DIR/node-<id>/        each node's LMDB data directory

Each node runs as ``python -m dledger_app.cli node --cluster DIR/cluster.toml
--id ID`` in its own session, so it outlives the command that started it.
A recorded pid is only signalled while ``/proc/<pid>/stat`` still shows the
start time recorded with it: a pid the kernel recycled is left alone.

The small HTTP client here (stdlib only) talks to the admin endpoint.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dledger.config import (
    AuthSpec,
    ClusterFile,
    MemberSpec,
    load_cluster_file,
    write_cluster_file,
)
from dledger.errors import ConfigError

DEFAULT_DIR = "run/cluster"
CLUSTER_FILE = "cluster.toml"
PIDS_FILE = "pids.json"


# ---------------------------------------------------------------------------
# HTTP client (stdlib)


@dataclass(frozen=True, slots=True)
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def http_request(
    address: str,
    method: str,
    path: str,
    body: bytes | None = None,
    timeout_s: float = 2.0,
    headers: dict[str, str] | None = None,
) -> HttpResult:
    """One request to ``host:port``. Raises OSError / http.client.HTTPException
    when the node cannot be reached or the connection breaks."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return HttpResult(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


HTTP_ERRORS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


# ---------------------------------------------------------------------------
# processes


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports the OS says are free right now (all bound at once,
    so they differ; another process may still take one before we listen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_HAVE_PROC = os.path.isdir("/proc/self")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid``, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[19])


def process_start_time(pid: int) -> int | None:
    st = _proc_stat(pid)
    return st[1] if st else None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Is ``pid`` running (not a zombie) and, when ``start`` is given, still
    the same process that was recorded?"""
    if _HAVE_PROC:
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        return start is None or st[1] == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is
    the state, ``[1]`` the parent pid, ``[11:15]`` utime, stime, cutime,
    cstime in clock ticks), None if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks (Linux), None if gone."""
    rest = proc_stat(pid)
    return None if rest is None else int(rest[11]) + int(rest[12])


class LocalCluster:
    """A cluster directory and its node processes. See the module docstring."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory).resolve()
        self.cluster_path = self.dir / CLUSTER_FILE
        self.pids_path = self.dir / PIDS_FILE
        self._spec: ClusterFile | None = None
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- the cluster file -----------------------------------------------------
    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        voters: int = 3,
        learners: int = 0,
        secret: str | None = None,
        cluster_id: str = "local",
        host: str = "127.0.0.1",
        settings: dict[str, object] | None = None,
        auth: AuthSpec | None = None,
    ) -> LocalCluster:
        """Write a new cluster file with free ports; refuses to overwrite one.
        ``auth``: bearer tokens for the HTTP API (None: open, the default)."""
        if voters < 1 or learners < 0:
            raise ConfigError(f"need >= 1 voter and >= 0 learners, got {voters} and {learners}")
        lc = cls(directory)
        if lc.cluster_path.exists():
            raise ConfigError(f"{lc.cluster_path} already exists; reuse it or pick another --dir")
        n = voters + learners
        ports = free_ports(2 * n, host)
        members = tuple(
            MemberSpec(
                id=i + 1,
                raft_host=host,
                raft_port=ports[2 * i],
                http_host=host,
                http_port=ports[2 * i + 1],
                role="voter" if i < voters else "learner",
                data_dir=f"node-{i + 1}",
            )
            for i in range(n)
        )
        cf = ClusterFile(
            cluster_id,
            members,
            secret,
            tuple(sorted((settings or {}).items())),
            str(lc.dir),
            auth,
        )
        write_cluster_file(cf, lc.cluster_path)
        lc._spec = load_cluster_file(lc.cluster_path)  # what the nodes will read
        return lc

    @property
    def spec(self) -> ClusterFile:
        if self._spec is None:
            self._spec = load_cluster_file(self.cluster_path)
        return self._spec

    def ids(self) -> list[int]:
        return [m.id for m in self.spec.members]

    def member(self, node_id: int) -> MemberSpec:
        return self.spec.member(node_id)

    def http(self, node_id: int) -> str:
        return self.member(node_id).http_address

    def endpoints(self) -> str:
        """Every member's HTTP ``host:port``, comma-separated: what
        ``--endpoints``, ``$DLEDGER_ENDPOINTS`` and Spark's ``endpoints``
        option take."""
        return ",".join(m.http_address for m in self.spec.members)

    def log_path(self, node_id: int) -> Path:
        return self.dir / f"node-{node_id}.log"

    def data_dir(self, node_id: int) -> Path:
        return Path(self.spec.data_dir(node_id))

    def log_tail(self, node_id: int, lines: int = 20) -> str:
        try:
            text = self.log_path(node_id).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- pids.json ------------------------------------------------------------
    def _read_pids(self) -> dict[int, dict[str, int]]:
        try:
            raw = json.loads(self.pids_path.read_text())
        except (OSError, ValueError):
            return {}
        return {int(k): v for k, v in raw.items() if isinstance(v, dict)}

    def _write_pids(self, pids: dict[int, dict[str, int]]) -> None:
        tmp = self.pids_path.with_name(self.pids_path.name + ".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in sorted(pids.items())}, indent=1))
        os.replace(tmp, self.pids_path)

    def pid(self, node_id: int) -> int | None:
        """The pid of ``node_id`` if it is running, else None."""
        rec = self._read_pids().get(node_id)
        if rec is None:
            return None
        child = self._children.get(node_id)
        if child is not None and child.pid == rec["pid"]:
            return rec["pid"] if child.poll() is None else None
        return rec["pid"] if process_alive(rec["pid"], rec.get("start")) else None

    def running(self, node_id: int) -> bool:
        return self.pid(node_id) is not None

    # -- processes ----------------------------------------------------------
    def start(
        self,
        node_id: int,
        *,
        cluster_file: str | os.PathLike[str] | None = None,
        secret: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Start member ``node_id`` as its own process (output to its log file).
        ``cluster_file``/``secret`` override this cluster's (for tests)."""
        if self.running(node_id):
            raise ConfigError(f"node {node_id} is already running (pid {self.pid(node_id)})")
        self.member(node_id)  # must exist in our file
        argv = [
            sys.executable,
            "-m",
            "dledger_app.cli",
            "node",
            "--cluster",
            str(cluster_file or self.cluster_path),
            "--id",
            str(node_id),
            *extra_args,
        ]
        if secret is not None:
            argv += ["--secret", secret]
        self.dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path(node_id), "ab") as log:
            log.write(
                f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting node {node_id}\n".encode()
            )
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self._children[node_id] = proc
        pids = self._read_pids()
        pids[node_id] = {"pid": proc.pid, "start": process_start_time(proc.pid) or 0}
        self._write_pids(pids)
        return proc

    def start_all(self, ids: Iterable[int] | None = None) -> None:
        for nid in ids if ids is not None else self.ids():
            if not self.running(nid):
                self.start(nid)

    def send_signal(self, node_id: int, sig: signal.Signals) -> bool:
        """Send ``sig`` to ``node_id`` if it runs; returns whether it was sent."""
        pid = self.pid(node_id)
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait_exit(self, node_id: int, timeout_s: float) -> int | None:
        """Wait until ``node_id`` exits; returns its exit code when it is our
        child (negative: killed by that signal), else None. Raises
        TimeoutError if it is still running after ``timeout_s``."""
        child = self._children.get(node_id)
        rec = self._read_pids().get(node_id)
        if child is not None and (rec is None or child.pid == rec["pid"]):
            try:
                return child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"node {node_id} still running after {timeout_s}s") from None
        deadline = time.monotonic() + timeout_s
        while self.running(node_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} still running after {timeout_s}s")
            time.sleep(0.05)
        return None

    def kill(
        self, node_id: int, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 10
    ) -> bool:
        """Signal ``node_id`` and, for a terminating signal, wait for it to exit."""
        sent = self.send_signal(node_id, sig)
        if sent and sig not in (signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP):
            self.wait_exit(node_id, timeout_s)
        return sent

    def stop(self, node_id: int, timeout_s: float = 10) -> str:
        """SIGTERM, then SIGKILL after ``timeout_s``. Returns what it took."""
        if not self.send_signal(node_id, signal.SIGTERM):
            self._reap(node_id)
            return "not running"
        self.send_signal(node_id, signal.SIGCONT)  # a stopped process cannot exit
        try:
            self.wait_exit(node_id, timeout_s)
            return "stopped"
        except TimeoutError:
            self.kill(node_id, signal.SIGKILL, timeout_s)
            return "killed"

    def down(self, timeout_s: float = 10) -> dict[int, str]:
        """Stop every node (SIGTERM all at once, SIGKILL the stragglers)."""
        ids = sorted(set(self.ids()) | set(self._read_pids()) | set(self._children))
        out: dict[int, str] = {}
        for nid in ids:
            if self.send_signal(nid, signal.SIGTERM):
                self.send_signal(nid, signal.SIGCONT)
                out[nid] = "stopped"
            else:
                out[nid] = "not running"
        deadline = time.monotonic() + timeout_s
        for nid in ids:
            if out[nid] == "not running":
                self._reap(nid)
                continue
            try:
                self.wait_exit(nid, max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                self.kill(nid, signal.SIGKILL, timeout_s)
                out[nid] = "killed"
        with contextlib.suppress(OSError):
            self.pids_path.unlink()
        return out

    def restart(self, node_id: int, timeout_s: float = 10) -> subprocess.Popen[bytes]:
        self.stop(node_id, timeout_s)
        return self.start(node_id)

    def _reap(self, node_id: int) -> None:
        child = self._children.get(node_id)
        if child is not None and child.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.1)

    # -- HTTP -----------------------------------------------------------------
    def admin_headers(self) -> dict[str, str]:
        """An admin bearer token from the cluster file, when it has auth on:
        this is the operator's tool and reads the same file as the nodes."""
        auth = self.spec.auth
        token = auth.token_with("admin") if auth is not None else None
        return {"Authorization": f"Bearer {token}"} if token else {}

    def status(self, node_id: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """``/raft/status`` of ``node_id``, None if it does not answer."""
        try:
            r = http_request(
                self.http(node_id),
                "GET",
                "/raft/status",
                timeout_s=timeout_s,
                headers=self.admin_headers(),
            )
        except HTTP_ERRORS:
            return None
        if r.status != 200:
            return None
        st: dict[str, Any] = r.json()
        return st

    def leader(self, among: Iterable[int] | None = None) -> int | None:
        """A node that says it leads and has committed in its term (the
        highest such term if two answer during a change), else None."""
        best: tuple[int, int] | None = None
        for nid in among if among is not None else self.ids():
            st = self.status(nid, timeout_s=0.5)
            if st is None or st.get("role") != "leader" or not st.get("leader_ready"):
                continue
            if best is None or st["term"] > best[0]:
                best = (st["term"], nid)
        return best[1] if best else None

    def wait_leader(
        self, timeout_s: float = 30, among: Iterable[int] | None = None, poll_s: float = 0.1
    ) -> int:
        ids = list(among) if among is not None else self.ids()
        deadline = time.monotonic() + timeout_s
        while True:
            lead = self.leader(ids)
            if lead is not None:
                return lead
            if time.monotonic() > deadline:
                raise TimeoutError(f"no leader among nodes {ids} within {timeout_s}s")
            time.sleep(poll_s)

    def wait_http(self, node_id: int, timeout_s: float = 30) -> None:
        """Wait until ``node_id`` answers ``/healthz`` (it started serving)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(*HTTP_ERRORS):
                r = http_request(
                    self.http(node_id),
                    "GET",
                    "/healthz",
                    timeout_s=0.5,
                    headers=self.admin_headers(),
                )
                if r.status == 200:
                    return
            if not self.running(node_id):
                raise RuntimeError(
                    f"node {node_id} exited during start-up; its log ends with:\n"
                    + self.log_tail(node_id)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} did not serve HTTP within {timeout_s}s")
            time.sleep(0.05)
