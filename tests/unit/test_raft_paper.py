"""The rules of the Raft paper, one test per rule, in the style of etcd's
``raft_paper_test.go``: set a node (or a few) up, act, check the exact
messages and state that come out.

Sections: 5.1 terms, 5.2 leader election, 5.3 log replication, 5.4 safety
(5.4.1 election restriction, 5.4.2 commitment rule / figure 8), plus the
durability rules the Ready contract implies (vote persisted before the reply
leaves, restart remembers term and vote, commit clamped after a damaged tail).
"""

from __future__ import annotations

import random

import pytest

from dledger.core.raft import RawNode
from dledger.core.types import (
    NONE,
    Entry,
    EntryType,
    HardState,
    Message,
    MsgType,
    Role,
)
from dledger.errors import ReplicaDiverged
from tests.unit.raft_harness import (
    E,
    Network,
    core_log,
    drain,
    ents,
    new_node,
    of_type,
    persist,
    preload,
    read_messages,
    step_ready,
    storage_of,
    stored_log,
)

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def node_in_role(
    role: Role, term: int, voters: tuple[int, ...] = (1, 2, 3), **kw: object
) -> RawNode:
    """Node 1 in ``role`` at ``term`` (>= 1), with every pending message read."""
    if role in (Role.FOLLOWER, Role.PRE_CANDIDATE):
        r = new_node(1, voters, storage=preload(term=term), **kw)  # type: ignore[arg-type]
        if role is Role.PRE_CANDIDATE:
            r.campaign()
    else:
        r = new_node(1, voters, storage=preload(term=term - 1), pre_vote=False, **kw)  # type: ignore[arg-type]
        r.campaign()
        if role is Role.LEADER:
            read_messages(r)
            r.step(Message(MsgType.VOTE_RESP, 1, 2, term))
    read_messages(r)
    assert (r.role, r.term) == (role, term)
    return r


def ticks_until_campaign(r: RawNode, limit: int = 10 * E) -> tuple[int, list[Message]]:
    for t in range(1, limit + 1):
        r.tick()
        msgs = read_messages(r)
        if of_type(msgs, MsgType.VOTE, MsgType.PRE_VOTE):
            return t, msgs
    raise AssertionError("never campaigned")


def elected_leader(n: int = 3, **kw: object) -> Network:
    net = Network.of(tuple(range(1, n + 1)), **kw)  # type: ignore[arg-type]
    net.elect(1)
    return net


# ===========================================================================
# 5.1 Terms
# ===========================================================================


@pytest.mark.parametrize("role", [Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE, Role.LEADER])
@pytest.mark.parametrize(
    "mtype, want_lead",
    [
        (MsgType.APP, 2),
        (MsgType.HEARTBEAT, 2),
        (MsgType.APP_RESP, NONE),
        (MsgType.HEARTBEAT_RESP, NONE),
        (MsgType.VOTE_RESP, NONE),
        (MsgType.TIMEOUT_NOW, NONE),
    ],
)
def test_paper_update_term_from_message(role: Role, mtype: MsgType, want_lead: int) -> None:
    """5.1: if a message carries a larger term, the node adopts it and reverts
    to follower (knowing the leader when the message comes from one)."""
    r = node_in_role(role, term=2)
    r.step(Message(mtype, 1, 2, 3))
    assert r.role is Role.FOLLOWER
    assert r.term == 3
    assert r.lead == want_lead
    assert r.vote == NONE
    rd = step_ready(r)
    assert rd.hard_state is not None and rd.hard_state.term == 3
    assert rd.must_sync


@pytest.mark.parametrize("role", [Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE])
def test_paper_higher_term_vote_request_without_leader_steps_down(role: Role) -> None:
    """5.1: a VOTE with a larger term makes a node without a live leader adopt
    the term (and grant the vote, its log being no more up to date)."""
    r = node_in_role(role, term=2)
    r.step(Message(MsgType.VOTE, 1, 2, 3))
    assert (r.role, r.term, r.vote) == (Role.FOLLOWER, 3, 2)
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, 2, 1, 3)]


def test_paper_rejected_pre_vote_resp_with_higher_term_steps_down() -> None:
    r = node_in_role(Role.PRE_CANDIDATE, term=2)
    r.step(Message(MsgType.PRE_VOTE_RESP, 1, 2, 5, reject=True))
    assert (r.role, r.term) == (Role.FOLLOWER, 5)


def test_paper_granted_pre_vote_resp_does_not_change_term() -> None:
    r = node_in_role(Role.PRE_CANDIDATE, term=2)
    # A grant carries the term asked about (ours + 1): no term change.
    r.step(Message(MsgType.PRE_VOTE_RESP, 1, 2, 3))
    assert r.role is Role.CANDIDATE  # quorum of 3: self + 2
    assert r.term == 3  # the real campaign's term, not adopted from the reply


@pytest.mark.parametrize("role", [Role.FOLLOWER, Role.CANDIDATE, Role.LEADER])
def test_paper_reject_stale_term_append(role: Role) -> None:
    """5.1: a request with a stale term is rejected. The stale leader gets an
    APP_RESP carrying the newer term, so it can step down."""
    r = node_in_role(role, term=3)
    log_before = core_log(r)
    for mtype in (MsgType.APP, MsgType.HEARTBEAT):
        r.step(Message(mtype, 1, 2, 2, log_term=0, index=0, entries=tuple(ents(2)), commit=1))
        assert read_messages(r) == [Message(MsgType.APP_RESP, 2, 1, 3)]
        assert (r.role, r.term, r.lead) == (role, 3, 1 if role is Role.LEADER else NONE)
        assert core_log(r) == log_before


