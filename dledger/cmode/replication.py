"""Controller mode's HA link without I/O: what a master sends its slaves and
what a slave does with what it receives.

Theory of operation
-------------------
Who is master, of which epoch, is the controller's word (the driver learns
it from heartbeat answers and builds a :class:`MasterLink` or a
:class:`SlaveLink` for that epoch). Both sides are fed messages and return
actions; the driver performs them in order: persist, then send.

Slave, joining: it sends ``JOIN`` with its log's ``(min, max]`` and epoch
map; the master answers with its own; the slave decides with
:func:`~dledger.cmode.epochs.join_decision` (the six cases): truncate to the
last consistent point (``Truncate``), or refuse (case 3-3, no common epoch,
or a reset that would need a snapshot: this first version never compacts a
controller-mode log, so a reset is only possible from an empty master
head). Once the truncation is durable (:meth:`SlaveLink.on_durable`) it
acknowledges the point it truncated to, and the master starts pushing from
there.

Master, pushing: per joined slave a ``next`` index; pushes go out
pipelined, up to ``max_batch_bytes`` per message and ``max_inflight``
entries past the slave's acknowledgement; an empty push every
``heartbeat_ms`` carries the confirm offset. Messages may be lost (never
reordered within one peer), so a push names the index before its first
entry (``prev``): a slave that sees a gap answers ``ACK`` with ``need``,
and a master whose slave's acknowledgement has not moved for
``resend_ms`` pushes again from it.

Acknowledgements count only from the slave's current master, in the
current epoch, after its join: a slave drops pushes from any other node (a
deposed master that does not know it yet), so an old master's confirm
offset cannot move on acknowledgements its slaves did not give it. What it
can do, with no lease (RocketMQ has none), is confirm writes on its own
when its SyncStateSet allows that: the comparison shows what that costs.

A slave's epoch map follows the entries it appends: an entry of a newer
epoch than its map's last starts that epoch at the index before it. The
confirm offset a slave may apply up to is the master's confirm offset,
capped by what the slave holds durably.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dledger.cmode.codec import Ack, HaMessage, Join, JoinReply, Push
from dledger.cmode.epochs import EpochMap, JoinAction, join_decision
from dledger.cmode.master import MasterCore
from dledger.core.types import Entry


class LogView(Protocol):
    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]: ...


@dataclass(frozen=True, slots=True)
class Send:
    to: int
    msg: HaMessage


@dataclass(frozen=True, slots=True)
class Truncate:
    """Slave: durably drop every entry after ``to`` (and the epochs starting
    at or after it), then call :meth:`SlaveLink.on_durable`."""

    to: int


@dataclass(frozen=True, slots=True)
class Append:
    """Slave: durably append ``entries`` (flush mode permitting), then call
    :meth:`SlaveLink.on_durable` with the last index."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class Refuse:
    """Slave: this log cannot follow this master; an operator must decide."""

    reason: str


Action = Send | Truncate | Append | Refuse


@dataclass
class _Peer:
    joined: bool = False
    next: int = 1  # the next index to push
    acked: int = 0
    acked_ms: int = 0  # when ``acked`` last moved
    sent_ms: int = 0  # when anything was last pushed
    rewound_ms: int = 0  # when pushing last started again from ``acked``


