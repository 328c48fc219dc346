"""Batch reads of a live 3-node cluster through the ``dledger`` format."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from tests.http.apiclient import ApiCluster
from tests.spark.helpers import client, endpoints, produce

pytestmark = pytest.mark.spark


def _reader(spark: SparkSession, c: ApiCluster, topic: str, **opts: str):  # type: ignore[no-untyped-def]
    r = spark.read.format("dledger").option("endpoints", ",".join(endpoints(c)))
    r = r.option("topic", topic)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_returns_exactly_the_produced_messages(
    spark: SparkSession, cluster: ApiCluster
) -> None:
    cl = client(cluster)
    cl.create_topic("batch", 4)
    acks = produce(cl, "batch", 1500)
    df = _reader(spark, cluster, "batch", minPartitions="6")
    rows = df.collect()
    now = time.time()
    assert len(rows) == len(acks)
    got = {(r.queue, r.queue_offset): r for r in rows}
    assert len(got) == len(rows), "a (queue, offset) came back twice"
    for i, a in enumerate(acks):
        r = got[(a.queue, a.queue_offset)]
        assert r.topic == "batch"
        assert r.commit_offset == a.commit_offset
        assert r.msg_id == a.msg_id
        assert r.value == f"m-{i}".encode()
        assert r.tags == ("odd" if i % 2 else None)
        assert r.key == (f"k{i} x" if i % 3 == 0 else None)
        assert r.properties == ({"i": str(i)} if i % 5 == 0 else {})
        # stored during this test (naive datetimes are local time, as .timestamp() reads them)
        assert abs(r.store_timestamp.timestamp() - now) < 600
        assert abs(r.born_timestamp.timestamp() - now) < 600
    # every queue is contiguous from 0: no gap
    for q in range(4):
        offs = sorted(o for (qq, o) in got if qq == q)
        assert offs == list(range(len(offs)))
    # one partition per queue range, split up to minPartitions
    assert df.rdd.getNumPartitions() >= 6
    # aggregation over the source works like over any DataFrame
    per_queue = {r["queue"]: r["count"] for r in df.groupBy("queue").count().collect()}
    assert per_queue == {q: sum(1 for a in acks if a.queue == q) for q in range(4)}


def test_starting_and_ending_offsets_as_in_kafka(spark: SparkSession, cluster: ApiCluster) -> None:
    cl = client(cluster)
    cl.create_topic("ranges", 2)
    p = cl.producer()
    for q in range(2):
        p.send("ranges", [f"q{q}-{i}" for i in range(20)], queue=q)
    start = json.dumps({"ranges": {"0": 5, "1": -2}})
    end = json.dumps({"ranges": {"0": 12}})  # queue 1 left out: latest
    rows = _reader(spark, cluster, "ranges", startingOffsets=start, endingOffsets=end).collect()
    got = sorted((r.queue, r.queue_offset, r.value.decode()) for r in rows)
    want = [(0, i, f"q0-{i}") for i in range(5, 12)] + [(1, i, f"q1-{i}") for i in range(20)]
    assert got == want
    # endingOffsets is exclusive and -1 means latest
    rows = _reader(
        spark,
        cluster,
        "ranges",
        startingOffsets=json.dumps({"ranges": {"0": 19, "1": 20}}),
        endingOffsets=json.dumps({"ranges": {"0": -1, "1": -1}}),
    ).collect()
    assert [(r.queue, r.queue_offset) for r in rows] == [(0, 19)]
    # a fixed range ignores messages produced after planning... and a new plan sees them
    df = _reader(spark, cluster, "ranges", endingOffsets=json.dumps({"ranges": {"0": 20}}))
    p.send("ranges", ["late"], queue=0)
    assert df.filter("queue = 0").count() == 20
    assert _reader(spark, cluster, "ranges").filter("queue = 0").count() == 21


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"startingOffsets": "latest"}, "not allowed in batch"),
        ({"endingOffsets": "earliest"}, "not allowed in batch"),
        ({"endingOffsets": json.dumps({"ranges": {"0": 10_000}})}, "beyond its max offset"),
        ({"startingOffsets": json.dumps({"other": {"0": 1}})}, "not subscribed"),
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss"),
        ({"startingOffset": "earliest"}, "unknown option"),
    ],
)
def test_bad_options_fail_with_a_clear_message(
    spark: SparkSession, cluster: ApiCluster, opts: dict[str, str], needle: str
) -> None:
    cl = client(cluster)
    if "ranges" not in {t["name"] for t in cl.topics()}:
        cl.create_topic("ranges", 2)
    with pytest.raises(PySparkException, match=needle):
        _reader(spark, cluster, "ranges", **opts).collect()


def test_unknown_topic_is_an_error(spark: SparkSession, cluster: ApiCluster) -> None:
    with pytest.raises(PySparkException, match="do not exist"):
        _reader(spark, cluster, "no-such-topic").collect()


def test_multiple_topics(spark: SparkSession, cluster: ApiCluster) -> None:
    cl = client(cluster)
    cl.create_topic("multi-a", 1)
    cl.create_topic("multi-b", 3)
    produce(cl, "multi-a", 30, "a")
    produce(cl, "multi-b", 40, "b")
    df = (
        spark.read.format("dledger")
        .option("endpoints", ",".join(endpoints(cluster)))
        .option("subscribe", "multi-a,multi-b")
        .load()
    )
    counts = {r["topic"]: r["count"] for r in df.groupBy("topic").count().collect()}
    assert counts == {"multi-a": 30, "multi-b": 40}


def test_fail_on_data_loss(spark: SparkSession, own_cluster: Callable[[], ApiCluster]) -> None:
    c = own_cluster()
    cl = client(c)
    cl.create_topic("trim", 1)
    p = cl.producer()
    for k in range(10):
        p.send("trim", [("x" * 900 + f"-{k}-{i}").encode() for i in range(10)], queue=0)
    # keep about the newest 20 KB: the front of the queue is deleted
    cl.request("PUT", "/v1/retention", {"max_bytes": 20_000}, safe=False)
    lo = cl.topic("trim")["queues"][0]["min_offset"]
    assert 0 < lo < 100
    start = json.dumps({"trim": {"0": 0}})
    with pytest.raises(PySparkException, match=r"offsets \[0, \d+\) are no longer available"):
        _reader(spark, c, "trim", startingOffsets=start).collect()
    rows = _reader(spark, c, "trim", startingOffsets=start, failOnDataLoss="false").collect()
    assert sorted(r.queue_offset for r in rows) == list(range(lo, 100))
    # earliest means the queue's min offset: no loss, no error
    assert _reader(spark, c, "trim").count() == 100 - lo


def test_arrow_and_json_pages_give_identical_dataframes(
    spark: SparkSession, cluster: ApiCluster
) -> None:
    """fetchFormat=json (the JSON pages, decoded in the source) and the
    default Arrow pages give the same rows, column for column."""
    cl = client(cluster)
    cl.create_topic("formats", 3)
    produce(cl, "formats", 2500, batch=500)
    cols = "topic, queue, queue_offset, commit_offset, msg_id, key, tags, properties, value, "
    cols += "born_timestamp, store_timestamp"
    order = ["queue", "queue_offset"]
    by_arrow = _reader(spark, cluster, "formats", minPartitions="5").orderBy(order).collect()
    by_json = _reader(spark, cluster, "formats", fetchFormat="json").orderBy(order).collect()
    assert len(by_arrow) == 2500
    assert by_arrow == by_json
    assert list(by_arrow[0].asDict()) == [c.strip() for c in cols.split(",")]
    assert any(r.key for r in by_arrow) and any(r.tags for r in by_arrow)
    assert any(r.properties for r in by_arrow)
    # small pages: more requests, the same rows
    small = _reader(spark, cluster, "formats", fetchMaxMessages="7").orderBy(order).collect()
    assert small == by_arrow
    with pytest.raises(PySparkException, match="fetchFormat"):
        _reader(spark, cluster, "formats", fetchFormat="xml").count()


def test_a_schema_with_fewer_columns_reads_just_those(
    spark: SparkSession, cluster: ApiCluster
) -> None:
    """``.schema(...)`` naming some of the source's columns (Spark gives a
    Python data source no column pruning): the same rows, those columns,
    in that order; a column the source has not fails the query clearly."""
    cl = client(cluster)
    cl.create_topic("narrow", 2)
    produce(cl, "narrow", 700, batch=350)
    eps = ",".join(endpoints(cluster))

    def load(schema: str | None):  # type: ignore[no-untyped-def]
        r = spark.read.format("dledger")
        if schema is not None:
            r = r.schema(schema)
        return r.option("endpoints", eps).option("topic", "narrow").load()

    full = load(None)
    narrow = load("value binary, queue int, queue_offset long")
    assert narrow.columns == ["value", "queue", "queue_offset"]
    assert narrow.count() == full.count() == 700
    order = ["queue", "queue_offset"]
    assert (
        narrow.orderBy(order).collect()
        == full.select("value", "queue", "queue_offset").orderBy(order).collect()
    )
    with pytest.raises(PySparkException, match="no column 'partition'"):
        load("partition int").collect()
