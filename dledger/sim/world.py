"""The simulated world a real :class:`dledger.node.Node` runs in.

Theory of operation
-------------------
Every simulated node process is a :class:`Host`: its own asyncio event loop
(:class:`VirtualLoop`, whose selector never blocks and whose ``time()`` is the
host's *local* clock), a :class:`SimStorage` that survives the process, and a
:class:`SimTransport` on the shared :class:`SimNetwork`. The node's
:class:`~dledger.runtime.NodeEnv` points at all of these, so the node's own
loop code (tick catch-up, group commit, apply batching, snapshot tasks,
snapshot streaming, leadership transfer, lease reads) is what runs.

Time. Global (real) time is a float in seconds, owned by the scheduler in
:mod:`dledger.sim.cluster`. A host's local clock is ``offset + rate * g``
(``rate`` models clock drift). The scheduler always runs, next, the host
whose earliest ready callback or timer is due soonest in global time, one
``_run_once`` at a time. While a host runs, its ``work()`` hook charges
virtual CPU time (and now and then a long stall), so its clock moves on
*inside* the pass: later sends of that pass leave late, and the other hosts
may act (elect a new leader) before this host's next pass, which cannot
start before its ``busy_until``.

Determinism: no threads, no wall clock, no iteration over sets of objects;
``offload`` runs the function on the loop after a virtual delay. A crash is a
:class:`HostCrashed` (a ``SystemExit``, which asyncio lets through its tasks)
raised from the work hook, or the scheduler discarding the loop between
passes; either way the storage loses every write since its last sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import inspect
import random
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from dledger.core.types import Entry, EntryType, Snapshot, SnapshotMeta
from dledger.metrics import Histogram
from dledger.storage.memory import MemoryStorage

if TYPE_CHECKING:
    from dledger.sim.cluster import Simulation

T = TypeVar("T")
_EPS = 1e-7  # seconds: global due times are rounded up by this (float inverse)


class HostCrashed(SystemExit):
    """Raised inside a host's pass to crash it there (asyncio re-raises
    SystemExit out of tasks and handles, so it unwinds the whole pass)."""


class _NullSelector:
    def select(self, timeout: float | None = None) -> list[Any]:
        return []

    def close(self) -> None:
        return None


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop that never waits: the scheduler decides when it runs."""

    def __init__(self, host: Host) -> None:
        super().__init__()
        self._selector = _NullSelector()
        self._host = host
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._host.local_now()

    def _process_events(self, event_list: Any) -> None:
        return None

    def _write_to_self(self) -> None:
        return None

    def next_due_local(self) -> float | None:
        """Local time of the earliest thing to do; -inf when a callback is ready."""
        ready: Any = self._ready  # type: ignore[attr-defined]
        if ready:
            return float("-inf")
        sched: list[Any] = self._scheduled  # type: ignore[attr-defined]
        while sched and sched[0]._cancelled:
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
            h = heapq.heappop(sched)
            h._scheduled = False
        if sched:
            return float(sched[0]._when)
        return None

    def run_pass(self) -> None:
        asyncio.events._set_running_loop(self)
        try:
            self._run_once()  # type: ignore[attr-defined]
        finally:
            asyncio.events._set_running_loop(None)

    def discard(self) -> None:
        """The process died: nothing of this loop runs again, and nothing it
        left behind complains when it is garbage-collected."""
        self.set_exception_handler(lambda loop, ctx: None)
        # Close every coroutine now, with this loop as the running one, in a
        # fixed order (task names carry a creation counter), instead of leaving
        # suspended coroutines to the garbage collector: CPython 3.11 crashed
        # (SIGSEGV, "Garbage-collecting") finalizing them later, under
        # another loop or none (vote-loss seed 21 of skip_vote_persist).
        tasks = sorted(asyncio.all_tasks(self), key=_task_order)
        asyncio.events._set_running_loop(self)
        try:
            for task in tasks:
                task._log_destroy_pending = False  # type: ignore[attr-defined]
                coro = task.get_coro()
                if inspect.iscoroutine(coro):
                    with contextlib.suppress(BaseException):
                        coro.close()
        finally:
            asyncio.events._set_running_loop(None)
        self._ready.clear()  # type: ignore[attr-defined]
        self._scheduled.clear()  # type: ignore[attr-defined]
        if not self.is_closed():
            self.close()


