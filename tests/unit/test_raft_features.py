"""The Raft extensions dledger relies on, one test per rule: pre-vote,
check-quorum, stickiness (leader lease on the voter side), the leader lease
and ReadIndex, learners, leadership transfer and single-server membership
changes. Same style as ``test_raft_paper.py``: set up, act, check the exact
messages and state.
"""

from __future__ import annotations

import itertools

import pytest

from dledger.core.raft import RawNode
from dledger.core.types import (
    NONE,
    ConfChange,
    ConfChangeType,
    EntryType,
    Message,
    MsgType,
    ReadFailed,
    ReadMode,
    ReadState,
    Role,
)
from dledger.errors import (
    DLedgerError,
    InvariantViolation,
    NotLeader,
    ProposalDropped,
    TransferInProgress,
)
from tests.unit.raft_harness import (
    E,
    Network,
    core_log,
    ents,
    new_node,
    of_type,
    preload,
    read_messages,
    storage_of,
    stored_log,
    take_snapshot,
)

LEASE = E - 2  # election_ticks - lease_drift_ticks (the default drift is 2)


def elected(
    voters: tuple[int, ...] = (1, 2, 3), learners: tuple[int, ...] = (), **kw: object
) -> Network:
    net = Network.of(voters, learners, **kw)
    net.elect(1)
    return net


def terms(net: Network) -> dict[int, int]:
    return {nid: n.term for nid, n in sorted(net.nodes.items())}


def hb_round(net: Network, *, deliver: bool = True) -> int:
    """Tick the leader once (one heartbeat round) and optionally deliver it."""
    leader = net.nodes[1]
    leader.tick()
    if deliver:
        net.deliver_all()
    return leader.tick_count


# ===========================================================================
# Pre-vote
# ===========================================================================


def test_prevote_partitioned_node_rejoins_without_disruption() -> None:
    """SCENARIOS 3: an isolated node keeps pre-voting but, never getting a
    quorum, never raises its term; when it rejoins, the leader and the term
    are unchanged and it simply follows."""
    net = elected()
    net.isolate(3)
    for _ in range(10 * E):
        net.tick()
    assert terms(net) == {1: 1, 2: 1, 3: 1}
    assert net.nodes[3].role in (Role.PRE_CANDIDATE, Role.FOLLOWER)
    net.recover()
    net.tick(times=2)
    assert terms(net) == {1: 1, 2: 1, 3: 1}
    assert net.leaders() == [1]
    assert (net.nodes[3].role, net.nodes[3].lead) == (Role.FOLLOWER, 1)
    net.nodes[1].propose(b"x")
    net.deliver_all()
    assert {n.log.committed for n in net.nodes.values()} == {2}


def test_without_prevote_a_rejoining_node_disrupts_the_cluster() -> None:
    """The contrast that shows why pre-vote matters (and that the previous
    test can fail): without it, the isolated node's term keeps rising and on
    rejoining its reply to a heartbeat deposes the leader."""
    net = elected(pre_vote=False)
    net.isolate(3)
    for _ in range(5 * E):
        net.tick()
    assert net.nodes[3].term > 1
    net.recover()
    net.tick([1])
    assert net.nodes[1].role is Role.FOLLOWER
    assert net.nodes[1].term == net.nodes[3].term


def test_prevote_changes_no_term_and_no_vote() -> None:
    """A pre-vote round changes neither the pre-candidate's nor the voters'
    term or vote, and needs nothing persisted."""
    net = Network.of()
    n1 = net.nodes[1]
    n1.campaign()
    rd = n1.ready()
    assert (n1.role, n1.term, n1.vote) == (Role.PRE_CANDIDATE, 0, NONE)
    assert rd.hard_state is None
    assert list(rd.messages) == [
        Message(MsgType.PRE_VOTE, 2, 1, 1),
        Message(MsgType.PRE_VOTE, 3, 1, 1),
    ]
    for nid in (2, 3):
        peer = net.nodes[nid]
        peer.step(rd.messages[nid - 2])
        prd = peer.ready()
        assert list(prd.messages) == [Message(MsgType.PRE_VOTE_RESP, 1, nid, 1)]
        assert prd.hard_state is None
        assert (peer.term, peer.vote) == (0, NONE)


def test_failed_prevote_leaves_term_unchanged() -> None:
    """A pre-candidate whose log is behind is refused by a quorum and returns
    to follower in the same term; nobody's term moved."""
    n1 = new_node(1, storage=preload(term=1))
    n2 = new_node(2, storage=preload(ents(1, 1), term=1))
    n3 = new_node(3, storage=preload(ents(1, 1), term=1))
    net = Network({1: n1, 2: n2, 3: n3})
    n1.campaign()
    net.deliver_all()
    assert (n1.role, n1.term) == (Role.FOLLOWER, 1)
    assert terms(net) == {1: 1, 2: 1, 3: 1}


# ===========================================================================
# Check-quorum
# ===========================================================================


def test_check_quorum_leader_steps_down_without_a_quorum() -> None:
    """A leader that hears from no quorum for a whole election timeout steps
    down (so a partitioned leader stops serving), keeping its term."""
    net = elected()
    leader = net.nodes[1]
    net.isolate(1)
    for _ in range(2 * E - 1):
        leader.tick()
        read_messages(leader)
    assert leader.role is Role.LEADER
    leader.tick()
    assert (leader.role, leader.term, leader.lead) == (Role.FOLLOWER, 1, NONE)


def test_check_quorum_leader_stays_with_one_follower() -> None:
    net = elected()
    net.isolate(3)
    net.tick([1], times=5 * E)
    assert net.nodes[1].role is Role.LEADER


def test_check_quorum_does_not_count_learners() -> None:
    net = elected(learners=(4, 5))
    net.isolate(2)
    net.isolate(3)
    net.tick([1, 4, 5], times=2 * E)
    assert net.nodes[1].role is Role.FOLLOWER


# ===========================================================================
# Stickiness
# ===========================================================================


