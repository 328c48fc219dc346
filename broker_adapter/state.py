"""The broker: RocketMQ CommitLog semantics as a deterministic state machine.

Theory of operation
-------------------
:class:`BrokerState` is fed committed Raft entries, in log order, and
nothing else: no clock, no randomness, no I/O. Every replica (learners
included) that applied the same entries holds the same state, so
:meth:`BrokerState.snapshot` returns the same bytes on each of them.

* **Offsets.** Entry ``i`` occupies ``[pos, pos + len(data))`` of the
  CommitLog. A produce entry holds message records back to back; the record
  at byte ``o`` of the entry has physical offset ``pos + o`` and its own
  length as size. Each message gets the next queue offset of its
  (topic, queue). The **confirm offset** is the end of the last applied
  entry (of any type); it never moves backwards (asserted), and since only
  committed entries reach ``apply`` it never passes the commit index.
* **Time.** The leader stamps every command with its wall clock when it
  proposes; ``now`` is the largest stamp applied so far (so it never goes
  backwards even across leaders with skewed clocks). Store timestamps,
  producer expiry and age retention all use ``now``, never the local clock.
* **Errors.** A command that cannot apply (unknown topic, sequence gap...)
  changes nothing and its :class:`BrokerError` is *returned* as the entry's
  result, identically on every replica; ``apply`` raises only on a broken
  invariant (entries out of order, the CommitLog moving backwards).
* **Idempotent producers.** State per producer id: epoch and last activity;
  per (topic, queue): the last sequence and a window of the last
  ``DEDUP_WINDOW`` batches with their acknowledgements. A batch whose first
  sequence is in the window is answered with the original offsets and not
  stored again. An idempotent batch goes to one queue (like a Kafka
  producer batch to one partition): its explicit queue, its sharding key's
  hash, or else the producer id's hash, so a retry lands in the same queue.
* **Retention** drops the oldest messages (by physical offset) while the
  total stored bytes exceed the limit, or by age at each sweep; queue
  offsets never change, the queue's min offset just advances.
"""

from __future__ import annotations

import heapq
import importlib
import struct
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import overload

from broker_adapter import codec
from broker_adapter.bodies import (
    Bodies,
    BodyMissing,
    DurableBodies,
    IndexEntry,
    MemoryBodies,
    RecordNotHere,
)
from broker_adapter.codec import (
    Command,
    CommandKind,
    CommitOffsets,
    Produce,
    Record,
    RecordColumns,
    RegisterProducer,
    ResetGroup,
    ResetMode,
    SetRetention,
    TopicCmd,
    dump_value,
    load_value,
)
from broker_adapter.errors import (
    BrokerError,
    DuplicateSequence,
    InvalidArgument,
    InvalidQueue,
    MalformedCommand,
    OffsetOutOfRange,
    ProducerFenced,
    SequenceGap,
    TopicExists,
    UnknownProducer,
    UnknownTopic,
)
from dledger.core.types import Entry, EntryType
from dledger.errors import CatchingUp, InvariantViolation, StorageCorrupted
from dledger.statemachine import big_endian_bytes, from_big_endian

DEDUP_WINDOW = 5
DEFAULT_PRODUCER_IDLE_MS = 7 * 24 * 3600 * 1000
SWEEP_INTERVAL_MS = 1000
# Index entries size retention reads from a queue's head at a time.
RETENTION_CHUNK = 64
MAX_SCAN = 10_000  # entries a filtered read looks at before returning
SNAPSHOT_MAGIC = b"BSNP"
SNAPSHOT_VERSION = 1  # every retained record in the snapshot
# The ConsumeQueue without records: a log-backed store's (records stay in the
# log entries; an installing replica gets them by replication).
SNAPSHOT_VERSION_INDEX_ONLY = 2
CHECKPOINT_MAGIC = b"BCKP"
_SNAP_HDR = struct.Struct(">4sBI")


def _load_blob(
    data: bytes, magic: bytes, what: str, versions: tuple[int, ...] = (SNAPSHOT_VERSION,)
) -> dict[object, object]:
    """The value of a snapshot or checkpoint blob (header: magic, version,
    CRC32 of the rest); raises MalformedCommand."""
    if len(data) < _SNAP_HDR.size:
        raise MalformedCommand(f"{what} is truncated")
    got, version, crc = _SNAP_HDR.unpack_from(data, 0)
    if got != magic:
        raise MalformedCommand(f"not a broker {what}")
    if version not in versions:
        raise MalformedCommand(f"{what} version {version} is not supported")
    payload = data[_SNAP_HDR.size :]
    if zlib.crc32(payload) != crc:
        raise MalformedCommand(f"{what} CRC mismatch")
    v, end = load_value(payload)
    if end != len(payload) or not isinstance(v, dict):
        raise MalformedCommand(f"{what} has trailing bytes or a wrong shape")
    return v


@dataclass(frozen=True, slots=True)
class MessageAck:
    queue: int
    queue_offset: int
    phys_offset: int
    size: int
    msg_id: str


AckRow = tuple[int, int, int, int]  # (queue, queue offset, physical offset, size)


