"""Snapshots and log compaction, one test per rule (Raft paper section 7, in
the style of etcd's raft_paper_test.go): the leader sends InstallSnapshot
when a follower needs compacted entries; the follower installs it (persisted
before it acknowledges) and the leader resumes replication; a stale or
duplicated snapshot changes nothing; the commit index never moves back; a
restart from a snapshot keeps its membership and never reapplies below it;
the codec round-trips the new message."""

from __future__ import annotations

import pytest

from dledger.core.codec import ENTRY_OVERHEAD, decode_message, encode_message
from dledger.core.types import (
    EARLY_SEND_TYPES,
    ClusterConfig,
    Compaction,
    ConfChange,
    ConfChangeType,
    Entry,
    Message,
    MsgType,
    Role,
    Snapshot,
    SnapshotMeta,
)
from dledger.errors import CodecError, InvariantViolation, ReplicaDiverged
from tests.unit.raft_harness import (
    Network,
    ents,
    new_node,
    of_type,
    persist,
    preload,
    step_ready,
    storage_of,
    take_snapshot,
)
from tests.unit.test_codec import MSG_HDR, reseal_message

CFG = ClusterConfig((1, 2, 3))


def elected(**kw: object) -> Network:
    net = Network.of((1, 2, 3), **kw)
    net.elect(1)
    return net


def snap_msg(meta: SnapshotMeta, *, term: int = 1, to: int = 2, data: bytes = b"sm") -> Message:
    return Message(
        MsgType.SNAPSHOT,
        to,
        1,
        term,
        log_term=meta.term,
        index=meta.index,
        commit=meta.index,
        snapshot=meta,
        snapshot_data=data,
    )


def lagging_follower_net(trailing: int = 0, proposals: int = 5) -> Network:
    """Node 3 was cut off while the leader committed ``proposals`` entries
    with node 2, then snapshotted and compacted (keeping ``trailing``)."""
    net = elected(snapshot_trailing_entries=trailing)
    net.isolate(3)
    for k in range(proposals):
        net.nodes[1].propose(b"v%d" % k)
        net.deliver_all()
    take_snapshot(net.nodes[1])
    net.recover()
    return net


def test_snapshot_taken_compacts_behind_the_trailing_entries() -> None:
    net = elected(snapshot_trailing_entries=2)
    leader = net.nodes[1]
    for k in range(5):
        leader.propose(b"%d" % k)
    net.deliver_all()
    applied = leader.log.applied
    meta = leader.snapshot_meta()
    assert (meta.index, meta.term, meta.config) == (applied, 1, CFG)
    assert meta.end_pos == leader.log.last_end_pos()
    comp = leader.snapshot_taken(meta)
    assert comp == Compaction(applied - 1, 1, leader.log.end_pos(applied - 2))
    assert leader.snapshot_taken(meta) is None  # not newer than what we hold
    with pytest.raises(InvariantViolation):
        leader.snapshot_taken(SnapshotMeta(applied + 1, 1, 0, CFG))


def test_leader_sends_snapshot_when_follower_needs_compacted_entries() -> None:
    net = lagging_follower_net()
    leader = net.nodes[1]
    snap = storage_of(leader).snapshot()
    assert snap is not None
    assert storage_of(leader).first_index() == snap.meta.index + 1
    applied_before = len(net.applied.get(3, []))
    net.tick([1])  # heartbeat: node 3 answers, the leader finds its entries gone
    sent = of_type(net.delivered, MsgType.SNAPSHOT)
    assert len(sent) == 1
    m = sent[0]
    assert (m.to, m.snapshot, m.snapshot_data) == (3, snap.meta, snap.data)
    assert MsgType.SNAPSHOT not in EARLY_SEND_TYPES
    f = net.nodes[3]
    assert storage_of(f).snapshot() == snap
    assert f.log.committed == leader.log.committed
    assert f.log.last_index() == leader.log.last_index()
    # Nothing at or below the snapshot was applied on node 3 after the install.
    assert all(e.index > snap.meta.index for e in net.applied[3][applied_before:])
    pr = leader.status().peers[3]
    assert (pr.state, pr.match) == ("REPLICATE", leader.log.last_index())


