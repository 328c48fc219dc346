"""One PySyncObj node for the peer baseline benchmark (run as its own OS process).

Usage::

    python -m benchmarks._pysyncobj_node --self 127.0.0.1:P \\
        --partners 127.0.0.1:Q,127.0.0.1:R --control-port C

The process hosts a :class:`ReplicatedList` (a ``SyncObj`` whose only replicated
command appends one value to a list) and a small control server on
``127.0.0.1:C`` that the benchmark driver (``benchmarks.peer_pysyncobj``) talks
to.  The control protocol is line based: the client sends one command per line
(words separated by spaces) and gets exactly one JSON object per line back.  No
pickle crosses the control connection.

Commands:

``status``
    Raft view of this node: is_leader, leader, commit_index, last_applied,
    raft_term, has_quorum, plus process CPU seconds and the SyncObj config.
``bench_pipelined N SIZE WINDOW [TIMEOUT_S]``
    Leader only.  Submits N appends of SIZE-byte payloads through the async
    API (``append(value, callback=...)``), keeping at most WINDOW commands
    outstanding; a callback frees a slot.  Reports elapsed seconds, ops/s and
    per-op commit latency (callback time - submit time) in ms.
``bench_sync N SIZE [TIMEOUT_S]``
    Leader only.  N appends one at a time with ``sync=True`` (PySyncObj blocks
    on an event set by the commit callback).  Same report.
``shutdown``
    Destroys the SyncObj and exits the process.

Configuration: PySyncObj defaults, i.e. ``appendEntriesUseBatch=True`` which is
the mode PySyncObj documents as the one for throughput ("improve overall
performance (requests per second)"), an in-memory journal (``journalFile=None``)
and no full-dump file.  PySyncObj never fsyncs, even with a journal file, so
nothing here touches the disk.  ``--no-batch`` switches to
``appendEntriesUseBatch=False`` (PySyncObj's documented low-latency mode) for
comparison runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socketserver
import string
import sys
import threading
import time
from collections import Counter
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjException, replicated
from pysyncobj.version import VERSION as PYSYNCOBJ_VERSION

from benchmarks.stats import summarize

# Names for PySyncObj's integer failure codes, for readable error counts.
_FAIL_NAMES: dict[int, str] = {
    value: name
    for name, value in vars(FAIL_REASON).items()
    if not name.startswith("_") and isinstance(value, int)
}

# The SyncObjConf fields reported next to every figure.
_REPORTED_CONF_FIELDS: tuple[str, ...] = (
    "appendEntriesUseBatch",
    "appendEntriesBatchSizeBytes",
    "appendEntriesPeriod",
    "autoTick",
    "autoTickPeriod",
    "raftMinTimeout",
    "raftMaxTimeout",
    "connectionTimeout",
    "leaderFallbackTimeout",
    "commandsQueueSize",
    "commandsWaitLeader",
    "journalFile",
    "fullDumpFile",
    "logCompactionMinEntries",
    "logCompactionMinTime",
    "sendBufferSize",
    "recvBufferSize",
    "pollerType",
    "dynamicMembershipChange",
    "password",
)


def make_conf(
    use_batch: bool, overrides: dict[str, Any] | None = None, self_addr: str = ""
) -> SyncObjConf:
    """Build the SyncObjConf used for the benchmark.

    Everything is PySyncObj's default except what is passed explicitly here;
    ``appendEntriesUseBatch`` is True by default already (the throughput mode).
    ``overrides`` (from ``--conf KEY=VALUE``) are for experiments only and are
    reported with the figures; unknown keys are rejected.  In string values
    ``{port}`` becomes this node's Raft port, so per-node files can be named
    (e.g. ``fullDumpFile=/tmp/dir/{port}.dump``).
    """
    kwargs: dict[str, Any] = {"appendEntriesUseBatch": use_batch}
    defaults = SyncObjConf()
    port = self_addr.rpartition(":")[2]
    for key, value in (overrides or {}).items():
        if not hasattr(defaults, key):
            raise ValueError(f"unknown SyncObjConf option: {key}")
        kwargs[key] = value.replace("{port}", port) if isinstance(value, str) else value
    conf = SyncObjConf(**kwargs)
    conf.validate()
    return conf


def parse_conf_overrides(items: list[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings; VALUE is JSON (``true``, ``0.5``, ``"x"``) or a bare string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def conf_to_dict(conf: SyncObjConf) -> dict[str, Any]:
    """The reported subset of a SyncObjConf as a JSON-serialisable dict."""
    out: dict[str, Any] = {}
    for field in _REPORTED_CONF_FIELDS:
        value = getattr(conf, field, None)
        if field == "password":
            value = value is not None  # only whether encryption is on
        out[field] = value
    out["fsync"] = False  # PySyncObj never fsyncs its log (file journal: mmap, msync at shutdown)
    out["journal"] = (
        "memory" if conf.journalFile is None else "mmap file (no fsync; msync only at shutdown)"
    )
    return out


class ReplicatedList(SyncObj):  # type: ignore[misc]
    """A replicated append-only list: the smallest useful commit-log state machine."""

    def __init__(self, self_addr: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(self_addr, partners, conf)
        # Attributes set after SyncObj.__init__ are the replicated state
        # (SyncObj snapshots the attribute names it owns during __init__).
        self._items: list[str] = []
        self._bytes = 0

    @replicated  # type: ignore[untyped-decorator,unused-ignore]
    def append(self, value: str) -> int:
        self._items.append(value)
        self._bytes += len(value)
        return len(self._items)

    def size(self) -> int:
        return len(self._items)


def _fail_name(code: Any) -> str:
    if isinstance(code, int):
        return _FAIL_NAMES.get(code, f"code_{code}")
    return str(code)


def make_payload(size: int) -> str:
    """An ASCII payload of exactly ``size`` bytes (UTF-8) with varied content.

    A ``str`` rather than ``bytes``: PySyncObj pickles commands with protocol 2,
    under which Python 3 ``bytes`` become a ``codecs.encode`` reduce call, a
    needless extra cost on every node.  PySyncObj's own benchmark sends
    ``str`` payloads as well.
    """
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[(i * 7 + 3) % len(alphabet)] for i in range(size))


class Node:
    """Owns the SyncObj and implements the control commands."""

    def __init__(
        self,
        self_addr: str,
        partners: list[str],
        use_batch: bool,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.self_addr = self_addr
        self.overrides = dict(overrides or {})
        self.conf = make_conf(use_batch, self.overrides, self_addr)
        self.obj = ReplicatedList(self_addr, partners, self.conf)
        self.bench_lock = threading.Lock()
        self.started = time.monotonic()

    # -- status -------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        obj = self.obj
        leader = obj._getLeader()
        return {
            "ok": True,
            "self": self.self_addr,
            "pid": os.getpid(),
            "is_leader": bool(obj._isLeader()),
            "leader": None if leader is None else str(leader),
            "commit_index": obj.raftCommitIndex,
            "last_applied": obj.raftLastApplied,
            "raft_term": obj.raftCurrentTerm,
            "has_quorum": bool(obj.hasQuorum),
            "ready": bool(obj.isReady()),
            "items": obj.size(),
            "cpu_s": time.process_time(),
            "uptime_s": time.monotonic() - self.started,
            "version": PYSYNCOBJ_VERSION,
            "config": conf_to_dict(self.conf),
            "conf_overrides": self.overrides,
        }

    def _not_leader(self) -> dict[str, Any] | None:
        if self.obj._isLeader():
            return None
        leader = self.obj._getLeader()
        return {
            "ok": False,
            "error": "not_leader",
            "leader": None if leader is None else str(leader),
        }

    def _raft_snapshot(self) -> dict[str, Any]:
        return {
            "commit_index": self.obj.raftCommitIndex,
            "raft_term": self.obj.raftCurrentTerm,
            "is_leader": bool(self.obj._isLeader()),
        }

    # -- pipelined ------------------------------------------------------------
    def bench_pipelined(self, n: int, size: int, window: int, timeout_s: float) -> dict[str, Any]:
        if n <= 0 or size < 0 or window <= 0:
            return {"ok": False, "error": "bad_arguments"}
        if window > self.conf.commandsQueueSize > 0:
            return {"ok": False, "error": "window_exceeds_commandsQueueSize"}
        refusal = self._not_leader()
        if refusal is not None:
            return refusal
        payload = make_payload(size)
        submit_t = [0.0] * n
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        slots = threading.Semaphore(window)
        state_lock = threading.Lock()
        done = threading.Event()
        finished = [0]
        last_done_t = [0.0]
        append = self.obj.append

        def make_callback(i: int) -> Any:
            def on_commit(_result: Any, err: Any) -> None:
                now = time.perf_counter()
                with state_lock:
                    if err == FAIL_REASON.SUCCESS:
                        latencies.append(now - submit_t[i])
                    else:
                        errors[_fail_name(err)] += 1
                    finished[0] += 1
                    last_done_t[0] = now
                    if finished[0] == n:
                        done.set()
                slots.release()

            return on_commit

        before = self._raft_snapshot()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        submitted = 0
        for i in range(n):
            if not slots.acquire(timeout=max(0.0, deadline - time.perf_counter())):
                break
            submit_t[i] = time.perf_counter()
            append(payload, callback=make_callback(i))
            submitted += 1
        timed_out = not done.wait(max(0.0, deadline - time.perf_counter()))
        t_end = time.perf_counter() if timed_out else last_done_t[0]
        cpu1 = time.process_time()
        with state_lock:
            lat_ms = [x * 1000.0 for x in latencies]
            errs = dict(errors)
            completed = finished[0]
        elapsed = t_end - t0
        succeeded = len(lat_ms)
        return {
            "ok": not timed_out and not errs,
            "mode": "pipelined",
            "n": n,
            "size": size,
            "window": window,
            "submitted": submitted,
            "completed": completed,
            "succeeded": succeeded,
            "errors": errs,
            "timed_out": timed_out,
            "elapsed_s": elapsed,
            "ops_per_s": succeeded / elapsed if elapsed > 0 else 0.0,
            "latency_ms": summarize(lat_ms),
            "cpu_s": cpu1 - cpu0,
            "cpu_util": (cpu1 - cpu0) / elapsed if elapsed > 0 else 0.0,
            "raft_before": before,
            "raft_after": self._raft_snapshot(),
        }

    # -- one at a time --------------------------------------------------------
    def bench_sync(self, n: int, size: int, timeout_s: float) -> dict[str, Any]:
        if n <= 0 or size < 0:
            return {"ok": False, "error": "bad_arguments"}
        refusal = self._not_leader()
        if refusal is not None:
            return refusal
        payload = make_payload(size)
        lat_ms: list[float] = []
        errors: Counter[str] = Counter()
        append = self.obj.append
        before = self._raft_snapshot()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        timed_out = False
        attempted = 0
        for _ in range(n):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                timed_out = True
                break
            attempted += 1
            ts = time.perf_counter()
            try:
                append(payload, sync=True, timeout=remaining)
            except SyncObjException as exc:
                code = exc.errorCode
                errors["timeout" if code == "Timeout" else _fail_name(code)] += 1
                if code == "Timeout":
                    timed_out = True
                    break
                continue
            lat_ms.append((time.perf_counter() - ts) * 1000.0)
        t_end = time.perf_counter()
        cpu1 = time.process_time()
        elapsed = t_end - t0
        errs = dict(errors)
        return {
            "ok": not timed_out and not errs,
            "mode": "sync",
            "n": n,
            "size": size,
            "window": 1,
            "submitted": attempted,
            "completed": attempted,
            "succeeded": len(lat_ms),
            "errors": errs,
            "timed_out": timed_out,
            "elapsed_s": elapsed,
            "ops_per_s": len(lat_ms) / elapsed if elapsed > 0 else 0.0,
            "latency_ms": summarize(lat_ms),
            "cpu_s": cpu1 - cpu0,
            "cpu_util": (cpu1 - cpu0) / elapsed if elapsed > 0 else 0.0,
            "raft_before": before,
            "raft_after": self._raft_snapshot(),
        }

    # -- dispatch -------------------------------------------------------------
    def handle(self, line: str) -> dict[str, Any]:
        words = line.split()
        if not words:
            return {"ok": False, "error": "empty_command"}
        cmd, args = words[0], words[1:]
        try:
            if cmd == "status":
                return self.status()
            if cmd == "bench_pipelined" and len(args) in (3, 4):
                n, size, window = int(args[0]), int(args[1]), int(args[2])
                timeout_s = float(args[3]) if len(args) == 4 else _default_timeout(n)
                with self.bench_lock:
                    return self.bench_pipelined(n, size, window, timeout_s)
            if cmd == "bench_sync" and len(args) in (2, 3):
                n, size = int(args[0]), int(args[1])
                timeout_s = float(args[2]) if len(args) == 3 else _default_timeout(n)
                with self.bench_lock:
                    return self.bench_sync(n, size, timeout_s)
        except ValueError as exc:
            return {"ok": False, "error": f"bad_arguments: {exc}"}
        return {"ok": False, "error": f"unknown_command: {line.strip()[:80]}"}


def _default_timeout(n: int) -> float:
    return 60.0 + 0.01 * n


class _ControlServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    node: Node


class _ControlHandler(socketserver.StreamRequestHandler):
    server: _ControlServer

    def handle(self) -> None:
        for raw in self.rfile:
            line = raw.decode("utf-8", "replace").strip()
            if line == "shutdown":
                self._reply({"ok": True, "shutting_down": True})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
                return
            try:
                reply = self.server.node.handle(line)
            except Exception as exc:  # report, never kill the control server
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self._reply(reply)

    def _reply(self, obj: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(obj).encode("utf-8") + b"\n")
        self.wfile.flush()


def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver that started us goes away (no orphaned nodes)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--self", dest="self_addr", required=True, help="host:port of this node")
    ap.add_argument("--partners", default="", help="comma-separated host:port of the other nodes")
    ap.add_argument("--control-port", type=int, required=True, help="control server port")
    ap.add_argument(
        "--no-batch",
        action="store_true",
        help="appendEntriesUseBatch=False (PySyncObj's low-latency mode)",
    )
    ap.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one SyncObjConf option (experiments only; VALUE parsed as JSON)",
    )
    ap.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="exit when this process is no longer our parent (0: do not watch)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    partners = [p for p in args.partners.split(",") if p]
    node = Node(
        args.self_addr,
        partners,
        use_batch=not args.no_batch,
        overrides=parse_conf_overrides(args.conf),
    )
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    server = _ControlServer(("127.0.0.1", args.control_port), _ControlHandler)
    server.node = node
    print(
        f"pysyncobj node {args.self_addr} (pid {os.getpid()}) control on 127.0.0.1:{args.control_port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        # The main thread must stay alive: PySyncObj's tick thread stops when it exits.
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        node.obj.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