def test_stickiness_follower_ignores_vote_requests_while_leader_is_alive() -> None:
    """SCENARIOS 5: a follower that heard from the leader less than
    election_ticks ago ignores PRE_VOTE and VOTE (no reply, no term change);
    once it has not heard for election_ticks it answers again."""
    net = elected()
    f = net.nodes[2]
    net.isolate(2)
    for _ in range(E):
        for mtype in (MsgType.PRE_VOTE, MsgType.VOTE):
            f.step(Message(mtype, 2, 3, 2, log_term=1, index=1))
            assert of_type(read_messages(f), MsgType.PRE_VOTE_RESP, MsgType.VOTE_RESP) == []
        assert (f.term, f.vote) == (1, 1)
        f.tick()
    f.step(Message(MsgType.PRE_VOTE, 2, 3, 2, log_term=1, index=1))
    assert of_type(read_messages(f), MsgType.PRE_VOTE_RESP) == [
        Message(MsgType.PRE_VOTE_RESP, 3, 2, 2, log_term=1, commit=1)
    ]


def test_stickiness_leader_ignores_higher_term_vote_requests() -> None:
    net = elected()
    leader = net.nodes[1]
    for mtype in (MsgType.PRE_VOTE, MsgType.VOTE):
        leader.step(Message(mtype, 1, 3, 5, log_term=9, index=9))
        assert read_messages(leader) == []
        assert (leader.role, leader.term) == (Role.LEADER, 1)


def test_stickiness_is_off_without_check_quorum() -> None:
    net = elected(check_quorum=False)
    f = net.nodes[2]
    f.step(Message(MsgType.VOTE, 2, 3, 2, log_term=1, index=1))
    assert read_messages(f) == [Message(MsgType.VOTE_RESP, 3, 2, 2, log_term=1, commit=1)]


def test_asymmetric_partition_keeps_a_single_stable_leader() -> None:
    """SCENARIOS 4: a follower that can send but not receive times out and
    pre-votes forever, but everyone else heard the leader recently and
    ignores it: one leader, one term, commits continue."""
    net = elected()
    net.drop(1, 3)
    net.drop(2, 3)
    for k in range(20 * E):
        net.tick()
        if k % 10 == 0:
            net.nodes[1].propose(b"w")
    assert net.leaders() == [1]
    assert terms(net) == {1: 1, 2: 1, 3: 1}
    assert net.nodes[1].log.committed == net.nodes[1].log.last_index()
    assert any(m.frm == 3 and m.type is MsgType.PRE_VOTE for m in net.delivered)


def test_follower_that_cannot_send_keeps_following() -> None:
    net = elected()
    net.drop(3, 1)
    net.drop(3, 2)
    net.tick(times=10 * E)
    assert net.leaders() == [1]
    assert terms(net) == {1: 1, 2: 1, 3: 1}


@pytest.mark.parametrize("c_wins_by", ["recampaign", "delayed_vote"])
def test_lease_is_exclusive_despite_a_delayed_higher_term_message(c_wins_by: str) -> None:
    """Lease exclusivity: while leader L holds a lease that follower F's
    acknowledgement established, no other leader can be elected with F's
    vote, even after a higher-term message that is not a vote request has
    raised F's term and cleared its leader. (Regression: in 29faa4f stickiness
    was ``lead != NONE and election_elapsed < E``, so step 4 below made F vote
    at once.) Every event below is legal in an asynchronous network:

    1. L leads term 1; L is cut off; F and C stop hearing it (E ticks) and
       F's election timer fires: its PRE_VOTE(term 2) to C is delayed.
    2. C's timer fires; F (no leader now) grants C's pre-vote; C becomes a
       candidate of term 2 (its VOTE requests are lost).
    3. L's heartbeat reaches F: F follows L again and acks; L's lease starts.
    4. L is cut off again. F's delayed PRE_VOTE reaches C, which (term 2,
       voted for itself) rejects it with term 2; the rejection reaches F.
    5. C's timer fires again (it started in step 2, so this can be any moment
       now): F grants C's pre-vote and vote; C leads term 3 while L's lease
       is still valid. L serves LEASE reads that miss C's writes.
       Variant ``delayed_vote``: C's VOTE(term 2) from step 2 was delayed, not
       lost; it reaches F (now term 2, no vote, no leader), which grants it
       (stickiness is only checked for higher-term requests): C leads term 2.
    """
    net = elected()
    L, F, C = net.nodes[1], net.nodes[2], net.nodes[3]
    # 1. everything cut; F and C tick out of their stickiness
    for a in (1, 2, 3):
        net.isolate(a)
    for _ in range(E):
        for n in (L, F, C):
            n.tick()
        net.take()
    F.campaign()  # F's timer fires
    f_prevote_to_c = next(m for m in read_messages(F) if m.to == 3 and m.type is MsgType.PRE_VOTE)
    # 2. C campaigns; F grants the pre-vote; C's VOTEs are lost
    C.campaign()
    for m in read_messages(C):
        if m.to == 2:
            F.step(m)
    for m in read_messages(F):
        C.step(m)
    c_vote_to_f = next(m for m in read_messages(C) if m.to == 2 and m.type is MsgType.VOTE)
    assert (C.role, C.term) == (Role.CANDIDATE, 2)
    # 3. L's heartbeat reaches F, F acks: lease
    L.tick()
    for m in read_messages(L):
        if m.to == 2 and m.type is MsgType.HEARTBEAT:
            F.step(m)
    for m in read_messages(F):
        L.step(m)
    read_messages(L)
    assert (F.role, F.lead, F.term) == (Role.FOLLOWER, 1, 1)
    assert L.lease_valid()
    # 4. the delayed PRE_VOTE reaches C; its rejection reaches F
    C.step(f_prevote_to_c)
    for m in read_messages(C):
        F.step(m)
    read_messages(F)
    assert (F.term, F.lead) == (2, NONE)
    assert L.lease_valid()
    # 5. C's timer fires (or its delayed VOTE arrives): with F's vote it wins
    if c_wins_by == "recampaign":
        C.campaign()
    else:
        F.step(c_vote_to_f)
    for _ in range(3):
        for m in read_messages(C):
            if m.to == 2:
                F.step(m)
        for m in read_messages(F):
            if m.to == 3:
                C.step(m)
    new_leader = C.role is Role.LEADER
    assert not (new_leader and L.lease_valid()), (
        f"node 3 leads term {C.term} while node 1 (term {L.term}) holds a lease "
        f"for {L.lease_remaining_ticks()} more ticks"
    )


