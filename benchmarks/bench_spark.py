"""The Spark batch source's read rate (``spark_read``).

A 3-voter cluster is filled with 100-byte messages over HTTP (batches of
1,000, one queue per batch), then ``df.count()`` over the whole topic is timed
through the ``dledger`` data source with Arrow pages (the default), the same
count with a schema of one column (``.schema("queue int")``: Spark prunes no
columns of a Python source, so this is how a query that needs few of them
says so), and, once, with JSON pages (``fetchFormat=json``, the path for
people). The count makes
the source fetch every message: the Python data source has no count pushdown.
Spark runs ``local[*]`` in this process's JVM, on the same two cores as the
cluster. The measurement itself lives in :mod:`pipeline.bench`.
"""

from __future__ import annotations

import importlib.util

from benchmarks.common import cluster
from benchmarks.registry import BenchResult, Context, Figure, Skipped, benchmark

PAYLOAD = 100
QUEUES = 4


@benchmark(
    "spark_read",
    "Spark batch source: messages/s into df.count() (Arrow pages; JSON once for comparison)",
)
def run_spark_read(ctx: Context) -> BenchResult:
    if importlib.util.find_spec("pyspark") is None:
        raise Skipped("pyspark is not installed (pip install -e '.[spark]')")
    from pipeline import bench

    messages = 50_000 if ctx.quick else 1_000_000
    repeats = 1 if ctx.quick else 3
    settings: dict[str, object] = {"map_size_bytes": 4 << 30}
    with cluster(ctx, voters=3, settings=settings, topic=None) as (lc, _leader):
        eps = [lc.http(i) for i in lc.ids()]
        ctx.log(f"  spark_read: producing {messages:,} messages, then {repeats} counts (Arrow)")
        arrow = bench.run(eps, messages, PAYLOAD, QUEUES, "local[*]", repeats, None, "arrow")
        ctx.log(
            f"  spark_read arrow: count {arrow['count']['median_msgs_per_s']:,} msg/s "
            f"(best {arrow['count']['best_msgs_per_s']:,}), {arrow['input_partitions']} partitions; "
            f"with a one-column schema {arrow['count_one_column']['median_msgs_per_s']:,} msg/s"
        )
        js_msgs = min(messages, 100_000)  # JSON is for people: a smaller topic will do
        js = bench.run(eps, js_msgs, PAYLOAD, QUEUES, "local[*]", 1, None, "json")
        ctx.log(f"  spark_read json: count {js['count']['median_msgs_per_s']:,} msg/s")
    cfg = {
        "messages": messages,
        "payload_bytes": PAYLOAD,
        "queues": QUEUES,
        "partitions": arrow["input_partitions"],
        "master": "local[*]",
    }
    res = BenchResult()
    res.figures.append(
        Figure.of(
            "spark_read.arrow.count_msg_per_s",
            "Spark df.count() over a topic, Arrow pages",
            "msg/s",
            arrow["count"]["msgs_per_s"],
            config={**cfg, "best": arrow["count"]["best_msgs_per_s"], "repeats": repeats},
        )
    )
    res.figures.append(
        Figure.of(
            "spark_read.arrow.count_one_column_msg_per_s",
            'Spark df.count() over a topic, Arrow pages, .schema("queue int")',
            "msg/s",
            arrow["count_one_column"]["msgs_per_s"],
            config={**cfg, "repeats": repeats, "schema": "queue int"},
        )
    )
    res.figures.append(
        Figure.of(
            "spark_read.json.count_msg_per_s",
            "Spark df.count() over a topic, JSON pages",
            "msg/s",
            js["count"]["msgs_per_s"],
            config={**cfg, "messages": js_msgs, "repeats": 1},
        )
    )
    res.raw = {"arrow": arrow, "json": js}
    res.notes.append(
        f"{messages:,} messages of {PAYLOAD} B in {QUEUES} queues; the count is timed after "
        "one warm-up count; the cluster and Spark share the machine's cores."
    )
    return res
