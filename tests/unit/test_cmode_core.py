"""Controller mode's pure parts: epoch maps and files, the last consistent
point and the six join cases, the SyncStateSet and confirm offset rules,
and the controller's election."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.cmode.election import elect
from dledger.cmode.epochs import (
    EpochEntry,
    EpochMap,
    JoinAction,
    join_decision,
    last_consistent_point,
)
from dledger.cmode.master import CmodeConfig, MasterCore
from dledger.errors import ConfigError, StorageCorrupted


def emap(*pairs: tuple[int, int]) -> EpochMap:
    return EpochMap([EpochEntry(e, s) for e, s in pairs])


# --------------------------------------------------------------------------- epoch map


def test_the_articles_example_forks_at_2250() -> None:
    master = emap((6, 200), (7, 1200), (8, 2500))
    slave = emap((6, 200), (7, 1200), (8, 2250))
    assert last_consistent_point(slave, 2500, master, 2500) == 2250
    assert last_consistent_point(slave, 2500, master, None) == 2250


def test_epochs_must_increase_and_starts_never_decrease() -> None:
    m = emap((1, 0), (2, 100))
    with pytest.raises(ValueError, match="increase"):
        m.append(2, 200)
    with pytest.raises(ValueError, match="before"):
        m.append(3, 50)
    m.append(3, 100)  # epoch 2's master wrote nothing
    assert m.end_of(2, 500) == 100 and m.end_of(3, 500) == 500
    assert m.epoch_at(99) == 1 and m.epoch_at(100) == 3 and m.epoch_at(0) == 1


def test_truncate_and_drop_before() -> None:
    m = emap((1, 0), (2, 100), (3, 300))
    m.truncate_to(150)
    assert list(m) == [EpochEntry(1, 0), EpochEntry(2, 100)]
    m.truncate_to(100)  # epoch 2 has no byte left
    assert list(m) == [EpochEntry(1, 0)]
    m = emap((1, 0), (2, 100), (3, 300))
    m.drop_before(200)
    assert list(m) == [EpochEntry(2, 100), EpochEntry(3, 300)]


def test_copying_records_the_masters_epochs() -> None:
    master = emap((1, 0), (2, 100), (3, 100), (4, 300))
    s = emap((1, 0))
    s.copy_from(master, 50, 350)
    # Epoch 2's master wrote nothing: epoch 3 wrote from 100.
    assert list(s) == [EpochEntry(1, 0), EpochEntry(3, 100), EpochEntry(4, 300)]
    s = emap((1, 0))
    s.copy_from(master, 50, 300)  # epoch 4's bytes not copied yet
    assert list(s) == [EpochEntry(1, 0), EpochEntry(3, 100)]


def test_the_epoch_file_round_trips_and_detects_damage() -> None:
    m = emap((1, 0), (4, 1000), (9, 123456789))
    data = m.encode()
    assert EpochMap.decode(data) == m
    for cut in (1, 5, len(data) - 1):
        with pytest.raises(StorageCorrupted):
            EpochMap.decode(data[:cut])
    rng = random.Random(7)
    for _ in range(50):
        pos = rng.randrange(len(data))
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(StorageCorrupted):
            EpochMap.decode(bytes(bad))


# --------------------------------------------------------------------------- six cases


def test_case_1_1_resets_to_the_masters_min() -> None:
    d = join_decision(0, 300, emap((1, 0)), 500, 900, emap((1, 0), (2, 600)))
    assert (d.case, d.action, d.offset) == ("1-1", JoinAction.RESET, 500)


def test_cases_1_2_and_2_2_follow_from_the_slaves_end() -> None:
    master = emap((1, 0), (2, 600))
    d = join_decision(0, 700, emap((1, 0), (2, 600)), 100, 900, master)
    assert (d.case, d.action, d.offset, d.lost_bytes) == ("1-2", JoinAction.FOLLOW, 700, 0)
    d = join_decision(200, 700, emap((1, 0), (2, 600)), 100, 900, master)
    assert (d.case, d.action, d.offset) == ("2-2", JoinAction.FOLLOW, 700)


def test_case_1_2_with_a_forked_tail_truncates() -> None:
    # The slave was master in epoch 2 and wrote 600..800; epoch 3's master
    # (behind it) started at 700 and is at 900 now.
    master = emap((1, 0), (3, 700))
    slave = emap((1, 0), (2, 600))
    d = join_decision(0, 800, slave, 0, 900, master)
    assert d.case == "1-2" and d.action is JoinAction.FOLLOW
    assert (d.offset, d.lost_bytes) == (600, 200)


def test_cases_1_3_and_2_3_lose_the_slaves_unconfirmed_tail() -> None:
    master = emap((1, 0), (2, 500))  # new master elected at 500
    slave = emap((1, 0))  # the old master: wrote 0..800 in epoch 1
    d = join_decision(0, 800, slave, 0, 650, master)
    assert (d.case, d.action, d.offset, d.lost_bytes) == ("1-3", JoinAction.FOLLOW, 500, 300)
    d = join_decision(100, 800, slave, 0, 650, master)
    assert (d.case, d.offset) == ("2-3", 500)


def test_case_3_3_is_refused_for_an_operator() -> None:
    d = join_decision(1000, 1200, emap((1, 0)), 0, 500, emap((1, 0)))
    assert (d.case, d.action) == ("3-3", JoinAction.REFUSE)


def test_no_common_epoch_starts_over_or_is_refused() -> None:
    d = join_decision(0, 400, emap((1, 0)), 0, 500, emap((2, 0)))
    assert (d.action, d.offset, d.lost_bytes) == (JoinAction.FOLLOW, 0, 400)
    d = join_decision(0, 400, emap((1, 0)), 100, 500, emap((2, 100)))
    assert d.action is JoinAction.REFUSE


def test_an_empty_slave_copies_everything() -> None:
    d = join_decision(0, 0, EpochMap(), 100, 500, emap((1, 0)))
    assert (d.action, d.offset) == (JoinAction.RESET, 100)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_consistent_point_never_passes_a_real_fork(data: st.DataObject) -> None:
    """Generate a history of masters writing one shared byte string (one
    master per epoch; a slave copies a prefix of its master's log), then
    compare any two replicas: below the consistent point their bytes agree."""
    n = 3
    logs: list[list[int]] = [[] for _ in range(n)]  # each byte: the epoch that wrote it
    maps = [EpochMap() for _ in range(n)]
    for epoch in range(1, data.draw(st.integers(1, 6)) + 1):
        m = data.draw(st.integers(0, n - 1))  # any replica: unclean elections included
        maps[m].append(epoch, len(logs[m]))
        logs[m] += [epoch] * data.draw(st.integers(0, 5))
        for s in range(n):
            if s == m or not data.draw(st.booleans()):
                continue
            # s follows m: truncate to the consistent point (or drop its log
            # when there is none), then copy a prefix of m's log.
            p = last_consistent_point(maps[s], len(logs[s]), maps[m], None)
            p = min(p, len(logs[s]), len(logs[m]))
            if p < 0:
                p = 0
            logs[s] = logs[s][:p]
            maps[s].truncate_to(p)
            upto = data.draw(st.integers(p, len(logs[m])))
            maps[s].copy_from(maps[m], p, upto)
            logs[s] = logs[m][:upto]
    for a in range(n):
        for b in range(n):
            p = last_consistent_point(maps[a], len(logs[a]), maps[b], len(logs[b]))
            if p >= 0:
                assert logs[a][:p] == logs[b][:p], (a, b, p, maps[a], maps[b], logs)
        # Each replica's map says which epoch wrote each of its bytes.
        for off, e in enumerate(logs[a]):
            assert maps[a].epoch_at(off) == e, (a, off, maps[a], logs[a])


# --------------------------------------------------------------------------- master


def master(cfg: CmodeConfig, members: int = 3, in_set: int | None = None) -> MasterCore:
    ids = frozenset(range(1, members + 1))
    sss = frozenset(range(1, (in_set or members) + 1))
    return MasterCore(me=1, epoch=1, members=ids, sync_state_set=sss, cfg=cfg)


def test_all_ack_confirms_the_minimum_over_the_set() -> None:
    m = master(CmodeConfig(all_ack_in_sync_state_set=True))
    m.on_local(1000)
    m.on_ack(2, 800, 10)
    assert m.confirm == 0
    m.on_ack(3, 600, 10)
    assert m.confirm == 600
    m.on_ack(3, 1000, 11)
    assert m.confirm == 800


def test_in_sync_replicas_counts_the_kth_largest() -> None:
    m = master(CmodeConfig(in_sync_replicas=2, min_in_sync_replicas=1))
    m.on_local(1000)
    m.on_ack(3, 400, 1)
    assert m.confirm == 400
    m.on_ack(2, 900, 2)
    assert m.confirm == 900  # master and slave 2 hold 900


def test_the_confirm_offset_never_moves_back() -> None:
    m = master(CmodeConfig(in_sync_replicas=2, min_in_sync_replicas=1))
    m.on_local(1000)
    m.on_ack(2, 900, 1)
    m.on_sync_state_set(1, frozenset({1, 3}))  # slave 2 left the set
    assert m.confirm == 900


def test_fail_fast_below_min_in_sync_replicas() -> None:
    m = master(CmodeConfig.cp(3))
    assert m.write_refusal() is None
    m.on_sync_state_set(1, frozenset({1}))
    assert "min_in_sync_replicas" in (m.write_refusal() or "")


def test_adaptive_degradation_confirms_with_the_master_alone() -> None:
    m = master(CmodeConfig.ap(3))
    m.on_local(500)
    assert m.confirm == 0  # 3 acknowledgements needed while all are in the set
    m.on_sync_state_set(1, frozenset({1}))
    assert m.write_refusal() is None and m.required_acks() == 1
    assert m.confirm == 500
    strict = master(CmodeConfig(in_sync_replicas=3, min_in_sync_replicas=1))
    strict.on_sync_state_set(1, frozenset({1}))
    assert "enable_auto_in_sync_replicas" in (strict.write_refusal() or "")


def test_a_slave_far_behind_or_silent_is_asked_out_and_back_in() -> None:
    cfg = CmodeConfig(all_ack_in_sync_state_set=True, max_gap_bytes=100, max_lag_ms=1000)
    m = master(cfg)
    m.on_local(1000)
    m.on_ack(2, 1000, 0)
    m.on_ack(3, 950, 0)
    assert m.poll_request(500) is None  # within the gap, within the time
    req = m.poll_request(1500)  # slave 3 has not caught up for 1.5 s
    assert req is not None and req.new_set == frozenset({1, 2}) and "shrink" in req.reason
    assert m.poll_request(1600) is None  # one request in flight at a time
    m.on_sync_state_set(1, req.new_set)
    assert m.confirm == 1000
    m.on_ack(3, 1000, 1700)
    req = m.poll_request(1700)
    assert req is not None and req.new_set == frozenset({1, 2, 3}) and "expand" in req.reason
    m.on_request_failed()
    assert m.poll_request(1700) == req


def test_a_slave_behind_the_confirm_offset_does_not_join() -> None:
    m = master(CmodeConfig(max_gap_bytes=1000), in_set=2)
    m.on_local(1000)
    m.on_ack(2, 1000, 0)
    assert m.confirm == 1000
    m.on_ack(3, 900, 0)  # within the gap, but it lacks confirmed bytes
    assert m.poll_request(0) is None


def test_configuration_is_validated() -> None:
    with pytest.raises(ConfigError):
        CmodeConfig(min_in_sync_replicas=3).validate(2)
    with pytest.raises(ConfigError):
        CmodeConfig(in_sync_replicas=1, min_in_sync_replicas=2).validate(3)
    CmodeConfig.cp(3).validate(3)
    CmodeConfig.ap(2).validate(2)


# --------------------------------------------------------------------------- election


def test_an_alive_master_stays() -> None:
    e = elect(master=1, sync_state_set={1, 2}, alive={1, 2}, offsets={}, unclean=False)
    assert e.master == 1


def test_the_new_master_comes_from_the_sync_state_set() -> None:
    e = elect(
        master=1, sync_state_set={1, 2, 3}, alive={2, 3}, offsets={2: 500, 3: 700}, unclean=False
    )
    assert e.master == 3 and not e.unclean
    e = elect(
        master=1, sync_state_set={1, 2}, alive={2, 3}, offsets={2: 500, 3: 700}, unclean=False
    )
    assert e.master == 2  # 3 has more bytes but is not in the set


def test_unclean_elections_only_when_enabled() -> None:
    e = elect(master=1, sync_state_set={1}, alive={2, 3}, offsets={2: 5, 3: 5}, unclean=False)
    assert e.master is None and "unclean elections are off" in e.reason
    e = elect(master=1, sync_state_set={1}, alive={2, 3}, offsets={2: 5, 3: 5}, unclean=True)
    assert e.master == 2 and e.unclean