@pytest.mark.parametrize("role", [Role.FOLLOWER, Role.CANDIDATE, Role.LEADER])
def test_paper_ignore_stale_term_vote_and_responses(role: Role) -> None:
    r = node_in_role(role, term=3)
    vote = r.vote
    for mtype in (
        MsgType.VOTE,
        MsgType.VOTE_RESP,
        MsgType.APP_RESP,
        MsgType.HEARTBEAT_RESP,
        MsgType.PRE_VOTE_RESP,
        MsgType.TIMEOUT_NOW,
    ):
        r.step(Message(mtype, 1, 2, 2, index=9, log_term=9))
        assert read_messages(r) == []
        assert (r.role, r.term, r.vote) == (role, 3, vote)


def test_paper_stale_pre_vote_is_answered_with_reject() -> None:
    r = node_in_role(Role.FOLLOWER, term=3)
    r.step(Message(MsgType.PRE_VOTE, 1, 2, 2, index=9, log_term=9))
    assert read_messages(r) == [Message(MsgType.PRE_VOTE_RESP, 2, 1, 3, reject=True)]
    assert r.term == 3


def test_paper_stale_leader_steps_down_after_app_resp_with_higher_term() -> None:
    """A healed stale leader learns the newer term from the stale-term reply."""
    net = elected_leader()
    old = net.nodes[1]
    net.isolate(1)
    # 2 and 3 time out and elect one of them in term 2 (1 cannot hear it).
    for _ in range(3 * E):
        net.tick([2, 3])
        if net.leaders() != [1]:
            break
    (new,) = (n for n in net.leaders() if n != 1)
    assert net.nodes[new].term == 2
    assert old.role is Role.LEADER and old.term == 1
    net.recover()
    net.delivered.clear()
    old.tick()  # heartbeat of term 1
    net.deliver_all()
    assert old.status().role is Role.FOLLOWER
    assert old.term == 2
    resp = [m for m in net.delivered if m.to == 1 and m.type is MsgType.APP_RESP]
    assert resp and all(m.term == 2 for m in resp)
    # and it then learns the new leader from its heartbeats
    net.tick([new])
    assert old.lead == new


# ===========================================================================
# 5.2 Leader election
# ===========================================================================


def test_paper_start_as_follower() -> None:
    r = new_node(1)
    assert (r.role, r.term, r.vote, r.lead) == (Role.FOLLOWER, 0, NONE, NONE)


def test_paper_leader_bcast_heartbeat() -> None:
    """5.2: a leader sends periodic heartbeats (every heartbeat_ticks)."""
    net = elected_leader(heartbeat_ticks=2)
    r = net.nodes[1]
    r.tick()
    assert read_messages(r) == []
    r.tick()
    msgs = read_messages(r)
    ctx = msgs[0].context
    assert ctx >= 1
    assert msgs == [
        Message(MsgType.HEARTBEAT, 2, 1, 1, commit=1, log_term=1, context=ctx),
        Message(MsgType.HEARTBEAT, 3, 1, 1, commit=1, log_term=1, context=ctx),
    ]
    r.tick()
    r.tick()
    assert [m.context for m in read_messages(r)] == [ctx + 1, ctx + 1]


def test_paper_heartbeat_commit_is_clamped_to_follower_match() -> None:
    """A heartbeat never tells a follower to commit beyond what it matches."""
    net = elected_leader()
    r = net.nodes[1]
    net.isolate(3)
    r.propose(b"a")
    net.deliver_all()
    assert r.log.committed == 2
    r.tick()
    hb = {m.to: m for m in read_messages(r) if m.type is MsgType.HEARTBEAT}
    assert hb[2].commit == 2
    assert hb[3].commit == 1  # node 3 matches only index 1


@pytest.mark.parametrize("pre_vote", [True, False])
def test_paper_follower_starts_election_after_timeout(pre_vote: bool) -> None:
    """5.2: a follower that hears nothing for its election timeout (randomized
    in [E, 2E)) starts an election: with pre-vote a PRE_VOTE round for
    term + 1 without changing its term; without, a VOTE round in term + 1
    after voting for itself, durably (hard state in the same Ready)."""
    r = new_node(1, storage=preload(ents(1), term=1, commit=1), pre_vote=pre_vote)
    drain(r)  # apply the committed entry first
    t = 0
    while not r.has_ready() and t < 2 * E:
        r.tick()
        t += 1
    assert E <= t < 2 * E
    rd = r.ready()
    if pre_vote:
        assert (r.role, r.term, r.vote) == (Role.PRE_CANDIDATE, 1, NONE)
        assert rd.hard_state is None
        want = MsgType.PRE_VOTE
    else:
        assert (r.role, r.term, r.vote) == (Role.CANDIDATE, 2, 1)
        assert rd.hard_state == HardState(2, 1, 1)
        assert rd.must_sync
        want = MsgType.VOTE
    assert list(rd.messages) == [
        Message(want, 2, 1, 2, log_term=1, index=1),
        Message(want, 3, 1, 2, log_term=1, index=1),
    ]


def test_paper_election_timeout_is_randomized_in_range() -> None:
    """5.2: election timeouts are drawn from [E, 2E) so split votes are rare."""
    seen = set()
    for seed in range(80):
        r = new_node(1, seed=seed)
        t, _ = ticks_until_campaign(r)
        assert E <= t < 2 * E
        seen.add(t)
    assert len(seen) >= E // 2, seen


