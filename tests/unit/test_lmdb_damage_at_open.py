"""Bit flips in an LMDB data file surface as StorageCorrupted at open, never as
a raw lmdb error (found by the jepsen_like corrupt nemesis: MDB_CORRUPTED from
a cursor while verifying the tail made the node exit 1 with a traceback
instead of 2 with "rebuild this replica")."""

from __future__ import annotations

import random
from pathlib import Path

from dledger.core.types import Entry
from dledger.errors import StorageCorrupted
from dledger.storage.lmdb_store import LmdbStorage


def _damaged_store(path: Path, seed: int) -> None:
    st = LmdbStorage.open(path)
    st.append([Entry(index=i, term=1, data=bytes([i % 251]) * 200, pos=(i - 1) * 200)
               for i in range(1, 3001)])  # fmt: skip
    st.sync()
    st.close()
    rng = random.Random(seed)
    data = path / "data.mdb"
    size = data.stat().st_size
    with data.open("r+b") as fh:
        for _ in range(16):
            x = rng.randrange(max(0, size - (256 << 10)), size)
            fh.seek(x)
            b = fh.read(1)
            fh.seek(x)
            fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def test_damage_met_while_opening_is_storage_corrupted(tmp_path: Path) -> None:
    outcomes = set()
    for seed in range(60):
        d = tmp_path / str(seed)
        _damaged_store(d, seed)
        try:
            LmdbStorage.open(d).close()
            outcomes.add("opened")
        except StorageCorrupted:
            outcomes.add("refused")
    assert "refused" in outcomes
