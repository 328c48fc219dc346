"""Spark jobs over harness runs: ``python -m pipeline analyze RUNS_DIR``.

Theory of operation
-------------------
``RUNS_DIR`` is any path Spark can list (``file:``, ``hdfs://``, ``s3a://``):
every ``*.jsonl`` below it is one run's history (:mod:`jepsen_like.history`,
schema version 1), named by its directory (``run-7/history.jsonl`` is run
``run-7``) or by directory and file stem for other names; every
``results.json`` below it is a run's result file: the checkers' verdict
(``python -m jepsen_like.checkers`` output) or a benchmark result
(``benchmarks.log_append --out``). Nothing is read on the driver's disk:
histories are DataFrames from the start, the tables are written as Parquet
with Spark, and the HTML report and its PNG plots go through Hadoop's
FileSystem API to ``--out``.

The history is turned into operations the way the harness's reader pairs
them: a process has at most one outstanding op, so an ``invoke`` is paired
with that process's next record (by ``index``) when it is an ``ok``,
``fail`` or ``info``; an invoke without one counts as ``info``. Completion
fields override the invoke's. Fault windows pair the k-th ``start`` of a
nemesis kind with its k-th ``stop`` (a stop closes the earliest open
window); a window never closed ends with the run.

Tables (each a Parquet directory under ``--out``, also per run):

* ``ops``: every operation (run, id, process, f, key, status, times, latency)
* ``ops_by_type``: count per run, f and status
* ``latency``: ok latency percentiles (nearest rank, as the recovery
  checker) per run and f, ``phase`` = ``all`` (final reads excluded, the
  checker's figure), ``outside`` (completed outside every fault window) and
  ``inside`` (completed inside a window of ``nemesis``); ``latency_by_kind``
  the same over all runs
* ``windows``: per fault window the recovery checker's RTO (first failed op
  per ``f`` in ``[start, stop + grace]``, next ok op of that ``f``) and
  ``rto_by_kind``: the RTO distribution per nemesis kind
* ``timeline``: ok / fail / info per ``bucket_ms`` bucket, run and f
* ``anomalies``: the queue checker's anomaly counts per run (lost-write,
  duplicate, inconsistent-offsets, aborted-read, poll-skip,
  nonmonotonic-poll, unseen, stale-read, non-contiguous-read); values are compared as text, so
  the int 1 and the string "1" are one value here (the harness never mixes
  them in one key)
* ``results`` / ``bench``: what the result files say

The figures are the harness checkers' own definitions, recomputed with
DataFrame operations so that thousands of runs can be compared at once;
``tests/spark/test_spark_analyze.py`` holds them equal on recorded histories.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

ANOMALIES = (
    "lost-write",
    "duplicate",
    "inconsistent-offsets",
    "aborted-read",
    "poll-skip",
    "nonmonotonic-poll",
    "unseen",
    "stale-read",
    "non-contiguous-read",
)
PERCENTILES = (50, 95, 99)
_MS = 1_000_000

HISTORY_SCHEMA = StructType(
    [
        StructField("type", StringType()),
        StructField("process", LongType()),
        StructField("f", StringType()),
        StructField("key", StringType()),
        StructField("time_ns", LongType()),
        StructField("index", LongType()),
        # str or int for a produce, a list of [offset, value] for reads: kept as JSON text
        StructField("value", StringType()),
        StructField("offset", LongType()),
        StructField("consistency", StringType()),
        StructField("limit", LongType()),
        StructField("end", BooleanType()),
        StructField("group", StringType()),
        StructField("error", StringType()),
        StructField("kind", StringType()),
        StructField("targets", StringType()),
    ]
)
_PAIRS = ArrayType(ArrayType(StringType()))


@dataclass(frozen=True, slots=True)
class AnalyzeConfig:
    bucket_ms: int = 1000
    grace_ms: int = 2000


# ----------------------------------------------------------------------------- loading


def load_records(spark: SparkSession, runs_dir: str) -> DataFrame:
    """Every record of every ``*.jsonl`` under ``runs_dir``, with its ``run``."""
    df = (
        spark.read.schema(HISTORY_SCHEMA)
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.jsonl")
        .option("mode", "FAILFAST")
        .json(runs_dir)
        .withColumn("file", F.col("_metadata.file_path"))
    )
    parts = F.split(F.col("file"), "/")
    stem = F.regexp_replace(F.element_at(parts, -1), r"\.jsonl$", "")
    parent = F.element_at(parts, -2)
    run = F.when(stem == "history", parent).otherwise(F.concat_ws("/", parent, stem))
    return df.withColumn("run", run).drop("file")


def build_ops(records: DataFrame) -> DataFrame:
    """Invokes paired with their completions (see the module doc)."""
    recs = records.filter(F.col("type").isin("invoke", "ok", "fail", "info"))
    w = Window.partitionBy("run", "process").orderBy("index")
    nxt = recs.select(
        "*",
        *[
            F.lead(c).over(w).alias(f"n_{c}")
            for c in ("type", "time_ns", "index", "value", "offset", "end", "error")
        ],
    )
    completed = F.col("n_type").isin("ok", "fail", "info")
    inv = nxt.filter(F.col("type") == "invoke")
    status = F.when(completed, F.col("n_type")).otherwise(F.lit("info"))
    complete_ns = F.when(completed, F.col("n_time_ns"))
    is_read = F.col("f").isin("read", "final_read", "poll")
    ops = inv.select(
        "run",
        "process",
        "f",
        "key",
        status.alias("status"),
        F.col("time_ns").alias("invoke_ns"),
        complete_ns.alias("complete_ns"),
        F.col("index").alias("invoke_index"),
        F.when(completed, F.col("n_index")).alias("complete_index"),
        F.when(completed & F.col("n_offset").isNotNull(), F.col("n_offset"))
        .otherwise(F.col("offset"))
        .alias("offset"),
        F.when(is_read, None).otherwise(F.col("value")).alias("value"),
        F.when(is_read & (status == "ok"), F.coalesce(F.col("n_value"), F.lit("[]"))).alias(
            "results_json"
        ),
        F.coalesce(F.col("consistency"), F.lit("committed")).alias("consistency"),
        "limit",
        F.when(completed & F.col("n_end").isNotNull(), F.col("n_end"))
        .otherwise(F.col("end"))
        .alias("end"),
        "group",
        F.when(completed, F.col("n_error")).alias("error"),
    )
    ops = ops.withColumn("results", F.from_json("results_json", _PAIRS)).drop("results_json")
    ops = ops.withColumn(
        "id", F.row_number().over(Window.partitionBy("run").orderBy("invoke_index")) - 1
    )
    return ops.withColumn(
        "event_ns", F.coalesce(F.col("complete_ns"), F.col("invoke_ns"))
    ).withColumn(
        "latency_ms",
        F.when(
            (F.col("status") == "ok") & F.col("complete_ns").isNotNull(),
            (F.col("complete_ns") - F.col("invoke_ns")).cast(DoubleType()) / _MS,
        ),
    )


def build_faults(records: DataFrame, ops: DataFrame) -> DataFrame:
    """Fault windows: run, window (0-based, by start), kind, targets, start_ns,
    stop_ns (None: never healed), end_ns (stop, or the run's last event)."""
    nem = records.filter(F.col("type") == "nemesis")
    by_kind = Window.partitionBy("run", "kind", "f").orderBy("index")
    nem = nem.withColumn("k", F.row_number().over(by_kind))
    starts = nem.filter(F.col("f") == "start").select(
        "run",
        "kind",
        "k",
        "targets",
        F.col("time_ns").alias("start_ns"),
        F.col("index").alias("start_index"),
    )
    stops = nem.filter(F.col("f") == "stop").select(
        "run", "kind", "k", F.col("time_ns").alias("stop_ns"), F.col("index").alias("stop_index")
    )
    ends = (
        ops.filter(F.col("f") != "final_read")
        .groupBy("run")
        .agg(F.max("event_ns").alias("run_end_ns"))
    )
    w = starts.join(stops, ["run", "kind", "k"], "left").join(ends, "run", "left")
    w = w.withColumn(
        "window", F.row_number().over(Window.partitionBy("run").orderBy("start_index")) - 1
    )
    return w.select(
        "run",
        "window",
        "kind",
        "targets",
        "start_ns",
        "stop_ns",
        "start_index",
        "stop_index",
        F.coalesce("stop_ns", "run_end_ns", "start_ns").alias("end_ns"),
    )


# ----------------------------------------------------------------------------- figures


def ops_by_type(ops: DataFrame) -> DataFrame:
    return ops.groupBy("run", "f", "status").count()


def _percentiles(values: Column) -> list[Column]:
    """Nearest-rank percentiles of an aggregated, sorted array column."""
    n = F.size(values)
    cols = [n.alias("count")]
    for p in PERCENTILES:
        rank = F.greatest(F.lit(1), F.floor((n * p + 99) / 100).cast("int"))
        cols.append(F.when(n > 0, F.element_at(values, rank)).alias(f"p{p}_ms"))
    cols.append(F.when(n > 0, F.element_at(values, -1)).alias("max_ms"))
    return cols


def latency(ops: DataFrame, faults: DataFrame) -> DataFrame:
    """Ok latency per run and f: ``all`` (the recovery checker's figure),
    ``outside`` every window, and ``inside`` windows of each nemesis kind (by
    completion time)."""
    every = (
        _ok_latencies(ops)
        .select("run", "id", "f", "latency_ms")
        .withColumn("nemesis", F.lit(None).cast(StringType()))
        .withColumn("phase", F.lit("all"))
    )
    rows = every.unionByName(latency_rows(ops, faults))
    return rows.groupBy("run", "phase", "nemesis", "f").agg(
        *_percentiles(F.sort_array(F.collect_list("latency_ms")))
    )


def _ok_latencies(ops: DataFrame) -> DataFrame:
    return ops.filter(F.col("latency_ms").isNotNull() & (F.col("f") != "final_read"))


def latency_by_kind(ops: DataFrame, faults: DataFrame) -> DataFrame:
    """``latency`` over all runs at once (per phase, nemesis kind and f)."""
    per_op = latency_rows(ops, faults)
    return per_op.groupBy("phase", "nemesis", "f").agg(
        *_percentiles(F.sort_array(F.collect_list("latency_ms")))
    )


def latency_rows(ops: DataFrame, faults: DataFrame) -> DataFrame:
    """One row per ok op and phase: ``inside`` once per nemesis kind whose
    window holds its completion, else ``outside``."""
    ok = _ok_latencies(ops)
    hits = (
        ok.alias("o")
        .join(
            faults.alias("w"),
            (F.col("o.run") == F.col("w.run"))
            & (F.col("o.complete_ns") >= F.col("w.start_ns"))
            & (F.col("o.complete_ns") <= F.col("w.end_ns")),
        )
        .select("o.run", "o.id", "o.f", "o.latency_ms", F.col("w.kind").alias("nemesis"))
        .distinct()
        .withColumn("phase", F.lit("inside"))
    )
    outside = (
        ok.join(hits.select("run", "id").distinct(), ["run", "id"], "left_anti")
        .select("run", "id", "f", "latency_ms")
        .withColumn("nemesis", F.lit(None).cast(StringType()))
        .withColumn("phase", F.lit("outside"))
    )
    return outside.unionByName(hits)


def windows(ops: DataFrame, faults: DataFrame, cfg: AnalyzeConfig) -> DataFrame:
    """Per fault window: impacted, the RTO per f and overall, unrecovered fs."""
    nonfinal = ops.filter(F.col("f") != "final_read")
    fw = faults.withColumn("limit_ns", F.col("end_ns") + F.lit(cfg.grace_ms * _MS))
    fs = nonfinal.select("run", "f").distinct()
    per_f = fw.join(fs, "run")
    bad = (
        nonfinal.filter(F.col("status") != "ok")
        .alias("o")
        .join(
            fw.alias("w"),
            (F.col("o.run") == F.col("w.run"))
            & (F.col("o.event_ns") >= F.col("w.start_ns"))
            & (F.col("o.event_ns") <= F.col("w.limit_ns")),
        )
        .groupBy("w.run", "w.window", "o.f")
        .agg(F.min(F.struct("o.event_ns", "o.id", "o.invoke_ns")).alias("bad"))
    )
    oks = nonfinal.filter((F.col("status") == "ok") & F.col("complete_ns").isNotNull())
    good = (
        bad.alias("b")
        .join(
            oks.alias("k"),
            (F.col("b.run") == F.col("k.run"))
            & (F.col("b.f") == F.col("k.f"))
            & (F.col("k.complete_ns") > F.col("b.bad.event_ns")),
            "left",
        )
        .groupBy("b.run", "b.window", "b.f", "b.bad")
        .agg(F.min("k.complete_ns").alias("good_ns"))
    )
    f_rows = per_f.join(good, ["run", "window", "f"], "left").select(
        "run",
        "window",
        "kind",
        "f",
        F.col("bad").isNotNull().alias("impacted"),
        F.when(
            F.col("good_ns").isNotNull(),
            (F.col("good_ns") - F.greatest(F.col("bad.invoke_ns"), F.col("start_ns"))).cast(
                DoubleType()
            )
            / _MS,
        ).alias("rto_ms"),
        (F.col("bad").isNotNull() & F.col("good_ns").isNull()).alias("unrecovered"),
    )
    summary = f_rows.groupBy("run", "window").agg(
        F.max("rto_ms").alias("rto_ms"),
        F.max(F.col("impacted").cast("int")).cast("boolean").alias("impacted"),
        F.sort_array(F.collect_list(F.when(F.col("unrecovered"), F.col("f")))).alias("unrecovered"),
        F.map_from_entries(F.collect_list(F.struct("f", F.col("rto_ms")))).alias("rto_ms_by_f"),
    )
    out = faults.join(summary, ["run", "window"], "left")
    return out.select(
        "run",
        "window",
        "kind",
        "targets",
        "start_ns",
        "stop_ns",
        ((F.col("stop_ns") - F.col("start_ns")).cast(DoubleType()) / _MS).alias("duration_ms"),
        F.coalesce(F.col("impacted"), F.lit(False)).alias("impacted"),
        "rto_ms",
        F.coalesce(F.col("unrecovered"), F.array().cast(ArrayType(StringType()))).alias(
            "unrecovered"
        ),
        "rto_ms_by_f",
    )


def rto_by_kind(win: DataFrame) -> DataFrame:
    return win.groupBy("kind").agg(
        F.count("*").alias("windows"),
        F.sum(F.col("impacted").cast("int")).alias("impacted"),
        F.sum((F.size("unrecovered") > 0).cast("int")).alias("unrecovered"),
        *_percentiles(F.sort_array(F.collect_list("rto_ms")))[1:],
        F.sort_array(F.collect_list("rto_ms")).alias("rto_ms"),
    )


def timeline(ops: DataFrame, cfg: AnalyzeConfig) -> DataFrame:
    """Ok / fail / info per bucket (by event time from the run's first invoke)."""
    nonfinal = ops.filter(F.col("f") != "final_read")
    t0 = nonfinal.groupBy("run").agg(F.min("invoke_ns").alias("t0_ns"))
    b = nonfinal.join(t0, "run").withColumn(
        "bucket", F.floor((F.col("event_ns") - F.col("t0_ns")) / F.lit(cfg.bucket_ms * _MS))
    )
    agg = b.groupBy("run", "bucket", "f").agg(
        *[F.sum((F.col("status") == s).cast("int")).alias(s) for s in ("ok", "fail", "info")]
    )
    return agg.select(
        "run",
        "bucket",
        (F.col("bucket") * cfg.bucket_ms).alias("t_ms"),
        "f",
        "ok",
        "fail",
        "info",
        (F.col("ok") * 1000.0 / cfg.bucket_ms).alias("ok_per_s"),
    )


def anomalies(ops: DataFrame) -> DataFrame:
    """The queue checker's anomaly counts per run (see :mod:`jepsen_like.checkers.queue`)."""
    ok = ops.filter(F.col("status") == "ok")
    reads = ok.filter(F.col("f").isin("read", "final_read", "poll")).select(
        "run", "key", "f", "id", "invoke_index", F.posexplode("results").alias("pos", "pair")
    )
    read_obs = reads.select(
        "run",
        "key",
        "f",
        F.col("pair")[0].cast("long").alias("offset"),
        F.col("pair")[1].alias("value"),
    )
    prod_obs = ok.filter(
        (F.col("f") == "produce") & F.col("offset").isNotNull() & F.col("value").isNotNull()
    ).select("run", "key", "f", "offset", "value")
    obs = prod_obs.unionByName(read_obs)
    counts: list[DataFrame] = []

    def named(df: DataFrame, name: str) -> None:
        counts.append(df.groupBy("run").count().withColumn("anomaly", F.lit(name)))

    named(
        obs.groupBy("run", "key", "offset")
        .agg(F.countDistinct("value").alias("n"))
        .filter("n > 1"),
        "inconsistent-offsets",
    )
    named(
        obs.groupBy("run", "key", "value")
        .agg(F.countDistinct("offset").alias("n"))
        .filter("n > 1"),
        "duplicate",
    )
    # a read whose result is not one run of offsets from where it started
    # (the asked offset, or its first result's): one per read, as the checker
    runs_of = ok.filter(
        F.col("f").isin("read", "final_read", "poll") & (F.size("results") > 0)
    ).select(
        "run",
        "key",
        "id",
        F.coalesce(F.col("offset").cast("long"), F.col("results")[0][0].cast("long")).alias(
            "start"
        ),
        F.posexplode("results").alias("pos", "pair"),
    )
    named(
        runs_of.filter(F.col("pair")[0].cast("long") != F.col("start") + F.col("pos"))
        .select("run", "key", "id")
        .distinct(),
        "non-contiguous-read",
    )
    read_values = read_obs.select("run", "key", "value").distinct()
    produces = ops.filter((F.col("f") == "produce") & F.col("value").isNotNull())
    all_failed = (
        produces.groupBy("run", "key", "value")
        .agg(F.min((F.col("status") == "fail").cast("int")).alias("all_failed"))
        .filter("all_failed = 1")
    )
    named(all_failed.join(read_values, ["run", "key", "value"]), "aborted-read")

    # lost-write / unseen: only in runs with a final read (of any outcome)
    final_runs = ops.filter(F.col("f") == "final_read").select("run").distinct()
    finals = read_obs.filter(F.col("f") == "final_read")
    final_max = finals.groupBy("run", "key").agg(F.max("offset").alias("final_max"))
    final_values = finals.select("run", "key", "value").distinct().withColumn("in_final", F.lit(1))
    acked = (
        ok.filter(F.col("f") == "produce")
        .filter(F.col("value").isNotNull())
        .join(final_runs, "run")
        .join(final_max, ["run", "key"], "left")
        .join(read_values.withColumn("was_read", F.lit(1)), ["run", "key", "value"], "left")
        .join(final_values, ["run", "key", "value"], "left")
    )
    lost = (F.col("offset") <= F.coalesce(F.col("final_max"), F.lit(-1))) & F.col(
        "was_read"
    ).isNull()
    named(acked.filter(lost), "lost-write")
    named(acked.filter(~lost & F.col("in_final").isNull()), "unseen")

    # polls: each received offset must be the previous one + 1 (seek sets it, info forgets)
    pw = ops.filter(F.col("f").isin("poll", "seek") & (F.col("status") != "fail"))
    marks = pw.filter(~((F.col("f") == "poll") & (F.col("status") == "ok"))).select(
        "run",
        "key",
        "process",
        "invoke_index",
        F.lit(0).alias("pos"),
        F.lit(None).cast(LongType()).alias("got"),
        F.when((F.col("f") == "seek") & (F.col("status") == "ok"), F.col("offset"))
        .otherwise(F.lit(None).cast(LongType()))
        .alias("sets"),
    )
    received = (
        pw.filter((F.col("f") == "poll") & (F.col("status") == "ok"))
        .select(
            "run", "key", "process", "invoke_index", F.posexplode("results").alias("pos", "pair")
        )
        .select(
            "run",
            "key",
            "process",
            "invoke_index",
            "pos",
            F.col("pair")[0].cast("long").alias("got"),
            (F.col("pair")[0].cast("long") + 1).alias("sets"),
        )
    )
    seq = marks.unionByName(received)
    order = Window.partitionBy("run", "key", "process").orderBy("invoke_index", "pos")
    checked = seq.withColumn("expected", F.lag("sets").over(order)).filter(
        F.col("got").isNotNull()
        & F.col("expected").isNotNull()
        & (F.col("got") != F.col("expected"))
    )
    named(checked.filter(F.col("got") > F.col("expected")), "poll-skip")
    named(checked.filter(F.col("got") < F.col("expected")), "nonmonotonic-poll")

    # stale-read: a linearizable read reaching the end, below an offset acked before it began
    acks = ok.filter((F.col("f") == "produce") & F.col("offset").isNotNull()).select(
        "run", "key", F.col("complete_ns").alias("ack_ns"), F.col("offset").alias("acked")
    )
    n_res = F.size("results")
    reached_end = (
        F.when(F.col("end").isNotNull(), F.col("end"))
        .when(F.col("limit").isNotNull(), n_res < F.col("limit"))
        .otherwise(n_res == 0)
    )
    lin = ok.filter(
        F.col("f").isin("read", "final_read") & (F.col("consistency") == "linearizable")
    ).filter(reached_end)
    lin = lin.select(
        "run",
        "key",
        "id",
        "invoke_ns",
        F.coalesce(F.col("offset"), F.lit(0)).alias("start"),
        F.coalesce(
            F.array_max(F.transform("results", lambda p: p[0].cast("long"))),
            F.coalesce(F.col("offset"), F.lit(0)) - 1,
        ).alias("seen_max"),
    )
    stale = (
        lin.alias("r")
        .join(
            acks.alias("a"),
            (F.col("r.run") == F.col("a.run"))
            & (F.col("r.key") == F.col("a.key"))
            & (F.col("a.ack_ns") < F.col("r.invoke_ns")),
        )
        .groupBy("r.run", "r.id", "r.start", "r.seen_max")
        .agg(F.max("a.acked").alias("acked"))
        .filter((F.col("acked") > F.col("seen_max")) & (F.col("acked") >= F.col("start")))
    )
    named(stale, "stale-read")

    found = counts[0]
    for c in counts[1:]:
        found = found.unionByName(c)
    runs = ops.select("run").distinct()
    names = ops.sparkSession.createDataFrame([(a,) for a in ANOMALIES], ["anomaly"])
    return (
        runs.crossJoin(names)
        .join(found, ["run", "anomaly"], "left")
        .select("run", "anomaly", F.coalesce(F.col("count"), F.lit(0)).alias("count"))
    )


def load_results(spark: SparkSession, runs_dir: str) -> tuple[DataFrame, DataFrame]:
    """(checker verdicts, benchmark rows) from every ``results.json``."""
    raw = (
        spark.read.option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "results.json")
        .option("wholetext", "true")
        .text(runs_dir)
        .select(F.col("_metadata.file_path").alias("file"), F.col("value").alias("doc"))
    )
    run = F.element_at(F.split("file", "/"), -2)
    j = F.get_json_object
    verdicts = raw.filter(j("doc", "$.checkers").isNotNull()).select(
        run.alias("run"),
        j("doc", "$.verdict").alias("verdict"),
        j("doc", "$.checkers.linearizable.verdict").alias("linearizable"),
        j("doc", "$.checkers.queue.verdict").alias("queue"),
        j("doc", "$.checkers.recovery.verdict").alias("recovery"),
        j("doc", "$.checkers.recovery.max_rto_ms").cast(DoubleType()).alias("max_rto_ms"),
        j("doc", "$.ops").cast(LongType()).alias("ops"),
    )
    bench_schema = ArrayType(
        StructType(
            [
                StructField("voters", LongType()),
                StructField("flush", StringType()),
                StructField(
                    "pipelined",
                    StructType(
                        [
                            StructField(
                                "ops_per_s", StructType([StructField("median", DoubleType())])
                            ),
                            StructField(
                                "latency_ms",
                                StructType(
                                    [
                                        StructField("p50", DoubleType()),
                                        StructField("p99", DoubleType()),
                                    ]
                                ),
                            ),
                        ]
                    ),
                ),
            ]
        )
    )
    bench = (
        raw.filter(j("doc", "$.dledger").isNotNull())
        .select(
            run.alias("run"), F.explode(F.from_json(j("doc", "$.dledger"), bench_schema)).alias("b")
        )
        .select(
            "run",
            "b.voters",
            "b.flush",
            F.col("b.pipelined.ops_per_s.median").alias("ops_per_s"),
            F.col("b.pipelined.latency_ms.p50").alias("p50_ms"),
            F.col("b.pipelined.latency_ms.p99").alias("p99_ms"),
        )
    )
    return verdicts, bench


