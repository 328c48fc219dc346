"""Deterministic whole-cluster simulation of real nodes, with an invariant checker.

Theory of operation
-------------------
Each simulated node is a real :class:`dledger.node.Node` (the production
driver: tick catch-up, group commit, apply batching, snapshot tasks and
streaming, transfers, lease reads) on a :class:`~dledger.sim.world.Host`:
its own virtual-time event loop, drifting clock, crashing
:class:`~dledger.sim.world.SimStorage` and a :class:`~dledger.sim.world.SimTransport`
carrying the real codec's bytes over a seeded network that drops, duplicates,
delays, reorders and partitions (see :mod:`dledger.sim.world`).

The scheduler owns global time and one event heap (message deliveries,
client arrivals, faults, heals, restarts). Each step it either dispatches the
earliest event or runs one ``_run_once`` of the host whose next callback or
timer is due first (ties: lowest id), whichever is earlier. Clients are
coroutines on the hosts (like HTTP handlers) calling ``submit``,
``read("linearizable")``, ``read("committed")``, ``transfer_leadership`` and
``add_learner``/``promote``/``remove``.

Checked after every step: election safety, log matching (on every storage
append), leader completeness, state-machine safety (a digest per applied
index, snapshots included), commit monotonicity, commit durable on a quorum
(and no node lacking it able to win an election), lease exclusivity in
global time (no lease read after the lease ran out on the node's own clock,
nor once a higher term has a leader), and reads by value: a linearizable
read returns the value of the latest write acknowledged before it started,
or of a later one; a read index never lies below what was committed before
the read began. After the faulty phase everything heals (optionally leaving
one voter down), and the cluster must elect a leader and converge (liveness);
then every acknowledged write must be in the agreed applied log.

``flush="async"`` (profile ``power-loss``) promises less, and is checked
for exactly that: a crash loses what was not flushed (every crash here is a
power loss), so acknowledged writes may be lost, a majority may come back
with a shorter log than a survivor's commit index, and a new leader may
commit other entries at those indexes. What must still hold: every entry a
node applies was committed by a leader holding exactly that entry (a
follower never applies a tail nobody committed); a replica that finds the
leader's history differing below its own commit index stops
(``ReplicaDiverged``) and is rebuilt empty, keeping its term and vote; and
after healing all members converge on one applied history (equal digests).
Elections stay safe because a term or vote is fsynced at once in both modes.

A violation raises :class:`SimViolation` with the seed, the command that
reproduces it and the trace tail. Two runs of one seed have the same trace
hash (the determinism check).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import logging
import random
import struct
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from dledger.config import MemberSpec, NodeConfig
from dledger.core.codec import decode_message
from dledger.core.raft import CORE_FAULTS, RawNode
from dledger.core.types import (
    NONE,
    ClusterConfig,
    Entry,
    EntryType,
    MsgType,
    RaftConfig,
    ReadMode,
    Role,
)
from dledger.errors import DLedgerError, ReplicaDiverged
from dledger.node import NODE_FAULTS, Node
from dledger.runtime import NodeEnv, NodeStorage
from dledger.sim.world import Host, HostCrashed, SimStorage
from dledger.snapshot_stream import is_stream_frame

FAULT_NO_FSYNC = "no_fsync"  # sim-level: acknowledge without syncing (SCENARIOS 11)
ALL_FAULTS = CORE_FAULTS | NODE_FAULTS | {FAULT_NO_FSYNC}

_LOGGERS = ("dledger", "asyncio")


class SimViolation(AssertionError):
    def __init__(self, seed: int, what: str, trace_tail: list[str], argv: str) -> None:
        self.seed = seed
        self.what = what
        self.trace_tail = trace_tail
        tail = "\n".join("    " + t for t in trace_tail)
        super().__init__(
            f"invariant violated: {what}\nreproduce with: python -m dledger.sim {argv}\n"
            f"trace tail:\n{tail}"
        )


@dataclass(frozen=True)
class SimConfig:
    voters: int = 3
    learners: int = 0
    steps: int = 5000
    tick_ms: int = 10
    election_ticks: int = 10
    heartbeat_ticks: int = 1
    idle_heartbeat_ticks: int = 6  # an idle leader's round interval (0: off)
    lease_drift_ticks: int = 2
    drift: float = 0.02  # max relative clock-rate error per node
    drop_rate: float = 0.02
    dup_rate: float = 0.02
    max_delay_s: float = 0.004  # random delays reorder messages
    long_delay_rate: float = 0.01
    long_delay_s: float = 0.3
    crash_rate: float = 0.0015  # per step
    partition_rate: float = 0.0015
    pause_rate: float = 0.0008
    client_per_s: float = 400.0  # client arrivals per virtual second (faulty phase)
    quiet_client_per_s: float = 100.0
    membership: bool = True
    transfers: bool = True  # clients ask for leadership transfers
    min_voters: int = 1
    max_voters: int = 5
    check_quorum: bool = True  # off: no stickiness, no lease (ReadIndex only)
    pre_vote: bool = True
    log_cache_entries_max: int = 65536
    log_cache_bytes_max: int = 64 << 20
    stale_leader_reads: float = 0.0  # share of client ops sent to any self-believed leader
    crash_after_vote_rate: float = 0.0  # kill a node right after it granted a vote
    crash_after_elected_rate: float = 0.0  # kill a new leader before its no-op spreads
    max_inflight_msgs: int = 8
    max_msg_bytes: int = 256
    faults: frozenset[str] = field(default_factory=frozenset)
    min_steps: int = 0  # a profile's floor for the faulty phase (scheduler steps)
    quiet_s: float = 0.5  # after the faulty phase: heal, restart, then check liveness
    liveness_s: float = 6.0
    liveness_max_steps: int = 200_000  # a cluster churning without converging fails sooner
    check_liveness: bool = True
    keep_down_rate: float = 0.3  # quiet phase: leave one voter down (a minority)
    mixed: bool = False  # built by mixed_config(seed): reproduce with the seed alone
    profile: str = "mixed"
    snapshot_every_entries: int = 30
    snapshot_trailing_entries: int = 5  # log entries kept behind a snapshot
    snapshot_retry_ticks: int = 5
    sm_pad_bytes: int = 2500  # state-machine snapshot size: streams take several chunks
    # CPU cost (virtual seconds) the node's work() hook charges, and faults in it
    step_cost_s: float = 20e-6
    op_cost_s: float = 10e-6
    persist_cost_s: float = 5e-6
    apply_cost_s: float = 5e-6
    stall_rate: float = 0.002  # per unit of work: the loop stalls mid-pass
    stall_min_s: float = 0.002
    stall_kinds: tuple[str, ...] = ("step", "op", "persist", "apply")
    read_burst: int = 1  # linearizable reads a client issues at once
    write_share: float = 0.55  # of client ops (the rest: reads, transfers, membership)
    partition_shapes: tuple[str, ...] = ("isolate", "leader", "halves", "bridge", "ring", "oneway")
    stall_max_s: float = 0.25
    mid_pass_crash_rate: float = 0.00005
    sync_min_s: float = 0.0002
    sync_max_s: float = 0.002
    slow_sync_rate: float = 0.01
    slow_sync_s: float = 0.04
    slow_replay_rate: float = 0.3  # restarts that apply one entry per Ready, slowly
    slow_apply_cost_s: float = 0.003
    flush: str = "sync"  # "async": fsync once per flush interval (may lose acked writes)
    power_loss_rate: float = 0.0  # per step: a majority (or all) lose power at once
    scenario: str = ""  # a scripted nemesis (profiles for specific bugs)


@dataclass(frozen=True, slots=True)
class SimNodeConfig(NodeConfig):
    """NodeConfig plus the core settings the simulator varies; its bootstrap
    membership is explicit (the address book lists spare ids for later adds)."""

    sim_voters: tuple[int, ...] = ()
    sim_learners: tuple[int, ...] = ()
    check_quorum: bool = True
    pre_vote: bool = True
    log_cache_entries_max: int = 65536
    log_cache_bytes_max: int = 64 << 20
    snapshot_retry_ticks: int = 5
    clock_drift_max: float = 0.01

    def raft_config(self) -> RaftConfig:
        return dataclasses.replace(
            NodeConfig.raft_config(self),
            peers=ClusterConfig(self.sim_voters, self.sim_learners),
            check_quorum=self.check_quorum,
            pre_vote=self.pre_vote,
            log_cache_entries_max=self.log_cache_entries_max,
            log_cache_bytes_max=self.log_cache_bytes_max,
            snapshot_retry_ticks=self.snapshot_retry_ticks,
            clock_drift_max=self.clock_drift_max,
        )


@dataclass(slots=True)
class _Ack:
    time: float
    index: int
    term: int
    crc: int


class Simulation:
    def __init__(self, seed: int, cfg: SimConfig) -> None:
        self.seed = seed
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.net_rng = random.Random(seed ^ 0x7E7)
        self.fault_rng = random.Random(seed ^ 0xFA17)
        self.now = 0.0
        self._seq = 0
        self._events: list[tuple[float, int, str, Any]] = []
        self._hash = hashlib.blake2b(digest_size=16)
        self._tail: deque[str] = deque(maxlen=80)
        voters = tuple(range(1, cfg.voters + 1))
        learners = tuple(range(cfg.voters + 1, cfg.voters + cfg.learners + 1))
        self.bootstrap = ClusterConfig(voters, learners)
        self.next_id = cfg.voters + cfg.learners + 1
        self.max_id = cfg.voters + cfg.learners + 12
        self.book = tuple(
            MemberSpec(i, "sim", 10000 + i, "sim", 20000 + i) for i in range(1, self.max_id + 1)
        )
        self.storages: dict[int, SimStorage] = {}
        self.hosts: dict[int, Host] = {}  # live (not crashed) processes
        self.rate: dict[int, float] = {}
        self.blocked: set[tuple[int, int]] = set()
        self.removed: set[int] = set()
        self.keep_down: set[int] = set()  # never restarted (scenarios)
        self.clients_paused = False  # scenarios: no new client operations
        self.muted: set[tuple[int, int, int]] = set()  # (sender, incarnation, to) lost in flight
        self.reset: set[tuple[int, int]] = set()  # (node, incarnation): connections reset
        self.incarnation: dict[int, int] = {}
        self.violation: SimViolation | None = None
        # checker state
        self.leader_of_term: dict[int, int] = {}
        self.elections: list[tuple[float, int, int]] = []  # (global time, term, node)
        self.entry_record: dict[tuple[int, int], tuple[int, int]] = {}
        self.applied_record: dict[int, tuple[int, int]] = {}  # index -> (term, crc)
        self.writes: dict[int, bytes] = {}  # index -> value, NORMAL entries applied
        self.digest_at: dict[int, bytes] = {}
        self.leader_commits: dict[int, int] = {}
        self.max_commit = 0
        self.max_commit_entry_term = 0
        self.max_commit_seen_term = 0
        self.commit_times: list[tuple[float, int]] = []  # (global time, max commit)
        self.acks: list[_Ack] = []
        # async mode: (index, term) -> CRC of every entry a leader committed,
        # and applies waiting to be checked against it after their pass.
        self.committed_by_leader: dict[tuple[int, int], int] = {}
        self._pending_applies: list[tuple[int, int, int, int]] = []
        self._wseq = 0
        self.faulty = True
        self.read_only_phase = False
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "proposals",
                "acked",
                "reads_ok",
                "lease_reads",
                "reads_failed",
                "committed_reads",
                "crashes",
                "idle_rounds",
                "holds",  # sleeps an idle leader took with its peers' answers held
                "restarts",
                "slow_replays",
                "partitions",
                "pauses",
                "stalls",
                "transfers",
                "transfers_ok",
                "conf_changes",
                "conf_ok",
                "elections",
                "msgs",
                "passes",
                "snapshots_taken",
                "snapshots_installed",
                "min_voters",
                "power_losses",
                "rebuilt",
                "acked_lost",
            ),
            0,
        )
        self.stats["min_voters"] = cfg.voters
        self.steps = 0
        self.script: Callable[[], None] | None = None
        for nid in self.bootstrap.members():
            self._spawn(nid)
        self._at(0.01, "client", None)
        if cfg.scenario:
            from dledger.sim.scenarios import SCENARIOS

            self.script = SCENARIOS[cfg.scenario](self)

    # ------------------------------------------------------------------ setup
    def argv(self) -> str:
        c = self.cfg
        parts = [f"--seed {self.seed}", f"--steps {c.steps}"]
        if not c.mixed:
            parts.append(f"--voters {c.voters}")
        if c.learners and not c.mixed:
            parts.append(f"--learners {c.learners}")
        if c.faults:
            parts.append("--fault " + " --fault ".join(sorted(c.faults)))
        if c.mixed and c.profile != "mixed":
            parts.append(f"--profile {c.profile}")
        if not c.membership:
            parts.append("--no-membership")
        if not c.check_quorum and not c.mixed:
            parts.append("--no-check-quorum")
        if c.flush != "sync":
            parts.append(f"--flush {c.flush}")
        return " ".join(parts)

    def node_config(self, nid: int, max_apply_bytes: int) -> SimNodeConfig:
        c = self.cfg
        return SimNodeConfig(
            node_id=nid,
            cluster_id="sim",
            raft_host="sim",
            raft_port=10000 + nid,
            http_host="sim",
            http_port=20000 + nid,
            data_dir=f"/sim/{nid}",
            members=self.book,
            tick_ms=c.tick_ms,
            election_ticks=c.election_ticks,
            heartbeat_ticks=c.heartbeat_ticks,
            idle_heartbeat_ticks=c.idle_heartbeat_ticks,
            lease_drift_ticks=c.lease_drift_ticks,
            flush="async" if c.flush == "async" else "sync",
            flush_interval_ms=100,
            max_inflight_msgs=c.max_inflight_msgs,
            max_msg_bytes=c.max_msg_bytes,
            max_apply_bytes=max_apply_bytes,
            snapshot_every_entries=c.snapshot_every_entries,
            snapshot_trailing_entries=c.snapshot_trailing_entries,
            snapshot_chunk_bytes=1024,
            snapshot_window_chunks=2,
            snapshot_stream_timeout_ms=400,
            transfer_max_lag=64,
            faults=c.faults & (CORE_FAULTS | NODE_FAULTS),
            sim_voters=self.bootstrap.voters,
            sim_learners=self.bootstrap.learners,
            check_quorum=c.check_quorum,
            pre_vote=c.pre_vote,
            log_cache_entries_max=c.log_cache_entries_max,
            log_cache_bytes_max=c.log_cache_bytes_max,
            snapshot_retry_ticks=c.snapshot_retry_ticks,
            clock_drift_max=c.drift,
        )

    def _spawn(self, nid: int, slow: bool | None = None) -> Host:
        c = self.cfg
        st = self.storages.get(nid)
        if st is None:
            st = self.storages[nid] = SimStorage(
                nid,
                self,
                flush=c.flush,
                flush_interval_s=0.1,
                no_fsync=FAULT_NO_FSYNC in c.faults,
            )
        if nid not in self.rate:
            self.rate[nid] = 1 + self.rng.uniform(-c.drift, c.drift)
        offset = self.rng.uniform(0, 1000)
        host = Host(self, nid, st, self.rate[nid], offset)
        if slow is None:
            slow = self.incarnation.get(nid, 0) > 0 and self.rng.random() < c.slow_replay_rate
        max_apply = 8 << 20
        if slow:
            # Restart replays one entry per Ready, each costly: ticks run
            # between Readies long before the replay reaches the end.
            max_apply = 1
            host.apply_cost_s = c.slow_apply_cost_s
            host.slow_until = st.hard_state().commit
            self.stats["slow_replays"] += 1
        env = NodeEnv(
            clock=host.local_now,
            offload=host.offload,
            submit=host.submit,
            rng=host.rng,
            open_storage=host.open_storage,
            make_transport=host.make_transport,
            work=host.work,
            inline_sync_bytes=0,  # every sync through offload: its delays are the model
        )
        node = Node(self.node_config(nid, max_apply), host.sm, env)
        host.node = node
        self.hosts[nid] = host
        self.incarnation[nid] = self.incarnation.get(nid, 0) + 1
        host.loop.set_exception_handler(self._loop_error)
        host.loop.create_task(self._start(host))
        self.trace(f"spawn n{nid}{' slow-replay' if slow else ''}")
        return host

    async def _start(self, host: Host) -> None:
        node: Node = host.node
        await node.start()
        r = node._raft
        assert r is not None
        orig = r.read_index

        def read_index(ctx: int) -> None:
            orig(ctx)
            self._check_lease_read(host, r, ctx)

        r.read_index = read_index  # type: ignore[method-assign]
        orig_lease = r.lease_read_index

        def lease_read_index(behind: int = 0) -> int | None:
            index = orig_lease(behind)
            if index is not None:  # answered by the lease without a loop turn
                self._check_lease_read_at(host, r)
            return index

        r.lease_read_index = lease_read_index  # type: ignore[method-assign]
        host.commit_seen = r.log.committed
        if self.cfg.flush == "async":
            # Recorded the moment the leader commits: it may step down (or
            # crash) later in the same pass, before the pass is checked.
            orig_commit = r._maybe_commit

            def maybe_commit() -> bool:
                before = r.log.committed
                moved = orig_commit()
                if moved:
                    self._record_leader_commit(r, before, r.log.committed)
                return moved

            r._maybe_commit = maybe_commit  # type: ignore[method-assign]

    def _loop_error(self, loop: Any, ctx: dict[str, Any]) -> None:
        exc = ctx.get("exception")
        if isinstance(exc, SimViolation):
            self.violation = self.violation or exc
            return
        if isinstance(exc, HostCrashed):
            return
        msg = ctx.get("message", "")
        self._record_violation(f"unhandled error in a node task: {msg}: {exc!r}")

    # ------------------------------------------------------------------ events
    def _at(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def trace(self, s: str) -> None:
        line = f"t={self.now:.6f} {s}"
        self._tail.append(line)
        self._hash.update(line.encode())

    def trace_hash(self) -> str:
        return self._hash.hexdigest()

    def _record_violation(self, what: str) -> SimViolation:
        if self.violation is None:
            self.violation = SimViolation(self.seed, what, list(self._tail), self.argv())
        return self.violation

    def fail(self, what: str) -> None:
        raise self._record_violation(what)

    def run(self) -> Simulation:
        level = {n: logging.getLogger(n).level for n in _LOGGERS}
        for n in _LOGGERS:
            logging.getLogger(n).setLevel(logging.CRITICAL + 1)
        try:
            self._run()
        finally:
            for n, lv in level.items():
                logging.getLogger(n).setLevel(lv)
            for h in list(self.hosts.values()):
                self._count_idle_rounds(h)
                h.loop.discard()
        return self

    def _count_idle_rounds(self, h: Host) -> None:
        r = getattr(h.node, "_raft", None)
        if r is not None:
            self.stats["idle_rounds"] += r.idle_rounds
        if h.transport is not None:
            self.stats["holds"] += h.transport.counters["holds"]

    def _run(self) -> None:
        c = self.cfg
        while self.steps < max(c.steps, c.min_steps):
            if self.script is not None:
                self.script()
            else:
                self._maybe_inject()
            self._step()
        self.faulty = False
        self._heal_all()
        quiet_until = self.now + c.quiet_s
        while self.now < quiet_until:
            self._step()
        if c.check_liveness:
            self._check_liveness()
        self._check_final()

    def _step(self) -> None:
        best_t = float("inf")
        best: Host | None = None
        for nid in sorted(self.hosts):
            h = self.hosts[nid]
            t = h.next_due()
            if t < best_t:
                best_t, best = t, h
        self.steps += 1
        if self._events and self._events[0][0] <= best_t:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = max(self.now, t)
            self._dispatch(kind, payload)
        elif best is not None:
            self._run_host(best, max(self.now, best_t))
        else:
            self.fail("deadlock: nothing to run and no event pending")
        if self.violation is not None:
            raise self.violation

    def _run_host(self, host: Host, start: float) -> None:
        self.now = start
        host.running_at = start
        host.consumed = 0.0
        crashed = False
        self._hash.update(struct.pack(">Hd", host.nid, start))
        self.stats["passes"] += 1
        r0 = host.node._raft
        voters_before = r0.config.voters if r0 is not None else ()
        try:
            host.loop.run_pass()
        except HostCrashed:
            crashed = True
        finally:
            host.busy_until = start + host.consumed
            host.running_at = None
        if self.violation is not None:
            raise self.violation
        if crashed:
            self._crash(host.nid, "crash mid-pass")
            return
        node: Node = host.node
        if node.fatal is not None:
            if isinstance(node.fatal, SimViolation):
                raise node.fatal
            if isinstance(node.fatal, ReplicaDiverged) and self.cfg.flush == "async":
                self._rebuild(host.nid)
                return
            self.fail(f"node {host.nid} stopped on {type(node.fatal).__name__}: {node.fatal}")
        self._check_host(host, host.busy_until, voters_before)

    def _dispatch(self, kind: str, payload: Any) -> None:
        if kind == "msg":
            frm, to, data, inc = payload
            if (
                (frm, to) in self.blocked
                or (frm, inc, to) in self.muted
                or (frm, inc) in self.reset
            ):
                return
            h = self.hosts.get(to)
            if h is None or to in self.removed:
                return
            if self.cfg.flush == "async" and not is_stream_frame(data):
                self._check_ack(frm, inc, h, data)
            self._hash.update(struct.pack(">HHI", frm, to, zlib.crc32(data)))
            h.deliver(frm, data)
        elif kind == "restart":
            nid = payload
            if nid not in self.hosts and nid not in self.removed and nid not in self.keep_down:
                self.stats["restarts"] += 1
                self._spawn(nid)
        elif kind == "heal":
            self.blocked.clear()
            self.trace("heal")
        elif kind == "resume":
            h = self.hosts.get(payload)
            if h is not None and h.paused:
                h.paused = False
                self.trace(f"resume n{h.nid}")
        elif kind == "client":
            rate = self.cfg.client_per_s if self.faulty else self.cfg.quiet_client_per_s
            self._at(self.now + self.rng.expovariate(rate), "client", None)
            self._client_op()
        elif kind == "call":
            payload()

    def _check_ack(self, frm: int, inc: int, leader: Host, data: bytes) -> None:
        """An acknowledgement reaching the leader of its term names an entry
        the sender holds, the leader's own: within one term only that leader
        appends to it, so nothing can have replaced it since (unless the
        sender lost power after sending: another incarnation). Checked in
        async mode, where acknowledging a commit index unchecked after a
        power loss made leaders count entries replicas did not hold."""
        m = decode_message(data)
        if m.type is not MsgType.APP_RESP or m.reject:
            return
        lr = leader.node._raft
        sender = self.hosts.get(frm)
        if (
            lr is None
            or lr.role is not Role.LEADER
            or lr.term != m.term
            or sender is None
            or self.incarnation.get(frm) != inc
            or sender.node._raft is None
            or sender.node._raft.term != m.term
            or m.index > lr.log.last_index()
        ):
            return
        want = lr._safe_term(m.index)
        fr = sender.node._raft
        if want == 0 or m.index < fr.log.first_index():
            return  # compacted on either side
        if not fr.log.match_term(m.index, want):
            self.fail(
                f"node {frm} acknowledged {m.index} to leader {leader.nid} (term {m.term}), "
                f"which holds {m.index}@t{want} there, but node {frm} holds "
                f"{m.index}@t{fr._safe_term(m.index)}"
            )

    # ------------------------------------------------------------------ network
    def net_send(self, frm: int, to: int, payload: bytes, t: float) -> None:
        self.stats["msgs"] += 1
        c = self.cfg
        rng = self.net_rng
        if (frm, to) in self.blocked or to in self.removed:
            return
        if rng.random() < c.drop_rate:
            return
        copies = 2 if rng.random() < c.dup_rate else 1
        inc = self.incarnation[frm]
        for _ in range(copies):
            delay = 2e-5 + rng.random() * c.max_delay_s
            if rng.random() < c.long_delay_rate:
                delay += rng.random() * c.long_delay_s  # stale on arrival
            self._at(t + delay, "msg", (frm, to, payload, inc))
        if c.crash_after_vote_rate and self.faulty and not is_stream_frame(payload):
            m = decode_message(payload)
            if (
                m.type is MsgType.VOTE_RESP
                and not m.reject
                and self.fault_rng.random() < c.crash_after_vote_rate
            ):
                # It voted (durably, unless a bug skipped that), then died.
                self._at(t, "call", lambda: self._crash(frm, "crash-after-vote", 0.002))

    # ------------------------------------------------------------------ checks
    def check_append(self, nid: int, st: NodeStorage, entries: Sequence[Entry]) -> None:
        """Log matching: one (index, term) names one entry with one predecessor."""
        first = entries[0].index
        try:
            prev_term = st.term(first - 1) if first > 1 else 0
        except (DLedgerError, IndexError):
            prev_term = -1
        for e in entries:
            key = (e.index, e.term)
            val = (zlib.crc32(e.data) ^ (e.pos << 1), prev_term)
            old = self.entry_record.get(key)
            if old is None:
                self.entry_record[key] = val
            elif old != val and -1 not in (old[1], prev_term):
                self.fail(
                    f"log matching: node {nid} holds {e.index}@t{e.term} with different "
                    "content or predecessor than another node"
                )
            prev_term = e.term

    def on_apply(self, host: Host, e: Entry, digest: bytes) -> None:
        if self.cfg.flush == "async":
            # Histories may fork after a power loss of a majority (the lost
            # tail is rewritten): checked against what leaders committed,
            # once the pass is over.
            self._pending_applies.append((host.nid, e.index, e.term, zlib.crc32(e.data)))
            return
        if self.digest_at.setdefault(e.index, digest) != digest:
            self.fail(
                f"state machine safety: node {host.nid}'s applied prefix up to {e.index} "
                "differs from another node's"
            )
        crc = zlib.crc32(e.data)
        rec = self.applied_record.get(e.index)
        if rec is None:
            self.applied_record[e.index] = (e.term, crc)
            if e.type is EntryType.NORMAL:
                self.writes[e.index] = e.data
        elif rec != (e.term, crc):
            self.fail(
                f"state machine safety: node {host.nid} applied {e.index}@t{e.term} but "
                f"another node applied {e.index}@t{rec[0]}"
            )

    def on_restore(self, host: Host, index: int, digest: bytes) -> None:
        if index <= host.sm.index and host.sm.index > 0:
            self.fail(
                f"node {host.nid} restores a snapshot at {index} but its state machine "
                f"already applied {host.sm.index} (a stale snapshot is never installed)"
            )
        if (
            index
            and self.cfg.flush != "async"
            and self.digest_at.setdefault(index, digest) != digest
        ):
            self.fail(
                f"state machine safety: node {host.nid} restored a snapshot at {index} whose "
                "applied-prefix digest differs from what other nodes applied there"
            )
        if host.node is not None and host.node.running:
            self.stats["snapshots_installed"] += 1
            self.trace(f"n{host.nid} installs snapshot {index}")

    def _check_host(self, host: Host, t: float, voters_before: tuple[int, ...]) -> None:
        node: Node = host.node
        r = node._raft
        if r is None:
            return
        nid = host.nid
        if r.role is Role.LEADER:
            other = self.leader_of_term.setdefault(r.term, nid)
            if other != nid:
                self.fail(f"election safety: nodes {other} and {nid} both lead term {r.term}")
            if r.term != host.leader_term:
                host.leader_term = r.term
                self._on_elected(host, r, t)
        c = r.log.committed
        if c < host.commit_seen:
            self.fail(f"commit index of node {nid} went back from {host.commit_seen} to {c}")
        if c > host.commit_seen:
            host.commit_seen = c
            term = r.log.term(c)
            if r.role is Role.LEADER:
                # Counted under the configuration before or after this pass's
                # membership change: one of them must hold it durably.
                if not any(
                    self._durable_on_quorum(c, term, v) for v in (voters_before, r.config.voters)
                ):
                    self.fail(
                        f"leader {nid} committed {c}@t{term} but no quorum of voters "
                        f"{voters_before} or {r.config.voters} holds it durably"
                    )
                self.leader_commits[c] = term
                self._check_commit_safe(nid, c, term, r.config.voters)
            elif self.cfg.flush != "async" and self.leader_commits.get(c, term) != term:
                self.fail(
                    f"node {nid} committed {c}@t{term}; a leader committed another term there"
                )
            if c > self.max_commit:
                self.max_commit = c
                self.max_commit_entry_term = term
                self.max_commit_seen_term = r.term
                self.commit_times.append((t, c))
        self.stats["min_voters"] = min(self.stats["min_voters"], len(r.config.voters))
        if self._pending_applies:
            self._check_async_applies()

    def _record_leader_commit(self, r: RawNode, lo: int, hi: int) -> None:
        """Async mode: remember every entry the leader just committed."""
        lo = max(lo, r.log.first_index() - 1)
        for e in r.log.entries(lo + 1, hi + 1):
            self.committed_by_leader[(e.index, e.term)] = zlib.crc32(e.data)

    def _check_async_applies(self) -> None:
        for nid, index, term, crc in self._pending_applies:
            if self.committed_by_leader.get((index, term)) != crc:
                self.fail(
                    f"node {nid} applied {index}@t{term}, which no leader committed "
                    "(a follower applied a tail it held without the leader confirming it)"
                )
        self._pending_applies.clear()

    def _on_elected(self, host: Host, r: RawNode, t: float) -> None:
        nid = host.nid
        self.stats["elections"] += 1
        if self.faulty and self.fault_rng.random() < self.cfg.crash_after_elected_rate:
            # Elected, wrote its no-op, died: what it sent reaches some peers
            # at most (figure 8 needs such divergent uncommitted tails).
            inc = self.incarnation[nid]
            for peer in sorted(self.storages):
                if peer != nid and self.fault_rng.random() < 0.7:
                    self.muted.add((nid, inc, peer))
            self._at(t, "call", lambda: self._crash(nid, "crash-after-elected", 0.002))
        self.elections.append((t, r.term, nid))
        self.trace(f"n{nid} leader t{r.term} voters={list(r.config.voters)}")
        if (
            self.cfg.flush != "async"  # a majority's power loss may take committed entries
            and r.term > self.max_commit_seen_term
            and self.max_commit
            and not self._log_holds(r, self.max_commit, self.max_commit_entry_term)
        ):
            self.fail(
                f"leader completeness: leader {nid} of term {r.term} lacks committed "
                f"entry {self.max_commit}@t{self.max_commit_entry_term}"
            )
        for oid in sorted(self.hosts):
            o = self.hosts[oid]
            onode: Node = o.node
            orr = onode._raft
            if oid == nid or orr is None or orr.term >= r.term:
                continue
            exp = self._lease_expiry_local(o, orr)
            if exp is not None and o.offset + o.rate * t < exp:
                self.fail(
                    f"lease overlap: node {nid} was elected leader of term {r.term} while "
                    f"node {oid} (term {orr.term}) still holds a lease on its own clock"
                )

    def _lease_expiry_local(self, host: Host, r: RawNode) -> float | None:
        """Local time at which ``host``'s current lease ends, on its real
        clock (ticks it skipped count as elapsed), or None without a lease."""
        if (
            r.role is not Role.LEADER
            or not r.cfg.check_quorum
            or r._lease_disabled
            or r.transferee != NONE
            or r._lease_expiry_tick < 0
            or not r.leader_ready()
        ):
            return None
        node: Node = host.node
        skipped = node._ticks - r.tick_count
        return node._t0 + (r._lease_expiry_tick + skipped) * self.cfg.tick_ms / 1000

    def _check_lease_read(self, host: Host, r: RawNode, ctx: int) -> None:
        rs = r._read_states
        if not rs or rs[-1].ctx != ctx or rs[-1].mode is not ReadMode.LEASE:
            return
        self._check_lease_read_at(host, r)

    def _check_lease_read_at(self, host: Host, r: RawNode) -> None:
        """A lease read served now on ``host``: inside its lease on its own
        clock, and no higher term elected before it in global time."""
        g = host.global_now()
        exp = self._lease_expiry_local(host, r)
        local = host.local_now()
        if exp is None or local >= exp:
            self.fail(
                f"lease read on node {host.nid} (term {r.term}) at local {local:.4f}s after its "
                f"lease ran out on its own clock at {exp}"
            )
        for t, term, nid in reversed(self.elections):
            if term > r.term and t < g:
                self.fail(
                    f"lease read on node {host.nid} (term {r.term}) at {g:.4f}s while node "
                    f"{nid} leads term {term} since {t:.4f}s"
                )
            if t < g - 10:
                break

    @staticmethod
    def _log_holds(r: RawNode, index: int, term: int) -> bool:
        return index < r.log.first_index() - 1 or r.log.match_term(index, term)

    def _durably_holds(self, nid: int, index: int, term: int) -> bool:
        st = self.storages[nid]
        return st.durable_term(index) == term or st.durable_compacted(index)

    def _durable_on_quorum(self, index: int, term: int, voters: tuple[int, ...]) -> bool:
        if self.cfg.flush == "async":
            return True  # by design: durable only once per flush interval
        held = sum(1 for v in voters if v in self.storages and self._durably_holds(v, index, term))
        return held >= len(voters) // 2 + 1

    def _check_commit_safe(self, nid: int, c: int, term: int, voters: tuple[int, ...]) -> None:
        """Eager leader completeness: no voter lacking committed entry ``c`` may
        be at least as up to date as a quorum of the voters' durable logs."""
        if self.cfg.flush == "async" or FAULT_NO_FSYNC in self.cfg.faults:
            return
        tails: dict[int, tuple[int, int]] = {}
        for v in voters:
            if v in self.storages:
                tails[v] = self.storages[v].durable_last()
        for x in voters:
            h = self.hosts.get(x)
            xr = h.node._raft if h is not None else None
            if xr is not None:
                if self._log_holds(xr, c, term):
                    continue
                x_last, x_term = xr.log.last_index(), xr.log.last_term()
            elif x in self.storages:
                if self._durably_holds(x, c, term):
                    continue
                x_last, x_term = self.storages[x].durable_last()
            else:
                continue
            votes = 1 + sum(
                1
                for y, (y_last, y_term) in tails.items()
                if y != x and (x_term > y_term or (x_term == y_term and x_last >= y_last))
            )
            if votes >= len(voters) // 2 + 1:
                self.fail(
                    f"leader {nid} committed {c}@t{term}, but node {x} lacks it and could "
                    f"still win an election (last {x_last}@t{x_term}, {votes} possible votes)"
                )

    def _acked_before(self, t: float) -> int:
        best = 0
        for a in self.acks:
            if a.time < t and a.index > best:
                best = a.index
        return best

    def _committed_before(self, t: float) -> int:
        for ct, c in reversed(self.commit_times):
            if ct < t:
                return c
        return 0

    # ------------------------------------------------------------------ clients
    def _leader(self) -> Host | None:
        best: Host | None = None
        best_term = -1
        for nid in sorted(self.hosts):
            h = self.hosts[nid]
            r = h.node._raft
            if r is not None and r.role is Role.LEADER and r.term > best_term and not h.paused:
                best, best_term = h, r.term
        return best

    def _pick_target(self) -> Host | None:
        live = [self.hosts[n] for n in sorted(self.hosts) if self.hosts[n].node._raft is not None]
        if not live:
            return None
        if self.cfg.stale_leader_reads and self.rng.random() < self.cfg.stale_leader_reads:
            leaders = [h for h in live if h.node._raft.role is Role.LEADER]
            if leaders:
                return self.rng.choice(leaders)
        lead = self._leader()
        if lead is not None and self.rng.random() < 0.75:
            return lead
        return self.rng.choice(live)

    def spawn_client(self, host: Host, coro: Coroutine[Any, Any, None]) -> None:
        host.loop.create_task(coro)

    def _client_op(self) -> None:
        if self.clients_paused:
            return
        host = self._pick_target()
        if host is None:
            return
        roll = self.rng.random()
        if self.rng.random() < 0.02:
            # Load comes in phases: stretches with no writes leave every log
            # equal, which is when an isolated follower could win an election.
            self.read_only_phase = not self.read_only_phase
        w = self.cfg.write_share
        if (self.cfg.scenario or not self.cfg.transfers) and 0.9 <= roll < 0.95:
            roll = w + (roll - 0.9) * 4  # scripted runs: no random transfers
        if self.read_only_phase and roll < w:
            roll = w + roll * (0.85 - w) / w
        if not self.faulty and roll >= 0.9:
            roll = self.rng.random() * 0.9
        if roll < w:
            self.spawn_client(host, self.client_write(host))
        elif roll < 0.85:
            for _ in range(self.cfg.read_burst):
                self.spawn_client(host, self.client_read(host))
        elif roll < 0.9:
            self.spawn_client(host, self.client_read(host, "committed"))
        elif roll < 0.95:
            r = host.node._raft
            voters = [v for v in r.config.voters if v != host.nid]
            if voters:
                self.spawn_client(host, self.client_transfer(host, self.rng.choice(voters)))
        elif self.cfg.membership:
            # an operator's tool follows the leader hint
            self._conf_change(self._leader() or host)

    async def client_write(self, host: Host, data: bytes | None = None) -> None:
        node: Node = host.node
        if data is None:
            self._wseq += 1
            data = struct.pack(">QQ", self.seed, self._wseq) * self.rng.randrange(1, 4)
        self.stats["proposals"] += 1
        try:
            a = await node.submit(data)
        except DLedgerError:
            return
        self.stats["acked"] += 1
        self.acks.append(_Ack(host.global_now(), a.index, a.term, zlib.crc32(data)))

    async def client_read(self, host: Host, consistency: str = "linearizable") -> None:
        node: Node = host.node
        start = host.global_now()
        try:
            rr = await node.read("committed" if consistency == "committed" else "linearizable")
        except DLedgerError:
            self.stats["reads_failed"] += 1
            return
        sm = host.sm
        idx, reg_index, value = sm.index, sm.reg_index, sm.register
        if self.cfg.flush == "async":
            # A power loss of a majority may take acknowledged writes (and
            # what reads returned) back: no by-value promise across it.
            self.stats["committed_reads" if consistency == "committed" else "reads_ok"] += 1
            return
        if consistency == "committed":
            self.stats["committed_reads"] += 1
        else:
            self.stats["reads_ok"] += 1
            if rr.mode == "lease":
                self.stats["lease_reads"] += 1
            floor = self._committed_before(start)
            if rr.index < floor:
                self.fail(
                    f"stale linearizable read on node {host.nid}: read index {rr.index} < "
                    f"{floor} (committed before the read began), mode {rr.mode}"
                )
            acked = self._acked_before(start)
            if reg_index < acked:
                self.fail(
                    f"stale linearizable read on node {host.nid} ({rr.mode}): it returned the "
                    f"value written at {reg_index}, but the write at {acked} was acknowledged "
                    "before the read began"
                )
        if reg_index and self.writes.get(reg_index) != value:
            self.fail(
                f"read on node {host.nid} returned a value for index {reg_index} that is not "
                "the one the agreed history holds there"
            )
        if idx > self.max_commit and idx > host.node._raft.log.committed:
            self.fail(f"read on node {host.nid} shows uncommitted index {idx}")

    async def client_transfer(self, host: Host, to: int) -> None:
        self.stats["transfers"] += 1
        self.trace(f"client transfer n{host.nid} -> n{to}")
        try:
            await host.node.transfer_leadership(to, 0.3)
        except DLedgerError:
            return
        self.stats["transfers_ok"] += 1

    def _conf_change(self, host: Host) -> None:
        r = host.node._raft
        cfg = r.config
        c = self.cfg
        choice = self.rng.random()
        nvoters = len(cfg.voters)
        if choice < 0.3 and len(cfg.members()) < 7 and self.next_id <= self.max_id:
            new = self.next_id
            self.next_id += 1
            self._spawn(new)
            self.spawn_client(host, self.client_conf(host, "add_learner", new))
        elif choice < 0.65 and cfg.learners and nvoters < c.max_voters:
            self.spawn_client(
                host, self.client_conf(host, "promote", self.rng.choice(cfg.learners))
            )
        else:
            pool = [m for m in cfg.members() if m != host.nid]
            if nvoters <= c.min_voters:
                pool = [m for m in pool if m in cfg.learners]
            if pool:
                self.spawn_client(host, self.client_conf(host, "remove", self.rng.choice(pool)))

    async def client_conf(self, host: Host, op: str, nid: int) -> None:
        node: Node = host.node
        self.stats["conf_changes"] += 1
        self.trace(f"client conf {op} {nid} via n{host.nid}")
        try:
            if op == "add_learner":
                await node.add_learner(nid)
            elif op == "promote":
                await node.promote(nid)
            else:
                await node.remove(nid)
        except DLedgerError:
            return
        self.stats["conf_ok"] += 1
        if op == "remove":
            # The removed process is shut down for good once its removal
            # committed and (a careful operator checks) every remaining voter
            # that is up applied it, or after a second at most.
            t = host.global_now()
            self._at(t, "call", lambda: self._retire(nid, t + 1.0))

    def _retire(self, nid: int, give_up_at: float) -> None:
        if nid in self.removed:
            return
        waiting = [
            h.nid
            for h in (self.hosts[n] for n in sorted(self.hosts))
            if h.nid != nid
            and h.node._raft is not None
            and h.node._raft.config.is_voter(h.nid)
            and h.node._raft.config.is_voter(nid)
        ]
        if waiting and self.now < give_up_at:
            self._at(self.now + 0.01, "call", lambda: self._retire(nid, give_up_at))
            return
        self.removed.add(nid)
        h = self.hosts.pop(nid, None)
        if h is not None:
            h.alive = False
            h.loop.discard()
        self.trace(f"retire n{nid}")

    # ------------------------------------------------------------------ faults
    def _maybe_inject(self) -> None:
        rng = self.rng
        c = self.cfg
        x = rng.random()
        if x < c.crash_rate:
            live = sorted(self.hosts)
            if live:
                lead = self._leader()
                target = lead.nid if lead is not None and rng.random() < 0.4 else rng.choice(live)
                self._crash(target, "crash")
            return
        x -= c.crash_rate
        if x < c.partition_rate:
            self._partition()
            return
        x -= c.partition_rate
        if x < c.power_loss_rate:
            self.power_loss()
            return
        x -= c.power_loss_rate
        if x < c.pause_rate:
            live = [n for n in sorted(self.hosts) if not self.hosts[n].paused]
            if live:
                lead = self._leader()
                target = lead.nid if lead is not None and rng.random() < 0.5 else rng.choice(live)
                self.pause(target, rng.uniform(0.01, 0.25))

    def pause(self, nid: int, duration_s: float) -> None:
        h = self.hosts.get(nid)
        if h is None:
            return
        h.paused = True
        self.stats["pauses"] += 1
        self.trace(f"pause n{nid} for {duration_s * 1000:.0f}ms")
        self._at(self.now + duration_s, "resume", nid)

    def _crash(self, nid: int, why: str, restart_after_s: float | None = None) -> None:
        h = self.hosts.pop(nid, None)
        if h is None:
            return
        h.alive = False
        h.loop.discard()
        h.storage.crash()
        self._count_idle_rounds(h)
        self.stats["crashes"] += 1
        self.trace(f"{why} n{nid}")
        if restart_after_s is None:
            fast = self.rng.random() < 0.3
            restart_after_s = self.rng.uniform(0.001, 0.01) if fast else self.rng.uniform(0.05, 0.4)
        if restart_after_s >= 0:
            self._at(self.now + restart_after_s, "restart", nid)

    def _rebuild(self, nid: int) -> None:
        """Async mode: a replica that stopped on ReplicaDiverged is rebuilt
        from the leader: its log and state machine are dropped, its term and
        vote kept (the operator's procedure keeps the node's identity), and
        it restarts empty."""
        h = self.hosts.pop(nid, None)
        if h is None:
            return
        h.alive = False
        h.loop.discard()
        old = self.storages.pop(nid)
        hs = old.hard_state()
        st = self.storages[nid] = SimStorage(
            nid,
            self,
            flush=self.cfg.flush,
            flush_interval_s=0.1,
            no_fsync=FAULT_NO_FSYNC in self.cfg.faults,
        )
        st.save_hard_state(dataclasses.replace(hs, commit=0))
        st.sync()
        self.stats["rebuilt"] += 1
        self.trace(f"n{nid} diverged: rebuilt empty (term {hs.term}, vote {hs.vote})")
        self._at(self.now + self.rng.uniform(0.05, 0.2), "restart", nid)

    def power_loss(self) -> None:
        """A majority of the voters (sometimes all) lose power at once and
        lose what they had not flushed; the survivors are often cut off from
        them for a while, so the majority elects a leader and writes over
        the lost tail before a survivor is heard from again."""
        rng = self.rng
        lead = self._leader()
        if lead is None or lead.node._raft is None:
            return
        voters = [v for v in lead.node._raft.config.voters if v in self.hosts]
        if len(voters) < 2:
            return
        n = len(voters) if rng.random() < 0.25 else len(voters) // 2 + 1
        down = sorted(rng.sample(voters, min(n, len(voters))))
        self.stats["power_losses"] += 1
        self.trace(f"power loss {down}")
        for nid in down:
            self._crash(nid, "power loss", rng.uniform(0.02, 0.2))
        alive = [x for x in sorted(self.hosts) if x not in down]
        if alive and rng.random() < 0.7:
            for a in alive:
                for b in sorted(self.storages):
                    if b not in alive:
                        self.blocked.add((a, b))
                        self.blocked.add((b, a))
            self._at(self.now + rng.uniform(0.3, 0.8), "heal", None)

    def crash(self, nid: int, restart_after_s: float, drop_in_flight: bool = False) -> None:
        """Crash ``nid`` (scripts); restart it after ``restart_after_s`` (< 0: never).
        ``drop_in_flight``: what it sent and was not delivered yet is lost."""
        if drop_in_flight:
            self.reset.add((nid, self.incarnation.get(nid, 0)))
        self._crash(nid, "crash", restart_after_s)

    def _partition(self) -> None:
        rng = self.rng
        ids = sorted(self.hosts) or sorted(self.storages)
        everyone = sorted(set(self.storages) - self.removed)
        if len(everyone) < 2:
            return
        shape = rng.choice(self.cfg.partition_shapes)
        groups: list[set[int]] = []
        lead = self._leader()
        if shape == "cut-link":
            # the leader and one follower lose each other; both still reach the rest
            if lead is None or len(ids) < 2:
                return
            target = rng.choice([x for x in ids if x != lead.nid])
            self.blocked.add((lead.nid, target))
            self.blocked.add((target, lead.nid))
        elif shape == "deaf":
            # a follower stops hearing the leader but still reaches everyone
            if lead is None or len(ids) < 2:
                return
            target = rng.choice([x for x in ids if x != lead.nid])
            self.blocked.add((lead.nid, target))
        elif shape in ("isolate", "leader", "oneway"):
            target = lead.nid if shape == "leader" and lead is not None else rng.choice(ids)
            if shape == "oneway":
                other = rng.choice([x for x in everyone if x != target])
                self.blocked.add((target, other))
            else:
                groups = [{target}, set(everyone) - {target}]
        elif shape == "halves":
            shuffled = list(everyone)
            rng.shuffle(shuffled)
            k = len(shuffled) // 2
            groups = [set(shuffled[:k]), set(shuffled[k:])]
        elif shape == "bridge":
            shuffled = list(everyone)
            rng.shuffle(shuffled)
            rest = shuffled[1:]
            k = len(rest) // 2
            a, b = sorted(rest[:k]), sorted(rest[k:])
            for x in a:
                for y in b:
                    self.blocked.add((x, y))
                    self.blocked.add((y, x))
        elif shape == "ring":
            ring = list(everyone)
            rng.shuffle(ring)
            k = len(ring)
            for i, x in enumerate(ring):
                for j, y in enumerate(ring):
                    d = min((i - j) % k, (j - i) % k)
                    if x != y and d > 1:
                        self.blocked.add((x, y))
        self.cut(groups)
        self.stats["partitions"] += 1
        self.trace(f"partition {shape} blocked={sorted(self.blocked)}")
        self._at(self.now + rng.uniform(0.05, 0.6), "heal", None)

    def cut(self, groups: list[set[int]]) -> None:
        everyone = sorted(set(self.storages) - self.removed)
        for g in groups:
            for x in sorted(g):
                for y in everyone:
                    if y not in g:
                        self.blocked.add((x, y))
                        self.blocked.add((y, x))

    def _heal_all(self) -> None:
        self.blocked.clear()
        for nid in sorted(self.hosts):
            self.hosts[nid].paused = False
        down = [
            n
            for n in sorted(self.storages)
            if n not in self.hosts and n not in self.removed and n not in self.keep_down
        ]
        keep = self._keep_down_candidate(down) if not self.keep_down else 0
        for nid in down:
            if nid != keep:
                self._spawn(nid)
        self.trace(f"quiet phase: healed, resumed, restarted (kept down: {keep})")

    def _keep_down_candidate(self, down: list[int]) -> int:
        """A crashed voter left down through the quiet phase, if the rest still
        form a quorum of every configuration in play (liveness must hold)."""
        if not down or self.rng.random() >= self.cfg.keep_down_rate:
            return 0
        cand = down[-1]
        for h in self.hosts.values():
            r = h.node._raft
            if r is None:
                continue
            voters = r.config.voters
            if cand in voters:
                up = sum(1 for v in voters if v != cand and (v in self.hosts or v in down))
                if up < len(voters) // 2 + 1:
                    return 0
        return cand

    # ------------------------------------------------------------------ liveness
    def _converged(self) -> Host | None:
        lead = self._leader()
        if lead is None:
            return None
        lr = lead.node._raft
        if lr.log.committed != lr.log.last_index() or not lead.node.leader_ready():
            return None
        for m in lr.config.members():
            h = self.hosts.get(m)
            if h is not None and (h.node._raft is None or h.sm.index != lr.log.committed):
                return None
            if h is not None and h.sm.digest != lead.sm.digest:
                return None  # same index, another history: not converged
        return lead

    def _check_liveness(self) -> None:
        """After healing: a leader exists and every live member applies all of
        its log within a bounded time (replication never stays stuck)."""
        deadline = self.now + self.cfg.liveness_s
        step_limit = self.steps + self.cfg.liveness_max_steps
        while self.now < deadline and self.steps < step_limit:
            self._step()
            if self._converged() is not None:
                return
        state = {
            m: (
                self.hosts[m].node._raft.role.name,
                self.hosts[m].node._raft.term,
                self.hosts[m].sm.index,
                list(self.hosts[m].node._raft.config.voters),
                self.hosts[m].sm.digest.hex()[:8],
            )
            for m in sorted(self.hosts)
            if self.hosts[m].node._raft is not None
        }
        self.fail(f"liveness: no leader or replicas did not converge after healing: {state}")

    def _check_final(self) -> None:
        """Every acknowledged write is in the agreed applied log, at its index."""
        if self.cfg.flush == "async":
            lead = self._converged()
            if lead is not None:
                r = lead.node._raft
                for a in self.acks:
                    try:
                        held = r.log.term(a.index) == a.term
                    except DLedgerError:
                        held = True  # compacted: inside the agreed snapshot
                    if not held:
                        self.stats["acked_lost"] += 1
            return
        for a in self.acks:
            rec = self.applied_record.get(a.index)
            if rec != (a.term, a.crc):
                self.fail(
                    f"acknowledged write at {a.index}@t{a.term} is not in the final log "
                    f"(the agreed history holds {rec})"
                )
        if self.cfg.check_liveness and self.acks:
            top = max(a.index for a in self.acks)
            lead = self._converged()
            if lead is not None and lead.node._raft.log.committed < top:
                self.fail(f"final commit index is below the acknowledged write at {top}")


