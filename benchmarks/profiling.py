"""A cProfile profile of a leader under load.

py-spy cannot read this interpreter's version from a running process here,
so the node is restarted under ``python -m cProfile`` instead: the member is
stopped (SIGTERM), started again by PID under cProfile with the same cluster
file and id, made leader by a leadership transfer, loaded for a while, then
stopped with SIGTERM (the node exits through its normal shutdown path, so
cProfile writes its statistics). Only the event-loop thread is profiled,
which is where a node's CPU goes (fsyncs run in a worker thread).
"""

from __future__ import annotations

import contextlib
import io
import os
import pstats
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import wait_caught_up
from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request


def _wait_http(addr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http_request(addr, "GET", "/healthz", timeout_s=0.5).status == 200:
                return
        except HTTP_ERRORS:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{addr} did not come up under cProfile")


def _make_leader(lc: LocalCluster, node_id: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader = lc.leader()
        if leader == node_id:
            return
        if leader is not None:
            with contextlib.suppress(*HTTP_ERRORS):
                http_request(lc.http(leader), "POST", f"/raft/transfer?to={node_id}", timeout_s=5)
        time.sleep(0.2)
    raise TimeoutError(f"node {node_id} did not become leader")


def profile_leader(
    lc: LocalCluster,
    node_id: int,
    out_prof: Path,
    load: Callable[[str], Any],
    top: int = 25,
) -> dict[str, Any]:
    """Restart ``node_id`` under cProfile, make it leader, run ``load(addr)``
    (blocking), stop it, and return the top functions by own and total time.
    The member is left stopped; the caller tears the cluster down."""
    lc.stop(node_id)
    out_prof.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "cProfile",
        "-o",
        str(out_prof),
        "-m",
        "dledger.cli",
        "node",
        "--cluster",
        str(lc.cluster_path),
        "--id",
        str(node_id),
    ]
    with open(lc.log_path(node_id), "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        addr = lc.http(node_id)
        _wait_http(addr, 30)
        wait_caught_up(lc, 60, ids=[node_id])
        _make_leader(lc, node_id)
        load(addr)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    if not out_prof.exists():
        return {"error": "cProfile wrote no statistics"}
    return summarize_profile(out_prof, top)


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    st = pstats.Stats(str(path))
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{_short(file)}:{line}({fn})",
                "calls": nc,
                "own_s": tt,
                "cum_s": ct,
            }
        )
    by_own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_s"])[:top]
    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(40)
    path.with_suffix(".txt").write_text(buf.getvalue())
    return {"total_own_s": total, "by_own": by_own, "by_cum": by_cum, "file": str(path)}


def _short(file: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1]
    here = str(Path(__file__).resolve().parent.parent) + "/"
    return file.replace(here, "")
