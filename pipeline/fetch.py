"""Committed reads of a cluster's topics over HTTP, for the Spark source.

Theory of operation
-------------------
Every replica serves ``consistency=committed`` reads up to its own confirm
offset, so a reader may use any endpoint: it keeps one keep-alive connection
to the endpoint it is on and moves to the next one on a refused or broken
connection, a timeout, a ``5xx`` or a ``429``, with a short back-off, until
``retry_for_s`` passes without a useful answer. It never follows a ``307``
(reads are not redirected) and never writes.

:func:`read_range` returns exactly the messages ``[start, end)`` of one
queue, in offset order, or raises. Committed messages never change, so the
same range read twice (a retried Spark task, a micro-batch replayed from the
checkpoint after a restart) gives the same rows. A replica that has not yet
applied up to ``end`` answers with fewer messages or ``416`` above its max
offset: the reader long-polls it, and after ``retry_for_s`` without progress
gives up with :class:`SourceUnavailableError`. Offsets below the queue's min
offset (retention) or a topic that no longer exists are data loss:
:class:`DataLossError` when ``fail_on_data_loss``, else a warning and the
range continues after the gap.

This module holds no state between calls and opens its connections itself,
so Spark may run it on any executor.
"""

from __future__ import annotations

import binascii
import http.client
import logging
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.options import DataLossError, PipelineError, SourceUnavailableError

log = logging.getLogger("pipeline.source")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
POLL_WAIT_MS = 500


@dataclass(frozen=True, slots=True)
class QueueRange:
    """What one Spark input partition reads: offsets ``[start, end)``."""

    topic: str
    queue: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class QueueInfo:
    queue: int
    min_offset: int
    max_offset: int


class UnknownTopicError(PipelineError):
    """The topic does not exist on the endpoint that answered."""