def test_paper_candidate_times_out_and_retries_with_new_randomized_timeout() -> None:
    r = new_node(1, pre_vote=False)
    r.campaign()
    read_messages(r)
    assert r.term == 1
    t, msgs = ticks_until_campaign(r)
    assert E <= t < 2 * E
    assert r.term == 2 and r.role is Role.CANDIDATE and r.vote == 1
    assert {m.term for m in msgs if m.type is MsgType.VOTE} == {2}


@pytest.mark.parametrize(
    "size, votes, want",
    [
        (1, {}, Role.LEADER),
        (3, {2: True, 3: True}, Role.LEADER),
        (3, {2: True}, Role.LEADER),
        (5, {2: True, 3: True, 4: True, 5: True}, Role.LEADER),
        (5, {2: True, 3: True, 4: True}, Role.LEADER),
        (5, {2: True, 3: True}, Role.LEADER),
        (3, {2: False, 3: False}, Role.FOLLOWER),
        (5, {2: False, 3: False, 4: False, 5: False}, Role.FOLLOWER),
        (5, {2: True, 3: False, 4: False, 5: False}, Role.FOLLOWER),
        (3, {}, Role.CANDIDATE),
        (5, {2: True}, Role.CANDIDATE),
        (5, {2: False, 3: False}, Role.CANDIDATE),
        (5, {}, Role.CANDIDATE),
    ],
)
@pytest.mark.parametrize("pre_vote", [False, True])
def test_paper_leader_election_in_one_round(
    size: int, votes: dict[int, bool], want: Role, pre_vote: bool
) -> None:
    """5.2: a candidate wins with votes from a quorum, loses (reverts to
    follower) once a quorum rejects, and otherwise keeps waiting. With
    pre-vote the same counting decides whether the real campaign starts."""
    voters = tuple(range(1, size + 1))
    r = new_node(1, voters, pre_vote=pre_vote)
    r.campaign()
    read_messages(r)
    resp = MsgType.PRE_VOTE_RESP if pre_vote else MsgType.VOTE_RESP
    for frm, granted in votes.items():
        # a grant carries the term asked about; a rejection the voter's term
        term = 1 if granted else (0 if pre_vote else 1)
        r.step(Message(resp, 1, frm, term, reject=not granted))
    if pre_vote and size > 1:
        want = {
            Role.LEADER: Role.CANDIDATE,
            Role.FOLLOWER: Role.FOLLOWER,
            Role.CANDIDATE: Role.PRE_CANDIDATE,
        }[want]
    assert r.role is want
    assert r.term == (0 if r.role in (Role.PRE_CANDIDATE, Role.FOLLOWER) and pre_vote else 1)


def test_paper_new_leader_appends_noop_of_its_term_and_replicates_it() -> None:
    """Section 8 / 5.2: a new leader appends a no-op of its term at once."""
    r = new_node(1, storage=preload(ents(1), term=1, commit=1), pre_vote=False)
    r.campaign()
    read_messages(r)
    r.step(Message(MsgType.VOTE_RESP, 1, 2, 2))
    assert r.role is Role.LEADER and r.lead == 1
    rd = r.ready()
    noop = Entry(2, 2, EntryType.NOOP, b"", 0)
    assert rd.entries == (noop,)
    assert rd.soft_state is not None and rd.soft_state.role is Role.LEADER
    assert list(rd.messages) == [
        Message(MsgType.APP, 2, 1, 2, log_term=1, index=1, entries=(noop,), commit=1),
        Message(MsgType.APP, 3, 1, 2, log_term=1, index=1, entries=(noop,), commit=1),
    ]


def test_paper_candidate_reverts_to_follower_on_leader_of_same_term() -> None:
    """5.2: a candidate that hears an AppendEntries from a leader of its term
    recognises it and becomes a follower (also a pre-candidate)."""
    r = node_in_role(Role.CANDIDATE, term=2)
    r.step(Message(MsgType.APP, 1, 3, 2))
    assert (r.role, r.term, r.lead) == (Role.FOLLOWER, 2, 3)
    assert read_messages(r) == [Message(MsgType.APP_RESP, 3, 1, 2, index=0)]
    p = node_in_role(Role.PRE_CANDIDATE, term=2)
    p.step(Message(MsgType.HEARTBEAT, 1, 3, 2))
    assert (p.role, p.term, p.lead) == (Role.FOLLOWER, 2, 3)
    assert read_messages(p) == [Message(MsgType.HEARTBEAT_RESP, 3, 1, 2)]


def test_paper_split_vote_is_retried_in_a_new_term() -> None:
    """5.2: with votes split no one wins; a candidate times out (randomized)
    and starts a new election in a higher term, which it wins."""
    net = Network.of((1, 2, 3, 4), pre_vote=False)
    a, b = net.nodes[1], net.nodes[2]
    a.campaign()
    b.campaign()
    msgs = {(m.frm, m.to): m for m in net.take()}
    order = [(1, 3), (2, 4), (1, 4), (2, 3), (1, 2), (2, 1)]
    net.send(*(msgs[k] for k in order))
    net.deliver_all()
    assert (a.role, a.term, b.role, b.term) == (Role.CANDIDATE, 1, Role.CANDIDATE, 1)
    assert (net.nodes[3].vote, net.nodes[4].vote) == (1, 2)
    t = 0
    while a.term == 1:
        t += 1
        net.tick([1])
    assert E <= t < 2 * E
    assert a.role is Role.LEADER and a.term == 2
    assert all(n.term == 2 for n in net.nodes.values())
    assert net.leaders() == [1]


