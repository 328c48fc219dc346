"""Deterministic whole-cluster simulation with an invariant checker.

Theory of operation
-------------------
One process, one seeded ``random.Random``, one event heap ordered by
(real time, sequence). Real time is an integer; each node ticks with its own
period (the base period skewed by up to ``drift`` either way, to model clock
rate drift). Events are node ticks, message deliveries, client operations,
faults and heals. Every node is a :class:`RawNode` over a
:class:`MemoryStorage`; the driver here follows the Ready contract exactly
(persist + sync, send, apply, advance), so crashing a node (``storage.crash()``)
loses exactly what a real crash would: every write since the last sync.

Each node's state machine is a running digest of the entries it applied
(index, term, CRC), so two replicas agree on their applied prefix up to ``i``
iff their digests at ``i`` agree. Nodes snapshot it now and then (the digest
and its index are the opaque payload), which lets the core compact the log,
sometimes keeping almost no trailing entries so that lagging followers and
late learners really are brought up to date by InstallSnapshot; SNAPSHOT
messages cross the same faulty network as everything else.

After every event the checker verifies election safety, log matching,
leader completeness, state-machine safety (per entry and per snapshot:
installing a snapshot at ``i`` must give the digest everyone else had at
``i``), commit monotonicity (a stale or duplicated snapshot never rolls a
node back) and durability on a quorum, read linearizability and lease
exclusivity. A
violation raises :class:`SimViolation` carrying the seed and the trace tail.
A run's trace hash is a digest of every event it processed: two runs of one
seed must produce the same hash (the determinism check).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dledger.core.raft import CORE_FAULTS, RawNode
from dledger.core.types import (
    EARLY_SEND_TYPES,
    NONE,
    ClusterConfig,
    ConfChange,
    ConfChangeType,
    Message,
    MsgType,
    RaftConfig,
    Ready,
    Role,
    Snapshot,
)
from dledger.errors import DLedgerError, InvariantViolation
from dledger.storage.memory import MemoryStorage

FAULT_NO_FSYNC = "no_fsync"  # sim-level: acknowledge without syncing (SCENARIOS 11)
ALL_FAULTS = CORE_FAULTS | {FAULT_NO_FSYNC}

BASE_TICK = 1000  # real-time units per tick at nominal rate


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
    election_ticks: int = 10
    heartbeat_ticks: int = 1
    lease_drift_ticks: int = 2
    drift: float = 0.05  # max relative tick-rate error per node
    drop_rate: float = 0.02
    dup_rate: float = 0.02
    max_delay: int = 600  # real-time units; random delays reorder messages
    long_delay_rate: float = 0.01
    long_delay_ticks: int = 30
    crash_rate: float = 0.002  # per event
    partition_rate: float = 0.002
    pause_rate: float = 0.001
    client_rate: float = 0.08
    membership: bool = True
    check_quorum: bool = True  # off: no stickiness, no lease (ReadIndex only)
    pre_vote: bool = True
    log_cache_entries_max: int = 65536
    log_cache_bytes_max: int = 64 << 20
    stale_leader_reads: float = 0.0  # share of client ops sent to any self-believed leader
    crash_after_vote_rate: float = 0.05  # kill right after granting a vote
    crash_after_commit_rate: float = 0.01  # kill a leader right after it commits
    crash_after_elected_rate: float = 0.03  # kill a new leader before its no-op spreads
    max_inflight_msgs: int = 8
    max_msg_bytes: int = 256
    faults: frozenset[str] = field(default_factory=frozenset)
    quiet_ticks: int = 80  # after the faulty phase: heal, restart, then check liveness
    check_liveness: bool = True
    mixed: bool = False  # built by mixed_config(seed): reproduce with the seed alone
    profile: str = "mixed"
    snapshot_rate: float = 0.03  # per handled Ready: snapshot the state machine
    snapshot_trailing_entries: int = 5  # log entries kept behind a snapshot
    snapshot_retry_ticks: int = 5


class _Node:
    __slots__ = (
        "commit_before",
        "commit_seen",
        "paused",
        "raft",
        "sm_digest",
        "sm_index",
        "storage",
    )

    def __init__(self, raft: RawNode, storage: MemoryStorage, sm: tuple[int, bytes]) -> None:
        self.raft = raft
        self.storage = storage
        self.paused = False
        self.commit_seen = raft.log.committed
        self.commit_before = raft.log.committed
        # the state machine: how far it applied and the digest of that prefix
        self.sm_index, self.sm_digest = sm


def _sm_digest(prev: bytes, index: int, term: int, crc: int) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(index.to_bytes(8, "big") + term.to_bytes(8, "big") + crc.to_bytes(4, "big"))
    return h.digest()


def _encode_sm(index: int, digest: bytes) -> bytes:
    return index.to_bytes(8, "big") + digest


def _decode_sm(data: bytes) -> tuple[int, bytes]:
    return int.from_bytes(data[:8], "big"), data[8:]


class Simulation:
    def __init__(self, seed: int, cfg: SimConfig) -> None:
        self.seed = seed
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.now = 0
        self._seq = 0
        self._events: list[tuple[int, int, str, Any]] = []
        self._hash = hashlib.blake2b(digest_size=16)
        self._tail: deque[str] = deque(maxlen=60)
        voters = tuple(range(1, cfg.voters + 1))
        learners = tuple(range(cfg.voters + 1, cfg.voters + cfg.learners + 1))
        self.bootstrap = ClusterConfig(voters, learners)
        self.next_id = cfg.voters + cfg.learners + 1
        self.storages: dict[int, MemoryStorage] = {}
        self.nodes: dict[int, _Node] = {}  # live (not crashed) nodes
        self.period: dict[int, int] = {}
        self.blocked: set[tuple[int, int]] = set()
        self.held: dict[int, list[Message]] = {}  # messages for paused nodes
        self.missed_ticks: dict[int, int] = {}
        self.removed: set[int] = set()
        self.incarnation: dict[int, int] = {}
        # checker state
        self.leader_of_term: dict[int, int] = {}
        self.entry_record: dict[tuple[int, int], tuple[int, int]] = {}
        self.applied_record: dict[int, tuple[int, int]] = {}
        self.digest_at: dict[int, bytes] = {}  # applied-prefix digest at each index
        self.snap_rng = random.Random(seed ^ 0x5A995407)  # snapshot timing only
        self.leader_commits: dict[int, int] = {}  # index -> term, as leaders committed
        self.max_commit = 0  # highest index known committed anywhere
        self.max_commit_entry_term = 0  # the term of that entry
        self.max_commit_seen_term = 0  # the term in which it was first seen committed
        self.reads: dict[int, tuple[int, int]] = {}  # ctx -> (node, min index)
        self._ctx = 0
        self.read_only_phase = False
        self.faulty = True
        self.stats: dict[str, int] = {
            "proposals": 0,
            "reads_ok": 0,
            "reads_failed": 0,
            "lease_reads": 0,
            "crashes": 0,
            "partitions": 0,
            "pauses": 0,
            "transfers": 0,
            "conf_changes": 0,
            "elections": 0,
            "msgs": 0,
            "snapshots_taken": 0,
            "snapshots_sent": 0,
            "snapshots_installed": 0,
        }
        self.steps = 0
        for nid in self.bootstrap.members():
            self._spawn(nid)

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
        return " ".join(parts)

    def _raft_config(self, nid: int) -> RaftConfig:
        c = self.cfg
        return RaftConfig(
            node_id=nid,
            peers=self.bootstrap,
            election_ticks=c.election_ticks,
            heartbeat_ticks=c.heartbeat_ticks,
            lease_drift_ticks=c.lease_drift_ticks,
            max_inflight_msgs=c.max_inflight_msgs,
            max_msg_bytes=c.max_msg_bytes,
            check_quorum=c.check_quorum,
            pre_vote=c.pre_vote,
            log_cache_entries_max=c.log_cache_entries_max,
            log_cache_bytes_max=c.log_cache_bytes_max,
            snapshot_trailing_entries=c.snapshot_trailing_entries,
            snapshot_retry_ticks=c.snapshot_retry_ticks,
            faults=c.faults & CORE_FAULTS,
        )

    def _spawn(self, nid: int) -> None:
        st = self.storages.get(nid)
        if st is None:
            st = self.storages[nid] = MemoryStorage()
        if nid not in self.period:
            skew = self.rng.uniform(-self.cfg.drift, self.cfg.drift)
            self.period[nid] = int(BASE_TICK * (1 + skew))
        node_rng = random.Random(self.rng.getrandbits(64))
        snap = st.snapshot()
        sm = (0, b"")
        meta = None
        if snap is not None:
            # Restart: the state machine comes back from the durable snapshot
            # and the log is applied from there on, never again below it.
            meta = snap.meta
            sm = _decode_sm(snap.data)
        raft = RawNode(self._raft_config(nid), st, st, node_rng, applied=sm[0], snapshot=meta)
        if raft.log.applied != sm[0]:
            self.fail(f"node {nid} restarted with applied {raft.log.applied}, snapshot at {sm[0]}")
        self.nodes[nid] = _Node(raft, st, sm)
        self.incarnation[nid] = self.incarnation.get(nid, 0) + 1
        # Ticks carry the incarnation: a chain left from before a crash dies.
        self._at(
            self.now + self.rng.randrange(1, self.period[nid]), "tick", (nid, self.incarnation[nid])
        )

    # ------------------------------------------------------------------ events
    def _at(self, t: int, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _trace(self, s: str) -> None:
        line = f"t={self.now} {s}"
        self._tail.append(line)
        self._hash.update(line.encode())

    def trace_hash(self) -> str:
        return self._hash.hexdigest()

    def fail(self, what: str) -> None:
        raise SimViolation(self.seed, what, list(self._tail), self.argv())

    def run(self) -> Simulation:
        self.faulty = True
        quiet_until = None
        while True:
            if self.faulty and self.steps >= self.cfg.steps:
                self.faulty = False
                self._heal_all()
                quiet_until = self.now + self.cfg.quiet_ticks * BASE_TICK
            if not self.faulty and quiet_until is not None and self.now >= quiet_until:
                break
            if self.faulty:
                self._maybe_inject()
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = max(self.now, t)
            self.steps += 1
            try:
                self._dispatch(kind, payload)
            except (InvariantViolation, AssertionError) as e:
                if isinstance(e, SimViolation):
                    raise
                self.fail(f"{type(e).__name__}: {e}")
            self._check_global()
        if self.cfg.check_liveness:
            self._check_liveness()
        return self

    def _dispatch(self, kind: str, payload: Any) -> None:
        if kind == "tick":
            nid, inc = payload
            n = self.nodes.get(nid)
            if n is None or inc != self.incarnation[nid]:
                return  # crashed; restart schedules a new tick chain
            self._at(self.now + self.period[nid], "tick", payload)
            if n.paused:
                self.missed_ticks[nid] = self.missed_ticks.get(nid, 0) + 1
                return
            self._trace(f"tick n{nid}")
            n.raft.tick()
            self._process(nid)
        elif kind == "msg":
            m: Message = payload
            n = self.nodes.get(m.to)
            if n is None:
                return
            if n.paused:
                self.held.setdefault(m.to, []).append(m)
                return
            self._trace(
                f"deliver {m.type.name} {m.frm}->{m.to} t{m.term} i{m.index} lt{m.log_term} "
                f"c{m.commit} n{len(m.entries)} rej{int(m.reject)} ctx{m.context}"
            )
            n.raft.step(m)
            self._process(m.to)
        elif kind == "restart":
            nid = payload
            if nid not in self.nodes and nid not in self.removed:
                self._trace(f"restart n{nid}")
                self._spawn(nid)
        elif kind == "heal":
            self.blocked.clear()
            self._trace("heal")
        elif kind == "resume":
            self._resume(payload)
        elif kind == "client":
            self._client_op()

    # ------------------------------------------------------------------ driver
    def _process(self, nid: int) -> None:
        """Run the Ready loop for one node until it has nothing left."""
        for _ in range(100):
            n = self.nodes.get(nid)
            if n is None or not n.raft.has_ready():
                return
            voters_before = n.raft.config.voters
            n.commit_before = n.raft.log.committed
            rd = n.raft.ready()
            if (
                self.faulty
                and rd.soft_state is not None
                and rd.soft_state.role is Role.LEADER
                and self.rng.random() < self.cfg.crash_after_elected_rate
            ):
                # Elected, wrote its no-op, crashed before sending anything
                # (early sending is allowed, not required).
                if not self._persist(nid, n, rd):
                    self._crash(nid, "crash-after-elected", fast=True)
                return
            # The leader's replication may leave before its own write (Ready's
            # contract); everything else waits for the sync.
            for m in rd.messages:
                if m.type in EARLY_SEND_TYPES:
                    self._send(m)
            if self._persist(nid, n, rd):
                return  # crashed mid-write
            for m in rd.messages:
                if m.type not in EARLY_SEND_TYPES:
                    self._send(m)
            for m in rd.snapshots_to_send:
                self._send_snapshot(nid, n, m)
            if (
                self.faulty
                and any(m.type is MsgType.VOTE_RESP and not m.reject for m in rd.messages)
                and self.rng.random() < self.cfg.crash_after_vote_rate
            ):
                self._crash(nid, "crash-after-vote", fast=True)
                return
            self._apply(nid, n, rd)
            n.raft.advance(rd)
            self._after_advance(nid, n, rd, voters_before)
            self._maybe_snapshot(nid, n)
            if (
                self.faulty
                and n.raft.role is Role.LEADER
                and n.raft.log.committed > n.commit_before
                and self.rng.random() < self.cfg.crash_after_commit_rate
            ):
                self._crash(nid, "crash-after-commit", fast=True)
                return
        self.fail(f"node {nid} kept producing Ready batches (100 in a row)")

    def _persist(self, nid: int, n: _Node, rd: Ready) -> bool:
        st = n.storage
        if rd.snapshot is not None:
            self._install_snapshot(nid, n, rd.snapshot)
        if rd.entries:
            self._check_log_matching(nid, n, rd)
            st.append(rd.entries)
        if rd.hard_state is not None:
            st.save_hard_state(rd.hard_state)
        if rd.entries or rd.hard_state is not None or rd.snapshot is not None:
            if self.rng.random() < self.cfg.crash_rate / 2:
                # A crash in the middle of a write: appended, never synced.
                self._crash(nid, "mid-write")
                return True
            if FAULT_NO_FSYNC not in self.cfg.faults:
                st.sync()
        return False

    def _send(self, m: Message) -> None:
        self.stats["msgs"] += 1
        if (m.frm, m.to) in self.blocked or m.to in self.removed:
            return
        if self.rng.random() < self.cfg.drop_rate:
            return
        copies = 2 if self.rng.random() < self.cfg.dup_rate else 1
        for _ in range(copies):
            delay = 1 + self.rng.randrange(self.cfg.max_delay)
            if self.rng.random() < self.cfg.long_delay_rate:
                # A message stuck in a queue for many ticks: stale on arrival.
                delay += self.rng.randrange(self.cfg.long_delay_ticks * BASE_TICK)
            self._at(self.now + delay, "msg", m)

    # ------------------------------------------------------------------ snapshots
    def _install_snapshot(self, nid: int, n: _Node, snap: Snapshot) -> None:
        """Step 1 for a received snapshot: restore the state machine from the
        payload, then save it and reset the log (durable with this Ready's sync)."""
        meta = snap.meta
        index, digest = _decode_sm(snap.data)
        if index != meta.index:
            self.fail(f"node {nid} got a snapshot whose payload is at {index}, meta {meta.index}")
        if meta.index <= n.sm_index:
            self.fail(
                f"node {nid} told to install snapshot {meta.index} but its state machine "
                f"already applied {n.sm_index} (a stale snapshot would roll it back)"
            )
        want = self.digest_at.setdefault(meta.index, digest)
        if want != digest:
            self.fail(
                f"state machine safety: node {nid} installed a snapshot at {meta.index} whose "
                "applied-prefix digest differs from what other nodes applied there"
            )
        n.sm_index, n.sm_digest = index, digest
        n.storage.apply_snapshot(snap)
        self.stats["snapshots_installed"] += 1
        self._trace(f"n{nid} installs snapshot {meta.index}@t{meta.term}")

    def _send_snapshot(self, nid: int, n: _Node, m: Message) -> None:
        snap = n.storage.snapshot()
        if snap is None or snap.meta != m.snapshot:
            self.fail(f"leader {nid} asked to send snapshot {m.snapshot} but holds {snap}")
            return
        self.stats["snapshots_sent"] += 1
        self._send(dataclasses.replace(m, snapshot_data=snap.data))

    def _maybe_snapshot(self, nid: int, n: _Node) -> None:
        """Now and then, snapshot the state machine at the applied index and
        compact the log behind it."""
        r = n.raft
        latest = r.latest_snapshot()
        if r.log.applied <= (latest.index if latest is not None else 0):
            return
        if self.snap_rng.random() >= self.cfg.snapshot_rate:
            return
        meta = r.snapshot_meta()
        if meta.index != n.sm_index:
            self.fail(f"node {nid}: core applied {meta.index}, state machine {n.sm_index}")
        n.storage.save_snapshot(Snapshot(meta, _encode_sm(n.sm_index, n.sm_digest)))
        if FAULT_NO_FSYNC not in self.cfg.faults:
            n.storage.sync()
        comp = r.snapshot_taken(meta)
        if comp is not None:
            n.storage.compact(comp.upto, comp.term, comp.pos)
        self.stats["snapshots_taken"] += 1
        self._trace(f"n{nid} snapshot {meta.index} compact<{comp.upto if comp else 0}")

    def _apply(self, nid: int, n: _Node, rd: Ready) -> None:
        for e in rd.committed_entries:
            crc = zlib.crc32(e.data)
            if e.index != n.sm_index + 1:
                self.fail(f"node {nid} applies {e.index} after {n.sm_index} (gap or reapply)")
            n.sm_index = e.index
            n.sm_digest = _sm_digest(n.sm_digest, e.index, e.term, crc)
            if self.digest_at.setdefault(e.index, n.sm_digest) != n.sm_digest:
                self.fail(
                    f"state machine safety: node {nid}'s applied prefix up to {e.index} "
                    "differs from another node's"
                )
            rec = self.applied_record.get(e.index)
            if rec is None:
                self.applied_record[e.index] = (e.term, crc)
            elif rec != (e.term, crc):
                self.fail(
                    f"state machine safety: node {nid} applied {e.index}@t{e.term} but "
                    f"another node applied {e.index}@t{rec[0]}"
                )
        for rs in rd.read_states:
            want = self.reads.pop(rs.ctx, None)
            if want is None:
                continue
            _, min_index = want
            if rs.index < min_index:
                self.fail(
                    f"stale linearizable read on node {nid}: read index {rs.index} < "
                    f"{min_index} (committed before the read began), mode {rs.mode.name}"
                )
            self.stats["reads_ok"] += 1
            if rs.mode.name == "LEASE":
                self.stats["lease_reads"] += 1
        for rf in rd.read_failures:
            self.reads.pop(rf.ctx, None)
            self.stats["reads_failed"] += 1

    def _after_advance(self, nid: int, n: _Node, rd: Ready, voters_before: tuple[int, ...]) -> None:
        r = n.raft
        c = r.log.committed
        if c < n.commit_seen:
            self.fail(f"commit index of node {nid} went back from {n.commit_seen} to {c}")
        if c > n.commit_seen:
            term = r.log.term(c)
            if r.role is Role.LEADER:
                # The leader counted replicas, under the configuration before or
                # after this batch's membership change: one must hold it durably.
                if not any(
                    self._durable_on_quorum(c, term, v) for v in (voters_before, r.config.voters)
                ):
                    self.fail(
                        f"leader {nid} committed {c}@t{term} but no quorum of voters "
                        f"{voters_before} or {r.config.voters} holds it durably"
                    )
                self.leader_commits[c] = term
                self._check_commit_safe(nid, c, term, r.config.voters)
            elif self.leader_commits.get(c, term) != term:
                self.fail(
                    f"node {nid} committed {c}@t{term}; a leader committed another term there"
                )
            n.commit_seen = c
            if c > self.max_commit:
                self.max_commit = c
                self.max_commit_entry_term = term
                self.max_commit_seen_term = r.term
        if rd.soft_state is not None and rd.soft_state.role is Role.LEADER:
            self.stats["elections"] += 1
            for other in sorted(self.nodes):
                o = self.nodes[other]
                # A newer term deposes a lease holder; a stale leader of an older
                # term (late vote replies) cannot commit or lease, so it is harmless.
                if (
                    other != nid
                    and o.raft.term < r.term
                    and self._lease_held(other)
                    and o.raft.transferee == NONE
                ):
                    self.fail(
                        f"node {nid} was elected leader of term {r.term} while node {other} "
                        f"(term {o.raft.term}) still holds a lease"
                    )
            self._trace(f"n{nid} leader t{r.term}")

    def _check_commit_safe(self, nid: int, c: int, term: int, voters: tuple[int, ...]) -> None:
        """Eager leader completeness: no voter lacking committed entry ``c`` may
        be at least as up to date as a quorum of the voters' durable logs, or it
        could be elected and overwrite ``c`` (Raft figure 8)."""
        tails: dict[int, tuple[int, int]] = {}
        for v in voters:
            if v in self.storages:
                tails[v] = self.storages[v].durable_last()
        for x in voters:
            n = self.nodes.get(x)
            if n is not None:
                if self._log_holds(n.raft, c, term):
                    continue
                x_last, x_term = n.raft.log.last_index(), n.raft.log.last_term()
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

    def _durable_on_quorum(self, index: int, term: int, voters: tuple[int, ...]) -> bool:
        held = sum(1 for v in voters if v in self.storages and self._durably_holds(v, index, term))
        return held >= len(voters) // 2 + 1

    def _durably_holds(self, nid: int, index: int, term: int) -> bool:
        """Does node ``nid``'s synced image hold ``index@term``? An index below
        its compacted front counts: only applied entries are compacted, and
        state-machine safety checks those agree everywhere."""
        st = self.storages[nid]
        return st.durable_term(index) == term or st.durable_compacted(index)

    @staticmethod
    def _log_holds(r: RawNode, index: int, term: int) -> bool:
        """``match_term`` that counts entries compacted into a snapshot."""
        return index < r.log.first_index() - 1 or r.log.match_term(index, term)

    def _check_log_matching(self, nid: int, n: _Node, rd: Ready) -> None:
        log = n.raft.log
        for e in rd.entries:
            prev_term = log.term(e.index - 1) if e.index > 1 else 0
            key = (e.index, e.term)
            val = (zlib.crc32(e.data) ^ (e.pos << 1), prev_term)
            old = self.entry_record.get(key)
            if old is None:
                self.entry_record[key] = val
            elif old != val:
                self.fail(
                    f"log matching: node {nid} holds {e.index}@t{e.term} with different "
                    "content or predecessor than another node"
                )

    def _lease_held(self, nid: int) -> bool:
        """Lease validity in real time: a paused node's clock keeps running."""
        n = self.nodes[nid]
        r = n.raft
        if not r.lease_valid():
            return False
        return r.lease_remaining_ticks() > self.missed_ticks.get(nid, 0)

    def _check_global(self) -> None:
        holders = []
        for nid in sorted(self.nodes):
            n = self.nodes[nid]
            r = n.raft
            if r.role is Role.LEADER:
                other = self.leader_of_term.setdefault(r.term, nid)
                if other != nid:
                    self.fail(f"election safety: nodes {other} and {nid} both lead term {r.term}")
                if (
                    r.term > self.max_commit_seen_term
                    and self.max_commit
                    and not self._log_holds(r, self.max_commit, self.max_commit_entry_term)
                ):
                    self.fail(
                        f"leader completeness: leader {nid} of term {r.term} lacks committed "
                        f"entry {self.max_commit}"
                    )
                if self._lease_held(nid):
                    holders.append(nid)
        if len(holders) > 1:
            terms = {h: self.nodes[h].raft.term for h in holders}
            self.fail(f"lease overlap: nodes {terms} hold a lease at the same time")

    # ------------------------------------------------------------------ clients
    def _leader(self) -> int:
        best = NONE
        best_term = -1
        for nid in sorted(self.nodes):
            r = self.nodes[nid].raft
            if r.role is Role.LEADER and r.term > best_term and not self.nodes[nid].paused:
                best, best_term = nid, r.term
        return best

    def _pick_target(self) -> int:
        live = sorted(self.nodes)
        if self.cfg.stale_leader_reads and self.rng.random() < self.cfg.stale_leader_reads:
            leaders = [n for n in live if self.nodes[n].raft.role is Role.LEADER]
            if leaders:
                return self.rng.choice(leaders)
        lead = self._leader()
        if lead and self.rng.random() < 0.7:
            return lead
        return self.rng.choice(live)

    def _client_op(self) -> None:
        if not self.nodes:
            return
        nid = self._pick_target()
        n = self.nodes[nid]
        if n.paused:
            return
        r = n.raft
        roll = self.rng.random()
        if self.rng.random() < 0.02:
            # Load comes in phases: stretches with no writes leave every log
            # equal, which is when an isolated follower could win an election.
            self.read_only_phase = not self.read_only_phase
        if self.read_only_phase and roll < 0.6:
            roll = 0.6 + roll * 0.5
        try:
            if roll < 0.6:
                data = self.rng.getrandbits(64).to_bytes(8, "big") * self.rng.randrange(1, 8)
                idx = r.propose(data)
                self.stats["proposals"] += 1
                self._trace(f"client propose n{nid} -> {idx}")
            elif roll < 0.9:
                self._ctx += 1
                # Everything committed anywhere before the read began must be visible.
                floor = max([self.max_commit] + [x.raft.log.committed for x in self.nodes.values()])
                self.reads[self._ctx] = (nid, floor)
                r.read_index(self._ctx)
                self._trace(f"client read n{nid} ctx{self._ctx} floor {floor}")
            elif roll < 0.95:
                voters = [v for v in r.config.voters if v != nid]
                if voters:
                    to = self.rng.choice(voters)
                    r.transfer_leadership(to)
                    self.stats["transfers"] += 1
                    self._trace(f"client transfer n{nid} -> n{to}")
            elif self.cfg.membership:
                self._conf_change(nid, r)
        except DLedgerError:
            pass
        self._process(nid)

    def _conf_change(self, nid: int, r: RawNode) -> None:
        cfg = r.config
        choice = self.rng.random()
        cc: ConfChange | None = None
        if choice < 0.35 and len(cfg.members()) < 7:
            new = self.next_id
            self.next_id += 1
            cc = ConfChange(ConfChangeType.ADD_LEARNER, new)
            r.propose_conf_change(cc)
            self._spawn(new)
        elif choice < 0.7 and cfg.learners and len(cfg.voters) < 5:
            cc = ConfChange(ConfChangeType.PROMOTE_LEARNER, self.rng.choice(cfg.learners))
            r.propose_conf_change(cc)
        elif len(cfg.voters) > 3 or cfg.learners:
            pool = [m for m in cfg.members() if m != nid]
            if len(cfg.voters) <= 3:
                pool = list(cfg.learners)
            if pool:
                cc = ConfChange(ConfChangeType.REMOVE_NODE, self.rng.choice(pool))
                r.propose_conf_change(cc)
        if cc is not None:
            self.stats["conf_changes"] += 1
            self._trace(f"client conf {cc.type.name} {cc.node_id} via n{nid}")

    # ------------------------------------------------------------------ faults
    def _maybe_inject(self) -> None:
        rng = self.rng
        c = self.cfg
        x = rng.random()
        if x < c.client_rate:
            self._at(self.now + rng.randrange(1, 400), "client", None)
            return
        x -= c.client_rate
        if x < c.crash_rate:
            live = sorted(self.nodes)
            if live:
                target = (
                    self._leader() if rng.random() < 0.4 and self._leader() else rng.choice(live)
                )
                self._crash(target, "crash")
            return
        x -= c.crash_rate
        if x < c.partition_rate:
            self._partition()
            return
        x -= c.partition_rate
        if x < c.pause_rate:
            live = [n for n in sorted(self.nodes) if not self.nodes[n].paused]
            if live:
                target = (
                    self._leader() if rng.random() < 0.5 and self._leader() else rng.choice(live)
                )
                self.nodes[target].paused = True
                self.stats["pauses"] += 1
                self._trace(f"pause n{target}")
                self._at(self.now + rng.randrange(BASE_TICK, 25 * BASE_TICK), "resume", target)

    def _crash(self, nid: int, why: str, fast: bool = False) -> None:
        n = self.nodes.pop(nid, None)
        if n is None:
            return
        n.storage.crash()
        self.held.pop(nid, None)
        self.missed_ticks.pop(nid, None)
        self.stats["crashes"] += 1
        self._trace(f"{why} n{nid}")
        # A supervisor may restart a process at once, or only much later.
        lo, hi = (50, BASE_TICK) if fast or self.rng.random() < 0.3 else (BASE_TICK, 30 * BASE_TICK)
        self._at(self.now + self.rng.randrange(lo, hi), "restart", nid)

    def _resume(self, nid: int) -> None:
        n = self.nodes.get(nid)
        if n is None or not n.paused:
            return
        n.paused = False
        self._trace(f"resume n{nid} ({self.missed_ticks.get(nid, 0)} missed ticks)")
        # The runtime ticks by the monotonic clock: missed ticks fire first.
        for _ in range(self.missed_ticks.pop(nid, 0)):
            n.raft.tick()
        self._process(nid)
        for m in self.held.pop(nid, []):
            if nid in self.nodes:
                self.nodes[nid].raft.step(m)
                self._process(nid)

    def _partition(self) -> None:
        rng = self.rng
        ids = sorted(self.nodes) or sorted(self.storages)
        everyone = sorted(set(self.storages) - self.removed)
        if len(everyone) < 2:
            return
        shape = rng.choice(["isolate", "leader", "halves", "bridge", "ring", "oneway"])
        groups: list[set[int]] = []
        if shape in ("isolate", "leader", "oneway"):
            target = self._leader() if shape == "leader" and self._leader() else rng.choice(ids)
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
            mid = shuffled[0]
            rest = shuffled[1:]
            k = len(rest) // 2
            a, b = set(rest[:k]), set(rest[k:])
            for x in a:
                for y in b:
                    self.blocked.add((x, y))
                    self.blocked.add((y, x))
            _ = mid
        elif shape == "ring":
            ring = list(everyone)
            rng.shuffle(ring)
            k = len(ring)
            for i, x in enumerate(ring):
                for j, y in enumerate(ring):
                    d = min((i - j) % k, (j - i) % k)
                    if x != y and d > 1:
                        self.blocked.add((x, y))
        for g in groups:
            for x in g:
                for y in everyone:
                    if y not in g:
                        self.blocked.add((x, y))
                        self.blocked.add((y, x))
        self.stats["partitions"] += 1
        self._trace(f"partition {shape} blocked={sorted(self.blocked)}")
        self._at(self.now + rng.randrange(5 * BASE_TICK, 60 * BASE_TICK), "heal", None)

    def _heal_all(self) -> None:
        self.blocked.clear()
        for nid in sorted(self.nodes):
            if self.nodes[nid].paused:
                self._resume(nid)
        for nid in sorted(self.storages):
            if nid not in self.nodes and nid not in self.removed:
                self._spawn(nid)
        self._trace("quiet phase: healed, resumed, restarted")

    # ------------------------------------------------------------------ liveness
    def _check_liveness(self) -> None:
        """After healing: a leader exists and every live member applies all of
        its log within a bounded time (replication never stays stuck)."""
        deadline = self.now + 60 * BASE_TICK
        while self.now < deadline:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = max(self.now, t)
            if kind in ("tick", "msg", "restart"):
                self._dispatch(kind, payload)
            self._check_global()
            lead = self._leader()
            if not lead:
                continue
            lr = self.nodes[lead].raft
            if lr.log.committed == lr.log.last_index() and all(
                self.nodes[m].raft.log.applied == lr.log.committed
                for m in lr.config.members()
                if m in self.nodes
            ):
                return
        state = {
            m: (
                self.nodes[m].raft.role.name,
                self.nodes[m].raft.term,
                self.nodes[m].raft.log.applied,
            )
            for m in sorted(self.nodes)
        }
        self.fail(f"liveness: no leader or replicas did not converge after healing: {state}")


def run_seed(seed: int, cfg: SimConfig) -> Simulation:
    return Simulation(seed, cfg).run()


# Nemesis emphases. "mixed" is the standard run; the others turn up the fault
# that a particular protocol bug needs before it can show (as Jepsen picks
# nemeses per bug): figure 8 needs divergent uncommitted tails and leaders
# that die before their no-op spreads; a lost vote needs a crash right after
# voting and no stickiness to mask it.
PROFILES: dict[str, dict[str, Any]] = {
    "mixed": {},
    "figure8": {
        "voters": 5,
        "learners": 0,
        "crash_after_elected_rate": 0.3,
        "max_msg_bytes": 64,
        "drop_rate": 0.1,
        "membership": False,
    },
    "lease": {
        # leaders isolated or paused while clients keep reading from whoever
        # believes it leads: what a lease bug needs to turn into a stale read.
        "voters": 3,
        "learners": 0,
        "pause_rate": 0.004,
        "partition_rate": 0.006,
        "stale_leader_reads": 0.5,
        "membership": False,
    },
    "vote-loss": {
        # vanilla Raft (no pre-vote, no stickiness), tight timeouts and a slow
        # network: split votes are common and a vote can be in flight across
        # the crash of the node that granted the other one.
        "voters": 5,
        "learners": 0,
        "crash_after_vote_rate": 0.5,
        "check_quorum": False,
        "pre_vote": False,
        "election_ticks": 4,
        "lease_drift_ticks": 1,
        "max_delay": 1500,
        "drop_rate": 0.1,
        "membership": False,
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
        # a tiny entry cache makes every path through the cache's trimming run
        log_cache_entries_max=r.choice([65536, 3, 17]),
        log_cache_bytes_max=r.choice([64 << 20, 100]),
        # almost no trailing entries: lagging nodes need InstallSnapshot
        snapshot_trailing_entries=r.choice([0, 1, 2, 5, 50]),
        mixed=True,
    )
    return dataclasses.replace(cfg, profile=profile, **PROFILES[profile])


Progress = Callable[[str], None]