def _noop() -> None:
    return None


def run_seed(seed: int, cfg: SimConfig) -> Simulation:
    return Simulation(seed, cfg).run()


# Nemesis emphases. "mixed" is the standard run; the others turn up what a
# particular bug needs before it can show (as Jepsen picks nemeses per bug).
PROFILES: dict[str, dict[str, Any]] = {
    "mixed": {},
    "figure8": {
        # scripted Raft figure 8 (dledger/sim/scenarios.py)
        "min_steps": 15000,
        "voters": 5,
        "learners": 0,
        "scenario": "figure8",
        "max_msg_bytes": 64,
        "drop_rate": 0.0,
        "dup_rate": 0.0,
        "long_delay_rate": 0.0,
        "stall_rate": 0.0,
        "mid_pass_crash_rate": 0.0,
        "membership": False,
        "keep_down_rate": 0.0,
        "check_quorum": True,
    },
    "lease": {
        "min_steps": 25000,
        # leaders isolated or paused while clients keep reading from whoever
        # believes it leads: what a lease bug needs to turn into a stale read.
        "voters": 3,
        "learners": 0,
        "pause_rate": 0.003,
        "partition_rate": 0.004,
        "stale_leader_reads": 0.5,
        "membership": False,
    },
    "idle": {
        "min_steps": 25000,
        # sparse clients: the leader falls idle between them and stretches its
        # rounds (idle_heartbeat_ticks), while pauses, partitions and clock
        # drift test that the lease and stickiness still hold across the
        # longer gaps, and that the first request after idling is served.
        "voters": 3,
        "learners": 0,
        "client_per_s": 4.0,
        "quiet_client_per_s": 4.0,
        "stale_leader_reads": 0.5,
        "pause_rate": 0.002,
        "partition_rate": 0.002,
        "idle_heartbeat_ticks": 8,
        "membership": False,
    },
    "stall": {
        "min_steps": 25000,
        # loops stalled in the middle of a pass (GC, a huge batch) while
        # clients read from the leader: a lease decided on the pass's stale
        # clock shows here.
        "voters": 3,
        "learners": 0,
        "stall_rate": 0.05,
        "stall_kinds": ("op",),
        "stall_min_s": 0.06,
        "stall_max_s": 0.15,
        "read_burst": 3,
        "crash_rate": 0.0005,
        "partition_rate": 0.001,
        "client_per_s": 800.0,
        "membership": False,
    },
    "truncate": {
        "min_steps": 25000,
        # duplicated and long-delayed appends arrive after newer ones
        "dup_rate": 0.15,
        "long_delay_rate": 0.08,
        "long_delay_s": 0.05,
        "write_share": 0.8,
        "max_msg_bytes": 64,
    },
    "snapshot": {
        "min_steps": 25000,
        # scripted: a follower installs a snapshot, dies with its ack lost
        # and gets the same snapshot again after a quick restart
        "snapshot_every_entries": 5,
        "snapshot_trailing_entries": 0,
        "scenario": "stale-snapshot",
        "membership": False,
        "voters": 3,
        "learners": 0,
        "write_share": 0.8,
        "keep_down_rate": 0.0,
    },
    "sticky": {
        "min_steps": 25000,
        # followers cut off and back while a leader with a lease serves
        # reads, with few writes (so the returning node's log is current)
        "voters": 3,
        "learners": 0,
        "check_quorum": True,
        "partition_rate": 0.006,
        "partition_shapes": ("cut-link",),
        "write_share": 0.02,
        "transfers": False,
        "pause_rate": 0.0,
        "stall_rate": 0.0,
        "crash_rate": 0.0005,
        "membership": False,
    },
    "vote-loss": {
        "min_steps": 25000,
        # vanilla Raft (no pre-vote, no stickiness), tight timeouts and a slow
        # network: split votes are common and a vote can be in flight across
        # the crash of the node that granted the other one.
        "voters": 5,
        "learners": 0,
        "crash_after_vote_rate": 1.0,
        "check_quorum": False,
        "pre_vote": False,
        "election_ticks": 4,
        "idle_heartbeat_ticks": 0,
        "lease_drift_ticks": 1,
        "max_delay_s": 0.02,
        "drop_rate": 0.1,
        "membership": False,
    },
    "membership": {
        # membership down to one voter and back up to five, under partitions
        "min_steps": 25000,
        "voters": 3,
        "learners": 2,
        "client_per_s": 600.0,
        "min_voters": 1,
        "transfers": False,
    },
    "conf-replay": {
        "min_steps": 25000,
        # issue #12 bug 1: promotions in the log, a full restart with slow
        # replay, then a partition along the old/new voter sets
        "voters": 3,
        "learners": 2,
        "scenario": "conf-replay",
        "membership": False,
        "keep_down_rate": 0.0,
        "snapshot_every_entries": 0,
        "slow_apply_cost_s": 0.01,
        "write_share": 0.8,
        "stale_leader_reads": 0.5,
        "drop_rate": 0.01,
    },
    "power-loss": {
        # flush="async": majorities lose their unflushed tail at once while
        # survivors are cut off, so new leaders rewrite indexes a survivor
        # committed (issues #12 bug 6 and #20). Checked: applied entries
        # were committed by a leader, diverged replicas stop and are
        # rebuilt, every member converges.
        "min_steps": 25000,
        "flush": "async",
        "power_loss_rate": 0.002,
        "crash_rate": 0.0005,
        "membership": False,
        "transfers": False,
        "learners": 0,
        "write_share": 0.8,
    },
    "lost-majority": {
        # issue #20's divergence, scripted (dledger/sim/scenarios.py)
        "min_steps": 25000,
        "flush": "async",
        "voters": 3,
        "learners": 0,
        "scenario": "lost-majority",
        "membership": False,
        "transfers": False,
        "keep_down_rate": 0.0,
        "write_share": 0.8,
        "drop_rate": 0.01,
    },
    "lost-rewrite": {
        # issue #12 bug 6, scripted (dledger/sim/scenarios.py)
        "min_steps": 25000,
        "flush": "async",
        "voters": 3,
        "learners": 0,
        "scenario": "lost-rewrite",
        # The old leader must catch up by having its tail rewritten, not by
        # a snapshot: the new leader keeps the entries behind its snapshots.
        "snapshot_trailing_entries": 1000,
        "membership": False,
        "transfers": False,
        "keep_down_rate": 0.0,
        "write_share": 0.8,
        "drop_rate": 0.01,
    },
    "learner-vote": {
        "min_steps": 25000,
        # issue #12 bug 2: a promotion commits on the old voters, the
        # promoted node has not applied it, one old voter dies
        "voters": 2,
        "learners": 1,
        "scenario": "learner-vote",
        "membership": False,
        "keep_down_rate": 0.0,
        "write_share": 0.8,
        "drop_rate": 0.01,
    },
}


def mixed_config(
    seed: int, steps: int, faults: frozenset[str] = frozenset(), profile: str = "mixed"
) -> SimConfig:
    """The standard mix: 3 or 5 voters, sometimes learners, every fault kind,
    then the named profile's emphasis on top."""
    r = random.Random(seed ^ 0x5EED)
    cfg = SimConfig(
        voters=r.choice([3, 3, 5]),
        learners=r.choice([0, 0, 1, 2]),
        steps=steps,
        faults=faults,
        check_quorum=r.random() < 0.8,
        max_msg_bytes=r.choice([64, 256, 4096]),
        log_cache_entries_max=r.choice([65536, 3, 17]),
        log_cache_bytes_max=r.choice([64 << 20, 100]),
        snapshot_every_entries=r.choice([10, 30, 100]),
        snapshot_trailing_entries=r.choice([0, 1, 2, 5, 50]),
        mixed=True,
    )
    return dataclasses.replace(cfg, profile=profile, **PROFILES[profile])


Progress = Callable[[str], None]
