"""What a node applies when it runs the broker: the broker state plus the
replica records (``LogStateMachine``) that ``/raft/applied`` and
``/raft/messages`` serve.

Entries that are broker commands go to :class:`BrokerState` and its result
(or refusal) is the proposal's answer; any other NORMAL entry (raw
``/raft/propose`` payloads) keeps its old answer, the CRC. Listeners are
called after each applied entry (the HTTP layer wakes long-polls with one);
they run on the node's loop and must only schedule work, never block.

A snapshot is the replica records' snapshot (length-prefixed) followed by
the broker state's own deterministic snapshot; restoring replaces both.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from broker_adapter.bodies import Bodies, DurableBodies, IndexDamaged, SideStorage
from broker_adapter.codec import is_command
from broker_adapter.errors import MalformedCommand
from broker_adapter.state import BrokerState
from dledger.core.types import Entry
from dledger.statemachine import LogStateMachine, SnapshotError

_LEN = struct.Struct(">Q")
_CKPT = struct.Struct(">4sBQ")  # magic, version, length of the replica records part
_CKPT_MAGIC = b"NSMC"
_CKPT_VERSION = 1


REPLICA_RECORDS = 1 << 16


class BrokerStateMachine(LogStateMachine):
    def __init__(
        self,
        broker: BrokerState | None = None,
        broker_name: str = "dledger",
        bodies: Bodies | None = None,
    ) -> None:
        """``bodies``: where records live (default: memory); a node passes an
        :class:`~broker_adapter.bodies.LmdbBodies` in its data directory."""
        # The replica records behind /raft/applied are kept for the newest
        # entries only: all of them would grow without bound (20 bytes per
        # entry, in memory and in every checkpoint).
        super().__init__(max_records=REPLICA_RECORDS)
        self.broker = broker if broker is not None else BrokerState(broker_name, bodies)
        self._listeners: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        # LogStateMachine has __len__ (0 when empty); a state machine object
        # must stay truthy (Node uses ``state_machine or LogStateMachine()``).
        return True

    def _keep_payload(self, data: bytes) -> bool:
        # Broker commands are the broker's to keep (a log-backed broker reads
        # records from the log itself): only raw payloads go to the window,
        # so snapshots and checkpoints do not carry recent messages twice.
        return not (self.durable and is_command(data))

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def apply(self, entry: Entry) -> object:
        crc = super().apply(entry)
        result = self.broker.apply(entry)
        for fn in tuple(self._listeners):
            fn()
        return result if is_command(entry.data) else crc

    def snapshot(self) -> bytes:
        return self.snapshot_builder()()

    def snapshot_builder(self) -> Callable[[], bytes]:
        records = super().snapshot_builder()
        broker = self.broker.snapshot_chunks_builder()

        def build() -> bytes:
            r = records()
            return b"".join([_LEN.pack(len(r)), r, *broker()])

        return build

    def restore(self, data: bytes) -> None:
        self.prepare_restore(data)()

    def prepare_restore(self, data: bytes) -> Callable[[], None]:
        """:meth:`restore` in two steps: this one parses the snapshot and
        fills the store (heavy: a node runs it in a worker thread; reads of
        a durable store meanwhile answer 503 CATCHING_UP), the returned one
        swaps the state in and wakes the listeners (on the node's loop)."""
        data = bytes(data)
        if len(data) < _LEN.size:
            raise SnapshotError("broker state machine snapshot is truncated")
        (n,) = _LEN.unpack_from(data, 0)
        if _LEN.size + n > len(data):
            raise SnapshotError("broker state machine snapshot is truncated")
        records = data[_LEN.size : _LEN.size + n]
        LogStateMachine(0).restore(records)  # check it before the store is touched
        bodies = self.broker.bodies
        if isinstance(bodies, DurableBodies):
            bodies.restoring = True
        try:
            broker = BrokerState.restore(data[_LEN.size + n :], bodies)
        except MalformedCommand as exc:
            raise SnapshotError(f"broker snapshot: {exc}") from None
        finally:
            if isinstance(bodies, DurableBodies):
                bodies.restoring = False

        def finish() -> None:
            LogStateMachine.restore(self, records)
            self.broker = broker
            for fn in tuple(self._listeners):
                fn()

        return finish

    # -- a durable state (bodies = DurableBodies) --------------------------------
    @property
    def durable(self) -> bool:
        """Whether the state lives in the node's storage (see
        :class:`~broker_adapter.bodies.DurableBodies`)."""
        return isinstance(self.broker.bodies, DurableBodies)

    def attach_storage(self, storage: SideStorage) -> None:
        bodies = self.broker.bodies
        if isinstance(bodies, DurableBodies):
            bodies.attach(storage)

    def checkpoint(self) -> int:
        """Stage the whole state as of the last applied entry into the
        storage's next group commit; returns the number the storage reports
        durable (``checkpoint_durable``)."""
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        records = LogStateMachine.snapshot_builder(self)()
        blob = b"".join(
            [
                _CKPT.pack(_CKPT_MAGIC, _CKPT_VERSION, len(records)),
                records,
                self.broker.checkpoint_blob(),
            ]
        )
        return bodies.stage_checkpoint(blob)

    def checkpoint_durable(self, seq: int) -> bool:
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        bodies.prune()
        return bodies.durable(seq)

    def load_checkpoint(self) -> int | None:
        """Take the state back from the storage's last durable checkpoint:
        its applied index, or None when there is none. Raises SnapshotError
        when there is one but it is damaged (the caller discards it)."""
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        blob = bodies.load_checkpoint()
        if blob is None:
            return None
        if len(blob) < _CKPT.size:
            raise SnapshotError("the broker checkpoint is truncated")
        magic, version, n = _CKPT.unpack_from(blob, 0)
        if magic != _CKPT_MAGIC or version != _CKPT_VERSION:
            raise SnapshotError(f"not a broker checkpoint of version {_CKPT_VERSION}")
        if _CKPT.size + n > len(blob):
            raise SnapshotError("the broker checkpoint is truncated")
        # Everything is checked before anything here changes: a refused
        # checkpoint leaves this state as it was (empty), to be rebuilt.
        try:
            broker = BrokerState.from_checkpoint(blob[_CKPT.size + n :], bodies)
        except MalformedCommand as exc:
            raise SnapshotError(f"broker checkpoint: {exc}") from None
        records = blob[_CKPT.size : _CKPT.size + n]
        probe = LogStateMachine(0)
        probe.restore(records)
        if probe.last_applied != broker.applied_index:
            raise SnapshotError(
                f"the checkpoint's parts disagree: records at {probe.last_applied}, "
                f"broker at {broker.applied_index}"
            )
        try:
            bodies.verify()
        except IndexDamaged as exc:
            raise SnapshotError(f"the stored index is damaged: {exc}") from None
        LogStateMachine.restore(self, records)
        self.broker = broker
        return broker.applied_index

    def discard_checkpoint(self) -> None:
        """Forget the stored state (it will be rebuilt from a snapshot and
        the log): the checkpoint, the records and the index, and in memory
        whatever :meth:`load_checkpoint` took back from it. The node refuses
        a checkpoint that loaded fine when its applied index lies outside
        the durable log (after a power loss in async mode, ahead of the
        durable commit index); the state then starts empty again, or the
        rebuild's first entry would meet the refused checkpoint's applied
        index (a replica that stopped on "apply order broken")."""
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        bodies.discard()
        self.broker = BrokerState(self.broker.broker_name, bodies)
        LogStateMachine.restore(self, LogStateMachine().snapshot())

    def compact_floor(self) -> int | None:
        """The lowest log index the log must keep: the entry holding the
        oldest retained record (records stay in their entries), or None when
        no retained record lives in the log."""
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        floor: int | None = None
        for phys in self.broker.head_positions():
            index = bodies.index_of(phys)
            if index is not None and (floor is None or index < floor):
                floor = index
        return floor

    def log_compacted(self, front_pos: int) -> None:
        """The log now starts at CommitLog position ``front_pos``."""
        bodies = self.broker.bodies
        assert isinstance(bodies, DurableBodies)
        bodies.drop_entries_below(front_pos)
