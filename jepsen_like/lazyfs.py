"""A FUSE filesystem that loses what was never fsynced, on command.

Theory of operation
-------------------
One daemon per node (``python -m jepsen_like.lazyfs --backing B --mount M
--control SOCK``) mounts ``M`` over the real directory ``B``. Names and
metadata (create, unlink, rename, mkdir, chmod, ...) go to ``B`` at once, as
a journalling filesystem makes them durable quickly; file *contents* do not:
every ``write`` and ``truncate`` of a regular file is kept, in order, in the
daemon's memory (the "page cache") and reaches ``B`` only when that file is
fsynced (``fsync``/``fdatasync``, or any write through a descriptor opened
with ``O_SYNC``/``O_DSYNC``, which LMDB uses for its meta page). Reads see
``B`` with the pending writes laid over it, so a running process cannot tell
the difference.

The FUSE mount is write-through (no kernel writeback cache): every write
reaches the daemon when the process makes it, so the kernel never holds
dirty data of its own. Files are opened without ``keep_cache``, so the
kernel forgets its cached pages whenever a file is opened again; a drop also
invalidates every inode it touched. LMDB reads its data file through
``mmap``: those reads are served from the kernel page cache, filled by this
daemon's ``read``, and stay correct across a drop for that reason.

Control (one JSON object per line on a Unix socket, one reply per request):

``{"cmd": "drop", "tear": false, "seed": 1}``
    Power loss: forget every pending write of every file. With ``tear``,
    the pending writes of one file (the one written last) persist in order
    up to a point chosen by ``seed`` and the write in flight there is torn
    at a 512-byte sector boundary; everything after it is lost (the model
    of a disk that persists in order and loses power mid-write). With
    ``"file": "<path under the backing directory>"`` that file is the one
    torn, when it has pending writes. The caller must have killed the
    process using the files first.
``{"cmd": "fail", "op": "fsync"|"write", "errno": "EIO"|"ENOSPC"}``
    Disk errors from now on: every fsync (or every write) of a regular file
    fails with that errno. A failed fsync also discards that file's pending
    writes, as Linux does when writeback fails (the pages are marked clean
    and the error is reported once): a second fsync then "succeeds" with
    the data gone, which is the trap PostgreSQL fell into ("fsyncgate").
``{"cmd": "heal"}``
    No more errors.
``{"cmd": "stats"}`` / ``{"cmd": "ping"}``
    Counters (pending bytes, fsyncs, drops, failures).
``{"cmd": "stop"}``
    Unmount and exit.

Never pickle: the control protocol is JSON; nothing is persisted but the
backing files themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import random
import signal
import stat
import sys
from dataclasses import dataclass, field
from typing import Any

SECTOR = 512
FSNAME = "jepsen-lazyfs"

# The daemon needs pyfuse3 (PyPI, built over Debian's libfuse3) and trio; the
# harness imports this module without them. Typed Any so that the checks
# read the same with and without the optional packages.
pyfuse3: Any
trio: Any
try:
    pyfuse3 = importlib.import_module("pyfuse3")
    trio = importlib.import_module("trio")
except ImportError:  # reported by why_unavailable()
    pyfuse3 = None
    trio = None


def why_unavailable() -> str | None:
    """None when this machine can mount a lazyfs; else why not, in words."""
    if pyfuse3 is None:
        return "the Python package pyfuse3 is not installed (pip install 'dledger-py[faultfs]')"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0:
        return "mounting FUSE filesystems here needs root"
    if not any(
        os.access(os.path.join(d, "fusermount3"), os.X_OK)
        for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")
    ):
        return "fusermount3 is missing (Debian package fuse3)"
    return None


@dataclass
class _File:
    """Pending (unsynced) changes of one regular file, in the order made."""

    ops: list[tuple[int, int, bytes]] = field(default_factory=list)  # (kind, off/size, data)
    size: int = 0  # logical size (backing size with the ops applied)
    fd: int = -1  # an O_RDWR descriptor on the backing file
    opens: int = 0


_WRITE, _TRUNC = 0, 1


def _errno(name: str) -> int:
    code = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC}.get(name)
    if code is None:
        raise ValueError(f"unsupported errno {name!r} (EIO or ENOSPC)")
    return code


if pyfuse3 is not None:

    class LazyOps(pyfuse3.Operations):  # type: ignore[misc]
        """Passthrough to the backing directory, contents held until fsync."""

        enable_writeback_cache = False

        def __init__(self, backing: str) -> None:
            super().__init__()
            self.backing = os.path.abspath(backing)
            st = os.lstat(self.backing)
            self._root_ino = st.st_ino
            self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: self.backing}
            self.lookups: dict[int, int] = {}
            self.files: dict[int, _File] = {}
            self.handles: dict[int, tuple[int, int]] = {}  # fh -> (inode, open flags)
            self._next_fh = 1
            self.fail_op: str | None = None
            self.fail_errno = 0
            self.counters: dict[str, int] = {
                "writes": 0,
                "fsyncs": 0,
                "drops": 0,
                "dropped_bytes": 0,
                "torn_writes": 0,
                "failed_fsyncs": 0,
                "failed_writes": 0,
                "lost_on_failed_fsync_bytes": 0,
            }

        # -- inodes and paths ---------------------------------------------------
        def _ino(self, st: os.stat_result) -> int:
            return pyfuse3.ROOT_INODE if st.st_ino == self._root_ino else int(st.st_ino)

        def _path(self, inode: int) -> str:
            try:
                return self.paths[inode]
            except KeyError:
                raise pyfuse3.FUSEError(errno.ENOENT) from None

        def _attrs(self, st: os.stat_result, inode: int) -> Any:
            a = pyfuse3.EntryAttributes()
            for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_blksize"):
                setattr(a, name, getattr(st, name))
            a.st_ino = inode
            f = self.files.get(inode)
            a.st_size = f.size if f is not None and f.fd >= 0 else st.st_size
            a.st_blocks = (a.st_size + 511) // 512
            a.st_atime_ns = st.st_atime_ns
            a.st_mtime_ns = st.st_mtime_ns
            a.st_ctime_ns = st.st_ctime_ns
            a.generation = 0
            a.entry_timeout = 1.0
            a.attr_timeout = 1.0
            return a

        def _stat(self, path: str) -> os.stat_result:
            try:
                return os.lstat(path)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

        def _remember(self, path: str, st: os.stat_result) -> int:
            ino = self._ino(st)
            self.paths[ino] = path
            self.lookups[ino] = self.lookups.get(ino, 0) + 1
            return ino

        async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
            n = os.fsdecode(name)
            parent = self._path(parent_inode)
            if n == ".":
                path = parent
            elif n == "..":
                path = os.path.dirname(parent) if parent != self.backing else parent
            else:
                path = os.path.join(parent, n)
            st = self._stat(path)
            ino = self._remember(path, st)
            return self._attrs(st, ino)

        async def forget(self, inode_list: Any) -> None:
            for inode, nlookup in inode_list:
                left = self.lookups.get(inode, 0) - nlookup
                if left > 0:
                    self.lookups[inode] = left
                    continue
                self.lookups.pop(inode, None)
                f = self.files.get(inode)
                if inode != pyfuse3.ROOT_INODE and (f is None or f.opens == 0):
                    self.paths.pop(inode, None)
                    if f is not None and not f.ops:
                        self._close_file(inode)

        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            return self._attrs(self._stat(self._path(inode)), inode)

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            path = self._path(inode)
            try:
                if fields.update_size:
                    f = self._file(inode)
                    f.ops.append((_TRUNC, int(attr.st_size), b""))
                    f.size = int(attr.st_size)
                if fields.update_mode:
                    os.chmod(path, stat.S_IMODE(attr.st_mode))
                if fields.update_uid or fields.update_gid:
                    os.chown(
                        path,
                        attr.st_uid if fields.update_uid else -1,
                        attr.st_gid if fields.update_gid else -1,
                    )
                if fields.update_atime or fields.update_mtime:
                    st = os.lstat(path)
                    os.utime(
                        path,
                        ns=(
                            attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                            attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns,
                        ),
                    )
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            return await self.getattr(inode)

        # -- directories ---------------------------------------------------------
        async def opendir(self, inode: int, ctx: Any) -> int:
            return inode

        async def readdir(self, fh: int, start_id: int, token: Any) -> None:
            path = self._path(fh)
            entries = []
            for name in sorted(os.listdir(path)):
                try:
                    st = os.lstat(os.path.join(path, name))
                except FileNotFoundError:
                    continue
                entries.append((name, st))
            for k, (name, st) in enumerate(entries):
                if k < start_id:
                    continue
                ino = self._ino(st)
                if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(st, ino), k + 1):
                    break
                self._remember(os.path.join(path, name), st)

        async def releasedir(self, fh: int) -> None:
            return None

        async def fsyncdir(self, fh: int, datasync: bool) -> None:
            return None  # names are durable at once

        async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
            path = os.path.join(self._path(parent_inode), os.fsdecode(name))
            try:
                os.mkdir(path, mode)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            st = self._stat(path)
            return self._attrs(st, self._remember(path, st))

        async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            path = os.path.join(self._path(parent_inode), os.fsdecode(name))
            try:
                os.rmdir(path)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

        async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            path = os.path.join(self._path(parent_inode), os.fsdecode(name))
            st = self._stat(path)
            try:
                os.unlink(path)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            ino = self._ino(st)
            f = self.files.get(ino)
            if f is not None and f.opens == 0:
                self._close_file(ino)

        async def rename(
            self,
            parent_inode_old: int,
            name_old: bytes,
            parent_inode_new: int,
            name_new: bytes,
            flags: int,
            ctx: Any,
        ) -> None:
            if flags:
                raise pyfuse3.FUSEError(errno.EINVAL)
            old = os.path.join(self._path(parent_inode_old), os.fsdecode(name_old))
            new = os.path.join(self._path(parent_inode_new), os.fsdecode(name_new))
            st = self._stat(old)
            replaced: os.stat_result | None = None
            with contextlib.suppress(FileNotFoundError):
                replaced = os.lstat(new)
            try:
                os.rename(old, new)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            ino = self._ino(st)
            self.paths[ino] = new
            if stat.S_ISDIR(st.st_mode):
                for k, p in list(self.paths.items()):
                    if p.startswith(old + os.sep):
                        self.paths[k] = new + p[len(old) :]
            if replaced is not None and replaced.st_ino != st.st_ino:
                f = self.files.get(self._ino(replaced))
                if f is not None and f.opens == 0:
                    self._close_file(self._ino(replaced))

        async def statfs(self, ctx: Any) -> Any:
            s = os.statvfs(self.backing)
            out = pyfuse3.StatvfsData()
            for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail"):
                setattr(out, name, getattr(s, name))
            for name in ("f_files", "f_ffree", "f_favail", "f_namemax"):
                setattr(out, name, getattr(s, name))
            return out

        # -- files ----------------------------------------------------------------
        def _file(self, inode: int) -> _File:
            f = self.files.get(inode)
            if f is None:
                f = self.files[inode] = _File()
            if f.fd < 0:
                try:
                    f.fd = os.open(self._path(inode), os.O_RDWR)
                except OSError as e:
                    raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
                f.size = os.fstat(f.fd).st_size
            return f

        def _close_file(self, inode: int) -> None:
            f = self.files.pop(inode, None)
            if f is not None and f.fd >= 0:
                os.close(f.fd)

        def _new_fh(self, inode: int, flags: int) -> Any:
            fh = self._next_fh
            self._next_fh += 1
            self.handles[fh] = (inode, flags)
            self._file(inode).opens += 1
            info = pyfuse3.FileInfo(fh=fh)
            info.keep_cache = False  # a reopened file is read from this daemon again
            info.direct_io = False  # mmap needs the page cache
            return info

        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            st = self._stat(self._path(inode))
            if not stat.S_ISREG(st.st_mode):
                raise pyfuse3.FUSEError(errno.EINVAL)
            return self._new_fh(inode, flags)

        async def create(
            self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
        ) -> Any:
            path = os.path.join(self._path(parent_inode), os.fsdecode(name))
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR | (flags & os.O_EXCL), mode)
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
            os.close(fd)
            st = self._stat(path)
            ino = self._remember(path, st)
            f = self.files.get(ino)
            if f is not None and f.fd >= 0:  # a stale entry of a reused inode number
                self._close_file(ino)
            return self._new_fh(ino, flags), self._attrs(st, ino)

        async def read(self, fh: int, off: int, size: int) -> bytes:
            inode, _ = self.handles[fh]
            return self.read_view(inode, off, size)

        def read_view(self, inode: int, off: int, size: int) -> bytes:
            f = self._file(inode)
            end = min(off + size, f.size)
            if end <= off:
                return b""
            buf = bytearray(os.pread(f.fd, end - off, off))
            if len(buf) < end - off:
                buf.extend(bytes(end - off - len(buf)))
            # Replay the pending changes that touch [off, end) in order.
            for kind, at, data in f.ops:
                if kind == _TRUNC:
                    if at < end:
                        lo = max(at, off)
                        buf[lo - off : end - off] = bytes(end - lo)
                    continue
                lo, hi = max(at, off), min(at + len(data), end)
                if lo < hi:
                    buf[lo - off : hi - off] = data[lo - at : hi - at]
            return bytes(buf)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            inode, flags = self.handles[fh]
            if self.fail_op == "write":
                self.counters["failed_writes"] += 1
                raise pyfuse3.FUSEError(self.fail_errno)
            f = self._file(inode)
            f.ops.append((_WRITE, off, bytes(buf)))
            f.size = max(f.size, off + len(buf))
            self.counters["writes"] += 1
            if flags & (os.O_SYNC | os.O_DSYNC):
                # The kernel also sends an fsync for these; persisting here
                # keeps the promise even if it does not.
                self._persist(inode, f)
            return len(buf)

        async def flush(self, fh: int) -> None:
            return None  # close() is not fsync

        async def fsync(self, fh: int, datasync: bool) -> None:
            inode, _ = self.handles[fh]
            f = self._file(inode)
            self.counters["fsyncs"] += 1
            if self.fail_op == "fsync":
                self.counters["failed_fsyncs"] += 1
                lost = sum(len(d) for _, _, d in f.ops)
                self.counters["lost_on_failed_fsync_bytes"] += lost
                self._forget(inode, f)
                raise pyfuse3.FUSEError(self.fail_errno)
            self._persist(inode, f)

        async def release(self, fh: int) -> None:
            inode, _ = self.handles.pop(fh)
            f = self.files.get(inode)
            if f is None:
                return
            f.opens -= 1
            if f.opens == 0 and not f.ops and inode not in self.lookups:
                self._close_file(inode)
                self.paths.pop(inode, None)

        # -- durability ---------------------------------------------------------------
        def _persist(self, inode: int, f: _File, ops: int | None = None, torn: int = -1) -> None:
            """Apply the first ``ops`` pending changes (all when None) to the
            backing file; ``torn`` >= 0 also applies that many bytes of the next
            write."""
            todo = f.ops if ops is None else f.ops[:ops]
            for kind, at, data in todo:
                if kind == _TRUNC:
                    os.ftruncate(f.fd, at)
                else:
                    os.pwrite(f.fd, data, at)
            if torn >= 0 and ops is not None and ops < len(f.ops):
                kind, at, data = f.ops[ops]
                if kind == _WRITE and torn > 0:
                    os.pwrite(f.fd, data[:torn], at)
            if ops is None:
                f.ops.clear()
            # The backing files stand for the platter: no real fsync needed.

        def _forget(self, inode: int, f: _File) -> None:
            f.ops.clear()
            f.size = os.fstat(f.fd).st_size

        def drop(self, tear: bool, seed: int, file: str | None = None) -> dict[str, Any]:
            rng = random.Random(seed)
            touched = []
            total = 0
            torn_info: dict[str, Any] | None = None
            pending = [(i, f) for i, f in sorted(self.files.items()) if f.ops and f.fd >= 0]
            last_written = max(pending, key=lambda x: len(x[1].ops))[0] if pending else None
            if file is not None:
                want = os.path.join(self.backing, file)
                last_written = next(
                    (i for i, _ in pending if self.paths.get(i) == want), last_written
                )
            for inode, f in pending:
                n = len(f.ops)
                nbytes = sum(len(d) for _, _, d in f.ops)
                if tear and inode == last_written:
                    k = rng.randrange(n)
                    kind, _, data = f.ops[k]
                    cut = -1
                    if kind == _WRITE and len(data) > SECTOR:
                        cut = rng.randrange(1, (len(data) - 1) // SECTOR + 1) * SECTOR
                    self._persist(inode, f, ops=k, torn=cut)
                    torn_info = {
                        "file": os.path.relpath(self.paths.get(inode, "?"), self.backing),
                        "kept_ops": k,
                        "of_ops": n,
                        "torn_at_bytes": cut,
                    }
                    if cut > 0:
                        self.counters["torn_writes"] += 1
                total += nbytes
                self._forget(inode, f)
                touched.append(inode)
            self.counters["drops"] += 1
            self.counters["dropped_bytes"] += total
            return {"dropped_bytes": total, "files": len(touched), "torn": torn_info,
                    "inodes": touched}  # fmt: skip

        def pending_bytes(self) -> int:
            return sum(len(d) for f in self.files.values() for _, _, d in f.ops)

    async def _control(ops: LazyOps, sock_path: str) -> None:
        async def serve(stream: Any) -> None:
            buf = b""
            async with stream:
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        reply = await _handle(ops, line)
                        await stream.send_all(json.dumps(reply).encode() + b"\n")
                        if reply.get("stopping"):
                            pyfuse3.terminate()
                            return

        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(sock_path)
        sock.listen(16)
        await trio.serve_listeners(serve, [trio.SocketListener(sock)])

    async def _handle(ops: LazyOps, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "ping":
                return {"ok": True}
            if cmd == "stats":
                return {"ok": True, "pending_bytes": ops.pending_bytes(), **ops.counters}
            if cmd == "drop":
                file = req.get("file")
                out = ops.drop(
                    bool(req.get("tear")),
                    int(req.get("seed", 0)),
                    file if isinstance(file, str) else None,
                )
                for inode in out.pop("inodes"):
                    await trio.to_thread.run_sync(_invalidate, inode)
                return {"ok": True, **out}
            if cmd == "fail":
                op = req.get("op")
                if op not in ("fsync", "write"):
                    raise ValueError(f"op must be fsync or write, not {op!r}")
                ops.fail_errno = _errno(str(req.get("errno", "EIO")))
                ops.fail_op = op
                return {"ok": True}
            if cmd == "heal":
                ops.fail_op = None
                return {"ok": True}
            if cmd == "stop":
                return {"ok": True, "stopping": True}
            raise ValueError(f"unknown command {cmd!r}")
        except (ValueError, TypeError, KeyError) as e:
            return {"ok": False, "error": str(e)}

    def _invalidate(inode: int) -> None:
        # OSError: the kernel never cached it (or forgot it already).
        with contextlib.suppress(OSError):
            pyfuse3.invalidate_inode(inode, attr_only=False)

    async def _signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for _ in sigs:
                pyfuse3.terminate()  # main() returns; the caller unmounts
                return

    async def _main(ops: LazyOps, control: str) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_control, ops, control)
            nursery.start_soon(_signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jepsen_like.lazyfs", description=__doc__)
    p.add_argument("--backing", required=True)
    p.add_argument("--mount", required=True)
    p.add_argument("--control", required=True, help="Unix socket for commands")
    args = p.parse_args(argv)
    why = why_unavailable()
    if why is not None:
        print(f"lazyfs unavailable: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.backing, exist_ok=True)
    os.makedirs(args.mount, exist_ok=True)
    ops = LazyOps(args.backing)
    options = set(pyfuse3.default_options)
    options.discard("default_permissions")
    options |= {f"fsname={FSNAME}", "allow_other"}
    pyfuse3.init(ops, args.mount, options)
    try:
        trio.run(_main, ops, args.control)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
