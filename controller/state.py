"""The controller's replicated state: what every controller replica agrees on.

Theory of operation
-------------------
The controller group's log holds five kinds of command (``controller.codec``):
``heartbeat`` (a broker node says it is alive, whether it leads its group,
and its group's address book), ``tick`` (the controller leader's clock, so
time moves even when no broker heartbeats), and ``create_topic`` /
``update_topic`` / ``delete_topic`` (route changes). :meth:`ControllerState.apply`
applies them in log order and is deterministic: it never reads a clock or
does I/O, so every replica that applied the same prefix answers the same.

Time. ``now_ms`` is the largest ``ts_ms`` of any applied command (stamped by
the controller leader when it proposed it). It never goes back, even when a
new leader's clock is behind the old one's.

Liveness. A broker *group* is live (it can take writes) while its last
heartbeat from a ready leader is at most ``LIVENESS_TIMEOUT_MS`` old in
``now_ms`` and no member has since reported, at the same term or later,
that it knows no leader (a lone survivor of a dead majority says so within
an election timeout, faster than the timeout). A *member* is alive while its
own last heartbeat is at most that old. Brokers heartbeat every
``HEARTBEAT_INTERVAL_MS``; the 1 s / 5 s pair is RocketMQ 5's lite heartbeat
and NameServer removal delay.

Placement (the documented rule). A new topic's queue ``q`` goes to
``live[q % len(live)]``, ``live`` being the live groups sorted by name at
the moment the command applies; growing a topic places each new queue the
same way by its own number; queue counts never shrink (their offsets would
be lost). No live group: the command is refused (``NO_LIVE_GROUP``).

Controller-mode groups (``dledger.cmode``). A group whose nodes heartbeat
with a ``replica`` part replicates by master and slaves, and the controller
chooses its master: after every applied heartbeat or tick, a group whose
master is not alive (or that never had one) gets one from
:func:`dledger.cmode.election.elect` (alive members of the SyncStateSet,
the largest reported offset first; any alive member when the group allows
unclean elections; at the very first election, any alive member), with a
new **epoch** and a SyncStateSet of the new master alone. Only the master
of the current epoch counts as the group's leader. After the controller
itself was away (two applied commands more than two heartbeat intervals
apart: no leader, or its majority down), no master is deemed dead for one
liveness timeout, so brokers can heartbeat again first: a controller
outage alone never moves a master. ``alter_sync_state_set``
applies a master's request only when the master, its epoch and the
SyncStateSet's own epoch are still current (``STALE_EPOCH`` otherwise), so
a deposed master can never change the set.

Versions. ``version`` counts route-table changes (topic created, grown or
deleted, a group registered or its address book changed). Each topic route
keeps the ``version`` of its last change, so a cached route is current
exactly when its version equals the controller's for that topic; a deleted
topic leaves a tombstone with its deletion version (brokers delete their
copy of the queues when they see it).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker_adapter import codec as broker_codec
from broker_adapter.errors import (
    BrokerError,
    InvalidArgument,
    InvalidQueue,
    MalformedCommand,
    TopicExists,
    UnknownTopic,
)
from controller import codec
from dledger.cmode.election import elect
from dledger.core.types import Entry, EntryType

HEARTBEAT_INTERVAL_MS = 1000
LIVENESS_TIMEOUT_MS = 5000

_SNAP_HDR = struct.Struct(">8sI")
SNAPSHOT_MAGIC = b"DLCTSNP1"


class NoLiveGroup(BrokerError):
    """No broker group is live: a topic cannot be placed (503)."""

    code = "NO_LIVE_GROUP"


class StaleEpoch(BrokerError):
    """A controller-mode request from a master that is no longer the
    group's, or about a SyncStateSet that changed since (409)."""

    code = "STALE_EPOCH"


