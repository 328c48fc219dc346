"""Python clients for the /v1 API: :class:`Client` (sync, stdlib only but for the codec) and
:class:`AsyncClient` (aiohttp), with the same methods. Produce bodies go
in binary (the record layout of :mod:`broker_adapter.codec`, its only import
from this project), or as JSON where a node takes JSON only.

Both follow the leader: a ``307`` is followed to its ``Location``; a ``503``,
a ``429`` or a refused connection moves on to the next known node after a
short back-off, until ``retry_for_s`` runs out. A write whose outcome is
unknown (timeout, connection lost after sending, ``504``) is retried only
when it is safe: consumer-offset commits and topic reads are idempotent, and
produce through an :class:`IdempotentProducer` re-sends the same batch with
the same sequence, which the broker answers with the original offsets.
A plain produce raises :class:`OutcomeUnknownError` instead.

Authentication: pass ``token=`` (or set ``DLEDGER_TOKEN``) when the cluster
file has ``[auth]`` tokens; every request then carries
``Authorization: Bearer <token>``. A ``401`` raises
:class:`AuthenticationError`, a ``403`` :class:`PermissionDeniedError`.

An :class:`IdempotentProducer` chooses the queue itself (explicit queue,
hash of the sharding key with the broker's hash, else round robin) so that
it knows which per-queue sequence a batch carries.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import time
import urllib.parse
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker_adapter import codec
from broker_adapter.errors import BrokerError

RETRY_STATUSES = (429, 503)


class ApiError(Exception):
    """An error answer: ``status``, ``code``, ``message`` and the envelope's
    other fields in ``details`` (e.g. ``field``, ``min_offset``)."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        # status 0: no HTTP answer at all (refused, timed out, connection lost)
        super().__init__(f"{status} {code}: {message}" if status else f"{code}: {message}")
        self.status = status
        self.code = code
        self.details = details


class NotSent(Exception):
    """A connection could not be set up: the request was surely not sent."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class OutcomeUnknownError(ApiError):
    """The write may or may not have happened; retrying it may duplicate it."""


class UnavailableError(ApiError):
    """No node could serve the request within the retry budget."""


class AuthenticationError(ApiError):
    """401: no token, or one the cluster does not know."""


class PermissionDeniedError(ApiError):
    """403: the token lacks the role the route needs."""


TOKEN_ENV = "DLEDGER_TOKEN"


def _auth_headers(token: str | None) -> dict[str, str]:
    """``token`` or, when it is None, ``$DLEDGER_TOKEN``; empty: no header."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass(frozen=True, slots=True)
class Ack:
    topic: str
    queue: int
    queue_offset: int
    commit_offset: int
    msg_id: str
    duplicate: bool


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    queue: int
    queue_offset: int
    commit_offset: int
    msg_id: str
    value: bytes
    tags: str
    keys: tuple[str, ...]
    properties: dict[str, str]
    store_ts_ms: int
    born_ts_ms: int


@dataclass(frozen=True, slots=True)
class Batch:
    records: tuple[Record, ...]
    next_offset: int
    min_offset: int
    max_offset: int


@dataclass(slots=True)
class OutMessage:
    value: bytes
    tags: str = ""
    keys: Sequence[str] = ()
    properties: dict[str, str] = field(default_factory=dict)
    queue: int | None = None
    sharding_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": base64.b64encode(self.value).decode()}
        if self.tags:
            d["tags"] = self.tags
        if self.keys:
            d["keys"] = list(self.keys)
        if self.properties:
            d["properties"] = self.properties
        if self.queue is not None:
            d["queue"] = self.queue
        if self.sharding_key is not None:
            d["sharding_key"] = self.sharding_key
        return d


@dataclass(frozen=True, slots=True)
class BinaryBody:
    """A request body sent as it is, with its Content-Type."""

    data: bytes
    content_type: str


