"""Each replica catches up at its own random share of the bounds (so
followers fed the same entries do not stall at the same one): the share
comes from the storage's own generator, which a forked child reseeds as
Python reseeds the process-wide one."""

from __future__ import annotations

import json
import os

from dledger.storage import lmdb_store


def test_shares_are_within_bounds_and_vary() -> None:
    shares = [lmdb_store._catch_up_share() for _ in range(200)]
    assert all(lmdb_store.CATCH_UP_SHARE_MIN <= s <= 1.0 for s in shares)
    assert len(set(shares)) > 150


def test_a_forked_child_draws_apart_from_its_parent() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next few shares, then out without cleanup
        os.write(w, json.dumps([lmdb_store._catch_up_share() for _ in range(4)]).encode())
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    with os.fdopen(r, "rb") as f:
        child = json.loads(f.read())
    parent = [lmdb_store._catch_up_share() for _ in range(4)]
    assert child != parent, "a forked child repeats its parent's shares"