# ===========================================================================
# Lease and ReadIndex
# ===========================================================================


def test_read_index_before_the_noop_commits_waits() -> None:
    """No read is answered (locally or by ReadIndex) before the leader's no-op
    of its term has committed, even if a heartbeat round was acknowledged."""
    net = Network.of()
    net.dropped_types.add(MsgType.APP)
    net.elect(1)
    leader = net.nodes[1]
    assert leader.log.committed == 0
    hb_round(net)  # acknowledged, but the no-op is not committed
    assert not leader.lease_valid()
    leader.read_index(5)
    out = net.take()
    assert not of_type(out, MsgType.HEARTBEAT)
    assert net.read_states.get(1, []) == []
    net.recover()
    hb_round(net)  # the heartbeat responses trigger the no-op's replication
    assert leader.log.committed == 1
    rs = net.read_states[1]
    assert [(r.ctx, r.index) for r in rs] == [(5, 1)]


def test_lease_needs_an_acknowledged_heartbeat_round() -> None:
    """A leader answers read_index locally (LEASE) only once its no-op is
    committed and a quorum acknowledged a heartbeat round; the first read
    goes through ReadIndex (a heartbeat round) and is answered after the
    acks."""
    net = elected()
    leader = net.nodes[1]
    assert leader.log.committed == 1
    assert not leader.lease_valid()
    leader.read_index(1)
    rd = net.process(1)[0]
    assert rd.read_states == ()
    hbs = of_type(rd.messages, MsgType.HEARTBEAT)
    assert [m.to for m in hbs] == [2, 3]
    ctx = hbs[0].context
    assert all(m.context == ctx for m in hbs)
    net.deliver_all()
    assert net.read_states[1] == [ReadState(1, 1, ReadMode.READ_INDEX)]
    assert leader.lease_valid()
    leader.read_index(2)
    rd2 = net.process(1)[0]
    assert rd2.read_states == (ReadState(2, 1, ReadMode.LEASE),)
    assert rd2.messages == ()


def test_lease_counts_from_the_tick_the_round_was_sent() -> None:
    """An acknowledgement that arrives late must not extend the lease past
    sent_tick + election_ticks - lease_drift_ticks."""
    net = elected()
    leader = net.nodes[1]
    sent = hb_round(net, deliver=False)
    held = net.take()
    assert of_type(held, MsgType.HEARTBEAT)
    for _ in range(5):  # later rounds are lost
        leader.tick()
        net.take()
    net.send(*held)
    net.deliver_all()
    assert leader.lease_valid()
    assert leader.lease_remaining_ticks() == sent + LEASE - leader.tick_count == LEASE - 5
    while leader.tick_count < sent + LEASE - 1:
        leader.tick()
        net.take()
        assert leader.lease_valid()
    leader.tick()
    net.take()
    assert leader.tick_count == sent + LEASE
    assert not leader.lease_valid()
    assert leader.lease_remaining_ticks() == 0
    assert leader.role is Role.LEADER


def test_lease_read_index_counts_the_ticks_the_driver_has_not_delivered() -> None:
    """lease_read_index(behind) answers as read_index would after ``behind``
    more ticks, without ticking: the commit index while the lease holds at
    that tick, None from the expiry on, None on a follower."""
    net = elected()
    leader = net.nodes[1]
    sent = hb_round(net)
    assert leader.lease_valid()
    left = sent + LEASE - leader.tick_count
    ticks = leader.tick_count
    assert leader.lease_read_index() == leader.log.committed
    assert leader.lease_read_index(left - 1) == leader.log.committed
    assert leader.lease_read_index(left) is None
    assert leader.tick_count == ticks and not net.take()  # asked, nothing moved
    for _ in range(left):
        leader.tick()
        net.take()
    assert not leader.lease_valid() and leader.lease_read_index() is None
    assert net.nodes[2].lease_read_index() is None  # followers never


def test_lease_read_index_refuses_while_a_transfer_runs() -> None:
    net = elected()
    leader = net.nodes[1]
    hb_round(net)
    assert leader.lease_read_index() == leader.log.committed
    leader.transfer_leadership(2)
    assert leader.lease_read_index() is None


def test_read_after_lease_expiry_uses_read_index() -> None:
    """After the lease expires without acks, read_index sends a heartbeat
    round and answers (READ_INDEX) only after a quorum acknowledged that
    round; an acknowledgement of an older round does not count."""
    net = elected()
    leader = net.nodes[1]
    hb_round(net)
    old_ctx = max(m.context for m in net.delivered if m.type is MsgType.HEARTBEAT)
    net.isolate(1)
    for _ in range(LEASE):
        leader.tick()
        net.take()
    assert not leader.lease_valid()
    assert leader.role is Role.LEADER
    net.recover()
    leader.read_index(7)
    out = net.take()
    hbs = {m.to: m for m in of_type(out, MsgType.HEARTBEAT)}
    assert sorted(hbs) == [2, 3]
    assert hbs[2].context > old_ctx
    assert net.read_states[1] == []
    # a stale acknowledgement (older round) does not answer the read
    leader.step(Message(MsgType.HEARTBEAT_RESP, 1, 3, 1, context=old_ctx))
    net.take()
    assert net.read_states[1] == []
    # one follower acks the new round: leader + 2 is a quorum
    net.send(hbs[2])
    net.deliver_all()
    assert net.read_states[1] == [ReadState(7, leader.log.committed, ReadMode.READ_INDEX)]


def test_read_index_is_the_commit_index_at_request_time() -> None:
    net = elected()
    leader = net.nodes[1]
    net.isolate(3)
    leader.propose(b"a")
    net.deliver_all()
    leader.read_index(9)
    net.deliver_all()
    assert net.read_states[1][-1].ctx == 9
    assert net.read_states[1][-1].index == leader.log.committed == 2


