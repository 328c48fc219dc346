"""Helpers shared by the Spark tests."""

from __future__ import annotations

from http_api.client import Ack, Client, OutMessage
from tests.http.apiclient import ApiCluster


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
