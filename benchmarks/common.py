"""Helpers the benchmarks share: real local clusters, process and disk
measurements, produce bodies.

Clusters are :class:`dledger.cluster.LocalCluster` (one OS process per
member on 127.0.0.1); :func:`cluster` starts one in the run's scratch
directory and always stops its processes by PID on the way out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from benchmarks.registry import Context
from broker_adapter import codec
from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request

TOPIC = "bench"
QUEUES = 4

_counter = 0


@contextlib.contextmanager
def cluster(
    ctx: Context,
    *,
    voters: int = 3,
    learners: int = 0,
    settings: dict[str, object] | None = None,
    topic: str | None = TOPIC,
    queues: int = QUEUES,
) -> Iterator[tuple[LocalCluster, int]]:
    """A started cluster and its leader; the topic is created when named."""
    global _counter
    _counter += 1
    d = ctx.work_dir / f"c{_counter}-{voters}v{learners}l"
    lc = LocalCluster.create(d, voters=voters, learners=learners, settings=settings)
    try:
        lc.start_all()
        leader = lc.wait_leader(timeout_s=60)
        if topic is not None:
            create_topic(lc.http(leader), topic, queues)
        if learners:
            wait_caught_up(lc, timeout_s=30)
        yield lc, leader
    finally:
        lc.down()


def set_retention(lc: LocalCluster, addr: str, max_bytes: int) -> None:
    """Retention by size only (no age limit), through the node at ``addr``."""
    r = http_request(
        addr,
        "PUT",
        "/v1/retention",
        orjson.dumps({"max_bytes": max_bytes, "max_age_ms": 0}),
        timeout_s=10,
        headers={"Content-Type": "application/json", **lc.admin_headers()},
    )
    if r.status != 200:
        raise RuntimeError(f"setting retention failed: {r.status} {r.body[:200]!r}")


def create_topic(addr: str, name: str, queues: int) -> None:
    body = orjson.dumps({"name": name, "queues": queues})
    deadline = time.monotonic() + 30
    while True:
        try:
            r = http_request(addr, "POST", "/v1/topics", body, timeout_s=10)
            if r.status in (200, 201, 409):
                return
        except HTTP_ERRORS:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not create topic {name} on {addr}")
        time.sleep(0.1)


def wait_caught_up(lc: LocalCluster, timeout_s: float, ids: list[int] | None = None) -> None:
    """Until every running member has applied the leader's commit index."""
    deadline = time.monotonic() + timeout_s
    while True:
        leader = lc.leader()
        if leader is not None:
            lst = lc.status(leader)
            target = int(lst["commit"]) if lst else 0
            ok = True
            for nid in ids if ids is not None else lc.ids():
                st = lc.status(nid)
                if st is None or int(st.get("applied", 0)) < target:
                    ok = False
                    break
            if ok:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"members did not catch up within {timeout_s}s")
        time.sleep(0.05)


def followers(lc: LocalCluster, leader: int) -> list[int]:
    return [m.id for m in lc.spec.members if m.role == "voter" and m.id != leader]


def learner_ids(lc: LocalCluster) -> list[int]:
    return [m.id for m in lc.spec.members if m.role == "learner"]


def rss_bytes(pid: int | None) -> int:
    """Resident set size of ``pid`` (0 when gone)."""
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes(pid: int | None) -> int:
    """Anonymous resident memory of ``pid`` (``RssAnon``: the heap, what the
    process itself holds). ``VmRSS`` also counts pages of LMDB's memory-mapped
    files the process touched: page cache the kernel can reclaim, which grows
    with the data read or written, not with what the process keeps."""
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (st_blocks: LMDB files are sparse)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def produce_body(n_msgs: int, size: int, queue: int | None = None) -> bytes:
    """A produce request body of ``n_msgs`` UTF-8 values of ``size`` bytes."""
    msgs: list[dict[str, Any]] = []
    for i in range(n_msgs):
        v = (f"{i:08d}" + "m" * size)[:size]
        m: dict[str, Any] = {"value": v, "encoding": "utf-8"}
        if queue is not None:
            m["queue"] = queue
        msgs.append(m)
    return orjson.dumps({"messages": msgs})


def produce_batch(n_msgs: int, size: int, queue: int | None = None) -> bytes:
    """The same batch as :func:`produce_body` in the binary produce body
    (``BATCH_CONTENT_TYPE``, what the Python client sends)."""
    born = int(time.time() * 1000)
    rows: list[codec.MessageRow] = [
        ((f"{i:08d}" + "m" * size)[:size].encode(), "", (), (), queue, None, born)
        for i in range(n_msgs)
    ]
    return codec.encode_batch(rows)


def produce_url(addr: str, topic: str = TOPIC) -> str:
    return f"http://{addr}/v1/topics/{topic}/messages"


def host_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}
