"""Harness histories: a versioned JSONL format, a writer and a validating reader.

Theory of operation
-------------------
A history is one JSON object per line, appended while a run goes on and read
back offline by the checkers. Clients record every operation twice: an
``invoke`` line when they send the request and a completion line (``ok``,
``fail`` or ``info``) when they know the outcome. ``info`` means the outcome
is unknown (timeout, dropped connection): the operation may or may not have
taken effect, at any time after its invoke. ``fail`` means it certainly did
not take effect. An invoke that has no completion when the file ends counts
as ``info``. Nemeses record fault windows as ``start`` / ``stop`` pairs.

Schema, version 1 (``SCHEMA_VERSION``)
--------------------------------------
Line 1 may be a header (the :class:`Writer` always writes one)::

    {"type": "header", "schema": "jepsen_like.history", "version": 1, ...}

Any other keys in the header are free-form run metadata. A file without a
header is read as version 1; a header with another version is rejected.

Operation records (every line but the header and nemesis lines)::

    {"type": "invoke"|"ok"|"fail"|"info",
     "process": int >= 0,          # one logical client; at most one outstanding op
     "f": "produce"|"read"|"poll"|"commit_offset"|"seek"|"final_read",
     "key": "topic/queue",         # the queue the op addresses
     "time_ns": int,               # monotonic clock of the harness
     "index": int,                 # strictly increasing across the file
     ... f-specific fields below, all optional unless marked}

* ``produce``: ``value`` (str or int, required on invoke: the harness makes
  values unique per key), ``offset`` (the acknowledged queue offset, required
  on ``ok``), ``producer_id`` / ``sequence`` (idempotent producers).
* ``read`` and ``final_read``: ``offset`` (first queue offset asked for,
  required on invoke), ``consistency`` (``"committed"`` (default) or
  ``"linearizable"``), ``limit`` (most messages asked for), and on ``ok``:
  ``value``: the result, a list of ``[offset, value]`` pairs, expected to be
  contiguous from ``offset`` (``[]``: nothing there yet; a server that breaks
  that is an anomaly for the checkers, not a malformed history),
  and ``end`` (bool: the result reaches the end of the visible log;
  ``false`` promises an entry past the last one returned, or past
  ``offset`` for an empty result, which no log can give). When
  ``end`` is absent it is derived: ``true`` when fewer than ``limit``
  messages came back, or when an unlimited read came back empty. A client
  whose reads can also stop at a byte limit must set ``end`` itself.
* ``poll``: a consumer-group member's fetch; ``group`` (str); on ``ok``:
  ``value`` as for reads (the offsets the consumer received).
* ``commit_offset``: ``group``, ``offset`` (the next offset to consume;
  required on invoke).
* ``seek``: ``offset`` (required on invoke): the consumer's position is reset
  explicitly (seek or group reset); the next poll of that process on that
  key may start there.

Completion lines repeat ``process`` and ``f``; their fields override those of
the invoke (so ``offset`` of a produce comes from its ``ok``). ``error``
(str) may describe a ``fail`` / ``info``. Fields this version does not name
(``node``, ``msg_id``, ...) are allowed and ignored.

Nemesis records::

    {"type": "nemesis", "f": "start"|"stop",
     "kind": "kill"|"pause"|"partition"|"clock"|"corrupt",
     "targets": [node, ...], "time_ns": int, "index": int}

A ``stop`` closes the earliest open window of the same kind. A window still
open at the end of the file has ``stop_ns = None``.

The reader validates every line and raises :class:`HistoryError` naming the
line number; it never lets a ``KeyError`` or ``JSONDecodeError`` escape.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Literal, TypeGuard

import orjson

SCHEMA_NAME: Final = "jepsen_like.history"
SCHEMA_VERSION: Final = 1

OP_TYPES: Final = frozenset({"invoke", "ok", "fail", "info"})
OP_FS: Final = frozenset({"produce", "read", "poll", "commit_offset", "seek", "final_read"})
NEMESIS_KINDS: Final = frozenset(
    {"kill", "pause", "partition", "clock", "corrupt", "power", "disk"}
)
CONSISTENCIES: Final = frozenset({"committed", "linearizable"})
READ_FS: Final = frozenset({"read", "final_read", "poll"})

Status = Literal["ok", "fail", "info"]
Value = str | int


class HistoryError(ValueError):
    """A history file is malformed; ``line`` is 1-based (0: the whole file)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


