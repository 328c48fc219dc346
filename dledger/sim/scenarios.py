"""Scripted nemeses for specific bugs (profiles ``conf-replay``, ``learner-vote``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dledger.sim.cluster import Simulation

SCENARIOS: dict[str, Callable[[Simulation], Callable[[], None]]] = {}
