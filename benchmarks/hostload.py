"""How much of the machine other work took while a benchmark ran.

The 1-minute load average counts every runnable process, this run's own
nodes, peers and load generator included: a benchmark that saturates two
cores with three server processes and a client raises it past the core
count by itself. So next to it each benchmark records the CPU time that
went to processes *outside* this run: the machine's busy time (``/proc/stat``)
minus what this process and every descendant used (their own time and that
of the children they reaped, ``/proc/<pid>/stat``), as a share of the
machine (wall time x cores). That share is what "other work competed for
the CPU" means; the report prints it beside the load average.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dledger.cluster import proc_stat

_HZ = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> int:
    """Busy ticks of the whole machine (all CPUs): user, nice, system, irq,
    softirq and steal; idle and iowait excluded."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def _tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and its live descendants, including what the
    children each of them reaped used."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            rest = proc_stat(entry)
            if rest is not None:  # (parent, utime + stime + cutime + cstime)
                stats[int(entry)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo += kids.get(pid, [])
    return total


@dataclass(frozen=True)
class Sample:
    busy: int
    ours: int


def sample() -> Sample:
    return Sample(_busy_ticks(), _tree_ticks(os.getpid()))


# Below this the share is mostly the tick granularity of the two counters
# (a benchmark that was skipped after a few milliseconds once "used" 302%).
MIN_WALL_S = 2.0


def outside_share(
    a: Sample, b: Sample, wall_s: float, cpus: int | None = None, min_wall_s: float = MIN_WALL_S
) -> float | None:
    """Percent of the machine (wall x cores) used by processes outside this
    run between samples ``a`` and ``b``; None when it cannot be told (a
    window shorter than ``min_wall_s``). CPU of a descendant that was
    orphaned before it exited (re-parented, so reaped by no process of this
    run) counts as outside: the share is an upper bound."""
    cores = cpus or os.cpu_count() or 1
    if wall_s <= 0 or wall_s < min_wall_s:
        return None
    outside = (b.busy - a.busy) - (b.ours - a.ours)
    return min(100.0, max(0.0, 100.0 * outside / _HZ / (wall_s * cores)))