def test_slightly_behind_follower_gets_entries_not_a_snapshot() -> None:
    net = lagging_follower_net(trailing=50)
    net.tick([1])
    assert not of_type(net.delivered, MsgType.SNAPSHOT)
    assert net.nodes[3].log.committed == net.nodes[1].log.committed


def test_lost_snapshot_is_sent_again_after_the_retry_ticks() -> None:
    net = lagging_follower_net()
    net.dropped_types.add(MsgType.SNAPSHOT)
    net.tick([1])
    pr = net.nodes[1].status().peers[3]
    assert pr.state == "SNAPSHOT"
    net.dropped_types.clear()
    retry = net.nodes[1].cfg.snapshot_retry_ticks
    net.tick([1], times=retry - 1)
    assert not of_type(net.delivered, MsgType.SNAPSHOT)  # still waiting
    net.tick([1], times=2)
    assert len(of_type(net.delivered, MsgType.SNAPSHOT)) == 1
    assert net.nodes[3].log.committed == net.nodes[1].log.committed


def test_follower_installs_snapshot_and_acks_only_after_persisting() -> None:
    f = new_node(2)
    meta = SnapshotMeta(5, 1, 40, ClusterConfig((1, 2, 3), (4,)))
    f.step(snap_msg(meta))
    rd = f.ready()
    assert rd.snapshot == Snapshot(meta, b"sm")
    assert rd.must_sync and rd.hard_state is not None and rd.hard_state.commit == 5
    acks = of_type(rd.messages, MsgType.APP_RESP)
    assert [(a.to, a.index, a.reject) for a in acks] == [(1, 5, False)]
    assert all(a.type not in EARLY_SEND_TYPES for a in acks)  # sent after the sync
    assert not rd.committed_entries  # the state machine restores from the payload
    persist(f, rd)
    f.advance(rd)
    st = storage_of(f)
    assert (st.first_index(), st.last_index(), st.term(5), st.front_pos()) == (6, 5, 1, 40)
    assert (f.log.committed, f.log.applied, f.config) == (5, 5, meta.config)
    assert f.latest_snapshot() == meta
    # Replication continues right after the snapshot.
    f.step(
        Message(MsgType.APP, 2, 1, 1, log_term=1, index=5, commit=6, entries=(Entry(6, 1, pos=40),))
    )
    rd = step_ready(f)
    assert [e.index for e in rd.committed_entries] == [6]
    assert of_type(rd.messages, MsgType.APP_RESP)[0].index == 6


def test_snapshot_replaces_a_conflicting_uncommitted_log() -> None:
    f = new_node(2, storage=preload(ents(1, 1, 2, 2), term=2, commit=1))
    meta = SnapshotMeta(3, 3, 0, CFG)
    f.step(snap_msg(meta, term=3))
    rd = step_ready(f)
    assert rd.snapshot is not None
    assert (f.log.last_index(), f.log.last_term(), f.log.committed) == (3, 3, 3)
    assert storage_of(f).last_index() == 3 and storage_of(f).term(3) == 3


def test_snapshot_whose_entry_we_hold_only_advances_commit() -> None:
    f = new_node(2, storage=preload(ents(1, 1, 1, 1), term=1, commit=1))
    f.step(snap_msg(SnapshotMeta(3, 1, 0, CFG)))
    rd = step_ready(f)
    assert rd.snapshot is None  # the log already matches: keep it
    assert [e.index for e in rd.committed_entries] == [1, 2, 3]
    assert (f.log.committed, f.log.last_index()) == (3, 4)
    assert of_type(rd.messages, MsgType.APP_RESP)[0].index == 3


@pytest.mark.parametrize("snap_index", [2, 5])
def test_stale_or_duplicate_snapshot_is_acked_and_ignored(snap_index: int) -> None:
    f = new_node(2)
    f.step(snap_msg(SnapshotMeta(5, 1, 40, CFG)))
    step_ready(f)
    before = (f.log.committed, f.log.applied, f.log.last_index(), storage_of(f).snapshot())
    f.step(snap_msg(SnapshotMeta(snap_index, 1, 0, ClusterConfig((1, 2))), data=b"old"))
    rd = step_ready(f)
    assert rd.snapshot is None
    # acknowledged as far as the snapshot proves, not with our commit index
    assert [(m.type, m.index) for m in rd.messages] == [(MsgType.APP_RESP, snap_index)]
    assert (f.log.committed, f.log.applied, f.log.last_index(), storage_of(f).snapshot()) == before
    assert f.config == CFG


