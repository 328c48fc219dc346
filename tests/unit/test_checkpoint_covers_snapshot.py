"""A node whose broker state lives in LMDB comes back from its own state
checkpoint only when that checkpoint is at or after the snapshot the store
records ([snapshot, commit], Node._load_checkpoint); otherwise it rebuilds
the whole state from the snapshot and the log. Checkpoints wait for LMDB's
catch-up (up to two seconds), snapshots do not: a node killed after
recording a snapshot and before its next checkpoint rebuilt (seen as a
flaky live test on a loaded machine). The snapshot's record now carries a
fresh checkpoint in its own LMDB commit.

Real nodes (LMDB, the broker state in it) on the in-process transport;
after every few produces each node's crash image (a copy of what LMDB has
committed, as a SIGKILL would leave it) is opened and its checkpoint
compared with its snapshot. Timed checkpoints are pushed out of the test,
so only the ones snapshots carry count; the planted variant records its
snapshots without one."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from broker_adapter import encode_retention
from broker_adapter.bodies import DurableBodies
from broker_adapter.node_sm import BrokerStateMachine
from dledger import node as node_module
from dledger.node import Node
from dledger.storage.lmdb_store import LmdbStorage
from tests.unit.test_commitlog_catchup import Cluster


def crash_image(n: Node, where: Path) -> tuple[int, int | None]:
    """(snapshot index, checkpoint's applied index) of what LMDB holds now."""
    st = n._storage
    assert isinstance(st, LmdbStorage)
    where.mkdir()
    st.env.copy(str(where))  # one read transaction: the last committed state
    img = LmdbStorage.open(where)
    try:
        sm = BrokerStateMachine(broker_name="commitlog", bodies=DurableBodies())
        sm.attach_storage(img)
        meta = img.snapshot_meta()
        return (meta.index if meta is not None else 0), sm.load_checkpoint()
    finally:
        img.close()


@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-snapshot-without"])
async def test_a_crash_image_never_holds_a_checkpoint_behind_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    monkeypatch.setattr(node_module, "_CHECKPOINT_INTERVAL_S", 3600.0)
    monkeypatch.setattr(node_module, "_CHECKPOINT_DEFER_S", 7200.0)
    monkeypatch.setattr(node_module, "_CHECKPOINT_ENTRIES", 1 << 40)
    if planted:
        stage = Node._stage_checkpoint

        def stage_unless_snapshot(self: Node, now: float) -> None:
            if sys._getframe(1).f_code.co_name != "_snapshot_housekeeping":
                stage(self, now)

        monkeypatch.setattr(Node, "_stage_checkpoint", stage_unless_snapshot)
    c = Cluster(tmp_path)
    behind: list[tuple[int, int, int, int | None]] = []
    snapshots = 0
    try:
        await c.start_with_topic()
        # keep about 30 records: retention drops the rest, so snapshots are
        # recorded (a snapshot waits until no retained record is behind it)
        await c.propose(encode_retention(c.ts, 30 * 40, 0))
        for k in range(16):
            await c.produce(6, 6 * k)
            await asyncio.sleep(0.15)  # a pending snapshot is checked every 0.1 s
            for nid, n in c.nodes.items():
                snap, ckpt = crash_image(n, tmp_path / f"img-{k}-{nid}")
                if snap:
                    snapshots += 1
                    if ckpt is None or ckpt < snap:
                        behind.append((k, nid, snap, ckpt))
        await c.converged()
    finally:
        for nid in list(c.nodes):
            await c.stop(nid)
    assert snapshots >= 10, "the nodes recorded too few snapshots for the test to mean anything"
    if planted:
        assert behind, "the planted variant must leave a checkpoint behind a snapshot"
        return
    assert not behind, f"(round, node, snapshot, checkpoint) a restart would rebuild: {behind}"
