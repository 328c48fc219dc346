"""The ``dledger`` Spark data source: topics of a running cluster as a batch
or streaming DataFrame (PySpark's Python Data Source API, Spark >= 4.2).

Theory of operation
-------------------
Offsets are queue offsets, per ``(topic, queue)``: the *next* offset to read,
as in Spark's Kafka source. They travel as JSON ``{"topic": {"queue":
offset}}``; in a streaming query that JSON, written by Spark into the
checkpoint's offset log before a micro-batch runs, is the only state: the
stream reader keeps nothing that a restart would need. A micro-batch
``(start, end]`` becomes one input partition per queue that has new offsets,
``[start, end)``; :func:`pipeline.fetch.read_range` returns exactly those
messages or fails. Since committed messages never change and every replica
serves the same committed prefix, re-running a micro-batch after a crash
(Spark replays the last planned batch from its offset log) yields the same
rows, so an idempotent or transactional sink (Spark's file sink,
``foreachBatch`` keyed by batch id) sees every message exactly once, across
restarts of the query and leader changes of the cluster.

Planning asks every endpoint for the topic's queues and takes, per queue,
the highest max offset any replica serves (all of it committed) and the
highest min offset (what retention left everywhere): "latest" therefore
includes every message acknowledged before planning began, even when one
replica lags. ``latestOffset`` never returns less than its start for any
queue, so a lagging replica cannot move a stream backwards.

``maxOffsetsPerTrigger`` (Spark's ``ReadMaxRows``) bounds a micro-batch to at
most that many messages, split over the queues in proportion to their
backlog (largest remainders get the leftover units, so the total is exact).
``Trigger.AvailableNow`` is supported: ``prepareForTriggerAvailableNow``
records the latest offsets once and no later micro-batch goes past them.

Several broker groups (a controller holds the route table): when the
endpoints answer ``GET /v1/routes/{topic}``, each queue is described by,
and read from, the replicas of the group that owns it (any of them, as in
one group); the endpoints may then be controller or broker nodes of any
group. Offsets stay per ``(topic, queue)``: queue numbers are global.

Readers open their HTTP connections inside ``read()``, on the executor that
runs the task; the objects Spark serialises to executors hold only options
and offset ranges.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pipeline.fetch import (
    NodeClient,
    QueueInfo,
    QueueRange,
    UnknownTopicError,
    decode_value,
    first_endpoint,
    read_range,
)
from pipeline.options import (
    EARLIEST,
    LATEST,
    DataLossError,
    OffsetSpec,
    OptionError,
    QueueKey,
    SourceOptions,
    SourceUnavailableError,
    offsets_from_json,
    offsets_to_json,
)

log = logging.getLogger("pipeline.source")

FORMAT = "dledger"

SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("queue", IntegerType(), False),
        StructField("queue_offset", LongType(), False),
        StructField("commit_offset", LongType(), False),
        StructField("msg_id", StringType(), False),
        # RocketMQ keeps a message's keys as one space-separated string (KEY_SEPARATOR)
        StructField("key", StringType(), True),
        StructField("tags", StringType(), True),
        StructField("properties", MapType(StringType(), StringType(), True), True),
        StructField("value", BinaryType(), True),
        StructField("born_timestamp", TimestampType(), True),
        StructField("store_timestamp", TimestampType(), True),
    ]
)
ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")


class RangePartition(InputPartition):
    """One queue's offsets ``[start, end)``; ``endpoints``: the replicas of
    the broker group that owns the queue (a multi-group cluster), empty: the
    source's endpoints."""

    def __init__(
        self, topic: str, queue: int, start: int, end: int, endpoints: tuple[str, ...] = ()
    ) -> None:
        super().__init__((topic, queue, start, end))
        self.topic = topic
        self.queue = queue
        self.start = start
        self.end = end
        self.endpoints = endpoints


# ----------------------------------------------------------------------------- planning


DESCRIBE_TIMEOUT_S = 3.0


