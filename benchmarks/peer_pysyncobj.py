"""Peer baseline: PySyncObj measured on this machine, in the same run as our log.

``run_pysyncobj`` starts ``nodes`` PySyncObj processes on 127.0.0.1 (one OS
process per node, see ``benchmarks._pysyncobj_node``), waits for a leader, and
measures on the leader:

* ``pipelined``: ``ops`` appends through PySyncObj's async API with callbacks,
  at most ``window`` outstanding (its best mode for throughput);
* ``sync``: appends one at a time with ``sync=True``, same configuration;
* ``sync_low_latency``: the sync benchmark again on a second cluster with
  ``appendEntriesUseBatch=False``, PySyncObj's documented low-latency mode (in
  its default batch mode a lone request waits ~one ``appendEntriesPeriod``,
  0.1 s).

Each is repeated ``repeats`` times; the result reports median/min/max ops/s over
the repeats and the median over repeats of the per-run p50/p99 latencies.
PySyncObj keeps its log in memory and never fsyncs; its configuration is
recorded in the result under ``config``.

CLI::

    python -m benchmarks.peer_pysyncobj --nodes 3 --payload 100 --ops 20000 --repeats 3

Progress goes to stderr, the JSON result to stdout.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import peer_procs
from benchmarks.stats import median_min_max

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_MODULE = "benchmarks._pysyncobj_node"

# Caveats recorded with every result (see the module docstring).
_NOTES: tuple[str, ...] = (
    "PySyncObj never fsyncs; here the Raft log is in memory (journalFile=None).",
    "appendEntriesUseBatch=True sends appends every appendEntriesPeriod (0.1 s): "
    "pipelined throughput is ~window / latency, and a lone sync request takes ~100 ms.",
    "Log compaction re-pickles and gzips the whole state in the tick thread every "
    "logCompactionMinEntries (5000) entries, so with one cluster across repeats "
    "throughput falls as the list grows; see pipelined.runs (fresh_cluster avoids it).",
    "Latency = callback time - submit time on the leader, measured in the leader process.",
)

# Every node process we started and have not reaped yet; atexit cleans up.
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _stop_process(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """Stop one node by PID (:func:`benchmarks.peer_procs.stop`: SIGTERM,
    wait, then SIGKILL) and forget it."""
    try:
        peer_procs.stop(proc, grace_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _LIVE.pop(proc.pid, None)


def _stop_all_live() -> None:
    for proc in list(_LIVE.values()):
        _stop_process(proc, grace_s=1.0)


atexit.register(_stop_all_live)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together while picked)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ControlClient:
    """JSON-lines client for one node's control port."""

    def __init__(self, port: int, connect_timeout_s: float = 15.0) -> None:
        self.port = port
        deadline = time.monotonic() + connect_timeout_s
        last_exc: OSError | None = None
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                break
            except OSError as exc:
                last_exc = exc
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"control port 127.0.0.1:{port} did not accept connections "
                        f"within {connect_timeout_s:.0f}s: {last_exc}"
                    ) from exc
                time.sleep(0.05)
        self.rfile = self.sock.makefile("rb")

    def call(self, line: str, timeout_s: float = 10.0) -> dict[str, Any]:
        self.sock.settimeout(timeout_s)
        self.sock.sendall(line.encode("utf-8") + b"\n")
        raw = self.rfile.readline()
        if not raw:
            raise RuntimeError(f"node on control port {self.port} closed the connection")
        reply: dict[str, Any] = json.loads(raw)
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.rfile.close()
            self.sock.close()


