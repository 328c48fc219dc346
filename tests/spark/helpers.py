"""Helpers shared by the Spark tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyspark.sql.streaming import StreamingQuery

from http_api.client import Ack, Client, OutMessage
from tests.http.apiclient import ApiCluster, wait_for


def endpoints(c: ApiCluster) -> list[str]:
    return [c.http(i) for i in c.ids()]


def client(c: ApiCluster) -> Client:
    return Client(endpoints(c), timeout_s=5, retry_for_s=60)


def produce(c: Client, topic: str, n: int, prefix: str = "m", batch: int = 100) -> list[Ack]:
    """``n`` messages with unique values (``prefix-i``), some with keys, tags and
    properties, through an idempotent producer (a retry never duplicates)."""
    p = c.producer()
    acks: list[Ack] = []
    for lo in range(0, n, batch):
        msgs = [
            OutMessage(
                f"{prefix}-{i}".encode(),
                tags="odd" if i % 2 else "",
                keys=(f"k{i}", "x") if i % 3 == 0 else (),
                properties={"i": str(i)} if i % 5 == 0 else {},
            )
            for i in range(lo, min(n, lo + batch))
        ]
        acks.extend(p.send(topic, msgs))
    return acks


# Spark starts the driver-side Python process of a Python streaming source
# (PythonStreamingSourceRunner) with PythonWorkerFactory.createSimpleWorker,
# which waits a fixed 10 s for it to connect back (Selector.select(10000) in
# Spark 4.x; no configuration changes it). On a machine loaded far beyond its
# cores, starting Python and importing pyspark can take longer: the query then
# dies at start with "Python worker failed to connect back" /
# SocketTimeoutException before it read anything. Such a query is started
# again from the same checkpoint (which is what a user would do, and what the
# exactly-once promise is about); any other failure fails the test at once.
WORKER_START_FAILURES = ("Python worker failed to connect back",)


def query_failed(q: StreamingQuery) -> str | None:
    """The query's exception as text, None while it runs or stopped cleanly."""
    exc = q.exception()
    return None if exc is None else str(exc)


def started(start: Callable[[], StreamingQuery], attempts: int = 4) -> StreamingQuery:
    """``start()`` a streaming query; return it once its first trigger ran.
    A start that died only because its Python source process connected back
    too late is retried (same checkpoint); any other failure raises."""
    for attempt in range(1, attempts + 1):
        q = start()

        def ran_or_died(q: StreamingQuery = q) -> bool:
            return q.lastProgress is not None or not q.isActive

        wait_for(ran_or_died, 180, "the query's first trigger", poll_s=0.2)
        err = query_failed(q)
        if err is None:
            return q
        if attempt < attempts and any(s in err for s in WORKER_START_FAILURES):
            print(f"attempt {attempt}: the source's Python process started too slowly; again")
            continue
        raise AssertionError(f"the streaming query failed: {err[:3000]}")
    raise AssertionError("unreachable")


def wait_running(q: StreamingQuery, pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``wait_for(pred)`` that fails at once, with the cause, if ``q`` dies."""

    def check() -> Any:
        err = query_failed(q)
        if err is not None:
            raise AssertionError(f"the streaming query failed while waiting for {what}: {err}")
        return pred()

    return wait_for(check, timeout_s, what, poll_s=0.2)


def batches_after(q: StreamingQuery, n: int) -> Callable[[], bool]:
    """A condition: ``n`` more micro-batches than now have completed."""
    first = (q.lastProgress or {}).get("batchId", -1)

    def done() -> bool:
        p = q.lastProgress
        return p is not None and int(p.get("batchId", -1)) >= first + n

    return done
