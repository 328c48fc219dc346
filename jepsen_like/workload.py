"""Client workers: producers, readers, consumer-group pollers and final reads.

Theory of operation
-------------------
Every worker is one logical *process* of the history: it has at most one
operation outstanding, records ``invoke`` before sending and ``ok`` /
``fail`` / ``info`` when it knows the outcome (:class:`~jepsen_like.history.Writer`).
Workers talk plain HTTP to a random node and follow ``307`` redirects to the
leader themselves (a redirect hop has no effect, so following it stays one
operation).

Outcome rules (what the server's error table promises, and nothing more):

* a request that got no response (timeout, reset, refused after sending is
  indistinguishable) is ``info`` for a produce, and ``info`` for a read;
  a connection refused before anything was sent is ``fail``;
* ``504`` (outcome unknown: not applied within the timeout, leadership lost
  after proposing) and a ``5xx`` we do not know are ``info``;
* ``503`` (no leader, leader not ready, node stopped, transfer running),
  ``429`` (overloaded) and ``4xx`` broker errors are ``fail``: the request
  was refused before proposing, or the command was applied as a no-op;
* a read at an offset past the end (``416`` with the queue's range) is an
  ``ok`` read that found nothing there.

Values are unique strings ``p<process>-<n>``; an idempotent producer that
got ``info`` retries the *same* value with the same sequence number (a
duplicate would then be a real anomaly), a few times, then registers a new
producer id.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from jepsen_like.history import Writer

TOPIC = "jepsen"
GROUP = "jepsen-group"
# How long an unordered producer avoids a group that refused a message or
# left its outcome unknown (the routing client's ``down_for_s``, 3 s).
AVOID_S = 3.0


def key_of(queue: int) -> str:
    return f"{TOPIC}/{queue}"


@dataclass
class Reply:
    """One HTTP exchange after redirects: a status and JSON body, or no answer."""

    status: int | None
    body: Any = None
    error: str | None = None
    sent: bool = True  # False: certainly never reached a node
    node: str | None = None


@dataclass
class Stats:
    ok: int = 0
    fail: int = 0
    info: int = 0
    by_f: dict[str, list[int]] = field(default_factory=dict)

    def add(self, f: str, status: str) -> None:
        row = self.by_f.setdefault(f, [0, 0, 0])
        k = ("ok", "fail", "info").index(status)
        row[k] += 1
        if status == "ok":
            self.ok += 1
        elif status == "fail":
            self.fail += 1
        else:
            self.info += 1


class Http:
    """Redirect-following JSON over aiohttp, with a per-request deadline.

    ``routes`` (a multi-group run): queue -> the HTTP addresses of the group
    that owns it; a request for a queue goes to one of those nodes, as the
    routing client would send it (other requests go to ``nodes``)."""

    def __init__(
        self, nodes: list[str], timeout_s: float, routes: dict[int, list[str]] | None = None
    ) -> None:
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.routes = routes
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(
        self,
        method: str,
        path: str,
        *,
        node: str | None = None,
        json: Any = None,
        timeout_s: float | None = None,
        rng: random.Random | None = None,
        queue: int | None = None,
    ) -> Reply:
        assert self._session is not None
        pool = self.nodes
        if self.routes is not None and queue is not None:
            pool = self.routes[queue]
        host = node or (rng or random).choice(pool)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        url = f"http://{host}{path}"
        for _hop in range(4):
            left = deadline - time.monotonic()
            if left <= 0:
                return Reply(None, error="timeout", node=host)
            try:
                async with self._session.request(
                    method,
                    url,
                    json=json,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=left),
                ) as r:
                    if r.status in (307, 308) and "Location" in r.headers:
                        url = r.headers["Location"]
                        host = url.split("/")[2]
                        continue
                    try:
                        body = await r.json(content_type=None)
                    except ValueError:
                        body = None
                    return Reply(r.status, body, node=host)
            except aiohttp.ClientConnectorError as e:
                # Refused or unreachable before the request left: nothing sent.
                return Reply(None, error=f"connect: {e.os_error}", sent=False, node=host)
            except TimeoutError:
                return Reply(None, error="timeout", node=host)
            except aiohttp.ClientError as e:
                return Reply(None, error=f"{type(e).__name__}: {e}", node=host)
        return Reply(503, {"error": {"code": "TOO_MANY_REDIRECTS"}}, node=host)


def _err(reply: Reply) -> str:
    if reply.status is None:
        return reply.error or "no response"
    code = ""
    if isinstance(reply.body, dict) and isinstance(reply.body.get("error"), dict):
        code = str(reply.body["error"].get("code", ""))
    return f"{reply.status} {code}".strip()


def write_outcome(reply: Reply) -> str:
    """ok / fail / info for a request that may have changed the log."""
    if reply.status is None:
        return "fail" if not reply.sent else "info"
    if 200 <= reply.status < 300:
        return "ok"
    if reply.status in (503, 429) or 400 <= reply.status < 500:
        code = _err(reply)
        return "info" if "STORAGE_CORRUPTED" in code else "fail"
    return "info"


def read_outcome(reply: Reply) -> str:
    if reply.status is None:
        return "fail" if not reply.sent else "info"
    if reply.status == 200:
        return "ok"
    return "info" if reply.status >= 500 and reply.status not in (503,) else "fail"


class Workload:
    """Runs every worker until ``stop`` is set."""

    def __init__(
        self,
        writer: Writer,
        http: Http,
        *,
        queues: int,
        producers: int,
        idempotent_producers: int,
        readers: int,
        pollers: int,
        seed: int,
        op_timeout_s: float,
        clients_per_queue: int = 0,
        client_timeout_s: tuple[float, float] | None = None,
        unordered: int = 0,
        group_queues: dict[str, list[int]] | None = None,
    ) -> None:
        self.w = writer
        self.http = http
        self.queues = queues
        self.producers = producers
        self.idempotent = idempotent_producers
        self.readers = readers
        self.pollers = pollers
        self.seed = seed
        self.timeout_ms = int(op_timeout_s * 1000 * 0.8)
        self.clients_per_queue = clients_per_queue
        # Short client deadlines (drawn per op): the client gives up before the
        # server's own timeout, so ops cut off by a fault end ``info``.
        self.client_timeout_s = client_timeout_s
        self.stats = Stats()
        self.stop = asyncio.Event()
        self.high: dict[int, int] = dict.fromkeys(range(queues), 0)  # highest acked offset + 1
        self._next_process = 0
        # A multi-group run: producers that let a message move to another
        # group's queue when its group refuses it or times out (unordered
        # messages), and which queues each group owns.
        self.unordered = unordered
        self.group_queues = group_queues or {"": list(range(queues))}
        # Every worker's (role, queue, process), fixed before any runs, so a
        # history's header can say which processes are which.
        self.plan: list[tuple[str, int | None, int]] = [
            (role, q, self._process()) for role, q in self.roles()
        ]

    def processes_of(self, role: str) -> list[int]:
        return [p for r, _q, p in self.plan if r == role]

    def _process(self) -> int:
        p = self._next_process
        self._next_process += 1
        return p

    def _complete(self, status: str, process: int, f: str, **fields: Any) -> None:
        self.w.complete(status, process, **fields)  # type: ignore[arg-type]
        self.stats.add(f, status)

    async def _pause(self, rng: random.Random, status: str = "ok") -> None:
        if status == "fail":
            # Refused (node down, no leader): back off as a real client would,
            # instead of spinning through hundreds of instant failures.
            await asyncio.sleep(rng.uniform(0.2, 0.5))
        else:
            await asyncio.sleep(rng.uniform(0.002, 0.02))

    def _deadline(self, rng: random.Random, extra_s: float = 0.0) -> float | None:
        if self.client_timeout_s is None:
            return None
        return extra_s + rng.uniform(*self.client_timeout_s)

    # -- produce -----------------------------------------------------------------
    async def _register(self, rng: random.Random, queue: int | None) -> tuple[int, int] | None:
        # Producer sessions are per group: register with the queue's group.
        r = await self.http.call(
            "POST", "/v1/producers?timeout_ms=2000", json={}, rng=rng, queue=queue
        )
        if r.status == 200 and isinstance(r.body, dict):
            return int(r.body["producer_id"]), int(r.body.get("epoch", 0))
        return None

    async def producer(self, process: int, idempotent: bool, queue: int | None = None) -> None:
        """Unique values to random queues. An idempotent producer's op spans its
        retries: it re-sends the same value with the same sequence number after
        an unknown outcome (the server answers a repeat with the original
        offsets), so the history holds one logical produce that took effect at
        most once, somewhere between the first send and the final answer."""
        rng = random.Random(self.seed * 1000 + process)
        n = 0
        prod: tuple[int, int] | None = None
        seqs: dict[int, int] = {}
        while not self.stop.is_set():
            if idempotent and prod is None:
                prod = await self._register(rng, queue)
                seqs = {}
                if prod is None:
                    await asyncio.sleep(0.2)
                    continue
            q = rng.randrange(self.queues) if queue is None else queue
            value = f"p{process}-{n}"
            n += 1
            body: dict[str, Any] = {"messages": [{"value": value, "encoding": "utf-8", "queue": q}]}
            extra: dict[str, Any] = {}
            if idempotent and prod is not None:
                seq = seqs.get(q, 0)
                body.update(producer_id=prod[0], epoch=prod[1], sequence=seq)
                extra = {"producer_id": prod[0], "sequence": seq}
            self.w.invoke(process, "produce", key_of(q), value=value, **extra)
            maybe_happened = False
            attempts = 0
            final = "ok"
            while True:
                attempts += 1
                r, st, off = await self._send_produce(body, rng, q)
                if off is not None:
                    self._complete(
                        "ok", process, "produce", offset=off, node=r.node, attempts=attempts
                    )
                    self.high[q] = max(self.high[q], off + 1)
                    if idempotent:
                        seqs[q] = seqs.get(q, 0) + 1
                    break
                maybe_happened = maybe_happened or st == "info"
                broker_refused = r.status is not None and 400 <= r.status < 500 and r.status != 429
                if not idempotent or broker_refused or attempts >= 5 or self.stop.is_set():
                    final = "info" if maybe_happened else st
                    self._complete(
                        final, process, "produce", error=_err(r), node=r.node, attempts=attempts
                    )
                    if idempotent and (final == "info" or broker_refused):
                        prod = None  # an unknown or refused sequence: start a fresh producer
                    break
                await asyncio.sleep(0.1 * attempts)
            await self._pause(rng, final)

    async def _send_produce(
        self, body: dict[str, Any], rng: random.Random, q: int
    ) -> tuple[Reply, str, int | None]:
        """One produce request: the reply, its outcome, and the acknowledged
        queue offset (None unless ``ok``; an ``ok`` without one is ``info``)."""
        r = await self.http.call(
            "POST",
            f"/v1/topics/{TOPIC}/messages?timeout_ms={self.timeout_ms}",
            json=body,
            rng=rng,
            timeout_s=self._deadline(rng),
            queue=q,
        )
        st = write_outcome(r)
        if st != "ok":
            return r, st, None
        try:
            return r, st, int(r.body["messages"][0]["queue_offset"])
        except (KeyError, IndexError, TypeError, ValueError):
            return r, "info", None

    async def unordered_producer(self, process: int) -> None:
        """Unordered messages (no sharding key) in a multi-group run: each goes
        to a queue of a group picked at random among those not avoided; a
        group that refused a message (connection refused, ``503``, ``429``)
        or left its outcome unknown (no answer, ``504``) is avoided for
        ``AVOID_S``, so the next message moves to another group's queue, as
        the routing client does. A message whose outcome is unknown is never
        re-sent elsewhere (a copy in a second group would be a duplicate):
        the op ends ``info`` and the next message is a new one."""
        rng = random.Random(self.seed * 1000 + process)
        avoid: dict[str, float] = {}
        n = 0
        while not self.stop.is_set():
            now = time.monotonic()
            groups = [g for g in self.group_queues if avoid.get(g, 0.0) <= now]
            if groups:
                g = rng.choice(groups)
            else:
                # Every group refused lately: the one refused longest ago (a
                # dead group keeps refusing, a live one that missed a
                # deadline once does not).
                g = min(self.group_queues, key=lambda k: avoid.get(k, 0.0))
            q = rng.choice(self.group_queues[g])
            value = f"u{process}-{n}"
            n += 1
            body = {"messages": [{"value": value, "encoding": "utf-8", "queue": q}]}
            self.w.invoke(process, "produce", key_of(q), value=value)
            r, st, off = await self._send_produce(body, rng, q)
            if off is not None:
                self._complete("ok", process, "produce", offset=off, node=r.node)
                self.high[q] = max(self.high[q], off + 1)
            else:
                self._complete(st, process, "produce", error=_err(r), node=r.node)
                avoid[g] = time.monotonic() + AVOID_S
            # No back-off after a refusal: another group is there to take the next.
            await self._pause(rng)

    # -- reads ------------------------------------------------------------------------
    async def read_once(
        self,
        process: int,
        q: int,
        offset: int,
        consistency: str,
        limit: int,
        f: str = "read",
        rng: random.Random | None = None,
        node: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[str, list[list[Any]], int | None]:
        """Records one read; returns (status, pairs, next offset)."""
        self.w.invoke(process, f, key_of(q), offset=offset, consistency=consistency, limit=limit)
        path = (
            f"/v1/topics/{TOPIC}/queues/{q}/messages?offset={offset}&max_messages={limit}"
            f"&encoding=utf-8&consistency={consistency}&timeout_ms={self.timeout_ms}"
        )
        if timeout_s is None and rng is not None:
            timeout_s = self._deadline(rng)
        r = await self.http.call("GET", path, rng=rng, node=node, timeout_s=timeout_s, queue=q)
        if r.status == 416 and isinstance(r.body, dict):
            err = r.body.get("error", {})
            hi = err.get("max_offset") if isinstance(err, dict) else None
            if isinstance(hi, int) and offset > hi:
                self._complete("ok", process, f, value=[], end=True, node=r.node)
                return "ok", [], offset
        st = read_outcome(r)
        if st != "ok":
            self._complete(st, process, f, error=_err(r), node=r.node)
            return st, [], None
        try:
            msgs = r.body["messages"]
            pairs = [[int(m["queue_offset"]), str(m["value"])] for m in msgs]
            nxt = int(r.body["next_offset"])
            # The server says where the log ends: a read cut short by a byte or
            # scan limit has fewer than `limit` messages and still end=false.
            end = nxt >= int(r.body["max_offset"])
        except (KeyError, TypeError, ValueError):
            self._complete("info", process, f, error="bad ok body", node=r.node)
            return "info", [], None
        self._complete("ok", process, f, value=pairs, end=end, node=r.node)
        return "ok", pairs, nxt

    async def reader(self, process: int, queue: int | None = None) -> None:
        """Reads near the head of the log. With a fixed queue (the contended
        workload), most reads start at or just below the highest acknowledged
        offset with a small limit, racing the producers: their results end
        with ``end=true`` (the log's end) or ``end=false`` (more behind)."""
        rng = random.Random(self.seed * 1000 + process)
        while not self.stop.is_set():
            q = rng.randrange(self.queues) if queue is None else queue
            hi = self.high[q]
            if queue is None:
                offset = max(0, hi - rng.randint(0, 6))
                consistency = "linearizable" if rng.random() < 0.6 else "committed"
                limit = 8
            else:
                offset = max(0, hi - rng.randint(-1, 3))
                consistency = "linearizable" if rng.random() < 0.75 else "committed"
                limit = rng.choice((2, 4, 8))
            st, _, _ = await self.read_once(process, q, offset, consistency, limit, rng=rng)
            await self._pause(rng, st)

    # -- consumer group ------------------------------------------------------------------
    async def poller(self, process: int, index: int) -> None:
        rng = random.Random(self.seed * 1000 + process)
        q = index % self.queues
        pos: int | None = None
        since_commit = 0
        while not self.stop.is_set():
            if pos is None:
                self.w.invoke(process, "seek", key_of(q), offset=0, group=GROUP)
                # Linearizable: a committed read may come from a replica still
                # catching up (just resumed or restarted) and show an older
                # committed offset, which the queue checker would take for an
                # offset regression.
                r = await self.http.call(
                    "GET",
                    f"/v1/groups/{GROUP}/offsets?topic={TOPIC}&consistency=linearizable"
                    f"&timeout_ms={self.timeout_ms}",
                    rng=rng,
                    queue=q,
                )
                st = read_outcome(r)
                if st != "ok":
                    self._complete(st, process, "seek", error=_err(r), node=r.node)
                    await asyncio.sleep(0.2)
                    continue
                committed = 0
                for o in r.body.get("offsets", []) if isinstance(r.body, dict) else []:
                    if o.get("topic") == TOPIC and o.get("queue") == q:
                        committed = int(o.get("offset", 0))
                self._complete("ok", process, "seek", offset=committed, node=r.node)
                pos = committed
                continue
            self.w.invoke(process, "poll", key_of(q), offset=pos, group=GROUP, limit=16)
            r = await self.http.call(
                "GET",
                f"/v1/topics/{TOPIC}/queues/{q}/messages?offset={pos}&max_messages=16"
                f"&encoding=utf-8&wait_ms=200",
                rng=rng,
                timeout_s=self._deadline(rng, extra_s=0.2),  # on top of the long poll
                queue=q,
            )
            if r.status == 416:
                self._complete("ok", process, "poll", value=[], node=r.node)
                await asyncio.sleep(0.05)
                continue
            st = read_outcome(r)
            if st != "ok":
                self._complete(st, process, "poll", error=_err(r), node=r.node)
                pos = None if st == "info" else pos
                await asyncio.sleep(0.05)
                continue
            try:
                pairs: list[list[Any]] = [
                    [int(m["queue_offset"]), str(m["value"])] for m in r.body["messages"]
                ]
            except (KeyError, TypeError, ValueError):
                self._complete("info", process, "poll", error="bad ok body", node=r.node)
                pos = None
                continue
            self._complete("ok", process, "poll", value=pairs, node=r.node)
            if pairs:
                pos = int(pairs[-1][0]) + 1
            since_commit += len(pairs)
            if since_commit >= 8:
                since_commit = 0
                self.w.invoke(process, "commit_offset", key_of(q), offset=pos, group=GROUP)
                r = await self.http.call(
                    "POST",
                    f"/v1/groups/{GROUP}/offsets?timeout_ms={self.timeout_ms}",
                    json={"offsets": [{"topic": TOPIC, "queue": q, "offset": pos}]},
                    rng=rng,
                    timeout_s=self._deadline(rng),
                    queue=q,
                )
                st = write_outcome(r)
                self._complete(st, process, "commit_offset", error=None if st == "ok" else _err(r))
            await self._pause(rng)

    # -- final reads ----------------------------------------------------------------------
    async def final_reads(
        self, leader_http: str | dict[int, str | None] | None, deadline_s: float
    ) -> bool:
        """Read every queue from 0 to its end, linearizably; True when all
        completed. ``leader_http``: the leader, or (several groups) each
        queue's group's leader."""
        process = self._process()
        rng = random.Random(self.seed * 1000 + process)
        complete = True
        end_at = time.monotonic() + deadline_s
        for q in range(self.queues):
            offset = 0
            while time.monotonic() < end_at:
                st, pairs, _ = await self.read_once(
                    process,
                    q,
                    offset,
                    "linearizable",
                    500,
                    f="final_read",
                    rng=rng,
                    node=leader_http.get(q) if isinstance(leader_http, dict) else leader_http,
                    timeout_s=5.0,
                )
                if st != "ok":
                    await asyncio.sleep(0.3)
                    continue
                if not pairs or len(pairs) < 500:
                    break
                offset = pairs[-1][0] + 1
            else:
                complete = False
        return complete

    async def setup_topic(self, deadline_s: float) -> bool:
        end_at = time.monotonic() + deadline_s
        while time.monotonic() < end_at:
            r = await self.http.call(
                "POST", "/v1/topics", json={"name": TOPIC, "queues": self.queues}
            )
            if r.status in (200, 201) or (r.status == 409 and "TOPIC_EXISTS" in _err(r)):
                return True
            await asyncio.sleep(0.3)
        return False

    def roles(self) -> list[tuple[str, int | None]]:
        """(role, queue) of every worker: ``plain`` / ``idempotent`` producers,
        ``reader`` and ``poller``. With ``clients_per_queue`` each queue gets
        that many clients of its own (half producers, a third of them
        idempotent; the rest head readers), so the ops of one key overlap
        many others; otherwise the legacy mix of random-queue workers."""
        out: list[tuple[str, int | None]] = []
        if self.clients_per_queue > 0:
            n = self.clients_per_queue
            n_prod = max(1, (n + 1) // 2)
            n_idem = n_prod // 3
            for q in range(self.queues):
                out += [("idempotent", q)] * n_idem
                out += [("plain", q)] * (n_prod - n_idem)
                out += [("reader", q)] * (n - n_prod)
        else:
            out += [("idempotent", None)] * self.idempotent
            out += [("plain", None)] * max(0, self.producers - self.idempotent)
            out += [("reader", None)] * self.readers
        out += [("poller", k) for k in range(self.pollers)]
        out += [("unordered", None)] * self.unordered
        return out

    def tasks(self) -> list[asyncio.Task[None]]:
        out = []
        for role, q, p in self.plan:
            if role in ("plain", "idempotent"):
                out.append(asyncio.create_task(self.producer(p, role == "idempotent", q)))
            elif role == "reader":
                out.append(asyncio.create_task(self.reader(p, q)))
            elif role == "unordered":
                out.append(asyncio.create_task(self.unordered_producer(p)))
            else:
                assert q is not None
                out.append(asyncio.create_task(self.poller(p, q)))
        return out