@dataclass
class MasterLink:
    core: MasterCore
    log: LogView
    epochs: EpochMap
    max_batch_bytes: int = 1 << 20
    max_inflight: int = 4096
    heartbeat_ms: int = 100
    resend_ms: int = 1000
    peers: dict[int, _Peer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.peers = {m: _Peer() for m in sorted(self.core.members) if m != self.core.me}

    def _min(self) -> int:
        return self.log.first_index() - 1

    def on_message(self, frm: int, msg: HaMessage, now_ms: int) -> list[Action]:
        p = self.peers.get(frm)
        if p is None:
            return []
        core = self.core
        if isinstance(msg, Join):
            p.joined = False
            reply = JoinReply(
                core.epoch, self._min(), self.log.last_index(), core.confirm, self.epochs
            )
            return [Send(frm, reply)]
        if not isinstance(msg, Ack) or msg.epoch != core.epoch:
            return []
        last = self.log.last_index()
        upto = min(msg.max, last)
        if not p.joined:
            # The first acknowledgement after a join: where the slave truncated to.
            p.joined = True
            p.next = upto + 1
        if upto > p.acked:
            p.acked = upto
            p.acked_ms = now_ms
        if p.acked == upto:
            core.on_ack(frm, upto, now_ms)
        if msg.need:
            p.next = max(self._min() + 1, min(msg.need, last + 1))
        return self._push(frm, p, now_ms)

    def pump(self, now_ms: int) -> list[Action]:
        """Pushes due now: new entries, resends, heartbeats."""
        out: list[Action] = []
        for frm, p in self.peers.items():
            if not p.joined:
                continue
            stalled = now_ms - max(p.acked_ms, p.rewound_ms) > self.resend_ms
            if p.next > p.acked + 1 and stalled:
                # Nothing acknowledged for a while (pushes lost): again from there.
                p.next = p.acked + 1
                p.rewound_ms = now_ms
            out += self._push(frm, p, now_ms)
        return out

    def _push(self, frm: int, p: _Peer, now_ms: int) -> list[Action]:
        last = self.log.last_index()
        out: list[Action] = []
        while p.next <= last and p.next - p.acked <= self.max_inflight:
            hi = min(last + 1, p.acked + self.max_inflight + 1)
            batch = self.log.entries(p.next, hi, self.max_batch_bytes)
            if not batch:
                break
            out.append(
                Send(frm, Push(self.core.epoch, p.next - 1, self.core.confirm, tuple(batch)))
            )
            p.next = batch[-1].index + 1
            p.sent_ms = now_ms
        if not out and now_ms - p.sent_ms >= self.heartbeat_ms:
            out.append(Send(frm, Push(self.core.epoch, p.next - 1, self.core.confirm)))
            p.sent_ms = now_ms
        return out


@dataclass
class SlaveLink:
    me: int
    master: int
    epoch: int  # the master's epoch, as the controller said
    log: LogView
    epochs: EpochMap
    state: str = "new"  # new, joining, truncating, following, refused
    durable: int = 0  # the last index this slave holds durably
    pending: int = 0  # the last index handed to Append (durable or not)
    master_confirm: int = 0
    refusal: str = ""
    retry_ms: int = 500
    heard_ms: int = 0  # when the master was last heard (or a JOIN last sent)
    # Planted bug cmode_skip_truncation (dledger/faults.py), tests only.
    skip_truncation: bool = False

    def start(self, now_ms: int = 0) -> list[Action]:
        self.state = "joining"
        self.durable = self.pending = self.log.last_index()
        return self._join(now_ms)

    def _join(self, now_ms: int) -> list[Action]:
        self.heard_ms = now_ms
        join = Join(self.epoch, self.log.first_index() - 1, self.log.last_index(), self.epochs)
        return [Send(self.master, join)]

    def tick(self, now_ms: int) -> list[Action]:
        """Messages are lost: a JOIN without an answer is sent again, and a
        follower that has not heard its master for ``retry_ms`` acknowledges
        again (the master may have lost its first acknowledgement, and
        waits for one before it pushes)."""
        if now_ms - self.heard_ms < self.retry_ms:
            return []
        if self.state == "joining":
            return self._join(now_ms)
        if self.state == "following":
            self.heard_ms = now_ms
            return [Send(self.master, Ack(self.epoch, self.durable, need=self.pending + 1))]
        return []

    @property
    def confirm(self) -> int:
        """How far this slave may apply: the master's confirm offset, capped
        by what it holds durably."""
        return min(self.master_confirm, self.durable) if self.state == "following" else 0

    def on_message(self, frm: int, msg: HaMessage, now_ms: int = 0) -> list[Action]:
        if frm != self.master:
            return []  # a node that is not our master (a deposed one): not followed
        self.heard_ms = max(self.heard_ms, now_ms)
        if isinstance(msg, JoinReply):
            return self._on_join_reply(msg)
        if not isinstance(msg, Push) or msg.epoch != self.epoch or self.state != "following":
            return []
        self.master_confirm = max(self.master_confirm, msg.confirm)
        if msg.prev > self.pending:
            return [Send(self.master, Ack(self.epoch, self.durable, need=self.pending + 1))]
        new = [e for e in msg.entries if e.index > self.pending]
        if not new:
            # A heartbeat, or a resend of what we hold: acknowledgements get
            # lost too, so say again how far we are.
            return [Send(self.master, Ack(self.epoch, self.durable))]
        if new[0].index != self.pending + 1:
            return [Send(self.master, Ack(self.epoch, self.durable, need=self.pending + 1))]
        for e in new:
            last = self.epochs.last
            if last is None or e.term > last.epoch:
                self.epochs.append(e.term, e.index - 1)
        self.pending = new[-1].index
        return [Append(tuple(new))]

    def _on_join_reply(self, msg: JoinReply) -> list[Action]:
        if self.state != "joining" or msg.epoch != self.epoch:
            return []
        lo, hi = self.log.first_index() - 1, self.log.last_index()
        d = join_decision(lo, hi, self.epochs, msg.min, msg.max, msg.epochs)
        if d.action is JoinAction.REFUSE or (d.action is JoinAction.RESET and msg.min > 0):
            self.state = "refused"
            self.refusal = f"case {d.case}: {d.reason}"
            return [Refuse(self.refusal)]
        point = d.offset if d.action is JoinAction.FOLLOW else 0
        if self.skip_truncation and d.action is JoinAction.FOLLOW and point < hi <= msg.max:
            point = hi  # planted bug: the forked tail is kept and followed from
        self.epochs.truncate_to(point)
        self.state = "truncating"
        self.pending = point
        self.master_confirm = max(self.master_confirm, min(msg.confirm, point))
        return [Truncate(point)]

    def on_durable(self, last: int) -> list[Action]:
        """The driver made the log durable up to ``last`` (after a Truncate
        or an Append)."""
        if self.state == "truncating":
            self.state = "following"
            self.durable = last
            return [Send(self.master, Ack(self.epoch, last))]
        if self.state != "following":
            return []
        if last > self.durable:
            self.durable = last
        return [Send(self.master, Ack(self.epoch, self.durable))]


def entries_of(actions: Sequence[Action]) -> list[Entry]:
    """Every entry the actions append (tests, the driver's accounting)."""
    out: list[Entry] = []
    for a in actions:
        if isinstance(a, Append):
            out += a.entries
    return out