class NodeClient:
    """Keep-alive JSON GETs against any of ``endpoints`` (see the module doc).

    ``first`` picks the endpoint to start on, so that parallel tasks spread
    over the replicas."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        timeout_s: float = 10.0,
        retry_for_s: float = 60.0,
        first: int = 0,
    ) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self._k = first % len(endpoints)
        self._conn: http.client.HTTPConnection | None = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._k]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rotate(self) -> None:
        self.close()
        self._k = (self._k + 1) % len(self.endpoints)

    def _once(self, path: str) -> tuple[int, bytes]:
        if self._conn is None:
            host, _, port = self.endpoint.rpartition(":")
            self._conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            self._conn.request("GET", path, headers={"Accept": "application/json"})
            r = self._conn.getresponse()
            body = r.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if r.getheader("connection", "").lower() == "close":
            self.close()
        return r.status, body

    def get(self, path: str) -> tuple[int, Any]:
        """``(status, parsed JSON body)`` of the first answer that is neither a
        connection failure nor a retryable status; raises
        :class:`SourceUnavailableError` after ``retry_for_s``."""
        deadline = time.monotonic() + self.retry_for_s
        tries = 0
        last = ""
        while True:
            try:
                status, raw = self._once(path)
                if status not in RETRY_STATUSES:
                    return status, orjson.loads(raw) if raw else None
                last = f"{self.endpoint} answered {status}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{self.endpoint}: {exc!r}"
            tries += 1
            if time.monotonic() > deadline:
                raise SourceUnavailableError(
                    f"GET {path}: no endpoint of {list(self.endpoints)} answered within "
                    f"{self.retry_for_s:.0f}s (last: {last})"
                )
            self.rotate()
            time.sleep(min(0.5, 0.02 * tries))

    # -- the two calls the source makes -------------------------------------------
    def describe(self, topic: str) -> list[QueueInfo]:
        status, body = self.get(f"/v1/topics/{urllib.parse.quote(topic)}?consistency=committed")
        if status == 404:
            raise UnknownTopicError(f"topic {topic!r} does not exist ({self.endpoint})")
        if status != 200:
            raise PipelineError(f"describe {topic!r} on {self.endpoint}: {status} {body}")
        return [QueueInfo(q["queue"], q["min_offset"], q["max_offset"]) for q in body["queues"]]

    def fetch(
        self, topic: str, queue: int, offset: int, max_messages: int, wait_ms: int
    ) -> tuple[int, Any]:
        q = urllib.parse.urlencode(
            {
                "offset": offset,
                "max_messages": max_messages,
                "max_bytes": 8 << 20,
                "wait_ms": wait_ms,
                "consistency": "committed",
            }
        )
        return self.get(f"/v1/topics/{urllib.parse.quote(topic)}/queues/{queue}/messages?{q}")


def first_endpoint(topic: str, queue: int) -> int:
    """A stable spread of queues over endpoints (same range, same replica first)."""
    return zlib.crc32(f"{topic}/{queue}".encode())


def _error_details(body: Any) -> dict[str, Any]:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return dict(body["error"])
    return {}


def read_range(
    client: NodeClient,
    r: QueueRange,
    *,
    fail_on_data_loss: bool,
    fetch_max_messages: int = 1000,
) -> Iterator[list[dict[str, Any]]]:
    """Pages of message JSON objects (the API's shape) covering exactly
    ``[r.start, r.end)`` of one queue, less any gap skipped when
    ``fail_on_data_loss`` is false. See the module doc for the errors."""
    cur = r.start
    wait_ms = 0
    stalled_since: float | None = None
    where = f"{r.topic}/{r.queue}"
    while cur < r.end:
        status, body = client.fetch(
            r.topic, r.queue, cur, min(fetch_max_messages, r.end - cur), wait_ms
        )
        err = _error_details(body)
        if status == 200:
            msgs: list[dict[str, Any]] = body["messages"]
            if msgs:
                page = [m for m in msgs if m["queue_offset"] < r.end]
                for k, m in enumerate(page):
                    if m["queue_offset"] != cur + k:
                        raise PipelineError(
                            f"{where}: asked for offset {cur + k} from {client.endpoint}, "
                            f"got {m['queue_offset']} (a broken server answer)"
                        )
                cur += len(page)
                wait_ms, stalled_since = 0, None
                yield page
                continue
            # the replica has not applied up to `end` yet: long-poll, then others
            stalled_since = _stalled(client, stalled_since, where, cur, r.end)
            wait_ms = POLL_WAIT_MS
            continue
        if status == 416 and "min_offset" in err:
            lo, hi = int(err["min_offset"]), int(err["max_offset"])
            if cur < lo:
                cur = _data_loss(
                    where, cur, min(lo, r.end), f"the queue now starts at {lo}", fail_on_data_loss
                )
                continue
            stalled_since = _stalled(client, stalled_since, where, cur, r.end, hi)
            wait_ms = POLL_WAIT_MS
            continue
        if status == 404:
            # The topic (or queue) is gone: on every replica once deleted, or on
            # a replica that has not applied its creation yet. Ask the others.
            if stalled_since is not None and time.monotonic() - stalled_since > min(
                5.0, client.retry_for_s
            ):
                cur = _data_loss(
                    where,
                    cur,
                    r.end,
                    f"{err.get('code', 'NOT_FOUND')}: {err.get('message', '')}",
                    fail_on_data_loss,
                )
                continue
            stalled_since = _stalled(client, stalled_since, where, cur, r.end)
            time.sleep(0.1)
            continue
        raise PipelineError(f"{where} offset {cur} on {client.endpoint}: {status} {body}")


def _stalled(
    client: NodeClient,
    since: float | None,
    where: str,
    cur: int,
    end: int,
    hi: int | None = None,
) -> float:
    now = time.monotonic()
    if since is None:
        return now
    if now - since > client.retry_for_s:
        raise SourceUnavailableError(
            f"{where}: no endpoint of {list(client.endpoints)} served offsets [{cur}, {end}) "
            f"within {client.retry_for_s:.0f}s"
            + ("" if hi is None else f" ({client.endpoint} ends at {hi})")
        )
    client.rotate()
    return since


def _data_loss(where: str, cur: int, upto: int, why: str, fail: bool) -> int:
    msg = f"{where}: offsets [{cur}, {upto}) are no longer available ({why})"
    if fail:
        raise DataLossError(
            msg + "; set failOnDataLoss=false to skip them (the query then misses them)"
        )
    log.warning("%s; skipping them because failOnDataLoss=false", msg)
    return upto


def decode_value(m: dict[str, Any]) -> bytes:
    v: str = m["value"]
    if m.get("encoding", "base64") == "base64":
        return binascii.a2b_base64(v)
    return v.encode("utf-8")