@dataclass(frozen=True, slots=True)
class Operation:
    """One invoke paired with its completion.

    ``status`` is ``info`` also for an invoke never completed (then
    ``complete_ns`` and ``complete_index`` are ``None``). ``results`` holds
    the ``[offset, value]`` pairs of an ``ok`` read, final read or poll.
    ``id`` is the op's position in :attr:`History.ops` (invoke order).
    """

    id: int
    process: int
    f: str
    key: str
    status: Status
    invoke_ns: int
    complete_ns: int | None
    invoke_index: int
    complete_index: int | None
    value: Value | None = None
    offset: int | None = None
    results: tuple[tuple[int, Value], ...] = ()
    consistency: str = "committed"
    limit: int | None = None
    end: bool | None = None
    producer_id: int | None = None
    sequence: int | None = None
    group: str | None = None
    error: str | None = None
    invoke_line: int = 0

    @property
    def reached_end(self) -> bool:
        """Whether an ``ok`` read claims its result reaches the end of the log."""
        if self.end is not None:
            return self.end
        if self.limit is not None:
            return len(self.results) < self.limit
        return not self.results

    def to_json(self) -> dict[str, Any]:
        """A compact description for verdicts and reports."""
        out: dict[str, Any] = {
            "process": self.process,
            "f": self.f,
            "key": self.key,
            "type": self.status,
            "invoke_index": self.invoke_index,
            "complete_index": self.complete_index,
            "invoke_ns": self.invoke_ns,
            "complete_ns": self.complete_ns,
        }
        if self.value is not None:
            out["value"] = self.value
        if self.offset is not None:
            out["offset"] = self.offset
        if self.f in READ_FS and self.status == "ok":
            out["results"] = [list(r) for r in self.results]
        if self.f in ("read", "final_read"):
            out["consistency"] = self.consistency
        return out


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """One nemesis fault, from its ``start`` to its ``stop`` (None: never healed)."""

    kind: str
    targets: tuple[str | int, ...]
    start_ns: int
    stop_ns: int | None
    start_index: int
    stop_index: int | None


@dataclass(frozen=True, slots=True)
class History:
    ops: tuple[Operation, ...]
    faults: tuple[FaultWindow, ...]
    header: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> list[str]:
        return sorted({op.key for op in self.ops})

    def by_key(self) -> dict[str, list[Operation]]:
        out: dict[str, list[Operation]] = {}
        for op in self.ops:
            out.setdefault(op.key, []).append(op)
        return out


# --------------------------------------------------------------------------- writer


