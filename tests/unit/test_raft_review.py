"""Rules found missing by a review of the core against the Raft thesis and
etcd's raft (issue #12), one test per rule in the style of
``test_raft_paper.py``. Where a planted fault switch restores the old rule,
the test runs both ways: the switch on shows the bug the test catches."""

from __future__ import annotations

import pytest

from dledger.core.codec import encode_conf_change
from dledger.core.raft import (
    FAULT_CAMPAIGN_UNAPPLIED_CONF,
    FAULT_HEARTBEAT_COMMIT_UNCHECKED,
    FAULT_LEARNER_IGNORES_VOTES,
    RawNode,
)
from dledger.core.types import (
    EARLY_SEND_TYPES,
    ConfChange,
    ConfChangeType,
    Entry,
    EntryType,
    Message,
    MsgType,
    RaftConfig,
    ReadMode,
    Role,
)
from dledger.errors import ConfigError
from tests.unit.raft_harness import (
    E,
    Network,
    drain,
    ents,
    new_node,
    of_type,
    persist,
    preload,
    read_messages,
)


def _promotions_log(*nids: int) -> list[Entry]:
    """1: a no-op of term 1, then one PROMOTE_LEARNER entry per node."""
    out = [Entry(1, 1, EntryType.NOOP, b"")]
    for k, nid in enumerate(nids, start=2):
        cc = encode_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, nid))
        out.append(Entry(k, 1, EntryType.CONF_CHANGE, cc))
    return out


def _campaign_msgs(msgs: list[Message]) -> list[Message]:
    return of_type(msgs, MsgType.PRE_VOTE, MsgType.VOTE)


# ===========================================================================
# 1. No campaign while a committed membership change is not applied
# ===========================================================================


@pytest.mark.parametrize("planted", [False, True], ids=["rule", "planted-bug"])
def test_no_campaign_while_a_committed_conf_change_is_unapplied(planted: bool) -> None:
    """Voters {1,2,3} + learners {4,5}; the durable, committed log promotes 4
    and 5. Node 1 restarts and replays slowly (nothing applied yet): its
    configuration is still {1,2,3}, where {1,2} is a quorum, while {3,4,5} is
    a quorum of the real one. It must not stand for election (nor honour a
    TimeoutNow) until it has applied the promotions."""
    faults = frozenset({FAULT_CAMPAIGN_UNAPPLIED_CONF}) if planted else frozenset()
    st = preload(_promotions_log(4, 5), term=1, commit=3)
    n = new_node(1, (1, 2, 3), (4, 5), storage=st, faults=faults)
    assert n.config.voters == (1, 2, 3)
    for _ in range(3 * E):
        n.tick()
    rd = n.ready()  # look, without applying anything
    campaigned = _campaign_msgs(list(rd.messages))
    if planted:
        assert campaigned and {m.to for m in campaigned} == {2, 3}
        return
    assert campaigned == [] and n.role is Role.FOLLOWER
    n.step(Message(MsgType.TIMEOUT_NOW, 1, 2, 1))  # a transfer must wait too
    assert n.role is Role.FOLLOWER
    persist(n, rd)
    n.advance(rd)  # applies the promotions
    drain(n)
    assert n.config.voters == (1, 2, 3, 4, 5)
    for _ in range(3 * E):
        n.tick()
    assert {m.to for m in _campaign_msgs(read_messages(n))} == {2, 3, 4, 5}


