"""A consume page decoded with numpy, for the Arrow answer (issue 17).

:meth:`BrokerState.read_columns` answers a page column by column. Its
general path still touches every message in Python: an index tuple, a
record slice, a length, version and CRC check, and a decode of the header.
At about 3 microseconds a message that was most of what a Spark count
cost (three nodes' CPU, 3 s for 1,000,000 messages, against 1.5 s for
Spark itself).

This module does the same work per *page* and per *log entry* instead:

* the page's ConsumeQueue rows come as one buffer (:data:`INDEX_DTYPE`),
  read as arrays; the byte cap is a cumulative sum and a binary search;
* the log entries holding the records are read once each
  (:meth:`~broker_adapter.bodies.DurableBodies.page_entries`, which checks
  each entry's CRC as every read does) and joined; each record's header is
  gathered into one array of :data:`HEADER_DTYPE` rows;
* the checks :func:`~broker_adapter.codec.decode_columns` makes of each
  record are made on those arrays: its length is the index's size, its
  version is known, its body fits. The record's own CRC is not recomputed:
  the entry's CRC, checked when the entry was read, covers every byte of
  it, and a record sliced at a wrong place fails the length or version
  check (the ConsumeQueue rows have CRCs of their own);
* the bodies are gathered into one buffer with their offsets: Arrow's
  layout for a binary column, with no ``bytes`` object per message.

It serves *plain* records only (no sharding key, tag, keys or properties:
what a producer that sets none of them writes). A page with any other
record, or one that fails a check, returns None and the caller takes the
general path, which decodes every record and names the one at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from broker_adapter import codec
from dledger.core.types import Entry

# The ConsumeQueue row (broker_adapter.bodies._IVAL, ">qiIq").
INDEX_DTYPE = np.dtype([("phys", ">i8"), ("size", ">i4"), ("tag", ">u4"), ("ts", ">i8")])
# A record's fixed fields (codec._REC_FIXED, ">IIBqi") and, for a plain
# record, the lengths that follow them (codec._REC_PLAIN, ">HHHHI").
HEADER_DTYPE = np.dtype(
    [
        ("size", ">u4"),
        ("crc", ">u4"),
        ("ver", "u1"),
        ("born", ">i8"),
        ("queue", ">i4"),
        ("n_shard", ">u2"),
        ("n_tag", ">u2"),
        ("n_keys", ">u2"),
        ("n_props", ">u2"),
        ("n_body", ">u4"),
    ]
)
assert INDEX_DTYPE.itemsize == 24
assert HEADER_DTYPE.itemsize == codec.PLAIN_BODY_AT

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class IndexPage:
    """A page's ConsumeQueue rows, cut to its byte cap."""

    offsets: I64  # queue offsets
    phys: I64
    sizes: I64
    stamps: I64


def index_page(raw: bytes, first: int, max_bytes: int) -> IndexPage:
    """The rows in ``raw`` (joined :data:`INDEX_DTYPE` rows, the first at
    queue offset ``first``), as many as
    :meth:`BrokerState.read` would serve: the first always, then while the
    records' sizes add up to at most ``max_bytes``."""
    rows = np.frombuffer(raw, INDEX_DTYPE)
    sizes = rows["size"].astype(np.int64)
    take = len(rows)
    if take:
        # sizes are positive, so the sums grow: the count within the cap
        take = max(1, int(np.searchsorted(np.cumsum(sizes), max_bytes, side="right")))
    return IndexPage(
        np.arange(first, first + take, dtype=np.int64),
        rows["phys"][:take].astype(np.int64),
        sizes[:take],
        rows["ts"][:take].astype(np.int64),
    )


@dataclass(frozen=True, slots=True)
class PlainRecords:
    """The records of a page of plain records: their born times, and their
    bodies as Arrow lays out a binary column (``offsets``: n + 1 int32)."""

    born_ts_ms: I64
    body_offsets: npt.NDArray[np.int32]
    body_data: bytes


