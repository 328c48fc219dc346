"""Running a multi-group layout from an integration test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dledger_app.groups import MultiCluster


@contextlib.contextmanager
def multi_running(mc: MultiCluster, log_lines: int = 20) -> Iterator[MultiCluster]:
    """Every node of every group of ``mc`` started; all stopped by PID at the
    end (their logs' tails printed when DLEDGER_SHOW_LOGS is set)."""
    clusters = mc.all()
    try:
        for lc in clusters.values():
            lc.start_all()
        yield mc
    finally:
        for name, lc in clusters.items():
            lc.down(10)
            if os.environ.get("DLEDGER_SHOW_LOGS"):
                for nid in lc.ids():
                    print(f"--- {name} node {nid}\n{lc.log_tail(nid, log_lines)}")
