"""Offline checkers for harness histories.

:func:`check` reads one JSONL history (:mod:`jepsen_like.history`) and runs
every checker on it:

* ``linearizable`` (:mod:`.linearizable`): each queue as a linearizable log;
* ``queue`` (:mod:`.queue`): the Kafka-workload anomalies;
* ``recovery`` (:mod:`.recovery`): RTO per fault window, unavailability,
  throughput and latency over time.

``load`` (:mod:`.load`, no verdict) says how hard the history was: the
share of ``info`` ops (overall and during fault windows) and the mean
number of ops overlapping each op on its key.

The overall verdict is ``invalid`` if any checker says so, else ``unknown``
if any checker could not decide, else ``valid``. A malformed history raises
:class:`jepsen_like.history.HistoryError` (the CLI turns it into a JSON
error and exit status 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jepsen_like.checkers import groups, linearizable, queue, recovery
from jepsen_like.checkers.linearizable import LinConfig
from jepsen_like.checkers.load import load
from jepsen_like.checkers.queue import QueueConfig
from jepsen_like.checkers.recovery import RecoveryConfig
from jepsen_like.history import History, read_history

__all__ = [
    "LinConfig",
    "QueueConfig",
    "RecoveryConfig",
    "check",
    "check_history",
    "combine",
]


def combine(verdicts: list[str]) -> str:
    if "invalid" in verdicts:
        return "invalid"
    if "unknown" in verdicts:
        return "unknown"
    return "valid"


def check_history(
    history: History,
    *,
    lin: LinConfig | None = None,
    queue_config: QueueConfig | None = None,
    recovery_config: RecoveryConfig | None = None,
) -> dict[str, Any]:
    """Run every checker on an already-read history."""
    results = {
        "linearizable": linearizable.check(history, lin),
        "queue": queue.check(history, queue_config),
        "recovery": recovery.check(history, recovery_config),
    }
    if "queue_groups" in history.header:
        # A multi-group run's history (its header records the layout).
        results["groups"] = groups.check(history, recovery_config)
    return {
        "verdict": combine([r["verdict"] for r in results.values()]),
        "ops": len(history.ops),
        "faults": len(history.faults),
        "keys": history.keys(),
        "load": load(history),
        "checkers": results,
    }


def check(
    history_path: str | Path,
    *,
    lin: LinConfig | None = None,
    queue_config: QueueConfig | None = None,
    recovery_config: RecoveryConfig | None = None,
) -> dict[str, Any]:
    """Read ``history_path`` and run every checker on it."""
    return check_history(
        read_history(history_path),
        lin=lin,
        queue_config=queue_config,
        recovery_config=recovery_config,
    )
