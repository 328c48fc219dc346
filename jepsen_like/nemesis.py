"""Nemeses: faults on real processes and real network namespaces.

Theory of operation
-------------------
Schedule: a default run goes through :data:`REQUIRED` (kill of a majority,
kill of all nodes, a partition leaving the leader in a minority, a leader
pause longer than the election timeout, a clock step) in an order drawn
from the seed, then round robin over the enabled kinds; ``--schedule``
replaces the required list.

A :class:`Nemesis` runs one fault at a time: ``start`` (record the window
start in the history, then act), hold for a while, ``heal`` (act, then
record the stop). Every fault is healed before the next one starts and
before final reads, so a window in the history is exactly the time the
fault was in force (plus the recording latency).

Kinds and shapes (targets are voters unless said otherwise):

* ``kill``: SIGKILL of one node, a minority, a majority, the leader, or all
  voters; healed by restarting them.
* ``pause``: SIGSTOP of the same targets; healed by SIGCONT.
* ``partition`` (network namespaces only): isolate one node, isolate the
  leader, random halves, a bridge (two sides that only one node sees both
  of), and with 5 voters the majorities ring (each node sees its two ring
  neighbours: every node has a majority, no two majorities agree) and the
  leader cut off with a minority of followers (it replicates, never commits);
  healed by flushing every namespace's INPUT chain.
* ``clock`` (libfaketime): one node is restarted under ``LD_PRELOAD`` with
  its clocks offset (skew: wall and monotonic clocks both shifted by
  -120..+120 s), its wall clock strobing between two offsets, or (step, on
  the leader) its wall clock stepped once by 30..300 s either way; healed by
  restarting it without. A monotonic clock that *jumps back* while running
  is outside the lease's fault model (bounded drift, DESIGN.md), so the
  strobe moves the wall clock only (``FAKETIME_DONT_FAKE_MONOTONIC``).
* ``corrupt``: one node (a minority) is killed, its LMDB data file is
  truncated or has bits flipped (or, half the time when its write-ahead
  log holds two records or more, bits flip inside a record of the log that
  another follows: rot, not a torn write), and it is restarted. If it refuses to
  start (it must, when it detects the damage), the replica is rebuilt from
  its peers: its data directory is wiped and it rejoins empty. Wiping a
  voter is only safe when (1) every other voter holds every committed
  entry, so any majority the empty node joins still contains the log, and
  (2) the cluster's term has moved past every term the node could have voted
  in, so it cannot vote twice in one term. The nemesis waits for (1) by
  comparing the others' commit indexes with the leader's, and for (2) by
  asking for leadership transfers (each starts a new term) until the
  leader's term is above every term seen since the node went down. That
  leader was elected without the node, so it holds no stale progress for
  it (a leader that heard the node before the wipe would only ever offer
  it entries after its old position, which the empty node refuses). The
  heal, and so the fault's window, ends once the rebuilt node has caught
  up: its catch-up loads the leader and belongs to this fault. Only one
  node is ever corrupted at once.
* ``power`` (lazyfs: every data directory is a :mod:`jepsen_like.lazyfs`
  mount): one node, a minority, a majority or all voters lose power: each
  is SIGKILLed and its filesystem drops every write it had not fsynced;
  the ``-torn`` shapes also persist, in order, part of the last-written
  file's pending writes and tear the write in flight at a sector boundary.
  Healed by restarting them. In ``flush = "sync"`` mode nothing
  acknowledged may be lost; in ``"async"`` mode a power loss of a majority
  may lose the unsynced tail, and a survivor whose committed log the new
  leader contradicts stops with exit 2 (``REPLICA_DIVERGED``): the runner
  rebuilds it from the leader as for corruption.
* ``disk`` (lazyfs): one voter's disk fails every fsync, or every write,
  with EIO or ENOSPC (a failed fsync also loses the file's unsynced writes,
  as on Linux). The node must stop (exit 3, ``DISK_FAILED``) without
  acknowledging what it could not make durable; healed by making the disk
  good again and restarting the node.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jepsen_like import net
from jepsen_like.control import Cluster
from jepsen_like.history import Writer

ALL_KINDS = ("kill", "pause", "partition", "clock", "corrupt", "power", "disk")
# Kinds that need every data directory on lazyfs.
LAZYFS_KINDS = ("power", "disk")
POWER_SHAPES = (
    "majority",
    "one-torn",
    "all",
    "minority",
    "majority-torn",
    "one",
    "all-torn",
    "minority-torn",
)
DISK_SHAPES = ("fsync-eio", "write-enospc", "fsync-enospc", "write-eio")

# The shapes every default run goes through, in a seeded random order, before
# the round robin over the kinds: between them they catch each planted bug
# (dledger/faults.py). A kill of all nodes loses the unsynced tail where the
# storage allows it; the leader-minority partition keeps the leader with the
# learners (and, with 5 voters, one follower), which replicate entries that
# never commit.
REQUIRED: tuple[tuple[str, str], ...] = (
    ("kill", "majority"),
    ("kill", "all"),
    ("partition", "leader-minority"),
    ("pause", "leader"),
    ("clock", "step"),
)
SHAPES: dict[str, tuple[str, ...]] = {
    "kill": ("leader", "majority", "one", "minority", "all"),
    "pause": ("leader", "majority", "one", "minority"),
    "partition": (
        "isolate-leader",
        "halves",
        "majorities-ring",
        "bridge",
        "isolate-one",
        "leader-minority",
    ),
    "clock": ("skew", "strobe", "step"),
    "corrupt": ("one",),
    "power": POWER_SHAPES,
    "disk": DISK_SHAPES,
    # Multi-group runs only (jepsen_like.groups): a whole broker group, the controller.
    "group": ("majority", "all"),
    "controller": ("leader", "majority"),
}


# Scheduled shapes that aim at the leader: they wait for one to exist.
_AIMS_AT_LEADER: dict[str, set[str | None]] = {
    "kill": {"leader"},
    "pause": {"leader"},
    "partition": {"isolate-leader", "leader-minority"},
    "clock": {"step"},
    "disk": set(DISK_SHAPES),
}


def parse_schedule(text: str) -> list[tuple[str, str | None]]:
    """``kill:all,pause:leader,clock`` -> [(kind, shape or None), ...]; ValueError if unknown."""
    out: list[tuple[str, str | None]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        kind, _, shape = item.partition(":")
        if kind not in SHAPES:
            raise ValueError(f"unknown nemesis kind {kind!r} (known: {', '.join(SHAPES)})")
        if shape and shape not in SHAPES[kind]:
            raise ValueError(f"unknown {kind} shape {shape!r} (known: {', '.join(SHAPES[kind])})")
        out.append((kind, shape or None))
    return out


def default_schedule(
    kinds: list[str], rng: random.Random, shapes: dict[str, list[str]] | None = None
) -> list[tuple[str, str | None]]:
    """The required shapes whose kind is enabled (and not restricted to other
    shapes by ``--shapes``), shuffled by the run's seed."""
    only = shapes or {}
    out: list[tuple[str, str | None]] = [
        (k, s) for k, s in REQUIRED if k in kinds and (k not in only or s in only[k])
    ]
    rng.shuffle(out)
    return out