@pytest.mark.parametrize("planted", [False, True], ids=["rule", "planted-bug"])
def test_split_brain_needs_the_unapplied_campaign(planted: bool) -> None:
    """The whole scenario: after a full restart, nodes 1 and 2 replay slowly
    (their Readies are never handled, so nothing gets applied) and a
    partition {1,2} | {3,4,5} separates them from the rest. {3,4,5} elect a
    leader; {1,2} must not, or two leaders commit different entries at one
    index."""
    faults = frozenset({FAULT_CAMPAIGN_UNAPPLIED_CONF}) if planted else frozenset()
    log = _promotions_log(4, 5)

    def node(nid: int) -> RawNode:
        st = preload(log, term=1, commit=3)
        return new_node(nid, (1, 2, 3), (4, 5), storage=st, booted=False, faults=faults)

    net = Network({nid: node(nid) for nid in (3, 4, 5)})
    slow = {nid: node(nid) for nid in (1, 2)}
    for _ in range(8 * E):
        net.tick()
        for n in slow.values():
            n.tick()
        for _ in range(3):  # the two exchange messages, unapplied all along
            for n in slow.values():
                out, n._msgs = n._msgs, []
                for m in out:
                    if m.to in slow:
                        slow[m.to].step(m)
    assert len(net.leaders()) == 1
    slow_leaders = [nid for nid, n in slow.items() if n.role is Role.LEADER]
    if planted:
        assert len(slow_leaders) == 1  # a second leader, of the old configuration
    else:
        assert slow_leaders == []


# ===========================================================================
# 2. A promoted learner that has not applied its promotion still votes
# ===========================================================================


@pytest.mark.parametrize("planted", [False, True], ids=["rule", "planted-bug"])
def test_promoted_learner_votes_before_applying_its_promotion(planted: bool) -> None:
    """Voters {2,3} + learner 1; "promote 1" commits on {2,3} but never
    reaches 1; then 2 dies. {1,3} is a quorum of {1,2,3}: 3 must be elected
    with 1's vote, although 1 still believes it is a learner."""
    faults = frozenset({FAULT_LEARNER_IGNORES_VOTES}) if planted else frozenset()
    net = Network.of((2, 3), (1,), faults=faults)
    net.elect(2)
    net.isolate(1)
    net.nodes[2].propose_conf_change(ConfChange(ConfChangeType.PROMOTE_LEARNER, 1))
    net.deliver_all()
    assert net.nodes[3].config.voters == (1, 2, 3)
    assert net.nodes[1].config.voters == (2, 3)  # it never heard
    net.recover()
    net.isolate(2)  # 2 dies
    net.tick((1, 3), times=8 * E)
    if planted:
        assert net.leaders() == [2]  # only the dead one: no leader ever
        return
    assert 3 in net.leaders()
    assert net.nodes[1].config.voters == (1, 2, 3)  # it caught up from 3


def test_a_vote_from_a_removed_node_is_still_refused() -> None:
    """Answering as a learner does not mean answering strangers: a candidate
    outside our configuration whose log is no newer than ours is refused."""
    n = new_node(1, (1, 2, 3), storage=preload(ents(1, 2), term=2))
    n.step(Message(MsgType.VOTE, 1, 9, 5, log_term=2, index=2))
    (resp,) = read_messages(n)
    assert resp.reject


# ===========================================================================
# 3. Log repair skips a whole term per round trip
# ===========================================================================


def test_log_repair_skips_a_whole_term_per_round_trip() -> None:
    """Node 2, an old minority leader, piled up 1000 entries of term 2; the
    new leader holds 1000 entries of term 3 at the same indexes. The repair
    takes one rejection, not one per entry."""
    n_ents = 1000
    net = Network.of((1, 2, 3))
    net.nodes[1] = new_node(1, storage=preload(ents(1, *[3] * n_ents), term=3))
    net.nodes[3] = new_node(3, storage=preload(ents(1, *[3] * n_ents), term=3))
    net.nodes[2] = new_node(2, storage=preload(ents(1, *[2] * n_ents), term=3))
    net.elect(1)
    rejects = [m for m in net.delivered if m.type is MsgType.APP_RESP and m.reject]
    assert len(rejects) == 1, [(m.index, m.reject_hint, m.log_term) for m in rejects]
    lead = net.nodes[1]
    assert net.nodes[2].log.last_index() == lead.log.last_index()
    assert net.nodes[2].log.term(n_ents) == 3