def test_read_on_follower_raises_not_leader_with_hint() -> None:
    net = elected()
    with pytest.raises(NotLeader) as ei:
        net.nodes[2].read_index(1)
    assert ei.value.leader_hint == 1
    with pytest.raises(NotLeader) as ei2:
        net.nodes[3].propose(b"x")
    assert ei2.value.leader_hint == 1
    fresh = new_node(1)
    with pytest.raises(NotLeader) as ei3:
        fresh.read_index(1)
    assert ei3.value.leader_hint == NONE


def test_leader_stepping_down_fails_pending_reads() -> None:
    """Reads pending at the leader (ReadIndex in flight, or waiting for the
    no-op) are failed with the new leader hint when it steps down."""
    net = elected()
    leader = net.nodes[1]
    leader.read_index(11)
    net.take()  # the heartbeat round is lost
    leader.step(Message(MsgType.HEARTBEAT, 1, 2, 2))
    net.process(1)
    assert net.read_failures[1] == [ReadFailed(11, 2)]
    assert net.read_states[1] == []

    net2 = Network.of()
    net2.dropped_types.add(MsgType.APP)
    net2.elect(1)
    l2 = net2.nodes[1]
    l2.read_index(12)  # waits for the no-op
    l2.step(Message(MsgType.APP_RESP, 1, 3, 5))
    net2.process(1)
    assert net2.read_failures[1] == [ReadFailed(12, NONE)]


def test_check_quorum_step_down_fails_pending_reads() -> None:
    net = elected()
    leader = net.nodes[1]
    net.isolate(1)
    leader.read_index(3)
    for _ in range(2 * E):
        leader.tick()
        net.take()
    assert leader.role is Role.FOLLOWER
    assert net.read_failures[1] == [ReadFailed(3, NONE)]


def test_transfer_ends_the_lease_at_once_and_for_the_term() -> None:
    net = elected()
    leader = net.nodes[1]
    hb_round(net)
    assert leader.lease_valid()
    net.dropped_types.add(MsgType.TIMEOUT_NOW)
    leader.transfer_leadership(2)
    assert not leader.lease_valid()
    assert leader.lease_remaining_ticks() == 0
    leader.read_index(4)
    out = net.take()
    assert of_type(out, MsgType.HEARTBEAT)  # a ReadIndex round, not a lease read
    net.send(*out)
    net.deliver_all()
    assert net.read_states[1] == [ReadState(4, 1, ReadMode.READ_INDEX)]
    # the transfer aborts after an election timeout; the lease stays off
    net.tick([1], times=E + 2)
    assert leader.transferee == NONE and leader.role is Role.LEADER
    assert not leader.lease_valid()
    leader.read_index(5)
    net.deliver_all()
    assert net.read_states[1][-1] == ReadState(5, 1, ReadMode.READ_INDEX)


def test_single_voter_serves_reads_at_once() -> None:
    net = Network.of((1,))
    net.elect(1)
    n = net.nodes[1]
    n.read_index(1)
    net.process(1)
    assert [r.ctx for r in net.read_states[1]] == [1]
    assert net.read_states[1][0].index == 1


# ===========================================================================
# Learners
# ===========================================================================


def test_learner_never_campaigns_and_its_votes_do_not_count() -> None:
    """A learner never stands for election. It does answer vote requests (it
    may hold a promotion it has not applied yet), but a candidate whose
    configuration lists it as a learner does not count its vote."""
    net = elected(learners=(4,))
    learner = net.nodes[4]
    assert learner.status().role is Role.LEARNER
    net.isolate(4)
    for _ in range(5 * E):
        learner.tick()
        assert read_messages(learner) == []
    learner.step(Message(MsgType.VOTE, 4, 2, 3, log_term=1, index=1))
    (resp,) = read_messages(learner)
    assert resp.type is MsgType.VOTE_RESP and not resp.reject
    assert learner.vote == 2
    # candidates do not ask learners, and a learner's grant does not win
    c = new_node(2, learners=(4,), pre_vote=False)
    c.campaign()
    assert {m.to for m in read_messages(c)} == {1, 3}
    c.step(Message(MsgType.VOTE_RESP, 2, 4, c.term))
    assert c.role is Role.CANDIDATE


def test_learners_receive_entries_but_do_not_count_for_commit() -> None:
    """With 2 of 3 voters down and the learners up, nothing commits."""
    net = elected(learners=(4, 5))
    leader = net.nodes[1]
    net.isolate(2)
    net.isolate(3)
    idx = leader.propose(b"x")
    net.deliver_all()
    assert leader.log.committed == 1
    for nid in (4, 5):
        assert core_log(net.nodes[nid])[-1] == (idx, 1)
        assert stored_log(net.nodes[nid])[-1] == (idx, 1)
    assert leader.status().peers[4].match == idx
    net.recover()
    net.tick([1])
    assert leader.log.committed == idx
    assert [e.index for e in net.applied[4]] == [1, 2]


def test_learners_do_not_count_for_the_lease_or_read_index() -> None:
    net = elected(learners=(4, 5))
    leader = net.nodes[1]
    net.isolate(2)
    net.isolate(3)
    leader.read_index(1)
    net.deliver_all()
    hb_round(net)
    assert net.read_states[1] == []
    assert not leader.lease_valid()
    net.recover()
    hb_round(net)
    assert [r.ctx for r in net.read_states[1]] == [1]


def test_promoted_learner_counts_for_commit() -> None:
    net = elected(learners=(4,))
    leader = net.nodes[1]
    leader.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 4))
    net.deliver_all()
    for n in net.nodes.values():
        assert n.config.voters == (1, 2, 3, 4) and n.config.learners == ()
    assert net.nodes[4].status().role is Role.FOLLOWER
    # 4 voters, quorum 3: 1 and 2 alone cannot commit any more
    net.isolate(3)
    net.isolate(4)
    idx = leader.propose(b"x")
    net.deliver_all()
    assert leader.log.committed < idx
    net.recover()
    net.isolate(3)
    net.tick([1])
    assert leader.log.committed == idx
    # and the promoted node now votes
    p = net.nodes[4]
    p.step(Message(MsgType.VOTE, 4, 2, 5, log_term=1, index=idx, force=True))
    assert of_type(read_messages(p), MsgType.VOTE_RESP) == [
        Message(MsgType.VOTE_RESP, 2, 4, 5, log_term=1, commit=3)
    ]


