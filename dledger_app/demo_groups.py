"""``python -m dledger_app.demo_groups``: several broker groups, end to end.

Starts three broker groups of three nodes and a three-node controller group
(12 processes on 127.0.0.1) plus a ``dledger proxy``, creates a topic whose
12 queues spread over the groups, produces through the routing client and
through the proxy, SIGKILLs two of g2's three nodes and shows that unordered
messages keep being acknowledged by g1 and g3 while ordered messages for g2
get a clear error, restarts g2, reads every acknowledged message back from
every replica of its group, and stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

from dledger.cluster import free_ports, http_request
from dledger_app.groups import MultiCluster
from dledger_app.multi_cli import wait_groups_live
from http_api.client import ApiError, Client
from http_api.routing import RoutingClient


def say(msg: str) -> None:
    print(msg, flush=True)


def read_all(address: str, topic: str, queues: list[int]) -> list[str]:
    c = Client([address], timeout_s=5.0, retry_for_s=10.0)
    out: list[str] = []
    for q in queues:
        off = 0
        while True:
            b = c.consume(topic, q, off, max_messages=1000)
            out += [r.value.decode() for r in b.records]
            if b.next_offset == off:
                break
            off = b.next_offset
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dledger_app.demo_groups", description=__doc__)
    ap.add_argument("--dir", default="run/demo-groups", help="where it lives (wiped first)")
    a = ap.parse_args(argv)
    d = Path(a.dir)
    if MultiCluster.is_multi(d):
        for lc in MultiCluster(d).all().values():
            lc.down()
    if d.exists():
        shutil.rmtree(d)
    mc = MultiCluster.create(d, groups=3, nodes=3)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        say(
            "==> starting the controller group (3 nodes) and broker groups g1, g2, g3 (3 nodes each)"
        )
        for lc in mc.all().values():
            lc.start_all()
        for name, lc in mc.all().items():
            lead = lc.wait_leader(90)
            say(f"    {name}: leader node {lead}, pids {[lc.pid(i) for i in lc.ids()]}")
        wait_groups_live(mc, 60)
        mc.wait_serving(60)  # every node's port is bound: the proxy's cannot be one of them
        (port,) = free_ports(1)
        paddr = f"127.0.0.1:{port}"
        log = open(d / "proxy.log", "ab")  # noqa: SIM115 (the child keeps it)
        proxy = subprocess.Popen(
            [sys.executable, "-m", "dledger_app.cli", "proxy", "--dir", str(d), "--listen", paddr],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        (d / "proxy.pid").write_text(str(proxy.pid))
        say(f"==> proxy (pid {proxy.pid}) on {paddr}")
        rc = RoutingClient(mc.endpoints(), group_retry_s=1.5, route_ttl_s=2.0)
        route = rc.create_topic("orders", 12)
        spread: dict[str, list[int]] = {}
        for q in route["queues"]:
            spread.setdefault(q["group"], []).append(q["queue"])
        say(f"==> topic 'orders', 12 queues, route version {route['version']}: {spread}")
        deadline = time.monotonic() + 30
        while True:  # the proxy answers once it listens
            try:
                r = http_request(paddr, "GET", "/healthz", timeout_s=1)
                if r.status == 200 and r.json().get("role") == "proxy":
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                say("the proxy did not start; see " + str(d / "proxy.log"))
                return 1
            time.sleep(0.1)
        px = Client([paddr], timeout_s=10.0, retry_for_s=10.0)
        producer = rc.producer()
        acked: dict[str, str] = {}  # value -> group

        def produce(n: int, tag: str) -> Counter[str]:
            per: Counter[str] = Counter()
            for k in range(n):
                v = f"{tag}-client-{k}"
                (ack,) = producer.send("orders", [v])
                g = rc.route("orders").owners[ack.queue]
                acked[v], per[g] = g, per[g] + 1
                v = f"{tag}-proxy-{k}"
                body = {"messages": [{"value": v, "encoding": "utf-8"}]}
                m = px.request("POST", "/v1/topics/orders/messages", body, safe=False)
                g = m["messages"][0]["group"]
                acked[v], per[g] = g, per[g] + 1
            return per

        say(
            f"==> 60 unordered messages (client and proxy): {dict(sorted(produce(30, 'before').items()))}"
        )
        g2 = mc.group("g2")
        lead = g2.wait_leader(30)
        victims = [lead, next(i for i in g2.ids() if i != lead)]
        for v in victims:
            g2.kill(v, signal.SIGKILL)
        say(f"==> SIGKILL g2 nodes {victims} (its leader and a follower): g2 cannot take writes")
        t0 = time.monotonic()
        per = produce(30, "outage")
        say(
            f"    60 more unordered messages in {time.monotonic() - t0:.1f} s, all acknowledged: "
            f"{dict(sorted(per.items()))} (none on g2)"
        )
        key = next(
            f"customer-{k}"
            for k in range(1000)
            if route["queues"][zlib.crc32(f"customer-{k}".encode()) % 12]["group"] == "g2"
        )
        try:
            producer.send("orders", [b"ordered"], sharding_key=key)
            say("    (unexpected) an ordered message for g2 was acknowledged")
            return 1
        except ApiError as exc:
            say(f"    an ordered message (sharding key {key!r}) for g2: {exc}")
        r = http_request(
            paddr,
            "POST",
            "/v1/topics/orders/messages",
            json.dumps(
                {"messages": [{"value": "o", "encoding": "utf-8", "sharding_key": key}]}
            ).encode(),
            timeout_s=30,
        )
        say(f"    the same through the proxy: {r.status} {r.json()['error']['code']}")
        for v in victims:
            g2.start(v)
        say(f"==> restarted g2 nodes {victims}; leader: node {g2.wait_leader(60)}")
        wait_groups_live(mc, 60)
        for _ in range(50):
            try:
                (ack,) = producer.send("orders", ["ordered, after"], sharding_key=key)
                break
            except ApiError:
                time.sleep(0.2)
        else:
            say("    g2 did not take the ordered message again")
            return 1
        acked["ordered, after"] = "g2"
        say(f"    the ordered message now goes to g2: queue {ack.queue} offset {ack.queue_offset}")
        say("==> reading every queue back from every replica of its group")
        for name, lc in mc.groups().items():
            mine = [q["queue"] for q in route["queues"] if q["group"] == name]
            want = sorted(v for v, g in acked.items() if g == name)
            for nid in lc.ids():
                deadline = time.monotonic() + 60
                while True:
                    got = read_all(lc.http(nid), "orders", mine)
                    if set(want) <= set(got) or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                dups = [v for v, c in Counter(got).items() if c > 1]
                ok = set(want) <= set(got) and not dups
                say(
                    f"    {name} node {nid}: {len(got)} messages, every acknowledged one exactly "
                    f"once: {'yes' if ok else 'NO'}"
                )
                if not ok:
                    return 1
        return 0
    finally:
        mc.down(proxy)
        say("==> stopped every process it started (12 nodes and the proxy)")


if __name__ == "__main__":
    sys.exit(main())