def _describe_one(opts: SourceOptions, ep: str, topic: str) -> list[QueueInfo] | str | None:
    """One endpoint's answer: its queues, None (unknown topic) or "down"."""
    timeout = min(opts.request_timeout_s, DESCRIBE_TIMEOUT_S)
    with NodeClient((ep,), timeout, retry_for_s=0) as c:
        try:
            return c.describe(topic)
        except UnknownTopicError:
            return None
        except SourceUnavailableError:
            return "down"


def describe_all(opts: SourceOptions, topic: str) -> list[QueueInfo] | None:
    """The topic's queues as the most advanced replica sees them (see the
    module doc); None when no replica knows the topic. The endpoints are
    asked at once, so a paused node costs one short timeout, not one each."""
    with ThreadPoolExecutor(len(opts.endpoints)) as pool:
        answers = list(pool.map(lambda ep: _describe_one(opts, ep, topic), opts.endpoints))
    if all(a == "down" for a in answers):
        # nobody answered at once: wait for any endpoint, up to retryForMs
        with NodeClient(opts.endpoints, opts.request_timeout_s, opts.retry_for_s) as c:
            try:
                return c.describe(topic)
            except UnknownTopicError:
                return None
    merged: dict[int, QueueInfo] = {}
    for infos in answers:
        if not isinstance(infos, list):
            continue
        for qi in infos:
            old = merged.get(qi.queue)
            merged[qi.queue] = (
                qi
                if old is None
                else QueueInfo(
                    qi.queue,
                    max(old.min_offset, qi.min_offset),
                    max(old.max_offset, qi.max_offset),
                )
            )
    return [merged[q] for q in sorted(merged)] if merged else None


Owners = dict[QueueKey, tuple[str, ...]]


def group_routes(opts: SourceOptions, topic: str) -> dict[str, tuple[set[int], tuple[str, ...]]]:
    """A multi-group cluster (the endpoints serve ``/v1/routes``): group ->
    (its queues of ``topic``, its replicas' addresses). Empty: one group, or
    a topic the route table does not know (the describe says which)."""
    timeout = min(opts.request_timeout_s, DESCRIBE_TIMEOUT_S)
    with NodeClient(opts.endpoints, timeout, opts.retry_for_s) as c:
        status, body = c.get(f"/v1/routes/{urllib.parse.quote(topic)}")
    if status != 200 or not isinstance(body, dict):
        return {}
    out: dict[str, tuple[set[int], tuple[str, ...]]] = {}
    for q in body["queues"]:
        g = str(q["group"])
        members = tuple(str(m["http"]) for m in body["groups"].get(g, {}).get("members", []))
        out.setdefault(g, (set(), members))[0].add(int(q["queue"]))
    return out


def plan_infos(opts: SourceOptions) -> tuple[dict[QueueKey, QueueInfo], Owners]:
    """Every queue's offsets and, in a multi-group cluster, the replicas of
    the group that owns it (asked as :func:`describe_all` asks one group)."""
    out: dict[QueueKey, QueueInfo] = {}
    owners: Owners = {}
    for t in opts.topics:
        routes = group_routes(opts, t)
        if not routes:
            for qi in describe_all(opts, t) or []:
                out[(t, qi.queue)] = qi
            continue
        for _g, (queues, members) in sorted(routes.items()):
            sub = dataclasses.replace(opts, endpoints=members)
            for qi in describe_all(sub, t) or []:
                if qi.queue in queues:
                    out[(t, qi.queue)] = qi
                    owners[(t, qi.queue)] = members
    return out, owners


def queue_infos(opts: SourceOptions) -> dict[QueueKey, QueueInfo]:
    return plan_infos(opts)[0]