def test_promoting_a_lagging_learner_is_refused() -> None:
    net = elected(learners=(4,), transfer_max_lag=2)
    leader = net.nodes[1]
    net.isolate(4)
    for k in range(4):
        leader.propose(bytes([k]))
    net.deliver_all()
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 4))
    net.recover()
    net.tick([1])
    leader.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 4))


# ===========================================================================
# Leadership transfer
# ===========================================================================


def test_transfer_refuses_non_voters_and_lagging_nodes() -> None:
    net = elected(learners=(4,), transfer_max_lag=2)
    leader = net.nodes[1]
    with pytest.raises(DLedgerError):
        leader.transfer_leadership(4)  # a learner
    with pytest.raises(DLedgerError):
        leader.transfer_leadership(9)  # not a member
    net.isolate(2)
    for k in range(3):
        leader.propose(bytes([k]))
    net.deliver_all()
    with pytest.raises(DLedgerError):
        leader.transfer_leadership(2)  # 3 entries behind, max lag 2
    assert leader.transferee == NONE
    leader.transfer_leadership(1)  # to itself: nothing to do
    assert leader.transferee == NONE
    with pytest.raises(NotLeader):
        net.nodes[3].transfer_leadership(3)


def test_transfer_refuses_an_inactive_node() -> None:
    net = elected()
    leader = net.nodes[1]
    net.isolate(3)
    net.tick([1], times=E)  # one check-quorum window: 3 is not recently active
    with pytest.raises(DLedgerError):
        leader.transfer_leadership(3)


def test_proposals_are_refused_during_a_transfer() -> None:
    net = elected()
    leader = net.nodes[1]
    net.dropped_types.add(MsgType.TIMEOUT_NOW)
    leader.transfer_leadership(2)
    assert leader.transferee == 2
    with pytest.raises(TransferInProgress):
        leader.propose(b"x")
    with pytest.raises(TransferInProgress):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 9))
    assert issubclass(TransferInProgress, ProposalDropped)


def test_timeout_now_makes_the_target_campaign_at_once_and_win() -> None:
    """TimeoutNow: the target campaigns immediately, without pre-vote, with a
    forced VOTE that bypasses the others' stickiness, and wins."""
    net = elected()
    leader = net.nodes[1]
    leader.transfer_leadership(2)
    rd = net.process(1)[0]
    assert list(rd.messages) == [Message(MsgType.TIMEOUT_NOW, 2, 1, 1)]
    net.delivered.clear()
    net.deliver_all()
    t = net.nodes[2]
    assert (t.role, t.term) == (Role.LEADER, 2)
    votes = [m for m in net.delivered if m.frm == 2 and m.type in (MsgType.VOTE, MsgType.PRE_VOTE)]
    assert [(m.type, m.to, m.term, m.force) for m in votes] == [
        (MsgType.VOTE, 1, 2, True),
        (MsgType.VOTE, 3, 2, True),
    ]
    assert (leader.role, leader.lead, leader.transferee) == (Role.FOLLOWER, 2, NONE)
    assert net.leaders() == [2]
    t.propose(b"after")
    net.deliver_all()
    assert {n.log.committed for n in net.nodes.values()} == {3}


def test_transfer_to_a_lagging_target_catches_it_up_first() -> None:
    net = elected()
    leader = net.nodes[1]
    net.isolate(2)
    for k in range(3):
        leader.propose(bytes([k]))
    net.deliver_all()
    net.recover()
    leader.transfer_leadership(2)
    out = net.take()
    assert not of_type(out, MsgType.TIMEOUT_NOW)
    net.send(*out)
    net.delivered.clear()
    net.deliver_all()
    kinds = [(m.type, m.frm, m.to) for m in net.delivered]
    tn = kinds.index((MsgType.TIMEOUT_NOW, 1, 2))
    assert (MsgType.APP_RESP, 2, 1) in kinds[:tn]
    assert net.leaders() == [2]
    assert core_log(net.nodes[2])[:5] == core_log(leader)[:5]


def test_transfer_aborts_after_an_election_timeout() -> None:
    net = elected()
    leader = net.nodes[1]
    net.dropped_types.add(MsgType.TIMEOUT_NOW)
    leader.transfer_leadership(2)
    for _ in range(E - 1):
        net.tick([1])
        assert leader.transferee == 2
        with pytest.raises(TransferInProgress):
            leader.propose(b"x")
    net.tick([1])
    assert leader.transferee == NONE
    assert leader.role is Role.LEADER
    idx = leader.propose(b"x")
    net.deliver_all()
    assert leader.log.committed == idx


def test_timeout_now_from_a_non_leader_is_ignored() -> None:
    net = elected(learners=(4,))
    f = net.nodes[2]
    f.step(Message(MsgType.TIMEOUT_NOW, 2, 3, 1))
    assert read_messages(f) == [] and f.role is Role.FOLLOWER
    learner = net.nodes[4]
    learner.step(Message(MsgType.TIMEOUT_NOW, 4, 1, 1))
    assert read_messages(learner) == [] and learner.term == 1


# ===========================================================================
# Membership
# ===========================================================================


def add_node(net: Network, nid: int) -> RawNode:
    """A new, empty node that only knows the bootstrap configuration."""
    n = new_node(nid, net.nodes[1].cfg.peers.voters, net.nodes[1].cfg.peers.learners)
    net.nodes[nid] = n
    return n