class Cluster:
    """``nodes`` PySyncObj processes plus a control connection to each."""

    def __init__(
        self,
        nodes: int,
        use_batch: bool,
        log_dir: Path,
        conf_overrides: dict[str, Any] | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        ports = free_ports(2 * nodes)
        self.raft_addrs = [f"127.0.0.1:{p}" for p in ports[:nodes]]
        self.control_ports = ports[nodes:]
        self.log_paths = [log_dir / f"node{i}.stderr" for i in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.clients: dict[str, ControlClient] = {}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        env["PYTHONUNBUFFERED"] = "1"
        for i, addr in enumerate(self.raft_addrs):
            partners = ",".join(a for a in self.raft_addrs if a != addr)
            cmd = [
                sys.executable,
                "-m",
                NODE_MODULE,
                "--self",
                addr,
                "--partners",
                partners,
                "--control-port",
                str(self.control_ports[i]),
                "--parent-pid",
                str(os.getpid()),
            ]
            if not use_batch:
                cmd.append("--no-batch")
            for key, value in (conf_overrides or {}).items():
                if isinstance(value, str):  # "{tmp}": this cluster's scratch directory
                    value = value.replace("{tmp}", str(log_dir))
                cmd += ["--conf", f"{key}={json.dumps(value)}"]
            with open(self.log_paths[i], "wb") as err:
                proc = subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            self.procs.append(proc)
            _LIVE[proc.pid] = proc
        self.spawned_at = time.monotonic()

    def connect(self) -> None:
        for addr, port, proc, log in zip(
            self.raft_addrs, self.control_ports, self.procs, self.log_paths, strict=True
        ):
            try:
                self.clients[addr] = ControlClient(port)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; node {addr} {self._describe(proc, log)}") from exc

    @staticmethod
    def _describe(proc: subprocess.Popen[bytes], log: Path) -> str:
        state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
        try:
            tail = log.read_text(errors="replace")[-1500:]
        except OSError:
            tail = ""
        return f"({state}; stderr tail: {tail!r})"

    def statuses(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for addr, client in self.clients.items():
            try:
                out[addr] = client.call("status")
            except (OSError, RuntimeError, ValueError) as exc:
                out[addr] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return out

    def wait_for_leader(self, timeout_s: float) -> tuple[str, dict[str, dict[str, Any]]]:
        """Block until one node leads and every node agrees; return its address."""
        deadline = time.monotonic() + timeout_s
        statuses: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            for proc, addr, log in zip(self.procs, self.raft_addrs, self.log_paths, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"node {addr} died {self._describe(proc, log)}")
            statuses = self.statuses()
            leaders = [a for a, s in statuses.items() if s.get("ok") and s.get("is_leader")]
            if len(leaders) == 1:
                leader = leaders[0]
                ls = statuses[leader]
                agreed = all(s.get("ok") and s.get("leader") == leader for s in statuses.values())
                if agreed and ls.get("has_quorum") and ls.get("ready"):
                    return leader, statuses
            time.sleep(0.05)
        summary = {
            a: {k: s.get(k) for k in ("is_leader", "leader", "raft_term", "has_quorum", "error")}
            for a, s in statuses.items()
        }
        raise RuntimeError(
            f"no agreed PySyncObj leader among {len(self.raft_addrs)} nodes within "
            f"{timeout_s:.1f}s; last statuses: {json.dumps(summary)}"
        )

    def stop(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()
        for proc in self.procs:
            _stop_process(proc)


def _cpu_by_node(statuses: dict[str, dict[str, Any]]) -> dict[str, float]:
    return {a: float(s["cpu_s"]) for a, s in statuses.items() if s.get("ok")}


def _run_one(
    cluster: Cluster,
    leader: str,
    command: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Run one bench command on the leader; add per-node CPU utilisation."""
    before = _cpu_by_node(cluster.statuses())
    reply = cluster.clients[leader].call(command, timeout_s=timeout_s + 30.0)
    after = _cpu_by_node(cluster.statuses())
    elapsed = float(reply.get("elapsed_s") or 0.0)
    if elapsed > 0:
        util = {a: (after[a] - before[a]) / elapsed for a in after if a in before}
        reply["node_cpu_util"] = util
        followers = [u for a, u in util.items() if a != leader]
        reply["leader_cpu_util_total"] = util.get(leader, float("nan"))
        reply["followers_cpu_util_max"] = max(followers) if followers else 0.0
    return reply


def _measure(
    cluster: Cluster,
    leader: str,
    command: str,
    timeout_s: float,
    label: str,
    progress: Callable[[str], None],
    anomalies: list[dict[str, Any]],
    leader_timeout_s: float,
    attempts: int = 3,
) -> tuple[str, dict[str, Any]]:
    """Run ``command`` on the leader, retrying after leader changes or failures."""
    for attempt in range(1, attempts + 1):
        reply = _run_one(cluster, leader, command, timeout_s)
        if reply.get("ok"):
            return leader, reply
        note = {
            "label": label,
            "attempt": attempt,
            "leader": leader,
            "error": reply.get("error"),
            "errors": reply.get("errors"),
            "timed_out": reply.get("timed_out"),
            "succeeded": reply.get("succeeded"),
            "raft_before": reply.get("raft_before"),
            "raft_after": reply.get("raft_after"),
        }
        anomalies.append(note)
        progress(f"  {label}: attempt {attempt} failed ({json.dumps(note)}); re-electing/retrying")
        leader, _ = cluster.wait_for_leader(leader_timeout_s)
    raise RuntimeError(f"{label}: failed {attempts} times; see anomalies: {anomalies[-attempts:]}")


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "n",
        "window",
        "succeeded",
        "elapsed_s",
        "ops_per_s",
        "latency_ms",
        "cpu_util",
        "leader_cpu_util_total",
        "followers_cpu_util_max",
    )
    out = {k: run.get(k) for k in keys}
    out["term"] = (run.get("raft_after") or {}).get("raft_term")
    return out


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in runs]
    return {
        "ops_per_s": median_min_max(r["ops_per_s"] for r in runs),
        "latency_ms": {
            "p50": median_min_max(x["p50"] for x in lat)["median"],
            "p99": median_min_max(x["p99"] for x in lat)["median"],
            "min": min(x["min"] for x in lat),
            "max": max(x["max"] for x in lat),
            "mean": median_min_max(x["mean"] for x in lat)["median"],
        },
        "leader_cpu_util": median_min_max(r.get("leader_cpu_util_total", 0.0) for r in runs),
        "followers_cpu_util_max": median_min_max(
            r.get("followers_cpu_util_max", 0.0) for r in runs
        ),
        "runs": [_compact(r) for r in runs],
    }


@contextlib.contextmanager
def _cluster(
    nodes: int, use_batch: bool, conf_overrides: dict[str, Any] | None
) -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="pysyncobj-bench-") as tmp:
        cluster = Cluster(nodes, use_batch, Path(tmp), conf_overrides)
        try:
            cluster.connect()
            yield cluster
        finally:
            cluster.stop()


@dataclasses.dataclass
class _ModeResult:
    """What one measurement mode (one SyncObjConf) produced."""

    pipelined: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sync: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    elections_s: list[float] = dataclasses.field(default_factory=list)
    first_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    final: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _run_mode(
    *,
    label: str,
    nodes: int,
    payload_bytes: int,
    ops: int,
    window: int,
    repeats: int,
    sync_n: int,
    warm_n: int,
    do_pipelined: bool,
    use_batch: bool,
    conf_overrides: dict[str, Any] | None,
    fresh_cluster: bool,
    leader_timeout_s: float,
    progress: Callable[[str], None],
    anomalies: list[dict[str, Any]],
) -> _ModeResult:
    """Start cluster(s) with one configuration and run the repeats on the leader."""
    out = _ModeResult()
    pipe_timeout = 60.0 + 0.01 * ops
    sync_timeout = 60.0 + 1.0 * sync_n

    def start_cluster(stack: contextlib.ExitStack) -> tuple[Cluster, str]:
        progress(
            f"{label}: starting {nodes} node processes (appendEntriesUseBatch={use_batch}, "
            f"overrides={json.dumps(conf_overrides or {})})"
        )
        cluster = stack.enter_context(_cluster(nodes, use_batch, conf_overrides))
        leader, statuses = cluster.wait_for_leader(leader_timeout_s)
        out.elections_s.append(time.monotonic() - cluster.spawned_at)
        if not out.first_status:
            out.first_status.update(statuses[leader])
        progress(
            f"{label}: leader {leader} (term {statuses[leader]['raft_term']}) agreed by "
            f"all nodes {out.elections_s[-1]:.2f}s after spawn"
        )
        if warm_n > 0:
            leader, warm = _measure(
                cluster,
                leader,
                f"bench_pipelined {warm_n} {payload_bytes} {window} {pipe_timeout}",
                pipe_timeout,
                f"{label} warmup",
                progress,
                anomalies,
                leader_timeout_s,
            )
            progress(f"{label}: warm-up {warm_n} ops: {warm['ops_per_s']:.0f} ops/s")
        return cluster, leader

    with contextlib.ExitStack() as stack:
        cluster: Cluster | None = None
        leader = ""
        for r in range(1, repeats + 1):
            if cluster is None or fresh_cluster:
                stack.close()  # stops the previous cluster, if any
                cluster, leader = start_cluster(stack)
            if do_pipelined:
                leader, pipe = _measure(
                    cluster,
                    leader,
                    f"bench_pipelined {ops} {payload_bytes} {window} {pipe_timeout}",
                    pipe_timeout,
                    f"{label} pipelined#{r}",
                    progress,
                    anomalies,
                    leader_timeout_s,
                )
                out.pipelined.append(pipe)
                lat = pipe["latency_ms"]
                progress(
                    f"{label}: repeat {r}/{repeats} pipelined: {pipe['ops_per_s']:.0f} ops/s, "
                    f"p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, leader CPU "
                    f"{pipe.get('leader_cpu_util_total', float('nan')):.0%}, "
                    f"{pipe['elapsed_s']:.2f}s"
                )
            if sync_n > 0:
                leader, sync = _measure(
                    cluster,
                    leader,
                    f"bench_sync {sync_n} {payload_bytes} {sync_timeout}",
                    sync_timeout,
                    f"{label} sync#{r}",
                    progress,
                    anomalies,
                    leader_timeout_s,
                )
                out.sync.append(sync)
                lat = sync["latency_ms"]
                progress(
                    f"{label}: repeat {r}/{repeats} sync: {sync['ops_per_s']:.1f} ops/s, "
                    f"p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, {sync['elapsed_s']:.2f}s"
                )
        if cluster is not None:
            out.final = cluster.statuses()
    return out


def run_pysyncobj(
    nodes: int,
    payload_bytes: int,
    ops: int,
    window: int,
    repeats: int,
    progress: Callable[[str], None] = print,
    *,
    sync_ops: int | None = None,
    warmup_ops: int | None = None,
    use_batch: bool = True,
    low_latency_sync: bool = True,
    conf_overrides: dict[str, Any] | None = None,
    fresh_cluster: bool = False,
    leader_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Measure PySyncObj (``nodes`` processes on 127.0.0.1) and return a JSON-able dict.

    ``pipelined`` and ``sync`` are measured with PySyncObj's default
    configuration (``appendEntriesUseBatch=True``, its documented throughput
    mode; ``use_batch=False`` switches both to the low-latency mode).  In batch
    mode a lone request waits for the next append-entries round (every
    ``appendEntriesPeriod`` = 0.1 s), so ``sync`` there is ~100 ms per op; when
    ``low_latency_sync`` is on (default) the result also has
    ``sync_low_latency``: the same sync benchmark on a second cluster with
    ``appendEntriesUseBatch=False``, the mode PySyncObj documents for
    "single request speed".  Quote that one as PySyncObj's commit latency.

    ``sync_ops`` (per repeat) defaults to ``min(ops, 50)`` in batch mode and
    ``min(ops, 2000)`` in low-latency mode.  ``warmup_ops`` (default
    ``min(ops, 2000)``) pipelined appends run unmeasured after each leader
    election.  ``conf_overrides`` sets other ``SyncObjConf`` options on every
    node (experiments; recorded under ``config.overrides``).  ``fresh_cluster``
    starts a new cluster for every repeat, so every repeat starts from an empty
    state (PySyncObj's log compaction re-serialises the whole state every
    ``logCompactionMinEntries`` = 5000 entries, so its cost grows with the
    entries already applied).
    """
    if min(nodes, ops, window, repeats) < 1 or payload_bytes < 0:
        raise ValueError("nodes, ops, window, repeats must be >= 1 and payload_bytes >= 0")

    def sync_count(batch: bool) -> int:
        if sync_ops is not None:
            return sync_ops
        return min(ops, 50) if batch else min(ops, 2000)

    warm_n = min(ops, 2000) if warmup_ops is None else warmup_ops
    t_start = time.monotonic()
    load_before = os.getloadavg()
    anomalies: list[dict[str, Any]] = []
    progress(
        f"pysyncobj: {nodes} nodes, payload {payload_bytes} B, ops {ops}, window {window}, "
        f"repeats {repeats}, fresh cluster per repeat: {fresh_cluster}"
    )
    main_mode = _run_mode(
        label="pysyncobj",
        nodes=nodes,
        payload_bytes=payload_bytes,
        ops=ops,
        window=window,
        repeats=repeats,
        sync_n=sync_count(use_batch),
        warm_n=warm_n,
        do_pipelined=True,
        use_batch=use_batch,
        conf_overrides=conf_overrides,
        fresh_cluster=fresh_cluster,
        leader_timeout_s=leader_timeout_s,
        progress=progress,
        anomalies=anomalies,
    )
    low: _ModeResult | None = None
    if low_latency_sync and use_batch and sync_count(False) > 0:
        low = _run_mode(
            label="pysyncobj[no-batch]",
            nodes=nodes,
            payload_bytes=payload_bytes,
            ops=ops,
            window=window,
            repeats=repeats,
            sync_n=sync_count(False),
            warm_n=min(warm_n, sync_count(False)),
            do_pipelined=False,
            use_batch=False,
            conf_overrides=conf_overrides,
            fresh_cluster=fresh_cluster,
            leader_timeout_s=leader_timeout_s,
            progress=progress,
            anomalies=anomalies,
        )

    first = main_mode.first_status
    conf = dict(first.get("config") or {})
    conf.update(
        {
            "payload_type": "str (ASCII; payload_bytes bytes as UTF-8)",
            "submitter": "leader process, one client thread beside PySyncObj's tick thread",
            "transport": "TCP over 127.0.0.1, one OS process per node",
            "window": window,
            "pipelined_ops": ops,
            "sync_ops": sync_count(use_batch),
            "warmup_ops": warm_n,
            "fresh_cluster_per_repeat": fresh_cluster,
            "overrides": dict(conf_overrides or {}),
        }
    )
    elections = main_mode.elections_s + (low.elections_s if low else [])
    result: dict[str, Any] = {
        "system": "pysyncobj",
        "version": first.get("version"),
        "config": conf,
        "nodes": nodes,
        "payload_bytes": payload_bytes,
        "ops": ops,
        "window": window,
        "repeats": repeats,
        "election_s": median_min_max(elections),
        "pipelined": _aggregate(main_mode.pipelined),
        "sync": _aggregate(main_mode.sync) if main_mode.sync else None,
        "sync_low_latency": None,
        "final_raft": {
            a: {k: s.get(k) for k in ("is_leader", "raft_term", "commit_index", "items")}
            for a, s in main_mode.final.items()
        },
        "anomalies": anomalies,
        "notes": list(_NOTES),
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
            "python": sys.version.split()[0],
        },
        "wall_s": 0.0,
    }
    if low is not None and low.sync:
        result["sync_low_latency"] = {
            **_aggregate(low.sync),
            "config": {"appendEntriesUseBatch": False, "sync_ops": sync_count(False)},
        }
    result["wall_s"] = time.monotonic() - t_start
    progress(f"pysyncobj: done in {result['wall_s']:.1f}s")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="PySyncObj peer baseline benchmark")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--payload", type=int, default=100, help="payload bytes per append")
    ap.add_argument("--ops", type=int, default=20000, help="pipelined appends per repeat")
    ap.add_argument("--window", type=int, default=5000, help="max outstanding pipelined appends")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync-ops", type=int, default=None, help="sync appends per repeat")
    ap.add_argument("--warmup-ops", type=int, default=None)
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
        help="override a SyncObjConf option on every node (experiments; recorded in config)",
    )
    ap.add_argument(
        "--no-low-latency-sync",
        action="store_true",
        help="skip the extra sync run with appendEntriesUseBatch=False",
    )
    ap.add_argument(
        "--fresh-cluster",
        action="store_true",
        help="start a new cluster (empty state) for every repeat",
    )
    ap.add_argument("--leader-timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    # Imported here so that importing this module does not need pysyncobj.
    from benchmarks._pysyncobj_node import parse_conf_overrides

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run_pysyncobj(
        args.nodes,
        args.payload,
        args.ops,
        args.window,
        args.repeats,
        progress,
        sync_ops=args.sync_ops,
        warmup_ops=args.warmup_ops,
        use_batch=not args.no_batch,
        conf_overrides=parse_conf_overrides(args.conf),
        low_latency_sync=not args.no_low_latency_sync,
        fresh_cluster=args.fresh_cluster,
        leader_timeout_s=args.leader_timeout,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
