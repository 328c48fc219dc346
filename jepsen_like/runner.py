"""One harness run: set up, load + faults for ``time_limit``, heal, final reads, check.

Order of a run (each step is printed as a progress line):

1. clean up what a crashed run left (our namespaces, links, recorded PIDs);
2. network namespaces (when root and ``ip netns`` work; otherwise say so,
   run every node on 127.0.0.1 and refuse partition nemeses);
3. write the cluster file, start every node, wait until each is ready,
   create the topic;
4. workers run while the nemesis loop alternates fault / quiet periods;
5. the last fault is healed, crashed nodes are noted and restarted, every
   node must become ready again, then final reads (linearizable, from the
   leader) of every queue;
6. stop every process by PID, remove namespaces; run every checker on the
   history and write ``results.json`` and ``report.html``.

Cleanup runs in ``finally`` and on SIGTERM/SIGINT/SIGHUP, so an interrupted
run leaves no process, namespace or rule behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from jepsen_like import lazyfs, net, replicas
from jepsen_like.checkers import check_history, combine, tail
from jepsen_like.checkers.recovery import RecoveryConfig
from jepsen_like.control import Cluster, RunLock, find_libfaketime, kill_stale, unmount_stale
from jepsen_like.history import Writer, read_history
from jepsen_like.nemesis import (
    ALL_KINDS,
    LAZYFS_KINDS,
    Nemesis,
    default_schedule,
    format_schedule,
)
from jepsen_like.report import html_report
from jepsen_like.summary import render
from jepsen_like.workload import TOPIC, Http, Workload


@dataclass
class RunConfig:
    nodes: int = 3
    learners: int = 0
    nemesis: list[str] = field(default_factory=lambda: list(ALL_KINDS))
    time_limit_s: float = 60.0
    out: Path = Path("jepsen-out")
    seed: int = 0
    queues: int = 4
    producers: int = 4
    idempotent_producers: int = 2
    readers: int = 2
    pollers: int = 2
    fault_s: tuple[float, float] = (2.5, 5.0)
    quiet_s: tuple[float, float] = (2.0, 4.0)
    op_timeout_s: float = 3.0
    recovery_s: float = 8.0
    lock_wait_s: float = 900.0
    node_env: dict[str, str] = field(default_factory=dict)
    node_settings: dict[str, int | str | bool] = field(default_factory=dict)
    use_netns: bool = True
    shapes: dict[str, list[str]] = field(default_factory=dict)
    quiet: bool = False
    # Contended workload (issue 18): clients per queue (0: the legacy mix of
    # random-queue producers/readers above) and their short per-op deadlines.
    clients_per_queue: int = 20
    client_timeout_s: tuple[float, float] | None = (0.03, 0.3)
    # Fault schedule: None = nemesis.REQUIRED in a seeded order, then round robin.
    schedule: list[tuple[str, str | None]] | None = None
    # The nodes' flush mode (issue 20: "async" may lose the unsynced tail
    # after a power loss of a majority, never diverge).
    flush: str = "sync"
    # A multi-group run (jepsen_like.groups): broker groups (0: one plain
    # cluster), the controller group's voters, unordered producers.
    groups: int = 0
    controller_nodes: int = 3
    unordered: int = 0
    # How the broker groups replicate (jepsen_like.groups): "raft", or
    # "controller" (RocketMQ 5's controller mode) with the "cp" or "ap"
    # settings preset (cmode_settings).
    replication: str = "raft"
    cmode: str = "cp"


class Runner:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.notes: list[str] = []
        self.cluster: Cluster | None = None
        self.netns = False
        self.used_netns = False
        self.exits: list[dict[str, Any]] = []
        self.nem: Nemesis | None = None
        self.lock = RunLock()
        self.warnings: list[dict[str, Any]] = []
        self.lazyfs = False
        # Replicas that stopped with REPLICA_DIVERGED and were rebuilt.
        self.diverged: list[dict[str, Any]] = []
        self.replicas_result: dict[str, Any] | None = None

    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    # -- setup / teardown ------------------------------------------------------------------
    def _prepare(self) -> list[str]:
        cfg = self.cfg
        kinds = list(cfg.nemesis)
        if not self.lock.acquire(cfg.lock_wait_s, self.log):
            raise RuntimeError(
                f"another jepsen_like run held the machine for {cfg.lock_wait_s:.0f} s"
            )
        for pid in kill_stale():
            self.log(f"killed stale node process {pid} from an earlier run")
        for point in unmount_stale():
            self.log(f"cleanup: unmounted a lazyfs an earlier run left at {point}")
        why = net.available() if cfg.use_netns else "disabled by --no-netns"
        if why is None:
            for line in net.cleanup():
                self.log(f"cleanup: {line}")
            net.setup(range(1, self._node_count() + 1))
            self.netns = True
            self.used_netns = True
            self.log(f"network namespaces ready: bridge {net.BRIDGE}, nodes on {net.SUBNET}.x")
        else:
            msg = f"network namespaces unavailable ({why}): nodes run on 127.0.0.1"
            if "partition" in kinds:
                kinds.remove("partition")
                msg += "; partition nemeses refused (no kernel-level partitions to make)"
            self.log(msg)
            self.notes.append(msg)
        wanted = [k for k in kinds if k in LAZYFS_KINDS]
        if wanted:
            why_not = lazyfs.why_unavailable()
            if why_not is None:
                self.lazyfs = True
                self.log("data directories on lazyfs (power loss and disk errors): FUSE mounts")
            else:
                for k in wanted:
                    kinds.remove(k)
                msg = f"lazyfs unavailable ({why_not}): {', '.join(wanted)} nemesis skipped"
                self.log(msg)
                self.notes.append(msg)
        if "clock" in kinds and find_libfaketime() is None:
            kinds.remove("clock")
            msg = "libfaketime not found (apt package 'faketime'): clock nemesis skipped"
            self.log(msg)
            self.notes.append(msg)
        return kinds

    def _node_settings(self) -> dict[str, int | str | bool]:
        """The cluster files' [node] settings of every run."""
        settings: dict[str, int | str | bool] = {"snapshot_every_entries": 4000}
        if self.cfg.flush != "sync":
            settings["flush"] = self.cfg.flush
        settings.update(self.cfg.node_settings)
        return settings

    def _meta(self, kinds: list[str], settings: dict[str, int | str | bool]) -> dict[str, Any]:
        """The history header's description of the run."""
        cfg = self.cfg
        return {
            "nodes": cfg.nodes,
            "learners": cfg.learners,
            "nemesis": kinds,
            "seed": cfg.seed,
            "netns": self.netns,
            "node_env": sorted(cfg.node_env),
            "flush": str(settings.get("flush", "sync")),
            "lazyfs": self.lazyfs,
        }

    def _node_count(self) -> int:
        """How many node processes (and network namespaces) the run has."""
        return self.cfg.nodes + self.cfg.learners

    def _teardown(self) -> None:
        if self.cluster is not None:
            self.cluster.stop_all()
        if self.netns:
            with contextlib.suppress(Exception):
                net.cleanup()
            self.netns = False
        self.lock.release()

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)

        def on_signal(signum: int, _frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            kinds = self._prepare()
            hist = cfg.out / "history.jsonl"
            if hist.exists():
                hist.unlink()
            asyncio.run(self._run(kinds, hist))
        except KeyboardInterrupt as e:
            self.log(f"interrupted ({e}); cleaning up")
            self._teardown()
            return 130
        finally:
            self._teardown()
            for s, h in old.items():
                signal.signal(s, h)
        return self._check(hist)

    async def _run(self, kinds: list[str], hist: Path) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        settings = self._node_settings()
        self.cluster = c = Cluster(
            cfg.out / "cluster",
            voters=cfg.nodes,
            learners=cfg.learners,
            netns=self.netns,
            node_settings=settings,
            node_env=cfg.node_env,
            lazyfs=self.lazyfs,
        )
        import shutil

        shutil.rmtree(c.root, ignore_errors=True)
        c.write_cluster_file()
        with Writer(hist, metadata=self._meta(kinds, settings)) as w:
            c.start_all()
            self.log(f"started {len(c.ids)} nodes: {[c.members[i].http for i in c.ids]}")
            if not await c.wait_ready(timeout_s=60):
                raise RuntimeError(
                    f"the cluster did not become ready in 60 s: see node logs in {c.root}"
                )
            http = Http([c.members[i].http for i in c.ids], cfg.op_timeout_s)
            await http.open()
            try:
                wl = Workload(
                    w,
                    http,
                    queues=cfg.queues,
                    producers=cfg.producers,
                    idempotent_producers=cfg.idempotent_producers,
                    readers=cfg.readers,
                    pollers=cfg.pollers,
                    seed=cfg.seed,
                    op_timeout_s=cfg.op_timeout_s,
                    clients_per_queue=cfg.clients_per_queue,
                    client_timeout_s=cfg.client_timeout_s,
                )
                if not await wl.setup_topic(30):
                    raise RuntimeError("could not create the topic in 30 s")
                self.log(f"topic ready; workload for {cfg.time_limit_s:.0f} s, nemeses {kinds}")
                tasks = wl.tasks()
                nem = Nemesis(
                    c,
                    w,
                    rng,
                    kinds,
                    log=self.log,
                    libfaketime=find_libfaketime(),
                    shapes=cfg.shapes,
                )
                self.nem = nem
                await self._nemesis_loop(nem, wl, kinds, rng)
                await self._stop_workload(wl, tasks)
                await self._recover_all(c)
                lead = await c.leader()
                lead_http = c.members[lead].http if lead is not None else None
                self.log(f"final reads from leader {lead}")
                await self._final_reads(wl, lead_http, 60)
                self.log("comparing the replicas (every queue from every live node)")
                self.replicas_result = await replicas.compare(
                    c, TOPIC, cfg.queues, damaged=nem.corrupted
                )
                self.log(
                    f"replicas: {self.replicas_result['divergent_offsets']} divergent offsets, "
                    f"messages per node {self.replicas_result['messages_per_node']}"
                )
                self.stats = wl.stats.by_f
                self.nemesis_events = nem.events
            finally:
                await http.close()
                await c.close()

    async def _stop_workload(self, wl: Workload, tasks: list[asyncio.Task[None]]) -> None:
        wl.stop.set()
        await asyncio.wait(tasks, timeout=self.cfg.op_timeout_s * 3)
        for t in tasks:
            t.cancel()

    async def _final_reads(
        self, wl: Workload, leaders: str | dict[int, str | None] | None, deadline_s: float
    ) -> None:
        if not await wl.final_reads(leaders, deadline_s):
            self.log("final reads did not all complete")
            self.notes.append("final reads incomplete")
        self.log(f"workload done: ok={wl.stats.ok} fail={wl.stats.fail} info={wl.stats.info}")

    async def _note_all_exits(self) -> None:
        assert self.cluster is not None
        await self._note_exits(self.cluster, self._nem_for(self.cluster))

    def _nem_for(self, c: Cluster) -> Any:
        """The nemesis acting on ``c`` (None before the nemesis exists)."""
        return self.nem

    async def _nemesis_loop(
        self, nem: Any, wl: Workload, kinds: list[str], rng: random.Random
    ) -> None:
        cfg = self.cfg
        end = time.monotonic() + cfg.time_limit_s
        last_progress = time.monotonic()
        k = 0
        plan = self._plan(kinds, rng)
        await asyncio.sleep(min(2.0, cfg.time_limit_s / 10))
        while time.monotonic() < end:
            if kinds or plan:
                if plan:
                    kind, shape = plan.pop(0)
                else:
                    kind, shape = kinds[k % len(kinds)], None
                    k += 1
                # A replica that stopped during the quiet time (REPLICA_DIVERGED
                # once the leader reached it, after a power loss) is rebuilt
                # before the next fault can take the cluster's last quorum.
                await self._note_all_exits()
                await nem.start(kind, shape)
                await self._sleep_until(rng.uniform(*cfg.fault_s), end)
                await nem.heal()
            await self._note_all_exits()
            await self._sleep_until(rng.uniform(*cfg.quiet_s), end)
            if time.monotonic() - last_progress >= 10:
                last_progress = time.monotonic()
                s = wl.stats
                self.log(f"progress: ok={s.ok} fail={s.fail} info={s.info}")
        await nem.heal()
        # Clients keep going after the last heal, so its window's recovery is
        # observed rather than cut off by the end of the run.
        self.log(f"all faults healed; the workload runs {cfg.recovery_s:.0f} s more")
        await asyncio.sleep(cfg.recovery_s)
        await self._note_all_exits()

    def _plan(self, kinds: list[str], rng: random.Random) -> list[tuple[str, str | None]]:
        """The schedule's steps this run can make (printed), before the round robin."""
        if self.cfg.schedule is None:
            plan = default_schedule(kinds, random.Random(rng.random()), self.cfg.shapes)
        else:
            plan = [(k, s) for k, s in self.cfg.schedule if k in kinds]
            dropped = [f"{k}:{s or '*'}" for k, s in self.cfg.schedule if k not in kinds]
            if dropped:
                self.log(f"schedule steps dropped (nemesis unavailable here): {dropped}")
        self.log(f"fault schedule: {format_schedule(plan, kinds)}")
        self.schedule = [f"{k}:{s or '*'}" for k, s in plan]
        return plan

    async def _sleep_until(self, seconds: float, end: float) -> None:
        await asyncio.sleep(max(0.0, min(seconds, end - time.monotonic() + 0.5)))

    async def _note_exits(self, c: Cluster, nem: Any) -> None:
        for rec in c.check_exits():
            node = rec["node"]
            if nem is not None and node in nem.corrupted:
                # Damage found after start-up (a record outside the verified
                # tail was read, or LMDB hit a damaged page): the node stopped
                # instead of serving it. The CLI promises exit 2 for damaged
                # data; anything else is reported as a warning.
                code = rec["exit_code"]
                self.log(f"node {node} found its damaged data later (exit {code}); rebuilding it")
                if code != 2:
                    self.warnings.append(
                        {
                            "node": node,
                            "warning": f"a node with damaged data stopped with exit code {code}, "
                            "not 2 (StorageCorrupted)",
                            "log_tail": rec["log_tail"],
                        }
                    )
                st = await c.statuses()
                term = max((int(s.get("term", 0)) for s in st.values()), default=0)
                info: dict[str, Any] = {"late_detection": True}
                await nem.rebuild(node, term, info)
                nem.events.append({"kind": "corrupt-late", "targets": [node], **info})
                continue
            tail = c.log_tail(node, 60)
            if rec["exit_code"] == 2 and ("ReplicaDiverged" in tail or "REPLICA_DIVERGED" in tail):
                # The replica found that its committed log contradicts the
                # leader's (possible after a majority power loss in async
                # mode) and stopped, as it must: rebuild it from the leader.
                said = [x for x in tail.splitlines() if "diverged" in x]
                self.log(f"node {node} stopped: REPLICA_DIVERGED; rebuilding it from the leader")
                st = await c.statuses()
                term = max((int(s.get("term", 0)) for s in st.values()), default=0)
                info = {"said": (said or [""])[-1][-400:]}
                if nem is not None:
                    await nem.rebuild(node, term, info)
                    nem.events.append({"kind": "diverged-rebuild", "targets": [node], **info})
                self.diverged.append({"node": node, **info})
                continue
            self.exits.append(rec)
            self.log(
                f"node {rec['node']} exited on its own with code {rec['exit_code']}:\n"
                f"{rec['log_tail']}"
            )
            if len(c.members[node].exits) < 3:
                c.start(node)
            else:
                self.log(f"node {node} crashed {len(c.members[node].exits)} times: left down")

    async def _recover_all(self, c: Cluster) -> None:
        net.heal(c.ids) if self.netns else None
        for i in c.ids:
            if c.members[i].paused:
                c.signal(i, signal.SIGCONT)
        await self._note_exits(c, self._nem_for(c))
        for i in c.ids:
            if not c.alive(i) and not c.members[i].exits:
                c.start(i)
        await asyncio.sleep(1.0)  # a node that crashes again at start-up shows now
        await self._note_exits(c, self._nem_for(c))
        down = [i for i in c.ids if not c.alive(i)]
        if down:
            self.log(
                f"nodes {down} are down after healing (crashed again): final reads without them"
            )
            self.notes.append(f"nodes {down} down at the end")
        if not await c.wait_ready([i for i in c.ids if c.alive(i)], timeout_s=60):
            self.log("not every node became ready within 60 s of healing")
            self.notes.append("cluster not fully ready after healing")

    # -- checking ------------------------------------------------------------------------------
    def _check(self, hist: Path) -> int:
        cfg = self.cfg
        self.log("checking the history")
        history = read_history(hist)
        results = check_history(history, recovery_config=RecoveryConfig())
        disk_warnings = self.nem.disk_warnings if self.nem is not None else []
        # A divergence is the promised fail-stop in async mode after a power
        # loss of a majority; in sync mode nothing acknowledged is ever lost,
        # so a replica that finds its committed log contradicted is a bug.
        bad_divergence = self.diverged if cfg.flush == "sync" else []
        nodes_verdict = "invalid" if self.exits or disk_warnings or bad_divergence else "valid"
        results["checkers"]["nodes"] = {
            "checker": "nodes",
            "verdict": nodes_verdict,
            "unexpected_exits": self.exits,
            "warnings": self.warnings + disk_warnings,
            "diverged_rebuilt": self.diverged,
            "flush": cfg.flush,
        }
        if self.replicas_result is not None:
            results["checkers"]["replicas"] = self.replicas_result
        if cfg.flush == "async":
            # What a power loss of a majority took: only the unsynced tail.
            interval_ms = int(cfg.node_settings.get("flush_interval_ms", 200))
            results["checkers"]["tail"] = tail.check(
                history, voters=cfg.nodes, tail_s=max(2.0, 10 * interval_ms / 1000)
            )
        results["verdict"] = combine([r["verdict"] for r in results["checkers"].values()])
        results["run"] = {
            "nodes": cfg.nodes,
            "learners": cfg.learners,
            "nemesis": cfg.nemesis,
            "time_limit_s": cfg.time_limit_s,
            "seed": cfg.seed,
            "netns": self.used_netns,
            "notes": "; ".join(self.notes),
            "ops_by_f": getattr(self, "stats", {}),
            "nemesis_events": getattr(self, "nemesis_events", []),
            "schedule": getattr(self, "schedule", []),
            "flush": cfg.flush,
            "lazyfs": self.lazyfs,
            "wall_s": round(time.monotonic() - self.t0, 1),
            **self._run_info(),
        }
        (cfg.out / "results.json").write_bytes(
            orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
        )
        (cfg.out / "report.html").write_text(html_report(results, history), encoding="utf-8")
        lin = results["checkers"]["linearizable"]
        if lin["verdict"] == "invalid":
            # The smallest failing window per key, on its own for a person to read.
            windows = {
                k: {"window": lin["keys"][k].get("window"), "stuck_at": lin["keys"][k].get("stuck_at"),
                    "note": lin["keys"][k].get("note")}
                for k in lin["invalid_keys"]
            }  # fmt: skip
            (cfg.out / "linearizability-windows.json").write_bytes(
                orjson.dumps(windows, option=orjson.OPT_INDENT_2)
            )
        print(render(results, str(cfg.out / "report.html")), flush=True)
        sys.stdout.flush()
        return {"valid": 0, "invalid": 1, "unknown": 2}[results["verdict"]]

    def _run_info(self) -> dict[str, Any]:
        """More facts about the run for ``results["run"]`` (subclasses)."""
        return {}


def summarize(results_path: Path) -> dict[str, Any]:
    """RTO figures per fault kind from a results.json (for notes and tests)."""
    res = json.loads(results_path.read_text())
    out: dict[str, list[float]] = {}
    for w in res["checkers"]["recovery"].get("windows", []):
        if w.get("rto_ms") is not None:
            out.setdefault(w["kind"], []).append(w["rto_ms"])
    return {
        k: {"n": len(v), "max_ms": max(v), "median_ms": sorted(v)[len(v) // 2]}
        for k, v in out.items()
    }
