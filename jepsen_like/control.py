"""Cluster control: the cluster file, node processes by PID, and their status.

Theory of operation
-------------------
The harness writes the cluster file itself (TOML, the format documented in
``dledger/config.py``) and starts every member as
``python -m dledger_app.cli node --cluster FILE --id ID``, inside the member's
network namespace (``ip netns exec``, which execs, so the PID we hold is
the node's) or on 127.0.0.1 when namespaces are unavailable. It never
imports server code: it talks HTTP (``/v1/cluster``, ``/readyz``) and sends
signals, always to a PID it started and still tracks.

Every PID is also written to ``STATE_DIR/pids.json`` with the process start
time, so a later run can kill, by PID, what a crashed run left behind
(:func:`kill_stale`), without ever matching processes by name.

A node may be started with extra environment (libfaketime for the clock
nemesis, fault switches for planted-bug tests).

With ``lazyfs=True`` every member's data directory is a mount of
:mod:`jepsen_like.lazyfs` (one daemon per member, started by
:meth:`Cluster.mount_all` before any node and stopped after every node by
:meth:`Cluster.stop_all`), over a backing directory ``node-<ID>.disk``: the
power-loss and disk-error nemeses drive it through its control socket.
Daemons are recorded in the PID file like nodes, and
:func:`unmount_stale` lazily unmounts what a crashed run left mounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import lmdb

from jepsen_like import net

STATE_DIR = Path(os.environ.get("JEPSEN_LIKE_STATE", "/tmp/jepsen_like-state"))
PIDS_FILE = STATE_DIR / "pids.json"

FAKETIME_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def find_libfaketime() -> str | None:
    for p in FAKETIME_CANDIDATES:
        if os.path.exists(p):
            return p
    return None


def _proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[-1].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return None


def _load_pids() -> dict[str, dict[str, int]]:
    try:
        data = json.loads(PIDS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_pids(pids: dict[str, dict[str, int]]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = PIDS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids))
    tmp.replace(PIDS_FILE)


LOCK_FD_ENV = "JEPSEN_LIKE_LOCK_FD"


class RunLock:
    """One harness run per machine: namespaces, the bridge and the PID file
    are machine-wide, and a run's start-up cleanup would destroy a live
    run's cluster. ``acquire`` waits for a running one to finish (the lock
    dies with its process, so a crashed run never blocks the next)."""

    def __init__(self) -> None:
        self._fh: Any = None
        self._inherited = False

    def acquire(self, wait_s: float, log: Any) -> bool:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        inherited = os.environ.get(LOCK_FD_ENV)
        if inherited and inherited.isdigit():
            # A parent (a test) took the lock before starting its clock and
            # passed its descriptor: flock on the same open file succeeds.
            with contextlib.suppress(OSError):
                fh = os.fdopen(os.dup(int(inherited)), "a+")
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    fh.close()
                else:
                    self._fh, self._inherited = fh, True
                    return True
        self._fh = open(STATE_DIR / "lock", "a+")  # noqa: SIM115 - held for the run
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                if not said:
                    self._fh.seek(0)
                    holder = self._fh.read().strip() or "?"
                    log(f"another jepsen_like run (pid {holder}) holds the machine: waiting")
                    said = True
                time.sleep(1.0)
                continue
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.write(str(os.getpid()))
            self._fh.flush()
            return True

    def fileno(self) -> int:
        assert self._fh is not None, "not acquired"
        return int(self._fh.fileno())

    def release(self) -> None:
        if self._fh is not None:
            if not self._inherited:  # the parent's lock stays the parent's
                with contextlib.suppress(OSError):
                    fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def kill_stale() -> list[int]:
    """SIGKILL (by PID) every node a previous run recorded that still runs."""
    killed = []
    for key, rec in _load_pids().items():
        pid, start = int(rec.get("pid", 0)), rec.get("start")
        if pid > 0 and start is not None and _proc_start(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        del key
    _save_pids({})
    return killed


def unmount_stale() -> list[str]:
    """Lazily unmount every lazyfs mount left by a crashed run (recognised by
    its filesystem name, never by a path pattern); returns the mount points."""
    from jepsen_like.lazyfs import FSNAME

    out: list[str] = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == FSNAME:
            point = parts[1].replace("\\040", " ")
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
            out.append(point)
    return out


def lazyfs_call(sock: Path, timeout_s: float = 10.0, **req: Any) -> dict[str, Any]:
    """One request to a lazyfs daemon's control socket (JSON lines)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(sock))
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf or b"{}")
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise RuntimeError(f"lazyfs {sock.name}: {req} failed: {reply}")
    return reply


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Member:
    id: int
    role: str
    raft: str
    http: str
    ns: str | None
    data_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    paused: bool = False
    expected_exit: bool = False
    fs_proc: subprocess.Popen[bytes] | None = None
    exits: list[dict[str, Any]] = field(default_factory=list)


