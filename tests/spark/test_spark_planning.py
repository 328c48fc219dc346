"""Offset planning of the dledger source, without a cluster: the read-limit
split, the range split, the offset JSON and the option parser."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.options import (
    OptionError,
    SourceOptions,
    offsets_from_json,
    offsets_to_json,
)
from pipeline.source import plan_ranges, prorate

pytestmark = pytest.mark.spark

queues = st.dictionaries(
    st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 7)),
    st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
    max_size=10,
)


@given(queues, st.integers(1, 3000))
def test_prorate_bounds_a_batch_and_always_progresses(
    q: dict[tuple[str, int], tuple[int, int]], limit: int
) -> None:
    start = {k: s for k, (s, _) in q.items()}
    latest = {k: s + n for k, (s, n) in q.items()}
    end = prorate(start, latest, limit)
    assert set(end) == set(latest)
    assert all(start[k] <= end[k] <= latest[k] for k in end)
    backlog = sum(latest[k] - start[k] for k in latest)
    took = sum(end[k] - start[k] for k in end)
    assert took == min(limit, backlog)


def test_prorate_splits_by_backlog() -> None:
    start = {("t", 0): 0, ("t", 1): 100, ("t", 2): 5}
    latest = {("t", 0): 300, ("t", 1): 200, ("t", 2): 5}
    assert prorate(start, latest, 40) == {("t", 0): 30, ("t", 1): 110, ("t", 2): 5}
    # a queue that is new since `start` counts from offset 0
    assert prorate({}, {("t", 0): 10, ("t", 1): 30}, 8) == {("t", 0): 2, ("t", 1): 6}


@given(queues, st.integers(1, 12))
def test_plan_ranges_cover_exactly_the_offsets(
    q: dict[tuple[str, int], tuple[int, int]], min_partitions: int
) -> None:
    start = {k: s for k, (s, _) in q.items()}
    end = {k: s + n for k, (s, n) in q.items()}
    ranges = plan_ranges(start, end, min_partitions)
    covered = sorted((r.topic, r.queue, o) for r in ranges for o in range(r.start, r.end))
    want = sorted((t, qq, o) for (t, qq), e in end.items() for o in range(start[(t, qq)], e))
    assert covered == want  # no gap, no overlap
    assert all(r.end > r.start for r in ranges)
    total = len(want)
    assert len(ranges) >= min(min_partitions, total)


def test_offsets_json_round_trip_and_fixed_order() -> None:
    offs = {("b", 10): 3, ("a", 2): 1, ("b", 2): 7}
    doc = offsets_to_json(offs)
    assert list(doc) == ["a", "b"] and list(doc["b"]) == ["2", "10"]
    assert offsets_from_json(doc) == offs


def test_option_parsing() -> None:
    o = SourceOptions.parse(
        {
            "endpoints": "127.0.0.1:1, h:2",
            "subscribe": "x,y,x",
            "startingOffsets": '{"x": {"0": -2, "3": 17}}',
            "maxOffsetsPerTrigger": "5",
        },
        streaming=True,
    )
    assert o.endpoints == ("127.0.0.1:1", "h:2")
    assert o.topics == ("x", "y")
    assert o.starting == {"x": {0: -2, 3: 17}}
    assert o.max_offsets_per_trigger == 5 and o.fail_on_data_loss
    batch = SourceOptions.parse({"endpoints": "h:1", "topic": "x"}, streaming=False)
    assert (batch.starting, batch.ending) == ("earliest", "latest")
    for bad, streaming in [
        ({"topic": "x"}, False),
        ({"endpoints": "nohost", "topic": "x"}, False),
        ({"endpoints": "h:1"}, False),
        ({"endpoints": "h:1", "topic": "x", "subscribe": "y"}, False),
        ({"endpoints": "h:1", "topic": "x", "endingOffsets": "latest"}, True),
        ({"endpoints": "h:1", "topic": "x", "startingOffsets": '{"x": {"0": -3}}'}, True),
        ({"endpoints": "h:1", "topic": "x", "startingOffsets": '{"x": {"q": 1}}'}, True),
        ({"endpoints": "h:1", "topic": "x", "maxOffsetsPerTrigger": "0"}, True),
    ]:
        with pytest.raises(OptionError):
            SourceOptions.parse(bad, streaming=streaming)


class _Pages:
    """A NodeClient stand-in: fetch answers from a list (status, body)."""

    endpoint = "n1:1"
    endpoints = ("n1:1",)
    retry_for_s = 1.0

    def __init__(self, answers: list[tuple[int, object]]) -> None:
        self.answers = answers
        self.asked: list[tuple[int, bool]] = []

    def fetch(
        self, topic: str, queue: int, offset: int, n: int, wait_ms: int, arrow: bool = False
    ) -> tuple[int, object]:
        self.asked.append((offset, arrow))
        return self.answers.pop(0)

    def rotate(self) -> None:
        pass


def _json_msg(off: int) -> dict[str, object]:
    return {"queue_offset": off, "value": "", "encoding": "base64"}


def test_read_range_falls_back_to_json_and_checks_arrow_offsets() -> None:
    import pyarrow as pa

    from pipeline.fetch import QueueRange, read_range
    from pipeline.options import PipelineError

    r = QueueRange("t", 0, 0, 3)
    batch = pa.RecordBatch.from_pydict({"queue_offset": pa.array([0, 1], pa.int64())})
    no_arrow = {"error": {"code": "ARROW_UNAVAILABLE", "message": "no pyarrow"}}
    # an Arrow page, then a node without pyarrow (406): JSON from then on
    c = _Pages([(200, batch), (406, no_arrow), (200, {"messages": [_json_msg(2)]})])
    pages = list(read_range(c, r, fail_on_data_loss=True, arrow=True))  # type: ignore[arg-type]
    assert isinstance(pages[0], pa.RecordBatch) and pages[0].num_rows == 2
    assert pages[1] == [_json_msg(2)]
    assert c.asked == [(0, True), (2, True), (2, False)]
    # a node that answers JSON to an Arrow request (an older server) is read as JSON
    c = _Pages([(200, {"messages": [_json_msg(k) for k in range(4)]})])
    pages = list(read_range(c, r, fail_on_data_loss=True, arrow=True))  # type: ignore[arg-type]
    assert pages == [[_json_msg(k) for k in range(3)]]  # cut at the range's end
    # an Arrow page whose offsets skip one is a broken answer
    bad = pa.RecordBatch.from_pydict({"queue_offset": pa.array([0, 2], pa.int64())})
    c = _Pages([(200, bad)])
    with pytest.raises(PipelineError, match=r"asked for offset 1 .* got 2"):
        list(read_range(c, r, fail_on_data_loss=True, arrow=True))  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="fetchFormat"):
        SourceOptions.parse(
            {"endpoints": "h:1", "topic": "t", "fetchFormat": "xml"}, streaming=False
        )
    o = SourceOptions.parse(
        {"endpoints": "h:1", "topic": "t", "fetchFormat": "JSON"}, streaming=False
    )
    assert not o.fetch_arrow and o.fetch_max_messages == 1000
    o = SourceOptions.parse({"endpoints": "h:1", "topic": "t"}, streaming=False)
    assert o.fetch_arrow and o.fetch_max_messages == 10_000


def test_a_schema_given_to_the_reader_projects_and_is_checked() -> None:
    """The columns a user's schema names come out, in its order, with its
    field flags; a column the source has not, one of another type, one
    named twice, or a nullable one declared NOT NULL is a clear error."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructType
    from pyspark.sql.types import StructField as F

    from pipeline.source import ARROW_SCHEMA, SCHEMA, Projection

    def ddl(*fields: F) -> StructType:
        return StructType(list(fields))

    full = pa.RecordBatch.from_pylist(
        [
            {
                "topic": "t",
                "queue": 1,
                "queue_offset": 7,
                "commit_offset": 900,
                "msg_id": "X",
                "key": None,
                "tags": "a",
                "properties": [("p", "q")],
                "value": b"v",
                "born_timestamp": None,
                "store_timestamp": None,
            }
        ],
        schema=ARROW_SCHEMA,
    )
    assert Projection(SCHEMA).of(full) is full
    proj = Projection(ddl(F("value", BinaryType()), F("queue_offset", LongType())))
    got = proj.of(full)
    assert got.schema.names == ["value", "queue_offset"]
    assert got.to_pylist() == [{"value": b"v", "queue_offset": 7}]
    for schema, needle in [
        (ddl(F("offset", LongType())), "no column 'offset'"),
        (ddl(F("queue", LongType())), "queue' is int, not bigint"),
        (ddl(F("queue", IntegerType()), F("queue", IntegerType())), "named twice"),
        (ddl(F("key", StringType(), False)), "can be null"),
        (ddl(), "at least one column"),
    ]:
        with pytest.raises(OptionError, match=needle):
            Projection(schema)
    assert Projection(ddl(F("queue", IntegerType(), False))).names == ["queue"]
