"""LmdbStorage as a SnapshotStore: the snapshot file (atomic write, header,
CRC), its record in the meta db, crash safety and apply_snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dledger.core.types import ClusterConfig, Entry, HardState, Snapshot, SnapshotMeta
from dledger.errors import Compacted, StorageCorrupted
from dledger.storage.base import SnapshotStore
from dledger.storage.lmdb_store import LmdbStorage, decode_snapshot_file, encode_snapshot_file


def chain(first: int, terms: list[int], pos: int = 0) -> list[Entry]:
    out = []
    for k, t in enumerate(terms):
        e = Entry(index=first + k, term=t, data=f"e{first + k:04d}".encode(), pos=pos)
        out.append(e)
        pos = e.end_pos
    return out


CFG = ClusterConfig(voters=(1, 2, 3), learners=(4,))


def snap_at(entries: list[Entry], index: int, data: bytes = b"state") -> Snapshot:
    e = entries[index - 1]
    return Snapshot(SnapshotMeta(index=index, term=e.term, end_pos=e.end_pos, config=CFG), data)


def snap_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("snapshot-"))


def test_file_codec_round_trip() -> None:
    s = Snapshot(SnapshotMeta(7, 3, 99, CFG), b"\x00payload\xff")
    got, _ = decode_snapshot_file(encode_snapshot_file(s))
    assert got == s
    raw = bytearray(encode_snapshot_file(s))
    raw[20] ^= 1
    with pytest.raises(ValueError):
        decode_snapshot_file(bytes(raw))


def test_round_trip_and_survives_reopen(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        assert isinstance(s, SnapshotStore)
        assert s.snapshot() is None
        s.append(es)
        snap = snap_at(es, 4, b"abc" * 100)
        s.save_snapshot(snap)
        assert s.snapshot() == snap  # read-your-writes before sync
        s.sync()
        assert s.snapshot() == snap
        assert s.first_index() == 1  # save_snapshot leaves the log alone
        s.compact(3, es[1].term, es[1].end_pos)  # keeping trailing entries 3..
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert s.snapshot() == snap
        assert s.snapshot_meta() == snap.meta
        assert s.first_index() == 3 and s.last_index() == 5
        assert s.term(2) == es[1].term
    assert len(snap_files(tmp_path)) == 1


def test_newer_snapshot_replaces_older_file(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.save_snapshot(snap_at(es, 2, b"old"))
        s.sync()
        first = snap_files(tmp_path)
        s.save_snapshot(snap_at(es, 5, b"new"))
        s.sync()
        files = snap_files(tmp_path)
        assert len(files) == 1 and files != first
    with LmdbStorage(tmp_path) as s:
        got = s.snapshot()
        assert got is not None and got.data == b"new" and got.meta.index == 5


def test_crash_before_sync_keeps_the_old_snapshot(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        old = snap_at(es, 2, b"old")
        s.save_snapshot(old)
        s.sync()
        s.save_snapshot(snap_at(es, 5, b"new"))
        # close() without sync() is a crash
    with LmdbStorage(tmp_path) as s:
        assert s.snapshot() == old


def test_crash_between_file_and_commit_keeps_the_old_snapshot(tmp_path: Path) -> None:
    """The new file is renamed into place but the LMDB commit never happens:
    the meta db still names the old file, and the orphan is removed."""
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        old = snap_at(es, 2, b"old")
        s.save_snapshot(old)
        s.sync()
        s._write_snapshot_file(snap_at(es, 5, b"new"))  # the crash point
        assert len(snap_files(tmp_path)) == 2
    with LmdbStorage(tmp_path) as s:
        assert s.snapshot() == old
    assert len(snap_files(tmp_path)) == 1


def test_corrupt_snapshot_file_is_detected(tmp_path: Path) -> None:
    es = chain(1, [1, 1, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.save_snapshot(snap_at(es, 3, b"x" * 64))
        s.sync()
    (name,) = snap_files(tmp_path)
    path = tmp_path / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    with LmdbStorage(tmp_path) as s, pytest.raises(StorageCorrupted, match=name):
        s.snapshot()


def test_missing_snapshot_file_is_detected(tmp_path: Path) -> None:
    es = chain(1, [1])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        s.save_snapshot(snap_at(es, 1))
        s.sync()
    (name,) = snap_files(tmp_path)
    os.remove(tmp_path / name)
    with LmdbStorage(tmp_path) as s, pytest.raises(StorageCorrupted, match="missing"):
        s.snapshot()


@pytest.mark.parametrize("synced_log", [True, False])
@pytest.mark.parametrize("leader_index", [3, 8])
def test_apply_snapshot_then_append_continues(
    tmp_path: Path, synced_log: bool, leader_index: int
) -> None:
    """A follower's log (shorter or longer than the snapshot) is replaced."""
    mine = chain(1, [1, 1, 1, 1, 1])
    leader = chain(1, [1, 2, 2, 3, 3, 3, 3, 3, 3, 3])
    with LmdbStorage(tmp_path) as s:
        s.append(mine)
        if synced_log:
            s.sync()
        snap = snap_at(leader, leader_index, b"leader-state")
        s.apply_snapshot(snap)
        s.save_hard_state(HardState(term=3, vote=0, commit=leader_index))
        assert s.first_index() == leader_index + 1
        assert s.last_index() == leader_index
        assert s.term(leader_index) == snap.meta.term
        assert s.front_pos() == snap.meta.end_pos
        assert s.epoch_map() == {snap.meta.term: snap.meta.end_pos}
        with pytest.raises(Compacted):
            s.entries(leader_index, leader_index + 1)
        # Appending right after it, before and after a sync.
        s.append(leader[leader_index : leader_index + 1])
        assert (
            s.entries(leader_index + 1, leader_index + 2) == leader[leader_index : leader_index + 1]
        )
        s.sync()
        s.append(leader[leader_index + 1 :])
        s.sync()
    with LmdbStorage(tmp_path, verify="full") as s:
        assert s.snapshot() == snap
        assert s.first_index() == leader_index + 1
        assert s.last_index() == 10
        assert s.entries(leader_index + 1, 11) == leader[leader_index:]
        assert s.term(leader_index) == snap.meta.term
        assert s.verify_all() == 10 - leader_index


