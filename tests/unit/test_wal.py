"""The write-ahead log in front of LMDB: what sync() makes durable is one
record, a crash replays it, a torn last record is cut off, rot in the middle
is corruption, and records left over from before the file was emptied are
recognised by their numbers (dledger/storage/wal.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lmdb
import pytest

from dledger.core.types import Entry, HardState
from dledger.errors import StorageCorrupted
from dledger.storage import lmdb_store, wal
from dledger.storage.lmdb_store import LmdbStorage
from jepsen_like.control import wal_key


def chain(first: int, terms: list[int], pos: int = 0, size: int = 16) -> list[Entry]:
    out = []
    for k, t in enumerate(terms):
        i = first + k
        e = Entry(index=i, term=t, data=f"e{i:06d}-t{t}".encode().ljust(size, b"."), pos=pos)
        out.append(e)
        pos = e.end_pos
    return out


def crash(s: LmdbStorage) -> None:
    """Stop using ``s`` as a killed process would: nothing more is written
    (the page cache keeps what was written, as it does for a killed process)."""
    s._close_wal()
    s._env.close()
    s._closed = True


def wal_bytes(d: Path) -> bytes:
    return (d / wal.WAL_NAME).read_bytes()


def records(d: Path, key: int | None = None) -> list[tuple[int, int]]:
    """(offset, seq) of each whole record in the file; ``key``: the store's
    (read from its stopped LMDB image when not given)."""
    data = wal_bytes(d)
    if key is None:
        key = wal_key(d)
    out, off = [], 0
    while (got := wal._record_at(data, off, key)) is not None:
        out.append((off, got[0]))
        off = got[1]
    return out


def end_pos(s: LmdbStorage) -> int:
    last = s.last_index()
    return s.entries(last, last + 1)[0].end_pos if last else 0


def test_sync_writes_one_record_and_lmdb_catches_up_later(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1, 1]))
    s.sync()
    s.append(chain(4, [1], pos=end_pos(s)))
    s.sync()
    assert s.lmdb_commits == 0
    assert [seq for _, seq in records(tmp_path, s._wal_key)] == [1, 2]
    assert s.wal_bytes == len(wal_bytes(tmp_path)) > 0
    with s.env.begin() as txn:  # LMDB does not hold the entries yet
        assert s.entry_in(txn, 1) is None
    assert s.entries(1, 5) == chain(1, [1, 1, 1, 1])
    assert s.checkpoint()
    assert s.lmdb_commits == 1
    assert wal_bytes(tmp_path) == b"" and s.wal_bytes == 0
    with s.env.begin() as txn:
        assert s.entry_in(txn, 4) == chain(1, [1, 1, 1, 1])[3]
    s.close()


def test_a_crash_after_sync_replays_entries_and_the_vote(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    es = chain(1, [2, 2, 2, 2, 2])
    s.append(es)
    s.save_hard_state(HardState(term=3, vote=2, commit=4))
    s.sync()
    crash(s)
    r = LmdbStorage(tmp_path)
    assert r.wal_replayed == 1
    assert r.entries(1, 6) == es
    assert r.hard_state() == HardState(term=3, vote=2, commit=4)
    assert wal_bytes(tmp_path) == b""  # replayed into LMDB at once
    assert r.verify_all() == 5
    r.close()


def test_a_cut_and_overwrite_replays_exactly(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1, 1, 1, 1]))
    s.sync()
    assert s.checkpoint()  # entries 1..5 of term 1 in LMDB
    new = chain(3, [2, 2], pos=s.entries(2, 3)[0].end_pos)
    s.append(new)  # replaces 3..5 by 3..4 of term 2
    s.sync()
    s.append(chain(5, [2], pos=end_pos(s)))
    s.sync()
    s.truncate_from(5)
    s.sync()
    crash(s)
    r = LmdbStorage(tmp_path, verify="full")
    assert r.wal_replayed == 3
    assert r.last_index() == 4
    assert [r.term(i) for i in range(1, 5)] == [1, 1, 2, 2]
    assert r.entries(3, 5) == new
    assert r.epoch_map() == {1: 0, 2: new[0].pos}
    assert r.verify_all() == 4
    r.close()


def test_what_was_never_synced_is_lost_in_a_crash(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1, 1]))
    s.sync()
    s.append(chain(4, [1, 1], pos=end_pos(s)))
    s.save_hard_state(HardState(term=5, vote=1))
    crash(s)
    r = LmdbStorage(tmp_path)
    assert r.last_index() == 3
    assert r.hard_state() == HardState()
    r.close()


def test_close_leaves_lmdb_covering_the_log_unless_writes_wait_for_a_sync(
    tmp_path: Path,
) -> None:
    s = LmdbStorage(tmp_path / "a")
    s.append(chain(1, [1, 1]))
    s.sync()
    s.close()
    assert wal_bytes(tmp_path / "a") == b""
    t = LmdbStorage(tmp_path / "b")
    t.append(chain(1, [1, 1]))
    t.sync()
    t.append(chain(3, [1], pos=end_pos(t)))  # never synced: lost, as in a crash
    t.close()
    assert records(tmp_path / "b") != []
    r = LmdbStorage(tmp_path / "b")
    assert (r.wal_replayed, r.last_index()) == (1, 2)
    r.close()


def test_a_torn_last_record_is_cut_off_and_the_log_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1]))
    s.sync()
    s.append(chain(3, [1, 1], pos=end_pos(s)))
    s.sync()
    crash(s)
    ((off2, _),) = [r for r in records(tmp_path) if r[1] == 2]
    path = tmp_path / wal.WAL_NAME
    os.truncate(path, off2 + 20)  # the second write cut short
    with caplog.at_level(logging.WARNING):
        r = LmdbStorage(tmp_path)
    assert "torn or damaged record" in caplog.text
    assert (r.wal_replayed, r.last_index()) == (1, 2)
    # the next record takes the torn one's number, and survives a crash too
    r.append(chain(3, [1], pos=end_pos(r)))
    r.sync()
    crash(r)
    again = LmdbStorage(tmp_path, verify="full")
    assert again.last_index() == 3
    assert again.verify_all() == 3
    again.close()


def three_records(d: Path) -> tuple[Path, list[tuple[int, int]]]:
    """A crashed log of three records, one entry each: (the file, records)."""
    s = LmdbStorage(d)
    for k in range(3):
        s.append(chain(k + 1, [1], pos=end_pos(s)))
        s.sync()
    crash(s)
    return d / wal.WAL_NAME, records(d)


def test_rot_in_a_record_followed_by_others_is_corruption(tmp_path: Path) -> None:
    path, recs = three_records(tmp_path)
    off2 = recs[1][0]
    raw = bytearray(path.read_bytes())
    raw[off2 + wal.HEAD_SIZE + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(StorageCorrupted, match=r"write-ahead log .* damaged record"):
        LmdbStorage(tmp_path)


def test_rot_in_the_length_of_a_middle_record_is_corruption(tmp_path: Path) -> None:
    path, recs = three_records(tmp_path)
    off2 = recs[1][0]
    raw = bytearray(path.read_bytes())
    raw[off2 + 6] ^= 0x40  # the length now points far past the end of the file
    path.write_bytes(bytes(raw))
    with pytest.raises(StorageCorrupted, match="rotted"):
        LmdbStorage(tmp_path)


def test_records_left_over_from_before_the_file_was_emptied_are_ignored(
    tmp_path: Path,
) -> None:
    s = LmdbStorage(tmp_path)
    for k in range(4):
        s.append(chain(k + 1, [1], pos=end_pos(s), size=64))
        s.sync()
    old = wal_bytes(tmp_path)
    assert s.checkpoint()  # LMDB covers records 1..4; the file is emptied
    s.append(chain(5, [1], pos=end_pos(s)))
    s.sync()  # record 5, at offset 0
    crash(s)
    new = wal_bytes(tmp_path)
    assert len(new) < len(old)
    # The power went before the truncation reached the disk: the new record
    # lies over the start of the old contents.
    (tmp_path / wal.WAL_NAME).write_bytes(new + old[len(new) :])
    r = LmdbStorage(tmp_path, verify="full")
    assert (r.wal_replayed, r.last_index()) == (1, 5)
    assert r.verify_all() == 5
    r.close()


def test_a_missing_record_is_corruption(tmp_path: Path) -> None:
    path, recs = three_records(tmp_path)
    path.write_bytes(path.read_bytes()[recs[1][0] :])  # record 1 gone
    with pytest.raises(StorageCorrupted, match="resumes at record 2"):
        LmdbStorage(tmp_path)


def test_async_mode_replays_a_log_left_in_sync_mode_and_stops_using_it(
    tmp_path: Path,
) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1, 1]))
    s.sync()
    crash(s)
    a = LmdbStorage(tmp_path, flush="async")
    assert (a.wal_replayed, a.last_index()) == (1, 3)
    assert wal_bytes(tmp_path) == b""
    a.append(chain(4, [1], pos=end_pos(a)))
    a.sync()
    assert wal_bytes(tmp_path) == b""  # async mode commits LMDB
    a.close()


def test_a_big_batch_goes_straight_to_lmdb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_store, "WAL_RECORD_MAX", 1000)
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1] * 5, size=300))
    s.sync()
    assert (s.lmdb_commits, wal_bytes(tmp_path)) == (1, b"")
    s.append(chain(6, [1], pos=end_pos(s)))
    s.sync()  # small: the log
    assert s.lmdb_commits == 1 and records(tmp_path, s._wal_key)
    s.close()


def test_lmdb_catches_up_after_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1]))
    s.sync()
    assert s.lmdb_commits == 0
    monkeypatch.setattr(lmdb_store, "WAL_COMMIT_INTERVAL_S", 0.0)
    s.append(chain(2, [1], pos=end_pos(s)))
    s.sync()  # logged, then LMDB covers both records
    assert s.lmdb_commits == 1
    assert wal_bytes(tmp_path) == b""
    crash(s)
    r = LmdbStorage(tmp_path)
    assert (r.wal_replayed, r.last_index()) == (0, 2)
    r.close()


def test_lmdb_catches_up_every_mebibyte_under_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catch-up commit runs inside a group commit, so what it covers is
    a stall of the request path: under a steady stream of batches it comes
    once the log holds about 1 MiB, not only every interval (8 MiB at a
    time made the produce p99 at half saturation; issue 17's note)."""
    monkeypatch.setattr(lmdb_store, "WAL_COMMIT_INTERVAL_S", 3600.0)
    s = LmdbStorage(tmp_path)
    first, most = 1, 0
    for _ in range(30):  # 30 batches of 100 KB: 3 MB within the interval
        s.append(chain(first, [1] * 10, pos=end_pos(s), size=10_000))
        s.sync()
        first += 10
        most = max(most, len(wal_bytes(tmp_path)))
    assert s.lmdb_commits >= 2
    assert most < 1 << 20
    crash(s)
    r = LmdbStorage(tmp_path)  # what only the log held comes back
    assert r.last_index() == 300
    assert r.entries(299, 301, 1 << 30)[-1].data.startswith(b"e000300-t1")
    r.close()