def test_add_learner_then_promote() -> None:
    net = elected()
    leader = net.nodes[1]
    n4 = add_node(net, 4)
    assert n4.status().role is Role.LEARNER  # not a voter of its config
    idx = leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.deliver_all()
    assert leader.log.applied >= idx
    assert leader.config.learners == (4,)
    assert 4 in leader.status().peers and leader.status().peers[4].learner
    assert stored_log(n4) == stored_log(leader)
    assert n4.config.learners == (4,)
    leader.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 4))
    net.deliver_all()
    for n in net.nodes.values():
        assert n.config.voters == (1, 2, 3, 4)
    assert n4.status().role is Role.FOLLOWER
    conf = [e for e in net.applied[4] if e.type is EntryType.CONF_CHANGE]
    assert len(conf) == 2


def test_one_membership_change_at_a_time() -> None:
    net = Network.of(pre_vote=False)
    leader = net.nodes[1]
    leader.campaign()
    # elected, but the no-op is not applied yet: no change may start
    for m in read_messages(leader):
        net.nodes[m.to].step(m)
    for nid in (2, 3):
        for m in read_messages(net.nodes[nid]):
            leader.step(m)
    assert leader.role is Role.LEADER
    assert leader.log.applied == 0
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.deliver_all()
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 5))
    net.deliver_all()
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 5))
    net.deliver_all()
    assert leader.config.learners == (4, 5)


def test_quorum_changes_when_the_change_is_applied() -> None:
    """ADD_VOTER commits under the old configuration (2 of 3) and, once
    applied, commits need 3 of 4."""
    net = elected()
    leader = net.nodes[1]
    add_node(net, 4)
    net.isolate(3)
    net.isolate(4)
    idx = leader.propose_conf_change(ConfChange(ConfChangeType.ADD_VOTER, 4))
    assert leader.config.quorum() == 2
    net.deliver_all()
    assert leader.log.committed >= idx and leader.log.applied >= idx
    assert leader.config.voters == (1, 2, 3, 4) and leader.config.quorum() == 3
    x = leader.propose(b"x")
    net.deliver_all()
    assert leader.log.committed < x
    net.recover()
    net.isolate(3)
    net.tick([1])
    assert leader.log.committed == x


def test_removed_leader_steps_down_and_the_rest_elect_a_new_one() -> None:
    net = elected()
    leader = net.nodes[1]
    leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 1))
    net.deliver_all()
    assert leader.role is not Role.LEADER
    assert leader.status().role is Role.LEARNER  # a non-voter follower
    for nid in (2, 3):
        assert net.nodes[nid].config.voters == (2, 3)
    with pytest.raises(NotLeader):
        leader.propose(b"x")
    net.delivered.clear()
    for _ in range(4 * E):
        net.tick()
        if net.leaders():
            break
    (new,) = net.leaders()
    assert new in (2, 3) and net.nodes[new].term == 2
    idx = net.nodes[new].propose(b"y")
    net.deliver_all()
    assert net.nodes[new].log.committed == idx
    assert not any(m.frm == 1 and m.type in (MsgType.VOTE, MsgType.PRE_VOTE) for m in net.delivered)


def test_removed_node_cannot_disrupt_the_members() -> None:
    net = elected()
    leader = net.nodes[1]
    net.isolate(3)
    leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 3))
    net.deliver_all()
    assert leader.config.voters == (1, 2)
    net.recover()
    for _ in range(10 * E):
        net.tick()
    assert net.leaders() == [1]
    assert terms(net)[1] == terms(net)[2] == 1
    # even a voter that is not sticky refuses a non-member's pre-vote,
    # unless the stranger's log is strictly newer than its own (the next test)
    f = new_node(2, voters=(1, 2), storage=preload(ents(1, 1), term=1))
    for index, log_term in ((2, 1), (1, 1), (5, 0)):
        f.step(Message(MsgType.PRE_VOTE, 2, 3, 2, log_term=log_term, index=index))
        (resp,) = read_messages(f)
        assert resp.type is MsgType.PRE_VOTE_RESP and resp.reject, (index, log_term)
    f.step(Message(MsgType.PRE_VOTE, 2, 3, 2, log_term=1, index=3))
    (resp,) = read_messages(f)
    assert not resp.reject


def test_a_voter_that_missed_the_changes_votes_for_the_stranger_that_holds_them() -> None:
    """Voters {1,2,3}; 3 is cut off while 4 is added and promoted and 1 and
    2 are removed: the configuration is {3,4}. 4 loses its leadership
    (check-quorum: 3 is silent), 1 and 2 are gone, 3 comes back with
    {1,2,3}. 3 cannot win with 1 and 2 gone, and 4 needs 3's vote: 3 must
    not refuse 4 as a stranger, since 4's log is newer than its own
    (node-driven simulator, seed 174: no leader ever again)."""
    net = elected()
    net.isolate(3)
    add_node(net, 4)
    net.isolate(3)  # the cut covers the new node too
    lead = net.nodes[1]
    lead.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.deliver_all()
    lead.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 4))
    net.deliver_all()
    lead.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 1))
    net.deliver_all()
    assert net.nodes[2].config.voters == (2, 3, 4)
    for _ in range(4 * E):
        net.tick((2, 4))
        if net.leaders():
            break
    (new,) = [n for n in net.leaders() if n != 1]
    other = 4 if new == 2 else 2
    if new == 2:
        net.nodes[2].transfer_leadership(4)
        net.deliver_all()
        for _ in range(2 * E):
            if net.nodes[4].role is Role.LEADER:
                break
            net.tick((2, 4))
    assert net.nodes[4].role is Role.LEADER
    net.nodes[4].propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, other))
    net.deliver_all()
    assert net.nodes[4].config.voters == (3, 4)
    del net.nodes[1], net.nodes[2]  # retired
    net.tick((4,), times=2 * E)  # check-quorum: 3 is silent
    assert net.leaders() == [] and net.nodes[4].config.voters == (3, 4)
    assert net.nodes[3].config.voters == (1, 2, 3)
    net.recover()
    for _ in range(12 * E):
        net.tick()
        if net.leaders() and net.nodes[3].config.voters == (3, 4):
            break
    assert net.leaders() in ([3], [4]), terms(net)
    assert net.nodes[3].config.voters == (3, 4)
    idx = net.nodes[net.leaders()[0]].propose(b"after")
    net.deliver_all()
    assert net.nodes[3].log.committed >= idx


