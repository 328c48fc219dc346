"""Issue 14: the broker's records are read from the replicated log. Real
nodes (LMDB storage, the broker state in it) on the in-process transport:
a follower that was down while the others went on catches up by ordinary
replication while what it missed is still retained, and by an index-only
snapshot plus the retained log once retention dropped past it; every
replica then answers the same reads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker_adapter import CommandKind, Message, encode_produce, encode_retention, encode_topic
from broker_adapter.bodies import DurableBodies
from broker_adapter.node_sm import BrokerStateMachine
from dledger.config import MemberSpec, NodeConfig
from dledger.errors import DLedgerError
from dledger.node import Node
from dledger.runtime import NodeEnv
from dledger.transport.memory import MemoryNetwork
from tests.broker.helpers import all_messages

IDS = (1, 2, 3)


def cfg(tmp: Path, nid: int) -> NodeConfig:
    members = tuple(
        MemberSpec(i, "127.0.0.1", 17400 + i, "127.0.0.1", 18400 + i, data_dir=str(tmp / f"n{i}"))
        for i in IDS
    )
    return NodeConfig(
        node_id=nid,
        cluster_id="commitlog",
        raft_host="127.0.0.1",
        raft_port=17400 + nid,
        http_host="127.0.0.1",
        http_port=18400 + nid,
        data_dir=str(tmp / f"n{nid}"),
        members=members,
        tick_ms=10,
        election_ticks=10,
        heartbeat_ticks=1,
        lease_drift_ticks=2,
        snapshot_every_entries=10,
        snapshot_trailing_entries=2,
    )


async def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.net = MemoryNetwork()
        self.nodes: dict[int, Node] = {}
        self.ts = 1_000_000

    async def start(self, nid: int) -> Node:
        def make_transport(  # type: ignore[no-untyped-def]
            node_id, cluster_id, host, port, peers, secret, on_message
        ):
            return self.net.transport(node_id, on_message, list(peers))

        c = cfg(self.tmp, nid)
        Path(c.data_dir).mkdir(parents=True, exist_ok=True)
        sm = BrokerStateMachine(broker_name="commitlog", bodies=DurableBodies())
        n = Node(c, sm, NodeEnv(make_transport=make_transport))
        await n.start()
        self.nodes[nid] = n
        return n

    async def stop(self, nid: int) -> None:
        await self.nodes.pop(nid).stop()
        self.net = self.net  # the stopped node's transport left the network

    def leader(self) -> Node | None:
        ready = [n for n in self.nodes.values() if n.running and n.leader_ready()]
        return ready[0] if len(ready) == 1 else None

    async def propose(self, data: bytes) -> Any:
        for _ in range(300):
            lead = self.leader()
            if lead is None:
                await asyncio.sleep(0.02)
                continue
            try:
                return (await asyncio.wait_for(lead.submit(data), 5)).result
            except DLedgerError:
                await asyncio.sleep(0.02)
        raise AssertionError("a proposal was never acknowledged")

    async def produce(self, n: int, start: int) -> None:
        for k in range(start, start + n):
            self.ts += 10
            msgs = [Message(body=b"m%d-%d" % (k, j), queue=j % 2) for j in range(3)]
            await self.propose(encode_produce("t", msgs, self.ts))

    def broker(self, nid: int) -> Any:
        sm = self.nodes[nid].state_machine
        assert isinstance(sm, BrokerStateMachine)
        return sm.broker

    async def converged(self) -> None:
        lead = self.leader()
        assert lead is not None
        target = lead.applied
        await until(
            lambda: all(n.applied >= target for n in self.nodes.values()), 20, "replicas applied"
        )

    async def start_with_topic(self) -> None:
        """Every member started, a leader, and topic ``t`` of 2 queues."""
        for nid in IDS:
            await self.start(nid)
        await until(lambda: self.leader() is not None, 10, "a leader")
        await self.propose(encode_topic(CommandKind.CREATE_TOPIC, "t", self.ts, 2))

    def answers(self, nid: int) -> Any:
        b = self.broker(nid)
        return b.stats(), all_messages(b)


async def test_a_follower_catches_up_by_log_within_retention_and_by_snapshot_behind_it(
    tmp_path: Path,
) -> None:
    c = Cluster(tmp_path)
    try:
        await c.start_with_topic()
        await c.produce(20, 0)
        await c.converged()

        # 1. Within retention: nothing is dropped, so the log keeps every
        # entry and the follower gets all it missed by replication.
        lag = 3 if c.leader() is not c.nodes[3] else 2
        await c.stop(lag)
        await c.produce(60, 20)
        await c.start(lag)
        await c.converged()
        assert c.nodes[lag].counters["snapshots_installed"] == 0
        ref = c.answers(next(iter(c.nodes)))
        assert all(c.answers(nid) == ref for nid in c.nodes)
        assert len(ref[1][("t", 0)]) == 80 * 2  # queue 0 gets 2 of each 3

        # 2. Behind retention: keep about 30 records; the others drop the
        # log past what the stopped follower has, so it installs a snapshot
        # (index and metadata, no records) and replicates the retained log.
        await c.propose(encode_retention(c.ts, 30 * 40, 0))
        lag = 3 if c.leader() is not c.nodes[3] else 2
        behind = c.nodes[lag].applied
        await c.stop(lag)
        await c.produce(100, 80)
        lead = c.leader()
        assert lead is not None and lead._storage is not None
        await until(lambda: lead._storage.first_index() > behind + 1, 10, "leader compaction")
        snap = lead._snap
        assert snap is not None and len(snap.data) < 20_000  # no records in it
        await c.start(lag)
        await c.converged()
        assert c.nodes[lag].counters["snapshots_installed"] >= 1
        ref = c.answers(lead.cfg.node_id)
        kept = sum(len(v) for v in ref[1].values())
        assert 10 < kept < 100, kept
        assert all(c.answers(nid) == ref for nid in c.nodes)
        # and every replica restarts into the same answers without a rebuild
        for nid in list(c.nodes):
            await c.stop(nid)
        for nid in IDS:
            await c.start(nid)
        await until(lambda: c.leader() is not None, 10, "a leader after the restart")
        assert all(n.restored_from_checkpoint > 0 for n in c.nodes.values())
        await c.converged()
        # (the new leader's no-op moved the applied index and confirm offset)
        after = {nid: c.answers(nid) for nid in c.nodes}
        assert all(a == after[1] for a in after.values())
        assert after[1][1] == ref[1]
    finally:
        for nid in list(c.nodes):
            await c.stop(nid)