def produce_body(
    msgs: Sequence[OutMessage],
    binary: bool,
    producer_id: int | None = None,
    epoch: int = 0,
    sequence: int | None = None,
) -> Any:
    """A produce request's body: the binary batch (no JSON, no base64 on
    either side; its layout is in /openapi.json) or the JSON one. A batch
    the binary encoder refuses (a string or value over the default caps)
    goes as JSON, so the node that may have other caps answers it."""
    if binary:
        born = int(time.time() * 1000)
        rows = [
            (m.value, m.tags, tuple(m.keys), tuple(sorted(m.properties.items())),
             m.queue, m.sharding_key or None, born)
            for m in msgs
        ]  # fmt: skip
        try:
            data = codec.encode_batch(
                rows,
                producer_id=producer_id or 0,
                epoch=epoch,
                sequence=-1 if sequence is None else sequence,
            )
        except (BrokerError, TypeError, UnicodeError):
            pass
        else:
            return BinaryBody(data, codec.BATCH_CONTENT_TYPE)
    body: dict[str, Any] = {"messages": [m.to_json() for m in msgs]}
    if producer_id is not None:
        body.update(producer_id=producer_id, epoch=epoch, sequence=sequence)
    return body


def _binary_refused(exc: ApiError) -> bool:
    """A node (a broker group's, or the proxy) that takes JSON bodies only."""
    return exc.status == 415 and exc.code == "UNSUPPORTED_MEDIA_TYPE"


def _send_produce(
    client: Client,
    topic: str,
    msgs: Sequence[OutMessage],
    *,
    safe: bool,
    ids: tuple[int | None, int, int | None] = (None, 0, None),
) -> list[Ack]:
    """One produce request through ``client`` (:func:`produce_body`;
    ``ids``: producer id, epoch, sequence). A binary body a node refuses
    with 415 goes again as JSON (refused, so surely not written), and the
    client sends JSON from then on."""
    path = f"/v1/topics/{topic}/messages"
    body = produce_body(msgs, client.binary, *ids)
    try:
        return _acks(client.request("POST", path, body, safe=safe))
    except ApiError as exc:
        if not (isinstance(body, BinaryBody) and _binary_refused(exc)):
            raise
        client.binary = False
    return _acks(client.request("POST", path, produce_body(msgs, False, *ids), safe=safe))


def _as_messages(values: Sequence[bytes | str | OutMessage]) -> list[OutMessage]:
    out = []
    for v in values:
        if isinstance(v, OutMessage):
            out.append(v)
        else:
            out.append(OutMessage(v.encode() if isinstance(v, str) else v))
    return out


def _error(status: int, body: Any) -> ApiError:
    e = body.get("error", {}) if isinstance(body, dict) else {}
    code = str(e.get("code", "HTTP_ERROR"))
    details = {k: v for k, v in e.items() if k not in ("code", "message")}
    classes: dict[int, type[ApiError]] = {
        504: OutcomeUnknownError,
        401: AuthenticationError,
        403: PermissionDeniedError,
    }
    return classes.get(status, ApiError)(status, code, str(e.get("message", "")), details)


def _acks(body: dict[str, Any]) -> list[Ack]:
    return [
        Ack(
            body["topic"],
            m["queue"],
            m["queue_offset"],
            m["commit_offset"],
            m["msg_id"],
            bool(m.get("duplicate", False)),
        )
        for m in body["messages"]
    ]


def _batch(topic: str, queue: int, body: dict[str, Any]) -> Batch:
    recs = tuple(
        Record(
            topic,
            queue,
            m["queue_offset"],
            m["commit_offset"],
            m["msg_id"],
            base64.b64decode(m["value"]) if m["encoding"] == "base64" else m["value"].encode(),
            m["tags"],
            tuple(m["keys"]),
            dict(m["properties"]),
            m["store_ts_ms"],
            m["born_ts_ms"],
        )
        for m in body["messages"]
    )
    return Batch(recs, body["next_offset"], body["min_offset"], body["max_offset"])


def _consume_path(
    topic: str,
    queue: int,
    offset: int,
    max_messages: int,
    wait_ms: int,
    tag: str | None,
    consistency: str,
) -> str:
    q = {
        "offset": offset,
        "max_messages": max_messages,
        "wait_ms": wait_ms,
        "consistency": consistency,
    }
    if tag:
        q["tag"] = tag
    return f"/v1/topics/{topic}/queues/{queue}/messages?{urllib.parse.urlencode(q)}"


def _describe(exc: BaseException) -> str:
    """A connection failure in words: ``timed out``, ``connection reset``, ..."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def queue_for_key(key: str, queues: int) -> int:
    """The broker's queue for a sharding key (same hash as the state machine)."""
    return zlib.crc32(key.encode("utf-8")) % queues


