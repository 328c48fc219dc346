"""A multi-group harness run: ``python -m jepsen_like run --groups N``.

Theory of operation
-------------------
The run starts a controller group (``--controller-nodes`` voters, the
controller's state machine) and ``N`` broker groups of ``--nodes`` voters,
each an ordinary :class:`~jepsen_like.control.Cluster` with a
``group.toml`` naming its group and the controller's addresses, exactly as
``dledger cluster up --groups N`` lays them out. Node ids (and network
namespaces) are numbered across the run: the controller's first, then each
group's, so one partition rule names one node wherever it is.

Set-up: every node ready, every group registered and live at the
controller, then the test topic is created through the controller, which
spreads its queues over the groups (queue ``q`` to the ``q % N``-th live
group); the harness reads the route back and sends each queue's requests
to its group's nodes, as the routing client does. The history's header
records the layout (``groups``, ``controller``, ``queue_groups``) and
which processes are *unordered* producers.

Workload: per queue, the contended mix of a single-group run (ordered
producers that keep their queue, a third of them idempotent; head readers),
one consumer-group poller per queue, and ``--unordered`` producers whose
messages go to a queue of a group they pick at random, moving to another
group's queue after a refusal or an unknown outcome
(:meth:`~jepsen_like.workload.Workload.unordered_producer`).

Nemeses (``--nemesis all`` in this mode): ``group`` takes out a whole
broker group (SIGKILL of a majority or of all its voters), ``controller``
kills the controller's leader or its majority, and ``kill``, ``pause``,
``partition``, ``clock`` and ``corrupt`` act as in a single-group run on a
broker group picked at random. One fault at a time, as always. ``power``
and ``disk`` (lazyfs) are left out of ``all`` here: one FUSE daemon per
node is twelve more Python processes on the data path of a 3 x 3 run, and
a 2-core machine cannot carry them and the nodes without the run measuring
the overload; name them in ``--nemesis`` to have them anyway, and the
single-group runs cover them.

Checks: every checker of a single-group run (per queue: linearizable,
queue; recovery over the whole service; nodes; replicas per group), plus
:mod:`jepsen_like.checkers.groups`: recovery per group (faults elsewhere,
the controller's included, excuse nothing), the unordered producers'
availability during each whole-group outage, and ordered produces aimed
at a dead group failing cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, cast

from jepsen_like import replicas
from jepsen_like.checkers import combine
from jepsen_like.control import Cluster, find_libfaketime
from jepsen_like.history import Writer
from jepsen_like.nemesis import SHAPES, Nemesis
from jepsen_like.runner import Runner
from jepsen_like.workload import TOPIC, Http, Workload

GROUP_KINDS = ("group", "controller")
# What ``--nemesis all`` means with --groups (see the module docstring).
GROUPS_ALL = ("group", "controller", "kill", "pause", "partition", "clock", "corrupt")
# The steps every default multi-group run makes first, in a seeded order.
GROUPS_REQUIRED: tuple[tuple[str, str], ...] = (
    ("group", "majority"),
    ("group", "all"),
    ("controller", "majority"),
    ("controller", "leader"),
    ("pause", "leader"),
    ("partition", "isolate-leader"),
    ("clock", "step"),
)
GROUP_SHAPES = {k: SHAPES[k] for k in GROUP_KINDS}


_TRUNCATED = re.compile(rb"TRUNCATED (\d+) entries after index")


def truncated_in_log(path: Path) -> int:
    """Entries a controller-mode replica's log says it truncated (its
    ``TRUNCATED n entries`` lines), 0 when there is no log."""
    try:
        data = path.read_bytes()
    except OSError:
        return 0
    return sum(int(m.group(1)) for m in _TRUNCATED.finditer(data))


def cmode_settings(preset: str, replicas: int) -> dict[str, int | str | bool]:
    """The cluster-file settings of a controller-mode broker group:
    ``cp`` (every member of the SyncStateSet acknowledges, at least a
    majority in it) or ``ap`` (adaptive degradation down to the master
    alone, unclean elections), as docs/controller-mode.md describes."""
    majority = replicas // 2 + 1
    if preset == "cp":
        return {
            "replication": "controller",
            "all_ack_in_sync_state_set": True,
            "in_sync_replicas": majority,
            "min_in_sync_replicas": majority,
        }
    if preset == "ap":
        return {
            "replication": "controller",
            "in_sync_replicas": replicas,
            "min_in_sync_replicas": 1,
            "enable_auto_in_sync_replicas": True,
            "enable_elect_unclean_master": True,
        }
    raise ValueError(f"unknown controller-mode preset {preset!r} (cp, ap)")


class GroupNemesis:
    """One fault at a time over several clusters: ``group`` and
    ``controller`` faults, and the single-group kinds on a random group."""

    def __init__(
        self,
        groups: dict[str, Cluster],
        controller: Cluster,
        writer: Writer,
        rng: random.Random,
        kinds: list[str],
        *,
        log: Any,
        libfaketime: str | None,
        shapes: dict[str, list[str]],
    ) -> None:
        self.rng = rng
        base = [k for k in kinds if k not in GROUP_KINDS]
        self.by_group = {
            g: Nemesis(
                c,
                writer,
                rng,
                base,
                log=log,
                libfaketime=libfaketime,
                shapes=shapes,
                group=g,
                others=controller.ids,
            )
            for g, c in groups.items()
        }
        self.ctl = Nemesis(
            controller, writer, rng, ["kill"], log=log, libfaketime=None, group="controller"
        )
        # One list of events and of disk warnings for the whole run.
        self.events: list[dict[str, Any]] = []
        self.disk_warnings: list[dict[str, Any]] = []
        for n in self.all():
            n.events = self.events
            n.disk_warnings = self.disk_warnings
        self.count: dict[str, int] = {}
        self._current: Nemesis | None = None

    def all(self) -> list[Nemesis]:
        return [self.ctl, *self.by_group.values()]

    def of(self, c: Cluster) -> Nemesis:
        return next(n for n in self.all() if n.c is c)

    async def start(self, kind: str, shape: str | None = None) -> None:
        assert self._current is None
        k = self.count.get(kind, 0)
        self.count[kind] = k + 1
        if kind == "controller":
            nem, act = self.ctl, "kill"
            shape = shape or GROUP_SHAPES[kind][k % 2]
        else:
            nem = self.by_group[self.rng.choice(sorted(self.by_group))]
            act = "kill" if kind == "group" else kind
            if kind == "group":
                shape = shape or GROUP_SHAPES[kind][k % 2]
        self._current = nem
        await nem.start(act, shape)

    async def heal(self) -> None:
        if self._current is not None:
            nem, self._current = self._current, None
            await nem.heal()


def _merge_replicas(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    examples = [{**ex, "group": g} for g, r in per.items() for ex in r.get("examples", [])]
    return {
        "checker": "replicas",
        "verdict": combine([r["verdict"] for r in per.values()]),
        "divergent_offsets": sum(int(r.get("divergent_offsets", 0)) for r in per.values()),
        "examples": examples[:10],
        "messages_per_node": {
            i: v for r in per.values() for i, v in r.get("messages_per_node", {}).items()
        },
        "unreadable_nodes": [i for r in per.values() for i in r.get("unreadable_nodes", [])],
        "refused_damaged_nodes": [
            i for r in per.values() for i in r.get("refused_damaged_nodes", [])
        ],
        "damage_reports": {
            i: v for r in per.values() for i, v in r.get("damage_reports", {}).items()
        },
        "by_group": {
            g: {k: r.get(k) for k in ("verdict", "divergent_offsets", "leader_commit")}
            for g, r in per.items()
        },
    }


class GroupsRunner(Runner):
    """A :class:`Runner` over a controller group and several broker groups."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.ctl: Cluster | None = None
        self.groups: dict[str, Cluster] = {}
        self.layout: dict[str, Any] = {}

    def _node_count(self) -> int:
        return int(self.cfg.groups * self.cfg.nodes + self.cfg.controller_nodes)

    def _clusters(self) -> list[Cluster]:
        return ([self.ctl] if self.ctl is not None else []) + list(self.groups.values())

    def _teardown(self) -> None:
        # Broker groups first: their nodes heartbeat to the controller.
        for c in [*self.groups.values(), *([self.ctl] if self.ctl else [])]:
            with contextlib.suppress(Exception):
                c.stop_all()
        self.cluster = None
        super()._teardown()

    async def _note_all_exits(self) -> None:
        for c in self._clusters():
            await self._note_exits(c, self._nem_for(c))

    def _nem_for(self, c: Cluster) -> Any:
        return self.nem.of(c) if isinstance(self.nem, GroupNemesis) else None

    def _plan(self, kinds: list[str], rng: random.Random) -> list[tuple[str, str | None]]:
        if self.cfg.schedule is not None:
            return super()._plan(kinds, rng)
        r = random.Random(rng.random())
        plan: list[tuple[str, str | None]] = [s for s in GROUPS_REQUIRED if s[0] in kinds]
        r.shuffle(plan)
        self.log(
            "fault schedule: "
            + ", ".join(f"{k}:{s}" for k, s in plan)
            + f"; then round robin over {', '.join(kinds)}"
        )
        self.schedule = [f"{k}:{s or '*'}" for k, s in plan]
        return plan

    # -- set-up ------------------------------------------------------------------------
    def _layout_clusters(self, settings: dict[str, int | str | bool]) -> None:
        cfg = self.cfg
        root = cfg.out / "cluster"
        shutil.rmtree(root, ignore_errors=True)
        nid = 1
        self.ctl = Cluster(
            root / "controller",
            voters=cfg.controller_nodes,
            netns=self.netns,
            node_settings={**settings, "state_machine": "log"},
            first_id=nid,
            cluster_id="controller",
        )
        ctl_http = [m.http for m in self.ctl.members.values()]
        self.ctl.group = ("controller", "controller", ctl_http)
        nid += cfg.controller_nodes
        for k in range(cfg.groups):
            name = f"g{k + 1}"
            self.groups[name] = Cluster(
                root / name,
                voters=cfg.nodes,
                netns=self.netns,
                node_settings=settings,
                node_env=cfg.node_env,
                lazyfs=self.lazyfs,
                first_id=nid,
                cluster_id=name,
                group=(name, "broker", ctl_http),
            )
            nid += cfg.nodes
        for c in self._clusters():
            c.write_cluster_file()

    async def _wait_groups_live(self, http: Http, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = set(self.groups)
        seen: set[str] = set()
        while time.monotonic() < deadline:
            r = await http.call("GET", "/v1/brokers")
            if r.status == 200 and isinstance(r.body, dict):
                seen = {str(g["name"]) for g in r.body.get("groups", []) if g.get("live")}
                if want <= seen:
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(
            f"broker groups {sorted(want - seen)} not live at the controller in {timeout_s:.0f} s"
        )

    async def _create_topic(self, http: Http, timeout_s: float) -> dict[int, str]:
        """Create the topic through the controller; queue -> owning group."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            r = await http.call(
                "POST", "/v1/topics", json={"name": TOPIC, "queues": self.cfg.queues}, timeout_s=15
            )
            if r.status in (200, 201) or (r.status == 409 and "TOPIC_EXISTS" in str(r.body)):
                break
            last = f"{r.status} {r.body or r.error}"
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"could not create the topic in {timeout_s:.0f} s: {last}")
        while time.monotonic() < deadline:
            r = await http.call("GET", f"/v1/routes/{TOPIC}")
            if r.status == 200 and isinstance(r.body, dict):
                owners = {int(x["queue"]): str(x["group"]) for x in r.body["queues"]}
                if await self._groups_have_topic(http, owners):
                    return owners
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the groups did not all create the topic in {timeout_s:.0f} s")

    async def _groups_have_topic(self, http: Http, owners: dict[int, str]) -> bool:
        for g in set(owners.values()):
            c = self.groups[g]
            for m in c.members.values():
                r = await http.call("GET", f"/v1/topics/{TOPIC}", node=m.http)
                if r.status != 200:
                    return False
        return True

    # -- the run -----------------------------------------------------------------------
    async def _run(self, kinds: list[str], hist: Any) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        settings = self._node_settings()
        self._layout_clusters(settings)
        if cfg.replication == "controller":
            broker = cmode_settings(cfg.cmode, cfg.nodes)
            for c in self.groups.values():
                c.node_settings.update(broker)
                c.write_cluster_file()
            self.log(f"broker groups in controller mode ({cfg.cmode}): {broker}")
        assert self.ctl is not None
        ctl = self.ctl
        ctl.start_all()
        for c in self.groups.values():
            c.start_all()
        self.log(
            f"started a controller group of {len(ctl.ids)} and {len(self.groups)} broker groups "
            f"of {cfg.nodes}: " + ", ".join(f"{g} {c.ids}" for g, c in self.groups.items())
        )
        for name, c in [("controller", ctl), *self.groups.items()]:
            if not await c.wait_ready(timeout_s=60):
                raise RuntimeError(f"group {name} did not become ready in 60 s: see {c.root}")
        ctl_http = Http([m.http for m in ctl.members.values()], cfg.op_timeout_s)
        await ctl_http.open()
        try:
            await self._wait_groups_live(ctl_http, 60)
            owners = await self._create_topic(ctl_http, 60)
        finally:
            await ctl_http.close()
        group_queues = {g: sorted(q for q, o in owners.items() if o == g) for g in self.groups}
        self.log(
            f"topic {TOPIC!r}: {cfg.queues} queues: "
            + ", ".join(f"{g} {qs}" for g, qs in group_queues.items())
        )
        routes = {q: [m.http for m in self.groups[g].members.values()] for q, g in owners.items()}
        all_http = [m.http for c in self.groups.values() for m in c.members.values()]
        http = Http(all_http, cfg.op_timeout_s, routes=routes)
        # The workload is made before the history so that its header can say
        # which processes are which; the writer is handed over below.
        wl = Workload(
            cast(Writer, None),
            http,
            queues=cfg.queues,
            producers=cfg.producers,
            idempotent_producers=cfg.idempotent_producers,
            readers=cfg.readers,
            pollers=cfg.queues,
            seed=cfg.seed,
            op_timeout_s=cfg.op_timeout_s,
            clients_per_queue=cfg.clients_per_queue,
            client_timeout_s=cfg.client_timeout_s,
            unordered=cfg.unordered,
            group_queues=group_queues,
        )
        self.layout = {
            "groups": {g: c.ids for g, c in self.groups.items()},
            "controller": ctl.ids,
            "queue_groups": {str(q): g for q, g in sorted(owners.items())},
            "unordered_processes": wl.processes_of("unordered"),
        }
        meta = {
            **self._meta(kinds, settings),
            "learners": 0,
            "replication": cfg.replication,
            "cmode": cfg.cmode if cfg.replication == "controller" else None,
            **self.layout,
        }
        await http.open()
        try:
            with Writer(hist, metadata=meta) as w:
                wl.w = w
                self.log(f"workload for {cfg.time_limit_s:.0f} s, nemeses {kinds}")
                tasks = wl.tasks()
                nem = GroupNemesis(
                    self.groups,
                    ctl,
                    w,
                    rng,
                    kinds,
                    log=self.log,
                    libfaketime=find_libfaketime(),
                    shapes=cfg.shapes,
                )
                self.nem = nem  # type: ignore[assignment]
                await self._nemesis_loop(nem, wl, kinds, rng)
                await self._stop_workload(wl, tasks)
                for c in self._clusters():
                    await self._recover_all(c)
                leaders: dict[int, str | None] = {}
                lead_of: dict[str, int | None] = {}
                for g, c in self.groups.items():
                    lead = lead_of[g] = await c.leader()
                    for q in group_queues[g]:
                        leaders[q] = c.members[lead].http if lead is not None else None
                self.log(f"final reads from each group's leader {lead_of}")
                await self._final_reads(wl, leaders, 90)
                self.log("comparing the replicas (every queue from every live node, per group)")
                per = {
                    g: await replicas.compare(c, TOPIC, cfg.queues, damaged=nem.of(c).corrupted)
                    for g, c in self.groups.items()
                }
                self.replicas_result = _merge_replicas(per)
                self.log(f"replicas: {self.replicas_result['divergent_offsets']} divergent offsets")
                if cfg.replication == "controller":
                    self.truncated = self._truncated()
                    self.log(
                        f"entries truncated by replicas joining a new master: {self.truncated}"
                    )
                self.stats = wl.stats.by_f
                self.nemesis_events = nem.events
        finally:
            await http.close()
            for c in self._clusters():
                await c.close()

    # -- checking ----------------------------------------------------------------------
    def _truncated(self) -> dict[str, int]:
        """Controller mode: entries each replica cut from its log when it
        joined a master (a forked or unconfirmed tail), over the whole run:
        counted from the nodes' logs, which outlive restarts and rebuilds
        (a status counter starts again at each start)."""
        out: dict[str, int] = {}
        for c in self.groups.values():
            for i in c.members:
                out[str(i)] = truncated_in_log(c.root / f"node-{i}.log")
        return out

    def _run_info(self) -> dict[str, Any]:
        return {
            "truncated_entries": getattr(self, "truncated", {}),
            "replication": self.cfg.replication,
            "cmode": self.cfg.cmode if self.cfg.replication == "controller" else None,
            "groups": self.cfg.groups,
            "controller_nodes": self.cfg.controller_nodes,
            "unordered": self.cfg.unordered,
            "layout": self.layout,
        }
