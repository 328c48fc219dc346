"""Planted bugs, for proving that the harness's checkers can fail.

A node process reads ``DLEDGER_FAULTS`` (comma-separated switch names) at
start-up, and accepts it only when ``DLEDGER_ENABLE_FAULTS=1`` is also set:
a switch without the enable variable, or an unknown switch, is a
:class:`~dledger.errors.ConfigError` (the node refuses to start, exit 2).
Production never sets either variable. Every hook in the product is one
line that calls :func:`on` and is marked ``planted bug``.

Switches (each breaks exactly one promise; the checker that must notice it):

``ack_before_commit``
    A produce is answered at once with the offsets it *would* get, and the
    entry is proposed in the background. Acknowledged writes are lost when
    that entry never commits (leader killed or isolated): the queue checker
    reports lost writes / inconsistent offsets, the linearizability checker
    fails.
``lin_read_no_lease``
    ``consistency=linearizable`` reads are served from local state on any
    node, without leadership, lease or ReadIndex: stale reads from lagging
    or partitioned replicas.
``skip_fsync``
    The log is written without fsync, and a restarted node loses the last
    ``DLEDGER_FAULT_LOST_TAIL`` (default 64) entries of its log, as after a
    power failure (a SIGKILL alone keeps the page cache, so the loss is
    simulated at open). Killing a majority then loses acknowledged writes.
    On the harness's power-loss nemesis (``jepsen_like.lazyfs``) the
    filesystem drops the unsynced writes itself: with
    ``DLEDGER_FAULT_LOST_TAIL=0`` (no simulated loss) a power loss of a
    majority is what loses them (``tests/jepsen/test_power_nemesis.py``).
``ack_below_commit``
    The old rule of issue 20: a follower answers an AppendEntries below its
    commit index with that commit index, unchecked, instead of comparing
    what it committed with the leader's log. After a majority power loss in
    ``flush = "async"`` mode a survivor then keeps serving a history the
    leader does not have: the ``replicas`` checker reports divergent
    offsets (``tests/jepsen/test_power_loss.py``).
``cmode_confirm_from_master``
    Controller mode: the master's confirm offset follows its own log alone,
    not the minimum over the SyncStateSet, so a produce is acknowledged
    (and consumers read it) before any slave holds it. A master killed or
    cut off then takes acknowledged writes with it when the controller
    elects a slave: the queue checker reports lost writes.
``cmode_skip_truncation``
    Controller mode: a slave joining a new master keeps its forked tail (it
    follows from its own last entry instead of the last consistent point
    the epoch maps give) and applies it as confirmed: the ``replicas``
    checker reports offsets at which replicas hold different messages.
``follower_reads_uncommitted``
    A follower treats every entry it appended as committed (its commit
    index follows its log, not the leader's), so it applies and serves
    entries that may never commit; with 5 voters a leader cut off with one
    follower lets that follower serve values that a new leader overwrites.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from dledger.errors import ConfigError

ENABLE_ENV = "DLEDGER_ENABLE_FAULTS"
SWITCHES_ENV = "DLEDGER_FAULTS"
LOST_TAIL_ENV = "DLEDGER_FAULT_LOST_TAIL"

ACK_BEFORE_COMMIT = "ack_before_commit"
LIN_READ_NO_LEASE = "lin_read_no_lease"
SKIP_FSYNC = "skip_fsync"
FOLLOWER_READS_UNCOMMITTED = "follower_reads_uncommitted"
ACK_BELOW_COMMIT = "ack_below_commit"
CMODE_CONFIRM_FROM_MASTER = "cmode_confirm_from_master"
CMODE_SKIP_TRUNCATION = "cmode_skip_truncation"
KNOWN = frozenset(
    {
        ACK_BEFORE_COMMIT,
        LIN_READ_NO_LEASE,
        SKIP_FSYNC,
        FOLLOWER_READS_UNCOMMITTED,
        ACK_BELOW_COMMIT,
        CMODE_CONFIRM_FROM_MASTER,
        CMODE_SKIP_TRUNCATION,
    }
)

# The core's own switches (dledger.core.raft) that some of these map to.
_CORE = {
    FOLLOWER_READS_UNCOMMITTED: "follower_commits_ahead",
    ACK_BELOW_COMMIT: "ack_below_commit",
}

logger = logging.getLogger(__name__)


def parse(environ: dict[str, str] | None = None) -> frozenset[str]:
    """The switches ``environ`` asks for; ConfigError when not allowed or unknown."""
    env = os.environ if environ is None else environ
    raw = env.get(SWITCHES_ENV, "").strip()
    if not raw:
        return frozenset()
    if env.get(ENABLE_ENV) != "1":
        raise ConfigError(
            f"{SWITCHES_ENV}={raw!r} is set but {ENABLE_ENV}=1 is not: "
            "fault switches are planted bugs for harness tests only"
        )
    names = frozenset(x.strip() for x in raw.split(",") if x.strip())
    unknown = sorted(names - KNOWN)
    if unknown:
        raise ConfigError(f"{SWITCHES_ENV}: unknown switch(es) {unknown} (known: {sorted(KNOWN)})")
    return names


@functools.cache
def active() -> frozenset[str]:
    names = parse()
    if names:
        logger.warning("PLANTED BUGS ACTIVE (%s): this node is deliberately unsafe", sorted(names))
    return names


def on(name: str) -> bool:
    return name in active()


def core_faults() -> frozenset[str]:
    """The Raft core's fault switches (``RaftConfig.faults``) the active ones imply."""
    return frozenset(_CORE[n] for n in active() if n in _CORE)


# --------------------------------------------------------------------------- hooks


class _Storage(Protocol):
    def first_index(self) -> int: ...
    def last_index(self) -> int: ...
    def truncate_from(self, index: int) -> None: ...
    def sync(self) -> None: ...


def lose_unsynced_tail(storage: _Storage) -> None:
    """skip_fsync: drop the log tail a power failure would have lost."""
    if not on(SKIP_FSYNC):
        return
    n = int(os.environ.get(LOST_TAIL_ENV, "64"))
    first, last = storage.first_index(), storage.last_index()
    cut = max(first, last - n + 1, 1)
    if last >= cut:
        logger.warning("planted bug skip_fsync: dropping log entries %d..%d", cut, last)
        storage.truncate_from(cut)
        storage.sync()


_predicted: dict[tuple[str, int], int] = {}
_background: set[asyncio.Future[Any]] = set()


def ack_before_commit(
    node: Any, broker: Any, topic: str, queues_asked: Sequence[int | None], data: bytes
) -> dict[str, Any]:
    """ack_before_commit: the response a produce gets before its entry commits.

    Offsets are predicted as the queue's end plus what this node already
    promised; the entry is proposed in the background and its outcome ignored.
    """
    queues = broker.topic(topic).queues
    acks = []
    for asked in queues_asked:
        q = asked if asked is not None else 0
        off = max(int(queues[q].max_offset), _predicted.get((topic, q), 0))
        _predicted[(topic, q)] = off + 1
        acks.append(
            {
                "queue": q,
                "queue_offset": off,
                "commit_offset": -1,
                "size": 0,
                "msg_id": "",
                "duplicate": False,
            }
        )
    fut = asyncio.ensure_future(node.propose_entry(data))
    _background.add(fut)
    fut.add_done_callback(_forget)
    return {"topic": topic, "duplicate": False, "store_ts_ms": 0, "messages": acks}


def _forget(fut: asyncio.Future[Any]) -> None:
    _background.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: the bug ignores the outcome
