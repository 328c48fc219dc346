"""Issue 15's live test: three broker groups of three nodes plus a three-node
controller group, real processes on 127.0.0.1, stopped by PID.

One cluster, in phases, with producers running throughout (unordered,
idempotent through the routing client; unordered, one message a request
through a ``dledger proxy`` process; every value unique):

1. SIGKILL the controller's leader: produce and consume go on (routes are
   cached); a new controller leader takes route changes.
2. SIGKILL two nodes (the leader and a follower) of group g2: g2's queues
   take no writes, g1 and g3 keep acknowledging (the availability figure of
   the outage is printed); ordered messages for g2 get ``GROUP_UNAVAILABLE``
   naming g2, from the client and from the proxy. Restart them.
3. SIGKILL two controller nodes (its majority): produce goes on; a route
   change answers ``503 CONTROLLER_UNAVAILABLE`` (through a broker node and
   the proxy). Restart them.
4. Every acknowledged message is read back exactly once from every replica
   of its group, at the queue and offset it was acknowledged with; no value
   (acknowledged or not) is stored twice anywhere.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dledger.cluster import free_ports, http_request
from dledger_app.groups import MultiCluster, stop_process
from http_api.client import ApiError, Client
from http_api.routing import GroupUnavailableError, RoutingClient
from tests.integration.multi import multi_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

START_TIMEOUT_S = 90.0
TOPIC = "live"
QUEUES = 12


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Op:
    value: str
    via: str  # "client" | "proxy"
    t0: float
    t1: float
    outcome: str  # "ok" | "fail" | "unknown"
    queue: int = -1
    offset: int = -1
    group: str = ""
    code: str = ""


class Producers:
    """Unordered producers, one thread each, recording every attempt."""

    def __init__(self, rc: RoutingClient, proxy: str) -> None:
        self.rc = rc
        self.proxy = Client([proxy], timeout_s=10.0, retry_for_s=3.0)
        self.ops: list[Op] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._guard, args=(self._client_loop,), daemon=True),
            threading.Thread(target=self._guard, args=(self._proxy_loop,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _record(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def _client_loop(self) -> None:
        p = self.rc.producer()
        k = 0
        while not self._stop.is_set():
            k += 1
            v = f"c-{k}"
            t0 = time.monotonic()
            try:
                (a,) = p.send(TOPIC, [v])
                r = self.rc.route(TOPIC)
                self._record(
                    Op(
                        v,
                        "client",
                        t0,
                        time.monotonic(),
                        "ok",
                        a.queue,
                        a.queue_offset,
                        r.owners[a.queue],
                    )
                )
            except ApiError as exc:
                kind = "unknown" if exc.code in ("OUTCOME_UNKNOWN", "CONNECTION") else "fail"
                self._record(Op(v, "client", t0, time.monotonic(), kind, code=exc.code))

    def _proxy_loop(self) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            v = f"p-{k}"
            t0 = time.monotonic()
            try:
                body = {"messages": [{"value": v, "encoding": "utf-8"}]}
                res = self.proxy.request("POST", f"/v1/topics/{TOPIC}/messages", body, safe=False)
                m = res["messages"][0]
                self._record(
                    Op(
                        v,
                        "proxy",
                        t0,
                        time.monotonic(),
                        "ok",
                        m["queue"],
                        m["queue_offset"],
                        m["group"],
                    )
                )
            except ApiError as exc:
                unknown = exc.status in (0, 504) or exc.details.get("outcome_unknown")
                self._record(
                    Op(
                        v,
                        "proxy",
                        t0,
                        time.monotonic(),
                        "unknown" if unknown else "fail",
                        code=exc.code,
                    )
                )

    def acked_since(self, t: float, groups: set[str] | None = None) -> int:
        with self._lock:
            return sum(
                1
                for o in self.ops
                if o.outcome == "ok" and o.t1 > t and (groups is None or o.group in groups)
            )


@pytest.fixture
def multi(tmp_path: Path) -> Iterator[MultiCluster]:
    mc = MultiCluster.create(tmp_path / "mc", groups=3, nodes=3, secret="live-test-secret-0123")
    with multi_running(mc, 15) as running:
        yield running


@pytest.fixture
def proxy(multi: MultiCluster) -> Iterator[str]:
    multi.wait_serving(START_TIMEOUT_S)  # every node's port bound before ours is picked
    (port,) = free_ports(1)
    log = open(multi.dir / "proxy.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dledger_app.cli",
            "proxy",
            "--dir",
            str(multi.dir),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)
        log.close()


def key_for_group(route: Any, group: str) -> str:
    for k in range(10_000):
        key = f"key-{k}"
        if route.owners[zlib.crc32(key.encode()) % len(route.owners)] == group:
            return key
    raise AssertionError("no key")


def read_replica(address: str, queues: list[int]) -> list[tuple[int, int, str]]:
    """Every (queue, offset, value) a replica serves for ``queues``."""
    c = Client([address], timeout_s=5.0, retry_for_s=5.0)
    out: list[tuple[int, int, str]] = []
    for q in queues:
        off = 0
        while True:
            b = c.consume(TOPIC, q, off, max_messages=1000)
            out += [(q, r.queue_offset, r.value.decode()) for r in b.records]
            if b.next_offset == off:
                break
            off = b.next_offset
    return out


def test_three_groups_controller_failover_group_outage_and_exactly_once(
    multi: MultiCluster, proxy: str
) -> None:
    t_start = time.monotonic()
    ctl = multi.controller()
    groups = multi.groups()
    for lc in multi.all().values():
        lc.wait_leader(START_TIMEOUT_S)

    def brokers() -> dict[str, Any] | None:
        for addr in multi.controller_endpoints():
            with contextlib.suppress(OSError):
                r = http_request(addr, "GET", "/v1/brokers", timeout_s=2)
                if r.status == 200:
                    j: dict[str, Any] = r.json()
                    return j
        return None

    wait_for(
        lambda: (
            (b := brokers()) is not None
            and all(g["live"] for g in b["groups"])
            and len(b["groups"]) == 3
        ),
        START_TIMEOUT_S,
        "the controller to see three live groups",
    )
    rc = RoutingClient(multi.endpoints(), group_retry_s=1.5, route_ttl_s=2.0)
    created = rc.create_topic(TOPIC, QUEUES)
    assert [q["group"] for q in created["queues"]] == ["g1", "g2", "g3"] * 4
    assert created["pending_groups"] == []
    wait_for(lambda: proxy and _healthy(proxy), 30, "the proxy")
    route = rc.route(TOPIC)
    print(f"\nstart-up: {time.monotonic() - t_start:.1f} s")

    prod = Producers(rc, proxy)
    prod.start()
    try:
        wait_for(lambda: prod.acked_since(0) >= 20, 60, "first acknowledgements")

        # -- 1. the controller's leader dies: produce and consume go on ----------------
        lead = ctl.wait_leader(30)
        t_kill = time.monotonic()
        ctl.kill(lead, signal.SIGKILL)
        wait_for(
            lambda: prod.acked_since(t_kill + 0.5) >= 20,
            30,
            "acks after the controller leader died",
        )
        b = rc.consume(TOPIC, 0, 0, max_messages=10)
        assert b.records, "consume goes on without the controller leader"
        ctl.wait_leader(60, among=[i for i in ctl.ids() if i != lead])
        side = rc.create_topic("after-controller-failover", 3)
        assert side["version"] > route.version
        ctl.start(lead)
        print(f"controller leader {lead} killed: {prod.acked_since(t_kill)} acks since")

        # -- 2. a whole group's majority dies ---------------------------------------------
        g2 = groups["g2"]
        g2_lead = g2.wait_leader(30)
        victims = [g2_lead, next(i for i in g2.ids() if i != g2_lead)]
        t_out = time.monotonic()
        for v in victims:
            g2.kill(v, signal.SIGKILL)
        t_dead = time.monotonic()  # both are gone (kill waits for the exit)
        # ordered messages for g2: the documented error, naming the group
        key = key_for_group(route, "g2")
        with pytest.raises(GroupUnavailableError) as ei:
            rc.producer().send(TOPIC, [b"ordered"], sharding_key=key)
        assert ei.value.code == "GROUP_UNAVAILABLE" and ei.value.details["group"] == "g2"
        ordered = {"messages": [{"value": "ordered-p", "encoding": "utf-8", "sharding_key": key}]}
        pr = http_request(
            proxy,
            "POST",
            f"/v1/topics/{TOPIC}/messages",
            json.dumps(ordered).encode(),
            timeout_s=30,
        )
        assert pr.status == 503, pr.body
        assert pr.json()["error"]["code"] == "GROUP_UNAVAILABLE"
        assert pr.json()["error"]["group"] == "g2" and pr.headers.get("retry-after")
        t_mid = time.monotonic()
        wait_for(
            lambda: prod.acked_since(t_mid, {"g1"}) >= 10 and prod.acked_since(t_mid, {"g3"}) >= 10,
            60,
            "g1 and g3 to keep acknowledging",
        )
        t_back = time.monotonic()
        for v in victims:
            g2.start(v)
        g2.wait_leader(60)
        # g2's queues took nothing after the kill (beyond answers in flight then)
        with prod._lock:
            window = [o for o in prod.ops if t_dead + 1.0 < o.t0 and o.t1 < t_back]
        assert not [o for o in window if o.outcome == "ok" and o.group == "g2"]
        for via in ("client", "proxy"):
            w = [o for o in window if o.via == via]
            ok = sum(1 for o in w if o.outcome == "ok")
            print(
                f"g2 outage {t_back - t_out:.1f} s, {via}: {ok}/{len(w)} unordered produces "
                f"acknowledged ({100 * ok / max(1, len(w)):.1f}%), "
                f"outcomes {sorted({(o.outcome, o.code) for o in w})}"
            )
            assert ok > 0
        wait_for(lambda: _group_acks_after(prod, t_back, "g2"), 60, "g2 to acknowledge again")

        # -- 3. the controller's majority dies: only route changes stop --------------------
        ctl.wait_leader(60)
        dead = ctl.ids()[:2]
        t_maj = time.monotonic()
        for v in dead:
            ctl.kill(v, signal.SIGKILL)
        wait_for(
            lambda: prod.acked_since(t_maj + 0.5) >= 20, 60, "acks without a controller majority"
        )
        g1_node = groups["g1"].http(1)
        r = http_request(
            g1_node, "POST", "/v1/topics", b'{"name": "refused", "queues": 2}', timeout_s=30
        )
        assert r.status == 503, r.body
        err = r.json()["error"]
        assert err["code"] == "CONTROLLER_UNAVAILABLE" and "route changes" in err["message"]
        assert r.headers.get("retry-after")
        rr = http_request(proxy, "GET", f"/v1/routes/{TOPIC}", timeout_s=10)
        assert rr.status == 200 and rr.json()["version"] == route.version
        for v in dead:
            ctl.start(v)
        ctl.wait_leader(60)
    finally:
        prod.stop()
    assert not prod.errors, prod.errors

    # -- 4. every acknowledged message exactly once on every replica of its group ---------
    ops = prod.ops
    acked = {o.value: o for o in ops if o.outcome == "ok"}
    counts: dict[str, int] = {}
    for o in ops:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    print(f"operations: {counts}; moved batches (client): {rc.stats.moved}")
    for name, lc in groups.items():
        mine = route.queues_of(name)
        want = {(o.queue, o.offset, o.value) for o in acked.values() if o.group == name}
        assert all(o.queue in mine for o in acked.values() if o.group == name)
        for nid in lc.ids():

            def replica_has_all(
                addr: str = lc.http(nid),
                mine: list[int] = mine,
                want: set[tuple[int, int, str]] = want,
            ) -> list[tuple[int, int, str]] | None:
                try:
                    got = read_replica(addr, mine)
                except ApiError:
                    return None
                return got if want <= set(got) else None

            got = wait_for(replica_has_all, 60, f"{name} node {nid} to hold every acked message")
            seen = Counter(v for _, _, v in got)
            dups = {v for v, n in seen.items() if n > 1}
            assert not dups, f"{name} node {nid} stores {sorted(dups)[:5]} twice"
            assert len(got) == len(set(got))
    where: dict[str, list[tuple[str, int, int]]] = {}
    for name, lc in groups.items():
        for q, off, v in read_replica(lc.http(1), route.queues_of(name)):
            where.setdefault(v, []).append((name, q, off))
    twice = {v: w for v, w in where.items() if len(w) > 1}
    outcome = {o.value: (o.via, o.outcome, o.code) for o in ops}
    assert not twice, "stored twice: " + "; ".join(
        f"{v} at {w}, client saw {outcome.get(v)}" for v, w in sorted(twice.items())[:5]
    )
    all_values = list(where)
    assert set(acked) <= set(all_values)
    print(f"total: {time.monotonic() - t_start:.1f} s")


def _group_acks_after(prod: Producers, t: float, group: str) -> bool:
    return prod.acked_since(t, {group}) > 0


def _healthy(address: str) -> bool:
    """The proxy answers there (not some other process that took the port)."""
    with contextlib.suppress(OSError, ValueError):
        r = http_request(address, "GET", "/healthz", timeout_s=1)
        return r.status == 200 and r.json().get("role") == "proxy"
    return False
