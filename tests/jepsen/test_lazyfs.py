"""The lazyfs filesystem itself, and LMDB storage on it (power loss, disk errors).

One daemon per test module, mounted under a temporary directory. Needs
root, /dev/fuse, fusermount3 and pyfuse3; skips otherwise, saying which.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dledger.core.types import Entry
from dledger.errors import StorageFailed
from dledger.storage.lmdb_store import LmdbStorage
from jepsen_like.control import lazyfs_call
from jepsen_like.lazyfs import why_unavailable

WHY = why_unavailable()
pytestmark = [
    pytest.mark.jepsen,
    pytest.mark.skipif(WHY is not None, reason=f"needs lazyfs: {WHY}"),
]

REPO = Path(__file__).resolve().parents[2]


class Fs:
    def __init__(self, root: Path) -> None:
        self.mount = root / "m"
        self.backing = root / "b"
        self.sock = root / "ctl.sock"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jepsen_like.lazyfs", "--backing", str(self.backing),
             "--mount", str(self.mount), "--control", str(self.sock)],
            env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not (os.path.ismount(self.mount) and self.sock.exists()):
            assert self.proc.poll() is None, self.proc.stdout and self.proc.stdout.read()
            assert time.monotonic() < deadline, "lazyfs did not mount in 20 s"
            time.sleep(0.05)

    def __call__(self, **req: Any) -> dict[str, Any]:
        return lazyfs_call(self.sock, **req)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        assert not os.path.ismount(self.mount), "lazyfs left its mount behind"


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fs]:
    f = Fs(tmp_path_factory.mktemp("lazyfs"))
    try:
        yield f
    finally:
        f.stop()


def test_unsynced_writes_are_dropped_and_mmap_sees_the_durable_bytes(fs: Fs) -> None:
    p = fs.mount / "plain"
    with open(p, "wb") as f:
        f.write(b"A" * 8192)
        f.flush()
        os.fsync(f.fileno())
        f.seek(4096)
        f.write(b"B" * 8192)  # unsynced: grows the file too
        f.flush()
    assert p.read_bytes() == b"A" * 4096 + b"B" * 8192  # the process sees its writes
    assert (fs.backing / "plain").read_bytes() == b"A" * 8192  # the "platter" does not
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[4096:4100] == b"BBBB"
    out = fs(cmd="drop", tear=False, seed=0)
    assert out["dropped_bytes"] >= 8192
    assert p.read_bytes() == b"A" * 8192
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[4096:4100] == b"AAAA"  # no stale page from before the drop


def test_a_torn_drop_keeps_an_ordered_prefix_and_part_of_one_write(fs: Fs) -> None:
    p = fs.mount / "torn"
    with open(p, "wb") as f:
        f.flush()
        os.fsync(f.fileno())
        for k in range(8):
            f.write(bytes([65 + k]) * 4096)
            f.flush()
    out = fs(cmd="drop", tear=True, seed=7)
    torn = out["torn"]
    assert torn is not None and torn["file"] == "torn", out
    data = p.read_bytes()
    kept = torn["kept_ops"]
    # Every write before the torn one is whole, in order; nothing after it.
    assert data[: kept * 4096] == b"".join(bytes([65 + k]) * 4096 for k in range(kept))
    assert len(data) <= (kept + 1) * 4096
    if torn["torn_at_bytes"] > 0:
        assert len(data) == kept * 4096 + torn["torn_at_bytes"]
        assert torn["torn_at_bytes"] % 512 == 0


def test_a_failed_fsync_loses_the_pending_writes_and_a_retry_succeeds(fs: Fs) -> None:
    """The Linux behaviour the storage must not trust (fsyncgate)."""
    p = fs.mount / "fsyncgate"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"x" * 4096)
        fs(cmd="fail", op="fsync", errno="EIO")
        with pytest.raises(OSError) as ei:
            os.fsync(fd)
        assert ei.value.errno == 5
        fs(cmd="heal")
        os.fsync(fd)  # "succeeds": the data is gone
        assert (fs.backing / "fsyncgate").read_bytes() == b""
    finally:
        os.close(fd)


def _fill(st: LmdbStorage, n: int) -> None:
    last = st.last_index()
    pos = st.entries(last, last + 1)[0].end_pos if last else 0
    for i in range(last + 1, last + n + 1):
        e = Entry(i, 1, data=os.urandom(200), pos=pos)
        pos = e.end_pos
        st.append([e])
        st.sync()


def _reopen_elsewhere(path: Path, flush: str) -> int:
    """The last index a fresh process finds (LMDB keeps one environment per
    process and path, so the reopen must not happen here)."""
    code = (
        "import sys; from dledger.storage.lmdb_store import LmdbStorage; "
        f"s = LmdbStorage({str(path)!r}, flush={flush!r}, verify='full'); "
        "print(s.last_index(), s.verify_all())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0])


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_lmdb_after_a_power_loss(fs: Fs, flush: str) -> None:
    """sync: every synced batch survives; async: the batches since the last
    flush are lost, and what remains is a consistent log."""
    d = fs.mount / f"lmdb-{flush}"
    st = LmdbStorage(d, flush=flush, flush_interval_s=3600)  # type: ignore[arg-type]
    _fill(st, 200)
    st.flush()
    _fill(st, 100)
    fs(cmd="drop", tear=False, seed=0)
    last = _reopen_elsewhere(d, flush)
    assert last == (300 if flush == "sync" else 200)
    st._env.close()  # the "crashed" process's handle; nothing is flushed


@pytest.mark.parametrize(("op", "err"), [("fsync", "EIO"), ("write", "ENOSPC")])
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_lmdb_fails_stop_on_a_disk_error_and_never_retries(
    fs: Fs, flush: str, op: str, err: str
) -> None:
    d = fs.mount / f"fail-{flush}-{op}"
    st = LmdbStorage(d, flush=flush)  # type: ignore[arg-type]
    _fill(st, 5)
    st.flush()
    fs(cmd="fail", op=op, errno=err)
    try:
        st.append([Entry(6, 1, data=b"y" * 100, pos=st.entries(5, 6)[0].end_pos)])
        with pytest.raises(StorageFailed, match="the disk under") as ei:
            st.sync()
            st.flush()  # async mode: the commit went to the page cache; the fsync fails
        assert err in str(ei.value) or os.strerror(5 if err == "EIO" else 28) in str(ei.value)
    finally:
        fs(cmd="heal")
    before = fs(cmd="stats")["fsyncs"]
    # Poisoned: the healed disk is never asked again, nothing reports success.
    with pytest.raises(StorageFailed):
        st.flush()
    with pytest.raises(StorageFailed):
        st.sync()
    st.close()  # does not flush either
    assert fs(cmd="stats")["fsyncs"] == before
    fs(cmd="drop", tear=False, seed=0)  # and the power goes: entry 6 was never durable
    assert _reopen_elsewhere(d, flush) == 5


class _Died(Exception):
    """The process stopped between a write and its fsync."""


# Seeds whose tear falls inside the record: FUSE hands the 20 KB write over
# as a sliver up to a page boundary and the rest; these seeds tear the rest.
@pytest.mark.parametrize("seed", [5, 7, 9])
def test_a_torn_write_ahead_log_record_is_cut_and_every_synced_batch_survives(
    fs: Fs, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sync() appends one record to the write-ahead log per batch: the power
    going while the last record is half on disk loses that record only."""
    d = fs.mount / f"wal-torn-{seed}"
    st = LmdbStorage(d)
    try:
        _fill(st, 40)  # each batch one record (LMDB catches up every half second)
        last = st.last_index()
        pos = st.entries(last, last + 1)[0].end_pos
        st.append([Entry(last + 1, 1, data=os.urandom(20_000), pos=pos)])

        def died(fd: int) -> None:
            raise _Died

        monkeypatch.setattr(os, "fdatasync", died)
        with pytest.raises(_Died):
            st.sync()
        monkeypatch.undo()
        out = fs(cmd="drop", tear=True, seed=seed, file=f"wal-torn-{seed}/wal")
        assert out["torn"] is not None and out["torn"]["file"].endswith("/wal"), out
        assert out["torn"]["torn_at_bytes"] > 0, out  # part of the record reached the disk
        assert _reopen_elsewhere(d, "sync") == last
    finally:
        st._env.close()
