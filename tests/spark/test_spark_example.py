"""The README's streaming example, short: events over HTTP, per-minute counts
by a Structured Streaming query on the dledger source, into Parquet."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pipeline.examples import events_per_minute as ex
from tests.http.apiclient import ApiCluster
from tests.spark.helpers import endpoints

pytestmark = pytest.mark.spark


def test_events_per_minute_example(
    spark: SparkSession, cluster: ApiCluster, tmp_path: Path
) -> None:
    eps = endpoints(cluster)
    base = 1_700_000_040_000  # a minute boundary
    events = ex.make_events(900, base, span_minutes=3)
    assert ex.produce(eps, "clicks", events) == 900
    # as the example's produce command does: a late clock tick moves the
    # watermark past every minute above, so all of them are final
    ex.produce(eps, "clicks", [{"type": "tick", "user": "clock", "ts": base + 3_600_000}])
    out, ck = str(tmp_path / "counts"), str(tmp_path / "ck")
    want = Counter(((e["ts"] // 60_000) * 60_000, e["type"]) for e in events)
    for run in range(2):  # the second run resumes from the checkpoint: nothing new, no duplicate
        q = ex.start(spark, eps, "clicks", out, ck, available_now=True)
        read = ex.follow(q)  # what the example's run command reports
        assert q.exception() is None
        assert read == (901 if run == 0 else 0)
        assert ex.summary(spark, read, out, ck) == (
            f"read {read} events; {out} now holds {len(want)} rows (one per minute and type, "
            f"Parquet); offsets are in {ck}"
        )
        rows = (
            spark.read.parquet(out)
            .select(F.unix_millis("minute").alias("ms"), "type", "events")
            .collect()
        )
        assert len(rows) == len(want)
        assert {(r.ms, r.type): r.events for r in rows} == dict(want)