def test_apply_snapshot_alone_survives_reopen(tmp_path: Path) -> None:
    leader = chain(1, [1, 2, 2, 4])
    with LmdbStorage(tmp_path) as s:
        s.append(chain(1, [1, 1]))
        s.sync()
        snap = snap_at(leader, 4)
        s.apply_snapshot(snap)
        s.sync()
    with LmdbStorage(tmp_path, verify="full") as s:
        assert (s.first_index(), s.last_index(), s.term(4)) == (5, 4, 4)
        assert s.front_pos() == snap.meta.end_pos
        s.append(chain(5, [4], pos=snap.meta.end_pos))
        s.sync()
        assert s.last_index() == 5


def test_async_flush_mode_snapshot(tmp_path: Path) -> None:
    es = chain(1, [1, 1])
    with LmdbStorage(tmp_path, flush="async") as s:
        s.append(es)
        s.save_snapshot(snap_at(es, 2))
        s.sync()
        assert s.flushes >= 1  # the record naming the file was fsynced
    with LmdbStorage(tmp_path) as s:
        assert s.snapshot() == snap_at(es, 2)


def test_snapshot_written_ahead_then_recorded(tmp_path: Path) -> None:
    """write_snapshot_file (a worker thread's job) makes only the file
    durable; a sync meanwhile neither records nor deletes it; record_snapshot
    plus a sync puts it in force; a crash before that keeps the old one."""
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        old = snap_at(es, 2, b"old")
        s.save_snapshot(old)
        s.sync()
        new = snap_at(es, 4, b"new")
        name = s.write_snapshot_file(new)
        s.append(chain(6, [2], es[-1].end_pos))
        s.sync()  # an ordinary group commit while the file waits
        assert name in snap_files(tmp_path)
        assert s.snapshot() == old
    with LmdbStorage(tmp_path) as s:  # crashed before recording: old in force
        assert s.snapshot() == old
        assert name not in snap_files(tmp_path)  # and the orphan file is gone
        name = s.write_snapshot_file(new)
        assert s.record_snapshot(new, name)
        assert s.snapshot() == new  # read-your-writes before the sync
        s.sync()
    with LmdbStorage(tmp_path) as s:
        assert s.snapshot() == new
        assert snap_files(tmp_path) == [name]


def test_record_refuses_a_snapshot_older_than_the_one_held(tmp_path: Path) -> None:
    """A local snapshot finishing after the leader's newer one was installed
    must not roll the store back; its file is removed."""
    es = chain(1, [1, 1, 2, 2, 2])
    with LmdbStorage(tmp_path) as s:
        s.append(es)
        local = snap_at(es, 3, b"local")
        name = s.write_snapshot_file(local)
        installed = snap_at(es, 5, b"from the leader")
        s.apply_snapshot(installed)
        s.sync()
        assert name in snap_files(tmp_path)  # still being "written": kept
        assert not s.record_snapshot(local, name)
        assert name not in snap_files(tmp_path)
        s.sync()
        assert s.snapshot() == installed