def _task_order(task: asyncio.Task[Any]) -> tuple[int, str]:
    name = task.get_name()
    head, _, tail = name.rpartition("-")
    return (int(tail), head) if tail.isdigit() else (-1, name)


# ==========================================================================
# storage
# ==========================================================================
class SimStorage(MemoryStorage):
    """MemoryStorage plus what the node calls on LmdbStorage.

    ``flush="sync"``: ``sync()`` makes everything durable (``crash()`` loses
    what came after the last one). ``flush="async"``: ``sync()`` only commits;
    ``maybe_flush()`` makes the committed state durable once per interval, so
    a crash loses the unflushed tail even of acknowledged entries.
    ``no_fsync``: nothing ever becomes durable (planted bug)."""

    def __init__(
        self,
        nid: int,
        sim: Simulation,
        flush: str = "sync",
        flush_interval_s: float = 0.2,
        no_fsync: bool = False,
    ) -> None:
        super().__init__()
        self.nid = nid
        self.sim = sim
        self.flush_mode = flush
        self.flush_interval_s = flush_interval_s
        self.no_fsync = no_fsync
        self.fsync_seconds = Histogram()
        self.write_txns = 0
        self.flushes = 0
        self.map_growths = 0
        self._committed: Any = None
        self._last_flush_s: float | None = None
        self._behind = 0  # syncs since the last catch-up (sync mode)
        self.catch_ups = 0

    # -- checked writes ----------------------------------------------------
    def append(self, entries: Sequence[Entry]) -> None:
        if entries:
            self.sim.check_append(self.nid, self, entries)
        super().append(entries)

    # -- what the node needs beyond MemoryStorage --------------------------
    def snapshot_meta(self) -> SnapshotMeta | None:
        snap = self.snapshot()
        return snap.meta if snap is not None else None

    def write_snapshot_file(self, snap: Snapshot) -> str:
        return f"snap-{snap.meta.index}-{snap.meta.term}"

    def record_snapshot(self, snap: Snapshot, name: str) -> bool:
        held = self.snapshot_meta()
        if held is not None and held.index >= snap.meta.index:
            return False
        self.save_snapshot(snap)
        return True

    def epoch_map(self) -> dict[int, int]:
        return {}

    def sync(self, *, catch_up: bool = True) -> None:
        self.write_txns += 1
        if self.flush_mode == "sync":
            # LmdbStorage's catch-up of its write-ahead log, which a node runs
            # after its group commit's answers (Node._catch_up): due every few
            # syncs here, so the simulated nodes take that path too. Nothing
            # becomes more durable by it (sync() already made all of it so).
            self._behind += 1
            if catch_up and self._behind >= self.CATCH_UP_EVERY:
                self._behind = 0
        if self.no_fsync:
            return
        if self.flush_mode == "async":
            durable_hs = self._durable[4]
            if (self._hs.term, self._hs.vote) == (durable_hs.term, durable_hs.vote):
                self._committed = self._image()
                return
            # A new term or vote is fsynced at once (LmdbStorage.sync), and
            # with it every commit before it.
            self._committed = None
            self.flushes += 1
        super().sync()

    CATCH_UP_EVERY = 5

    def catch_up_due(self) -> bool:
        return self._behind >= self.CATCH_UP_EVERY

    def checkpoint(self) -> bool:
        self._behind = 0
        self.catch_ups += 1
        return True

    def flush_pending(self) -> bool:
        return self.flush_mode == "async" and self._committed is not None

    def maybe_flush(self, now_s: float) -> bool:
        if self.flush_mode != "async" or self._committed is None:
            return False
        if self._last_flush_s is not None and now_s - self._last_flush_s < self.flush_interval_s:
            return False
        self._durable = self._committed
        self._committed = None
        self._last_flush_s = now_s
        self.flushes += 1
        return True

    def close(self) -> None:
        return None

    def crash(self) -> None:
        self._committed = None
        super().crash()

    def _image(self) -> Any:
        return (
            list(self._entries),
            self._offset,
            self._offset_term,
            self._offset_pos,
            self._hs,
            self._snap,
        )


# ==========================================================================
# state machine
# ==========================================================================
_SM = struct.Struct(">QQIH")  # index, register index, register length, digest length


