"""Whole-cluster deterministic simulation: invariants hold, runs are
reproducible, and the checker catches every protocol bug we plant."""

from __future__ import annotations

import pytest

from dledger.core.raft import (
    FAULT_COMMIT_OLD_TERM,
    FAULT_FOLLOWER_COMMITS_AHEAD,
    FAULT_INSTALL_STALE_SNAPSHOT,
    FAULT_LEASE_IGNORES_EXPIRY,
    FAULT_SKIP_VOTE_PERSIST,
    FAULT_TRUNCATE_WITHOUT_CONFLICT,
    FAULT_VOTE_DESPITE_LEADER,
)
from dledger.sim.cluster import FAULT_NO_FSYNC, Simulation, SimViolation, mixed_config

pytestmark = pytest.mark.sim


def run(seed: int, steps: int = 3000, faults: frozenset[str] = frozenset(), profile: str = "mixed") -> Simulation:
    return Simulation(seed, mixed_config(seed, steps, faults, profile)).run()


@pytest.mark.parametrize("block", range(4))
def test_standard_mix_has_no_violation(block: int) -> None:
    """100 seeds per block (3 and 5 voters, learners, every fault kind)."""
    elections = proposals = 0
    for seed in range(block * 100 + 1, block * 100 + 101):
        try:
            sim = run(seed)
        except SimViolation as v:  # the message carries "reproduce with: ..."
            pytest.fail(str(v))
        elections += sim.stats["elections"]
        proposals += sim.stats["proposals"]
    assert elections > 300  # the faults really forced leader changes
    assert proposals > 3000


@pytest.mark.parametrize("profile", ["figure8", "vote-loss", "lease"])
def test_emphasis_profiles_have_no_violation(profile: str) -> None:
    for seed in range(1, 41):
        try:
            run(seed, profile=profile)
        except SimViolation as v:
            pytest.fail(str(v))


def test_same_seed_same_trace() -> None:
    a = run(7, steps=2000)
    b = run(7, steps=2000)
    c = run(8, steps=2000)
    assert a.trace_hash() == b.trace_hash()
    assert a.steps == b.steps
    assert a.trace_hash() != c.trace_hash()


def test_violation_names_the_reproducing_command() -> None:
    with pytest.raises(SimViolation) as ei:
        for seed in range(1, 30):
            run(seed, faults=frozenset({FAULT_NO_FSYNC}))
    msg = str(ei.value)
    assert f"reproduce with: python -m dledger.sim --seed {ei.value.seed}" in msg
    assert "--fault no_fsync" in msg
    assert "trace tail:" in msg


# (fault switch, profile, seeds within which it must be caught). Runs are
# deterministic, so these pass or fail the same way every time; the bounds are
# several times the mean seeds-to-catch measured over 100-300 seeds, so that a
# change that merely reshuffles the random streams still passes.
SWITCHES = [
    (FAULT_NO_FSYNC, "mixed", 20),
    (FAULT_TRUNCATE_WITHOUT_CONFLICT, "mixed", 20),
    (FAULT_LEASE_IGNORES_EXPIRY, "lease", 60),
    (FAULT_VOTE_DESPITE_LEADER, "lease", 40),
    (FAULT_COMMIT_OLD_TERM, "figure8", 150),
    (FAULT_SKIP_VOTE_PERSIST, "vote-loss", 40),
    (FAULT_INSTALL_STALE_SNAPSHOT, "mixed", 20),
    (FAULT_FOLLOWER_COMMITS_AHEAD, "mixed", 20),  # the harness's follower_reads_uncommitted
]


@pytest.mark.parametrize(("fault", "profile", "bound"), SWITCHES, ids=[s[0] for s in SWITCHES])
def test_checker_catches_fault_switch(fault: str, profile: str, bound: int) -> None:
    for n, seed in enumerate(range(1, bound + 1), start=1):
        try:
            run(seed, steps=5000, faults=frozenset({fault}), profile=profile)
        except SimViolation as v:
            print(f"{fault}: caught at seed {seed} after {n} seed(s): {v.what}")
            return
    pytest.fail(f"fault switch {fault} was not caught within {bound} seeds ({profile})")