def test_find_conflict_by_term() -> None:
    n = new_node(1, storage=preload(ents(1, 1, 2, 2, 4, 4), term=4))
    log = n.log
    assert log.find_conflict_by_term(6, 4) == (6, 4)
    assert log.find_conflict_by_term(6, 3) == (4, 2)
    assert log.find_conflict_by_term(6, 1) == (2, 1)
    assert log.find_conflict_by_term(6, 0) == (0, 0)
    assert log.find_conflict_by_term(99, 5) == (6, 4)


# ===========================================================================
# 4. The lease: a documented margin, and suspended after a stalled loop
# ===========================================================================


def test_lease_margin_is_a_documented_inequality() -> None:
    cfg = RaftConfig(node_id=1, peers=new_node(1).cfg.peers, election_ticks=15, lease_drift_ticks=3)
    assert cfg.lease_margin_ticks() == pytest.approx(14 * 0.99 - 12 * 1.01)
    with pytest.raises(ConfigError, match="no safety margin"):
        RaftConfig(
            node_id=1,
            peers=cfg.peers,
            election_ticks=10,
            lease_drift_ticks=1,
            clock_drift_max=0.05,
        ).validate()


def test_a_suspended_lease_comes_back_only_with_a_later_round() -> None:
    """After a loop stall the driver suspends the lease: reads go by
    ReadIndex, and an acknowledgement of a round sent before the stall does
    not restore it; one sent after it does."""
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    lead.tick()
    net.deliver_all()
    assert lead.lease_valid()
    lead.tick()  # a round whose acknowledgements arrive after the stall
    before = net.take()
    lead.suspend_lease()
    assert not lead.lease_valid()
    for m in before:
        net.nodes[m.to].step(m)
    net.deliver_all()
    assert not lead.lease_valid()
    lead.read_index(7)
    net.deliver_all()
    (rs,) = net.read_states[1]
    assert rs.mode is ReadMode.READ_INDEX  # the read's own round went by ReadIndex
    assert lead.lease_valid()  # ... and that later round gave the lease back


# ===========================================================================
# 5. Persist before send, also for a lone voter
# ===========================================================================


def test_a_lone_voter_sends_nothing_before_its_new_term_is_durable() -> None:
    """A single voter wins within one step; its appends to learners must not
    share a Ready (and so possibly leave before the sync) with its new term
    and vote."""
    n = new_node(1, (1,), (2, 3), pre_vote=True)
    for _ in range(3 * E):
        n.tick()
        if n.role is Role.LEADER:
            break
    assert n.role is Role.LEADER
    rd = n.ready()
    assert rd.hard_state is not None and rd.hard_state.term == 1 and rd.hard_state.vote == 1
    assert [m for m in rd.messages if m.type in EARLY_SEND_TYPES] == []
    persist(n, rd)
    n.advance(rd)
    rd2 = n.ready()
    assert {m.to for m in rd2.messages if m.type is MsgType.APP} == {2, 3}
    assert rd2.hard_state is None or rd2.hard_state.term == 1


# ===========================================================================
# 6. A heartbeat commits only an entry the leader confirmed we hold
# ===========================================================================


@pytest.mark.parametrize("planted", [False, True], ids=["rule", "planted-bug"])
def test_heartbeat_commit_needs_the_confirmed_entry(planted: bool) -> None:
    """A follower that lost its unsynced tail (async flush) and now holds
    other entries at those indexes must not commit them on a heartbeat whose
    commit index the leader confirmed for the entries it had before."""
    faults = frozenset({FAULT_HEARTBEAT_COMMIT_UNCHECKED}) if planted else frozenset()
    # our log: 1@1 2@1 3@2 (3@2 is an uncommitted leftover); the leader's
    # entry 3 is 3@3 and it believes we hold it (a stale match)
    f = new_node(2, storage=preload(ents(1, 1, 2), term=3), faults=faults)
    f.step(Message(MsgType.HEARTBEAT, 2, 1, 3, commit=3, log_term=3, context=1))
    if planted:
        assert f.log.committed == 3  # applies an entry that never committed
        return
    assert f.log.committed == 0
    f.step(Message(MsgType.HEARTBEAT, 2, 1, 3, commit=2, log_term=1, context=2))
    assert f.log.committed == 2
    resps = of_type(read_messages(f), MsgType.HEARTBEAT_RESP)
    assert [m.context for m in resps] == [1, 2]


