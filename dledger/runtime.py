"""What a :class:`dledger.node.Node` needs from the world, in one object.

Theory of operation
-------------------
The node's loop is the only I/O-doing code around the pure core. Everything
it takes from the outside world goes through a :class:`NodeEnv`:

* ``clock()``: monotonic seconds (every timer, tick catch-up and lag
  measurement of the node reads it, never ``time.monotonic`` directly);
* ``offload(fn, *args)``: run blocking work (fsync, snapshot encoding and
  file writes) off the loop and await its result;
* ``submit(fn, on_done)``: start blocking work off the loop at once, without
  a task; ``on_done(exc_or_None)`` is called on the loop when it returns
  (the leader's group commit: one wake-up of the loop when the fsync ends);
* ``rng``: the randomness handed to the core (election timeouts);
* ``open_storage(cfg)``: the durable log, plus a release callback run after
  the storage is closed (production: the data-directory lock);
* ``make_transport(...)``: the peer network;
* ``work(kind, n)``: called by the loop per stepped message (``"step"``),
  per queued op (``"op"``), per persisted entry (``"persist"``) and per
  applied entry (``"apply"``). Production does nothing; the simulator
  charges virtual CPU time there and injects stalls in the middle of a pass.

:func:`production_env` is what ``Node(cfg)`` uses when no env is passed:
behaviour identical to a node without this module. The simulator
(:mod:`dledger.sim`) builds an env over a virtual clock, an in-memory
crashing storage and a seeded lossy network, so it runs the real node loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dledger.errors import ConfigError
from dledger.metrics import Histogram

if TYPE_CHECKING:
    from dledger.config import NodeConfig
    from dledger.core.types import Entry, HardState, Snapshot, SnapshotMeta

T = TypeVar("T")

OnMessage = Callable[[int, bytes], None]


class NodeStorage(Protocol):
    """What the node loop calls on its storage (LmdbStorage implements it;
    the simulator's SimStorage too). The core's LogStorage/StableStore
    methods are part of it, since the node hands the same object to RawNode."""

    fsync_seconds: Histogram
    write_txns: int
    flushes: int
    map_growths: int

    # LogStorage / StableStore (what RawNode uses)
    def first_index(self) -> int: ...
    def last_index(self) -> int: ...
    def term(self, index: int) -> int: ...
    def front_pos(self) -> int: ...
    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]: ...
    def append(self, entries: Sequence[Entry]) -> None: ...
    def truncate_from(self, index: int) -> None: ...
    def compact(self, upto: int, term: int, pos: int) -> None: ...
    def hard_state(self) -> HardState: ...
    def save_hard_state(self, hs: HardState) -> None: ...
    # snapshots
    def snapshot(self) -> Snapshot | None: ...
    def snapshot_meta(self) -> SnapshotMeta | None: ...
    def apply_snapshot(self, snap: Snapshot) -> None: ...
    def write_snapshot_file(self, snap: Snapshot) -> str: ...
    def record_snapshot(self, snap: Snapshot, name: str) -> bool: ...
    # durability and lifecycle
    def sync(self, *, catch_up: bool = True) -> None: ...
    def small_batch(self, max_bytes: int) -> bool: ...
    def catch_up_due(self) -> bool: ...
    def catches_up(self) -> bool: ...
    def checkpoint(self) -> bool: ...
    def maybe_flush(self, now_s: float) -> bool: ...
    def flush_pending(self) -> bool: ...
    def epoch_map(self) -> dict[int, int]: ...
    def close(self) -> None: ...


class PeerStatusLike(Protocol):
    outbound_connected: bool
    inbound_connected: bool
    queued_frames: int


class NodeTransport(Protocol):
    """What the node calls on its transport (TcpTransport implements it)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def send(self, to: int, payload: bytes) -> bool: ...
    def update_peers(self, peers: Mapping[int, tuple[str, int]]) -> None: ...
    def peer_status(self, peer_id: int) -> Any: ...
    def hold_inbound(self) -> None: ...
    def release_inbound(self) -> None: ...

    @property
    def stats(self) -> Mapping[str, int]: ...


MakeTransport = Callable[
    [int, str, str, int, dict[int, tuple[str, int]], bytes | None, OnMessage], NodeTransport
]


def lock_data_dir(data_dir: str) -> int:
    """Take an exclusive lock on ``data_dir`` for this process's lifetime.

    LMDB lets several processes open one environment; two nodes writing one
    log would destroy it, so a second node on the same directory is refused."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "node.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"data directory {data_dir} is in use by another node process (pid {holder})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def open_lmdb_storage(cfg: NodeConfig) -> tuple[NodeStorage, Callable[[], None]]:
    """Lock the data directory and open LMDB there. The callback releases
    the lock (after ``close()``); it is released on failure here already."""
    from dledger.storage.lmdb_store import LmdbStorage

    fd = lock_data_dir(cfg.data_dir)

    def release() -> None:
        os.close(fd)  # closing the descriptor releases the flock

    try:
        storage = LmdbStorage.open(
            cfg.data_dir,
            map_size=cfg.map_size_bytes,
            flush=cfg.flush,
            flush_interval_s=cfg.flush_interval_ms / 1000,
            verify=cfg.verify,
            verify_tail=cfg.verify_tail_entries,
        )
    except BaseException:
        release()
        raise
    return storage, release


def make_tcp_transport(
    node_id: int,
    cluster_id: str,
    host: str,
    port: int,
    peers: dict[int, tuple[str, int]],
    secret: bytes | None,
    on_message: OnMessage,
) -> NodeTransport:
    from dledger.transport.tcp import TcpTransport

    return TcpTransport(node_id, cluster_id, host, port, peers, secret, on_message)


async def to_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


class Offload(Protocol):
    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


OnDone = Callable[[BaseException | None], None]
Submit = Callable[[Callable[[], None], OnDone], None]

# One pool for the process (its threads start on first use): a node has at
# most one group commit in flight, so its commits reuse one idle thread.
_POOL = concurrent.futures.ThreadPoolExecutor(
    max_workers=(os.cpu_count() or 1) + 4, thread_name_prefix="dledger-io"
)


def submit_to_thread(fn: Callable[[], None], on_done: OnDone) -> None:
    """Run ``fn`` on a worker thread, starting now (no task, whose first
    step waits for the loop's next turn), and call ``on_done`` with its
    exception or None on the calling loop when it returns. The completion
    costs the loop one wake-up (its self-pipe) and one callback; awaiting
    ``asyncio.to_thread`` costs four turns of callbacks (the future chain,
    the task, the waiter) before the awaiting code runs again."""
    loop = asyncio.get_running_loop()

    def run() -> None:
        exc: BaseException | None = None
        try:
            fn()
        except BaseException as e:  # handed to the loop, which raises it there
            exc = e
        # RuntimeError: the loop closed meanwhile (the node stopped without waiting)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(on_done, exc)

    _POOL.submit(run)


def _no_work(kind: str, n: int) -> None:
    return None


# See NodeEnv.inline_sync_bytes.
INLINE_SYNC_BYTES = 256 << 10


@dataclass(slots=True)
class NodeEnv:
    """The node's runtime environment; see the module docstring."""

    clock: Callable[[], float] = time.monotonic
    offload: Offload = to_thread
    submit: Submit = submit_to_thread
    rng: random.Random = field(default_factory=random.Random)
    open_storage: Callable[[NodeConfig], tuple[NodeStorage, Callable[[], None]]] = open_lmdb_storage
    make_transport: MakeTransport = make_tcp_transport
    work: Callable[[str, int], None] = _no_work
    # CPU time of the calling thread (a metric only: the simulator keeps it)
    cpu_clock: Callable[[], float] = time.thread_time
    # A follower's group commit the storage calls small (``small_batch`` of
    # this many bytes) runs on the loop instead of through ``offload``; 0
    # sends every one through ``offload`` (the simulator does, to inject its
    # delays).
    inline_sync_bytes: int = INLINE_SYNC_BYTES


def production_env() -> NodeEnv:
    return NodeEnv()
