"""Options of the ``dledger`` Spark source, parsed once and validated.

The names and meanings follow Spark's Kafka source so that a query can move
between the two by changing the format and the connection options:

========================  =======================================================
``endpoints``             ``host:port[,host:port...]`` of any nodes (required)
``topic`` / ``subscribe`` one topic or a comma-separated list (``topics`` too)
``startingOffsets``       ``earliest``, ``latest`` or JSON ``{"t": {"0": 12}}``
                          with -2 = earliest and -1 = latest per queue; batch
                          default ``earliest``, streaming default ``latest``
``endingOffsets``         batch only: ``latest`` (default) or JSON as above
``maxOffsetsPerTrigger``  streaming: at most this many messages per micro-batch,
                          split over the queues in proportion to their backlog
``failOnDataLoss``        ``true`` (default): a needed offset below a queue's
                          min offset (retention) or a vanished topic is an
                          error; ``false``: skip the gap with a warning
``minPartitions``         batch: split queue ranges until there are at least
                          this many input partitions
``fetchFormat``           ``arrow`` (default): pages as Arrow IPC streams;
                          ``json``: the JSON pages (debugging, comparisons)
``fetchMaxMessages``      messages per HTTP request (Arrow: 1..10000, default
                          10000; JSON: 1..1000, default 1000); a page also
                          stops at 8 MiB of records
``requestTimeoutMs``      one HTTP request (default 10000)
``retryForMs``            how long a read keeps trying other endpoints before it
                          fails (default 60000)
========================  =======================================================

Queues a JSON offset map leaves out start at ``earliest`` (starting) or end at
``latest`` (ending); Kafka instead demands every partition. Unknown options
are rejected so that a typo is not silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

JSON_MAX_MESSAGES: Final = 1000  # the server's caps on a page (http_api)
ARROW_MAX_MESSAGES: Final = 10_000

EARLIEST: Final = -2
LATEST: Final = -1

QueueKey = tuple[str, int]
# "earliest" / "latest", or per topic and queue an offset, EARLIEST or LATEST
OffsetSpec = str | dict[str, dict[int, int]]

KNOWN: Final = frozenset(
    {
        "endpoints",
        "topic",
        "topics",
        "subscribe",
        "startingoffsets",
        "endingoffsets",
        "maxoffsetspertrigger",
        "failondataloss",
        "minpartitions",
        "fetchmaxmessages",
        "fetchformat",
        "requesttimeoutms",
        "retryforms",
        "path",  # Spark adds it for load(path); we ignore it
    }
)


class PipelineError(Exception):
    """Base class of the pipeline's errors."""


class OptionError(PipelineError, ValueError):
    """A source option is missing, unknown or malformed (the message names it)."""


class DataLossError(PipelineError):
    """Offsets that a query needs are gone (retention, deleted topic) and
    ``failOnDataLoss`` is true."""