# ===========================================================================
# Bounded catch-up work: bytes in flight per follower
# ===========================================================================


def test_catch_up_sends_at_most_max_inflight_bytes_per_follower() -> None:
    """A leader catching up a far-behind follower streams at most
    ``max_inflight_bytes`` of entries before an acknowledgement frees some,
    however many messages ``max_inflight_msgs`` would allow: the work of one
    loop pass stays small (a restarted follower used to cost the leader a
    stall of hundreds of MiB read and encoded at once, and a leader change)."""
    payload = b"x" * 1000
    net = Network.of((1, 2, 3), max_msg_bytes=4096, max_inflight_bytes=20_000)
    net.elect(1)
    lead = net.nodes[1]
    net.isolate(3)
    for _ in range(200):
        lead.propose(payload)
    net.deliver_all()
    net.recover()
    seen: list[int] = []

    def watch(m: Message) -> bool:
        if m.type is MsgType.APP and m.to == 3:
            seen.append(lead._progress[3].inflight_bytes)
        return False

    net.intercept = watch
    net.tick((1,), times=3)  # heartbeats: 3 answers, is probed, then caught up
    net.deliver_all()
    assert net.nodes[3].log.last_index() == lead.log.last_index()
    assert len(seen) > 10
    assert max(seen) <= 20_000 + 4096  # the bound, plus at most one message
    assert max(seen) > 10_000  # and the window was really used


# ===========================================================================
# Idle cost: the driver may sleep until the next tick that matters
# ===========================================================================


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_ticking_the_due_ticks_at_once_equals_ticking_each(role: str) -> None:
    """Sleeping ``ticks_until_due()`` ticks and then ticking them in a row
    gives the same messages and state as ticking one at a time."""

    def make() -> tuple[Network, RawNode]:
        net = Network.of((1, 2, 3))
        net.elect(1)
        n = net.nodes[1 if role == "leader" else 2]
        return net, n

    net_a, a = make()
    net_b, b = make()
    for _ in range(5):
        due = a.ticks_until_due()
        assert due >= 1
        for _ in range(due - 1):  # the ticks before the due one change nothing
            a.tick()
            b.tick()
            assert read_messages(b) == []
        a.tick()
        b.tick()
        msgs_a, msgs_b = read_messages(a), read_messages(b)
        assert msgs_a == msgs_b and msgs_a, (role, due)
        assert (a.role, a.term) == (b.role, b.term)
        net_a.send(*msgs_a)
        net_b.send(*msgs_b)
        net_a.deliver_all()
        net_b.deliver_all()


# ===========================================================================
# A replica rebuilt in place (emptied) is caught up
# ===========================================================================


def test_a_replica_rebuilt_from_an_empty_directory_is_caught_up() -> None:
    """The leader once heard node 3 acknowledge its log; node 3 is then
    rebuilt from an empty directory (after corruption or divergence) and
    rejects the probe at its old match. The leader believes the rejection
    instead of probing at match + 1 for ever."""
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    for k in range(10):
        lead.propose(f"v{k}".encode())
    net.deliver_all()
    assert lead.status().peers[3].match == lead.log.last_index()
    net.nodes[3] = new_node(3)  # an empty replica with the same id
    lead.propose(b"after")
    net.tick((1,), times=3)
    net.deliver_all()
    assert net.nodes[3].log.last_index() == lead.log.last_index()
    assert net.nodes[3].log.committed == lead.log.committed