def test_a_snapshot_or_side_rows_commit_lmdb_with_what_was_logged(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.side_db(b"side")
    s.append(chain(1, [1, 1]))
    s.sync()
    s.stage({b"side": {b"k": b"v"}})
    s.sync()
    assert s.lmdb_commits == 1 and s.side_synced == 1
    assert wal_bytes(tmp_path) == b""
    with s.env.begin() as txn:
        assert s.entry_in(txn, 2) is not None
    s.close()


def test_the_buffered_tail_and_a_read_transaction_cover_every_entry(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1]))
    s.sync()
    assert s.checkpoint()
    s.append(chain(3, [1, 1], pos=end_pos(s)))
    s.sync()
    tail = s.buffered_tail()
    with s.env.begin() as txn:
        got = [s.entry_in(txn, i) for i in (1, 2)] + tail
    assert got == chain(1, [1, 1, 1, 1])
    s.close()


def test_a_read_below_the_buffered_entries_returns_exactly_what_was_asked(
    tmp_path: Path,
) -> None:
    """entries(lo, hi) with hi at or below the first buffered entry: only
    LMDB's part. (A negative slice end once appended buffered entries after
    hi: harmless while the buffer emptied at every sync, wrong once it holds
    what only the write-ahead log has; the controller-mode harness run
    caught it as a slave and its master applying different entries.)"""
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1, 1, 1]))
    s.sync()
    assert s.checkpoint()  # 1..4 in LMDB
    more = chain(5, [1, 1, 1], pos=end_pos(s))
    s.append(more)
    s.sync()  # 5..7 in the log and the buffer only
    es = chain(1, [1, 1, 1, 1])
    assert s.entries(1, 3) == es[:2]
    assert s.entries(2, 5) == es[1:]
    assert s.entries(3, 6) == es[2:] + more[:1]
    assert s.entries(6, 8) == more[1:]
    assert s.entries(1, 3, max_bytes=10_000) == es[:2]
    s.close()