@pytest.mark.parametrize(
    "vote, frm, reject",
    [(NONE, 2, False), (NONE, 3, False), (2, 2, False), (3, 3, False), (2, 3, True), (3, 2, True)],
)
def test_paper_vote_granted_at_most_once_per_term(vote: int, frm: int, reject: bool) -> None:
    """5.2: each server votes for at most one candidate in a given term."""
    r = new_node(1, storage=preload(term=1, vote=vote))
    r.step(Message(MsgType.VOTE, 1, frm, 1))
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, frm, 1, 1, reject=reject)]
    assert r.vote == (vote if reject else frm)


def test_paper_second_candidate_of_same_term_is_rejected() -> None:
    r = new_node(1, voters=(1, 2, 3, 4))
    r.step(Message(MsgType.VOTE, 1, 2, 2))
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, 2, 1, 2)]
    r.step(Message(MsgType.VOTE, 1, 3, 2))
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, 3, 1, 2, reject=True)]
    r.step(Message(MsgType.VOTE, 1, 2, 2))  # a duplicated request: same answer
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, 2, 1, 2)]
    assert r.vote == 2


def test_paper_follower_knowing_a_leader_rejects_same_term_vote() -> None:
    r = new_node(1, storage=preload(term=2))
    r.step(Message(MsgType.HEARTBEAT, 1, 3, 2))
    read_messages(r)
    r.step(Message(MsgType.VOTE, 1, 2, 2))
    # rejected (a stricter stickiness may also ignore it): never granted
    assert read_messages(r) in ([Message(MsgType.VOTE_RESP, 2, 1, 2, reject=True)], [])
    assert r.vote == NONE


def test_paper_vote_is_persisted_before_the_vote_response_is_sent() -> None:
    """The Ready that carries a granting VOTE_RESP also carries the hard state
    with the vote (and new term): the driver syncs it before sending."""
    r = new_node(1, storage=preload(ents(1), term=1, commit=1))
    r.step(Message(MsgType.VOTE, 1, 2, 2, log_term=1, index=1))
    rd = r.ready()
    assert list(rd.messages) == [Message(MsgType.VOTE_RESP, 2, 1, 2, log_term=1, commit=1)]
    assert rd.hard_state == HardState(2, 2, 1)
    assert rd.must_sync
    # the same holds when the term does not change (vote cast in the current term)
    r2 = new_node(1, storage=preload(ents(1), term=2, commit=1))
    r2.step(Message(MsgType.VOTE, 1, 3, 2, log_term=1, index=1))
    rd2 = r2.ready()
    assert list(rd2.messages) == [Message(MsgType.VOTE_RESP, 3, 1, 2, log_term=1, commit=1)]
    assert rd2.hard_state == HardState(2, 3, 1)
    assert rd2.must_sync


def test_paper_candidate_vote_for_itself_is_persisted_with_its_vote_requests() -> None:
    r = new_node(1, pre_vote=False)
    r.campaign()
    rd = r.ready()
    assert of_type(rd.messages, MsgType.VOTE)
    assert rd.hard_state == HardState(1, 1, 0)
    assert rd.must_sync


def test_paper_pre_vote_response_needs_no_persistence() -> None:
    r = new_node(1, storage=preload(term=1))
    r.step(Message(MsgType.PRE_VOTE, 1, 2, 2))
    rd = r.ready()
    assert list(rd.messages) == [Message(MsgType.PRE_VOTE_RESP, 2, 1, 2)]
    assert rd.hard_state is None
    assert not rd.must_sync


# (log of the voter, candidate's last index, candidate's last term, grant?)
UP_TO_DATE_CASES = [
    (ents(1), 1, 1, True),
    (ents(1), 1, 2, True),
    (ents(1), 2, 1, True),
    (ents(1), 0, 0, False),
    (ents(1, 1), 1, 1, False),
    (ents(1, 1), 2, 1, True),
    (ents(1, 1), 1, 2, True),
    (ents(2), 1, 1, False),
    (ents(2), 2, 1, False),
    (ents(2), 1, 2, True),
    (ents(2), 1, 3, True),
    (ents(1, 2, 2), 5, 1, False),
    (ents(1, 2, 2), 2, 2, False),
    (ents(1, 2, 2), 3, 2, True),
]


@pytest.mark.parametrize("log, index, log_term, grant", UP_TO_DATE_CASES)
@pytest.mark.parametrize("mtype", [MsgType.VOTE, MsgType.PRE_VOTE])
def test_paper_voter_checks_candidate_log_is_up_to_date(
    log: list[Entry], index: int, log_term: int, grant: bool, mtype: MsgType
) -> None:
    """5.4.1: a vote (and a pre-vote) is denied to a candidate whose log is
    less up to date: compare last terms, then lengths."""
    r = new_node(1, storage=preload(log, term=3))
    r.step(Message(mtype, 1, 2, 4, log_term=log_term, index=index))
    msgs = read_messages(r)
    resp = MsgType.VOTE_RESP if mtype is MsgType.VOTE else MsgType.PRE_VOTE_RESP
    assert len(msgs) == 1 and msgs[0].type is resp and msgs[0].to == 2
    assert msgs[0].reject is (not grant)
    if mtype is MsgType.VOTE:
        assert r.term == 4
        assert r.vote == (2 if grant else NONE)
    else:
        assert r.term == 3 and r.vote == NONE  # pre-vote changes nothing
        assert msgs[0].term == (4 if grant else 3)


