"""Consume pages as an Arrow IPC stream (``Accept: application/vnd.apache.arrow.stream``).

The consume route answers JSON unless the request's ``Accept`` names
:data:`ARROW_STREAM`; then the committed messages the JSON page would carry
(same offsets, limits, long-poll; errors stay JSON envelopes) come as one
record batch of :data:`COLUMNS`, built from the broker's columnar read
(:meth:`broker_adapter.state.BrokerState.read_columns`: no base64; in a
node's store the page is decoded per log entry with numpy,
:mod:`broker_adapter.columnar`, and every column is built from buffers,
with no object per message), and the page's offsets travel in headers:

=======================  =====================================================
``X-Next-Offset``        the queue offset to ask for next (``next_offset``)
``X-Min-Offset``         the queue's first retained offset (``min_offset``)
``X-Max-Offset``         one past its last stored offset (``max_offset``)
``X-Confirm-Offset``     this node's CommitLog confirm offset (bytes)
``X-Message-Count``      rows in the stream
=======================  =====================================================

pyarrow is an optional dependency of the server: without it the route
answers ``406 ARROW_UNAVAILABLE`` to an Arrow request and JSON as ever.
numpy (in the same ``spark`` extra) is optional too: without it the page is
decoded record by record: the same rows for about three times the CPU.
"""

from __future__ import annotations

import binascii
import importlib
import sys
from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from broker_adapter.state import ReadColumns

ARROW_STREAM = "application/vnd.apache.arrow.stream"
# An Arrow page may hold more messages than a JSON one (which base64 makes
# slow to build): it is still bounded by max_bytes.
ARROW_MAX_MESSAGES = 10_000
JSON_MAX_MESSAGES = 1000  # a JSON page's cap (http_api.app.MAX_MESSAGES)
HEADERS = (
    "X-Next-Offset",
    "X-Min-Offset",
    "X-Max-Offset",
    "X-Confirm-Offset",
    "X-Message-Count",
)
# name, Arrow type (as text, for the OpenAPI document), JSON field it carries
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("topic", "string", "the topic (the URL's)"),
    ("queue", "int32", "the queue (the URL's)"),
    ("queue_offset", "int64", "queue_offset"),
    ("commit_offset", "int64", "commit_offset"),
    ("size", "int32", "size"),
    ("msg_id", "string", "msg_id"),
    ("store_ts_ms", "timestamp[ms, tz=UTC]", "store_ts_ms"),
    ("born_ts_ms", "timestamp[ms, tz=UTC]", "born_ts_ms"),
    ("tags", "string (null: no tag)", "tags"),
    ("keys", "list<string>", "keys"),
    ("properties", "map<string, string>", "properties"),
    ("value", "binary", "value (decoded: the bytes themselves)"),
)

_pa: ModuleType | None = None
_schema: Any = None


def load_pyarrow() -> ModuleType | None:
    """pyarrow, or None when it cannot be imported (asked once a process)."""
    global _pa
    if _pa is None:
        try:
            _pa = importlib.import_module("pyarrow")
        except ImportError:
            return None
    return _pa


def wants_arrow(accept: str) -> bool:
    """The request's ``Accept`` names the Arrow stream type (any
    parameters, q above 0); anything else, absent included, is JSON."""
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() != ARROW_STREAM:
            continue
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                try:
                    if float(value) <= 0:
                        return False
                except ValueError:
                    return False
        return True
    return False


def schema(pa: Any) -> Any:
    """The stream's ``pyarrow.Schema`` (:data:`COLUMNS`)."""
    global _schema
    if _schema is None:
        _schema = _make_schema(pa)
    return _schema