def resolve(
    spec: OffsetSpec,
    infos: Mapping[QueueKey, QueueInfo],
    default: int,
) -> dict[QueueKey, int]:
    """Concrete offsets for every known queue; ``default`` (EARLIEST or
    LATEST) for queues a JSON spec leaves out."""
    out: dict[QueueKey, int] = {}
    for key, qi in infos.items():
        if isinstance(spec, str):
            want = EARLIEST if spec == "earliest" else LATEST
        else:
            want = spec.get(key[0], {}).get(key[1], default)
        out[key] = qi.min_offset if want == EARLIEST else qi.max_offset if want == LATEST else want
    if isinstance(spec, dict):
        for t, queues in spec.items():
            for q, off in queues.items():
                if (t, q) not in infos:
                    raise OptionError(f"offsets name {t}/{q}, which the cluster does not have")
                if off >= 0 and off > infos[(t, q)].max_offset:
                    raise OptionError(
                        f"offset {off} of {t}/{q} is beyond its max offset "
                        f"{infos[(t, q)].max_offset}"
                    )
    return out


def prorate(
    start: Mapping[QueueKey, int], end: Mapping[QueueKey, int], limit: int
) -> dict[QueueKey, int]:
    """``end`` cut so that at most ``limit`` offsets lie between ``start``
    and it, split over the queues in proportion to their backlog; the
    leftover of the integer split goes to the largest remainders (ties: the
    larger backlog, then the queue order), so the total is exactly ``limit``
    whenever the backlog exceeds it."""
    lag = {k: e - start.get(k, 0) for k, e in end.items()}
    total = sum(v for v in lag.values() if v > 0)
    if total <= limit:
        return dict(end)
    take = {k: (limit * v) // total for k, v in lag.items() if v > 0}
    left = limit - sum(take.values())
    order = sorted(take, key=lambda k: (-((limit * lag[k]) % total), -lag[k], k))
    for k in order[:left]:
        take[k] += 1
    return {k: start.get(k, 0) + take.get(k, 0) if lag[k] > 0 else e for k, e in end.items()}


def plan_ranges(
    start: Mapping[QueueKey, int], end: Mapping[QueueKey, int], min_partitions: int = 1
) -> list[QueueRange]:
    """Non-empty ``[start, end)`` per queue (queues new since ``start`` begin
    at 0), split into more pieces when fewer than ``min_partitions``."""
    ranges = [
        QueueRange(t, q, start.get((t, q), 0), e)
        for (t, q), e in sorted(end.items())
        if e > start.get((t, q), 0)
    ]
    total = sum(r.end - r.start for r in ranges)
    if len(ranges) >= min_partitions or total == 0:
        return ranges
    out: list[QueueRange] = []
    for r in ranges:
        size = r.end - r.start
        pieces = max(1, min(size, -(-size * min_partitions // total)))
        cuts = [r.start + size * i // pieces for i in range(pieces + 1)]
        out.extend(QueueRange(r.topic, r.queue, lo, hi) for lo, hi in itertools.pairwise(cuts))
    return out


def _partitions(ranges: Sequence[QueueRange], owners: Owners | None = None) -> list[RangePartition]:
    owners = owners or {}
    return [
        RangePartition(r.topic, r.queue, r.start, r.end, owners.get((r.topic, r.queue), ()))
        for r in ranges
    ]


# ----------------------------------------------------------------------------- reading


def _to_arrow(topic: str, queue: int, page: list[dict[str, Any]]) -> pa.RecordBatch:
    n = len(page)
    keys = [" ".join(m["keys"]) if m["keys"] else None for m in page]
    cols = [
        pa.array([topic] * n, pa.string()),
        pa.array([queue] * n, pa.int32()),
        pa.array([m["queue_offset"] for m in page], pa.int64()),
        pa.array([m["commit_offset"] for m in page], pa.int64()),
        pa.array([m["msg_id"] for m in page], pa.string()),
        pa.array(keys, pa.string()),
        pa.array([m["tags"] or None for m in page], pa.string()),
        pa.array([list(m["properties"].items()) for m in page], ARROW_SCHEMA.field(7).type),
        pa.array([decode_value(m) for m in page], pa.binary()),
        pa.array([m["born_ts_ms"] * 1000 for m in page], ARROW_SCHEMA.field(9).type),
        pa.array([m["store_ts_ms"] * 1000 for m in page], ARROW_SCHEMA.field(10).type),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)


_NO_KEY = pa.scalar(None, pa.string())


def _from_server(
    topic: str, queue: int, page: pa.RecordBatch, proj: Projection | None = None
) -> pa.RecordBatch:
    """A page the node sent as Arrow (:mod:`http_api.arrow`'s columns) in
    :data:`ARROW_SCHEMA` (or ``proj``'s columns: only those are built),
    column by column: the rows :func:`_to_arrow` makes of the same page sent
    as JSON."""
    n = page.num_rows
    ts = ARROW_SCHEMA.field("born_timestamp").type
    props_type = ARROW_SCHEMA.field("properties").type

    def key() -> pa.Array:
        keys = page.column("keys")
        if len(keys.flatten()) == 0:
            return pa.nulls(n, pa.string())
        return pc.if_else(
            pc.equal(pc.list_value_length(keys), 0), _NO_KEY, pc.binary_join(keys, " ")
        )

    def props() -> pa.Array:
        p = page.column("properties")
        return p if p.type == props_type else p.cast(props_type)

    derived: dict[str, Callable[[], pa.Array]] = {
        "key": key,
        "properties": props,
        "born_timestamp": lambda: page.column("born_ts_ms").cast(ts),
        "store_timestamp": lambda: page.column("store_ts_ms").cast(ts),
    }
    if proj is None:
        names, schema = SCHEMA.names, ARROW_SCHEMA
    else:
        names, schema = proj.names, proj.arrow
    cols = [derived[c]() if c in derived else page.column(c) for c in names]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


class Projection:
    """The columns a schema given to the reader asks for
    (``spark.read.format("dledger").schema("queue int, queue_offset long")``):
    a subset of :data:`SCHEMA` in any order, each with its type. Spark's
    Python data sources get no column pruning from the optimizer, so every
    column a batch carries is converted on the JVM side even when the query
    never reads it (``count()`` reads none); naming only the columns a query
    needs is how a user prunes them. None of it: all of :data:`SCHEMA`."""

    def __init__(self, schema: StructType) -> None:
        ours = {f.name: f for f in SCHEMA.fields}
        seen: set[str] = set()
        for f in schema.fields:
            mine = ours.get(f.name)
            if mine is None:
                raise OptionError(
                    f"schema: no column {f.name!r} in the dledger source; "
                    f"its columns are {', '.join(ours)}"
                )
            if f.name in seen:
                raise OptionError(f"schema: column {f.name!r} is named twice")
            seen.add(f.name)
            if f.dataType != mine.dataType:
                raise OptionError(
                    f"schema: column {f.name!r} is {mine.dataType.simpleString()}, "
                    f"not {f.dataType.simpleString()}"
                )
            if mine.nullable and not f.nullable:
                raise OptionError(f"schema: column {f.name!r} can be null: declare it nullable")
        if not schema.fields:
            raise OptionError("schema: name at least one column")
        self.names = [f.name for f in schema.fields]
        self.all = self.names == SCHEMA.names
        self.arrow = ARROW_SCHEMA if self.all else to_arrow_schema(schema, timezone="UTC")

    def of(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (of :data:`ARROW_SCHEMA`) with the asked columns only."""
        if self.all:
            return batch
        return pa.RecordBatch.from_arrays(batch.select(self.names).columns, schema=self.arrow)


def read_partition(
    opts: SourceOptions, p: RangePartition, proj: Projection
) -> Iterator[pa.RecordBatch]:
    """Executor side: exactly the messages of ``p`` as Arrow batches of
    ``proj``'s columns."""
    r = QueueRange(p.topic, p.queue, p.start, p.end)
    with NodeClient(
        p.endpoints or opts.endpoints,
        opts.request_timeout_s,
        opts.retry_for_s,
        first=first_endpoint(r.topic, r.queue),
    ) as client:
        for page in read_range(
            client,
            r,
            fail_on_data_loss=opts.fail_on_data_loss,
            fetch_max_messages=opts.fetch_max_messages,
            arrow=opts.fetch_arrow,
        ):
            if isinstance(page, pa.RecordBatch):
                yield _from_server(r.topic, r.queue, page, proj)
            else:
                yield proj.of(_to_arrow(r.topic, r.queue, page))


# ----------------------------------------------------------------------------- Spark API


class DLedgerDataSource(DataSource):
    """``spark.read.format("dledger")`` / ``spark.readStream.format("dledger")``;
    options in :mod:`pipeline.options`."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DLedgerBatchReader:
        return DLedgerBatchReader(SourceOptions.parse(self.options, streaming=False), schema)

    def streamReader(self, schema: StructType) -> DLedgerStreamReader:
        return DLedgerStreamReader(SourceOptions.parse(self.options, streaming=True), schema)


class DLedgerBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions, schema: StructType = SCHEMA) -> None:
        self.opts = opts
        self.proj = Projection(schema)

    def partitions(self) -> list[RangePartition]:
        infos, owners = plan_infos(self.opts)
        missing = [t for t in self.opts.topics if not any(k[0] == t for k in infos)]
        if missing:
            raise OptionError(f"topic(s) {missing} do not exist on {list(self.opts.endpoints)}")
        start = resolve(self.opts.starting, infos, EARLIEST)
        end = resolve(self.opts.ending or "latest", infos, LATEST)
        for k, s in start.items():
            if s > end[k]:
                raise OptionError(
                    f"{k[0]}/{k[1]}: startingOffsets {s} is after endingOffsets {end[k]}"
                )
        return _partitions(plan_ranges(start, end, self.opts.min_partitions), owners)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.proj)


class DLedgerStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: SourceOptions, schema: StructType = SCHEMA) -> None:
        self.opts = opts
        self.proj = Projection(schema)
        # Trigger.AvailableNow: the latest offsets when the query began (in memory
        # only: a restarted AvailableNow query takes a new target, as Kafka's does)
        self._target: dict[QueueKey, int] | None = None
        # which group's replicas serve each queue (a multi-group cluster),
        # as of the last planning; refreshed when a queue is missing
        self._owners: Owners = {}

    # offsets -------------------------------------------------------------------
    def initialOffset(self) -> dict[str, dict[str, int]]:
        infos = queue_infos(self.opts)
        return offsets_to_json(resolve(self.opts.starting, infos, EARLIEST))

    def _latest(self) -> dict[QueueKey, int]:
        infos, self._owners = plan_infos(self.opts)
        return {k: qi.max_offset for k, qi in infos.items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_offsets_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def reportLatestOffset(self) -> dict[str, dict[str, int]]:
        return offsets_to_json(self._latest())

    def latestOffset(
        self, start: dict[str, dict[str, int]], limit: ReadLimit
    ) -> dict[str, dict[str, int]]:
        begin = offsets_from_json(start)
        latest = self._target if self._target is not None else self._latest()
        end: dict[QueueKey, int] = {}
        for k, b in begin.items():
            if k not in latest and self._target is None:
                msg = f"{k[0]}/{k[1]} no longer exists (topic deleted or shrunk) at offset {b}"
                if self.opts.fail_on_data_loss:
                    raise DataLossError(msg + "; set failOnDataLoss=false to go on without it")
                log.warning("%s; dropped because failOnDataLoss=false", msg)
            end[k] = max(b, latest.get(k, b))
        for k, e in latest.items():
            end.setdefault(k, e)
        if isinstance(limit, ReadMaxRows):
            end = prorate(begin, end, limit.max_rows)
        return offsets_to_json(end)

    def partitions(
        self, start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]
    ) -> list[RangePartition]:
        ranges = plan_ranges(offsets_from_json(start), offsets_from_json(end))
        if any((r.topic, r.queue) not in self._owners for r in ranges):
            self._owners = plan_infos(self.opts)[1]
        return _partitions(ranges, self._owners)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_partition(self.opts, partition, self.proj)

    def commit(self, end: dict[str, dict[str, int]]) -> None:
        """Nothing to do: the broker keeps committed messages until retention."""


def register(spark: SparkSession) -> None:
    """Make ``format("dledger")`` available in ``spark``."""
    spark.dataSource.register(DLedgerDataSource)