class Acks(Sequence[MessageAck]):
    """The acknowledgements of one produce batch, in message order: a
    sequence of :class:`MessageAck`, built only when someone looks.

    Apply runs on every replica, but only the leader's answer is read (and
    only while its client waits), so apply records what it already has (the
    scanned record heads of the entry and each message's queue offset) and
    rows, message ids and ``MessageAck`` objects are made on first use.
    Equal when the rows and the broker's id prefix are equal, whichever way
    they were built (apply, or a snapshot's dedup window)."""

    __slots__ = ("_base", "_heads", "_id_prefix", "_qoffs", "_rows")

    def __init__(self, id_prefix: str, rows: tuple[AckRow, ...]) -> None:
        self._id_prefix = id_prefix
        self._rows: tuple[AckRow, ...] | None = rows
        self._base = 0
        self._heads: list[tuple[int, int, int, int]] | None = None
        self._qoffs: list[int] | None = None

    @classmethod
    def of_entry(
        cls,
        id_prefix: str,
        base_pos: int,
        heads: list[tuple[int, int, int, int]],
        qoffs: list[int],
    ) -> Acks:
        """``heads[k]`` = (offset in the entry, size, queue, tag hash) of
        message ``k``; ``qoffs[k]`` its queue offset; the entry at ``base_pos``."""
        a = cls(id_prefix, ())
        a._rows = None
        a._base, a._heads, a._qoffs = base_pos, heads, qoffs
        return a

    def rows(self) -> tuple[AckRow, ...]:
        rows = self._rows
        if rows is None:
            assert self._heads is not None and self._qoffs is not None
            b = self._base
            rows = self._rows = tuple(
                [(h[2], qo, b + h[0], h[1]) for h, qo in zip(self._heads, self._qoffs, strict=True)]
            )
            self._heads = self._qoffs = None
        return rows

    def msg_ids(self) -> list[str]:
        """Each message's id, as :meth:`BrokerState.msg_id` gives it."""
        prefix = self._id_prefix
        return [f"{prefix}{r[2]:016X}" for r in self.rows()]

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._qoffs or ())

    @overload
    def __getitem__(self, i: int) -> MessageAck: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[MessageAck, ...]: ...

    def __getitem__(self, i: int | slice) -> MessageAck | tuple[MessageAck, ...]:
        if isinstance(i, slice):
            return tuple(self)[i]
        q, qoff, phys, size = self.rows()[i]
        return MessageAck(q, qoff, phys, size, f"{self._id_prefix}{phys:016X}")

    def __iter__(self) -> Iterator[MessageAck]:
        prefix = self._id_prefix
        for q, qoff, phys, size in self.rows():
            yield MessageAck(q, qoff, phys, size, f"{prefix}{phys:016X}")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Acks):
            return self._id_prefix == other._id_prefix and self.rows() == other.rows()
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._id_prefix, self.rows()))

    def __repr__(self) -> str:
        return f"Acks({list(self)!r})"


@dataclass(frozen=True, slots=True)
class ProduceResult:
    topic: str
    acks: Acks
    store_ts_ms: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class QueueInfo:
    queue: int
    min_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    queues: tuple[QueueInfo, ...]


@dataclass(frozen=True, slots=True)
class ProducerResult:
    producer_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class OffsetsResult:
    group: str
    offsets: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class RetentionResult:
    max_bytes: int
    max_age_ms: int
    producer_idle_ms: int


@dataclass(frozen=True, slots=True)
class TopicDeleted:
    name: str


@dataclass(frozen=True, slots=True)
class StoredMessage:
    topic: str
    queue: int
    queue_offset: int
    phys_offset: int
    size: int
    msg_id: str
    store_ts_ms: int
    born_ts_ms: int
    tag: str
    keys: tuple[str, ...]
    properties: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class ReadResult:
    messages: tuple[StoredMessage, ...]
    next_offset: int
    min_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class ReadColumns:
    """What :meth:`BrokerState.read_columns` answers: the messages of a
    :class:`ReadResult`, column by column (``records``: what their records
    hold), and the same offsets."""

    queue_offsets: Sequence[int]
    phys_offsets: Sequence[int]
    sizes: Sequence[int]
    store_ts_ms: Sequence[int]
    id_prefix: str  # a message's id: this, then its physical offset in 16 hex digits
    records: RecordColumns
    next_offset: int
    min_offset: int
    max_offset: int

    def __len__(self) -> int:
        return len(self.phys_offsets)

    def msg_ids(self) -> list[str]:
        """As :meth:`BrokerState.msg_id` gives them."""
        return [f"{self.id_prefix}{p:016X}" for p in self.phys_offsets]


class _Queue:
    """One ConsumeQueue: queue offsets ``[lo, hi)`` are retained; the entry
    of each (physical offset, size, tag hash, store time) and the records
    themselves are in the state's :class:`~broker_adapter.bodies.Bodies`
    under this queue's ``qid`` (a local number: never part of a snapshot)."""

    __slots__ = ("hi", "lo", "qid")

    def __init__(self, qid: int, lo: int = 0, hi: int | None = None) -> None:
        self.qid = qid
        self.lo = lo
        self.hi = lo if hi is None else hi

    @property
    def min_offset(self) -> int:
        return self.lo

    @property
    def max_offset(self) -> int:
        return self.hi


@dataclass(slots=True)
class _Topic:
    name: str
    queues: list[_Queue]
    rr: int = 0


@dataclass(slots=True)
class _Seq:
    last_seq: int
    batches: list[tuple[int, int, Acks, int]] = field(default_factory=list)
    # (base_seq, count, acks, store_ts)


@dataclass(slots=True)
class _Producer:
    epoch: int
    last_ts: int
    seqs: dict[tuple[str, int], _Seq] = field(default_factory=dict)


_COLUMNAR: list[ModuleType | None] = []
# What a columnar page may hold of log entries at once (they are joined):
# a queue whose messages each sit in a large entry among other queues' gets
# a shorter page, not a page that holds gigabytes.
PAGE_ENTRY_BYTES = 32 << 20


def _columnar() -> ModuleType | None:
    """:mod:`broker_adapter.columnar`, imported on the first columnar read
    (it needs numpy, which a node serving only JSON never loads); None
    without numpy."""
    if not _COLUMNAR:
        try:
            _COLUMNAR.append(importlib.import_module("broker_adapter.columnar"))
        except ImportError:
            _COLUMNAR.append(None)
    return _COLUMNAR[0]