def format_schedule(schedule: list[tuple[str, str | None]], kinds: list[str]) -> str:
    steps = " ".join(f"{i}.{k}:{s or '*'}" for i, (k, s) in enumerate(schedule, 1))
    rr = ",".join(kinds) if kinds else "nothing"
    return f"{steps or '(none)'}; then round robin over {rr}"


def set_faked_offset(path: Path, offset: str) -> None:
    """Point a node's faked wall clock (libfaketime's
    ``FAKETIME_TIMESTAMP_FILE``) at ``offset``, atomically: a new file
    renamed over the old one. Rewriting the file in place leaves it empty
    for an instant, and libfaketime (0.9.11 on, and any version on its
    first read) parses an empty read as a timestamp, fails and calls
    ``exit(1)`` inside the node: an "unexpected exit" the harness blamed on
    the node (seen once in CI, in a strobe)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(offset + "\n")
    os.replace(tmp, path)


class Nemesis:
    def __init__(
        self,
        cluster: Cluster,
        writer: Writer,
        rng: random.Random,
        kinds: list[str],
        *,
        log: Callable[[str], None],
        libfaketime: str | None,
        shapes: dict[str, list[str]] | None = None,
        group: str | None = None,
        others: list[int] | None = None,
    ) -> None:
        self.c = cluster
        # A multi-group run: the run's nodes outside this cluster (the
        # controller group's). An isolated node is cut from them too, as a
        # node that loses its network is.
        self.others = list(others or [])
        # A multi-group run: the group this nemesis acts on, in every record.
        self.group = group
        self.w = writer
        self.rng = rng
        self.kinds = kinds
        self.log = log
        self.libfaketime = libfaketime
        self.shapes = shapes or {}
        # Corrupted nodes not rebuilt since: their damage may still be found later.
        self.corrupted: set[int] = set()
        # Nodes whose disk failed and that did not stop as promised (exit 3).
        self.disk_warnings: list[dict[str, Any]] = []
        self.count: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self._heal: Callable[[], Any] | None = None
        self._open: tuple[str, list[int], dict[str, Any]] | None = None
        self._strobe: asyncio.Task[None] | None = None
        self._strobe_file: Path | None = None

    # -- targets ------------------------------------------------------------
    def _pick(self, kind: str, default: list[str], k: int) -> str:
        """The k-th shape of ``kind``: round robin over the configured shapes."""
        chosen = self.shapes.get(kind) or default
        bad = [s for s in chosen if s not in default]
        if bad:
            raise ValueError(f"unknown {kind} shape(s) {bad} (known: {default})")
        return chosen[k % len(chosen)]

    def _shape_targets(self, shape: str, leader: int | None) -> list[int]:
        v = list(self.c.voters)
        n = len(v)
        if shape == "one":
            return [self.rng.choice(self.c.ids)]
        if shape == "leader":
            return [leader] if leader is not None else [self.rng.choice(v)]
        if shape == "minority":
            return sorted(self.rng.sample(v, (n - 1) // 2))
        if shape == "majority":
            return sorted(self.rng.sample(v, n // 2 + 1))
        if shape == "all":
            return v
        raise ValueError(shape)

    def _record(self, f: str, kind: str, targets: list[int], **extra: Any) -> None:
        if self.group is not None:
            extra["group"] = self.group
        self.w.nemesis(f, kind, targets, **extra)  # type: ignore[arg-type]

    # -- one fault ---------------------------------------------------------------
    async def start(self, kind: str, shape: str | None = None) -> None:
        """Start one fault; ``shape`` forces a shape (a schedule step), else round robin."""
        assert self._open is None
        leader = await self.c.leader()
        if leader is None and shape in _AIMS_AT_LEADER.get(kind, set()):
            leader = await self._await_leader(kind, shape)
        k = self.count.get(kind, 0)
        self.count[kind] = k + 1
        forced = shape
        if kind == "kill":
            shape = forced or self._pick(kind, ["leader", "majority", "one", "minority", "all"], k)
            targets = self._shape_targets(shape, leader)
            self._record("start", kind, targets, shape=shape)
            for t in targets:
                self.c.kill(t)
            info: dict[str, Any] = {"shape": shape}

            async def heal_kill() -> None:
                for t in targets:
                    self.c.start(t)

            self._heal = heal_kill
        elif kind == "pause":
            shape = forced or self._pick(kind, ["leader", "majority", "one", "minority"], k)
            targets = self._shape_targets(shape, leader)
            self._record("start", kind, targets, shape=shape)
            for t in targets:
                self.c.signal(t, signal.SIGSTOP)
            info = {"shape": shape}

            async def heal_pause() -> None:
                for t in targets:
                    self.c.signal(t, signal.SIGCONT)

            self._heal = heal_pause
        elif kind == "partition":
            shapes = ["isolate-leader", "halves", "bridge", "isolate-one"]
            if len(self.c.voters) >= 5:
                shapes.insert(2, "majorities-ring")
                shapes.append("leader-minority")
            shape = forced or self._pick(kind, shapes, k)
            grudge, targets = self._grudge(shape, leader)
            self._record(
                "start",
                kind,
                targets,
                shape=shape,
                grudge={str(a): sorted(b) for a, b in grudge.items() if b},
            )
            net.apply_grudge(grudge)
            info = {"shape": shape, "grudge": {a: sorted(b) for a, b in grudge.items()}}

            async def heal_partition() -> None:
                net.heal([*self.c.ids, *self.others])

            self._heal = heal_partition
        elif kind == "clock":
            mode = forced or self._pick(kind, ["skew", "strobe"], k)
            # A step hits the leader (its lease and timers matter most).
            if mode == "step" and leader is not None:
                targets = [leader]
            else:
                targets = [self.rng.choice(self.c.ids)]
            env = self._faketime_env(mode, targets[0])
            self._record("start", kind, targets, mode=mode, faketime=env.get("FAKETIME", ""))
            self.c.kill(targets[0])
            self.c.start(targets[0], extra_env=env)
            if mode == "strobe":
                self._strobe = asyncio.create_task(self._strobe_loop())
            elif mode == "step":
                self._strobe = asyncio.create_task(self._step_once())
            info = {"mode": mode, "env": {k2: v for k2, v in env.items() if k2 != "LD_PRELOAD"}}

            async def heal_clock() -> None:
                if self._strobe is not None:
                    self._strobe.cancel()
                    self._strobe = None
                self.c.kill(targets[0])
                self.c.start(targets[0])

            self._heal = heal_clock
        elif kind == "corrupt":
            targets = [self.rng.choice(await self._corruptible())]
            before = await self.c.statuses()
            max_term = max((int(s.get("term", 0)) for s in before.values()), default=0)
            self._record("start", kind, targets)
            self.c.kill(targets[0])
            damage = self.c.corrupt(targets[0], self.rng)
            self.corrupted.add(targets[0])
            self.c.start(targets[0])
            info = {"damage": damage, "max_term_before": max_term}

            async def heal_corrupt() -> None:
                await self._settle_corrupt(targets[0], max_term, info)

            self._heal = heal_corrupt
        elif kind == "power":
            shape = forced or self._pick(kind, list(POWER_SHAPES), k)
            base, torn = shape.removesuffix("-torn"), shape.endswith("-torn")
            targets = self._shape_targets(base, leader)
            self._record("start", kind, targets, shape=shape)
            dropped: dict[str, Any] = {}
            for t in targets:
                self.c.kill(t)
            for t in targets:
                dropped[str(t)] = self.c.power_loss(t, tear=torn, seed=self.rng.randrange(1 << 30))
            info = {"shape": shape, "torn": torn, "dropped": dropped}

            async def heal_power() -> None:
                for t in targets:
                    self.c.start(t)

            self._heal = heal_power
        elif kind == "disk":
            shape = forced or self._pick(kind, list(DISK_SHAPES), k)
            op, _, err = shape.partition("-")
            # The leader: the node whose acknowledgements matter most.
            targets = [leader if leader is not None else self.rng.choice(self.c.voters)]
            self._record("start", kind, targets, shape=shape)
            self.c.fs(targets[0], cmd="fail", op=op, errno=err.upper())
            info = {"shape": shape}

            async def heal_disk() -> None:
                await self._settle_disk(targets[0], info)

            self._heal = heal_disk
        else:
            raise ValueError(f"unknown nemesis kind {kind!r}")
        self._open = (kind, targets, info)
        where = f"{self.group}: " if self.group else ""
        self.log(f"nemesis start {where}{kind} {targets} {_brief(info)}")

    async def heal(self) -> None:
        if self._open is None:
            return
        kind, targets, info = self._open
        assert self._heal is not None
        await self._heal()
        self._heal = None
        self._open = None
        extra = {
            k: v
            for k, v in info.items()
            if k in ("rebuilt", "refused", "damage", "caught_up", "torn", "stopped", "exit_code")
        }
        self._record("stop", kind, targets, **extra)
        group = {} if self.group is None else {"group": self.group}
        self.events.append({"kind": kind, "targets": targets, **group, **info})
        where = f"{self.group}: " if self.group else ""
        self.log(f"nemesis stop  {where}{kind} {targets}")

    async def _await_leader(self, kind: str, shape: str | None, wait_s: float = 10.0) -> int | None:
        """A shape aimed at the leader right after a fault that left none
        (a kill of a majority, say) would hit a random node: wait for one."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            leader = await self.c.leader()
            if leader is not None:
                return leader
        self.log(f"no leader within {wait_s:.0f} s for {kind}:{shape or '*'}: a random target")
        return None

    # -- partitions --------------------------------------------------------------------
    def _grudge(self, shape: str, leader: int | None) -> tuple[dict[int, set[int]], list[int]]:
        ids = self.c.ids
        v = list(self.c.voters)
        if shape in ("isolate-leader", "isolate-one"):
            t = leader if shape == "isolate-leader" and leader is not None else self.rng.choice(v)
            return net.complete_grudge([[t]], [*ids, *self.others]), [t]
        if shape == "leader-minority":
            # The leader keeps a minority of followers (none with 3 voters)
            # and every learner: it can replicate to them but never commit;
            # the majority elects another leader.
            t = leader if leader is not None else self.rng.choice(v)
            rest = [x for x in v if x != t]
            learners = [x for x in ids if x not in v]
            side = [t, *self.rng.sample(rest, max(0, (len(v) - 1) // 2 - 1)), *learners]
            return net.complete_grudge([side], ids), sorted(side)
        if shape == "halves":
            shuffled = ids[:]
            self.rng.shuffle(shuffled)
            half = len(shuffled) // 2
            a, b = shuffled[:half], shuffled[half:]
            return net.complete_grudge([a, b], ids), sorted(a)
        if shape == "bridge":
            shuffled = v[:]
            self.rng.shuffle(shuffled)
            mid = len(shuffled) // 2
            bridge = shuffled[mid]
            a, b = shuffled[:mid], shuffled[mid + 1 :]
            grudge: dict[int, set[int]] = {i: set() for i in ids}
            for x in a:
                grudge[x] |= set(b)
            for y in b:
                grudge[y] |= set(a)
            return grudge, [bridge]
        if shape == "majorities-ring":
            ring = v[:]
            self.rng.shuffle(ring)
            n = len(ring)
            grudge = {i: set() for i in ids}
            for k, x in enumerate(ring):
                near = {ring[(k - 1) % n], ring[(k + 1) % n], x}
                grudge[x] = set(v) - near
            return grudge, ring
        raise ValueError(shape)

    # -- clocks ---------------------------------------------------------------------------
    def _faketime_env(self, mode: str, node: int) -> dict[str, str]:
        assert self.libfaketime is not None
        env = {"LD_PRELOAD": self.libfaketime}
        if mode == "skew":
            secs = self.rng.choice([-1, 1]) * self.rng.randint(5, 120)
            env["FAKETIME"] = f"{secs:+d}s"
            return env
        # strobe and step: the wall clock follows a file the nemesis rewrites.
        path = self.c.root / f"faketime-{node}.txt"
        set_faked_offset(path, "+0s")
        self._strobe_file = path
        env.update(
            FAKETIME_TIMESTAMP_FILE=str(path),
            FAKETIME_CACHE_DURATION="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        return env

    async def _step_once(self) -> None:
        """One step of the wall clock, once the restarted node is running."""
        assert self._strobe_file is not None
        await asyncio.sleep(1.5)
        step = self.rng.choice([-1, 1]) * self.rng.randint(30, 300)
        set_faked_offset(self._strobe_file, f"{step:+d}s")
        self.log(f"clock step {step:+d} s on the wall clock")

    async def _strobe_loop(self) -> None:
        assert self._strobe_file is not None
        offsets = ["+0s", f"+{self.rng.randint(30, 300)}s", f"-{self.rng.randint(30, 300)}s"]
        k = 0
        while True:
            await asyncio.sleep(0.5)
            k += 1
            set_faked_offset(self._strobe_file, offsets[k % len(offsets)])

    # -- disk errors -----------------------------------------------------------------------
    async def _settle_disk(self, node: int, info: dict[str, Any]) -> None:
        """Heal the disk; the node must have stopped on its own (exit 3,
        DISK_FAILED) if it tried to write: restart it."""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and self.c.alive(node):
            await asyncio.sleep(0.2)  # a write in flight when the window closes
        self.c.fs(node, cmd="heal")
        m = self.c.members[node]
        rc = m.proc.poll() if m.proc is not None else None
        info["stopped"] = rc is not None
        info["exit_code"] = rc
        if rc is None:
            self.log(f"node {node} kept running through its disk errors (it wrote nothing?)")
            return
        m.expected_exit = True
        tail = self.c.log_tail(node, 30)
        said = [x for x in tail.splitlines() if "DISK_FAILED" in x]
        info["said"] = said[-1][said[-1].find("DISK_FAILED") :][:600] if said else tail[-400:]
        if rc != 3 or not said:
            self.disk_warnings.append(
                {
                    "node": node,
                    "warning": f"a node whose disk failed exited with code {rc}"
                    + ("" if said else " without saying DISK_FAILED")
                    + " (expected 3, DISK_FAILED)",
                    "log_tail": tail,
                }
            )
        self.log(f"node {node} stopped on its disk errors (exit {rc}); restarting it")
        self.c.start(node)

    # -- corruption ---------------------------------------------------------------------------
    async def _corruptible(self) -> list[int]:
        """The voters the corrupt nemesis may damage: any, except in a
        controller-mode group the only member of the master's SyncStateSet
        (right after the group comes back from a power loss, the new master
        is alone in it until its slaves catch up, about a second). The
        controller elects only from that set, so damaging its only member
        destroys the one copy it may elect: two faults (a group-wide power
        loss, then rot in the survivor the controller trusts) that a CP group
        survives only by an unclean election, which it refuses by design."""
        if self.c.node_settings.get("replication") != "controller":
            return list(self.c.voters)
        st = await self.c.statuses()
        for s in st.values():
            if s.get("cmode_role") == "master":
                sss = [int(x) for x in s.get("sync_state_set", [])]
                if len(sss) == 1:
                    others = [v for v in self.c.voters if v not in sss]
                    if others:
                        return others
        return list(self.c.voters)

    async def _settle_corrupt(self, node: int, max_term: int, info: dict[str, Any]) -> None:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and self.c.alive(node):
            await asyncio.sleep(0.2)
        if self.c.alive(node):
            info["refused"] = False
            return
        proc = self.c.members[node].proc
        rc = proc.poll() if proc is not None else None
        info["refused"] = True
        info["exit_code"] = rc
        self.c.members[node].expected_exit = True
        self.log(f"node {node} refused its damaged data (exit {rc}); rebuilding it from its peers")
        await self.rebuild(node, max_term, info)

    async def rebuild(self, node: int, max_term: int, info: dict[str, Any]) -> None:
        """Wipe ``node`` and restart it empty once safe (see :func:`rebuild_replica`
        and, for a controller-mode group, :func:`rebuild_cmode_replica`)."""
        if self.c.node_settings.get("replication") == "controller":
            await rebuild_cmode_replica(self.c, node, info, self.log)
        else:
            await rebuild_replica(self.c, node, max_term, info, self.rng, self.log)
        if info.get("rebuilt"):
            self.corrupted.discard(node)


async def rebuild_replica(
    c: Cluster,
    node: int,
    max_term: int,
    info: dict[str, Any],
    rng: random.Random,
    log: Callable[[str], None],
) -> None:
    """Wipe ``node`` (stopped, a minority of one: damaged, or diverged after a
    power loss in async mode) and restart it empty, once
    safe; return once it holds the log again (or after a bounded wait), so
    the fault's window covers the whole rebuild."""
    others = [v for v in c.voters if v != node]
    # Everything committed before the kill is at or below every commit
    # index reported now; entries committed later never counted the
    # damaged node, and a majority of the others holds them.
    floor: int | None = None
    # A leader elected while the node is down, after it stopped: its term
    # is above every term the node saw (so it cannot vote twice in one),
    # and it never heard the node acknowledge anything. A leader that did
    # (elected before the kill) keeps the node's old match index; the
    # core never probes below it, so an emptied node would be sent
    # entries after its old match, refuse each one, and stay empty until
    # the next leader change (see docs/design.md, "Rebuilding a replica").
    fresh_term: int | None = None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        st = await c.statuses()
        if floor is None and st:
            floor = max(int(s.get("commit", 0)) for s in st.values())
        lead = next((i for i, s in st.items() if s.get("role") == "leader"), None)
        if lead is None or floor is None:
            await asyncio.sleep(0.3)
            continue
        term = int(st[lead].get("term", 0))
        if fresh_term is None:
            fresh_term = max([max_term, *(int(s.get("term", 0)) for s in st.values())])
        if term <= fresh_term:
            to = rng.choice([o for o in others if o != lead])
            await c.transfer_leadership(lead, to)
            await asyncio.sleep(0.5)
            continue
        if all(o in st and int(st[o].get("commit", 0)) >= floor for o in others):
            info["rebuild_commit_floor"] = floor
            info["rebuild_term"] = term
            break
        await asyncio.sleep(0.3)
    else:
        info["rebuilt"] = False
        log(f"node {node}: could not make a rebuild safe in 60 s; leaving it down")
        return
    await _wipe_and_catch_up(c, node, floor or 0, info, log)


async def _wipe_and_catch_up(
    c: Cluster, node: int, floor: int, info: dict[str, Any], log: Callable[[str], None]
) -> None:
    """Wipe ``node``, start it empty, and wait until it applied ``floor``.
    The heal ends when the rebuilt replica holds everything committed
    before the damage: its catch-up (the leader reads and sends it the
    whole log) is part of this fault, not of the quiet time after it."""
    c.wipe(node)
    c.start(node)
    info["rebuilt"] = True
    t0 = time.monotonic()
    caught_up = False
    while time.monotonic() - t0 < 30 and c.alive(node):
        s = await c.status(node)
        if s is not None and int(s.get("applied", 0)) >= floor:
            caught_up = True
            break
        await asyncio.sleep(0.2)
    info["caught_up"] = caught_up
    info["catch_up_s"] = round(time.monotonic() - t0, 2)
    if not caught_up:
        log(f"node {node}: rebuilt, but not caught up after {info['catch_up_s']} s")


async def rebuild_cmode_replica(
    c: Cluster, node: int, info: dict[str, Any], log: Callable[[str], None]
) -> None:
    """Wipe ``node`` of a controller-mode group (stopped, damaged) and
    restart it empty once safe; return once it holds what the group had
    confirmed before (or after a bounded wait).

    There are no votes to cast twice here; what could lose data is an empty
    replica the controller still counts in the SyncStateSet, since an
    election takes any alive member of that set. So the wipe waits until a
    master that is not ``node`` runs and its SyncStateSet (which it adopts
    only once the controller has recorded it) no longer names ``node``: the
    master shrank it while the node was down, or the controller elected a
    master without it. The empty replica then joins as a slave from offset
    0 (no common epoch, and the master's log starts at 0) and rejoins the
    set once caught up, by the ordinary expansion."""
    floor: int | None = None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        st = await c.statuses()
        master = next((i for i, s in st.items() if s.get("cmode_role") == "master"), None)
        if master is None or master == node:
            await asyncio.sleep(0.3)
            continue
        sss = [int(x) for x in st[master].get("sync_state_set", [])]
        if node in sss:
            await asyncio.sleep(0.3)
            continue
        floor = int(st[master].get("confirm", 0))
        info["rebuild_commit_floor"] = floor
        info["rebuild_master"] = master
        info["rebuild_sync_state_set"] = sss
        break
    else:
        info["rebuilt"] = False
        log(f"node {node}: no master without it in its SyncStateSet in 60 s; leaving it down")
        return
    await _wipe_and_catch_up(c, node, floor, info, log)


def _brief(info: dict[str, Any]) -> str:
    keep = {k: v for k, v in info.items() if k in ("shape", "mode", "damage")}
    if "damage" in keep and isinstance(keep["damage"], dict):
        keep["damage"] = keep["damage"].get("mode")
    return " ".join(f"{k}={v}" for k, v in keep.items())