class Writer:
    """Appends records to a JSONL history, one flushed line per record.

    Thread-safe; no fsync (a history only needs to survive the harness, not
    the machine). ``clock`` defaults to ``time.monotonic_ns``; every record
    method also takes an explicit ``time_ns``. ``path`` may be an open text
    stream (tests). The header is written when the file is new or empty; an
    existing file is continued with the next ``index``.
    """

    def __init__(
        self,
        path: str | Path | IO[str],
        *,
        metadata: dict[str, Any] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._index = 0
        self._outstanding: dict[int, str] = {}
        if isinstance(path, str | Path):
            # Owned for the writer's lifetime; close() releases it.
            self._fh: IO[str] = Path(path).open("a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._owns = True
            fresh = self._fh.tell() == 0
            if not fresh:
                self._index = _last_index(Path(path)) + 1
        else:
            self._fh = path
            self._owns = False
            fresh = True
        if fresh:
            header = {"type": "header", "schema": SCHEMA_NAME, "version": SCHEMA_VERSION}
            header.update(metadata or {})
            self._write_line(header)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._owns and not self._fh.closed:
                self._fh.close()

    def _write_line(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n")

    def _record(self, record: dict[str, Any], time_ns: int | None) -> dict[str, Any]:
        with self._lock:
            record["time_ns"] = self._clock() if time_ns is None else time_ns
            record["index"] = self._index
            self._index += 1
            self._write_line(record)
            return record

    def invoke(
        self, process: int, f: str, key: str, *, time_ns: int | None = None, **fields: Any
    ) -> dict[str, Any]:
        """Record an invoke; raises ``ValueError`` if ``process`` has one outstanding."""
        if f not in OP_FS:
            raise ValueError(f"unknown f {f!r}")
        with self._lock:
            if process in self._outstanding:
                raise ValueError(f"process {process} already has an outstanding op")
            self._outstanding[process] = f
        rec = {"type": "invoke", "process": process, "f": f, "key": key, **fields}
        return self._record(rec, time_ns)

    def complete(
        self,
        type_: Status,
        process: int,
        *,
        key: str | None = None,
        time_ns: int | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Record the completion of ``process``'s outstanding op."""
        if type_ not in ("ok", "fail", "info"):
            raise ValueError(f"unknown completion type {type_!r}")
        with self._lock:
            f = self._outstanding.pop(process, None)
        if f is None:
            raise ValueError(f"process {process} has no outstanding op")
        rec: dict[str, Any] = {"type": type_, "process": process, "f": f}
        if key is not None:
            rec["key"] = key
        rec.update(fields)
        return self._record(rec, time_ns)

    def ok(self, process: int, **fields: Any) -> dict[str, Any]:
        return self.complete("ok", process, **fields)

    def fail(self, process: int, **fields: Any) -> dict[str, Any]:
        return self.complete("fail", process, **fields)

    def info(self, process: int, **fields: Any) -> dict[str, Any]:
        return self.complete("info", process, **fields)

    def nemesis(
        self,
        f: Literal["start", "stop"],
        kind: str,
        targets: Iterable[str | int],
        *,
        time_ns: int | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        if f not in ("start", "stop") or kind not in NEMESIS_KINDS:
            raise ValueError(f"bad nemesis record f={f!r} kind={kind!r}")
        rec = {"type": "nemesis", "f": f, "kind": kind, "targets": list(targets), **fields}
        return self._record(rec, time_ns)


def _last_index(path: Path) -> int:
    last = -1
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("index"), int):
                last = max(last, rec["index"])
    return last


# --------------------------------------------------------------------------- reader


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_value(x: object) -> TypeGuard[str | int]:
    return isinstance(x, str) or _is_int(x)


class _Pending:
    __slots__ = ("fields", "index", "line", "time_ns")

    def __init__(self, fields: dict[str, Any], line: int, time_ns: int, index: int) -> None:
        self.fields = fields
        self.line = line
        self.time_ns = time_ns
        self.index = index


_OPTIONAL_FIELDS: Final[dict[str, Callable[[object], bool]]] = {
    "value": lambda x: x is None or _is_value(x) or isinstance(x, list),
    "offset": lambda x: x is None or (_is_int(x) and x >= 0),
    "consistency": lambda x: isinstance(x, str) and x in CONSISTENCIES,
    "limit": lambda x: x is None or (_is_int(x) and x > 0),
    "end": lambda x: x is None or isinstance(x, bool),
    "producer_id": lambda x: x is None or _is_int(x),
    "sequence": lambda x: x is None or _is_int(x),
    "group": lambda x: x is None or isinstance(x, str),
    "error": lambda x: x is None or isinstance(x, str),
    "key": lambda x: isinstance(x, str) and bool(x),
}


def _parse_results(line: int, raw: object) -> tuple[tuple[int, Value], ...]:
    if not isinstance(raw, list):
        raise HistoryError(line, "an ok read/poll needs 'value': a list of [offset, value] pairs")
    out: list[tuple[int, Value]] = []
    for i, pair in enumerate(raw):
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not _is_int(pair[0])
            or pair[0] < 0
            or not _is_value(pair[1])
        ):
            raise HistoryError(line, f"result #{i} is not an [offset >= 0, str|int] pair: {pair!r}")
        out.append((pair[0], pair[1]))
    return tuple(out)


class Reader:
    """Validates and pairs the records of one history file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> History:
        try:
            with self.path.open(encoding="utf-8") as fh:
                return self.parse(fh)
        except OSError as e:
            raise HistoryError(0, f"cannot read {self.path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise HistoryError(0, f"{self.path} is not UTF-8: {e.reason}") from None

    @staticmethod
    def parse(lines: Iterable[str]) -> History:
        ops: list[Operation | None] = []
        pending: dict[int, tuple[int, _Pending]] = {}
        open_faults: dict[str, list[tuple[tuple[str | int, ...], int, int]]] = {}
        faults: list[FaultWindow] = []
        header: dict[str, Any] = {}
        last_index: int | None = None
        lineno = 0
        for lineno, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                rec = orjson.loads(text)
            except ValueError as e:
                raise HistoryError(
                    lineno, f"not valid JSON ({e.args[0] if e.args else e})"
                ) from None
            if not isinstance(rec, dict):
                raise HistoryError(lineno, "a record must be a JSON object")
            rtype = rec.get("type")
            if rtype == "header":
                if ops or faults or last_index is not None:
                    raise HistoryError(lineno, "the header must be the first record")
                if rec.get("schema", SCHEMA_NAME) != SCHEMA_NAME:
                    raise HistoryError(lineno, f"unknown schema {rec.get('schema')!r}")
                if rec.get("version") != SCHEMA_VERSION:
                    raise HistoryError(
                        lineno,
                        f"unsupported history version {rec.get('version')!r} "
                        f"(this reader knows {SCHEMA_VERSION})",
                    )
                header = rec
                continue
            t = rec.get("time_ns")
            idx = rec.get("index")
            if not _is_int(t):
                raise HistoryError(lineno, "'time_ns' must be an integer")
            if not _is_int(idx):
                raise HistoryError(lineno, "'index' must be an integer")
            if last_index is not None and idx <= last_index:
                raise HistoryError(lineno, f"'index' {idx} is not greater than {last_index}")
            last_index = idx
            if rtype == "nemesis":
                _nemesis(lineno, rec, t, idx, open_faults, faults)
                continue
            if not isinstance(rtype, str) or rtype not in OP_TYPES:
                raise HistoryError(lineno, f"unknown record type {rtype!r}")
            proc = rec.get("process")
            if not _is_int(proc) or proc < 0:
                raise HistoryError(lineno, "'process' must be an integer >= 0")
            f = rec.get("f")
            if not isinstance(f, str) or f not in OP_FS:
                raise HistoryError(lineno, f"unknown f {f!r} (expected one of {sorted(OP_FS)})")
            for name, ok in _OPTIONAL_FIELDS.items():
                if name in rec and not ok(rec[name]):
                    raise HistoryError(lineno, f"bad {name!r}: {rec[name]!r}")
            if rtype == "invoke":
                if proc in pending:
                    raise HistoryError(
                        lineno,
                        f"process {proc} invokes while its op from line "
                        f"{pending[proc][1].line} is outstanding",
                    )
                if "key" not in rec:
                    raise HistoryError(lineno, "an invoke needs 'key'")
                if f == "produce" and not _is_value(rec.get("value")):
                    raise HistoryError(lineno, "a produce invoke needs 'value' (str or int)")
                if (
                    f in ("read", "final_read", "seek", "commit_offset")
                    and rec.get("offset") is None
                ):
                    raise HistoryError(lineno, f"a {f} invoke needs 'offset'")
                pending[proc] = (len(ops), _Pending(rec, lineno, t, idx))
                ops.append(None)
                continue
            if proc not in pending:
                raise HistoryError(
                    lineno, f"{rtype} for process {proc} without an outstanding invoke"
                )
            slot, inv = pending.pop(proc)
            if inv.fields["f"] != f:
                raise HistoryError(
                    lineno,
                    f"{rtype} has f={f!r} but the invoke on line {inv.line} has f={inv.fields['f']!r}",
                )
            if t < inv.time_ns:
                raise HistoryError(
                    lineno, f"completion time_ns {t} is before its invoke's {inv.time_ns}"
                )
            if "key" in rec and rec["key"] != inv.fields["key"]:
                raise HistoryError(lineno, f"key {rec['key']!r} differs from the invoke's")
            ops[slot] = _build(lineno, slot, inv, rec, rtype, t, idx)
        for slot, inv in pending.values():
            ops[slot] = _build(inv.line, slot, inv, {}, "info", None, None)
        for kind, windows in open_faults.items():
            for targets, start_ns, start_index in windows:
                faults.append(FaultWindow(kind, targets, start_ns, None, start_index, None))
        faults.sort(key=lambda w: w.start_index)
        done = tuple(op for op in ops if op is not None)
        if len(done) != len(ops):  # pragma: no cover - every slot is filled above
            raise HistoryError(0, "internal error: unpaired operation")
        return History(done, tuple(faults), header)


def _nemesis(
    lineno: int,
    rec: dict[str, Any],
    t: int,
    idx: int,
    open_faults: dict[str, list[tuple[tuple[str | int, ...], int, int]]],
    faults: list[FaultWindow],
) -> None:
    f = rec.get("f")
    kind = rec.get("kind")
    targets = rec.get("targets", [])
    if f not in ("start", "stop"):
        raise HistoryError(lineno, f"nemesis 'f' must be 'start' or 'stop', got {f!r}")
    if not isinstance(kind, str) or kind not in NEMESIS_KINDS:
        raise HistoryError(
            lineno, f"unknown nemesis kind {kind!r} (expected one of {sorted(NEMESIS_KINDS)})"
        )
    if not isinstance(targets, list) or not all(_is_value(x) for x in targets):
        raise HistoryError(lineno, "nemesis 'targets' must be a list of node names or ids")
    if f == "start":
        open_faults.setdefault(kind, []).append((tuple(targets), t, idx))
        return
    windows = open_faults.get(kind)
    if not windows:
        raise HistoryError(lineno, f"nemesis stop of {kind!r} without a start")
    start_targets, start_ns, start_index = windows.pop(0)
    faults.append(FaultWindow(kind, start_targets, start_ns, t, start_index, idx))


def _build(
    lineno: int,
    slot: int,
    inv: _Pending,
    comp: dict[str, Any],
    status: str,
    t: int | None,
    idx: int | None,
) -> Operation:
    merged = dict(inv.fields)
    for k, v in comp.items():
        if k in ("type", "time_ns", "index"):
            continue
        if k == "value" and merged["f"] == "produce" and v is None:
            continue
        merged[k] = v
    f = merged["f"]
    results: tuple[tuple[int, Value], ...] = ()
    value = merged.get("value")
    if status == "ok" and f in READ_FS:
        results = _parse_results(lineno, merged.get("value", []))
        value = None
    elif f == "produce":
        if not _is_value(value):
            raise HistoryError(lineno, "a produce needs 'value' (str or int)")
        if merged.get("value") != inv.fields.get("value"):
            raise HistoryError(lineno, "a produce completion changes the invoked value")
        if status == "ok" and merged.get("offset") is None:
            raise HistoryError(lineno, "an ok produce needs the acknowledged 'offset'")
    elif value is not None and not _is_value(value):
        raise HistoryError(lineno, f"'value' of a {f} must be a str or an int")
    if f != "produce" and f not in READ_FS:
        value = value if _is_value(value) else None
    return Operation(
        id=slot,
        process=merged["process"],
        f=f,
        key=merged["key"],
        status=status,  # type: ignore[arg-type]
        invoke_ns=inv.time_ns,
        complete_ns=t,
        invoke_index=inv.index,
        complete_index=idx,
        value=value if f not in READ_FS else None,
        offset=merged.get("offset"),
        results=results,
        consistency=merged.get("consistency", "committed"),
        limit=merged.get("limit"),
        end=merged.get("end"),
        producer_id=merged.get("producer_id"),
        sequence=merged.get("sequence"),
        group=merged.get("group"),
        error=merged.get("error"),
        invoke_line=inv.line,
    )


def read_history(path: str | Path) -> History:
    """Read and validate ``path``; raises :class:`HistoryError` on any malformed line."""
    return Reader(path).read()


def parse_history(lines: Iterable[str]) -> History:
    """Like :func:`read_history` for lines already in memory."""
    return Reader.parse(lines)
