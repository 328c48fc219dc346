"""Client-side routing over several broker groups (a multi-group cluster:
a controller group holds the route table, topic -> queues -> owning group).

:class:`RoutingClient` asks any node that serves ``GET /v1/routes/{topic}``
(a controller node, or any broker node: they answer from their cached
table) for a topic's route, caches it with its version, and sends each
message to the group that owns its queue. Stdlib only, thread-safe (the
proxy, :mod:`dledger_app.proxy`, runs it in worker threads).

Which queue a message goes to:

- ``queue`` given: that queue, always.
- ``sharding_key`` given: ``crc32(key) % queues``, always (the broker's own
  hash): an *ordered* message keeps its queue. When the owning group
  cannot take writes the send fails with :class:`GroupUnavailableError`
  (``503 GROUP_UNAVAILABLE``) naming the group, the queue and why.
- neither: round robin over the queues; when the owning group surely did
  not take the batch (connections refused or timed out before sending,
  ``503``, ``429``, for ``group_retry_s``), the group is avoided for
  ``down_for_s`` and the batch moves to a queue of another group. A batch
  whose outcome is *unknown* (sent, then no answer; ``504``) never moves:
  it could be in the first group already, and a copy in a second one would
  be a duplicate (its group is avoided for ``down_for_s`` all the same).
  A plain send raises :class:`OutcomeUnknownError`; a
  :class:`RoutedProducer` keeps the batch and sends it again, with the same
  sequence, before anything else it sends to that queue (the group's dedup
  answers the first copy's offsets), and sends its other unordered batches
  to other queues meanwhile.

A :class:`RoutedProducer` whose session a group forgot (``UNKNOWN_PRODUCER``
after ``producer_idle_ms``, ``PRODUCER_FENCED``, ``SEQUENCE_GAP`` after the
topic was deleted and made again) registers a new one there and sends once
more; its batches in doubt with that group then stay unknown.

Routes are cached for ``route_ttl_s``; a refresh that fails keeps the
cached route (its version tells how old it is), so a controller without a
leader, or dead, stops no produce or consume. ``WRONG_GROUP`` or
``UNKNOWN_TOPIC`` from a group makes the client refresh the route once and
try again.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from http_api.client import (
    Ack,
    ApiError,
    Batch,
    Client,
    IdempotentProducer,
    OutcomeUnknownError,
    OutMessage,
    UnavailableError,
    _acks,
    _as_messages,
    queue_for_key,
)


class GroupUnavailableError(ApiError):
    """The broker group owning a message's queue cannot take writes, and the
    message may not move (it names its queue or has a sharding key)."""


class RouteUnavailableError(ApiError):
    """No node answered with the topic's route, and none is cached."""


@dataclass(frozen=True, slots=True)
class Route:
    topic: str
    version: int
    owners: tuple[str, ...]  # queue -> group
    members: dict[str, tuple[str, ...]]  # group -> HTTP addresses (leader first)
    live: dict[str, bool]
    fetched_at: float
    body: dict[str, Any] = field(default_factory=dict, compare=False)  # as answered

    @classmethod
    def of(cls, body: dict[str, Any]) -> Route:
        owners = tuple(str(q["group"]) for q in body["queues"])
        members: dict[str, tuple[str, ...]] = {}
        live: dict[str, bool] = {}
        for name, g in body.get("groups", {}).items():
            addrs = [str(m["http"]) for m in g.get("members", [])]
            lead = g.get("leader_http")
            if lead in addrs:
                addrs.remove(lead)
                addrs.insert(0, lead)
            members[name] = tuple(addrs)
            live[name] = bool(g.get("live", True))
        return cls(
            body["topic"], int(body["version"]), owners, members, live, time.monotonic(), body
        )

    def queues_of(self, group: str) -> list[int]:
        return [q for q, g in enumerate(self.owners) if g == group]


@dataclass(slots=True)
class _Stats:
    moved: int = 0  # batches sent to another group's queue than first chosen
    route_fetches: int = 0
    route_fetch_failures: int = 0
    group_failures: dict[str, int] = field(default_factory=dict)