def test_paper_restarted_node_remembers_term_and_vote() -> None:
    """A vote survives a crash: the restarted node never grants another
    candidate of that term, and (once its boot stickiness is over) repeats
    its grant to the one it voted for."""
    r = new_node(1, storage=preload(ents(1), term=4, commit=1))
    r.step(Message(MsgType.VOTE, 1, 2, 5, log_term=1, index=1))
    assert read_messages(r) == [Message(MsgType.VOTE_RESP, 2, 1, 5, log_term=1, commit=1)]
    st = storage_of(r)
    st.crash()  # only what was synced survives
    r2 = new_node(1, storage=st, booted=False)
    assert (r2.term, r2.vote, r2.role) == (5, 2, Role.FOLLOWER)
    for cand in (3, 2):  # during the boot stickiness: no new grant
        r2.step(Message(MsgType.VOTE, 1, cand, 5, log_term=1, index=1))
        resp = of_type(read_messages(r2), MsgType.VOTE_RESP)
        if cand == 3:
            assert resp in (
                [Message(MsgType.VOTE_RESP, 3, 1, 5, log_term=1, commit=1, reject=True)],
                [],
            )
        assert r2.vote == 2
    for _ in range(E):
        r2.tick()
    read_messages(r2)
    r2.step(Message(MsgType.VOTE, 1, 3, 5, log_term=1, index=1))
    assert of_type(read_messages(r2), MsgType.VOTE_RESP) == [
        Message(MsgType.VOTE_RESP, 3, 1, 5, log_term=1, commit=1, reject=True)
    ]
    r2.step(Message(MsgType.VOTE, 1, 2, 5, log_term=1, index=1))
    assert of_type(read_messages(r2), MsgType.VOTE_RESP) == [
        Message(MsgType.VOTE_RESP, 2, 1, 5, log_term=1, commit=1)
    ]
    assert (r2.term, r2.vote) == (5, 2)


def test_paper_restarted_node_ignores_votes_for_an_election_timeout() -> None:
    """Boot stickiness: a restart forgets whether it heard a leader, so a node
    ignores higher-term vote requests for election_ticks after booting."""
    r = new_node(1, storage=preload(ents(1), term=1, commit=1), booted=False)
    for _ in range(E - 1):
        r.step(Message(MsgType.PRE_VOTE, 1, 2, 2, log_term=1, index=1))
        r.step(Message(MsgType.VOTE, 1, 2, 2, log_term=1, index=1))
        assert read_messages(r) == []
        assert r.term == 1
        r.tick()
    r.tick()
    r.step(Message(MsgType.VOTE, 1, 2, 2, log_term=1, index=1))
    assert of_type(read_messages(r), MsgType.VOTE_RESP) == [
        Message(MsgType.VOTE_RESP, 2, 1, 2, log_term=1, commit=1)
    ]


# ===========================================================================
# 5.3 Log replication
# ===========================================================================


def test_paper_leader_sends_append_on_propose() -> None:
    net = elected_leader()
    r = net.nodes[1]
    assert r.propose(b"x") == 2
    rd = r.ready()
    e2 = Entry(2, 1, EntryType.NORMAL, b"x", 0)
    assert rd.entries == (e2,)  # persisted before the APPs leave
    assert list(rd.messages) == [
        Message(MsgType.APP, 2, 1, 1, log_term=1, index=1, entries=(e2,), commit=1),
        Message(MsgType.APP, 3, 1, 1, log_term=1, index=1, entries=(e2,), commit=1),
    ]
    persist(r, rd)
    r.advance(rd)
    # positions are assigned by the leader as the end of the previous entry
    r.propose(b"yz")
    msgs = read_messages(r)
    assert msgs[0].entries == (Entry(3, 1, EntryType.NORMAL, b"yz", 1),)
    assert (msgs[0].index, msgs[0].log_term) == (2, 1)


def test_paper_leader_commits_and_followers_learn_commit() -> None:
    """5.3: once replicated on a quorum the leader commits, applies, and
    tells followers the commit index in later AppendEntries."""
    net = elected_leader()
    r = net.nodes[1]
    r.propose(b"a")
    net.deliver_all()
    for nid in (1, 2, 3):
        assert net.nodes[nid].log.committed == 2
        assert [(e.index, e.data) for e in net.applied[nid]] == [(1, b""), (2, b"a")]


@pytest.mark.parametrize(
    "index, log_term, new, want_log, want_ack",
    [
        (2, 2, ents(3, start=3), [(1, 1), (2, 2), (3, 3)], 3),
        (1, 1, ents(3, 4, start=2), [(1, 1), (2, 3), (3, 4)], 3),
        (0, 0, ents(1), [(1, 1), (2, 2)], 1),
        (0, 0, ents(3), [(1, 3)], 1),
        (2, 2, [], [(1, 1), (2, 2)], 2),
        (1, 1, [], [(1, 1), (2, 2)], 1),
    ],
)
def test_paper_follower_appends_and_acks_last_index_of_message(
    index: int, log_term: int, new: list[Entry], want_log: list[tuple[int, int]], want_ack: int
) -> None:
    """5.3: a follower that matches (index, log_term) deletes a conflicting
    suffix, appends what is new and acknowledges the last index of the
    message (not of its log)."""
    r = new_node(1, storage=preload(ents(1, 2), term=4))
    r.step(Message(MsgType.APP, 1, 2, 4, log_term=log_term, index=index, entries=tuple(new)))
    assert core_log(r) == want_log
    assert read_messages(r) == [Message(MsgType.APP_RESP, 2, 1, 4, index=want_ack)]
    assert stored_log(r) == want_log