def _toml_str(s: str) -> str:
    return json.dumps(s)


def _toml_scalar(v: int | str | bool) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return _toml_str(v) if isinstance(v, str) else str(v)


_WAL_HEAD = struct.Struct("<IIQI")  # magic, body length, seq, crc32
_WAL_MAGIC = 0xD1EDA1CE


def wal_key(data_dir: Path) -> int:
    """The key a stopped node's write-ahead log record CRCs start from (kept
    in its LMDB meta database, sealed with a CRC32; 0 when there is none,
    as in stores logged before keys existed). Read with the lmdb package,
    not the server's code."""
    if not (data_dir / "data.mdb").exists():
        return 0
    env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=16, subdir=True)
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(b"wal_key", db=meta)
    except lmdb.NotFoundError:
        return 0
    finally:
        env.close()
    if raw is None or len(raw) != 12:
        return 0
    return int.from_bytes(raw[:8], "big")


def wal_records(data: bytes, key: int = 0) -> list[tuple[int, int, int]]:
    """(seq, start, end) of the whole records at the start of a node's
    write-ahead log (the framing of dledger/storage/wal.py: magic, length,
    sequence number, CRC32 from the store's ``key`` of the first 16 bytes
    and the body, the body, zero padding to 8 bytes), up to the first that
    is not whole and CRC-valid; ``end`` excludes the padding. Parsed here
    rather than imported: the harness does not import server code."""
    out: list[tuple[int, int, int]] = []
    off = 0
    while off + _WAL_HEAD.size <= len(data):
        magic, length, seq, crc = _WAL_HEAD.unpack_from(data, off)
        end = off + _WAL_HEAD.size + length
        if magic != _WAL_MAGIC or end > len(data):
            break
        head_crc = zlib.crc32(data[off : off + 16], key)
        if zlib.crc32(data[off + _WAL_HEAD.size : end], head_crc) != crc:
            break
        out.append((seq, off, end))
        off = end + (-(end - off) % 8)
    return out