def ascending(phys: I64) -> bool:
    """CommitLog positions of a queue's messages only grow."""
    return bool(len(phys) < 2 or np.all(phys[1:] > phys[:-1]))


def plain_records(
    entries: Sequence[tuple[Entry, int]], phys: I64, sizes: I64
) -> PlainRecords | None:
    """The records at ``phys`` (``sizes`` bytes each) sliced out of
    ``entries`` (:meth:`DurableBodies.page_entries`: each entry with the end
    of its run in ``phys``), or None when any of them is not a plain record
    or fails a check (the caller then decodes them one by one, which names
    the one at fault)."""
    n = len(phys)
    if not n or np.any(sizes < codec.PLAIN_BODY_AT):
        return None
    # Join the entries; shift each record's CommitLog position to its place
    # in the joined buffer, and check that it ends inside its entry.
    ends = np.fromiter((k for _e, k in entries), np.int64, len(entries))
    counts = np.diff(ends, prepend=0)
    lens = np.fromiter((len(e.data) for e, _k in entries), np.int64, len(entries))
    bases = np.cumsum(lens) - lens  # each entry's start in the joined buffer
    epos = np.fromiter((e.pos for e, _k in entries), np.int64, len(entries))
    starts = phys + np.repeat(bases - epos, counts)
    if np.any(starts + sizes > np.repeat(bases + lens, counts)) or np.any(
        starts < np.repeat(bases, counts)
    ):
        return None
    buf = np.frombuffer(b"".join(e.data for e, _k in entries), np.uint8)
    # Every record's header: one gather of n x 33 bytes, read as rows.
    at = starts[:, None] + np.arange(codec.PLAIN_BODY_AT, dtype=np.int64)
    hdr = buf[at].reshape(-1).view(HEADER_DTYPE)
    n_body = hdr["n_body"].astype(np.int64)
    if not (
        np.all(hdr["size"] == sizes)
        and np.all(hdr["ver"] == codec.RECORD_VERSION)
        and not np.any(hdr["n_shard"] | hdr["n_tag"] | hdr["n_keys"] | hdr["n_props"])
        and np.all(codec.PLAIN_BODY_AT + n_body <= sizes)
    ):
        return None
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(n_body, out=offsets[1:])
    data = _bodies(buf, starts, sizes, n_body)
    return PlainRecords(hdr["born"].astype(np.int64), offsets.astype(np.int32), data)


def _bodies(buf: npt.NDArray[np.uint8], starts: I64, sizes: I64, n_body: I64) -> bytes:
    """The bodies, back to back. A run of records of one size, each right
    after the previous one (a producer's batch of equal messages), is a
    2-D view of the buffer whose columns are the body: one copy for the
    run. Pages of many short runs slice each body instead."""
    n = len(starts)
    # a run breaks where a record does not start where the previous ended,
    # or its size or body length differs from the previous one's
    brk = np.flatnonzero(
        (starts[1:] != starts[:-1] + sizes[:-1])
        | (sizes[1:] != sizes[:-1])
        | (n_body[1:] != n_body[:-1])
    )
    if len(brk) * 8 > n:  # short runs: a slice per record
        mv = buf.data
        lo = (starts + codec.PLAIN_BODY_AT).tolist()
        hi = (starts + codec.PLAIN_BODY_AT + n_body).tolist()
        return b"".join([mv[a:b] for a, b in zip(lo, hi, strict=True)])
    parts: list[bytes] = []
    for a, b in zip([0, *(brk + 1).tolist()], [*(brk + 1).tolist(), n], strict=True):
        size, at = int(sizes[a]), int(starts[a])
        rows = buf[at : at + size * (b - a)].reshape(b - a, size)
        parts.append(rows[:, codec.PLAIN_BODY_AT : codec.PLAIN_BODY_AT + int(n_body[a])].tobytes())
    return b"".join(parts)


def as_list(values: Any) -> list[Any]:
    """A column as a list of Python values (for comparisons and JSON)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)
