"""Structured Streaming from the ``dledger`` format: read limits,
Trigger.AvailableNow, and exactly-once output across a query restart and a
leader SIGKILL."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from http_api.client import Ack
from pipeline.source import SCHEMA
from tests.http.apiclient import ApiCluster
from tests.spark.helpers import client, endpoints, produce, started, wait_running

pytestmark = pytest.mark.spark


def _stream(spark: SparkSession, c: ApiCluster, topic: str, **opts: str) -> DataFrame:
    r = spark.readStream.format("dledger").option("endpoints", ",".join(endpoints(c)))
    r = r.option("topic", topic)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_max_offsets_per_trigger_and_available_now(
    spark: SparkSession, cluster: ApiCluster, tmp_path: Path
) -> None:
    cl = client(cluster)
    cl.create_topic("avail", 3)
    acks = produce(cl, "avail", 300)
    batches: list[list[tuple[int, int, bytes]]] = []
    late: list[Ack] = []

    def sink(df: DataFrame, batch_id: int) -> None:
        batches.append([(r.queue, r.queue_offset, r.value) for r in df.collect()])
        if not late:
            # produced while the AvailableNow query runs: past its target, so unread
            late.extend(produce(cl, "avail", 50, "late"))

    def run() -> None:
        q = started(
            lambda: (
                _stream(
                    spark, cluster, "avail", startingOffsets="earliest", maxOffsetsPerTrigger="40"
                )
                .writeStream.foreachBatch(sink)
                .option("checkpointLocation", str(tmp_path / "ck"))
                .trigger(availableNow=True)
                .start()
            )
        )
        assert q.awaitTermination(180), "an AvailableNow query stops by itself"
        assert q.exception() is None

    run()
    sizes = [len(b) for b in batches if b]
    assert sizes == [40] * 7 + [20], sizes  # bounded per micro-batch, exact total
    rows = [r for b in batches for r in b]
    assert sorted((q, o) for q, o, _ in rows) == sorted((a.queue, a.queue_offset) for a in acks)
    assert sorted(v for _, _, v in rows) == sorted(f"m-{i}".encode() for i in range(300))
    # the same checkpoint, run again: exactly the messages produced meanwhile
    batches.clear()
    run()
    rows = [r for b in batches for r in b]
    assert sorted((q, o) for q, o, _ in rows) == sorted((a.queue, a.queue_offset) for a in late)
    assert all(len(b) <= 40 for b in batches)


def test_streaming_starts_at_latest_by_default(
    spark: SparkSession, cluster: ApiCluster, tmp_path: Path
) -> None:
    cl = client(cluster)
    cl.create_topic("fromlatest", 2)
    produce(cl, "fromlatest", 20, "old")
    got: list[bytes] = []
    q = started(
        lambda: (
            _stream(spark, cluster, "fromlatest")
            .writeStream.foreachBatch(lambda df, _: got.extend(r.value for r in df.collect()))
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
    )
    try:
        produce(cl, "fromlatest", 10, "new")
        wait_running(q, lambda: len(got) >= 10, 120, "the new messages")
        # One more message, read after the others: anything old the query
        # wrongly read would have arrived by the time it does.
        produce(cl, "fromlatest", 1, "last")
        wait_running(q, lambda: b"last-0" in got, 120, "the last message")
    finally:
        q.stop()
    assert sorted(got) == sorted([*(f"new-{i}".encode() for i in range(10)), b"last-0"])


def _parquet_count(spark: SparkSession, path: Path) -> int:
    if not (path / "_spark_metadata").exists():
        return 0
    return spark.read.schema(SCHEMA).parquet(str(path)).count()


def test_exactly_once_across_restart_and_leader_kill(
    spark: SparkSession, cluster: ApiCluster, tmp_path: Path
) -> None:
    cl = client(cluster)
    cl.create_topic("events", 4)
    acks: list[Ack] = []
    values: list[bytes] = []

    sent = threading.Lock()  # acks and values stay pairwise aligned

    def send(prefix: str, n: int) -> None:
        got = produce(client(cluster), "events", n, prefix)
        with sent:
            acks.extend(got)
            values.extend(f"{prefix}-{i}".encode() for i in range(n))

    send("a", 400)
    out, ck = tmp_path / "out", tmp_path / "ck"
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            for k in range(12):  # keeps producing through the failover
                send(f"b{k}", 50)
                time.sleep(0.2)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def start() -> Any:
        return (
            _stream(
                spark, cluster, "events", startingOffsets="earliest", maxOffsetsPerTrigger="150"
            )
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(ck))
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    t = threading.Thread(target=producer, daemon=True)
    q = started(start)
    t.start()
    try:
        wait_running(q, lambda: _parquet_count(spark, out) > 0, 180, "first rows in the sink")
        leader = cluster.wait_leader()
        cluster.kill(leader)  # SIGKILL, while the query runs
        # The query goes on through the failover: what is produced after the
        # kill (through the new leader) reaches the sink.
        send("c", 20)
        n = len(acks)
        wait_running(
            q, lambda: _parquet_count(spark, out) >= n, 180, "rows produced after the kill"
        )
    finally:
        q.stop()
    # restarted from its checkpoint while the old leader is still down
    q = started(start)
    try:
        t.join(180)
        assert not t.is_alive() and not errors, errors
        assert len(acks) == 400 + 12 * 50 + 20
        wait_running(
            q,
            lambda: _parquet_count(spark, out) >= len(acks),
            180,
            "every acknowledged message in the sink",
        )
        # One more batch, read after everything else: a duplicate of any
        # earlier batch would have been written by the time it is.
        send("d", 5)
        wait_running(q, lambda: _parquet_count(spark, out) >= len(acks), 180, "the last batch")
        assert q.exception() is None
    finally:
        q.stop()
    rows = (
        spark.read.schema(SCHEMA)
        .parquet(str(out))
        .select("topic", "queue", "queue_offset", "value")
        .collect()
    )
    keys = [(r.topic, r.queue, r.queue_offset) for r in rows]
    assert len(keys) == len(set(keys)), "a message reached the sink twice"
    assert set(keys) == {("events", a.queue, a.queue_offset) for a in acks}, "missing messages"
    for queue in range(4):  # no gap in any queue
        offs = sorted(o for (_, qq, o) in keys if qq == queue)
        assert offs == list(range(len(offs)))
    by_offset = {(r.queue, r.queue_offset): r.value for r in rows}
    assert by_offset == {(a.queue, a.queue_offset): v for a, v in zip(acks, values, strict=True)}