class RoutingClient:
    """See the module docstring. ``seeds``: ``host:port`` of nodes that serve
    routes (controller or broker nodes, any mix); ``timeout_s``: one
    request's deadline; ``group_retry_s``: how long a send keeps trying one
    group before it counts as unable to take writes."""

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        timeout_s: float = 5.0,
        group_retry_s: float = 2.0,
        route_ttl_s: float = 5.0,
        down_for_s: float = 3.0,
        token: str | None = None,
    ) -> None:
        self.seeds = Client(seeds, timeout_s=timeout_s, retry_for_s=group_retry_s, token=token)
        self.timeout_s = timeout_s
        self.group_retry_s = group_retry_s
        self.route_ttl_s = route_ttl_s
        self.down_for_s = down_for_s
        self._token = token
        self._routes: dict[str, Route] = {}
        self._groups: dict[str, Client] = {}
        self._down: dict[str, float] = {}
        self._rr = 0
        self._lock = threading.Lock()
        self.stats = _Stats()

    # -- routes -------------------------------------------------------------------
    def route(self, topic: str, *, refresh: bool = False) -> Route:
        """The topic's route: cached, refreshed after ``route_ttl_s`` (or
        now with ``refresh``); a failed refresh keeps the cached one."""
        cached = self._routes.get(topic)
        if (
            cached is not None
            and not refresh
            and time.monotonic() - cached.fetched_at < self.route_ttl_s
        ):
            return cached
        try:
            body = self.seeds.request("GET", f"/v1/routes/{urllib.parse.quote(topic)}", safe=True)
            self.stats.route_fetches += 1
        except ApiError as exc:
            self.stats.route_fetch_failures += 1
            if cached is not None and exc.status in (0, 429, 503):
                # keep serving from the cache; ask again after another TTL
                stale = Route(
                    cached.topic,
                    cached.version,
                    cached.owners,
                    cached.members,
                    cached.live,
                    time.monotonic(),
                    cached.body,
                )
                self._routes[topic] = stale
                return stale
            if exc.status in (0, 429, 503):
                raise RouteUnavailableError(
                    503,
                    "ROUTE_UNAVAILABLE",
                    f"no route for topic {topic!r}: no node answered ({exc})",
                    {"topic": topic},
                ) from None
            raise
        r = Route.of(body)
        with self._lock:
            old = self._routes.get(topic)
            if old is None or r.version >= old.version:
                self._routes[topic] = r
            else:
                r = Route(
                    old.topic,
                    old.version,
                    old.owners,
                    old.members,
                    old.live,
                    r.fetched_at,
                    old.body,
                )
                self._routes[topic] = r
            for g, addrs in r.members.items():
                c = self._groups.get(g)
                if c is None:
                    self._groups[g] = Client(
                        list(addrs),
                        timeout_s=self.timeout_s,
                        retry_for_s=self.group_retry_s,
                        token=self._token,
                        binary=False,  # a group's node takes JSON produce bodies only
                    )
                else:
                    c.addresses = list(addrs) or c.addresses
        return r

    def group(self, name: str) -> Client:
        c = self._groups.get(name)
        if c is None:
            raise GroupUnavailableError(
                503, "GROUP_UNAVAILABLE", f"broker group {name!r} is not in any route", {}
            )
        return c

    def _is_down(self, group: str) -> bool:
        until = self._down.get(group)
        return until is not None and time.monotonic() < until

    def _mark_down(self, group: str) -> None:
        self._down[group] = time.monotonic() + self.down_for_s
        self.stats.group_failures[group] = self.stats.group_failures.get(group, 0) + 1

    def pick_queue(
        self, r: Route, avoid: set[str] | None = None, skip: set[int] | None = None
    ) -> int | None:
        """The next queue, round robin, not in ``skip``, of a group not in
        ``avoid`` and not down; groups the route says are not live only when
        nothing else is left."""
        avoid = avoid or set()
        skip = skip or set()
        n = len(r.owners)
        with self._lock:
            self._rr += 1
            start = self._rr
        fallback: int | None = None
        for k in range(n):
            q = (start + k) % n
            g = r.owners[q]
            if g in avoid or q in skip:
                continue
            if not self._is_down(g) and r.live.get(g, True):
                return q
            if fallback is None and not self._is_down(g):
                fallback = q
        return fallback

    # -- topics -------------------------------------------------------------------
    def create_topic(self, name: str, queues: int = 8) -> dict[str, Any]:
        res: dict[str, Any] = self.seeds.request(
            "POST", "/v1/topics", {"name": name, "queues": queues}, safe=False, retry_for_s=10.0
        )
        return res

    def topics(self) -> list[dict[str, Any]]:
        """Every topic, described as :meth:`topic` does."""
        listed = self.seeds.request("GET", "/v1/topics", safe=True)["topics"]
        names = sorted({str(t.get("name") or t.get("topic")) for t in listed})
        return [self.topic(n) for n in names]

    def topic(self, name: str) -> dict[str, Any]:
        """``{name, version, queues: [{queue, group, min_offset, max_offset}]}``:
        each queue's range from the group that owns it."""
        r = self.route(name)
        queues: list[dict[str, Any]] = []
        for g in sorted(set(r.owners)):
            info = self.group(g).request("GET", f"/v1/topics/{name}", safe=True)
            mine = set(r.queues_of(g))
            queues += [{**q, "group": g} for q in info["queues"] if q["queue"] in mine]
        queues.sort(key=lambda q: int(q["queue"]))
        return {"name": name, "version": r.version, "queues": queues}

    def delete_topic(self, name: str) -> None:
        self.seeds.request("DELETE", f"/v1/topics/{name}", safe=False, retry_for_s=10.0)
        self._routes.pop(name, None)

    # -- produce --------------------------------------------------------------------
    def targets(self, topic: str, msgs: Sequence[OutMessage]) -> list[tuple[int, bool]]:
        """(queue, ordered) of each message; the unordered ones of one call
        share one queue, chosen round robin (one request, as a batch)."""
        r = self.route(topic)
        out: list[tuple[int, bool]] = []
        shared: int | None = None
        for m in msgs:
            if m.queue is not None:
                out.append((m.queue, True))
            elif m.sharding_key is not None:
                out.append((queue_for_key(m.sharding_key, len(r.owners)), True))
            else:
                if shared is None:
                    q = self.pick_queue(r)
                    shared = q if q is not None else 0
                out.append((shared, False))
        return out

    def produce(self, topic: str, values: Sequence[bytes | str | OutMessage]) -> list[Ack]:
        """Send each message to its queue's group (see the module docstring);
        the acks in the order of ``values``. Not idempotent: a batch whose
        outcome is unknown raises :class:`OutcomeUnknownError`."""
        msgs = _as_messages(values)
        by_queue: dict[tuple[int, bool], list[int]] = {}
        for k, t in enumerate(self.targets(topic, msgs)):
            by_queue.setdefault(t, []).append(k)
        acks: list[Ack | None] = [None] * len(msgs)
        for (q, ordered), ks in by_queue.items():
            part = [msgs[k] for k in ks]
            got = self.send_batch(topic, q, part, ordered, None)
            for k, a in zip(ks, got, strict=True):
                acks[k] = a
        return [a for a in acks if a is not None]

    def send_batch(
        self,
        topic: str,
        queue: int,
        msgs: list[OutMessage],
        ordered: bool,
        producer: RoutedProducer | None,
    ) -> list[Ack]:
        """One batch to one queue; an unordered one may move to other groups."""
        r = self.route(topic)
        avoid: set[str] = set()
        refreshed = False
        q = queue
        while True:
            if not 0 <= q < len(r.owners):
                raise ApiError(
                    422,
                    "INVALID_QUEUE",
                    f"queue {q} does not exist: topic {topic!r} has {len(r.owners)} queues",
                    {"field": "queue"},
                )
            g = r.owners[q]
            try:
                if producer is not None:
                    return producer.send_to(g, topic, q, msgs)
                body = {"messages": [_with_queue(m, q) for m in msgs]}
                return _acks(
                    self.group(g).request("POST", f"/v1/topics/{topic}/messages", body, safe=False)
                )
            except OutcomeUnknownError:
                self._mark_down(g)
                raise
            except UnavailableError as exc:
                self._mark_down(g)  # other batches avoid it meanwhile, whatever happened
                if exc.details.get("outcome_unknown"):
                    raise OutcomeUnknownError(
                        504,  # never a 503: a 503 tells a client it may send again
                        "OUTCOME_UNKNOWN",
                        f"broker group {g!r} (queue {q} of {topic!r}) may have written this "
                        f"batch; it is not moved to another group ({exc})",
                        {"group": g, "queue": q, "topic": topic},
                    ) from None
                if ordered:
                    raise GroupUnavailableError(
                        503,
                        "GROUP_UNAVAILABLE",
                        f"queue {q} of topic {topic!r} belongs to broker group {g!r}, which "
                        f"cannot take writes now ({exc.details.get('last_error', exc)}); a "
                        "message with a sharding key or a queue keeps its queue: retry later",
                        {"group": g, "queue": q, "topic": topic},
                    ) from None
                avoid.add(g)
                nq = self.pick_queue(r, avoid, producer.in_doubt(topic) if producer else set())
                if nq is None:
                    raise GroupUnavailableError(
                        503,
                        "GROUP_UNAVAILABLE",
                        f"no broker group of topic {topic!r} can take writes now "
                        f"(tried {sorted(avoid)})",
                        {"groups": sorted(avoid), "topic": topic},
                    ) from None
                self.stats.moved += 1
                q = nq
            except ApiError as exc:
                if exc.code in ("WRONG_GROUP", "UNKNOWN_TOPIC") and not refreshed:
                    refreshed = True
                    r = self.route(topic, refresh=True)
                    continue
                raise

    def producer(self) -> RoutedProducer:
        return RoutedProducer(self)

    # -- consume ----------------------------------------------------------------------
    def consume(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 100,
        wait_ms: int = 0,
        consistency: str = "committed",
    ) -> Batch:
        """Read ``queue`` from its group (any replica serves committed reads)."""
        r = self.route(topic)
        c = self.group(r.owners[queue])
        return _consume(c, topic, queue, offset, max_messages, wait_ms, consistency)

    def commit(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Commit consumer offsets, each to the group owning its queue."""
        per: dict[str, dict[tuple[str, int], int]] = {}
        for (t, q), off in offsets.items():
            per.setdefault(self.route(t).owners[q], {})[(t, q)] = off
        for g, offs in sorted(per.items()):
            self.group(g).commit(group, offs)

    def offsets(self, group: str, topic: str) -> dict[tuple[str, int], int]:
        """The consumer group's committed offsets of ``topic``, from the
        groups that own its queues."""
        r = self.route(topic)
        out: dict[tuple[str, int], int] = {}
        for g in sorted(set(r.owners)):
            mine = set(r.queues_of(g))
            for (t, q), off in self.group(g).offsets(group, topic).items():
                if q in mine:
                    out[(t, q)] = off
        return out


def _with_queue(m: OutMessage, q: int) -> dict[str, Any]:
    d = m.to_json()
    d["queue"] = q
    d.pop("sharding_key", None)  # the queue is chosen; the key is not stored
    return d


def _consume(
    c: Client,
    topic: str,
    queue: int,
    offset: int,
    max_messages: int,
    wait_ms: int,
    consistency: str,
) -> Batch:
    return c.consume(topic, queue, offset, max_messages, wait_ms, None, consistency)


class RoutedProducer:
    """An idempotent producer over several groups: one producer id per group
    (each group's log assigns its own), sequences per (topic, queue), sends
    to one queue one at a time (thread-safe). See the module docstring for
    what happens to a batch whose outcome is unknown."""

    def __init__(self, rc: RoutingClient) -> None:
        self.rc = rc
        self._per_group: dict[str, IdempotentProducer] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()
        # (topic, queue) -> the batch whose outcome is unknown (sent again
        # with its sequence before anything else goes to that queue)
        self._doubt: dict[tuple[str, int], list[OutMessage]] = {}

    @property
    def producer_id(self) -> str:
        """The producer ids this producer holds, one per group it wrote to."""
        return ",".join(f"{g}:{p.producer_id}" for g, p in sorted(self._per_group.items())) or "-"

    def in_doubt(self, topic: str) -> set[int]:
        return {q for (t, q) in self._doubt if t == topic}

    def _queue_lock(self, topic: str, q: int) -> threading.Lock:
        with self._lock:
            lk = self._locks.get((topic, q))
            if lk is None:
                lk = self._locks[(topic, q)] = threading.Lock()
            return lk

    def _for_group(self, g: str) -> IdempotentProducer:
        with self._lock:
            p = self._per_group.get(g)
        if p is None:
            c = self.rc.group(g)
            # Safe to repeat: an unused producer id expires (see Client.producer).
            res = c.request("POST", "/v1/producers", {}, safe=True)
            p = IdempotentProducer(c, res["producer_id"], res["epoch"])
            with self._lock:
                p = self._per_group.setdefault(g, p)
        return p

    # Answers after which the group no longer knows this producer's session
    # (expired after producer_idle_ms, fenced, or the topic was deleted and
    # made again, so its sequences restarted): a new session is registered.
    RESTART_CODES = ("UNKNOWN_PRODUCER", "PRODUCER_FENCED", "SEQUENCE_GAP")

    def send_to(self, g: str, topic: str, q: int, msgs: list[OutMessage]) -> list[Ack]:
        try:
            return self._send_to(g, topic, q, msgs)
        except ApiError as exc:
            if exc.code not in self.RESTART_CODES:
                raise
        with self._lock:
            self._per_group.pop(g, None)
            # batches in doubt in the old session can no longer be resolved
            # by their sequence: they stay "maybe" (the caller was told so)
            for key in [k for k in self._doubt if self.rc.route(k[0]).owners[k[1]] == g]:
                del self._doubt[key]
        return self._send_to(g, topic, q, msgs)

    def _send_to(self, g: str, topic: str, q: int, msgs: list[OutMessage]) -> list[Ack]:
        with self._queue_lock(topic, q):
            p = self._for_group(g)
            doubtful = self._doubt.get((topic, q))
            if doubtful is not None:
                # resolve it first: the same sequence, the same messages
                try:
                    self._send(p, g, topic, q, doubtful)
                except UnavailableError as exc:
                    # still in doubt; ``msgs`` was surely not sent
                    raise UnavailableError(
                        exc.status,
                        exc.code,
                        f"an earlier batch to queue {q} is still in doubt: {exc}",
                        {**exc.details, "outcome_unknown": False},
                    ) from None
                del self._doubt[(topic, q)]
            try:
                return self._send(p, g, topic, q, msgs)
            except (UnavailableError, OutcomeUnknownError) as exc:
                if isinstance(exc, OutcomeUnknownError) or exc.details.get("outcome_unknown"):
                    self._doubt[(topic, q)] = list(msgs)
                raise

    @staticmethod
    def _send(
        p: IdempotentProducer, g: str, topic: str, q: int, msgs: list[OutMessage]
    ) -> list[Ack]:
        return p.send(
            topic, [OutMessage(m.value, m.tags, m.keys, m.properties) for m in msgs], queue=q
        )

    def send(
        self,
        topic: str,
        values: Sequence[bytes | str | OutMessage],
        queue: int | None = None,
        sharding_key: str | None = None,
    ) -> list[Ack]:
        """One batch to one queue (``queue``, the key's queue, or one chosen
        round robin that may move when its group cannot take writes)."""
        msgs = _as_messages(values)
        r = self.rc.route(topic)
        if queue is not None:
            q, ordered = queue, True
        elif sharding_key is not None:
            q, ordered = queue_for_key(sharding_key, len(r.owners)), True
        else:
            pq = self.rc.pick_queue(r, skip=self.in_doubt(topic))
            q, ordered = (pq if pq is not None else 0), False
        return self.rc.send_batch(topic, q, msgs, ordered, self)