def test_reads_during_the_write_threads_catch_up_are_never_short(tmp_path: Path) -> None:
    """The leader's group commit runs in a worker thread; when it catches
    LMDB up it swaps the buffer and the limit while the loop keeps reading.
    A read that paired the old limit with the emptied buffer came back short
    (66 of 85,460 reads here before the swap took a lock): a consume page
    then answered "record not here" for a committed message. Switching
    threads as often as the interpreter can makes the window wide."""
    import sys
    import threading

    s = LmdbStorage(tmp_path)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    short = reads = 0
    try:
        for _ in range(150):
            s.append(chain(s.last_index() + 1, [1] * 20, pos=end_pos(s)))
            s.sync()  # in the log; LMDB behind until the checkpoint below
            last = s.last_index()
            t = threading.Thread(target=s.checkpoint)
            t.start()
            while t.is_alive():
                reads += 1
                short += len(s.entries(last - 19, last + 1)) != 20
                short += s.term(last) != 1 or s._entry(last).index != last
            t.join()
    finally:
        sys.setswitchinterval(old)
        s.close()
    assert reads > 0
    assert short == 0, f"{short} short reads of {reads}"


def _forged(seq: int, key: int) -> bytes:
    """A whole write-ahead log record a producer could put in a message body."""
    return wal.encode_record(seq, HardState(term=99, vote=1, commit=0), 1, chain(1, [99]), key)