class Cluster:
    """The node processes of one run."""

    def __init__(
        self,
        root: Path,
        *,
        voters: int,
        learners: int = 0,
        netns: bool,
        node_settings: dict[str, int | str | bool] | None = None,
        node_env: dict[str, str] | None = None,
        lazyfs: bool = False,
        first_id: int = 1,
        cluster_id: str = "jepsen",
        group: tuple[str, str, list[str]] | None = None,
    ) -> None:
        """``first_id``: the members' ids are ``first_id``, ``first_id + 1``, ...
        (several clusters of one run share the namespaces, the bridge and the
        PID file, so their ids must not overlap). ``group``: (name, role,
        controller HTTP addresses) of a multi-group run: a ``group.toml``
        goes next to the cluster file, and the nodes join that group."""
        self.root = root
        self.cluster_id = cluster_id
        self.group = group
        self.netns = netns
        self.lazyfs = lazyfs
        self.members: dict[int, Member] = {}
        self.node_env = dict(node_env or {})
        self.node_settings = dict(node_settings or {})
        for i in range(first_id, first_id + voters + learners):
            role = "voter" if i < first_id + voters else "learner"
            if netns:
                ip = net.node_ip(i)
                raft, http = f"{ip}:7000", f"{ip}:8000"
            else:
                raft, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            self.members[i] = Member(
                i,
                role,
                raft,
                http,
                net.ns_name(i) if netns else None,
                root / f"node-{i}",
                root / f"node-{i}.log",
            )
        self.cluster_file = root / "cluster.toml"
        self._session: aiohttp.ClientSession | None = None

    # -- files -------------------------------------------------------------
    def write_cluster_file(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lines = [
            "[cluster]",
            f"id = {_toml_str(self.cluster_id)}",
            f"secret = {_toml_str(os.urandom(16).hex())}",
            "",
        ]
        if self.node_settings:
            lines.append("[node]")
            for k, v in sorted(self.node_settings.items()):
                lines.append(f"{k} = {_toml_scalar(v)}")
            lines.append("")
        for m in self.members.values():
            lines += [
                "[[members]]",
                f"id = {m.id}",
                f"raft = {_toml_str(m.raft)}",
                f"http = {_toml_str(m.http)}",
                f'role = "{m.role}"',
                f"data_dir = {_toml_str(str(m.data_dir))}",
                "",
            ]
        self.cluster_file.write_text("\n".join(lines))
        if self.group is not None:
            name, role, controller = self.group
            addrs = ", ".join(_toml_str(a) for a in controller)
            (self.root / "group.toml").write_text(
                f"[group]\nname = {_toml_str(name)}\nrole = {_toml_str(role)}\n"
                f"controller = [{addrs}]\n"
            )

    @property
    def ids(self) -> list[int]:
        return sorted(self.members)

    @property
    def voters(self) -> list[int]:
        return [i for i in self.ids if self.members[i].role == "voter"]

    # -- processes -----------------------------------------------------------
    def start(self, node_id: int, extra_env: dict[str, str] | None = None) -> None:
        m = self.members[node_id]
        if m.proc is not None and m.proc.poll() is None:
            return
        argv = [
            sys.executable,
            "-m",
            "dledger_app.cli",
            "node",
            "--cluster",
            str(self.cluster_file),
            "--id",
            str(node_id),
        ]
        if m.ns is not None:
            argv = ["ip", "netns", "exec", m.ns, *argv]
        m.env = dict(extra_env or {})
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.node_env, **m.env)
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = repo + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(m.log, "ab") as log:
            log.write(
                f"--- {time.strftime('%H:%M:%S')} jepsen_like starts node {node_id}"
                f" env={sorted(m.env)}\n".encode()
            )
            log.flush()
            m.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=repo,
            )
        m.paused = False
        m.expected_exit = False
        pids = _load_pids()
        pids[str(node_id)] = {"pid": m.proc.pid, "start": _proc_start(m.proc.pid) or 0}
        _save_pids(pids)

    def start_all(self) -> None:
        if self.lazyfs:
            self.mount_all()
        for i in self.ids:
            self.start(i)

    # -- lazyfs (power loss, disk errors) ------------------------------------
    def fs_socket(self, node_id: int) -> Path:
        return self.root / f"lazyfs-{node_id}.sock"

    def mount_all(self, timeout_s: float = 20.0) -> None:
        """Start one lazyfs daemon per member (if not running) and wait until
        every data directory is mounted and answers on its control socket."""
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = repo + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for m in self.members.values():
            if m.fs_proc is not None and m.fs_proc.poll() is None:
                continue
            backing = self.root / f"node-{m.id}.disk"
            m.data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.root / f"lazyfs-{m.id}.log", "ab") as log:
                m.fs_proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "jepsen_like.lazyfs",
                        "--backing",
                        str(backing),
                        "--mount",
                        str(m.data_dir),
                        "--control",
                        str(self.fs_socket(m.id)),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                    cwd=repo,
                )
            pids = _load_pids()
            pids[f"fs-{m.id}"] = {"pid": m.fs_proc.pid, "start": _proc_start(m.fs_proc.pid) or 0}
            _save_pids(pids)
        deadline = time.monotonic() + timeout_s
        for m in self.members.values():
            while True:
                ok = False
                if os.path.ismount(m.data_dir):
                    with contextlib.suppress(OSError, RuntimeError, ValueError):
                        lazyfs_call(self.fs_socket(m.id), timeout_s=2, cmd="ping")
                        ok = True
                if ok:
                    break
                assert m.fs_proc is not None
                if m.fs_proc.poll() is not None or time.monotonic() > deadline:
                    log_text = (self.root / f"lazyfs-{m.id}.log").read_text(errors="replace")
                    raise RuntimeError(f"lazyfs for node {m.id} did not mount: {log_text[-800:]}")
                time.sleep(0.1)

    def unmount_all(self, timeout_s: float = 10.0) -> None:
        for m in self.members.values():
            p = m.fs_proc
            if p is None:
                continue
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=timeout_s)
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if os.path.ismount(m.data_dir):
                subprocess.run(["umount", "-l", str(m.data_dir)], capture_output=True, check=False)
            m.fs_proc = None

    def fs(self, node_id: int, **req: Any) -> dict[str, Any]:
        """A lazyfs command for ``node_id``'s data directory (see jepsen_like.lazyfs)."""
        assert self.lazyfs, "the data directories are not on lazyfs"
        return lazyfs_call(self.fs_socket(node_id), **req)

    def power_loss(self, node_id: int, *, tear: bool, seed: int) -> dict[str, Any]:
        """Drop what ``node_id`` never fsynced (kill it first: a power loss
        takes the process with it)."""
        assert not self.alive(node_id), "power loss of a running node: kill it first"
        out = self.fs(node_id, cmd="drop", tear=tear, seed=seed)
        out.pop("ok", None)
        return out

    def alive(self, node_id: int) -> bool:
        p = self.members[node_id].proc
        return p is not None and p.poll() is None

    def signal(self, node_id: int, sig: signal.Signals) -> bool:
        m = self.members[node_id]
        if m.proc is None or m.proc.poll() is not None:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):
            m.expected_exit = True
        try:
            os.kill(m.proc.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGSTOP:
            m.paused = True
        elif sig == signal.SIGCONT:
            m.paused = False
        return True

    def kill(self, node_id: int) -> None:
        m = self.members[node_id]
        if m.proc is None:
            return
        self.signal(node_id, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            m.proc.wait(timeout=10)
        m.paused = False

    def stop_all(self, timeout_s: float = 5.0) -> None:
        for i in self.ids:
            m = self.members[i]
            if m.proc is not None and m.proc.poll() is None:
                self.signal(i, signal.SIGCONT)
                self.signal(i, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for i in self.ids:
            m = self.members[i]
            if m.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if m.proc.poll() is None:
                self.kill(i)
        if self.lazyfs:
            self.unmount_all()
        # Only this cluster's records: another cluster of the run may still run.
        mine = {str(i) for i in self.ids} | {f"fs-{i}" for i in self.ids}
        _save_pids({k: v for k, v in _load_pids().items() if k not in mine})

    def check_exits(self) -> list[dict[str, Any]]:
        """Nodes that exited without the harness killing them (recorded once)."""
        found = []
        for m in self.members.values():
            if m.proc is None or m.expected_exit:
                continue
            rc = m.proc.poll()
            if rc is not None:
                rec = {"node": m.id, "exit_code": rc, "log_tail": self.log_tail(m.id)}
                m.exits.append(rec)
                m.expected_exit = True  # reported; a restart clears it
                found.append(rec)
        return found

    def log_tail(self, node_id: int, lines: int = 12) -> str:
        try:
            text = self.members[node_id].log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wipe(self, node_id: int) -> None:
        d = self.members[node_id].data_dir
        if self.lazyfs and os.path.ismount(d):
            # The mount point stays; its contents go (through the filesystem).
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            return
        shutil.rmtree(d, ignore_errors=True)

    # -- corruption ------------------------------------------------------------
    def corrupt(self, node_id: int, rng: random.Random) -> dict[str, Any]:
        """Damage the stopped node's data: its LMDB data file (truncate its
        tail or flip bits near its end, where the most recent pages are), or,
        half the time when it holds two whole records or more, its
        write-ahead log (flip bits inside one record that another follows:
        rot the node must detect by CRC and refuse, see
        :mod:`dledger.storage.wal`). The log's last record is left alone: a
        damaged last record is indistinguishable from a torn write, which
        the node cuts off as never acknowledged."""
        m = self.members[node_id]
        assert not self.alive(node_id), "corrupt only a stopped node"
        wal_path = m.data_dir / "wal"
        try:
            spans = wal_records(wal_path.read_bytes(), wal_key(m.data_dir))
        except OSError:
            spans = []
        if len(spans) >= 2 and rng.random() < 0.5:
            seq, start, end = rng.choice(spans[:-1])
            flips = sorted({rng.randrange(start, end) for _ in range(rng.randint(1, 8))})
            with open(wal_path, "r+b") as fh:
                for pos in flips:
                    fh.seek(pos)
                    b = fh.read(1)
                    fh.seek(pos)
                    fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            return {
                "mode": "bitflip",
                "file": wal_path.name,
                "record": seq,
                "records": len(spans),
                "positions": flips,
            }
        path = m.data_dir / "data.mdb"
        try:
            size = path.stat().st_size
        except OSError:
            return {"mode": "none", "reason": "no data file"}
        if size < 8192:
            return {"mode": "none", "reason": f"data file has {size} bytes"}
        mode = rng.choice(["truncate", "bitflip"])
        if mode == "truncate":
            cut = rng.randint(1, max(1, min(size // 4, 1 << 20)))
            with open(path, "r+b") as fh:
                fh.truncate(size - cut)
            return {"mode": mode, "file": path.name, "bytes_cut": cut, "size": size}
        flips = []
        lo = max(0, size - (256 << 10))
        with open(path, "r+b") as fh:
            for _ in range(16):
                pos = rng.randrange(lo, size)
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                flips.append(pos)
        return {"mode": mode, "file": path.name, "positions": sorted(flips), "size": size}

    # -- HTTP ----------------------------------------------------------------------
    async def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.5),
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def status(self, node_id: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
        m = self.members[node_id]
        if not self.alive(node_id) or m.paused:
            return None
        s = await self.session()
        try:
            async with s.get(
                f"http://{m.http}/v1/cluster", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                if r.status != 200:
                    return None
                doc = await r.json()
                return doc if isinstance(doc, dict) else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def statuses(self) -> dict[int, dict[str, Any]]:
        docs = await asyncio.gather(*(self.status(i) for i in self.ids))
        return {i: d for i, d in zip(self.ids, docs, strict=True) if d is not None}

    async def leader(self) -> int | None:
        """The node that reports itself leader with the highest term."""
        best: tuple[int, int] | None = None
        for i, st in (await self.statuses()).items():
            if st.get("role") == "leader":
                t = int(st.get("term", 0))
                if best is None or t > best[0]:
                    best = (t, i)
        return best[1] if best else None

    async def wait_ready(self, node_ids: list[int] | None = None, timeout_s: float = 60) -> bool:
        """Every listed node answers /readyz 200 (a leader known, caught up)."""
        ids = node_ids or self.ids
        s = await self.session()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok = 0
            for i in ids:
                try:
                    async with s.get(f"http://{self.members[i].http}/readyz") as r:
                        ok += r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    pass
            if ok == len(ids):
                return True
            await asyncio.sleep(0.3)
        return False

    async def transfer_leadership(self, leader: int, to: int) -> bool:
        s = await self.session()
        try:
            async with s.post(
                f"http://{self.members[leader].http}/v1/cluster/transfer-leadership",
                json={"to": to},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def proc_state(self, node_id: int) -> str | None:
        p = self.members[node_id].proc
        return None if p is None else _proc_state(p.pid)