class BrokerState:
    """See the module docstring. Public reads never mutate state."""

    def __init__(self, broker_name: str = "dledger", bodies: Bodies | None = None) -> None:
        self.broker_name = broker_name
        self.bodies: Bodies = bodies if bodies is not None else MemoryBodies()
        self._id_prefix = f"{zlib.crc32(broker_name.encode()):08X}"
        self.applied_index = 0
        self.confirm_offset = 0
        self.now_ms = 0
        self._last_sweep_ms = 0
        self.epochs: dict[int, int] = {}
        self._topics: dict[str, _Topic] = {}
        self._groups: dict[str, dict[tuple[str, int], int]] = {}
        self._producers: dict[int, _Producer] = {}
        self._next_pid = 1
        self._next_qid = 0  # local queue ids for the store (not replicated state)
        self.retention_max_bytes = 0
        self.retention_max_age_ms = 0
        self.producer_idle_ms = DEFAULT_PRODUCER_IDLE_MS
        self.stored_bytes = 0
        self.stored_messages = 0

    # ======================================================================
    # apply
    # ======================================================================
    def apply(self, entry: Entry) -> object:
        """Apply one committed entry. Returns the command's result, a
        BrokerError the command was refused with, or None (not a command)."""
        if entry.index <= self.applied_index:
            raise InvariantViolation(
                f"entry {entry.index} applied after {self.applied_index}: apply order broken"
            )
        end = entry.end_pos
        if end < self.confirm_offset:
            raise InvariantViolation(
                f"entry {entry.index} ends at {end}, before the confirm offset "
                f"{self.confirm_offset}: the CommitLog moved backwards"
            )
        self.applied_index = entry.index
        if entry.term not in self.epochs:
            self.epochs[entry.term] = entry.pos
        result: object = None
        if entry.type is EntryType.NORMAL and codec.is_command(entry.data):
            try:
                cmd = codec.decode_command(entry.data)
                if cmd.ts_ms > self.now_ms:
                    self.now_ms = cmd.ts_ms
                self._maybe_sweep()
                result = self._dispatch(cmd, entry)
            except BodyMissing as exc:
                # The store lost or damaged what this replica applied before:
                # refusing the command here alone would make this replica
                # diverge from the others. Stop instead (rebuild it).
                raise StorageCorrupted(
                    f"entry {entry.index} cannot apply on this replica's store: {exc}"
                ) from None
            except BrokerError as exc:
                result = exc
            except (struct.error, UnicodeDecodeError) as exc:
                result = MalformedCommand(f"command does not decode: {exc}")
        self.confirm_offset = end
        return result

    def _dispatch(self, cmd: Command, entry: Entry) -> object:
        b = cmd.body
        if isinstance(b, Produce):
            return self._produce(b, entry)
        if isinstance(b, TopicCmd):
            if cmd.kind is CommandKind.CREATE_TOPIC:
                return self._create_topic(b.topic, b.queues)
            if cmd.kind is CommandKind.UPDATE_TOPIC:
                return self._update_topic(b.topic, b.queues)
            return self._delete_topic(b.topic)
        if isinstance(b, CommitOffsets):
            return self._commit_offsets(b)
        if isinstance(b, ResetGroup):
            return self._reset_group(b)
        if isinstance(b, RegisterProducer):
            return self._register_producer(b.producer_id)
        if isinstance(b, SetRetention):
            return self._set_retention(b)
        raise MalformedCommand(f"no handler for {cmd.kind!r}")

    # -- topics ---------------------------------------------------------------
    def _create_topic(self, name: str, queues: int) -> TopicInfo:
        codec.check_name(name)
        codec.check_queue_count(queues)
        if name in self._topics:
            raise TopicExists(f"topic {name!r} already exists", field="topic")
        self._topics[name] = _Topic(name, [self._new_queue() for _ in range(queues)])
        return self.topic(name)

    def _update_topic(self, name: str, queues: int) -> TopicInfo:
        t = self._topic(name)
        codec.check_queue_count(queues)
        if queues < len(t.queues):
            raise InvalidQueue(
                f"topic {name!r} has {len(t.queues)} queues; the count can only grow "
                "(queue offsets of removed queues would be lost)",
                "queues",
            )
        t.queues.extend(self._new_queue() for _ in range(queues - len(t.queues)))
        return self.topic(name)

    def _delete_topic(self, name: str) -> TopicDeleted:
        t = self._topic(name)
        for q in t.queues:
            for off in range(q.lo, q.hi):
                phys, size, _, _ = self.bodies.index_get(q.qid, off)
                self.stored_bytes -= size
                self.bodies.delete(phys)
            self.stored_messages -= q.hi - q.lo
            self.bodies.index_delete(q.qid, q.lo, q.hi)
        del self._topics[name]
        for offs in self._groups.values():
            for key in [k for k in offs if k[0] == name]:
                del offs[key]
        for p in self._producers.values():
            for key in [k for k in p.seqs if k[0] == name]:
                del p.seqs[key]
        return TopicDeleted(name)

    # -- produce ------------------------------------------------------------
    def _produce(self, p: Produce, entry: Entry) -> ProduceResult:
        data = entry.data
        t = self._topics.get(p.topic)
        nq = len(t.queues) if t is not None else p.auto_create_queues
        if t is None:
            codec.check_name(p.topic)
            if not p.auto_create_queues:
                raise UnknownTopic(f"topic {p.topic!r} does not exist", field="topic")
            codec.check_queue_count(p.auto_create_queues)
        if p.count < 1:
            raise MalformedCommand("a produce command without messages")
        # 1. Scan and resolve everything; nothing changes before all checks pass.
        pos = p.records_start
        heads: list[tuple[int, int, int, int]] = []  # (entry offset, size, queue, tag hash)
        add_head = heads.append
        rr = t.rr if t is not None else 0
        idem = p.base_seq >= 0
        pid_queue = zlib.crc32(struct.pack(">Q", p.producer_id)) % nq if idem else 0
        ndata = len(data)
        scan = codec.RECORD_SCAN.unpack_from
        scan_size = codec.RECORD_SCAN.size
        fixed_size = codec.RECORD_FIXED_SIZE
        crc32 = zlib.crc32
        for k in range(p.count):
            # The common record (no sharding key) in one unpack; anything
            # else, or anything out of bounds, through codec.record_header,
            # which reads the same bytes and raises its own errors.
            if pos + scan_size <= ndata:
                size, _crc, _ver, _born, q, n_shard, n_tag = scan(data, pos)
                if n_shard or size < fixed_size or pos + size > ndata:
                    size, q, shard, th = codec.record_header(data, pos)
                else:
                    shard = ""
                    th = crc32(data[pos + scan_size : pos + scan_size + n_tag]) if n_tag else 0
            else:
                size, q, shard, th = codec.record_header(data, pos)
            if q >= 0:
                if q >= nq:
                    raise InvalidQueue(
                        f"queue {q} does not exist: topic {p.topic!r} has {nq} queues",
                        f"messages[{k}].queue",
                    )
            elif shard:
                q = crc32(shard.encode("utf-8")) % nq
            elif idem:
                q = pid_queue
            else:
                q = rr % nq
                rr += 1
            add_head((pos, size, q, th))
            pos += size
        if pos != len(data):
            raise MalformedCommand("bytes after the last record")
        seq_state: _Seq | None = None
        prod: _Producer | None = None
        queue_of_batch = heads[0][2]
        if idem:
            if any(h[2] != queue_of_batch for h in heads):
                raise InvalidQueue(
                    "an idempotent batch must go to one queue (give one queue or one "
                    "sharding key for all its messages)",
                    "messages",
                )
            prod = self._live_producer(p.producer_id)
            if p.epoch < prod.epoch:
                raise ProducerFenced(
                    f"producer {p.producer_id} epoch {p.epoch} is fenced by epoch {prod.epoch}",
                    field="epoch",
                    current_epoch=prod.epoch,
                )
            if p.epoch > prod.epoch:
                raise InvalidArgument(
                    f"producer {p.producer_id} has epoch {prod.epoch}, not {p.epoch}",
                    field="epoch",
                )
            seq_state = prod.seqs.get((p.topic, queue_of_batch))
            last = seq_state.last_seq if seq_state is not None else -1
            if p.base_seq <= last:
                assert seq_state is not None
                for base, count, old_acks, ts in seq_state.batches:
                    if base == p.base_seq and count == p.count:
                        prod.last_ts = self.now_ms
                        return ProduceResult(p.topic, old_acks, ts, duplicate=True)
                raise DuplicateSequence(
                    f"sequence {p.base_seq} was already written and is no longer in the "
                    f"retry window (last sequence {last})",
                    field="sequence",
                    last_sequence=last,
                )
            if p.base_seq != last + 1:
                raise SequenceGap(
                    f"sequence {p.base_seq} skips ahead: the next one for producer "
                    f"{p.producer_id} on {p.topic}/{queue_of_batch} is {last + 1}",
                    field="sequence",
                    expected_sequence=last + 1,
                )
        # 2. Mutate.
        if t is None:
            t = _Topic(p.topic, [self._new_queue() for _ in range(nq)])
            self._topics[p.topic] = t
        t.rr = rr
        now = self.now_ms
        base_pos = entry.pos
        queues = t.queues
        bodies = self.bodies
        index_put = bodies.index_put
        log_backed = bodies.log_backed
        put = bodies.put
        qoffs: list[int] = []
        add_qoff = qoffs.append
        if log_backed:
            bodies.put_entry(entry.index, base_pos)  # the records stay in the entry
            # The index entries of each queue go in one run (consecutive
            # queue offsets): one packed slice per queue instead of a put
            # per message.
            runs: dict[int, list[int]] = {}
            for off, size, q, th in heads:
                cq = queues[q]
                add_qoff(cq.hi)
                cq.hi += 1
                run = runs.get(q)
                if run is None:
                    run = runs[q] = []
                run += (base_pos + off, size, th, now)
            for q, run in runs.items():
                cq = queues[q]
                bodies.index_put_run(cq.qid, cq.hi - len(run) // 4, run)
        else:
            for off, size, q, th in heads:
                cq = queues[q]
                qoff = cq.hi
                add_qoff(qoff)
                phys = base_pos + off
                index_put(cq.qid, qoff, (phys, size, th, now))
                cq.hi = qoff + 1
                put(phys, data[off : off + size])
        self.stored_bytes += pos - p.records_start  # the records are back to back
        self.stored_messages += len(heads)
        result = ProduceResult(p.topic, Acks.of_entry(self._id_prefix, base_pos, heads, qoffs), now)
        if idem:
            assert prod is not None
            key = (p.topic, queue_of_batch)
            if seq_state is None:
                seq_state = prod.seqs[key] = _Seq(-1)
            seq_state.last_seq = p.base_seq + p.count - 1
            seq_state.batches.append((p.base_seq, p.count, result.acks, now))
            if len(seq_state.batches) > DEDUP_WINDOW:
                del seq_state.batches[0]
            prod.last_ts = now
        if self.retention_max_bytes and self.stored_bytes > self.retention_max_bytes:
            self._enforce_size()
        return result

    def msg_id(self, phys_offset: int) -> str:
        """RocketMQ-style: the broker's identity, then the physical offset, in hex."""
        return f"{self._id_prefix}{phys_offset:016X}"

    # -- producers ------------------------------------------------------------
    def _live_producer(self, pid: int) -> _Producer:
        prod = self._producers.get(pid)
        if prod is None or self._expired(prod):
            raise UnknownProducer(
                f"producer {pid} is not registered (or expired after "
                f"{self.producer_idle_ms} ms idle); register it again",
                field="producer_id",
            )
        return prod

    def _expired(self, prod: _Producer) -> bool:
        return prod.last_ts + self.producer_idle_ms < self.now_ms

    def _register_producer(self, pid: int) -> ProducerResult:
        if pid == 0:
            pid = self._next_pid
            self._next_pid += 1
            self._producers[pid] = _Producer(0, self.now_ms)
            return ProducerResult(pid, 0)
        old = self._producers.get(pid)
        if pid >= self._next_pid:
            raise UnknownProducer(f"producer id {pid} was never assigned", field="producer_id")
        epoch = old.epoch + 1 if old is not None else 0
        # A new epoch fences the old one and starts its sequences afresh.
        self._producers[pid] = _Producer(epoch, self.now_ms)
        return ProducerResult(pid, epoch)

    # -- consumer groups --------------------------------------------------------
    def _commit_offsets(self, c: CommitOffsets) -> OffsetsResult:
        for k, (topic, q, off) in enumerate(c.offsets):
            t = self._topic(topic)
            if not 0 <= q < len(t.queues):
                raise InvalidQueue(
                    f"queue {q} does not exist: topic {topic!r} has {len(t.queues)} queues",
                    f"offsets[{k}].queue",
                )
            cq = t.queues[q]
            if off > cq.max_offset:
                raise OffsetOutOfRange(
                    f"offset {off} is past the end of {topic}/{q}",
                    cq.min_offset,
                    cq.max_offset,
                    f"offsets[{k}].offset",
                )
        offs = self._groups.setdefault(c.group, {})
        for topic, q, off in c.offsets:
            offs[(topic, q)] = off
        return OffsetsResult(c.group, c.offsets)

    def _reset_group(self, r: ResetGroup) -> OffsetsResult:
        t = self._topic(r.topic)
        out = []
        for q, cq in enumerate(t.queues):
            if r.mode is ResetMode.EARLIEST:
                off = cq.min_offset
            elif r.mode is ResetMode.LATEST:
                off = cq.max_offset
            else:
                off = self._first_at_or_after(cq, r.timestamp_ms)
            out.append((r.topic, q, off))
        offs = self._groups.setdefault(r.group, {})
        for topic, q, off in out:
            offs[(topic, q)] = off
        return OffsetsResult(r.group, tuple(out))

    # -- retention and expiry -------------------------------------------------
    def _set_retention(self, s: SetRetention) -> RetentionResult:
        self.retention_max_bytes = s.max_bytes
        self.retention_max_age_ms = s.max_age_ms
        if s.producer_idle_ms:
            self.producer_idle_ms = s.producer_idle_ms
        if self.retention_max_bytes and self.stored_bytes > self.retention_max_bytes:
            self._enforce_size()
        if self.retention_max_age_ms:
            self._enforce_age()
        return RetentionResult(s.max_bytes, s.max_age_ms, self.producer_idle_ms)

    def _maybe_sweep(self) -> None:
        if self.now_ms - self._last_sweep_ms < SWEEP_INTERVAL_MS:
            return
        self._last_sweep_ms = self.now_ms
        for pid in sorted(self._producers):
            if self._expired(self._producers[pid]):
                del self._producers[pid]
        if self.retention_max_age_ms:
            self._enforce_age()

    def _drop_head(self, cq: _Queue) -> None:
        phys, size, _, _ = self.bodies.index_get(cq.qid, cq.lo)
        self.bodies.delete(phys)
        self.bodies.index_delete(cq.qid, cq.lo, cq.lo + 1)
        cq.lo += 1
        self.stored_bytes -= size
        self.stored_messages -= 1

    def _head_phys(self, cq: _Queue) -> int | None:
        return self.bodies.index_get(cq.qid, cq.lo)[0] if cq.lo < cq.hi else None

    def head_positions(self) -> list[int]:
        """The physical offset of every queue's oldest retained message."""
        return [h for q in self._all_queues() if (h := self._head_phys(q)) is not None]

    def _first_at_or_after(self, cq: _Queue, ts: int) -> int:
        """The first retained queue offset stored at or after ``ts`` (store
        times never decrease within a queue), or the max offset."""
        lo, hi = cq.lo, cq.hi
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bodies.index_get(cq.qid, mid)[3] < ts:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _new_queue(self, lo: int = 0, hi: int | None = None) -> _Queue:
        self._next_qid += 1
        return _Queue(self._next_qid, lo, hi)

    def _all_queues(self) -> list[_Queue]:
        return [q for name in sorted(self._topics) for q in self._topics[name].queues]

    def _enforce_size(self) -> None:
        """Drop the oldest messages, by physical offset across every queue,
        until the stored bytes are within the limit.

        With a size limit in force this runs after every produce and drops
        about as many messages as the produce added, so it reads the index
        of each queue it drains a chunk at a time (:data:`RETENTION_CHUNK`
        entries after the head) and deletes each queue's dropped run with
        one call at the end: the same messages in the same order as dropping
        one head at a time (a lookup, a delete and a second lookup per
        message, which cost a third of a follower's time in the benchmark's
        retention window, issue 17)."""
        qs = self._all_queues()
        bodies = self.bodies
        limit = self.retention_max_bytes
        # k -> [the chunk of queue k's index from its head on, position in it]
        bufs: dict[int, tuple[list[IndexEntry], int]] = {}
        heap: list[tuple[int, int]] = []
        for k, q in enumerate(qs):
            if q.lo < q.hi:
                # The head alone at first: with many queues, most lose
                # nothing to this call; a queue that does gets chunks.
                head = bodies.index_get(q.qid, q.lo)
                bufs[k] = ([head], 0)
                heap.append((head[0], k))
        heapq.heapify(heap)
        first: dict[int, int] = {}  # k -> the head before this call
        delete = bodies.delete
        try:
            while self.stored_bytes > limit and heap:
                _, k = heapq.heappop(heap)
                cq = qs[k]
                ents, i = bufs[k]
                phys, size, _, _ = ents[i]
                delete(phys)
                if k not in first:
                    first[k] = cq.lo
                cq.lo += 1
                self.stored_bytes -= size
                self.stored_messages -= 1
                i += 1
                if i == len(ents):
                    if cq.lo >= cq.hi:
                        continue
                    ents = bodies.index_many(cq.qid, cq.lo, min(cq.hi, cq.lo + RETENTION_CHUNK))
                    i = 0
                bufs[k] = (ents, i)
                heapq.heappush(heap, (ents[i][0], k))
        finally:  # what was dropped leaves the index even if a read failed
            for k, lo in first.items():
                bodies.index_delete(qs[k].qid, lo, qs[k].lo)

    def _enforce_age(self) -> None:
        cutoff = self.now_ms - self.retention_max_age_ms
        for cq in self._all_queues():
            while cq.lo < cq.hi and self.bodies.index_get(cq.qid, cq.lo)[3] < cutoff:
                self._drop_head(cq)

    # ======================================================================
    # reads (never mutate)
    # ======================================================================
    def _topic(self, name: str) -> _Topic:
        t = self._topics.get(name)
        if t is None:
            codec.check_name(name)
            raise UnknownTopic(f"topic {name!r} does not exist", field="topic")
        return t

    def _queue(self, topic: str, queue: int) -> _Queue:
        t = self._topic(topic)
        if not 0 <= queue < len(t.queues):
            raise InvalidQueue(
                f"queue {queue} does not exist: topic {topic!r} has {len(t.queues)} queues",
                "queue",
            )
        return t.queues[queue]

    def has_topic(self, name: str) -> bool:
        return name in self._topics

    def topic_names(self) -> list[str]:
        return sorted(self._topics)

    def topic(self, name: str) -> TopicInfo:
        t = self._topic(name)
        return TopicInfo(
            name,
            tuple(QueueInfo(k, q.min_offset, q.max_offset) for k, q in enumerate(t.queues)),
        )

    def queue_range(self, topic: str, queue: int) -> tuple[int, int]:
        q = self._queue(topic, queue)
        return q.min_offset, q.max_offset

    def _read_range(self, topic: str, queue: int, offset: int) -> tuple[_Queue, int, int]:
        """The queue a read starts in, and its [min, max] offsets; raises
        OffsetOutOfRange below the min or past the max (``max`` itself is an
        empty page)."""
        cq = self._queue(topic, queue)
        lo, hi = cq.min_offset, cq.max_offset
        if not lo <= offset <= hi:
            raise OffsetOutOfRange(
                f"offset {offset} is outside {topic}/{queue}'s range [{lo}, {hi}]", lo, hi
            )
        return cq, lo, hi

    def read(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 32,
        max_bytes: int = 1 << 20,
        tag: str | None = None,
    ) -> ReadResult:
        """Messages of ``topic``/``queue`` from queue offset ``offset``: at most
        ``max_messages``, and at most ``max_bytes`` of records except that the
        first one is always returned. ``tag``: "a||b" keeps messages tagged a
        or b ("*" or None: all). Raises OffsetOutOfRange below the min or
        past the max offset (``offset == max`` is an empty answer)."""
        cq, lo, hi = self._read_range(topic, queue, offset)
        wanted: dict[int, set[str]] | None = None
        if tag and tag != "*":
            wanted = {}
            for tg in (x.strip() for x in tag.split("||")):
                if tg:
                    wanted.setdefault(codec.tag_hash(tg), set()).add(tg)
        out: list[StoredMessage] = []
        used = 0
        k = offset
        end = cq.hi
        scanned = 0
        index_get = self.bodies.index_get
        with self.bodies.reading():
            while k < end and len(out) < max_messages and scanned < MAX_SCAN:
                try:
                    phys, size, th, ts = index_get(cq.qid, k)
                except RecordNotHere as exc:
                    raise CatchingUp(f"{topic}/{queue}@{k}: {exc}") from None
                except BodyMissing as exc:
                    raise StorageCorrupted(f"{topic}/{queue}@{k}: {exc}") from None
                if out and used + size > max_bytes:
                    break
                scanned += 1
                if wanted is not None and th not in wanted:
                    k += 1
                    continue
                m = self._message(topic, queue, k, phys, size, ts)
                k += 1
                if wanted is not None and m.tag not in wanted.get(th, ()):
                    continue
                out.append(m)
                used += size
        return ReadResult(tuple(out), k, lo, hi)

    def read_columns(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 32,
        max_bytes: int = 1 << 20,
        tag: str | None = None,
    ) -> ReadColumns:
        """:meth:`read`, the same messages and offsets and the same errors
        (a damaged record is :class:`StorageCorrupted` naming it, never
        served), as columns: the page's index entries and records are read
        in two bulk store calls and decoded without an object per message.
        A tag filter takes :meth:`read` and turns its answer into columns."""
        if tag and tag != "*":
            res = self.read(topic, queue, offset, max_messages, max_bytes, tag)
            recs = RecordColumns()
            for m in res.messages:
                recs.add(Record(m.born_ts_ms, queue, "", m.tag, m.keys, m.properties, m.body))
            ms = res.messages
            return ReadColumns(
                [m.queue_offset for m in ms],
                [m.phys_offset for m in ms],
                [m.size for m in ms],
                [m.store_ts_ms for m in ms],
                self._id_prefix,
                recs,
                res.next_offset,
                res.min_offset,
                res.max_offset,
            )
        cq, lo, hi = self._read_range(topic, queue, offset)
        n = max(0, min(max_messages, hi - offset))
        fast = self._columnar_page(cq, offset, n, max_bytes, lo, hi)
        if fast is not None:
            return fast
        with self.bodies.reading():
            try:
                entries = self.bodies.index_many(cq.qid, offset, offset + n)
            except RecordNotHere as exc:
                raise CatchingUp(f"{topic}/{queue}: {exc}") from None
            except BodyMissing as exc:
                raise StorageCorrupted(f"{topic}/{queue}: {exc}") from None
            phys: Sequence[int] = ()
            sizes: Sequence[int] = ()
            stamps: Sequence[int] = ()
            if entries:
                phys, sizes, _hashes, stamps = zip(*entries, strict=True)
                # as read(): the first always, then while within max_bytes
                used, take = sizes[0], 1
                while take < n and used + sizes[take] <= max_bytes:
                    used += sizes[take]
                    take += 1
                if take < n:
                    phys, sizes, stamps = phys[:take], sizes[:take], stamps[:take]
            try:
                raw = self.bodies.get_many(phys, sizes)
            except RecordNotHere as exc:
                raise CatchingUp(f"{topic}/{queue}@{offset}..: {exc}") from None
            except BodyMissing as exc:
                raise StorageCorrupted(f"{topic}/{queue}@{offset}..: {exc}") from None
            except StorageCorrupted as exc:
                raise StorageCorrupted(f"{topic}/{queue}@{offset}..: {exc}", exc.index) from None
        try:
            recs = codec.decode_columns(raw)
        except codec.BadRecord as exc:
            off = offset + exc.index
            raise StorageCorrupted(
                f"message {topic}/{queue}@{off} (physical offset {phys[exc.index]}) "
                f"cannot be read back: {exc}"
            ) from None
        return ReadColumns(
            range(offset, offset + len(phys)),
            phys,
            sizes,
            stamps,
            self._id_prefix,
            recs,
            offset + len(phys),
            lo,
            hi,
        )

    def _columnar_page(
        self, cq: _Queue, offset: int, n: int, max_bytes: int, lo: int, hi: int
    ) -> ReadColumns | None:
        """:meth:`read_columns`' page decoded per page and per log entry
        with numpy (:mod:`broker_adapter.columnar`), when its records are in
        the log (not the archive) and numpy is there; else None, and the
        caller decodes them one by one. An error is None too: the general
        path meets it again and reports it with the record at fault."""
        bodies = self.bodies
        if not n or not isinstance(bodies, DurableBodies):
            return None
        columnar = _columnar()
        if columnar is None:
            return None
        try:
            with bodies.reading():
                page = columnar.index_page(
                    bodies.index_raw(cq.qid, offset, offset + n), offset, max_bytes
                )
                if not columnar.ascending(page.phys):
                    return None
                entries = bodies.page_entries(page.phys, PAGE_ENTRY_BYTES)
        except (BodyMissing, StorageCorrupted):
            return None
        if entries is None:
            return None
        page = page.head(entries[-1][1])  # the entries held may cover fewer
        recs = columnar.page_records(entries, page.phys, page.sizes)
        if recs is None:
            return None
        k = len(page.phys)
        return ReadColumns(
            page.offsets,
            page.phys,
            page.sizes,
            page.stamps,
            self._id_prefix,
            recs,
            offset + k,
            lo,
            hi,
        )

    def _message(
        self, topic: str, queue: int, off: int, phys: int, size: int, ts: int
    ) -> StoredMessage:
        try:
            rec = codec.decode_record(self.bodies.get(phys))
        except RecordNotHere as exc:
            raise CatchingUp(
                f"message {topic}/{queue}@{off} (physical offset {phys}) is not stored on this "
                f"replica: it installed a snapshot since and is catching up ({exc})"
            ) from None
        except StorageCorrupted as exc:
            # the log entry holding it failed its check: name the message too
            raise StorageCorrupted(
                f"message {topic}/{queue}@{off} (physical offset {phys}) cannot be read back: "
                f"{exc}",
                exc.index,
            ) from None
        except MalformedCommand as exc:
            # The index names it, so it was applied whole: the record store
            # is damaged. Reported (503 at the API), never served.
            raise StorageCorrupted(
                f"message {topic}/{queue}@{off} (physical offset {phys}) cannot be read back: {exc}"
            ) from None
        return StoredMessage(
            topic,
            queue,
            off,
            phys,
            size,
            self.msg_id(phys),
            ts,
            rec.born_ts_ms,
            rec.tag,
            rec.keys,
            rec.properties,
            rec.body,
        )

    def group_offsets(self, group: str, topic: str | None = None) -> dict[tuple[str, int], int]:
        offs = self._groups.get(group, {})
        return {k: v for k, v in sorted(offs.items()) if topic is None or k[0] == topic}

    def groups(self) -> list[str]:
        return sorted(self._groups)

    def producer(self, pid: int) -> ProducerResult | None:
        p = self._producers.get(pid)
        if p is None or self._expired(p):
            return None
        return ProducerResult(pid, p.epoch)

    def stats(self) -> dict[str, int]:
        return {
            "applied_index": self.applied_index,
            "confirm_offset": self.confirm_offset,
            "topics": len(self._topics),
            "stored_messages": self.stored_messages,
            "stored_bytes": self.stored_bytes,
            "producers": len(self._producers),
            "groups": len(self._groups),
        }

    # ======================================================================
    # snapshot / restore
    # ======================================================================
    def _meta_value(self) -> dict[str, object]:
        """Everything but the topics' messages, as plain values (copies)."""
        groups = {
            g: {f"{tp}\x00{q}": off for (tp, q), off in offs.items()}
            for g, offs in self._groups.items()
        }
        producers: dict[int, object] = {}
        for pid, p in self._producers.items():
            seqs: dict[str, object] = {}
            for (tp, qn), st in p.seqs.items():
                seqs[f"{tp}\x00{qn}"] = [
                    st.last_seq,
                    [
                        [
                            base,
                            count,
                            ts,
                            [list(row) for row in acks.rows()],
                        ]
                        for base, count, acks, ts in st.batches
                    ],
                ]
            producers[pid] = [p.epoch, p.last_ts, seqs]
        return {
            "broker": self.broker_name,
            "applied": self.applied_index,
            "confirm": self.confirm_offset,
            "now": self.now_ms,
            "last_sweep": self._last_sweep_ms,
            "epochs": dict(self.epochs),
            "next_pid": self._next_pid,
            "retention": [
                self.retention_max_bytes,
                self.retention_max_age_ms,
                self.producer_idle_ms,
            ],
            "stored": [self.stored_bytes, self.stored_messages],
            "groups": groups,
            "producers": producers,
        }

    def checkpoint_blob(self) -> bytes:
        """The state without its records and ConsumeQueue entries (those are
        in :attr:`bodies`, under the local queue ids this blob names):
        versioned and CRC-checked like a snapshot. With a durable store it is
        written in the same transaction as the store's changes up to
        ``applied_index``, so :meth:`from_checkpoint` gives this state back
        at a restart without replaying the log."""
        v = self._meta_value()
        v["topics"] = {
            name: [t.rr, [[q.qid, q.lo, q.hi] for q in t.queues]]
            for name, t in self._topics.items()
        }
        v["next_qid"] = self._next_qid
        parts: list[bytes] = []
        dump_value(v, parts)
        payload = b"".join(parts)
        return _SNAP_HDR.pack(CHECKPOINT_MAGIC, SNAPSHOT_VERSION, zlib.crc32(payload)) + payload

    @classmethod
    def from_checkpoint(cls, data: bytes, bodies: Bodies) -> BrokerState:
        """The state :meth:`checkpoint_blob` was taken from, over ``bodies``
        (which must hold the store as of that moment); raises
        MalformedCommand when the blob is damaged or of another version."""
        v = _load_blob(data, CHECKPOINT_MAGIC, "checkpoint")
        try:
            return cls._from_value(v, bodies, checkpoint=True)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise MalformedCommand(f"checkpoint has a wrong shape: {exc!r}") from None

    def _freeze(self) -> Callable[[], dict[str, object]]:
        """Cheap copies of everything the snapshot holds (array slices are
        memcpy, list slices copy pointers to immutable bytes); the returned
        function converts them into the snapshot value, off the apply path."""
        frozen_topics = [
            (name, t.rr, [(q.qid, q.lo, q.hi) for q in t.queues])
            for name, t in self._topics.items()
        ]
        meta = self._meta_value()
        groups, producers = meta.pop("groups"), meta.pop("producers")
        head: dict[str, object] = meta

        frozen = self.bodies.freeze()
        with_records = not self.bodies.log_backed

        def value() -> dict[str, object]:
            try:
                topics: dict[str, object] = {}
                for name, rr, qs in frozen_topics:
                    out = []
                    for qid, lo, hi in qs:
                        cols = frozen.columns(qid, lo, hi)
                        row: list[object] = [lo, *(big_endian_bytes(a) for a in cols)]
                        if with_records:
                            row.append(frozen.records(cols[0]))
                        out.append(row)
                    topics[name] = [rr, out]
            finally:
                frozen.close()
            return {**head, "topics": topics, "groups": groups, "producers": producers}

        return value

    def _to_value(self) -> dict[str, object]:
        return self._freeze()()

    def snapshot(self) -> bytes:
        """The whole state at ``applied_index``: deterministic bytes (equal
        states give equal snapshots), versioned and CRC-checked."""
        return self.snapshot_builder()()

    def snapshot_builder(self) -> Callable[[], bytes]:
        """:meth:`snapshot` in two steps: freeze now (cheap), encode later
        (possibly in another thread: the frozen copies share nothing mutable
        with this state)."""
        chunks = self.snapshot_chunks_builder()

        def build() -> bytes:
            return b"".join(chunks())

        return build

    def snapshot_chunks_builder(self) -> Callable[[], list[bytes]]:
        """:meth:`snapshot_builder` as a list of chunks (their concatenation
        is the snapshot). Big snapshots are joined in groups, so no single C
        call holds the GIL for long while the loop thread wants to run (one
        join of millions of parts held it for ~0.5 s per 350 MB)."""
        value = self._freeze()
        version = SNAPSHOT_VERSION_INDEX_ONLY if self.bodies.log_backed else SNAPSHOT_VERSION

        def build() -> list[bytes]:
            parts: list[bytes] = []
            dump_value(value(), parts)
            chunks = [b"".join(parts[k : k + 4096]) for k in range(0, len(parts), 4096)]
            del parts
            crc = 0
            for c in chunks:
                crc = zlib.crc32(c, crc)  # releases the GIL on big buffers
            return [_SNAP_HDR.pack(SNAPSHOT_MAGIC, version, crc), *chunks]

        return build

    @classmethod
    def restore(cls, data: bytes, bodies: Bodies | None = None) -> BrokerState:
        """The state a snapshot was taken from; raises MalformedCommand.
        ``bodies`` (emptied and refilled) holds the restored records."""
        v = _load_blob(
            data, SNAPSHOT_MAGIC, "snapshot", (SNAPSHOT_VERSION, SNAPSHOT_VERSION_INDEX_ONLY)
        )
        try:
            return cls._from_value(v, bodies)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise MalformedCommand(f"snapshot has a wrong shape: {exc!r}") from None

    @classmethod
    def _from_value(
        cls, v: dict[object, object], bodies: Bodies | None, checkpoint: bool = False
    ) -> BrokerState:
        def d(x: object) -> dict[object, object]:
            if not isinstance(x, dict):
                raise TypeError("expected a map")
            return x

        def lst(x: object) -> list[object]:
            if not isinstance(x, list):
                raise TypeError("expected a list")
            return x

        def i(x: object) -> int:
            if not isinstance(x, int):
                raise TypeError("expected an int")
            return x

        def b(x: object) -> bytes:
            if not isinstance(x, bytes):
                raise TypeError("expected bytes")
            return x

        def s(x: object) -> str:
            if not isinstance(x, str):
                raise TypeError("expected a string")
            return x

        st = cls(s(v["broker"]), MemoryBodies())  # the real store is filled once all is valid
        records: list[tuple[int, bytes]] = []
        index: list[tuple[int, int, tuple[array[int], ...]]] = []
        st.applied_index = i(v["applied"])
        st.confirm_offset = i(v["confirm"])
        st.now_ms = i(v["now"])
        st._last_sweep_ms = i(v["last_sweep"])
        st.epochs = {i(k): i(x) for k, x in sorted(d(v["epochs"]).items(), key=lambda kv: i(kv[0]))}
        st._next_pid = i(v["next_pid"])
        ret = lst(v["retention"])
        st.retention_max_bytes, st.retention_max_age_ms, st.producer_idle_ms = (
            i(ret[0]),
            i(ret[1]),
            i(ret[2]),
        )
        stored = lst(v["stored"])
        st.stored_bytes, st.stored_messages = i(stored[0]), i(stored[1])
        if checkpoint:
            # Queue ids name the store's entries: kept as they were.
            for name, tv in d(v["topics"]).items():
                rr, qs = lst(tv)
                queues = []
                for qv in lst(qs):
                    qid, lo, hi = (i(x) for x in lst(qv))
                    if not 0 <= lo <= hi:
                        raise ValueError(f"queue {qid} has range [{lo}, {hi})")
                    queues.append(_Queue(qid, lo, hi))
                st._topics[s(name)] = _Topic(s(name), queues, i(rr))
            st._next_qid = i(v["next_qid"])
        for name, tv in d(v["topics"]).items() if not checkpoint else ():
            rr, qs = lst(tv)
            queues = []
            for qv in lst(qs):
                parts = lst(qv)
                mn, phys, sizes, tags, ts = parts[:5]
                cols = tuple(from_big_endian("q", b(x)) for x in (phys, sizes, tags, ts))
                n = len(cols[0])
                if not all(len(c) == n for c in cols):
                    raise ValueError("queue arrays of different lengths")
                if len(parts) == 6:  # with the records
                    recs_l = [b(r) for r in lst(parts[5])]
                    if len(recs_l) != n:
                        raise ValueError("queue arrays of different lengths")
                    records.extend(zip(cols[0], recs_l, strict=True))
                elif len(parts) != 5:
                    raise ValueError("a queue of the wrong shape")
                q = st._new_queue(i(mn), i(mn) + n)
                index.append((q.qid, q.lo, cols))
                queues.append(q)
            st._topics[s(name)] = _Topic(s(name), queues, i(rr))
        for g, offs in d(v["groups"]).items():
            go: dict[tuple[str, int], int] = {}
            for key, off in d(offs).items():
                tp, _, qs_ = s(key).rpartition("\x00")
                go[(tp, int(qs_))] = i(off)
            st._groups[s(g)] = go
        for pid, pv in d(v["producers"]).items():
            epoch, last_ts, seqs = lst(pv)
            prod = _Producer(i(epoch), i(last_ts))
            for key, sv in d(seqs).items():
                tp, _, qs_ = s(key).rpartition("\x00")
                last_seq, batches = lst(sv)
                seq = _Seq(i(last_seq))
                for bv in lst(batches):
                    base, count, ts, acks = lst(bv)
                    seq.batches.append(
                        (
                            i(base),
                            i(count),
                            Acks(
                                st._id_prefix,
                                tuple(
                                    (i(a[0]), i(a[1]), i(a[2]), i(a[3]))
                                    for a in (lst(x) for x in lst(acks))
                                ),
                            ),
                            i(ts),
                        )
                    )
                prod.seqs[(tp, int(qs_))] = seq
            st._producers[i(pid)] = prod
        st.bodies = bodies if bodies is not None else MemoryBodies()
        if not checkpoint:
            st.bodies.replace_all(records, index)
        return st
