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
import struct
import time
import zlib
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


def _speed_work(n: int) -> int:
    """A fixed mix of what a node does per message in Python: dict and list
    traffic, struct packing, a CRC over a short buffer, bytes joins."""
    pack = struct.Struct(">qiI").pack
    buf = b"m" * 140
    d: dict[int, bytes] = {}
    acc = 0
    for i in range(n):
        rec = pack(i, i & 1023, zlib.crc32(buf, i))
        d[i & 4095] = rec
        acc += len(b"".join((rec, buf[: i & 63])))
    return acc + len(d)


def cpu_speed(trials: int = 3, n: int = 200_000) -> float:
    """Thousands of iterations per second of :func:`_speed_work` on one
    core, the best of ``trials`` (about 0.1 s each). The same code and
    interpreter on the same machine score the same whatever the run's
    figures are; a lower score means a slower machine that day (the
    figures that are not ratios to a peer, such as Spark's messages/s or a
    p99 in milliseconds, move with it)."""
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        _speed_work(n)
        dt = time.perf_counter() - t0
        best = max(best, n / dt / 1000)
    return best