class Client:
    """Synchronous client. ``addresses``: ``host:port`` of any nodes;
    ``token``: bearer token (default ``$DLEDGER_TOKEN``, if set);
    ``binary``: produce in the binary body (``application/vnd.dledger.batch``)
    rather than JSON (falls back to JSON where a node answers 415)."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float = 10.0,
        retry_for_s: float = 30.0,
        token: str | None = None,
        binary: bool = True,
    ) -> None:
        if not addresses:
            raise ValueError("at least one node address is needed")
        self.addresses = list(addresses)
        self._auth = _auth_headers(token)
        # produce bodies in binary (off after a node answers that it takes
        # JSON only: a broker group's node, the proxy)
        self.binary = binary
        # Safe requests sent again after an unknown outcome (connection lost
        # after sending, timeout, 504): what the idempotent producer is for.
        self.resent_after_unknown = 0
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self._current = self.addresses[0]

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        safe: bool,
        retry_for_s: float | None = None,
    ) -> Any:
        """``safe``: the request may be repeated after an unknown outcome.
        ``retry_for_s``: this request's retry budget (default the client's).
        An :class:`UnavailableError` says in ``details["outcome_unknown"]``
        whether some attempt may have been carried out; when it is False,
        none was (refused connections, 503s, 429s): the request surely did
        nothing."""
        if isinstance(body, BinaryBody):
            data: bytes | None = body.data
            content_type = body.content_type
        else:
            data = json.dumps(body).encode() if body is not None else None
            content_type = "application/json"
        retry_for_s = self.retry_for_s if retry_for_s is None else retry_for_s
        deadline = time.monotonic() + retry_for_s
        address = self._current
        k = 0
        last = ""  # why the last attempt failed, for the error a person reads
        # Whether some attempt may have been carried out (sent, then no
        # answer, or a 504): the request then failed "maybe", not "surely".
        ambiguous = False
        while True:
            # No single attempt outlives the retry budget: a node that never
            # answers costs at most what is left of it.
            attempt_s = min(self.timeout_s, max(0.2, deadline - time.monotonic()))
            try:
                status, headers, raw = self._once(
                    address, method, path, data, attempt_s, content_type
                )
            except ConnectionRefusedError:
                status, headers, raw = 0, {}, b""
                last = f"connection refused at {address}"
            except NotSent as exc:
                status, headers, raw = 0, {}, b""
                last = f"cannot connect to {address}: {_describe(exc.cause)}"
            except (OSError, http.client.HTTPException) as exc:
                if not safe:
                    raise OutcomeUnknownError(
                        0, "CONNECTION", f"{address}: {_describe(exc)}", {}
                    ) from None
                self.resent_after_unknown += 1
                ambiguous = True
                status, headers, raw = 0, {}, b""
                last = f"{address}: {_describe(exc)}"
            if status == 307 and "location" in headers:
                address = urllib.parse.urlsplit(headers["location"]).netloc
                continue
            parsed = json.loads(raw) if raw else None
            if 200 <= status < 300:
                self._current = address
                return parsed
            if status == 504 and safe:
                self.resent_after_unknown += 1
                ambiguous = True
                status = 503
            if status in (0, *RETRY_STATUSES):
                if status:
                    last = f"{address} answered {status}"
                    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                        last += f" {parsed['error'].get('code', '')}".rstrip()
                if time.monotonic() > deadline:
                    raise UnavailableError(
                        status,
                        "UNAVAILABLE",
                        f"{method} {path}: gave up after {retry_for_s:g} s; last attempt: {last}",
                        {"last_error": last, "outcome_unknown": ambiguous},
                    )
                k += 1
                address = self.addresses[k % len(self.addresses)]
                time.sleep(min(0.5, 0.05 * k, max(0.0, deadline - time.monotonic())))
                continue
            raise _error(status, parsed)

    def _once(
        self,
        address: str,
        method: str,
        path: str,
        data: bytes | None,
        timeout_s: float | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, str], bytes]:
        host, _, port = address.rpartition(":")
        conn = http.client.HTTPConnection(
            host, int(port), timeout=self.timeout_s if timeout_s is None else timeout_s
        )
        try:
            try:
                conn.connect()
            except OSError as exc:
                if isinstance(exc, ConnectionRefusedError):
                    raise
                raise NotSent(exc) from None  # nothing was sent: surely not done
            headers = dict(self._auth)
            if data is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    # -- API --------------------------------------------------------------------
    def create_topic(self, name: str, queues: int = 8) -> dict[str, Any]:
        res: dict[str, Any] = self.request(
            "POST", "/v1/topics", {"name": name, "queues": queues}, safe=False
        )
        return res

    def topic(self, name: str) -> dict[str, Any]:
        res: dict[str, Any] = self.request("GET", f"/v1/topics/{name}", safe=True)
        return res

    def topics(self) -> list[dict[str, Any]]:
        res: list[dict[str, Any]] = self.request("GET", "/v1/topics", safe=True)["topics"]
        return res

    def delete_topic(self, name: str) -> None:
        self.request("DELETE", f"/v1/topics/{name}", safe=False)

    def produce(self, topic: str, values: Sequence[bytes | str | OutMessage]) -> list[Ack]:
        return _send_produce(self, topic, _as_messages(values), safe=False)

    def consume(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 100,
        wait_ms: int = 0,
        tag: str | None = None,
        consistency: str = "committed",
    ) -> Batch:
        path = _consume_path(topic, queue, offset, max_messages, wait_ms, tag, consistency)
        return _batch(topic, queue, self.request("GET", path, safe=True))

    def commit(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        body = {"offsets": [{"topic": t, "queue": q, "offset": o} for (t, q), o in offsets.items()]}
        self.request("POST", f"/v1/groups/{group}/offsets", body, safe=True)

    def offsets(self, group: str, topic: str | None = None) -> dict[tuple[str, int], int]:
        # Linearizable (from the leader): a lagging replica could return an
        # offset older than the group's last commit, and the group re-read.
        path = f"/v1/groups/{group}/offsets?consistency=linearizable" + (
            f"&topic={topic}" if topic else ""
        )
        res = self.request("GET", path, safe=True)
        return {(o["topic"], o["queue"]): o["offset"] for o in res["offsets"]}

    def reset(self, group: str, topic: str, to: str = "earliest", timestamp_ms: int = 0) -> None:
        body: dict[str, Any] = {"topic": topic, "to": to}
        if to == "timestamp":
            body["timestamp_ms"] = timestamp_ms
        self.request("POST", f"/v1/groups/{group}/reset", body, safe=True)

    def producer(self) -> IdempotentProducer:
        # Registering again after an unknown outcome is harmless: a producer id
        # that nobody uses expires after producer_idle_ms. (A failover during
        # registration used to surface as OUTCOME_UNKNOWN to the caller.)
        res = self.request("POST", "/v1/producers", {}, safe=True)
        return IdempotentProducer(self, res["producer_id"], res["epoch"])

    def consumer(
        self, topic: str, group: str, wait_ms: int = 1000, start: str = "earliest"
    ) -> Iterator[Record]:
        """Every message of ``topic`` from the group's committed offsets (or
        ``start``), long-polling, committing each page after yielding it."""
        queues = len(self.topic(topic)["queues"])
        committed = self.offsets(group, topic)
        info = self.topic(topic)["queues"]
        pos = {
            q: committed.get(
                (topic, q), info[q]["min_offset"] if start == "earliest" else info[q]["max_offset"]
            )
            for q in range(queues)
        }
        while True:
            for q in range(queues):
                b = self.consume(topic, q, pos[q], wait_ms=wait_ms if queues == 1 else 0)
                yield from b.records
                if b.next_offset != pos[q]:
                    pos[q] = b.next_offset
                    self.commit(group, {(topic, q): pos[q]})
            if queues > 1:
                time.sleep(wait_ms / 1000 / 10)


class IdempotentProducer:
    """Sends batches that a retry can never duplicate (see the module doc)."""

    def __init__(self, client: Client, producer_id: int, epoch: int) -> None:
        self.client = client
        self.producer_id = producer_id
        self.epoch = epoch
        self._seq: dict[tuple[str, int], int] = {}
        self._queues: dict[str, int] = {}
        self._rr = 0

    def _queue(self, topic: str, queue: int | None, key: str | None) -> int:
        if queue is not None:
            return queue
        if topic not in self._queues:
            self._queues[topic] = len(self.client.topic(topic)["queues"])
        n = self._queues[topic]
        if key is not None:
            return queue_for_key(key, n)
        self._rr += 1
        return self._rr % n

    def send(
        self,
        topic: str,
        values: Sequence[bytes | str | OutMessage],
        queue: int | None = None,
        sharding_key: str | None = None,
    ) -> list[Ack]:
        q = self._queue(topic, queue, sharding_key)
        msgs = _as_messages(values)
        for m in msgs:
            m.queue, m.sharding_key = q, None
        seq = self._seq.get((topic, q), 0)
        ids = (self.producer_id, self.epoch, seq)
        acks = _send_produce(self.client, topic, msgs, safe=True, ids=ids)
        self._seq[(topic, q)] = seq + len(msgs)
        return acks


class AsyncClient:
    """The same API over aiohttp (``async with AsyncClient([...]) as c``)."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float = 10.0,
        retry_for_s: float = 30.0,
        token: str | None = None,
        binary: bool = True,
    ) -> None:
        import aiohttp

        if not addresses:
            raise ValueError("at least one node address is needed")
        self.addresses = list(addresses)
        self.binary = binary  # as Client's
        self.retry_for_s = retry_for_s
        self._current = self.addresses[0]
        self.resent_after_unknown = 0
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s), headers=_auth_headers(token)
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        safe: bool,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """``headers``: extra request headers (they override the client's)."""
        import aiohttp

        deadline = time.monotonic() + self.retry_for_s
        address = self._current
        k = 0
        ambiguous = False
        while True:
            status, location, parsed = 0, None, None
            if isinstance(body, BinaryBody):
                kw: dict[str, Any] = {
                    "data": body.data,
                    "headers": {"Content-Type": body.content_type, **(headers or {})},
                }
            else:
                kw = {"json": body, "headers": headers}
            try:
                async with self._session.request(
                    method, f"http://{address}{path}", allow_redirects=False, **kw
                ) as r:
                    status, location = r.status, r.headers.get("Location")
                    raw = await r.read()
                    parsed = json.loads(raw) if raw else None
            except aiohttp.ClientConnectorError:
                status = 0
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not safe:
                    raise OutcomeUnknownError(0, "CONNECTION", repr(exc), {}) from None
                self.resent_after_unknown += 1
                ambiguous = True
                status = 0
            if status == 307 and location:
                address = urllib.parse.urlsplit(location).netloc
                continue
            if 200 <= status < 300:
                self._current = address
                return parsed
            if status == 504 and safe:
                self.resent_after_unknown += 1
                ambiguous = True
                status = 503
            if status in (0, *RETRY_STATUSES):
                if time.monotonic() > deadline:
                    raise UnavailableError(
                        status, "UNAVAILABLE", f"{method} {path}", {"outcome_unknown": ambiguous}
                    )
                k += 1
                address = self.addresses[k % len(self.addresses)]
                await asyncio.sleep(min(0.5, 0.05 * k))
                continue
            raise _error(status, parsed)

    async def create_topic(self, name: str, queues: int = 8) -> dict[str, Any]:
        res: dict[str, Any] = await self.request(
            "POST", "/v1/topics", {"name": name, "queues": queues}, safe=False
        )
        return res

    async def produce(self, topic: str, values: Sequence[bytes | str | OutMessage]) -> list[Ack]:
        msgs, path = _as_messages(values), f"/v1/topics/{topic}/messages"
        body = produce_body(msgs, self.binary)
        try:
            return _acks(await self.request("POST", path, body, safe=False))
        except ApiError as exc:
            if not (isinstance(body, BinaryBody) and _binary_refused(exc)):
                raise
            self.binary = False  # refused, so surely not written: send it as JSON
        return _acks(await self.request("POST", path, produce_body(msgs, False), safe=False))

    async def consume(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 100,
        wait_ms: int = 0,
        tag: str | None = None,
        consistency: str = "committed",
    ) -> Batch:
        path = _consume_path(topic, queue, offset, max_messages, wait_ms, tag, consistency)
        return _batch(topic, queue, await self.request("GET", path, safe=True))

    async def commit(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        body = {"offsets": [{"topic": t, "queue": q, "offset": o} for (t, q), o in offsets.items()]}
        await self.request("POST", f"/v1/groups/{group}/offsets", body, safe=True)

    async def offsets(self, group: str, topic: str | None = None) -> dict[tuple[str, int], int]:
        # Linearizable (from the leader): a lagging replica could return an
        # offset older than the group's last commit, and the group re-read.
        path = f"/v1/groups/{group}/offsets?consistency=linearizable" + (
            f"&topic={topic}" if topic else ""
        )
        res = await self.request("GET", path, safe=True)
        return {(o["topic"], o["queue"]): o["offset"] for o in res["offsets"]}
