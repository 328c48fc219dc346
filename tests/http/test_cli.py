"""`dledger produce / consume / topics` as subprocesses against a live
3-node cluster that requires bearer tokens: plain output with queues,
offsets, msg ids and values; consumer-group offsets committed between runs;
--follow wakes on new data; the default endpoints come from the local
cluster directory; a missing or weak token is refused with exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dledger.config import AuthSpec, TokenSpec
from tests.http.apiclient import ApiCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ADMIN = "cli-admin-token-0123456789"
APP = "cli-app-token-0123456789ab"
AUTH = AuthSpec(
    (TokenSpec("ops", ADMIN, ("admin",)), TokenSpec("app", APP, ("produce", "consume")))
)


def rows(out: str) -> list[list[str]]:
    """Message rows (QUEUE OFFSET COMMIT_OFFSET MSG_ID VALUE), header dropped."""
    lines = [ln.split(None, 4) for ln in out.splitlines() if ln.strip()]
    assert lines and lines[0][:2] == ["QUEUE", "OFFSET"], out
    return [ln for ln in lines[1:] if ln[0].isdigit()]


def test_cli_produce_consume_and_topics(
    api_cluster: Callable[..., ApiCluster], tmp_path: Path
) -> None:
    c = api_cluster(voters=3, auth=AUTH)
    eps = ",".join(c.http(n) for n in c.ids())
    env = {k: v for k, v in os.environ.items() if k not in ("DLEDGER_TOKEN", "DLEDGER_ENDPOINTS")}

    def cli(*argv: str, token: str | None = APP, cwd: Path | None = None, endpoints: bool = True,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        e = dict(env, DLEDGER_TOKEN=token) if token else env
        extra = ["--endpoints", eps] if endpoints else []
        return subprocess.run(
            [sys.executable, "-m", "dledger_app.cli", *argv, *extra],
            capture_output=True, text=True, env=e, cwd=cwd, input=stdin, timeout=60,
        )  # fmt: skip

    # topics: create needs admin (--token beats $DLEDGER_TOKEN)
    r = cli("topics", "create", "orders", "--queues", "2")
    assert r.returncode == 1 and "403 FORBIDDEN" in r.stderr, r
    r = cli("topics", "create", "orders", "--queues", "2", "--token", ADMIN)
    assert r.returncode == 0 and "created topic orders with 2 queue(s)" in r.stdout, r
    r = cli("topics", "list", token=None)
    assert r.returncode == 1 and "401 UNAUTHORIZED" in r.stderr, r

    # produce: values, all to one queue by key
    r = cli("produce", "orders", "apple", "banana split", "cherry", "--key", "cust-1")
    assert r.returncode == 0, r
    got = rows(r.stdout)
    assert [g[4] for g in got] == ["apple", "banana split", "cherry"]
    assert len({g[0] for g in got}) == 1 and [g[1] for g in got] == ["0", "1", "2"]
    key_queue = got[0][0]
    assert all(len(g[3]) >= 16 for g in got)  # msg ids
    assert int(got[0][2]) < int(got[1][2]) < int(got[2][2])  # commit offsets grow
    # produce: lines of a file, and of stdin, to an explicit queue
    f = tmp_path / "values.txt"
    f.write_text("d1\nd2\n\nd3\n")
    other = "1" if key_queue == "0" else "0"
    r = cli("produce", "orders", "--file", str(f), "--queue", other)
    assert r.returncode == 0 and [g[4] for g in rows(r.stdout)] == ["d1", "d2", "d3"], r
    r = cli("produce", "orders", "--file", "-", "--queue", other, stdin="e1\n")
    assert r.returncode == 0 and rows(r.stdout)[0][1] == "3", r
    r = cli("produce", "orders")
    assert r.returncode == 2 and "nothing to produce" in r.stderr

    # topics list / describe
    r = cli("topics", "list")
    assert r.returncode == 0 and r.stdout.split("\n")[1].split() == ["orders", "2", "7"], r.stdout
    r = cli("topics", "describe", "orders")
    assert r.returncode == 0 and "topic orders: 2 queue(s), 7 message(s)" in r.stdout, r
    assert f"{other:>6} {0:>12} {4:>12}" in r.stdout

    # consume: everything once, then nothing (the group committed), --max
    r = cli("consume", "orders", "--group", "g1")
    assert r.returncode == 0, r
    values = sorted(g[4] for g in rows(r.stdout))
    assert values == sorted(["apple", "banana split", "cherry", "d1", "d2", "d3", "e1"])
    r = cli("consume", "orders", "--group", "g1")
    assert r.returncode == 0 and rows(r.stdout) == [], r.stdout
    r = cli("consume", "orders", "--group", "g2", "--max", "2")
    assert r.returncode == 0 and len(rows(r.stdout)) == 2
    r = cli("consume", "orders", "--group", "g3", "--from", "latest")
    assert r.returncode == 0 and rows(r.stdout) == []

    # --follow wakes up on new data (and stops at --max)
    follower = subprocess.Popen(
        [sys.executable, "-m", "dledger_app.cli", "consume", "orders", "--group", "g4",
         "--from", "latest", "--follow", "--max", "2", "--wait-ms", "500", "--endpoints", eps],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, DLEDGER_TOKEN=APP),
    )  # fmt: skip
    try:
        # The header comes once the consumer has fixed its start positions
        # ("latest" as of then): what is produced after it must be read.
        assert follower.stdout is not None
        header = follower.stdout.readline()
        assert header.startswith("QUEUE"), (header, follower.poll())
        assert follower.poll() is None, "consume --follow exited before any data"
        r = cli("produce", "orders", "late-1", "late-2", "--queue", key_queue)
        assert r.returncode == 0, r
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    assert [g[4] for g in rows(header + out)] == ["late-1", "late-2"]
    assert [g[1] for g in rows(header + out)] == ["3", "4"]

    # default endpoints: the local cluster directory's file
    run_dir = tmp_path / "cwd"
    (run_dir / "run").mkdir(parents=True)
    (run_dir / "run" / "cluster").symlink_to(c.dir)
    r = cli("topics", "describe", "orders", cwd=run_dir, endpoints=False)
    assert r.returncode == 0 and "9 message(s)" in r.stdout, r
    r = cli("topics", "list", cwd=tmp_path, endpoints=False)
    assert r.returncode == 2 and "no --endpoints" in r.stderr

    # delete (admin), then the topic is gone
    r = cli("topics", "delete", "orders", "--token", ADMIN)
    assert r.returncode == 0 and "deleted topic orders" in r.stdout
    r = cli("consume", "orders", "--group", "g1")
    assert r.returncode == 1 and "404 UNKNOWN_TOPIC" in r.stderr
