"""``python -m dledger.sim``: run many seeds of the cluster simulation.

Each seed runs real :class:`dledger.node.Node` instances on virtual time
(see :mod:`dledger.sim.cluster`). Prints progress lines, steps per second,
and for a failing seed the exact command that reproduces it with its trace
tail. ``--stop-on-failure`` (the default) stops at the first violation.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import time
from typing import Any

from dledger.sim.cluster import (
    ALL_FAULTS,
    PROFILES,
    SimConfig,
    Simulation,
    SimViolation,
    mixed_config,
)

Job = tuple[int, int, int | None, int, frozenset[str], dict[str, Any], str]


def _one(args: Job) -> tuple[int, int, str, str]:
    seed, steps, voters, learners, faults, overrides, profile = args
    if voters is None:
        cfg = mixed_config(seed, steps, faults, profile)
    else:
        cfg = SimConfig(voters=voters, learners=learners, steps=steps, faults=faults)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    sim = Simulation(seed, cfg)
    try:
        sim.run()
    except SimViolation as v:
        return seed, sim.steps, "violation", str(v)
    return seed, sim.steps, "ok", sim.trace_hash()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dledger.sim", description=__doc__)
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    ap.add_argument("--seed", type=int, default=None, help="run this one seed")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5000, help="faulty steps per seed")
    ap.add_argument(
        "--voters", type=int, default=None, help="fix the voter count (default: mix of 3 and 5)"
    )
    ap.add_argument("--learners", type=int, default=0)
    ap.add_argument(
        "--fault",
        action="append",
        default=[],
        choices=sorted(ALL_FAULTS),
        help="break the protocol on purpose (checker self-test)",
    )
    ap.add_argument(
        "--profile",
        default="mixed",
        choices=sorted(PROFILES),
        help="nemesis emphasis on top of the standard mix",
    )
    ap.add_argument("--no-membership", action="store_true")
    ap.add_argument("--no-check-quorum", action="store_true", help="no stickiness or lease")
    ap.add_argument("--jobs", type=int, default=min(2, mp.cpu_count()))
    ap.add_argument(
        "--flush",
        default="sync",
        choices=["sync", "async"],
        help="node flush mode; async may lose acknowledged writes when a majority crashes",
    )
    ap.add_argument(
        "--stop-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop at the first violation (default: yes)",
    )
    a = ap.parse_args(argv)
    if a.voters is not None and a.profile != "mixed":
        ap.error(
            f"--profile {a.profile} sets its own cluster shape; it cannot be combined with "
            "--voters (use --profile alone, or --voters with the standard mix)"
        )
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    faults = frozenset(a.fault)
    seeds = [a.seed] if a.seed is not None else list(range(a.first_seed, a.first_seed + a.seeds))
    overrides: dict[str, Any] = {}
    if a.no_membership:
        overrides["membership"] = False
    if a.no_check_quorum:
        overrides["check_quorum"] = False
    if a.flush != "sync":
        overrides["flush"] = a.flush
    jobs: list[Job] = [
        (s, a.steps, a.voters, a.learners, faults, overrides, a.profile) for s in seeds
    ]
    t0 = time.monotonic()
    total_steps = 0
    done = 0
    failures: list[tuple[int, str]] = []
    last_print = t0

    def report(res: tuple[int, int, str, str]) -> None:
        nonlocal total_steps, done, last_print
        seed, steps, verdict, detail = res
        total_steps += steps
        done += 1
        if verdict != "ok":
            failures.append((seed, detail))
            print(f"seed {seed}: VIOLATION\n{detail}", flush=True)
        now = time.monotonic()
        if now - last_print > 5 or done == len(jobs) or len(jobs) == 1:
            last_print = now
            rate = total_steps / max(now - t0, 1e-9)
            print(
                f"[{done}/{len(jobs)} seeds] {total_steps} steps, {rate:,.0f} steps/s, "
                f"{len(failures)} violation(s)",
                flush=True,
            )
        if len(jobs) == 1 and verdict == "ok":
            print(f"seed {seed}: ok, trace hash {detail}")

    if a.jobs > 1 and len(jobs) > 1:
        with mp.get_context("fork").Pool(a.jobs) as pool:
            for res in pool.imap_unordered(_one, jobs, chunksize=1):
                report(res)
                if failures and a.stop_on_failure:
                    pool.terminate()
                    break
    else:
        for j in jobs:
            report(_one(j))
            if failures and a.stop_on_failure:
                break
    if failures and a.stop_on_failure and done < len(jobs):
        print(f"stopped at the first violation after {done} of {len(jobs)} seeds")
    elapsed = time.monotonic() - t0
    print(
        f"done: {done} seeds, {total_steps} steps in {elapsed:.1f}s "
        f"({total_steps / max(elapsed, 1e-9):,.0f} steps/s), {len(failures)} violation(s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
