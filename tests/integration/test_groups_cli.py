"""``dledger cluster up --groups N``: the controller group plus N broker
groups as processes; ``cluster status`` shows groups, leaders and routes;
``cluster kill/restart --group``; ``cluster down`` stops them all (every
process is also stopped by PID at the end, whatever happened)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dledger.cluster import http_request
from dledger.config import AuthSpec, TokenSpec
from dledger_app.groups import MultiCluster
from dledger_app.multi_cli import wait_groups_live
from http_api.routing import RoutingClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def dledger(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "dledger_app.cli", *args],
        capture_output=True,
        text=True,
        timeout=150,
    )
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def express_total(addr: str) -> float:
    text = http_request(addr, "GET", "/metrics", timeout_s=5).body.decode()
    return next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("dledger_http_express_total")
    )


def test_cluster_up_groups_status_routes_kill_and_down(tmp_path: Path) -> None:
    d = str(tmp_path / "mc")
    try:
        up = dledger(
            "cluster", "up", "--groups", "2", "--nodes", "1", "--dir", d, "--timeout", "90"
        )
        assert "2 broker groups + controller" in up.stdout
        mc = MultiCluster(d)
        assert mc.group_names() == ["g1", "g2"]
        # a topic created through a broker node goes to the controller and back
        g1 = mc.group("g1").http(1)
        r = http_request(g1, "POST", "/v1/topics", b'{"name": "t", "queues": 4}', timeout_s=30)
        assert r.status == 201, r.body
        assert [q["group"] for q in r.json()["queues"]] == ["g1", "g2", "g1", "g2"]
        r = http_request(mc.group("g2").http(1), "GET", "/v1/routes/t", timeout_s=5)
        assert r.status == 200 and r.json()["version"] >= 1
        # a produce to a queue of the other group is refused, naming the owner
        r = http_request(
            g1,
            "POST",
            "/v1/topics/t/messages",
            b'{"messages": [{"value": "x", "encoding": "utf-8", "queue": 1}]}',
            timeout_s=10,
        )
        assert r.status == 421 and r.json()["error"]["group"] == "g2", r.body
        # the same on the express lane (plain produce requests: the agent's
        # routing runs there too), on a topic of its own
        r = http_request(g1, "POST", "/v1/topics", b'{"name": "lane", "queues": 2}', timeout_s=30)
        assert r.status == 201 and [q["group"] for q in r.json()["queues"]] == ["g1", "g2"]
        before = express_total(g1)
        json_ct = {"Content-Type": "application/json"}
        for q, status in ((1, 421), (0, 200), (None, 200)):
            msg: dict[str, object] = {"value": "x", "encoding": "utf-8"}
            if q is not None:
                msg["queue"] = q
            body = json.dumps({"messages": [msg]}).encode()
            r = http_request(g1, "POST", "/v1/topics/lane/messages", body, 10, json_ct)
            assert r.status == status, r.body
            if status == 421:
                assert r.json()["error"]["group"] == "g2", r.body
            else:  # no queue named: the agent picks g1's
                assert r.json()["messages"][0]["queue"] == 0, r.body
        assert express_total(g1) == before + 3
        # growing a topic: new queues placed by their number, each group grows its copy
        r = http_request(g1, "PATCH", "/v1/topics/t", b'{"queues": 6}', timeout_s=30)
        assert r.status == 200 and r.json()["pending_groups"] == [], r.body
        assert [q["group"] for q in r.json()["queues"]] == ["g1", "g2"] * 3
        for g in ("g1", "g2"):
            r = http_request(mc.group(g).http(1), "GET", "/v1/topics/t", timeout_s=5)
            assert len(r.json()["queues"]) == 6, r.body
        r = http_request(g1, "PATCH", "/v1/topics/t", b'{"queues": 4}', timeout_s=30)
        assert r.status == 422 and r.json()["error"]["field"] == "queues", r.body
        # deleting goes through the controller too, and each group deletes its copy
        r = http_request(g1, "POST", "/v1/topics", b'{"name": "gone", "queues": 2}', timeout_s=30)
        assert r.status == 201, r.body
        assert http_request(g1, "GET", "/v1/topics/gone", timeout_s=5).status == 200
        r = http_request(g1, "DELETE", "/v1/topics/gone", timeout_s=30)
        assert r.status == 200 and r.json()["pending_groups"] == [], r.body
        for g in ("g1", "g2"):
            addr = mc.group(g).http(1)
            assert http_request(addr, "GET", "/v1/topics/gone", timeout_s=5).status == 404
            r = http_request(addr, "GET", "/v1/routes/gone", timeout_s=5)
            assert r.status == 404 and r.json()["error"]["code"] == "UNKNOWN_TOPIC", r.body
        st = dledger("cluster", "status", "--dir", d).stdout
        assert "controller: leader node" in st and "g1: leader node 1" in st, st
        assert "g2: leader node 1  controller sees it live" in st, st
        assert "t (v" in st and "g1: [0, 2, 4]; g2: [1, 3, 5]" in st, st
        # the client commands route by themselves in a multi-group directory
        out = dledger("produce", "t", "a", "b", "c", "--dir", d).stdout
        assert "produced 3 message(s) to t (producer g" in out, out
        dledger("produce", "t", "k", "--key", "b", "--dir", d)  # crc32("b") % 6 == 5: g2
        out = dledger("consume", "t", "--group", "cg", "--dir", d)
        assert "consumed 4 message(s)" in out.stderr, out.stderr
        out = dledger("topics", "describe", "t", "--dir", d).stdout
        assert "topic t: 6 queue(s), 4 message(s)" in out, out
        kill = dledger("cluster", "kill", "1", "--dir", d, check=False)
        assert kill.returncode == 2 and "--group" in kill.stderr
        dledger("cluster", "kill", "1", "--group", "g2", "--dir", d)
        st = dledger("cluster", "status", "--dir", d).stdout
        assert "g2: leader -" in st, st
        out = dledger("produce", "t", "x", "y", "--dir", d, "--timeout", "3")  # moves to g1
        assert "produced 2 message(s)" in out.stdout, out.stdout
        bad = dledger("produce", "t", "z", "--key", "b", "--dir", d, "--timeout", "2", check=False)
        assert bad.returncode == 1 and "GROUP_UNAVAILABLE" in bad.stderr, bad.stderr
        assert "broker group 'g2'" in bad.stderr, bad.stderr
        dledger("cluster", "restart", "1", "--group", "g2", "--dir", d, "--timeout", "60")
        down = dledger("cluster", "down", "--dir", d).stdout
        assert down.count("stopped") == 3 + 2, down
        assert not any(lc.running(nid) for lc in MultiCluster(d).all().values() for nid in lc.ids())
    finally:
        if MultiCluster.is_multi(d):
            for lc in MultiCluster(d).all().values():
                lc.down(10)


def test_groups_with_bearer_tokens(tmp_path: Path) -> None:
    """With [auth] in every group's cluster file, broker nodes heartbeat with
    an admin token; routes need a token; topic administration through a
    broker node is forwarded with the caller's own token."""
    admin, prod = "admin-token-0123456789", "produce-token-0123456789"
    auth = AuthSpec(
        (TokenSpec("ops", admin, ("admin",)), TokenSpec("app", prod, ("produce", "consume")))
    )
    mc = MultiCluster.create(tmp_path / "mc", groups=2, nodes=1, auth=auth)
    try:
        for lc in mc.all().values():
            lc.start_all()
        wait_groups_live(mc, 90)  # heartbeats are accepted: they carry the admin token
        g1 = mc.group("g1").http(1)
        r = http_request(g1, "GET", "/v1/routes", timeout_s=5)
        assert r.status == 401, r.body
        body = b'{"name": "t", "queues": 2}'
        h = {"Authorization": f"Bearer {prod}"}
        r = http_request(g1, "POST", "/v1/topics", body, timeout_s=30, headers=h)
        assert r.status == 403, r.body
        h = {"Authorization": f"Bearer {admin}"}
        r = http_request(g1, "POST", "/v1/topics", body, timeout_s=30, headers=h)
        assert r.status == 201 and r.json()["pending_groups"] == [], r.body
        rc = RoutingClient(mc.endpoints(), token=prod)
        (ack,) = rc.producer().send("t", [b"x"], queue=1)
        assert rc.route("t").owners[ack.queue] == "g2"
    finally:
        for lc in mc.all().values():
            lc.down(10)
