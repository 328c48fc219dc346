"""A leader's acknowledgements stepped while its Ready's write runs
(``RawNode.take_durable_committed``, the exception to "no input between
``ready()`` and ``advance()``" that ``Node._write_and_apply`` uses)."""

from __future__ import annotations

from dledger.core.types import ConfChange, ConfChangeType, EntryType, Message, MsgType
from tests.unit.raft_harness import Network, persist

BIG = 1 << 30


def _queued(net: Network) -> list[Message]:
    """The queued messages, without running anyone's Ready loop (``take``
    would run the leader's too, ending its write)."""
    out = list(net.queue)
    net.queue.clear()
    return out


def _acks(net: Network, msgs: list[Message], *followers: int) -> list[Message]:
    """Deliver ``msgs`` to ``followers``; return their answers to 1."""
    for m in msgs:
        if m.to in followers:
            net.nodes[m.to].step(m)
    for nid in followers:
        net.process(nid)
    return [m for m in _queued(net) if m.to == 1]


def test_entries_committed_during_a_write_that_earlier_readies_made_durable_apply_once() -> None:
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    a = lead.propose(b"a")
    net.process(1)  # a written and synced here, its appends queued
    acks = _acks(net, _queued(net), 2, 3)
    b = lead.propose(b"b")
    rd = lead.ready()  # b's write is "running" from here on
    assert [e.index for e in rd.entries] == [b] and not rd.committed_entries
    b_acks = _acks(net, list(rd.messages), 2, 3)  # b's appends leave early
    for m in acks:
        lead.step(m)
    got = lead.take_durable_committed(rd, BIG)
    assert [e.index for e in got] == [a]
    assert lead.take_durable_committed(rd, BIG) == ()  # handed out once
    for m in b_acks:
        lead.step(m)  # b committed by 2 and 3, but not durable here yet
    assert lead.log.committed == b
    assert lead.take_durable_committed(rd, BIG) == ()
    persist(lead, rd)
    lead.advance(rd)
    nxt = lead.ready()
    assert [e.index for e in nxt.committed_entries] == [b]  # a is not handed out again
    lead.advance(nxt)
    assert lead.log.applied == b


def test_a_membership_change_is_left_to_the_next_ready() -> None:
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    a = lead.propose(b"a")
    cc = lead.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    c = lead.propose(b"c")
    net.process(1)
    acks = _acks(net, _queued(net), 2, 3)
    lead.propose(b"d")
    rd = lead.ready()
    for m in acks:
        lead.step(m)
    assert lead.log.committed >= c
    assert [e.index for e in lead.take_durable_committed(rd, BIG)] == [a]
    persist(lead, rd)
    lead.advance(rd)
    nxt = lead.ready()
    assert [e.index for e in nxt.committed_entries][:2] == [cc, c]
    assert nxt.committed_entries[0].type is EntryType.CONF_CHANGE


def test_only_a_leader_hands_out_entries_during_a_write() -> None:
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    lead.propose(b"a")
    net.process(1)
    for m in _queued(net):
        if m.to == 2:
            net.nodes[2].step(m)
    f = net.nodes[2]
    rd = f.ready()
    assert f.take_durable_committed(rd, BIG) == ()
    assert [e.index for e in lead.take_durable_committed(lead.ready(), BIG)] == []
    assert MsgType.APP_RESP in {m.type for m in rd.messages}


def test_advance_keeps_what_was_applied_during_the_write() -> None:
    """The Ready's own committed entries (applied before its write) end below
    what the write's acknowledgements let through: advance keeps the higher
    applied index."""
    net = Network.of((1, 2, 3))
    net.elect(1)
    lead = net.nodes[1]
    a = lead.propose(b"a")
    net.process(1)
    acks_a = _acks(net, _queued(net), 2, 3)
    b = lead.propose(b"b")
    net.process(1)  # b durable here too
    acks_b = _acks(net, _queued(net), 2, 3)
    for m in acks_a:
        lead.step(m)
    c = lead.propose(b"c")
    rd = lead.ready()
    assert [e.index for e in rd.committed_entries] == [a] and [e.index for e in rd.entries] == [c]
    for m in acks_b:
        lead.step(m)
    assert [e.index for e in lead.take_durable_committed(rd, BIG)] == [b]
    persist(lead, rd)
    lead.advance(rd)
    assert lead.log.applied == b
    assert not lead.ready().committed_entries
