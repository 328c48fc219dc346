"""benchmarks.hostload: CPU of this run's own processes (children included,
reaped or not) is never counted as other work; CPU of a process outside the
run is."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks import hostload

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
HZ = os.sysconf("SC_CLK_TCK")


def test_a_child_of_the_run_is_the_runs_own() -> None:
    a, t0 = hostload.sample(), time.monotonic()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.6)], check=True)  # reaped: cutime
    b = hostload.sample()
    assert (b.ours - a.ours) / HZ >= 0.5
    share = hostload.outside_share(a, b, time.monotonic() - t0, min_wall_s=0)
    assert share is not None and share >= 0.0


def test_a_process_outside_the_run_is_other_work() -> None:
    # sh starts the burner in the background and exits: the burner is
    # re-parented away from this process, so it is not the run's.
    marker = f"{time.time_ns()}"
    a, t0 = hostload.sample(), time.monotonic()
    subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{BURN.format(s=0.8)}" {marker} >/dev/null 2>&1 &'],
        check=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until the orphan is gone
        time.sleep(0.2)
        if subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0:
            break
    b = hostload.sample()
    wall = time.monotonic() - t0
    share = hostload.outside_share(a, b, wall, min_wall_s=0)
    assert share is not None
    cores = os.cpu_count() or 1
    assert share >= 100.0 * 0.6 / (wall * cores), (share, wall)
    assert (b.ours - a.ours) / HZ < 0.5  # not counted as ours


def test_a_window_too_short_to_tell_is_none() -> None:
    # a benchmark skipped after a few milliseconds: one clock tick of the
    # machine's busy time would read as hundreds of percent
    a = hostload.Sample(busy=1000, ours=0)
    b = hostload.Sample(busy=1003, ours=0)
    assert hostload.outside_share(a, b, 0.005, cpus=2) is None
    assert hostload.outside_share(a, b, 0.005, cpus=2, min_wall_s=0) == 100.0  # clamped
    assert hostload.outside_share(a, b, 3.0, cpus=2) == 100.0 * 3 / HZ / 6.0


def test_the_speed_index_is_steady_on_one_machine() -> None:
    # best of 3 on the same interpreter: two readings close together agree
    # far better than the 2x the index is there to reveal
    a, b = hostload.cpu_speed(), hostload.cpu_speed()
    assert a > 0 and b > 0
    assert 0.5 < a / b < 2.0, (a, b)
