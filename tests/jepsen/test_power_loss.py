"""Issue 20 on real processes: power loss on a filesystem that drops unsynced writes.

Every node's data directory is a :mod:`jepsen_like.lazyfs` mount; a power
loss is a SIGKILL followed by dropping what the node never fsynced. Needs
root, /dev/fuse, fusermount3 and pyfuse3 (``.ci/run`` installs them); skips
otherwise, saying which is missing.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jepsen_like import replicas
from jepsen_like.control import Cluster
from jepsen_like.lazyfs import why_unavailable
from jepsen_like.nemesis import rebuild_replica

pytestmark = [pytest.mark.jepsen, pytest.mark.timeout(300)]

WHY = why_unavailable()
needs_lazyfs = pytest.mark.skipif(WHY is not None, reason=f"needs lazyfs: {WHY}")

TOPIC = "pl"


async def _until(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def _leader(c: Cluster, among: list[int] | None = None) -> int:
    async def find() -> int | None:
        lead = await c.leader()
        return lead if lead is not None and (among is None or lead in among) else None

    return int(await _until(find, 30, f"a leader among {among or c.ids}"))


async def _produce(
    s: aiohttp.ClientSession, c: Cluster, values: list[str], among: list[int] | None = None
) -> list[tuple[str, int]]:
    """Produce each value to queue 0 through the leader; (value, offset) of each ack."""
    acks: list[tuple[str, int]] = []
    for v in values:
        for _attempt in range(50):
            lead = await _leader(c, among)
            try:
                async with s.post(
                    f"http://{c.members[lead].http}/v1/topics/{TOPIC}/messages",
                    json={"messages": [{"value": v, "encoding": "utf-8", "queue": 0}]},
                    timeout=aiohttp.ClientTimeout(total=3),
                    allow_redirects=False,
                ) as r:
                    if r.status == 200:
                        body = await r.json()
                        acks.append((v, int(body["messages"][0]["queue_offset"])))
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"could not produce {v!r}")
    return acks


async def _status(c: Cluster, node: int) -> dict[str, Any]:
    return dict(await _until(lambda: c.status(node), 20, f"node {node}'s status"))


@needs_lazyfs
@pytest.mark.parametrize("planted", [False, True], ids=["fixed", "ack_below_commit"])
async def test_async_majority_power_loss_then_leader_kill_converges(
    tmp_path: Path, machine: None, planted: bool
) -> None:
    """The divergence of issue 20, step by step, then convergence.

    flush = "async" with no periodic fsync in the test's time: A is made
    durable by a clean restart; B is acknowledged (written, unsynced) on all
    three; the two followers lose power (B gone from their disks), the
    leader is SIGKILLed too (its page cache, so B, survives); the two
    restart, elect a leader and acknowledge C at the offsets B had; the old
    leader restarts holding B committed where the leader holds C. It must
    stop (exit 2, REPLICA_DIVERGED) and be rebuilt from the leader; then the
    leader is killed. What must hold: every replica serves the same
    messages, and every write acknowledged after the power loss (C, D) is
    there. B, the unsynced tail, is lost: the test reports how much.

    With the planted bug ``ack_below_commit`` (the rule before the fix) the
    same steps must end with replicas that diverge: the survivor never
    stops, and serves B where the others serve C."""
    rng = random.Random(20)
    c = Cluster(
        tmp_path / "cluster",
        voters=3,
        netns=False,
        lazyfs=True,
        node_settings={"flush": "async", "flush_interval_ms": 600_000},
        node_env={"DLEDGER_ENABLE_FAULTS": "1", "DLEDGER_FAULTS": "ack_below_commit"}
        if planted
        else {},
    )
    c.write_cluster_file()
    logs: list[str] = []
    try:
        c.start_all()
        assert await c.wait_ready(timeout_s=60)
        async with aiohttp.ClientSession() as s:
            lead = await _leader(c)
            async with s.post(
                f"http://{c.members[lead].http}/v1/topics",
                json={"name": TOPIC, "queues": 1},
            ) as r:
                assert r.status in (200, 201), await r.text()
            acked_a = await _produce(s, c, [f"a{i}" for i in range(20)])
            # A clean stop fsyncs (LmdbStorage.close): A is durable everywhere.
            c.stop_all()
            c.start_all()
            assert await c.wait_ready(timeout_s=60)
            survivor = await _leader(c)
            followers = [i for i in c.ids if i != survivor]
            acked_b = await _produce(s, c, [f"b{i}" for i in range(40)], among=[survivor])
            before = await _status(c, survivor)
            for f in followers:  # they hold B (applied), unsynced
                await _until(
                    lambda f=f: _applied_at_least(c, f, int(before["commit"])), 20, "B on f"
                )
            # Power loss of the two followers, then a plain kill of the leader.
            for f in followers:
                c.kill(f)
                logs.append(f"power loss of {f}: {c.power_loss(f, tear=False, seed=1)}")
            c.kill(survivor)
            for f in followers:
                c.start(f)
            new_lead = await _leader(c, among=followers)
            st = await _status(c, new_lead)
            # The scenario is set: the new leader's log ends below B's end.
            assert int(st["last_index"]) < int(before["commit"]), (st, before)
            acked_c = await _produce(s, c, [f"c{i}" for i in range(30)], among=followers)
            # The survivor comes back holding B committed where the leader has C.
            c.start(survivor)
            if planted:

                async def diverged() -> dict[str, Any] | None:
                    got = await replicas.compare(c, TOPIC, 1, timeout_s=2)
                    return got if got["divergent_offsets"] > 0 else None

                res = await _until(diverged, 40, "the replicas to diverge (planted bug)")
                print(f"planted ack_below_commit: {res['divergent_offsets']} divergent offsets")
                assert c.alive(survivor), "the planted bug hides the conflict: no exit"
                return
            await _until(lambda: _exited(c, survivor), 30, "the diverged replica to stop by itself")
            proc = c.members[survivor].proc
            assert proc is not None and proc.returncode == 2, proc and proc.returncode
            assert "REPLICA_DIVERGED" in c.log_tail(survivor, 40) or "diverged" in c.log_tail(
                survivor, 40
            )
            c.members[survivor].expected_exit = True
            info: dict[str, Any] = {}
            term = max(int(x.get("term", 0)) for x in (await c.statuses()).values())
            await rebuild_replica(c, survivor, term, info, rng, logs.append)
            assert info.get("rebuilt") and info.get("caught_up"), info
            # Then a kill of the leader: whoever is elected holds C.
            lead = await _leader(c)
            c.kill(lead)
            await _leader(c, among=[i for i in c.ids if i != lead])
            c.start(lead)
            acked_d = await _produce(s, c, [f"d{i}" for i in range(10)])
            assert await c.wait_ready(timeout_s=60)
            res = await replicas.compare(c, TOPIC, 1, timeout_s=60)
            assert res["verdict"] == "valid", res
            log = (await replicas.read_queue(s, c.members[await _leader(c)].http, TOPIC, 0)) or []
        held = dict(log)
        values = set(held.values())
        after = acked_c + acked_d
        lost_after = [v for v, _ in after if v not in values]
        assert not lost_after, f"writes acknowledged after the power loss were lost: {lost_after}"
        assert all(v in values for v, _ in acked_a), "A was durable: it must survive"
        lost_b = [v for v, _ in acked_b if v not in values]
        print(
            f"async majority power loss: acknowledged A={len(acked_a)} B={len(acked_b)} "
            f"C={len(acked_c)} D={len(acked_d)}; lost B (unsynced tail)={len(lost_b)}; "
            f"divergent offsets={res['divergent_offsets']}; {logs}"
        )
    finally:
        c.stop_all()
        await c.close()


async def _applied_at_least(c: Cluster, node: int, index: int) -> bool:
    st = await c.status(node)
    return st is not None and int(st.get("applied", 0)) >= index


async def _exited(c: Cluster, node: int) -> bool:
    return not c.alive(node)


@needs_lazyfs
async def test_async_mode_keeps_votes_and_terms_through_a_power_loss(
    tmp_path: Path, machine: None
) -> None:
    """flush = "async" fsyncs a new term or vote before anything depending on
    it leaves, whatever the interval: a node that forgot its vote could vote
    twice in a term, and two leaders of one term could write different
    entries at one index, a divergence no comparison of terms can see."""
    c = Cluster(
        tmp_path / "cluster",
        voters=3,
        netns=False,
        lazyfs=True,
        node_settings={"flush": "async", "flush_interval_ms": 600_000},
    )
    c.write_cluster_file()
    try:
        c.start_all()
        assert await c.wait_ready(timeout_s=60)
        first = await _leader(c)
        # The first sync after a start is flushed at once; a leadership
        # transfer later makes a new term and new votes inside the interval.
        to = next(i for i in c.ids if i != first)

        async def moved() -> bool:
            if await c.leader() == to:
                return True
            await c.transfer_leadership(first, to)
            return await c.leader() == to

        await _until(moved, 30, f"leadership to move from {first} to {to}")
        lead = await _leader(c, among=[to])
        before = {i: await _status(c, i) for i in c.ids}
        term = int(before[lead]["term"])
        assert term > 1, before[lead]
        for i in c.ids:
            c.kill(i)
        for i in c.ids:
            c.power_loss(i, tear=False, seed=i)
        c.start_all()
        for i in c.ids:
            await _until(lambda i=i: c.status(i), 30, f"node {i} back")
        opened = {
            i: [x for x in c.log_tail(i, 200).splitlines() if "opened" in x][-1] for i in c.ids
        }
        for i in c.ids:
            # "opened ... (entries a..b, term T, vote V, ...)": the term and vote
            # each node had when the power went are still there.
            t = int(opened[i].split("term ")[1].split(",")[0])
            v = int(opened[i].split("vote ")[1].split(",")[0])
            assert t >= int(before[i]["term"]) and t >= 1, opened[i]
            if int(before[i]["term"]) == term:
                assert v == int(before[i]["vote"]), (opened[i], before[i]["vote"])
    finally:
        c.stop_all()
        await c.close()