@dataclass(slots=True)
class ReplicaSet:
    """A controller-mode group's replication state (see the module docstring)."""

    master: int = 0  # 0: none (never elected, or no one electable)
    epoch: int = 0
    sync_state_set: list[int] = field(default_factory=list)
    sync_state_set_epoch: int = 0
    unclean: bool = False
    offsets: dict[int, int] = field(default_factory=dict)  # member -> last reported max offset
    elections: int = 0
    last_election: str = ""

    def value(self) -> list[Any]:
        return [
            self.master,
            self.epoch,
            self.sync_state_set,
            self.sync_state_set_epoch,
            self.unclean,
            {str(i): o for i, o in sorted(self.offsets.items())},
            self.elections,
            self.last_election,
        ]

    @classmethod
    def from_value(cls, v: list[Any]) -> ReplicaSet:
        master, epoch, sss, sss_epoch, unclean, offsets, elections, last = v
        return cls(
            int(master),
            int(epoch),
            [int(i) for i in sss],
            int(sss_epoch),
            bool(unclean),
            {int(i): int(o) for i, o in offsets.items()},
            int(elections),
            str(last),
        )

    def json(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "epoch": self.epoch,
            "sync_state_set": self.sync_state_set,
            "sync_state_set_epoch": self.sync_state_set_epoch,
            "unclean": self.unclean,
            "offsets": {str(i): o for i, o in sorted(self.offsets.items())},
            "elections": self.elections,
            "last_election": self.last_election,
        }


@dataclass(slots=True)
class MemberInfo:
    http: str
    last_seen_ms: int = -1  # never heard from
    leader: bool = False
    term: int = 0


@dataclass(slots=True)
class GroupInfo:
    name: str
    members: dict[int, MemberInfo] = field(default_factory=dict)
    leader: int = 0  # the member whose ready-leader heartbeat is the latest (0: none)
    leader_term: int = 0
    leader_seen_ms: int = -1
    routes_version: int = 0  # the route-table version its leader reported applied
    replica: ReplicaSet | None = None  # a controller-mode group


@dataclass(slots=True)
class TopicRoute:
    queues: list[str]  # queue number -> owning group
    version: int
    created_ms: int


