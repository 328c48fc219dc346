"""A controller-mode broker group (``replication = "controller"``) on real
processes: a 3-node controller group and one 3-node broker group whose
master the controller elects, with CP settings (every member of the
SyncStateSet acknowledges, at least 2 of them).

1. The master is elected, the SyncStateSet grows to all three, produce works.
2. SIGKILL the master: the controller elects another from the SyncStateSet
   (new epoch); writes fail fast (503) until a slave has rejoined and the
   set holds 2 again; then they are acknowledged.
3. The old master restarts, learns it is a slave, joins the new master.
4. Every acknowledged message is read back exactly once from every replica.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dledger.cluster import http_request
from dledger_app.groups import MultiCluster
from http_api.client import ApiError, Client
from http_api.routing import RoutingClient
from tests.http.apiclient import wait_for
from tests.integration.multi import multi_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOPIC = "cm"
START_TIMEOUT_S = 90.0


@pytest.fixture
def multi(tmp_path: Path) -> Iterator[MultiCluster]:
    settings = {
        "replication": "controller",
        "all_ack_in_sync_state_set": True,
        "in_sync_replicas": 2,
        "min_in_sync_replicas": 2,
    }
    mc = MultiCluster.create(
        tmp_path / "mc", groups=1, nodes=3, secret="cmode-live-secret-0123", settings=settings
    )
    with multi_running(mc, 25) as running:
        yield running


def replica_of(mc: MultiCluster) -> dict[str, Any] | None:
    for addr in mc.controller_endpoints():
        with contextlib.suppress(OSError, ValueError):
            r = http_request(addr, "GET", "/v1/brokers", timeout_s=2.0)
            if r.status == 200:
                for g in r.json()["groups"]:
                    if g["name"] == "g1" and g.get("replica") and g["live"]:
                        return dict(g["replica"])
    return None


def read_all(address: str, queues: int) -> list[str]:
    c = Client([address], timeout_s=5.0, retry_for_s=10.0)
    out: list[str] = []
    for q in range(queues):
        off = 0
        while True:
            b = c.consume(TOPIC, q, off, max_messages=1000)
            out += [r.value.decode() for r in b.records]
            if b.next_offset == off:
                break
            off = b.next_offset
    return out


def test_a_controller_mode_group_fails_over_and_the_old_master_rejoins(
    multi: MultiCluster,
) -> None:
    g1 = multi.group("g1")
    multi.controller().wait_leader(START_TIMEOUT_S)
    rep = wait_for(
        lambda: (r := replica_of(multi)) and len(r["sync_state_set"]) == 3 and r,
        START_TIMEOUT_S,
        "a master with all three in its SyncStateSet",
    )
    master, epoch = rep["master"], rep["epoch"]
    rc = RoutingClient(multi.endpoints(), timeout_s=5.0)
    wait_for(
        lambda: _try(lambda: rc.create_topic(TOPIC, 4), ok_codes={"TOPIC_EXISTS"}), 30, "the topic"
    )
    acked: list[str] = []
    producer = rc.producer()
    seq = iter(range(1_000_000))

    def produce(n: int, tag: str) -> None:
        for k in range(n):
            v = f"{tag}-{next(seq)}"
            producer.send(TOPIC, [v.encode()], queue=k % 4)
            acked.append(v)

    wait_for(lambda: _try(lambda: produce(1, "first")), 30, "a first acknowledged write")
    produce(40, "before")

    # 2. The master dies; the controller elects another (new epoch).
    t_kill = time.monotonic()
    g1.kill(master, signal.SIGKILL)
    rep2 = wait_for(
        lambda: (r := replica_of(multi)) and r["epoch"] > epoch and r["master"] != master and r,
        60,
        "a new master",
    )
    refusals: Counter[str] = Counter()

    def one_more() -> bool:
        try:
            produce(1, "after")
        except ApiError as exc:
            refusals[getattr(exc, "code", type(exc).__name__)] += 1
            return False
        return True

    wait_for(one_more, 60, "writes acknowledged after the failover")
    failover_s = time.monotonic() - t_kill
    print(
        f"failover: new master {rep2['master']} (epoch {rep2['epoch']}) writing "
        f"{failover_s:.1f} s after the kill; refusals meanwhile: {dict(refusals)}"
    )
    produce(40, "after")

    # 3. The old master comes back as a slave of the new one.
    g1.start(master)
    wait_for(
        lambda: (
            (st := g1.status(master)) is not None
            and st.get("role") == "follower"
            and st.get("cmode_role") == "slave"
            and st.get("link") == "following"
        ),
        60,
        "the old master following the new one",
    )
    wait_for(
        lambda: (r := replica_of(multi)) and len(r["sync_state_set"]) == 3,
        60,
        "the old master back in the SyncStateSet",
    )

    # 4. Every acknowledged message, once, on every replica.
    want = Counter(acked)
    for nid in g1.ids():

        def holds_all(nid: int = nid) -> Counter[str] | None:
            c = Counter(read_all(g1.http(nid), 4))
            return c if set(want) <= set(c) else None

        got = wait_for(holds_all, 60, f"node {nid} holding every acknowledged message")
        dup = [v for v, n in got.items() if n > 1]
        assert not dup, (nid, dup[:5])


def _try(fn: Callable[[], Any], ok_codes: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether ``fn`` succeeded (an API error whose code is in ``ok_codes``
    counts: a create that timed out on the client may have been made)."""
    try:
        fn()
    except ApiError as exc:
        return getattr(exc, "code", "") in ok_codes
    except OSError:
        return False
    return True