def test_commit_index_never_moves_back_after_a_snapshot_install() -> None:
    """SCENARIOS 9: after installing a snapshot at 10, delayed appends and
    heartbeats carrying older commit indexes leave commit at 10."""
    f = new_node(2)
    f.step(snap_msg(SnapshotMeta(10, 1, 0, CFG)))
    step_ready(f)
    f.step(Message(MsgType.APP, 2, 1, 1, log_term=1, index=3, commit=3, entries=()))
    f.step(Message(MsgType.HEARTBEAT, 2, 1, 1, commit=4))
    f.step(snap_msg(SnapshotMeta(7, 1, 0, CFG)))
    rd = step_ready(f)
    assert rd.snapshot is None
    assert f.log.committed == 10
    assert rd.hard_state is None or rd.hard_state.commit == 10
    acks = of_type(rd.messages, MsgType.APP_RESP)
    # the stale append and the stale snapshot are each acknowledged only as
    # far as they proved (3, 7)
    assert [(a.reject, a.index) for a in acks] == [(False, 3), (False, 7)]
    with pytest.raises(InvariantViolation):
        f.log.restore(SnapshotMeta(9, 1, 0, CFG))


def test_restart_from_snapshot_keeps_membership_and_never_reapplies() -> None:
    f = new_node(2)
    meta = SnapshotMeta(5, 1, 40, ClusterConfig((1, 2, 3), (4,)))
    f.step(snap_msg(meta))
    step_ready(f)
    st = storage_of(f)
    st.crash()  # everything was synced: nothing is lost
    r = new_node(2, storage=st, booted=False, applied=meta.index, snapshot=meta)
    assert (r.config, r.log.committed, r.log.applied) == (meta.config, 5, 5)
    assert r.latest_snapshot() == meta
    assert not r.log.has_next_committed()
    # A restart that claims less applied still never goes below the snapshot.
    r2 = new_node(2, storage=st, booted=False, applied=0, snapshot=meta)
    assert r2.log.applied == 5
    # A snapshot that does not match the stored log is refused.
    with pytest.raises(InvariantViolation):
        new_node(2, storage=st, booted=False, snapshot=SnapshotMeta(5, 2, 40, CFG))


def test_crash_before_sync_loses_the_snapshot_with_the_log_reset() -> None:
    f = new_node(2)
    f.step(snap_msg(SnapshotMeta(5, 1, 40, CFG)))
    rd = f.ready()
    st = storage_of(f)
    assert rd.snapshot is not None
    st.apply_snapshot(rd.snapshot)
    st.crash()  # before the sync: the durable image is the empty log again
    assert st.snapshot() is None and st.first_index() == 1 and st.last_index() == 0


def test_learner_added_late_catches_up_by_snapshot() -> None:
    net = elected(snapshot_trailing_entries=0)
    leader = net.nodes[1]
    for k in range(4):
        leader.propose(b"%d" % k)
        net.deliver_all()
    take_snapshot(leader)
    net.nodes[4] = new_node(4, snapshot_trailing_entries=0)
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.deliver_all()
    net.tick([1], times=2)
    learner = net.nodes[4]
    assert of_type(net.delivered, MsgType.SNAPSHOT)
    assert learner.log.committed == leader.log.committed
    assert learner.config == leader.config and learner.status().role is Role.LEARNER