@pytest.mark.parametrize(
    "index, log_term, hint",
    [
        (3, 3, 3),  # term mismatch at index 3
        (5, 2, 3),  # beyond the follower's log
        (2, 1, 1),  # term mismatch earlier: skip the whole term-2 run at once
        (4, 4, 3),
    ],
)
def test_paper_follower_rejects_mismatched_prev_with_hint(
    index: int, log_term: int, hint: int
) -> None:
    """5.3: the consistency check fails when the follower lacks an entry at
    prev index with prev term; the rejection carries a hint: its last entry,
    at or below prev index, whose term is at most prev term, and that term
    (etcd's findConflictByTerm), so the leader skips a whole term at once."""
    r = new_node(1, storage=preload(ents(1, 2, 2), term=4))
    before = core_log(r)
    r.step(
        Message(
            MsgType.APP,
            1,
            2,
            4,
            log_term=log_term,
            index=index,
            entries=tuple(ents(4, start=index + 1)),
        )
    )
    term_at_hint = dict(before)[hint]
    assert read_messages(r) == [
        Message(
            MsgType.APP_RESP,
            2,
            1,
            4,
            index=index,
            reject=True,
            reject_hint=hint,
            log_term=term_at_hint,
        )
    ]
    assert core_log(r) == before


LEADER_LOG = [1, 1, 1, 4, 4, 5, 5, 6, 6, 6]
FIGURE_7_FOLLOWERS = {
    "a": [1, 1, 1, 4, 4, 5, 5, 6, 6],
    "b": [1, 1, 1, 4],
    "c": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 6],
    "d": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 7, 7],
    "e": [1, 1, 1, 4, 4, 4, 4],
    "f": [1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3],
    "empty": [],
}


@pytest.mark.parametrize("name", sorted(FIGURE_7_FOLLOWERS))
def test_paper_leader_sync_follower_log(name: str) -> None:
    """5.3 / figure 7: whatever the follower's log, the leader finds the
    last matching entry, overwrites the follower's conflicting suffix and
    brings it to exactly the leader's log."""
    leader = new_node(1, storage=preload(ents(*LEADER_LOG), term=8, commit=3))
    follower = new_node(2, storage=preload(ents(*FIGURE_7_FOLLOWERS[name]), term=7))
    leader.campaign()
    read_messages(leader)
    leader.step(Message(MsgType.PRE_VOTE_RESP, 1, 3, 9))
    read_messages(leader)
    leader.step(Message(MsgType.VOTE_RESP, 1, 3, 9))
    assert leader.role is Role.LEADER and leader.term == 9
    net = Network({1: leader, 2: follower})  # node 3 voted, then went silent
    net.deliver_all()
    want = [*((i + 1, t) for i, t in enumerate(LEADER_LOG)), (11, 9)]
    assert stored_log(leader) == want
    assert stored_log(follower) == want
    assert core_log(follower) == want
    assert leader.log.committed == follower.log.committed == 11
    assert leader.status().peers[2].match == 11


def test_paper_delayed_append_does_not_truncate_acknowledged_entries() -> None:
    """SCENARIOS 6: a delayed or duplicated older APP whose entries all match
    must not truncate the entries after it (they may have been acknowledged
    and counted for commit)."""
    r = new_node(1, storage=preload(ents(1), term=2, commit=1))
    r.step(
        Message(MsgType.APP, 1, 2, 2, log_term=1, index=1, entries=tuple(ents(2, 2, 2, start=2)))
    )
    assert read_messages(r) == [Message(MsgType.APP_RESP, 2, 1, 2, index=4)]
    for old in (tuple(ents(2, start=2)), tuple(ents(2, 2, start=2)), ()):
        r.step(Message(MsgType.APP, 1, 2, 2, log_term=1, index=1, entries=old))
        rd = step_ready(r)
        assert rd.entries == ()  # nothing rewritten
        assert list(rd.messages) == [Message(MsgType.APP_RESP, 2, 1, 2, index=1 + len(old))]
        assert core_log(r) == stored_log(r) == [(1, 1), (2, 2), (3, 2), (4, 2)]


def test_paper_append_below_commit_is_answered_with_what_it_proved() -> None:
    """An append whose prev index is below our commit index (delayed or
    duplicated) is checked against our committed entries and acknowledged
    only as far as it proved agreement: never blindly with our commit index,
    which would hide a diverged replica."""
    r = new_node(1, storage=preload(ents(1, 1, 1), term=1, commit=3))
    r.step(Message(MsgType.APP, 1, 2, 1, log_term=1, index=1, entries=tuple(ents(1, start=2))))
    assert read_messages(r) == [Message(MsgType.APP_RESP, 2, 1, 1, index=2)]
    assert core_log(r) == [(1, 1), (2, 1), (3, 1)]
    # entries that reach past our commit index are appended as usual
    r.step(
        Message(MsgType.APP, 1, 2, 1, log_term=1, index=1, entries=tuple(ents(1, 1, 1, start=2)))
    )
    assert read_messages(r) == [Message(MsgType.APP_RESP, 2, 1, 1, index=4)]
    assert core_log(r) == [(1, 1), (2, 1), (3, 1), (4, 1)]


def test_paper_append_contradicting_a_committed_entry_stops_the_replica() -> None:
    """A leader whose log differs from ours at or below our commit index
    (possible only after acknowledged writes were lost, e.g. a majority power
    loss in async flush mode) is never acknowledged: the replica stops and
    asks to be rebuilt (ReplicaDiverged, a StorageCorrupted: exit 2)."""
    r = new_node(1, storage=preload(ents(1, 1, 1), term=1, commit=3))
    with pytest.raises(ReplicaDiverged):
        r.step(Message(MsgType.APP, 1, 2, 2, log_term=1, index=1, entries=tuple(ents(2, start=2))))
    r = new_node(1, storage=preload(ents(1, 1, 1), term=1, commit=3))
    with pytest.raises(ReplicaDiverged):
        r.step(Message(MsgType.APP, 1, 2, 2, log_term=2, index=2, entries=()))