@pytest.mark.parametrize("keyed", [True, False])
def test_a_record_forged_inside_a_torn_tail_does_not_pass_for_rot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, keyed: bool
) -> None:
    """A power cut tears the last record, whose message bytes hold a whole
    record with a high number (one copy at each offset mod 8, so one lies
    on the 8-byte grid that the check for rot reads). Forged without the
    store's key it fails its CRC, and the tail is cut off as torn. Without
    a key (``keyed=False``, the CRC of stores before keys existed) the
    forgery passes and refuses a replica that was merely torn."""
    if not keyed:
        monkeypatch.setattr(wal, "new_key", lambda: 0)
    s = LmdbStorage(tmp_path)
    s.append(chain(1, [1, 1]))
    s.sync()
    fake = _forged(10**12, 0)
    payload = b"\0".join([fake] * 8)
    tail = [Entry(index=3, term=1, data=payload, pos=end_pos(s))]
    s.append(tail)
    s.sync()
    crash(s)
    ((off2, _),) = [r for r in records(tmp_path) if r[1] == 2]
    path = tmp_path / wal.WAL_NAME
    os.truncate(path, len(wal_bytes(tmp_path)) - 8)  # the second write cut short
    assert len(wal_bytes(tmp_path)) > off2 + len(payload)  # every copy is on disk
    if not keyed:
        with pytest.raises(StorageCorrupted, match="rotted"):
            LmdbStorage(tmp_path)
        return
    with caplog.at_level(logging.WARNING):
        r = LmdbStorage(tmp_path)
    assert "torn or damaged record" in caplog.text
    assert (r.wal_replayed, r.last_index()) == (1, 2)
    r.close()


def test_a_store_logged_before_keys_replays_then_logs_under_a_new_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:  # the build before keys: no key, plain CRC32
        m.setattr(LmdbStorage, "_new_wal_key", lambda self: None)
        old = LmdbStorage(tmp_path)
        old.append(chain(1, [1, 1]))
        old.sync()
        assert old._wal_key == 0
        crash(old)
    assert wal_key(tmp_path) == 0 and [q for _, q in records(tmp_path, 0)] == [1]
    s = LmdbStorage(tmp_path)
    assert (s.wal_replayed, s.last_index()) == (1, 2)
    assert s._wal_key != 0 and wal_bytes(tmp_path) == b""  # covered, emptied, keyed
    s.append(chain(3, [1], pos=end_pos(s)))
    s.sync()
    crash(s)
    key = wal_key(tmp_path)
    assert key != 0 and [q for _, q in records(tmp_path, key)] == [2]
    assert records(tmp_path, 0) == []
    r = LmdbStorage(tmp_path, verify="full")
    assert (r.wal_replayed, r.last_index(), r._wal_key) == (1, 3, key)
    assert r.verify_all() == 3
    r.close()


def test_the_key_is_sealed(tmp_path: Path) -> None:
    s = LmdbStorage(tmp_path)
    s.close()
    env = lmdb.open(str(tmp_path), max_dbs=16)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        raw = bytearray(txn.get(b"wal_key", db=meta))
        raw[2] ^= 1
        txn.put(b"wal_key", bytes(raw), db=meta)
    env.close()
    with pytest.raises(StorageCorrupted, match="write-ahead log key"):
        LmdbStorage(tmp_path)