def test_invalid_membership_changes_are_refused() -> None:
    net = Network.of((1,))
    net.elect(1)
    leader = net.nodes[1]
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 1))  # last voter
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 7))
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_VOTER, 1))
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 2))
    with pytest.raises(ProposalDropped):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 0))
    net3 = elected()
    with pytest.raises(NotLeader):
        net3.nodes[2].propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))


def test_membership_survives_log_compaction_and_restart() -> None:
    """Compaction goes through a snapshot whose meta records the membership,
    so a restart past a compacted membership change keeps it. (Regression:
    the config was rebuilt from cfg.peers + the CONF_CHANGE entries still in
    the log, so compacting one away silently forgot it.)"""
    net = elected(snapshot_trailing_entries=1)
    leader = net.nodes[1]
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.deliver_all()
    leader.propose(b"x")
    net.deliver_all()
    assert leader.config.learners == (4,)
    st = storage_of(leader)
    last = st.last_index()
    take_snapshot(leader)
    snap = st.snapshot()
    assert snap is not None and snap.meta.index == last
    assert snap.meta.config.learners == (4,)
    assert st.first_index() == last  # the conf change entry is gone
    restarted = new_node(1, storage=st, booted=False, applied=last, snapshot=snap.meta)
    assert restarted.config.learners == (4,)
    assert restarted.log.applied == last and not restarted.has_ready()


def test_restart_over_a_compacted_log_without_its_snapshot_is_refused() -> None:
    """Without the snapshot the membership before the stored log is unknown:
    refuse loudly rather than fall back to the bootstrap peers."""
    net = elected(snapshot_trailing_entries=0)
    net.nodes[1].propose(b"x")
    net.deliver_all()
    take_snapshot(net.nodes[1])
    st = storage_of(net.nodes[1])
    assert st.first_index() > 1
    with pytest.raises(InvariantViolation):
        new_node(1, storage=st, booted=False)


# ===========================================================================
# Commit-only appends (no_reply)
# ===========================================================================


def test_commit_only_append_is_not_answered_but_commits() -> None:
    """Once a quorum acknowledged an entry, the leader tells the followers the
    new commit index in an append without entries marked ``no_reply``: they
    commit and apply it, and answer nothing (the answer would repeat an
    acknowledgement the leader holds). Appends that carry entries, and the
    probes of a follower the leader is not sure of, are still answered."""
    net = elected(voters=(1, 2, 3))
    r = net.nodes[1]
    net.delivered.clear()
    r.propose(b"a")
    net.deliver_all()
    apps = of_type(net.delivered, MsgType.APP)
    with_entries = [m for m in apps if m.entries]
    commit_only = [m for m in apps if not m.entries]
    assert {m.to for m in with_entries} == {2, 3}
    assert all(not m.no_reply for m in with_entries)
    # Node 2's acknowledgement committed the entry (with the leader's own
    # copy) while node 3's was still on its way: neither commit-only append
    # asks for an answer (node 3's answer to the entries is already coming;
    # asking again made it answer twice).
    assert [(m.to, m.commit, m.no_reply) for m in commit_only] == [(2, 2, True), (3, 2, True)]
    resps = sorted(m.frm for m in of_type(net.delivered, MsgType.APP_RESP))
    assert resps == [2, 3]
    assert r.status().peers[3].match == 2
    for nid in (1, 2, 3):
        assert net.nodes[nid].log.committed == 2
        assert [e.data for e in net.applied[nid]][-1] == b"a"


def test_a_lost_answer_is_asked_for_again_at_the_next_heartbeat_answer() -> None:
    """Node 3's acknowledgement of an entry is lost, and the commit-only
    append that follows asks for no answer: the leader sees node 3 behind in
    its next heartbeat answer and sends an append that does ask, so node 3's
    progress catches up without waiting for another proposal."""
    net = elected(voters=(1, 2, 3))
    r = net.nodes[1]
    lost: list[Message] = []

    def swallow(m: Message) -> bool:
        if m.type is MsgType.APP_RESP and m.frm == 3 and not lost:
            lost.append(m)
            return True
        return False

    net.intercept = swallow
    r.propose(b"a")
    net.deliver_all()
    idx = r.log.last_index()
    assert lost and lost[0].index == idx
    assert r.log.committed == idx and r.status().peers[3].match < idx
    net.intercept = None
    net.delivered.clear()
    for _ in range(r.cfg.heartbeat_ticks):
        hb_round(net)
    asked = [m for m in of_type(net.delivered, MsgType.APP) if m.to == 3 and not m.entries]
    assert asked and not asked[0].no_reply
    assert r.status().peers[3].match == idx


def test_a_follower_that_lost_an_acknowledged_tail_is_repaired_with_nothing_new_to_send() -> None:
    """Async flush: node 3 acknowledged entries, learned none of them
    committed, and lost them to a crash. No proposal follows, so no append
    would ever show the leader its mistake: node 3's heartbeat answer says it
    lacks the entry the leader believes it holds, the leader probes it from
    there, and node 3 gets the entries back and commits them."""
    net = elected(voters=(1, 2, 3))
    r = net.nodes[1]
    base = r.log.committed
    # node 3 never hears a commit index past ``base`` before its crash
    net.intercept = lambda m: m.to == 3 and m.type is MsgType.APP and not m.entries
    for data in (b"a", b"b", b"c"):
        r.propose(data)
    net.deliver_all()
    idx = r.log.last_index()
    assert r.status().peers[3].match == idx and r.log.committed == idx
    assert net.nodes[3].log.committed == base
    net.intercept = None
    storage_of(net.nodes[3]).truncate_from(base + 1)  # the unsynced tail, gone
    n3 = net.restart(3, crash=False)
    assert n3.log.last_index() == base
    for _ in range(2 * r.cfg.heartbeat_ticks):
        hb_round(net)
    assert n3.log.last_index() == idx and n3.log.committed == idx
    assert [e.data for e in net.applied[3]][-3:] == [b"a", b"b", b"c"]


