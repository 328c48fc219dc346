"""The corrupt nemesis and the write-ahead log (no cluster: a real storage
directory, the nemesis's own damage routine).

The nemesis damages either LMDB's data file or, half the time when it holds
two whole records or more, the write-ahead log: bits flipped inside a record
that another record follows. That is rot the node must detect by CRC and
refuse to start on (``StorageCorrupted``, exit 2: rebuilt from its peers),
never replay around. The last record is left alone: damage there looks like
a torn write, which the node cuts off as never acknowledged.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from dledger.core.types import Entry
from dledger.errors import StorageCorrupted
from dledger.storage import wal
from dledger.storage.lmdb_store import LmdbStorage
from jepsen_like.control import Cluster, wal_key, wal_records


class _Stopped:
    """What Cluster.corrupt uses of a cluster: one stopped member."""

    def __init__(self, data_dir: Path) -> None:
        self.members = {1: SimpleNamespace(data_dir=data_dir)}

    def alive(self, node_id: int) -> bool:
        return False


class _WalFirst(random.Random):
    """A seeded rng whose coin picks the write-ahead log."""

    def random(self) -> float:
        return 0.0


def _crashed_log(d: Path, records: int, per_record: int = 3) -> list[Entry]:
    s = LmdbStorage(d)
    out: list[Entry] = []
    pos = 0
    for k in range(records):
        es = []
        for j in range(per_record):
            i = k * per_record + j + 1
            e = Entry(index=i, term=1, data=f"entry-{i:05d}".encode() * 3, pos=pos)
            pos = e.end_pos
            es.append(e)
        s.append(es)
        s.sync()
        out += es
    # a killed process: nothing more is written, the page cache keeps the rest
    s._close_wal()
    s._env.close()
    s._closed = True
    return out


def test_the_harness_reads_the_log_framing_as_the_node_does(tmp_path: Path) -> None:
    _crashed_log(tmp_path, 4)
    data = (tmp_path / wal.WAL_NAME).read_bytes()
    key = wal_key(tmp_path)
    assert key != 0  # a new store logs under a key of its own
    spans = wal_records(data, key)
    assert (
        [seq for seq, _, _ in spans]
        == [seq for seq, _ in wal.scan(data, 0, key=key).records]
        == [
            1,
            2,
            3,
            4,
        ]
    )
    off = 0
    for seq, start, end in spans:
        got = wal._record_at(data, start, key)
        assert start == off and got is not None and got[0] == seq
        assert end - start == wal.HEAD_SIZE + len(got[2])
        off = got[1]
    assert wal_records(data[: spans[-1][2] - 1], key) == spans[:3]  # a torn last record
    assert wal_records(data) == []  # without the key no record passes its CRC
    flipped = bytearray(data)
    flipped[spans[1][1] + 5] ^= 1  # in the length of record 2
    assert wal_records(bytes(flipped), key) == spans[:1]


@pytest.mark.parametrize("seed", range(12))
def test_damage_to_a_logged_record_is_refused_at_start(tmp_path: Path, seed: int) -> None:
    _crashed_log(tmp_path, 4)
    info = Cluster.corrupt(_Stopped(tmp_path), 1, _WalFirst(seed))  # type: ignore[arg-type]
    assert info["file"] == "wal" and info["mode"] == "bitflip", info
    assert 1 <= info["record"] < 4 and info["records"] == 4
    with pytest.raises(StorageCorrupted, match="write-ahead log"):
        LmdbStorage(tmp_path)


def test_a_log_of_one_record_leaves_the_log_alone(tmp_path: Path) -> None:
    _crashed_log(tmp_path, 1)
    before = (tmp_path / wal.WAL_NAME).read_bytes()
    info = Cluster.corrupt(_Stopped(tmp_path), 1, _WalFirst(3))  # type: ignore[arg-type]
    assert info["file"] == "data.mdb", info
    assert (tmp_path / wal.WAL_NAME).read_bytes() == before