def test_codec_round_trips_a_snapshot_message() -> None:
    meta = SnapshotMeta(7, 3, 1234, ClusterConfig((1, 2, 5), (6, 9)))
    m = snap_msg(meta, term=4, data=b"\x00state\xff" * 10)
    assert decode_message(encode_message(m)) == m
    empty = snap_msg(SnapshotMeta(1, 1, 0, ClusterConfig((1,))), data=b"")
    assert decode_message(encode_message(empty)) == empty
    # Messages without a snapshot keep their old encoding: no flag, no section.
    plain = Message(MsgType.APP, 2, 1, 3, entries=(Entry(1, 1, data=b"x"),))
    enc_plain = encode_message(plain)
    assert enc_plain[MSG_HDR.size - 5] == 0
    assert len(enc_plain) == MSG_HDR.size + 4 + ENTRY_OVERHEAD + 1 + 4
    with pytest.raises(CodecError):
        encode_message(Message(MsgType.APP, 2, 1, 3, snapshot_data=b"x"))
    # A snapshot section cut short (behind a valid CRC) is refused.
    body = encode_message(m)[:-4]
    for cut in (1, 12, 40):
        with pytest.raises(CodecError):
            decode_message(reseal_message(body[:-cut]))


def test_reported_snapshot_failure_sends_it_again_at_once() -> None:
    net = lagging_follower_net()
    net.dropped_types.add(MsgType.SNAPSHOT)
    net.tick([1])
    leader = net.nodes[1]
    assert leader.status().peers[3].state == "SNAPSHOT"
    net.dropped_types.clear()
    leader.report_snapshot(3, ok=False)
    assert leader.status().peers[3].state == "PROBE"
    net.tick([1])  # the next heartbeat answer probes, hits the compacted log again
    assert len(of_type(net.delivered, MsgType.SNAPSHOT)) == 1
    assert net.nodes[3].log.committed == leader.log.committed


def test_memory_storage_keeps_the_synced_snapshot_across_a_crash() -> None:
    st = preload(ents(1, 1, 1), term=1, commit=3)
    a = Snapshot(SnapshotMeta(2, 1, 0, CFG), b"a")
    st.save_snapshot(a)
    st.compact(3, 1, 0)
    st.sync()
    st.save_snapshot(Snapshot(SnapshotMeta(3, 1, 0, CFG), b"b"))
    st.crash()  # the unsynced newer snapshot is lost, the synced one stays
    assert st.snapshot() == a and st.first_index() == 3 and st.term(2) == 1


def test_a_delivered_snapshot_whose_answer_was_lost_is_followed_by_a_probe() -> None:
    """Simulator seeds 1508, 1681 and 1870 of 2000: the follower installed the
    snapshot but its answer was lost. Every resend of that snapshot is
    acknowledged by the receiving stream (it already delivered it) without
    reaching the core again, so no answer ever comes: the leader waited in
    SNAPSHOT for ever and the follower never caught up. A stream that
    completes is reported (``ok=True``); the leader then probes just past the
    snapshot, and the answer to that probe moves the follower on."""
    net = lagging_follower_net()
    leader = net.nodes[1]
    # the follower's answer to the snapshot is lost
    net.intercept = lambda m: m.type is MsgType.APP_RESP and m.frm == 3 and not m.reject
    net.tick([1])
    assert of_type(net.delivered, MsgType.SNAPSHOT)
    assert net.nodes[3].log.committed == leader.log.committed
    assert leader.status().peers[3].state == "SNAPSHOT"
    net.intercept = None
    net.dropped_types.add(MsgType.SNAPSHOT)  # a resend never reaches the core
    leader.report_snapshot(3, ok=True)  # the stream completed
    assert leader.status().peers[3].state == "PROBE"
    leader.propose(b"after")
    net.deliver_all()
    net.tick([1], times=3)
    assert len(of_type(net.delivered, MsgType.SNAPSHOT)) == 1
    pr = leader.status().peers[3]
    assert pr.state == "REPLICATE" and pr.match == leader.log.last_index()
    assert net.nodes[3].log.committed == leader.log.committed


def test_a_stale_snapshot_that_contradicts_our_committed_log_stops_the_replica() -> None:
    """Async flush mode after a majority's power loss: a leader may hold
    another history below our commit index. A snapshot at an index we
    committed with another term shows it: stop (rebuild this replica), never
    acknowledge our commit index over it (the leader would count entries we
    do not hold)."""
    f = new_node(2, storage=preload(ents(1, 1, 1, 1, 1), term=1, commit=5))
    with pytest.raises(ReplicaDiverged, match="rebuild this replica"):
        f.step(snap_msg(SnapshotMeta(4, 2, 0, CFG), term=2))