def test_commit_only_append_is_answered_when_rejected() -> None:
    """A follower that no longer holds what it acknowledged (an async-mode
    replica that lost its unsynced tail) rejects a ``no_reply`` append like
    any other, and its rejection reaches the leader, which then repairs it."""
    net = elected(voters=(1, 2, 3))
    r = net.nodes[1]
    r.propose(b"a")
    net.deliver_all()
    idx = r.log.last_index()
    stale = Message(
        MsgType.APP, 2, 1, r.term, log_term=r.term, index=idx + 5, commit=idx, no_reply=True
    )
    net.nodes[2].step(stale)
    resp = of_type(read_messages(net.nodes[2]), MsgType.APP_RESP)
    assert len(resp) == 1 and resp[0].reject and resp[0].index == idx + 5


# ===========================================================================
# Idle heartbeat rounds
# ===========================================================================


def _round_ticks(net: Network, ticks: int) -> list[int]:
    """Tick the leader ``ticks`` times (the followers too, delivering after
    each); the leader's tick counts at which it sent a heartbeat round."""
    leader = net.nodes[1]
    sent = []
    for _ in range(ticks):
        net.tick()
        if any(m.type is MsgType.HEARTBEAT and m.frm == 1 for m in net.delivered):
            sent.append(leader.tick_count)
        net.delivered.clear()
    return sent


def test_an_idle_leader_stretches_its_rounds_and_a_request_shortens_them_at_once() -> None:
    """heartbeat_ticks 2, idle_heartbeat_ticks 6 (E = 10): rounds every 2
    ticks while anything happened in the last 3 election timeouts, then
    every 6, during which the followers stay sticky and the lease stays
    held; ticks_until_due lets the driver sleep through to the next round.
    A proposal or a read brings the 2-tick rounds back at once."""
    net = elected(heartbeat_ticks=2, idle_heartbeat_ticks=6)
    leader = net.nodes[1]
    busy = _round_ticks(net, 3 * E)
    assert all(b - a == 2 for a, b in itertools.pairwise(busy)), busy
    idle = _round_ticks(net, 4 * E)
    gaps = {b - a for a, b in itertools.pairwise(idle)}
    assert gaps == {6}, idle
    assert leader.idle_rounds >= 5
    assert leader.ticks_until_due() <= 6
    assert leader.role is Role.LEADER and leader.lease_valid()
    for nid in (2, 3):  # sticky: a vote request from anyone is refused
        assert net.nodes[nid]._in_stickiness()

    assert leader._idle()
    leader.propose(b"x")
    net.deliver_all()
    assert not leader._idle() and leader.ticks_until_due() <= 2
    after = _round_ticks(net, E)
    assert all(b - a == 2 for a, b in itertools.pairwise(after)), after

    # Idle again, then a read: the short interval is back at once.
    _round_ticks(net, 4 * E)
    assert leader._idle()
    leader.read_index(7)
    net.deliver_all()
    assert not leader._idle() and leader.ticks_until_due() <= 2


def test_a_lagging_follower_keeps_the_leader_busy() -> None:
    """A follower that has not acknowledged the leader's last entry (cut
    off) keeps the short rounds: it is probed at the usual pace."""
    net = elected(heartbeat_ticks=2, idle_heartbeat_ticks=6)
    leader = net.nodes[1]
    net.isolate(3)
    leader.propose(b"y")
    net.deliver_all()
    rounds = _round_ticks(net, 5 * E)
    tail = rounds[len(rounds) // 2 :]
    assert all(b - a == 2 for a, b in itertools.pairwise(tail)), rounds
    assert leader.idle_rounds == 0


def test_idle_heartbeat_ticks_is_validated() -> None:
    from dledger.core.types import ClusterConfig, RaftConfig
    from dledger.errors import ConfigError

    def config(**kw: int) -> RaftConfig:
        return RaftConfig(
            node_id=1, peers=ClusterConfig((1,), ()), election_ticks=10, heartbeat_ticks=2, **kw
        )

    for bad in (1, 10, 11):  # below heartbeat_ticks, at or above election_ticks
        with pytest.raises(ConfigError, match="idle_heartbeat_ticks"):
            config(idle_heartbeat_ticks=bad).validate()
    for bad in (-1, 3):  # a notice later than the next heartbeat round is pointless
        with pytest.raises(ConfigError, match="commit_notify_ticks"):
            config(commit_notify_ticks=bad).validate()


def test_a_moved_commit_rides_on_the_next_append_or_leaves_one_tick_later() -> None:
    """commit_notify_ticks 1 (a node setting, off by default): when an acknowledgement
    moves the commit index the leader sends no commit-only append at once;
    the next request's append carries it (with one request at a time, one
    frame and one follower loop pass less per request), and followers that
    get no append within a tick get a commit-only one then (ticks_until_due
    wakes the driver for it). With 0 every follower gets one at once."""
    net = elected(heartbeat_ticks=3, commit_notify_ticks=1)
    leader = net.nodes[1]
    followers = (net.nodes[2], net.nodes[3])

    def commit_only() -> list[Message]:
        return [m for m in net.delivered if m.type is MsgType.APP and not m.entries]

    net.delivered.clear()
    a = leader.propose(b"a")
    net.deliver_all()
    assert leader.log.committed == a
    assert all(f.log.committed < a for f in followers)
    assert commit_only() == [] and leader.ticks_until_due() == 1
    b = leader.propose(b"b")
    net.deliver_all()
    assert all(f.log.committed == a for f in followers)  # carried by b's append
    assert leader.log.committed == b and commit_only() == []
    net.tick([1])  # one tick, no heartbeat round due: the notice goes out
    assert all(f.log.committed == b for f in followers)
    assert len(commit_only()) == 2
    net.tick([1])
    assert len(commit_only()) == 2  # told once; nothing more until the commit moves

    now = elected(heartbeat_ticks=3, commit_notify_ticks=0)
    now.delivered.clear()
    c = now.nodes[1].propose(b"c")
    now.deliver_all()
    assert all(now.nodes[i].log.committed == c for i in (2, 3))
    assert len([m for m in now.delivered if m.type is MsgType.APP and not m.entries]) == 2