class SimStateMachine:
    """A running digest of applied entries (index, term, CRC) plus a register
    holding the last written value, so reads return something checkable."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.index = 0
        self.digest = b""
        self.reg_index = 0  # index of the write the register holds
        self.register = b""

    def apply(self, entry: Entry) -> object:
        if entry.index != self.index + 1:
            self.host.sim.fail(
                f"node {self.host.nid} applies {entry.index} after {self.index} (gap or reapply)"
            )
        h = zlib.crc32(entry.data)
        self.digest = _digest(self.digest, entry.index, entry.term, h)
        self.index = entry.index
        if entry.type is EntryType.NORMAL:
            self.reg_index, self.register = entry.index, entry.data
        self.host.sim.on_apply(self.host, entry, self.digest)
        return entry.index

    def snapshot(self) -> bytes:
        return self.snapshot_builder()()

    def snapshot_builder(self) -> Callable[[], bytes]:
        head = _SM.pack(self.index, self.reg_index, len(self.register), len(self.digest))
        # padding: a snapshot takes several stream chunks (chunks are >= 1 KiB)
        data = head + self.register + self.digest + bytes(self.host.sim.cfg.sm_pad_bytes)
        return lambda: data

    def restore(self, data: bytes) -> None:
        index, reg_index, n, dn = _SM.unpack_from(data, 0)
        off = _SM.size
        register = bytes(data[off : off + n])
        digest = bytes(data[off + n : off + n + dn])
        self.host.sim.on_restore(self.host, index, digest)
        self.index, self.digest, self.reg_index, self.register = index, digest, reg_index, register


def _noop() -> None:
    return None


def _digest(prev: bytes, index: int, term: int, crc: int) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(index.to_bytes(8, "big") + term.to_bytes(8, "big") + crc.to_bytes(4, "big"))
    return h.digest()


# ==========================================================================
# network
# ==========================================================================
class SimTransport:
    """The node's transport: frames go to :class:`SimNetwork` with the
    sender's current global time; arrivals are callbacks on this host's loop."""

    def __init__(self, host: Host, on_message: Callable[[int, bytes], None]) -> None:
        self.host = host
        self.on_message = on_message
        self.peers: tuple[int, ...] = ()
        self.counters: dict[str, int] = {"frames_sent": 0, "frames_received": 0, "holds": 0}
        self.running = False
        # hold_inbound: frames that arrived meanwhile wait here, as in a held
        # socket's buffer (lost with the process); after the release they
        # are delivered by a callback of the loop's next turn, and whatever
        # arrives before that callback queues behind them (per-link order)
        self.holding = False
        self.waiting: list[tuple[int, bytes]] = []

    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False
        self.holding = False
        self.waiting = []

    def hold_inbound(self) -> None:
        if not self.holding and self.running:
            self.holding = True
            self.counters["holds"] += 1

    def release_inbound(self) -> None:
        if self.holding:
            self.holding = False
            if self.waiting:
                self.host.loop.call_soon(self._deliver_waiting)

    def _deliver_waiting(self) -> None:
        if self.holding:
            return  # held again first: the next release delivers them
        frames, self.waiting = self.waiting, []
        for frm, payload in frames:
            self.receive(frm, payload)

    def send(self, to: int, payload: bytes) -> bool:
        if not self.running or to not in self.peers:
            return False
        self.counters["frames_sent"] += 1
        self.host.sim.net_send(self.host.nid, to, payload, self.host.global_now())
        return True

    def receive(self, frm: int, payload: bytes) -> None:
        if not self.running or frm not in self.peers:
            self.counters["rejected_unknown_sender"] = (
                self.counters.get("rejected_unknown_sender", 0) + 1
            )
            return  # like the TCP handshake: only configured peers get in
        if self.holding or self.waiting:
            self.waiting.append((frm, payload))
            return
        self.counters["frames_received"] += 1
        self.on_message(frm, payload)

    def update_peers(self, peers: Mapping[int, tuple[str, int]]) -> None:
        self.peers = tuple(sorted(peers))

    def peer_status(self, peer_id: int) -> Any:
        return None

    @property
    def stats(self) -> Mapping[str, int]:
        return dict(self.counters)


# ==========================================================================
# host
# ==========================================================================
class Host:
    """One node process: loop, clock, env, and the Node it runs."""

    def __init__(
        self, sim: Simulation, nid: int, storage: SimStorage, rate: float, offset: float
    ) -> None:
        self.sim = sim
        self.nid = nid
        self.storage = storage
        self.rate = rate
        self.offset = offset
        self.loop = VirtualLoop(self)
        self.transport: SimTransport | None = None
        self.sm = SimStateMachine(self)
        self.rng = random.Random(sim.rng.getrandbits(64))
        self.paused = False
        self.alive = True
        self.busy_until = sim.now
        self.running_at: float | None = None  # pass start (global) while in a pass
        self.consumed = 0.0
        self.node: Any = None  # dledger.node.Node (set by the simulation)
        self.commit_seen = 0
        self.leader_term = 0
        self.apply_cost_s = sim.cfg.apply_cost_s
        self.slow_until = 0  # applied index up to which apply_cost_s applies
        self._submitted: set[asyncio.Task[None]] = set()  # submit()'s tasks

    # -- time --------------------------------------------------------------
    def global_now(self) -> float:
        if self.running_at is not None:
            return self.running_at + self.consumed
        return max(self.sim.now, self.busy_until)

    def local_now(self) -> float:
        return self.offset + self.rate * self.global_now()

    def to_global(self, local: float) -> float:
        return (local - self.offset) / self.rate + _EPS

    def next_due(self) -> float:
        if not self.alive or self.paused:
            return float("inf")
        when = self.loop.next_due_local()
        if when is None:
            return float("inf")
        g = self.busy_until if when == float("-inf") else self.to_global(when)
        return max(g, self.busy_until)

    # -- env hooks ---------------------------------------------------------
    def work(self, kind: str, n: int) -> None:
        c = self.sim.cfg
        if kind == "apply":
            # a slow replay is slow up to what was committed at the restart
            cost = self.apply_cost_s if self.sm.index < self.slow_until else c.apply_cost_s
        elif kind == "step":
            cost = c.step_cost_s
        elif kind == "op":
            cost = c.op_cost_s
        else:
            cost = c.persist_cost_s
        self.consumed += cost * n
        if (
            self.sim.faulty
            and kind in c.stall_kinds
            and self.sim.fault_rng.random() < c.stall_rate * n
        ):
            stall = self.sim.fault_rng.uniform(c.stall_min_s, c.stall_max_s)
            self.consumed += stall
            self.sim.stats["stalls"] += 1
            self.sim.trace(f"stall n{self.nid} {kind} {stall * 1000:.1f}ms")
        if self.sim.faulty and self.sim.fault_rng.random() < c.mid_pass_crash_rate * n:
            self.sim.trace(f"crash-mid-pass n{self.nid} at {kind}")
            raise HostCrashed(self.nid)

    async def offload(self, fn: Callable[..., T], /, *args: Any) -> T:
        c = self.sim.cfg
        d = self.rng.uniform(c.sync_min_s, c.sync_max_s)
        if self.rng.random() < c.slow_sync_rate:
            d += self.rng.uniform(0.0, c.slow_sync_s)
        await asyncio.sleep(d)
        return fn(*args)

    def submit(
        self, fn: Callable[[], None], on_done: Callable[[BaseException | None], None]
    ) -> None:
        """``offload`` started as a task; its outcome handed to ``on_done``
        (a HostCrashed still unwinds the pass, as it does out of any task)."""

        async def run() -> None:
            try:
                await self.offload(fn)
            except Exception as exc:
                on_done(exc)
                return
            on_done(None)

        task = self.loop.create_task(run())
        self._submitted.add(task)
        task.add_done_callback(self._submitted.discard)

    def open_storage(self, cfg: Any) -> tuple[SimStorage, Callable[[], None]]:
        return self.storage, _noop

    def make_transport(
        self,
        node_id: int,
        cluster_id: str,
        host: str,
        port: int,
        peers: dict[int, tuple[str, int]],
        secret: bytes | None,
        on_message: Callable[[int, bytes], None],
    ) -> SimTransport:
        t = SimTransport(self, on_message)
        t.update_peers(peers)
        self.transport = t
        return t

    def deliver(self, frm: int, payload: bytes) -> None:
        t = self.transport
        if t is not None and self.alive:
            self.loop.call_soon(t.receive, frm, payload)
