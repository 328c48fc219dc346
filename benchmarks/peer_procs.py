"""Child processes of the external peers (etcd, nats-server).

Every process started here is remembered by PID until it is stopped;
:func:`stop_all` (also registered with ``atexit``) stops what is left. A
child also gets ``PR_SET_PDEATHSIG`` = SIGKILL, so a benchmark process that
is itself SIGKILLed does not leave servers running. Stopping is by PID:
SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from dledger.cluster import cpu_ticks

_LIVE: dict[int, subprocess.Popen[bytes]] = {}
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(cmd: list[str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout+stderr to ``log_path``; remembered until stopped."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    _LIVE[proc.pid] = proc
    return proc


def stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Stop one child by its PID: SIGTERM, wait ``grace_s``, then SIGKILL; reaped."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
    finally:
        _LIVE.pop(proc.pid, None)


def stop_all() -> None:
    for proc in list(_LIVE.values()):
        stop(proc, grace_s=2.0)


def live_pids() -> list[int]:
    """PIDs started here and not yet stopped (for tests)."""
    return list(_LIVE)


atexit.register(stop_all)


def describe(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
    try:
        tail = log_path.read_text(errors="replace")[-1500:]
    except OSError:
        tail = ""
    return f"({state}; log tail: {tail!r})"


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.1)


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` summed, in seconds (a gone PID counts 0)."""
    hz = os.sysconf("SC_CLK_TCK")
    return sum((cpu_ticks(p) or 0) for p in pids) / hz


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` exists (or only a zombie we do not own)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return raw[raw.rindex(")") + 2 :].split()[0] == "Z"