class ControllerState:
    """See the module docstring. Reads never mutate state."""

    def __init__(self, liveness_timeout_ms: int = LIVENESS_TIMEOUT_MS) -> None:
        self.liveness_timeout_ms = liveness_timeout_ms
        self.applied_index = 0
        self.now_ms = 0
        self.version = 0
        self.groups: dict[str, GroupInfo] = {}
        self.routes: dict[str, TopicRoute] = {}
        self.tombstones: dict[str, int] = {}
        self.grace_until_ms = 0  # no controller-mode election before this (see apply_command)

    # -- apply ------------------------------------------------------------------
    def apply(self, entry: Entry) -> object:
        """Apply one committed entry: the command's result (a JSON-ready
        dict), the BrokerError it was refused with, or None (not a command)."""
        if entry.index <= self.applied_index:
            raise AssertionError(
                f"entry {entry.index} applied after {self.applied_index}: apply order broken"
            )
        self.applied_index = entry.index
        if entry.type is not EntryType.NORMAL or not codec.is_command(entry.data):
            return None
        try:
            cmd = codec.decode(entry.data)
            return self.apply_command(cmd)
        except BrokerError as exc:
            return exc
        except (KeyError, TypeError, ValueError) as exc:
            return MalformedCommand(f"controller command has a wrong shape: {exc!r}")

    def apply_command(self, cmd: dict[str, Any]) -> object:
        ts = int(cmd["ts_ms"])
        if ts > self.now_ms:
            if self.now_ms and ts - self.now_ms > 2 * HEARTBEAT_INTERVAL_MS:
                # The controller itself was away (no leader, or all down): the
                # brokers' heartbeats could not land. No master is deemed dead
                # until each has had a full timeout to heartbeat again.
                self.grace_until_ms = ts + self.liveness_timeout_ms
            self.now_ms = ts
        op = cmd["op"]
        if op == "tick":
            self._elections()
            return None
        if op == "heartbeat":
            out = self._heartbeat(cmd)
            self._elections()
            g = self.groups[out["group"]]
            if g.replica is not None:
                out["replica"] = g.replica.json()
            return out
        if op == "alter_sync_state_set":
            return self._alter_sync_state_set(cmd)
        if op == "create_topic":
            return self._create_topic(_name(cmd["topic"]), _queues(cmd["queues"]))
        if op == "update_topic":
            return self._update_topic(_name(cmd["topic"]), _queues(cmd["queues"]))
        if op == "delete_topic":
            return self._delete_topic(_name(cmd["topic"]))
        raise MalformedCommand(f"no handler for controller op {op!r}")

    def _heartbeat(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = broker_codec.check_name(cmd["group"], "group")
        nid, term, leader = int(cmd["node_id"]), int(cmd["term"]), bool(cmd["leader"])
        if nid < 1:
            raise InvalidArgument("node_id must be >= 1", field="node_id")
        g = self.groups.get(name)
        changed = False
        if g is None:
            g = self.groups[name] = GroupInfo(name)
            changed = True
        book = {int(i): str(a) for i, a in cmd["members"]}
        book.setdefault(nid, str(cmd["http"]))
        for i, addr in sorted(book.items()):
            m = g.members.get(i)
            if m is None:
                g.members[i] = MemberInfo(addr)
                changed = True
            elif m.http != addr:
                m.http = addr
                changed = True
        m = g.members[nid]
        m.last_seen_ms, m.leader, m.term = self.now_ms, leader, term
        rep = cmd.get("replica")
        if rep is not None:
            r = g.replica
            if r is None:
                r = g.replica = ReplicaSet()
                changed = True
            r.offsets[nid] = int(rep["max_offset"])
            r.unclean = bool(rep.get("unclean", False))
            # The controller names the master: only the current epoch's
            # master, saying it takes writes, is the group's leader.
            if nid == r.master and leader and term == r.epoch:
                g.leader, g.leader_term, g.leader_seen_ms = nid, term, self.now_ms
            elif nid == r.master or nid == g.leader:
                g.leader = 0
        elif leader:
            if term >= g.leader_term:
                g.leader, g.leader_term, g.leader_seen_ms = nid, term, self.now_ms
                g.routes_version = int(cmd.get("routes_version", 0))
        elif nid == g.leader or (term >= g.leader_term and not cmd.get("knows_leader", True)):
            # The leader stepped down, or a member at the leader's term (or
            # later) lost it: the group cannot take writes until one says so.
            g.leader = 0
        if changed:
            self.version += 1
        return {"version": self.version, "group": name, "live": self.group_live(name)}

    def _elections(self) -> None:
        """Give every controller-mode group whose master is gone a new one."""
        if self.now_ms < self.grace_until_ms:
            return
        for name in sorted(self.groups):
            g = self.groups[name]
            r = g.replica
            if r is None:
                continue
            alive = {i for i, m in g.members.items() if self.member_alive(m)}
            if r.master != 0 and r.master in alive:
                continue
            if r.epoch == 0:
                # The first master: nothing was written yet, anyone will do.
                e = elect(
                    master=None, sync_state_set=alive, alive=alive, offsets=r.offsets, unclean=False
                )
            else:
                e = elect(
                    master=r.master,
                    sync_state_set=set(r.sync_state_set),
                    alive=alive,
                    offsets=r.offsets,
                    unclean=r.unclean,
                )
            if e.master is None:
                if r.master != 0 or not r.last_election.startswith("none"):
                    r.last_election = f"none at {self.now_ms}: {e.reason}"
                continue
            r.epoch += 1
            r.master = e.master
            r.sync_state_set = [e.master]
            r.sync_state_set_epoch += 1
            r.elections += 1
            r.last_election = f"epoch {r.epoch} at {self.now_ms}: {e.reason}"
            if g.leader != 0:
                g.leader = 0  # until the new master heartbeats as such
            self.version += 1

    def _alter_sync_state_set(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = broker_codec.check_name(cmd["group"], "group")
        g = self.groups.get(name)
        if g is None or g.replica is None:
            raise InvalidArgument(f"{name!r} is not a controller-mode group", field="group")
        r = g.replica
        master, epoch = int(cmd["master"]), int(cmd["epoch"])
        if master != r.master or epoch != r.epoch:
            raise StaleEpoch(
                f"group {name}: master {master} of epoch {epoch} is not the current "
                f"master ({r.master}, epoch {r.epoch})"
            )
        if int(cmd["sync_state_set_epoch"]) != r.sync_state_set_epoch:
            raise StaleEpoch(
                f"group {name}: the SyncStateSet changed since (epoch "
                f"{r.sync_state_set_epoch}, asked against {cmd['sync_state_set_epoch']})"
            )
        new = sorted({int(i) for i in cmd["new_set"]})
        if master not in new:
            raise InvalidArgument("a SyncStateSet must hold its master", field="new_set")
        unknown = [i for i in new if i not in g.members]
        if unknown:
            raise InvalidArgument(f"members {unknown} are not in group {name}", field="new_set")
        added = [i for i in new if i not in r.sync_state_set]
        dead = [i for i in added if not self.member_alive(g.members[i])]
        if dead:
            raise InvalidArgument(
                f"members {dead} are not alive: they cannot join", field="new_set"
            )
        r.sync_state_set = new
        r.sync_state_set_epoch += 1
        return {"group": name, **r.json()}

    def _place(self, queues: range) -> list[str]:
        live = self.live_groups()
        if not live:
            raise NoLiveGroup(
                "no broker group is live (none sent a leader heartbeat in the last "
                f"{self.liveness_timeout_ms} ms): cannot place queues",
            )
        return [live[q % len(live)] for q in queues]

    def _create_topic(self, topic: str, queues: int) -> dict[str, Any]:
        if topic in self.routes:
            raise TopicExists(f"topic {topic!r} already exists", field="name")
        placed = self._place(range(queues))
        self.version += 1
        self.routes[topic] = TopicRoute(placed, self.version, self.now_ms)
        self.tombstones.pop(topic, None)
        return self.route(topic)

    def _update_topic(self, topic: str, queues: int) -> dict[str, Any]:
        r = self._route(topic)
        if queues < len(r.queues):
            raise InvalidQueue(
                f"topic {topic!r} has {len(r.queues)} queues; the count can only grow",
                "queues",
            )
        if queues > len(r.queues):
            r.queues.extend(self._place(range(len(r.queues), queues)))
            self.version += 1
            r.version = self.version
        return self.route(topic)

    def _delete_topic(self, topic: str) -> dict[str, Any]:
        r = self._route(topic)
        del self.routes[topic]
        self.version += 1
        self.tombstones[topic] = self.version
        return {"deleted": topic, "version": self.version, "groups": sorted(set(r.queues))}

    # -- reads ------------------------------------------------------------------
    def _route(self, topic: str) -> TopicRoute:
        r = self.routes.get(topic)
        if r is None:
            raise UnknownTopic(f"topic {topic!r} does not exist", field="topic")
        return r

    def member_alive(self, m: MemberInfo) -> bool:
        return m.last_seen_ms >= 0 and self.now_ms - m.last_seen_ms <= self.liveness_timeout_ms

    def group_live(self, name: str) -> bool:
        g = self.groups.get(name)
        return (
            g is not None
            and g.leader != 0
            and self.now_ms - g.leader_seen_ms <= self.liveness_timeout_ms
        )

    def live_groups(self) -> list[str]:
        return [n for n in sorted(self.groups) if self.group_live(n)]

    def group_json(self, name: str) -> dict[str, Any]:
        g = self.groups[name]
        return {
            "name": name,
            "live": self.group_live(name),
            "leader": g.leader,
            "leader_http": g.members[g.leader].http if g.leader in g.members else None,
            "leader_term": g.leader_term,
            "leader_seen_ms": g.leader_seen_ms,
            "routes_version": g.routes_version,
            "members": [
                {
                    "id": i,
                    "http": m.http,
                    "alive": self.member_alive(m),
                    "leader": m.leader,
                    "term": m.term,
                    "last_seen_ms": m.last_seen_ms,
                }
                for i, m in sorted(g.members.items())
            ],
            "mode": "raft" if g.replica is None else "controller",
            **({} if g.replica is None else {"replica": g.replica.json()}),
        }

    def route(self, topic: str) -> dict[str, Any]:
        """The route of ``topic`` with its version and the groups it uses
        (addresses, liveness): everything a client needs to send to it."""
        r = self._route(topic)
        used = sorted(set(r.queues))
        return {
            "topic": topic,
            "name": topic,  # what a broker's topic answers call it
            "version": r.version,
            "table_version": self.version,
            "now_ms": self.now_ms,
            "queues": [{"queue": q, "group": g} for q, g in enumerate(r.queues)],
            "groups": {n: self.group_json(n) for n in used if n in self.groups},
        }

    def table(self) -> dict[str, Any]:
        """The whole route table (what brokers reconcile against)."""
        return {
            "version": self.version,
            "now_ms": self.now_ms,
            "topics": {
                t: {"version": r.version, "queues": list(r.queues)}
                for t, r in sorted(self.routes.items())
            },
            "deleted": dict(sorted(self.tombstones.items())),
            "groups": {n: self.group_json(n) for n in sorted(self.groups)},
        }

    # -- snapshot ----------------------------------------------------------------
    def _value(self) -> dict[str, Any]:
        return {
            "applied": self.applied_index,
            "now": self.now_ms,
            "version": self.version,
            "timeout": self.liveness_timeout_ms,
            "groups": {
                n: [
                    g.leader,
                    g.leader_term,
                    g.leader_seen_ms,
                    g.routes_version,
                    {
                        str(i): [m.http, m.last_seen_ms, m.leader, m.term]
                        for i, m in g.members.items()
                    },
                    None if g.replica is None else g.replica.value(),
                ]
                for n, g in self.groups.items()
            },
            "routes": {t: [r.queues, r.version, r.created_ms] for t, r in self.routes.items()},
            "tombstones": self.tombstones,
            "grace_until": self.grace_until_ms,
        }

    def snapshot(self) -> bytes:
        """Deterministic bytes (equal states, equal snapshots), CRC-checked."""
        body = orjson.dumps(self._value(), option=orjson.OPT_SORT_KEYS)
        return _SNAP_HDR.pack(SNAPSHOT_MAGIC, zlib.crc32(body)) + body

    @classmethod
    def restore(cls, data: bytes) -> ControllerState:
        """The state a snapshot was taken from; raises MalformedCommand."""
        if len(data) < _SNAP_HDR.size:
            raise MalformedCommand("controller snapshot is truncated")
        magic, crc = _SNAP_HDR.unpack_from(data, 0)
        body = bytes(data[_SNAP_HDR.size :])
        if magic != SNAPSHOT_MAGIC or zlib.crc32(body) != crc:
            raise MalformedCommand("not a controller snapshot, or its CRC does not match")
        try:
            v = orjson.loads(body)
            st = cls(int(v["timeout"]))
            st.applied_index, st.now_ms, st.version = (
                int(v["applied"]),
                int(v["now"]),
                int(v["version"]),
            )
            for n, row in v["groups"].items():
                # Five fields before controller mode, six since (the replica set).
                leader, lterm, lseen, rver, members = row[:5]
                g = GroupInfo(str(n), {}, int(leader), int(lterm), int(lseen), int(rver))
                if len(row) > 5 and row[5] is not None:
                    g.replica = ReplicaSet.from_value(row[5])
                for i, (http, seen, lead, term) in members.items():
                    g.members[int(i)] = MemberInfo(str(http), int(seen), bool(lead), int(term))
                st.groups[g.name] = g
            for t, (queues, version, created) in v["routes"].items():
                st.routes[str(t)] = TopicRoute([str(q) for q in queues], int(version), int(created))
            st.tombstones = {str(t): int(x) for t, x in v["tombstones"].items()}
            st.grace_until_ms = int(v.get("grace_until", 0))
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            raise MalformedCommand(f"controller snapshot has a wrong shape: {exc!r}") from None
        return st


def route_from_table(table: dict[str, Any], topic: str) -> dict[str, Any] | None:
    """What :meth:`ControllerState.route` answered for ``topic`` when
    ``table`` (a :meth:`ControllerState.table`) was taken; None: unknown."""
    r = table.get("topics", {}).get(topic)
    if r is None:
        return None
    groups = table.get("groups", {})
    used = sorted(set(r["queues"]))
    return {
        "topic": topic,
        "name": topic,
        "version": r["version"],
        "table_version": table.get("version", 0),
        "now_ms": table.get("now_ms", 0),
        "queues": [{"queue": q, "group": g} for q, g in enumerate(r["queues"])],
        "groups": {n: groups[n] for n in used if n in groups},
    }


def _name(v: object) -> str:
    return broker_codec.check_name(v)


def _queues(v: object) -> int:
    return broker_codec.check_queue_count(v)
