"""The controller's choice of a new master for a controller-mode group.

Theory of operation
-------------------
The controller group's state machine calls :func:`elect` when it applies an
election for a group (a master whose heartbeats lapsed, by the committed,
leader-stamped time, or an operator's request): the answer depends only on
what it is given, so every controller replica elects the same master.

* A master that is alive keeps its place (no election).
* Otherwise the new master comes from the **SyncStateSet**, alive members
  only: every confirmed byte is on each of them (the master counted their
  acknowledgements only while the controller listed them).
* When none is alive and ``unclean`` is on (``enable_elect_unclean_master``),
  any alive replica may be elected: the group takes writes again, and
  whatever it confirmed but that replica lacks is lost (the comparison
  counts it).
* Among candidates the one with the largest reported offset wins (the
  least to truncate elsewhere), then the lowest id.

The new master's SyncStateSet is itself alone; slaves rejoin it once they
have truncated to the last consistent point and caught up.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Election:
    master: int | None  # None: nobody can be elected (the group stays without a master)
    unclean: bool
    reason: str


def elect(
    *,
    master: int | None,
    sync_state_set: Set[int],
    alive: Set[int],
    offsets: Mapping[int, int],
    unclean: bool,
) -> Election:
    """See the module docstring. ``offsets``: each replica's last reported
    max offset (missing: unknown, counted as -1)."""
    if master is not None and master in alive:
        return Election(master, False, f"master {master} is alive")

    def best(ids: Set[int]) -> int:
        return min(ids, key=lambda i: (-offsets.get(i, -1), i))

    clean = set(sync_state_set) & set(alive) - ({master} if master is not None else set())
    if clean:
        m = best(clean)
        return Election(m, False, f"replica {m} of the SyncStateSet {sorted(sync_state_set)}")
    if unclean:
        rest = set(alive) - ({master} if master is not None else set())
        if rest:
            m = best(rest)
            return Election(
                m,
                True,
                f"unclean: no member of the SyncStateSet {sorted(sync_state_set)} is alive; "
                f"replica {m} may lack confirmed messages",
            )
    return Election(
        None,
        False,
        f"no alive member of the SyncStateSet {sorted(sync_state_set)}"
        + ("" if unclean else " and unclean elections are off"),
    )