def _make_schema(pa: Any) -> Any:
    return pa.schema(
        [
            pa.field("topic", pa.string(), False),
            pa.field("queue", pa.int32(), False),
            pa.field("queue_offset", pa.int64(), False),
            pa.field("commit_offset", pa.int64(), False),
            pa.field("size", pa.int32(), False),
            pa.field("msg_id", pa.string(), False),
            pa.field("store_ts_ms", pa.timestamp("ms", tz="UTC"), False),
            pa.field("born_ts_ms", pa.timestamp("ms", tz="UTC"), False),
            pa.field("tags", pa.string(), True),
            pa.field("keys", pa.list_(pa.string()), False),
            pa.field("properties", pa.map_(pa.string(), pa.string()), False),
            pa.field("value", pa.binary(), False),
        ]
    )


def record_batch(pa: Any, topic: str, queue: int, cols: ReadColumns) -> Any:
    """The page as one ``pyarrow.RecordBatch`` of :func:`schema`. A page
    decoded by :mod:`broker_adapter.columnar` (numpy arrays, and tags and
    bodies as Arrow's offsets and data) has every column built from
    buffers, none from a Python object per message."""
    n = len(cols)
    r = cols.records
    ts = pa.timestamp("ms", tz="UTC")
    if r.body_data is not None:
        tags = (
            pa.Array.from_buffers(
                pa.string(),
                n,
                [
                    pa.array(r.tag_valid, pa.bool_()).buffers()[1],
                    pa.py_buffer(r.tag_offsets),
                    pa.py_buffer(r.tag_data),
                ],
            )
            if r.tag_data
            else pa.nulls(n, pa.string())
        )
        values = pa.Array.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(r.body_offsets), pa.py_buffer(r.body_data)]
        )
    else:
        tags = pa.array(r.tags, pa.string())
        values = pa.array(r.bodies, pa.binary())
    arrays = [
        pa.repeat(pa.scalar(topic, pa.string()), n),
        pa.repeat(pa.scalar(queue, pa.int32()), n),
        pa.array(cols.queue_offsets, pa.int64()),
        pa.array(cols.phys_offsets, pa.int64()),
        pa.array(cols.sizes, pa.int32()),
        _msg_ids(pa, cols.id_prefix, cols.phys_offsets),
        pa.array(cols.store_ts_ms, ts),
        pa.array(r.born_ts_ms, ts),
        tags,
        pa.ListArray.from_arrays(
            pa.array(r.key_offsets, pa.int32()), pa.array(r.keys, pa.string())
        ),
        pa.MapArray.from_arrays(
            pa.array(r.prop_offsets, pa.int32()),
            pa.array(r.prop_keys, pa.string()),
            pa.array(r.prop_values, pa.string()),
        ),
        values,
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema(pa))


def _msg_ids(pa: Any, prefix: str, phys: Sequence[int]) -> Any:
    """``prefix`` then each physical offset in 16 upper-case hex digits
    (:meth:`ReadColumns.msg_ids`), as a string array built from one buffer:
    the offsets packed big-endian and hexlified together, then laid out
    prefix by prefix with strided copies."""
    n = len(phys)
    if hasattr(phys, "astype"):  # a numpy array (a page of plain records)
        be = phys.astype(">u8").tobytes()
    else:
        packed = array("Q", phys)
        if sys.byteorder == "little":
            packed.byteswap()
        be = packed.tobytes()
    digits = binascii.hexlify(be).upper()
    head = prefix.encode("ascii")
    width = len(head) + 16
    data = bytearray(width * n)
    for j in range(len(head)):
        data[j::width] = head[j : j + 1] * n
    for j in range(16):
        data[len(head) + j :: width] = digits[j::16]
    offsets = array("i", range(0, width * n + 1, width))
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def ipc_stream(pa: Any, batch: Any) -> Any:
    """``batch`` as an Arrow IPC stream (schema, the batch, end marker): a
    ``pyarrow.Buffer``, which supports the buffer protocol."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def headers(cols: ReadColumns, confirm_offset: int) -> dict[str, str]:
    return {
        "X-Next-Offset": str(cols.next_offset),
        "X-Min-Offset": str(cols.min_offset),
        "X-Max-Offset": str(cols.max_offset),
        "X-Confirm-Offset": str(confirm_offset),
        "X-Message-Count": str(len(cols)),
    }
