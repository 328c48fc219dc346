"""Read throughput of the ``dledger`` batch source: messages per second into a
DataFrame, on a local 3-node cluster started for the purpose.

    .venv/bin/python -m pipeline.bench [--messages 200000] [--payload 100] [--queues 4]
                                       [--master local[*]] [--repeats 3] [--endpoints H:P,...]
                                       [--fetch-format arrow|json]

It produces the messages over HTTP (batches of 1000, one queue per batch),
then times, ``--repeats`` times each: ``df.count()`` (every message is
fetched and handed to Spark as Arrow: the Python source has no count
pushdown), the same count with ``.schema("queue int")`` (one column handed
to Spark instead of eleven) and ``df.select("value").collect()`` (the values
brought back to the driver as well). Prints one JSON document; a measurement, never a test.
With ``--endpoints`` it uses a running cluster instead of starting one;
``--fetch-format json`` reads the JSON pages (the source's ``fetchFormat``).

Figures: see README, "Read throughput" (``df.count()`` over 1,000,000
messages with Arrow pages: 600,000-880,000 messages/s on the 2-core
development machine, where the nodes share the cores with Spark). About
0.4-0.7 s of every count is fixed Spark/Python-source cost (planning in a
Python worker, task start, the count's second stage), so a count over
200,000 messages gets about half that rate. For a count, Spark's JVM now
uses about as much CPU as the three nodes together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from http_api.client import Client, OutMessage


def _produce(eps: list[str], topic: str, n: int, payload: int, queues: int) -> float:
    c = Client(eps, timeout_s=30)
    c.create_topic(topic, queues)
    body = b"x" * max(0, payload - 8)
    t0 = time.perf_counter()
    for lo in range(0, n, 1000):
        q = (lo // 1000) % queues
        c.produce(
            topic,
            [OutMessage(body + b"%08d" % i, queue=q) for i in range(lo, min(n, lo + 1000))],
        )
    return time.perf_counter() - t0


def run(
    eps: list[str],
    messages: int,
    payload: int,
    queues: int,
    master: str,
    repeats: int,
    min_partitions: int | None,
    fetch_format: str = "arrow",
) -> dict[str, Any]:
    from pipeline.session import build_session

    topic = f"bench-{int(time.time())}"
    produce_s = _produce(eps, topic, messages, payload, queues)
    spark = build_session(master, "dledger-bench")
    spark.sparkContext.setLogLevel("ERROR")
    try:

        def new_reader() -> Any:
            r = (
                spark.read.format("dledger")
                .option("endpoints", ",".join(eps))
                .option("topic", topic)
                .option("fetchFormat", fetch_format)
            )
            return r.option("minPartitions", str(min_partitions)) if min_partitions else r

        reader = new_reader()
        # a reader of its own: DataFrameReader.schema() changes the reader
        one_column = new_reader().schema("queue int")
        # warm-up: Python workers started, JIT warm
        assert reader.load().count() == messages
        counts, narrow, collects = [], [], []
        for _ in range(repeats):
            df = reader.load()
            t0 = time.perf_counter()
            n = df.count()
            counts.append(time.perf_counter() - t0)
            assert n == messages, n
            # the same count with a schema of one column (the source's
            # column pruning: Spark gives Python sources none of its own)
            t0 = time.perf_counter()
            n = one_column.load().count()
            narrow.append(time.perf_counter() - t0)
            assert n == messages, n
            t0 = time.perf_counter()
            vals = df.select("value").collect()
            collects.append(time.perf_counter() - t0)
            assert len(vals) == messages
        partitions = reader.load().rdd.getNumPartitions()
        cores = spark.sparkContext.defaultParallelism
    finally:
        spark.stop()

    def rate(ts: list[float]) -> dict[str, Any]:
        return {
            "median_msgs_per_s": round(messages / statistics.median(ts)),
            "best_msgs_per_s": round(messages / min(ts)),
            "median_s": round(statistics.median(ts), 3),
            "msgs_per_s": [round(messages / t) for t in ts],
        }

    return {
        "messages": messages,
        "payload_bytes": payload,
        "queues": queues,
        "input_partitions": partitions,
        "master": master,
        "fetch_format": fetch_format,
        "default_parallelism": cores,
        "produce_msgs_per_s": round(messages / produce_s),
        "count": rate(counts),
        "count_one_column": rate(narrow),
        "collect_values": rate(collects),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=100)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-partitions", type=int, default=None)
    ap.add_argument("--endpoints", default=None, help="use this running cluster")
    ap.add_argument("--fetch-format", choices=("arrow", "json"), default="arrow")
    a = ap.parse_args(argv)
    if a.endpoints:
        eps = a.endpoints.split(",")
        res = run(
            eps,
            a.messages,
            a.payload,
            a.queues,
            a.master,
            a.repeats,
            a.min_partitions,
            a.fetch_format,
        )
    else:
        from dledger.cluster import LocalCluster

        with tempfile.TemporaryDirectory(prefix="dledger-bench-") as d:
            lc = LocalCluster.create(Path(d) / "cluster", voters=3, secret="bench")
            lc.start_all()
            try:
                lc.wait_leader(60)
                eps = [lc.http(i) for i in lc.ids()]
                res = run(
                    eps,
                    a.messages,
                    a.payload,
                    a.queues,
                    a.master,
                    a.repeats,
                    a.min_partitions,
                    a.fetch_format,
                )
            finally:
                lc.down(timeout_s=10)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