def test_paper_leader_never_records_a_match_beyond_its_log() -> None:
    net = elected_leader()
    r = net.nodes[1]
    before = r.status().peers[2]
    r.step(Message(MsgType.APP_RESP, 1, 2, 1, index=r.log.last_index() + 5))
    assert read_messages(r) == []
    assert r.status().peers[2] == before


def test_paper_stale_success_reply_never_lowers_match() -> None:
    """SCENARIOS 7: a delayed/duplicated success reply for an older append
    carries a lower index; match must not move backwards."""
    net = elected_leader()
    r = net.nodes[1]
    for d in (b"a", b"b", b"c"):
        r.propose(d)
    net.deliver_all()
    pr = r.status().peers[2]
    assert (pr.match, pr.next, pr.state) == (4, 5, "REPLICATE")
    for idx in (0, 1, 2, 3, 4):
        r.step(Message(MsgType.APP_RESP, 1, 2, 1, index=idx))
        assert read_messages(r) == []
        assert r.status().peers[2] == pr
    assert r.log.committed == 4


def test_paper_stale_rejection_is_ignored() -> None:
    net = elected_leader()
    r = net.nodes[1]
    for d in (b"a", b"b", b"c"):
        r.propose(d)
    net.deliver_all()
    pr = r.status().peers[2]
    r.step(Message(MsgType.APP_RESP, 1, 2, 1, index=2, reject=True, reject_hint=2, log_term=1))
    assert read_messages(r) == []
    assert r.status().peers[2] == pr


@pytest.mark.parametrize(
    "acks, committed",
    [((), False), ((2,), False), ((2, 3), True), ((2, 3, 4), True), ((2, 3, 4, 5), True)],
)
def test_paper_leader_commits_only_with_a_quorum_of_matches(
    acks: tuple[int, ...], committed: bool
) -> None:
    """5.3: an entry is committed once the leader has replicated it on a
    majority (itself included)."""
    net = elected_leader(5)
    r = net.nodes[1]
    for nid in (2, 3, 4, 5):
        if nid not in acks:
            net.isolate(nid)
    idx = r.propose(b"x")
    net.deliver_all()
    assert (r.log.committed >= idx) is committed
    assert any(e.index == idx for e in net.applied[1]) is committed


@pytest.mark.parametrize("ack_index, want_commit", [(1, 0), (2, 0), (3, 3)])
def test_paper_leader_only_commits_entries_of_its_term_by_counting(
    ack_index: int, want_commit: int
) -> None:
    """5.4.2: entries of earlier terms are never committed by counting
    replicas; only once an entry of the current term is on a quorum (and
    then everything before it with it)."""
    r = new_node(1, storage=preload(ents(1, 2), term=2))
    r.campaign()
    read_messages(r)
    r.step(Message(MsgType.PRE_VOTE_RESP, 1, 2, 3))
    read_messages(r)
    r.step(Message(MsgType.VOTE_RESP, 1, 2, 3))
    read_messages(r)
    assert r.role is Role.LEADER and r.log.last_index() == 3
    r.step(Message(MsgType.APP_RESP, 1, 2, 3, index=ack_index))
    rds = drain(r)
    assert r.log.committed == want_commit
    got = [(e.index, e.term) for rd in rds for e in rd.committed_entries]
    assert got == ([(1, 1), (2, 2), (3, 3)] if want_commit else [])


@pytest.mark.parametrize("current_term_entry_replicated", [False, True])
def test_paper_figure_8(current_term_entry_replicated: bool) -> None:
    """Figure 8, end to end with 5 nodes. S1 leads term 4 with 2@2 on a
    majority (S1, S2, S3). Not committed: S5 (last entry 2@3) can still be
    elected by S2, S3, S4 and overwrite it. Once S1's own no-op (3@4) is on a
    majority, the entries are committed and S5 can no longer win."""
    logs = {1: ents(1, 2), 2: ents(1, 2), 3: ents(1), 4: ents(1), 5: ents(1, 3)}
    terms = {1: 3, 2: 3, 3: 3, 4: 3, 5: 4}
    nodes = {
        nid: new_node(
            nid,
            (1, 2, 3, 4, 5),
            storage=preload(logs[nid], term=terms[nid], commit=1),
            check_quorum=False,
        )
        for nid in logs
    }
    net = Network(nodes)
    net.isolate(4)
    net.isolate(5)

    def strip(m: Message) -> bool:
        # S1's appends reach S2 and S3 only up to index 2 (a size-limited or
        # partially lost append); the no-op 3@4 stays on S1.
        if m.type is MsgType.APP and m.frm == 1 and any(e.index >= 3 for e in m.entries):
            kept = tuple(e for e in m.entries if e.index < 3)
            net.queue.append(
                Message(m.type, m.to, m.frm, m.term, m.log_term, m.index, kept, m.commit)
            )
            return True
        return False

    if not current_term_entry_replicated:
        net.intercept = strip
    net.elect(1)
    s1 = nodes[1]
    assert s1.term == 4
    for nid in (1, 2, 3):
        assert core_log(nodes[nid])[:2] == [(1, 1), (2, 2)]
    if current_term_entry_replicated:
        assert s1.log.committed == 3
    else:
        assert s1.log.committed == 1, "2@2 is on a majority but must not be committed"
        assert all(e.index < 2 for n in net.applied.values() for e in n)
    # S1 crashes; S5 tries to become leader with S2, S3, S4.
    net.intercept = None
    net.recover()
    net.isolate(1)
    nodes[5].campaign()
    net.deliver_all()
    if current_term_entry_replicated:
        assert nodes[5].role is not Role.LEADER
        assert all(core_log(nodes[nid])[:3] == [(1, 1), (2, 2), (3, 4)] for nid in (1, 2, 3))
    else:
        # Safe only because 2@2 was never committed: S5 overwrites it.
        assert nodes[5].role is Role.LEADER
        for nid in (2, 3, 4, 5):
            assert core_log(nodes[nid])[1] == (2, 3)
            assert [e.term for e in net.applied.get(nid, []) if e.index == 2] in ([], [3])


