"""A cProfile profile of a leader under load.

py-spy cannot read this interpreter's version from a running process here,
so a node runs under ``python -m cProfile`` instead: in a fresh cluster,
member 1 is started by PID under cProfile (the others normally), made
leader by a leadership transfer, loaded for a while, then stopped with
SIGTERM (the node exits through its normal shutdown path, so cProfile
writes its statistics). A fresh cluster keeps the replay of an existing
log out of the profile. Only the event-loop thread is profiled,
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

from benchmarks.common import QUEUES, TOPIC, create_topic
from benchmarks.registry import Context
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
    ctx: Context,
    out_prof: Path,
    load: Callable[[str], Any],
    *,
    voters: int = 3,
    settings: dict[str, object] | None = None,
    top: int = 25,
) -> dict[str, Any]:
    """A fresh cluster whose member 1 runs under cProfile from its start
    (so no log replay is in the profile); member 1 is made leader, loaded
    with ``load(http_address)`` (blocking), then stopped with SIGTERM.
    Returns the top functions by own and by cumulative time."""
    lc = LocalCluster.create(
        ctx.work_dir / f"profile-{out_prof.stem}", voters=voters, settings=settings
    )
    out_prof.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "cProfile",
        "-o",
        str(out_prof),
        "-m",
        "dledger_app.cli",
        "node",
        "--cluster",
        str(lc.cluster_path),
        "--id",
        "1",
    ]
    proc: subprocess.Popen[bytes] | None = None
    try:
        lc.start_all([nid for nid in lc.ids() if nid != 1])
        with open(lc.log_path(1), "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        addr = lc.http(1)
        _wait_http(addr, 30)
        lc.wait_leader(30)
        _make_leader(lc, 1)
        create_topic(addr, TOPIC, QUEUES)
        load(addr)
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        lc.down()
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