class SourceUnavailableError(PipelineError):
    """No endpoint could serve a request within ``retryForMs``."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    endpoints: tuple[str, ...]
    topics: tuple[str, ...]
    starting: OffsetSpec
    ending: OffsetSpec | None
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    min_partitions: int
    fetch_max_messages: int
    fetch_arrow: bool
    request_timeout_s: float
    retry_for_s: float

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        opts = {k.lower(): str(v) for k, v in options.items()}
        unknown = sorted(set(opts) - KNOWN)
        if unknown:
            raise OptionError(f"unknown option(s) for format 'dledger': {', '.join(unknown)}")
        endpoints = _csv(opts.get("endpoints", ""))
        if not endpoints:
            raise OptionError("option 'endpoints' is required: host:port[,host:port...]")
        for e in endpoints:
            host, sep, port = e.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise OptionError(f"option 'endpoints': {e!r} is not host:port")
        given = [k for k in ("topic", "topics", "subscribe") if k in opts]
        if len(given) != 1:
            raise OptionError("give exactly one of the options 'topic', 'topics', 'subscribe'")
        topics = tuple(dict.fromkeys(_csv(opts[given[0]])))
        if not topics:
            raise OptionError(f"option {given[0]!r} names no topic")
        starting = _offset_spec(
            opts.get("startingoffsets", "latest" if streaming else "earliest"),
            "startingOffsets",
            topics,
        )
        ending: OffsetSpec | None = None
        if "endingoffsets" in opts:
            if streaming:
                raise OptionError("option 'endingOffsets' is for batch queries only")
            ending = _offset_spec(opts["endingoffsets"], "endingOffsets", topics)
        elif not streaming:
            ending = "latest"
        if not streaming:
            # as in the Kafka source: a batch query is a fixed range read from the start
            if starting == "latest" or _has(starting, LATEST):
                raise OptionError("startingOffsets 'latest' (-1) is not allowed in batch queries")
            if ending == "earliest" or _has(ending, EARLIEST):
                raise OptionError("endingOffsets 'earliest' (-2) is not allowed in batch queries")
        fmt = opts.get("fetchformat", "arrow").strip().lower()
        if fmt not in ("arrow", "json"):
            raise OptionError(f"option 'fetchFormat' must be 'arrow' or 'json', got {fmt!r}")
        cap = ARROW_MAX_MESSAGES if fmt == "arrow" else JSON_MAX_MESSAGES
        mopt = opts.get("maxoffsetspertrigger")
        max_per_trigger = None if mopt is None else _int(mopt, "maxOffsetsPerTrigger", 1)
        return cls(
            endpoints=endpoints,
            topics=topics,
            starting=starting,
            ending=ending,
            max_offsets_per_trigger=max_per_trigger,
            fail_on_data_loss=_bool(opts.get("failondataloss", "true"), "failOnDataLoss"),
            min_partitions=_int(opts.get("minpartitions", "1"), "minPartitions", 1),
            fetch_max_messages=min(
                cap, _int(opts.get("fetchmaxmessages", str(cap)), "fetchMaxMessages", 1)
            ),
            fetch_arrow=fmt == "arrow",
            request_timeout_s=_int(opts.get("requesttimeoutms", "10000"), "requestTimeoutMs", 1)
            / 1000,
            retry_for_s=_int(opts.get("retryforms", "60000"), "retryForMs", 0) / 1000,
        )


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _int(s: str, name: str, lo: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise OptionError(f"option {name!r} must be an integer, got {s!r}") from None
    if v < lo:
        raise OptionError(f"option {name!r} must be >= {lo}, got {v}")
    return v


def _bool(s: str, name: str) -> bool:
    low = s.strip().lower()
    if low not in ("true", "false"):
        raise OptionError(f"option {name!r} must be 'true' or 'false', got {s!r}")
    return low == "true"


def _has(spec: OffsetSpec | None, marker: int) -> bool:
    return isinstance(spec, dict) and any(
        o == marker for queues in spec.values() for o in queues.values()
    )


def _offset_spec(raw: str, name: str, topics: tuple[str, ...]) -> OffsetSpec:
    s = raw.strip()
    if s.lower() in ("earliest", "latest"):
        return s.lower()
    try:
        doc = json.loads(s)
    except ValueError:
        raise OptionError(
            f"option {name!r} must be 'earliest', 'latest' or JSON "
            f'{{"topic": {{"queue": offset}}}}, got {raw!r}'
        ) from None
    if not isinstance(doc, dict):
        raise OptionError(f"option {name!r}: the JSON must be an object of topics")
    out: dict[str, dict[int, int]] = {}
    for topic, queues in doc.items():
        if topic not in topics:
            raise OptionError(f"option {name!r} names topic {topic!r}, which is not subscribed")
        if not isinstance(queues, dict):
            raise OptionError(f"option {name!r}: topic {topic!r} needs an object of queues")
        per: dict[int, int] = {}
        for q, off in queues.items():
            if not (isinstance(q, str) and q.isdigit()):
                raise OptionError(f"option {name!r}: {topic}/{q!r} is not a queue number")
            if not isinstance(off, int) or isinstance(off, bool) or off < EARLIEST:
                raise OptionError(
                    f"option {name!r}: {topic}/{q} must be an offset >= 0, -2 or -1, got {off!r}"
                )
            per[int(q)] = off
        out[topic] = per
    return out


def offsets_to_json(offsets: Mapping[QueueKey, int]) -> dict[str, dict[str, int]]:
    """``{(topic, queue): offset}`` as the checkpointed JSON shape, keys in a
    fixed order (topic name, then queue number) so equal maps print alike."""
    out: dict[str, dict[str, int]] = {}
    for (topic, queue), off in sorted(offsets.items()):
        out.setdefault(topic, {})[str(queue)] = off
    return out


def offsets_from_json(doc: Mapping[str, Mapping[str, int]]) -> dict[QueueKey, int]:
    return {(t, int(q)): int(o) for t, queues in doc.items() for q, o in queues.items()}