def test_paper_committed_entries_in_order_exactly_once() -> None:
    """Committed entries are handed to the driver in index order, each once,
    even with duplicated, reordered and dropped messages."""
    for seed in range(6):
        rng = random.Random(seed)
        net = Network.of((1, 2, 3), max_inflight_msgs=4, max_msg_bytes=64)
        net.rng = rng
        net.dup_rate = 0.2

        def lossy(m: Message, rng: random.Random = rng) -> bool:
            return rng.random() < 0.05

        net.elect(1)
        net.intercept = lossy
        proposed = 0
        for step in range(150):
            leaders = net.leaders()
            if leaders and rng.random() < 0.6:
                net.nodes[leaders[-1]].propose(bytes([step % 256]) * rng.randrange(1, 40))
                proposed += 1
            net.tick()
        net.intercept = None
        net.tick(times=3 * E)
        assert proposed > 0
        lasts = set()
        for nid, node in net.nodes.items():
            got = [e.index for e in net.applied[nid]]
            assert got == list(range(1, len(got) + 1)), (seed, nid)
            assert len(got) == node.log.committed
            lasts.add(node.log.committed)
        assert len(lasts) == 1, (seed, lasts)  # quiet period: everybody caught up
        # log matching: identical committed prefixes (index, term, data, pos)
        ref = net.applied[1]
        for nid in (2, 3):
            assert net.applied[nid] == ref


def test_paper_restart_clamps_commit_past_last_index() -> None:
    """SCENARIOS 8: a saved commit index past the durable log's end (damaged
    tail) is clamped on restart, not trusted."""
    st = preload(ents(1, 1, 1), term=1, vote=1, commit=5)
    r = new_node(1, storage=st, booted=False, applied=7)
    assert r.log.committed == 3
    assert r.status().commit == 3
    assert r.status().applied == 3
    r2 = new_node(1, storage=preload(ents(1, 1, 1), term=1, commit=5), booted=False)
    rd = step_ready(r2)
    assert [e.index for e in rd.committed_entries] == [1, 2, 3]
    assert r2.log.applied == 3


def test_paper_flow_control_limits_inflight_appends() -> None:
    """In REPLICATE the leader pipelines at most max_inflight_msgs
    unacknowledged APPs to a follower, then pauses until an ack frees slots."""
    net = elected_leader(max_inflight_msgs=3)
    r = net.nodes[1]
    assert r.status().peers[2].state == "REPLICATE"
    sent = []
    for k in range(10):
        r.propose(bytes([k]))
        sent.append([m for m in read_messages(r) if m.to == 2 and m.type is MsgType.APP])
    assert [len(s) for s in sent] == [1, 1, 1] + [0] * 7
    firsts = [s[0].entries[-1].index for s in sent[:3]]
    assert firsts == [2, 3, 4]
    # acknowledging the first frees one slot: everything pending goes in one APP
    r.step(Message(MsgType.APP_RESP, 1, 2, 1, index=2))
    apps = [m for m in read_messages(r) if m.to == 2 and m.type is MsgType.APP]
    assert len(apps) == 1
    assert [e.index for e in apps[0].entries] == list(range(5, 12))
    r.propose(b"more")
    assert [m for m in read_messages(r) if m.to == 2 and m.type is MsgType.APP] == []


def test_paper_heartbeat_response_frees_one_inflight_slot() -> None:
    net = elected_leader(max_inflight_msgs=2)
    r = net.nodes[1]
    for k in range(4):
        r.propose(bytes([k]))
        read_messages(r)
    r.step(Message(MsgType.HEARTBEAT_RESP, 1, 2, 1))
    apps = [m for m in read_messages(r) if m.to == 2 and m.type is MsgType.APP]
    assert len(apps) == 1
    assert apps[0].index == 3  # after the two in flight (2 and 3)


def test_paper_append_batching_respects_max_msg_bytes() -> None:
    net = elected_leader(max_msg_bytes=100)
    r = net.nodes[1]
    net.isolate(3)
    for k in range(5):
        r.propose(bytes([k]) * 40)
    net.deliver_all()
    apps = [m for m in net.delivered if m.type is MsgType.APP and m.to == 2 and m.entries]
    got = [e.index for m in apps for e in m.entries]
    assert got[-5:] == [2, 3, 4, 5, 6]
    for m in apps:
        assert m.entries
        assert sum(len(e.data) for e in m.entries) <= 100
    assert [len(m.entries) for m in apps if m.entries[0].index >= 2] == [2, 2, 1]
    assert r.log.committed == 6


def test_paper_oversized_entry_is_sent_alone() -> None:
    net = elected_leader(max_msg_bytes=100)
    r = net.nodes[1]
    r.propose(b"x" * 500)
    r.propose(b"y" * 10)
    out = net.take()
    msgs = [m for m in out if m.to == 2]
    assert [len(m.entries) for m in msgs] == [1]
    assert msgs[0].entries[0].data == b"x" * 500
    net.send(*out)
    net.deliver_all()
    assert r.log.committed == 3
