"""``python -m dledger.demo``: the newcomer's tour of a real local cluster.

Starts three node processes on 127.0.0.1 (LMDB storage, authenticated peer
links, fsync before every acknowledgement), writes a few messages through a
follower (which redirects to the leader), reads them back from every replica,
kills the leader with SIGKILL, shows a new leader taking over with nothing
lost, then stops every process it started.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request


def say(msg: str) -> None:
    print(msg, flush=True)


def _get(lc: LocalCluster, node: int, path: str) -> Any:
    res = http_request(lc.http(node), "GET", path, timeout_s=5)
    return res.json()


def produce(lc: LocalCluster, via: int, text: str) -> dict[str, Any]:
    """POST to ``via``; follow a 307 to the leader as any client would, and
    move on to another node when one is down or has no leader yet."""
    addrs = [lc.http(via)] + [lc.http(i) for i in lc.ids() if i != via]
    addr, k, last = addrs[0], 0, "nothing"
    for _ in range(100):
        try:
            res = http_request(addr, "POST", "/raft/propose", body=text.encode(), timeout_s=10)
        except HTTP_ERRORS as exc:
            last = f"{addr}: {exc}"
        else:
            if res.status == 200:
                out: dict[str, Any] = res.json()
                out["served_by"] = addr
                return out
            if res.status == 307:
                addr = res.headers["location"].split("//", 1)[1].split("/", 1)[0]
                continue
            last = f"{addr}: {res.status} {res.body[:200]!r}"
        k += 1
        addr = addrs[k % len(addrs)]
        time.sleep(0.1)
    raise RuntimeError(f"could not write {text!r}: last answer {last}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dledger.demo", description=__doc__)
    ap.add_argument("--dir", default="run/demo", help="where the cluster lives (wiped first)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    a = ap.parse_args(argv)
    d = Path(a.dir)
    if d.exists():
        LocalCluster(d).down()
        shutil.rmtree(d)
    lc = LocalCluster.create(d, voters=3)
    try:
        say(f"==> starting 3 nodes (cluster file {lc.cluster_path})")
        lc.start_all()
        try:
            leader = lc.wait_leader(timeout_s=60)
        except TimeoutError:
            say("no leader within 60 s; node 1's log:\n" + lc.log_tail(1))
            return 1
        for i in lc.ids():
            st = lc.status(i) or {}
            say(f"    node {i}: pid {lc.pid(i)}, http {lc.http(i)}, role {st.get('role')}, term {st.get('term')}")
        follower = next(i for i in lc.ids() if i != leader)
        say(f"==> producing 5 messages through follower {follower} (it redirects to leader {leader})")
        for k in range(1, 6):
            r = produce(lc, follower, f"hello #{k} from the demo")
            say(f"    acknowledged: index {r['index']}, term {r['term']} (by {r['served_by']})")
        time.sleep(0.3)
        say("==> consuming from every replica (each serves only what is committed)")
        for i in lc.ids():
            msgs = _get(lc, i, "/raft/messages?from=1&max=100")["messages"]
            say(f"    node {i}: " + ", ".join(f"{m['index']}:{m.get('text', '?')!r}" for m in msgs))
        say(f"==> SIGKILL the leader (node {leader}) and write again")
        t0 = time.monotonic()
        lc.kill(leader, signal.SIGKILL)
        survivor = next(i for i in lc.ids() if i != leader)
        r = produce(lc, survivor, "written after the failover")
        say(
            f"    acknowledged index {r['index']} in term {r['term']} "
            f"{(time.monotonic() - t0) * 1000:.0f} ms after the kill"
        )
        new_leader = lc.wait_leader(timeout_s=30, among=[i for i in lc.ids() if i != leader])
        say(f"    new leader: node {new_leader}")
        say(f"==> restarting node {leader}; it catches up from the others")
        lc.restart(leader)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = lc.status(leader) or {}
            if st.get("applied", 0) >= r["index"]:
                break
            time.sleep(0.2)
        msgs = _get(lc, leader, "/raft/messages?from=1&max=100")["messages"]
        say(f"    node {leader} now holds {len(msgs)} messages; last: {msgs[-1].get('text')!r}")
        say("==> status of the cluster")
        for i in lc.ids():
            st = lc.status(i) or {}
            say(
                f"    node {i}: role {st.get('role')}, term {st.get('term')}, "
                f"commit {st.get('commit')}, applied {st.get('applied')}"
            )
        say("done. Everything above ran on real processes; see README.md for the CLI.")
        return 0
    finally:
        if not a.keep:
            lc.down()
            say(f"==> stopped every node process (logs kept in {d})")


if __name__ == "__main__":
    sys.exit(main())