# ----------------------------------------------------------------------------- the job


@dataclass
class Analysis:
    ops: DataFrame
    faults: DataFrame
    tables: dict[str, DataFrame]


def analyze(spark: SparkSession, runs_dir: str, cfg: AnalyzeConfig | None = None) -> Analysis:
    cfg = cfg or AnalyzeConfig()
    records = load_records(spark, runs_dir).cache()
    ops = build_ops(records).cache()
    faults = build_faults(records, ops).cache()
    win = windows(ops, faults, cfg)
    verdicts, bench = load_results(spark, runs_dir)
    tables = {
        "ops": ops.drop("results"),
        "ops_by_type": ops_by_type(ops),
        "latency": latency(ops, faults),
        "latency_by_kind": latency_by_kind(ops, faults),
        "windows": win,
        "rto_by_kind": rto_by_kind(win),
        "timeline": timeline(ops, cfg),
        "anomalies": anomalies(ops),
        "results": verdicts,
        "bench": bench,
    }
    return Analysis(ops, faults, tables)


def write(spark: SparkSession, a: Analysis, out: str) -> None:
    """Each table as Parquet under ``out``, then the HTML report. The tables
    in ``a`` are replaced by their Parquet copies, so later use (the report,
    a caller's checks) reads them instead of computing them again."""
    for name, df in list(a.tables.items()):
        path = f"{out.rstrip('/')}/{name}"
        df.write.mode("overwrite").parquet(path)
        a.tables[name] = spark.read.parquet(path)
    from pipeline.report import write_report

    write_report(spark, a, out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline analyze", description="Spark analysis of harness runs"
    )
    p.add_argument(
        "runs_dir",
        help="a directory (any Spark path) of harness runs: every *.jsonl history under it "
        "(what `python -m jepsen_like run --out DIR` writes) and every results.json",
    )
    p.add_argument("--out", default=None, help="output directory (default: RUNS_DIR/analysis)")
    p.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    p.add_argument("--bucket-ms", type=int, default=1000)
    p.add_argument("--grace-ms", type=int, default=2000)
    args = p.parse_args(argv)
    from pipeline.session import build_session

    spark = build_session(args.master, "dledger-analyze")
    try:
        out = args.out or f"{args.runs_dir.rstrip('/')}/analysis"
        print(
            f"input: every *.jsonl history and results.json under {args.runs_dir} "
            "(harness runs: python -m jepsen_like run --out DIR)",
            flush=True,
        )
        a = analyze(spark, args.runs_dir, AnalyzeConfig(args.bucket_ms, args.grace_ms))
        write(spark, a, out)
        summary: dict[str, Any] = {
            "runs": a.ops.select("run").distinct().count(),
            "ops": a.ops.count(),
            "fault_windows": a.faults.count(),
        }
        print(
            f"analysed {summary['runs']} runs ({summary['ops']} ops, "
            f"{summary['fault_windows']} fault windows) from {args.runs_dir} into {out}"
            f" (open {out.rstrip('/')}/index.html)"
        )
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
