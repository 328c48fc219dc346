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
  version is known, every length in it stays inside it. The record's own
  CRC is not recomputed: the entry's CRC, checked when the entry was read,
  covers every byte of it, and a record sliced at a wrong place fails the
  length or version check (the ConsumeQueue rows have CRCs of their own);
* the sharding key and tag lengths are gathered the same way; a record
  with keys or properties (the rare case) is decoded on its own, CRC
  included, and spliced into the list and map columns;
* tags and bodies are gathered into one buffer each with their offsets:
  Arrow's layout for a string or binary column, with no object per
  message (one copy per run of equal adjacent records).

A page that fails any check returns None and the caller takes the general
path, which decodes every record and names the one at fault. The log
entries a page holds are bounded by the caller (``PAGE_ENTRY_BYTES``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from broker_adapter import codec
from broker_adapter.errors import MalformedCommand
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

    def head(self, k: int) -> IndexPage:
        """The first ``k`` rows."""
        if k >= len(self.phys):
            return self
        return IndexPage(self.offsets[:k], self.phys[:k], self.sizes[:k], self.stamps[:k])


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


def ascending(phys: I64) -> bool:
    """CommitLog positions of a queue's messages only grow."""
    return bool(len(phys) < 2 or np.all(phys[1:] > phys[:-1]))


def _u16(buf: npt.NDArray[np.uint8], at: I64) -> I64:
    return (buf[at].astype(np.int64) << 8) | buf[at + 1]


def _u32(buf: npt.NDArray[np.uint8], at: I64) -> I64:
    return (_u16(buf, at) << 16) | _u16(buf, at + 2)


def page_records(
    entries: Sequence[tuple[Entry, int]], phys: I64, sizes: I64
) -> codec.RecordColumns | None:
    """The records at ``phys`` (``sizes`` bytes each) sliced out of
    ``entries`` as :class:`~broker_adapter.codec.RecordColumns` in their
    columnar form (numpy arrays; tags and bodies as Arrow's offsets and
    data; keys and properties flat, only records that have any adding to
    them) (:meth:`DurableBodies.page_entries`: each entry with the end
    of its run in ``phys``), or None when any of them fails a check (the
    caller then decodes them one by one, which names the one at fault).

    Every field before the keys (lengths, sharding key, tag) is read for
    all records at once; a record with keys or properties (the rare case)
    is decoded on its own, in full, with its CRC checked."""
    n = len(phys)
    if not n or np.any(sizes < codec.PLAIN_BODY_AT):
        return None
    # Join the entries; shift each record's CommitLog position to its place
    # in the joined buffer, and check that it ends inside its entry.
    ends = np.fromiter((k for _e, k in entries), np.int64, len(entries))
    if not len(ends) or ends[-1] != n:
        return None  # the entries do not cover the page
    counts = np.diff(ends, prepend=0)
    lens = np.fromiter((len(e.data) for e, _k in entries), np.int64, len(entries))
    bases = np.cumsum(lens) - lens  # each entry's start in the joined buffer
    epos = np.fromiter((e.pos for e, _k in entries), np.int64, len(entries))
    starts = phys + np.repeat(bases - epos, counts)
    rec_end = starts + sizes
    if np.any(rec_end > np.repeat(bases + lens, counts)) or np.any(
        starts < np.repeat(bases, counts)
    ):
        return None
    joined = b"".join(e.data for e, _k in entries)
    buf = np.frombuffer(joined, np.uint8)
    # The fixed fields and the next four lengths of every record: one gather
    # of n x 33 bytes, read as rows (the lengths are a plain record's; the
    # sharding key, tag, keys and properties move what follows them).
    at = starts[:, None] + np.arange(codec.PLAIN_BODY_AT, dtype=np.int64)
    hdr = buf[at].reshape(-1).view(HEADER_DTYPE)
    if not (np.all(hdr["size"] == sizes) and np.all(hdr["ver"] == codec.RECORD_VERSION)):
        return None
    # Sharding key, then tag: both a u16 length and the bytes.
    p_tag = starts + codec.RECORD_FIXED_SIZE + 2 + hdr["n_shard"].astype(np.int64)
    if np.any(p_tag + 2 > rec_end):
        return None
    n_tag = _u16(buf, p_tag)
    tag_at = p_tag + 2
    p_keys = tag_at + n_tag
    if np.any(p_keys + 8 > rec_end):  # key count, property count, body length
        return None
    n_keys = _u16(buf, p_keys)
    n_props = _u16(buf, p_keys + 2)
    body_len = np.zeros(n, np.int64)
    simple = (n_keys == 0) & (n_props == 0)
    body_at = p_keys + 8
    body_len[simple] = _u32(buf, p_keys[simple] + 4)
    key_counts = np.zeros(n, np.int64)
    prop_counts = np.zeros(n, np.int64)
    keys: list[str] = []
    prop_keys: list[str] = []
    prop_values: list[str] = []
    for i in np.flatnonzero(~simple).tolist():
        rec = joined[int(starts[i]) : int(rec_end[i])]
        try:
            r = codec.decode_record(rec)
        except MalformedCommand:
            return None
        keys += r.keys
        key_counts[i] = len(r.keys)
        for k, v in r.properties:
            prop_keys.append(k)
            prop_values.append(v)
        prop_counts[i] = len(r.properties)
        body_len[i] = len(r.body)
        body_at[i] = int(starts[i]) + codec.body_at(rec)
    if np.any(body_at + body_len > rec_end):
        return None
    # numpy arrays stand where RecordColumns' annotations say lists: they
    # index and slice alike, and pyarrow takes either.
    columns: dict[str, Any] = {
        "born_ts_ms": hdr["born"].astype(np.int64),
        "tag_valid": n_tag > 0,
        "tag_offsets": _offsets(n_tag),
        "tag_data": _gather(buf, tag_at, n_tag),
        "key_offsets": _offsets(key_counts),
        "keys": keys,
        "prop_offsets": _offsets(prop_counts),
        "prop_keys": prop_keys,
        "prop_values": prop_values,
        "body_offsets": _offsets(body_len),
        "body_data": _gather(buf, body_at, body_len),
    }
    return codec.RecordColumns(**columns)


def _offsets(lengths: I64) -> npt.NDArray[np.int32]:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out.astype(np.int32)


def _gather(buf: npt.NDArray[np.uint8], at: I64, lengths: I64) -> bytes:
    """The byte ranges ``[at, at + lengths)``, back to back. A run of
    ranges of one length at one stride (a producer's batch of equal
    messages, each record right after the previous one) is a strided 2-D
    view of the buffer whose rows are the ranges: one copy for the whole
    run. Pages of many short runs slice each range instead."""
    n = len(at)
    if not n:
        return b""
    step = np.diff(at)
    # a run breaks before record i unless its length is the previous one's
    # and the step to it is the step before (or i is the second record)
    joins = np.ones(n, np.bool_)
    joins[0] = False
    joins[1:] = (lengths[1:] == lengths[:-1]) & (step > 0)
    joins[2:] &= step[1:] == step[:-1]
    starts = np.flatnonzero(~joins)
    if len(starts) * 8 > n:  # short runs: a slice per range
        mv = buf.data
        lo, hi = at.tolist(), (at + lengths).tolist()
        return b"".join([mv[a:b] for a, b in zip(lo, hi, strict=True)])
    parts: list[bytes] = []
    bounds = [*starts.tolist(), n]
    for a, b in itertools.pairwise(bounds):
        length, first = int(lengths[a]), int(at[a])
        if b - a == 1:
            parts.append(buf[first : first + length].tobytes())
            continue
        stride = int(at[a + 1] - at[a])
        rows = np.lib.stride_tricks.as_strided(
            buf[first:], shape=(b - a, length), strides=(stride, 1), writeable=False
        )
        parts.append(rows.tobytes())
    return b"".join(parts)


def as_list(values: Any) -> list[Any]:
    """A column as a list of Python values (for comparisons and JSON)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)
