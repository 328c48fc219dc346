"""Example: events produced over HTTP, counted per minute and type by a
Structured Streaming query on the ``dledger`` source, written to Parquet.

    # a local 3-node cluster (its members are in run/cluster/cluster.toml)
    .venv/bin/dledger cluster up --nodes 3 --dir run/cluster
    # 1. produce events (JSON: type, user, event time) over HTTP
    .venv/bin/python -m pipeline.examples.events_per_minute produce \\
        --cluster run/cluster/cluster.toml --events 5000
    # 2. the streaming query: per-minute counts into Parquet, exactly once
    .venv/bin/python -m pipeline.examples.events_per_minute run \\
        --cluster run/cluster/cluster.toml \\
        --out run/events/counts --checkpoint run/events/checkpoint --available-now
    # 3. look at the result
    .venv/bin/python -m pipeline.examples.events_per_minute show --out run/events/counts

The query reads ``events`` with ``startingOffsets=earliest`` and
``maxOffsetsPerTrigger``, parses the JSON value, and groups by a one-minute
event-time window and event type with a two-minute watermark; in append
mode a minute is written once the watermark has passed it, so every row of
the Parquet output is final. Stopped and started again with the same
``--checkpoint``, it resumes from the offsets Spark recorded there, with no
duplicate and no gap (the Parquet sink commits each micro-batch once).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import LongType, StringType, StructField, StructType

from http_api.client import Client, OutMessage, queue_for_key

EVENT = StructType(
    [
        StructField("type", StringType()),
        StructField("user", StringType()),
        StructField("ts", LongType()),  # event time, epoch milliseconds
    ]
)
TYPES = ("view", "click", "buy")


def make_events(
    n: int, start_ms: int, span_minutes: int, seed: int = 7
) -> list[dict[str, str | int]]:
    """``n`` events spread evenly over ``span_minutes`` minutes from ``start_ms``."""
    rng = random.Random(seed)
    step = span_minutes * 60_000 / max(1, n)
    return [
        {
            "type": rng.choice(TYPES),
            "user": f"u{rng.randrange(100)}",
            "ts": start_ms + int(i * step),
        }
        for i in range(n)
    ]


def produce(
    endpoints: Sequence[str], topic: str, events: Sequence[dict[str, str | int]], queues: int = 4
) -> int:
    """Create ``topic`` if needed and send ``events`` (sharded by user) with an
    idempotent producer; returns how many were acknowledged."""
    c = Client(list(endpoints))
    if topic not in {t["name"] for t in c.topics()}:
        c.create_topic(topic, queues)
    p = c.producer()
    sent = 0
    by_queue: dict[int, list[OutMessage]] = {}
    for e in events:
        m = OutMessage(json.dumps(e).encode(), tags=str(e["type"]))
        by_queue.setdefault(queue_for_key(str(e["user"]), queues), []).append(m)
    for q, msgs in sorted(by_queue.items()):
        for lo in range(0, len(msgs), 200):
            sent += len(p.send(topic, msgs[lo : lo + 200], queue=q))
    return sent


def per_minute(spark: SparkSession, endpoints: Sequence[str], topic: str) -> DataFrame:
    """The streaming aggregation: counts per event-time minute and type."""
    raw = (
        spark.readStream.format("dledger")
        .option("endpoints", ",".join(endpoints))
        .option("topic", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "2000")
        .load()
    )
    events = raw.select(
        F.from_json(F.col("value").cast("string"), EVENT).alias("e"), "queue", "queue_offset"
    ).select(
        F.timestamp_millis(F.col("e.ts")).alias("event_time"),
        F.col("e.type").alias("type"),
    )
    return (
        events.withWatermark("event_time", "2 minutes")
        .groupBy(F.window("event_time", "1 minute").alias("minute"), "type")
        .agg(F.count("*").alias("events"))
        .select(
            F.col("minute.start").alias("minute"),
            "type",
            "events",
        )
    )


def start(
    spark: SparkSession,
    endpoints: Sequence[str],
    topic: str,
    out: str,
    checkpoint: str,
    available_now: bool = False,
) -> StreamingQuery:
    w = (
        per_minute(spark, endpoints, topic)
        .writeStream.format("parquet")
        .outputMode("append")
        .option("path", out)
        .option("checkpointLocation", checkpoint)
    )
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime="1 second")
    return w.start()


def follow(q: StreamingQuery, every_s: int = 10) -> int:
    """Wait for ``q`` to end (or Ctrl-C, which stops it), printing a line per
    ``every_s`` with what it read; returns how many events it read."""
    events = 0
    seen: set[int] = set()

    def take() -> None:
        nonlocal events
        for p in q.recentProgress:
            b = int(p.get("batchId", -1))
            if b not in seen:
                seen.add(b)
                events += int(p.get("numInputRows", 0))

    try:
        while not q.awaitTermination(every_s):
            take()
            print(f"  {len(seen)} micro-batches so far, {events} events read", flush=True)
    except KeyboardInterrupt:
        print("stopping the query (start it again with the same --checkpoint to resume)")
        q.stop()
    take()
    return events


def summary(spark: SparkSession, events: int, out: str, checkpoint: str) -> str:
    """What a run read and wrote, and where."""
    try:
        rows = spark.read.parquet(out).count()
    except AnalysisException:  # nothing written yet: no Parquet to read
        rows = 0
    return (
        f"read {events} events; {out} now holds {rows} rows (one per minute and type, "
        f"Parquet); offsets are in {checkpoint}"
    )


def _where(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--endpoints", help="host:port[,host:port...] of any nodes")
    g.add_argument("--cluster", help="a cluster file (cluster.toml): every member's HTTP address")


def _endpoints(a: argparse.Namespace) -> list[str]:
    if a.endpoints:
        return [e.strip() for e in a.endpoints.split(",") if e.strip()]
    from dledger.config import load_cluster_file

    return [m.http_address for m in load_cluster_file(a.cluster).members]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.examples.events_per_minute")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("produce", help="produce events over HTTP")
    _where(pp)
    pp.add_argument("--topic", default="events")
    pp.add_argument("--events", type=int, default=5000)
    pp.add_argument("--minutes", type=int, default=10, help="event-time span of the events")
    rp = sub.add_parser("run", help="run the streaming query")
    _where(rp)
    rp.add_argument("--topic", default="events")
    rp.add_argument("--out", required=True, help="Parquet output directory (any Spark path)")
    rp.add_argument("--checkpoint", required=True, help="checkpoint directory")
    rp.add_argument("--available-now", action="store_true", help="read what is there, then stop")
    rp.add_argument("--master", default="local[*]")
    sp = sub.add_parser("show", help="print the per-minute counts")
    sp.add_argument("--out", required=True)
    sp.add_argument("--master", default="local[*]")
    a = ap.parse_args(argv)
    if a.cmd == "produce":
        eps = _endpoints(a)
        now = int(time.time() * 1000) // 60_000 * 60_000
        n = produce(eps, a.topic, make_events(a.events, now, a.minutes))
        # one event far ahead in event time moves the watermark past every minute above
        produce(eps, a.topic, [{"type": "tick", "user": "clock", "ts": now + 3_600_000}])
        print(f"produced {n} events to {a.topic}")
        return 0
    from pipeline.session import build_session

    spark = build_session(a.master, "events-per-minute")
    try:
        if a.cmd == "run":
            eps = _endpoints(a)
            print(f"reading topic {a.topic} from {','.join(eps)}; writing to {a.out}", flush=True)
            q = start(spark, eps, a.topic, a.out, a.checkpoint, a.available_now)
            events = follow(q)
            print(summary(spark, events, a.out, a.checkpoint), flush=True)
        else:
            spark.read.parquet(a.out).orderBy("minute", "type").show(100, truncate=False)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
