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

Pages come as Arrow IPC streams (``Accept: application/vnd.apache.arrow.stream``,
:mod:`http_api.arrow`): a ``pyarrow.RecordBatch`` per page, values as bytes,
no JSON or base64 on either side. A node without pyarrow answers ``406``
and a node that predates the Arrow answer sends JSON whatever it is asked:
the reader then reads JSON pages (lists of message objects) from that node,
so a caller gets either kind and turns both into rows alike.
``arrow=False`` asks for JSON throughout (``fetchFormat=json``).

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
from typing import Any, TypeAlias

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.options import (
    ARROW_MAX_MESSAGES,
    JSON_MAX_MESSAGES,
    DataLossError,
    PipelineError,
    SourceUnavailableError,
)

log = logging.getLogger("pipeline.source")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
POLL_WAIT_MS = 500
ARROW_STREAM = "application/vnd.apache.arrow.stream"
MAX_PAGE_BYTES = 8 << 20  # the server's cap on a page's record bytes

# A page of one queue: the server's Arrow batch, or the JSON page's messages.
Page: TypeAlias = pa.RecordBatch | list[dict[str, Any]]


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

    def _once(self, path: str, accept: str) -> tuple[int, str, bytes]:
        if self._conn is None:
            host, _, port = self.endpoint.rpartition(":")
            self._conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            self._conn.request("GET", path, headers={"Accept": accept})
            r = self._conn.getresponse()
            body = r.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if r.getheader("connection", "").lower() == "close":
            self.close()
        ctype = r.getheader("content-type", "").split(";")[0].strip().lower()
        return r.status, ctype, body

    def get(self, path: str, accept: str = "application/json") -> tuple[int, Any]:
        """``(status, body)`` of the first answer that is neither a
        connection failure nor a retryable status; raises
        :class:`SourceUnavailableError` after ``retry_for_s``. The body is
        parsed JSON, or a ``pyarrow.RecordBatch`` for an Arrow stream."""
        deadline = time.monotonic() + self.retry_for_s
        tries = 0
        last = ""
        while True:
            try:
                status, ctype, raw = self._once(path, accept)
                if status not in RETRY_STATUSES:
                    if ctype == ARROW_STREAM:
                        return status, _one_batch(raw)
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
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int,
        wait_ms: int,
        arrow: bool = False,
    ) -> tuple[int, Any]:
        """One page: ``(status, body)``; a 200's body is a
        ``pyarrow.RecordBatch`` when the node answered Arrow (asked with
        ``arrow``), else the JSON page."""
        cap = ARROW_MAX_MESSAGES if arrow else JSON_MAX_MESSAGES
        q = urllib.parse.urlencode(
            {
                "offset": offset,
                "max_messages": min(max_messages, cap),
                "max_bytes": MAX_PAGE_BYTES,
                "wait_ms": wait_ms,
                "consistency": "committed",
            }
        )
        path = f"/v1/topics/{urllib.parse.quote(topic)}/queues/{queue}/messages?{q}"
        return self.get(path, ARROW_STREAM if arrow else "application/json")


def _one_batch(raw: bytes) -> pa.RecordBatch:
    """The record batches of an Arrow IPC stream, as one batch."""
    reader = pa.ipc.open_stream(pa.py_buffer(raw))
    batches = list(reader)
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()
    if table.num_rows == 0:
        return pa.RecordBatch.from_arrays(
            [pa.array([], f.type) for f in reader.schema], schema=reader.schema
        )
    return table.to_batches()[0]


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
    arrow: bool = False,
) -> Iterator[Page]:
    """Pages covering exactly ``[r.start, r.end)`` of one queue, less any
    gap skipped when ``fail_on_data_loss`` is false: Arrow batches of the
    server's columns when ``arrow`` and the node answers Arrow, else lists
    of message JSON objects (the API's shape). See the module doc for the
    errors."""
    cur = r.start
    wait_ms = 0
    stalled_since: float | None = None
    where = f"{r.topic}/{r.queue}"
    while cur < r.end:
        status, body = client.fetch(
            r.topic, r.queue, cur, min(fetch_max_messages, r.end - cur), wait_ms, arrow
        )
        if status == 200 and isinstance(body, pa.RecordBatch):
            if body.num_rows:
                page = _arrow_page(body, cur, r.end, where, client.endpoint)
                cur += page.num_rows
                wait_ms, stalled_since = 0, None
                yield page
                continue
            stalled_since = _stalled(client, stalled_since, where, cur, r.end)
            wait_ms = POLL_WAIT_MS
            continue
        err = _error_details(body)
        if status == 406 and arrow and err.get("code") == "ARROW_UNAVAILABLE":
            log.warning("%s: %s has no Arrow answer; reading JSON pages", where, client.endpoint)
            arrow = False
            continue
        if status == 200:
            msgs: list[dict[str, Any]] = body["messages"]
            if msgs:
                page_json = [m for m in msgs if m["queue_offset"] < r.end]
                for k, m in enumerate(page_json):
                    if m["queue_offset"] != cur + k:
                        raise PipelineError(
                            f"{where}: asked for offset {cur + k} from {client.endpoint}, "
                            f"got {m['queue_offset']} (a broken server answer)"
                        )
                cur += len(page_json)
                wait_ms, stalled_since = 0, None
                yield page_json
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


def _arrow_page(
    batch: pa.RecordBatch, cur: int, end: int, where: str, endpoint: str
) -> pa.RecordBatch:
    """``batch`` cut at ``end``; its offsets must run from ``cur`` on, one by one."""
    page = batch.slice(0, min(batch.num_rows, end - cur))
    offsets = page.column("queue_offset")
    steps = pc.min_max(pc.pairwise_diff(offsets)).as_py()  # {min, max} of the steps
    if offsets[0].as_py() == cur and (page.num_rows == 1 or steps == {"min": 1, "max": 1}):
        return page
    for k, off in enumerate(offsets.to_pylist()):
        if off != cur + k:
            raise PipelineError(
                f"{where}: asked for offset {cur + k} from {endpoint}, "
                f"got {off} (a broken server answer)"
            )
    raise PipelineError(f"{where}: a broken server answer from {endpoint}")


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
