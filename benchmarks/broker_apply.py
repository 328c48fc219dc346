"""Apply throughput of the broker state machine and its memory per million
stored messages (no network, no Raft, no disk): what one replica's apply
loop costs.

    .venv/bin/python -m benchmarks.broker_apply [--messages N] [--batch B] [--body BYTES]

Entries are encoded up front (the leader's work), then applied in order to a
fresh :class:`BrokerState`; the time of the apply loop alone gives messages/s.
Memory is measured twice: tracemalloc's traced bytes of the state after the
run (what Python objects the adapter holds) and the RSS delta of the process.
Also reports snapshot size and snapshot/restore time.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import tempfile
import time
import tracemalloc

from broker_adapter import (
    BrokerState,
    BrokerStateMachine,
    CommandKind,
    Message,
    encode_produce,
    encode_topic,
)
from broker_adapter.bodies import Bodies, LmdbBodies, MemoryBodies
from dledger.core.types import Entry


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def build(n: int, batch: int, body: int, queues: int) -> list[Entry]:
    entries: list[Entry] = []
    pos = 0

    def add(data: bytes) -> None:
        nonlocal pos
        e = Entry(len(entries) + 1, 1, data=data, pos=pos)
        entries.append(e)
        pos = e.end_pos

    add(encode_topic(CommandKind.CREATE_TOPIC, "bench", 1, queues))
    payload = bytes(body)
    for k in range(0, n, batch):
        msgs = [Message(payload, tag="t", keys=(f"k{k + i}",)) for i in range(min(batch, n - k))]
        add(encode_produce("bench", msgs, 1_000 + k))
    return entries


def run(n: int, batch: int, body: int, queues: int, bodies: str = "lmdb") -> dict[str, float]:
    entries = build(n, batch, body, queues)
    tmp = tempfile.TemporaryDirectory(prefix="broker-apply-")
    made = 0

    def store() -> Bodies:
        """Where records go: LMDB as on a node (memory holds the index only),
        or a dict (the pure adapter, as in the tests)."""
        nonlocal made
        made += 1
        if bodies == "memory":
            return MemoryBodies()
        return LmdbBodies(os.path.join(tmp.name, f"b{made}"))

    entry_bytes = sum(len(e.data) for e in entries)
    # Throughput and RSS without tracemalloc (it slows allocation and adds
    # its own memory). RSS is the process's resident set delta: it includes
    # allocator slack, and pages freed by an earlier run in this process may
    # be reused, so this runs first and the first row of a run is the one to trust.
    gc.collect()
    rss0 = rss_bytes()
    st2 = BrokerState("bench", store())
    t = time.perf_counter()
    for e in entries:
        st2.apply(e)
    apply_s = time.perf_counter() - t
    rss1 = rss_bytes()
    tracemalloc.start()
    t0 = tracemalloc.take_snapshot()
    st = BrokerState("bench", store())
    for e in entries:
        st.apply(e)
    gc.collect()
    t1 = tracemalloc.take_snapshot()
    traced = sum(s.size_diff for s in t1.compare_to(t0, "filename"))
    tracemalloc.stop()
    del st, t0, t1
    # What a node runs: the broker plus the replica records (/raft/applied).
    sm = BrokerStateMachine(broker_name="bench", bodies=store())
    t = time.perf_counter()
    for e in entries:
        sm.apply(e)
    node_s = time.perf_counter() - t
    del sm
    t = time.perf_counter()
    snap = st2.snapshot()
    snap_s = time.perf_counter() - t
    t = time.perf_counter()
    BrokerState.restore(snap, store())
    restore_s = time.perf_counter() - t
    tmp.cleanup()
    per_m = 1_000_000 / n
    return {
        "messages": n,
        "batch": batch,
        "body_bytes": body,
        "apply_msgs_per_s": n / apply_s,
        "apply_entries_per_s": len(entries) / apply_s,
        "node_sm_msgs_per_s": n / node_s,
        "log_bytes_per_msg": entry_bytes / n,
        "traced_mib_per_million": traced * per_m / (1 << 20),
        "traced_overhead_bytes_per_msg": traced / n - body,
        "rss_mib_per_million": (rss1 - rss0) * per_m / (1 << 20),
        "snapshot_mib": len(snap) / (1 << 20),
        "snapshot_s": snap_s,
        "restore_s": restore_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--body", type=int, nargs="+", default=[100, 1024])
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument(
        "--bodies",
        choices=["lmdb", "memory"],
        default="lmdb",
        help="where message records live: LMDB as on a node (default) or a dict",
    )
    a = ap.parse_args()
    print(f"records in {a.bodies}")
    print(
        f"{'batch':>5} {'body':>5} {'msgs/s':>10} {'entries/s':>10} {'node msgs/s':>11} "
        f"{'log B/msg':>9} "
        f"{'traced MiB/M':>12} {'overhead B/msg':>14} {'RSS MiB/M':>9} {'snap MiB':>8} "
        f"{'snap s':>6} {'restore s':>9}"
    )
    for body in a.body:
        for batch in a.batch:
            r = run(a.messages, batch, body, a.queues, a.bodies)
            print(
                f"{batch:>5} {body:>5} {r['apply_msgs_per_s']:>10.0f} "
                f"{r['apply_entries_per_s']:>10.0f} {r['node_sm_msgs_per_s']:>11.0f} "
                f"{r['log_bytes_per_msg']:>9.1f} "
                f"{r['traced_mib_per_million']:>12.1f} {r['traced_overhead_bytes_per_msg']:>14.1f} "
                f"{r['rss_mib_per_million']:>9.1f} {r['snapshot_mib']:>8.1f} "
                f"{r['snapshot_s']:>6.2f} {r['restore_s']:>9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
