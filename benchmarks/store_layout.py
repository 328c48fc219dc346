"""Bytes on disk per message, by part of the store, without a cluster.

``python -m benchmarks.store_layout [--entries N] [--per-entry M] [--size B]``
feeds N produce entries of M messages of B bytes (4 queues) through the
node's storage and the broker state in one temporary LMDB environment, the
way a node does (each entry in the log before it is applied, a checkpoint
every 50 entries), then prints the pages each database holds per message
and data.mdb's size per message against what the record format needs.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from broker_adapter import CommandKind, Message, codec, encode_produce, encode_topic
from broker_adapter.bodies import DurableBodies
from broker_adapter.node_sm import BrokerStateMachine
from dledger.core.types import Entry
from dledger.storage.lmdb_store import LmdbStorage

DBS = (b"log", b"logparts", b"cqblocks", b"entrypos", b"broker", b"records")


def run(entries: int, per_entry: int, size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        st = LmdbStorage(d, flush="async", map_size=64 << 30)
        sm = BrokerStateMachine(broker_name="layout", bodies=DurableBodies())
        sm.attach_storage(st)
        pos = 0
        index = 0

        def add(data: bytes) -> None:
            nonlocal pos, index
            index += 1
            e = Entry(index=index, term=1, data=data, pos=pos)
            pos = e.end_pos
            st.append([e])
            st.sync()
            sm.apply(e)

        add(encode_topic(CommandKind.CREATE_TOPIC, "t", 1, 4))
        body = b"x" * size
        t0 = time.perf_counter()
        for k in range(entries):
            add(encode_produce("t", [Message(body=body, queue=j % 4) for j in range(per_entry)], k))
            if k % 50 == 49:
                seq = sm.checkpoint()
                st.sync()
                sm.checkpoint_durable(seq)
        sm.checkpoint()
        st.sync()
        n = entries * per_entry
        out: dict[str, float] = {}
        with st.env.begin() as txn:
            for name in DBS:
                if name == b"log":
                    db = st._log_db
                elif name == b"logparts":
                    db = st._parts_db
                else:
                    db = st.side_db(name)
                s = txn.stat(db)
                pages = s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
                out[name.decode()] = pages * s["psize"] / n
        out["data.mdb"] = os.path.getsize(os.path.join(d, "data.mdb")) / n
        out["record format"] = float(len(codec.encode_record(Message(body=body, queue=0))))
        out["seconds"] = time.perf_counter() - t0
        st.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--per-entry", type=int, default=100)
    ap.add_argument("--size", type=int, default=100)
    a = ap.parse_args()
    r = run(a.entries, a.per_entry, a.size)
    fmt = r["record format"]
    print(f"{a.entries * a.per_entry:,} messages of {a.size} B, {a.per_entry} per entry")
    for name in DBS:
        print(f"  {name.decode():<10} {r[name.decode()]:8.1f} B/message")
    print(
        f"  data.mdb   {r['data.mdb']:8.1f} B/message; the record format needs {fmt:.0f}: "
        f"{r['data.mdb'] / fmt:.3f}x  ({r['seconds']:.1f} s, max RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB)"
    )


if __name__ == "__main__":
    main()
