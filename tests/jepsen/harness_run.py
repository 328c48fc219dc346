"""Harness runs from tests: ``run`` starts ``python -m jepsen_like run`` as a
subprocess, after taking the harness's machine lock in the test process
(before the run's own clock, its subprocess timeout, starts). The lock is
held until the end of the test module (``conftest.py`` releases it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jepsen_like.control import LOCK_FD_ENV, RunLock

_LOCK = RunLock()
_HELD: list[bool] = []


def _take_machine_lock() -> int:
    """The harness's machine lock, taken here, before a run's clock (its
    subprocess timeout) starts: a run that waited inside for another
    session's run would spend its own time waiting. Held until the end of
    this module; each run inherits it (``JEPSEN_LIKE_LOCK_FD``)."""
    if not _HELD:
        if not _LOCK.acquire(1800, lambda msg: print(msg, file=sys.stderr, flush=True)):
            pytest.fail("another jepsen_like run held the machine lock for 30 minutes")
        _HELD.append(True)
    return _LOCK.fileno()


def release_machine_lock() -> None:
    if _HELD:
        _HELD.clear()
        _LOCK.release()


def run(
    out: Path, *args: str, timeout_s: float = 240, short_faults: bool = True
) -> tuple[int, dict[str, Any], str]:
    """One harness run; ``short_faults``: faults of 2.5-4 s, 2-3 s apart
    (else the command line's defaults)."""
    fd = _take_machine_lock()
    argv = [sys.executable, "-m", "jepsen_like", "run", "--out", str(out)]
    if short_faults:
        argv += ["--fault-seconds", "2.5", "4", "--quiet-seconds", "2", "3"]
    argv += args
    env = dict(os.environ, **{LOCK_FD_ENV: str(fd)})
    p = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=env,
        pass_fds=(fd,),
    )
    results_path = out / "results.json"
    if not results_path.exists():
        pytest.fail(
            f"no results.json (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p.returncode, json.loads(results_path.read_text()), p.stdout


def run_subcommand(args: list[str], *, timeout_s: float) -> tuple[int, str]:
    """``python -m jepsen_like ARGS`` holding the machine lock (its runs
    inherit it); returns the exit status and stdout plus stderr."""
    fd = _take_machine_lock()
    env = dict(os.environ, **{LOCK_FD_ENV: str(fd)})
    p = subprocess.run(
        [sys.executable, "-m", "jepsen_like", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=env,
        pass_fds=(fd,),
    )
    return p.returncode, p.stdout + p.stderr
