"""A durable broker state is checkpointed into LMDB about once a second. Its
rows cannot go to the write-ahead log, so the group commit that took them
became an LMDB commit (5-8 ms on each node, once a second, on the request
path: the produce tail under light load, issue 17's note). Under load they
now wait for LMDB's catch-up, which commits LMDB anyway after the group
commit's answers. Real nodes (LMDB, the broker state in it) on the
in-process transport; the planted variant stages each checkpoint at once,
as before."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dledger import node as node_module
from dledger.storage import lmdb_store
from dledger.storage.lmdb_store import LmdbStorage
from tests.unit.test_commitlog_catchup import Cluster

INTERVAL_S = 0.1  # the checkpoint interval here (1 s in production)


class SideCommits:
    """LMDB commits that carried the owner's side rows, by the call that made
    them: a group commit (``sync``) or a catch-up (``checkpoint``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.group = 0
        self.catch_up = 0
        self.counting = False
        orig_sync, orig_ckpt = LmdbStorage.sync, LmdbStorage.checkpoint

        def sync(st: LmdbStorage, *, catch_up: bool = True) -> None:
            side, before = bool(st._side_pending), st.lmdb_commits
            orig_sync(st, catch_up=catch_up)
            if self.counting and side and st.lmdb_commits > before:
                self.group += 1

        def checkpoint(st: LmdbStorage) -> bool:
            side, before = bool(st._side_pending), st.lmdb_commits
            done = orig_ckpt(st)
            if self.counting and side and st.lmdb_commits > before:
                self.catch_up += 1
            return done

        monkeypatch.setattr(LmdbStorage, "sync", sync)
        monkeypatch.setattr(LmdbStorage, "checkpoint", checkpoint)


@pytest.mark.parametrize("planted", [False, True], ids=["node", "planted-stage-at-once"])
async def test_checkpoints_ride_the_catch_up_not_a_group_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    monkeypatch.setattr(node_module, "_CHECKPOINT_INTERVAL_S", INTERVAL_S)
    monkeypatch.setattr(node_module, "_CHECKPOINT_DEFER_S", 0.0 if planted else 4 * INTERVAL_S)
    monkeypatch.setattr(lmdb_store, "WAL_COMMIT_INTERVAL_S", INTERVAL_S)
    commits = SideCommits(monkeypatch)
    c = Cluster(tmp_path)
    try:
        await c.start_with_topic()
        await c.produce(20, 0)  # warm: the first checkpoints of an idle start
        before = {nid: n.counters["checkpoints"] for nid, n in c.nodes.items()}
        commits.counting = True
        t0, k = time.monotonic(), 20
        while time.monotonic() - t0 < 1.2:  # continuous load: catch-ups keep coming
            await c.produce(5, k)
            k += 5
        commits.counting = False
        window = time.monotonic() - t0
        await c.converged()
        made = {nid: n.counters["checkpoints"] - before[nid] for nid, n in c.nodes.items()}
    finally:
        for nid in list(c.nodes):
            await c.stop(nid)
    if planted:
        assert commits.group > 0, "the planted variant must turn group commits into LMDB commits"
        return
    # every checkpoint under load was committed by a catch-up ...
    assert commits.group == 0, (commits.group, commits.catch_up)
    # ... and checkpoints kept coming: on each node at least one per
    # interval plus a catch-up's interval (the longest a due one waits)
    for nid, n in made.items():
        assert n >= int(window / (2 * INTERVAL_S)) - 1, (nid, n, window)
    assert commits.catch_up >= sum(made.values()) - len(made)