def test_a_leader_removing_itself_tells_the_others_the_removal_committed() -> None:
    """Voters {1,2}; leader 1 removes itself. The appends that would tell 2
    the removal committed are lost; as 1 applies the removal and steps down
    it still tells 2 (a heartbeat with the commit index), so 2, now the only
    voter, can elect itself although 1 is shut down at once."""
    net = Network.of((1, 2))
    net.elect(1)
    idx = net.nodes[1].propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 1))
    held: list[Message] = []

    def lose_commit(m: Message) -> bool:
        if m.frm == 1 and m.commit >= idx:
            if m.type is MsgType.HEARTBEAT:
                held.append(m)  # what 1 says as it steps down (no ticks here)
            return True
        return False

    net.intercept = lose_commit
    for _ in range(50):
        if net.nodes[1].config.voters == (2,):
            break
        net.deliver_all()
    assert net.nodes[1].config.voters == (2,)
    assert net.nodes[2].log.committed < idx  # the appends with the commit were lost
    net.intercept = None
    del net.nodes[1]  # shut down at once
    net.send(*held)
    net.deliver_all()
    two = net.nodes[2]
    assert two.log.committed >= idx and two.config.voters == (2,)
    net.tick((2,), times=3 * E)
    assert two.role is Role.LEADER


def test_a_survivor_that_lost_the_commit_of_a_removal_learns_it_from_the_removed() -> None:
    """Voters {1,2}; leader 2 removes itself and appends one more entry that
    1 never stores. 1 hears that the removal committed, then crashes before
    that commit index is durable: it restarts with {1,2} and needs 2's vote,
    but 2 (removed) refuses it, its log being longer. Every vote answer
    carries the answerer's commit index with the term there; a candidate
    whose log holds that entry commits up to it, applies the removal and,
    now the only voter, elects itself (node-driven simulator, seed 33)."""
    net = Network.of((1, 2))
    net.elect(2)
    one, two = net.nodes[1], net.nodes[2]
    idx = two.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 2))
    for m in net.take():
        net.nodes[m.to].step(m)
    net.process(1)
    acks = net.take()
    two.propose(b"1 never stores this")
    net.take()  # the append carrying it is lost
    for m in acks:
        two.step(m)
    net.process(2)
    assert two.config.voters == (1,) and two.role is not Role.LEADER
    told = [m for m in net.take() if m.to == 1]
    assert any(m.commit >= idx for m in told)
    for m in told:
        one.step(m)
    assert one.log.committed >= idx  # learned, in memory only
    one = net.restart(1)  # crashed before the commit index was synced
    assert one.log.committed < idx and one.config.voters == (1, 2)
    assert two.log.last_index() > one.log.last_index()
    net.tick((1,), times=6 * E)
    assert one.role is Role.LEADER and one.config.voters == (1,)
    assert one.log.committed > idx


def test_a_commit_index_covering_a_membership_change_is_synced() -> None:
    """A lone voter that shrank the configuration to itself has nobody to
    learn its commit index from after a restart: the Ready that applies a
    membership change must make its commit index durable first (must_sync),
    where a commit-only change otherwise waits for the next sync."""
    net = Network.of((1, 2))
    net.elect(1)
    one = net.nodes[1]
    idx = one.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 2))
    net.process(1)
    resp = [m for m in net.take() if m.to == 2]
    for m in resp:
        net.nodes[2].step(m)
    acks = [m for rd in drain(net.nodes[2]) for m in rd.messages]
    for m in acks:
        one.step(m)
    rd = one.ready()
    assert [e.index for e in rd.committed_entries] == [idx]
    assert rd.hard_state is not None and rd.hard_state.commit == idx
    assert rd.must_sync  # no new entries, no new term: only the membership change


def test_a_node_outside_its_own_configuration_answers_any_candidate() -> None:
    """A new node added and promoted before it applied anything still holds
    the bootstrap configuration, which lists neither it nor the candidate: its
    configuration is the stale one, so it answers (a voter refuses strangers)."""
    n = new_node(5, (1, 2, 3))
    assert not n.config.is_voter(5)
    n.step(Message(MsgType.VOTE, 5, 8, 3, log_term=3, index=23))
    (resp,) = read_messages(n)
    assert resp.type is MsgType.VOTE_RESP and not resp.reject
