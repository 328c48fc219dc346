"""Failures that shipped in other replicated logs, on the pure Raft core
(:class:`RawNode` over :class:`MemoryStorage`, driven by the harness in
raft_harness.py), where the existing rule-by-rule tests left a gap: a leader
that gets replication going again on its own after losing every append,
one-way partitions around the leader, and the production defaults the
election and lease rules depend on.
"""

from __future__ import annotations

import pytest

from dledger.config import NodeConfig
from dledger.core.types import Message, MsgType, Role
from tests.unit.raft_harness import E, Network, core_log

# ---------------------------------------------------------------------------
# Scenario 10: replication must not stay stuck after a timeout
# ---------------------------------------------------------------------------


def _caught_up(net: Network, nid: int) -> bool:
    leader = net.nodes[1]
    f = net.nodes[nid]
    return (
        core_log(f) == core_log(leader)
        and f.log.committed == leader.log.committed
        and leader.status().peers[nid].match == leader.log.last_index()
    )


def test_replication_resumes_after_every_append_in_the_window_was_lost() -> None:
    """Follower 2 is in REPLICATE with a window of 2; every append to it is
    lost (a network timeout) until the window is full and the leader pauses.
    Then the link works again but nobody proposes anything: heartbeats alone
    must get it going (no waiting for new writes, no retry loop for ever)."""
    net = Network.of(max_inflight_msgs=2)
    net.elect(1)
    leader = net.nodes[1]
    assert leader.status().peers[2].state == "REPLICATE"
    losing = True

    def lose_appends_to_2(m: Message) -> bool:
        return losing and m.type is MsgType.APP and m.to == 2

    net.intercept = lose_appends_to_2
    for k in range(6):
        leader.propose(b"w%d" % k)
        net.deliver_all()
    assert leader.log.committed == leader.log.last_index()  # 1 and 3 commit
    assert leader.status().peers[2].match < leader.log.last_index()
    losing = False
    for _ in range(3):  # a few heartbeat rounds, no new proposals
        net.tick()
        if _caught_up(net, 2):
            break
    assert _caught_up(net, 2), leader.status().peers[2]


def test_replication_resumes_after_a_long_outage_with_the_probe_lost() -> None:
    """Follower 2 is cut off for many election timeouts (the leader keeps
    its quorum with 3): every append and probe to it is lost, and it rejoins
    far behind. Within a couple of heartbeats the leader probes again and
    catches it up, without any new proposal."""
    net = Network.of(max_inflight_msgs=2)
    net.elect(1)
    leader = net.nodes[1]
    net.isolate(2)
    for k in range(30):
        leader.propose(b"x%d" % k)
        net.tick()
    net.tick(times=5 * E)
    assert leader.role is Role.LEADER
    assert leader.status().peers[2].match < leader.log.last_index() - 20
    net.recover()
    for _ in range(5):
        net.tick()
        if _caught_up(net, 2):
            break
    assert _caught_up(net, 2), leader.status().peers[2]


# ---------------------------------------------------------------------------
# Scenario 4: asymmetric partitions around the leader
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["leader-cannot-receive", "leader-cannot-send"])
def test_a_one_way_partition_of_the_leader_ends_with_one_stable_leader(cut: str) -> None:
    """The follower-side cases are in test_raft_features.py; here the leader
    is the one cut in one direction. The majority elects one new leader,
    once: afterwards no term moves (pre-vote and stickiness keep the
    half-connected old leader from disrupting it), and writes commit."""
    net = Network.of()
    net.elect(1)
    for other in (2, 3):
        if cut == "leader-cannot-receive":
            net.drop(other, 1)
        else:
            net.drop(1, other)
    for _ in range(6 * E):
        net.tick()
    leaders = [n for n in net.leaders() if n != 1]
    assert len(leaders) == 1, net.leaders()
    new = leaders[0]
    settled = {nid: n.term for nid, n in net.nodes.items()}
    for k in range(20 * E):
        net.tick()
        if k % E == 0:
            net.nodes[new].propose(b"w")
    assert [n for n in net.leaders() if n != 1] == [new]
    assert {nid: n.term for nid, n in net.nodes.items()} == settled
    lead = net.nodes[new]
    assert lead.log.committed == lead.log.last_index() > 2
    if cut == "leader-cannot-send":
        # it hears the new leader: it follows (a voter that can only listen)
        assert (net.nodes[1].role, net.nodes[1].lead) == (Role.FOLLOWER, new)
    else:
        # it hears nobody: it stepped down (check-quorum) and never raised its term
        assert net.nodes[1].role is not Role.LEADER and net.nodes[1].term == 1


# ---------------------------------------------------------------------------
# Scenarios 3, 4, 5, 11, 14: the production defaults these rules rely on
# ---------------------------------------------------------------------------


def test_a_production_node_runs_with_pre_vote_check_quorum_and_sync_flush() -> None:
    """The core tests switch pre-vote and check-quorum (stickiness, the
    lease) on explicitly; a node built from a cluster file must have them
    on too, and acknowledge only fsynced writes unless told otherwise."""
    cfg = NodeConfig(
        node_id=1,
        cluster_id="c",
        raft_host="127.0.0.1",
        raft_port=7001,
        http_host="127.0.0.1",
        http_port=8001,
        data_dir="/tmp/unused",
    )
    rc = cfg.raft_config()
    assert rc.pre_vote and rc.check_quorum
    assert 0 < rc.lease_ticks < rc.election_ticks
    assert cfg.flush == "sync"
