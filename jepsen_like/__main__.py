"""``python -m jepsen_like run ...``: one harness run; ``check H.jsonl``: the checkers.

    python -m jepsen_like run --nodes 3|5 [--learners N] [--groups G [--unordered N]]
        --nemesis all|kill,pause,partition,clock,corrupt,power,disk|none
        [--flush sync|async]
        --time-limit S --out DIR [--seed N] [--schedule kill:all,pause:leader,...]
        [--clients-per-queue N] [--client-timeout MIN_S MAX_S]
    python -m jepsen_like check HISTORY.jsonl [--json]

``check`` prints the same VERDICT line and summary table as ``run``.

Exit status of ``run``: 0 when every checker is valid, 1 invalid, 2 unknown,
3 the harness itself failed (cluster never ready, ...), 130 interrupted.
Planted bugs (tests only): ``--fault NAME`` starts every node with
``DLEDGER_ENABLE_FAULTS=1 DLEDGER_FAULTS=NAME``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jepsen_like.groups import GROUP_KINDS, GROUPS_ALL
from jepsen_like.nemesis import ALL_KINDS, parse_schedule
from jepsen_like.runner import RunConfig, Runner


def _kinds(s: str) -> list[str]:
    """Validated later, once --groups is known ('all' depends on it)."""
    if s in ("none", ""):
        return []
    return [k.strip() for k in s.split(",") if k.strip()]


def _resolve_kinds(kinds: list[str], groups: int) -> list[str]:
    known = list(ALL_KINDS) + (list(GROUP_KINDS) if groups else [])
    if kinds == ["all"]:
        return list(GROUPS_ALL) if groups else list(ALL_KINDS)
    bad = [k for k in kinds if k not in known]
    if bad:
        raise ValueError(f"unknown nemesis {bad} (known: {', '.join(known)})")
    return kinds


def _schedule(s: str) -> list[tuple[str, str | None]]:
    if s == "none":
        return []
    try:
        return parse_schedule(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jepsen_like")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run",
        help="run the harness against a fresh local cluster",
        description="Start a fresh cluster, run clients while nemeses inject faults, heal, "
        "read everything back, and check the history. Writes history.jsonl, results.json "
        "and report.html to --out. Exit status: 0 valid, 1 invalid, 2 unknown, 3 the "
        "harness failed. Partitions need root and `ip netns` (else the nodes run on "
        "127.0.0.1 and partition is skipped); the clock nemesis needs libfaketime.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--nodes", type=int, choices=[3, 5], default=3, help="voters")
    r.add_argument(
        "--learners",
        type=int,
        default=1,
        help="non-voting replicas (1: with 3 voters the leader-minority partition keeps the "
        "leader with the learner, which replicates entries that never commit)",
    )
    r.add_argument(
        "--nemesis",
        type=_kinds,
        default="all",
        metavar="KINDS",
        help="faults to inject, in turn: 'all', 'none', or a comma-separated list of "
        f"{', '.join(ALL_KINDS)}, and with --groups also group, controller (kill: SIGKILL "
        "nodes; pause: SIGSTOP them; partition: "
        "iptables rules between namespaces; clock: restart a node with a skewed or "
        "strobing clock; corrupt: damage a stopped node's data file, rebuild it; power: "
        "SIGKILL nodes and drop what they never fsynced (lazyfs, FUSE); disk: fail one "
        "node's fsyncs or writes with EIO/ENOSPC (lazyfs); group: SIGKILL a majority or all "
        "of one broker group; controller: SIGKILL the controller's leader or majority). With "
        "--groups, 'all' is group, controller, kill, pause, partition, clock, corrupt, the "
        "single-group kinds each acting on a random broker group",
    )
    r.add_argument(
        "--groups",
        type=int,
        default=0,
        metavar="G",
        help="a multi-group run: G broker groups of --nodes voters each, plus a controller "
        "group; queues spread over the groups by the controller (0: one plain cluster)",
    )
    r.add_argument("--controller-nodes", type=int, choices=[3, 5], default=3, help="with --groups")
    r.add_argument(
        "--replication",
        choices=["raft", "controller"],
        default="raft",
        help="how the broker groups replicate: raft, or controller (RocketMQ 5's controller "
        "mode, docs/controller-mode.md; implies --groups 1 at least)",
    )
    r.add_argument(
        "--cmode",
        choices=["cp", "ap"],
        default="cp",
        help="controller-mode settings: cp (every member of the SyncStateSet acknowledges, a "
        "majority at least) or ap (adaptive degradation, unclean elections)",
    )
    r.add_argument(
        "--unordered",
        type=int,
        default=None,
        metavar="N",
        help="with --groups: producers of unordered messages, which move to another group's "
        "queue when theirs refuses or times out (default: 2 per group)",
    )
    r.add_argument(
        "--flush",
        choices=["sync", "async"],
        default="sync",
        help="the nodes' flush mode: async may lose the unsynced tail after a power loss "
        "of a majority (the replicas checker still demands zero divergence)",
    )
    r.add_argument(
        "--time-limit", type=float, default=60.0, metavar="S", help="seconds of load and faults"
    )
    r.add_argument("--out", type=Path, default=Path("jepsen-out"), help="output directory")
    r.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and targets")
    r.add_argument(
        "--queues",
        type=int,
        default=None,
        help="queues of the test topic (default 3; with --groups, 2 per group)",
    )
    r.add_argument(
        "--clients-per-queue",
        type=int,
        default=None,
        help="contended workload: clients of each queue (half producers, a third of them "
        "idempotent; the rest read at the head); 0: the legacy --producers/--readers mix "
        f"(default {RunConfig.clients_per_queue}; with --groups 6)",
    )
    r.add_argument(
        "--client-timeout",
        type=float,
        nargs=2,
        default=RunConfig.client_timeout_s,  # one source: the run configuration
        metavar=("MIN_S", "MAX_S"),
        help="per-op client deadline drawn from this range (ops cut off end info)",
    )
    r.add_argument("--producers", type=int, default=4, help="producer clients (legacy mix only)")
    r.add_argument("--readers", type=int, default=2, help="clients reading by offset (legacy mix)")
    r.add_argument("--pollers", type=int, default=3, help="consumer-group pollers, one per queue")
    r.add_argument(
        "--schedule",
        type=_schedule,
        default=None,
        metavar="KIND[:SHAPE],...",
        help="faults to make first, in order, e.g. kill:all,partition:leader-minority,"
        "pause:leader,clock:step (then round robin over --nemesis); default: kill:majority, "
        "kill:all, partition:leader-minority, pause:leader, clock:step in an order drawn "
        "from --seed; 'none' for the round robin alone",
    )
    r.add_argument(
        "--fault-seconds",
        type=float,
        nargs=2,
        default=(2.5, 5.0),
        metavar=("MIN", "MAX"),
        help="how long each fault lasts (uniform between MIN and MAX)",
    )
    r.add_argument(
        "--quiet-seconds",
        type=float,
        nargs=2,
        default=(2.0, 4.0),
        metavar=("MIN", "MAX"),
        help="quiet time between faults",
    )
    r.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="NAME",
        help="planted bug to switch on in every node, to see a checker fail (tests): "
        "ack_before_commit, lin_read_no_lease, skip_fsync, follower_reads_uncommitted, "
        "ack_below_commit; controller mode: cmode_confirm_from_master, cmode_skip_truncation "
        "(ack_before_commit there acknowledges before the SyncStateSet holds the write)",
    )
    r.add_argument(
        "--no-netns",
        action="store_true",
        help="run nodes on 127.0.0.1 even when network namespaces are available",
    )
    r.add_argument(
        "--shapes",
        action="append",
        default=[],
        metavar="KIND=S1,S2",
        help="restrict a nemesis to these shapes, e.g. kill=majority,all partition=halves "
        "(kill/pause: leader, one, minority, majority, all; partition: isolate-leader, "
        "isolate-one, halves, bridge, majorities-ring, leader-minority; clock: skew, strobe; "
        "power: one, minority, majority, all, each also -torn; disk: fsync-eio, fsync-enospc, "
        "write-eio, write-enospc)",
    )
    cmp = sub.add_parser(
        "compare",
        help="the same seeded workload and fault schedule against Raft and controller mode "
        "(CP and AP settings, 2 and 3 replicas), one report",
        description="Runs one multi-group harness run per mode (one broker group plus the "
        "controller group), same seed and schedule, and writes compare.html (plots first) and "
        "compare.json to --out. Modes: raft-3, raft-5, cp-3, cp-2, ap-3, ap-2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cmp.add_argument(
        "--modes",
        default="raft-3,raft-5,cp-3,ap-3,cp-2,ap-2",
        help="comma-separated modes, run in this order",
    )
    cmp.add_argument(
        "--time-limit", type=float, default=90.0, metavar="S", help="per mode (default: 90)"
    )
    cmp.add_argument("--seed", type=int, default=1)
    cmp.add_argument("--out", type=Path, default=Path("jepsen-compare"))
    c = sub.add_parser(
        "check",
        help="run the checkers on a history file (the VERDICT line and table; --json: raw JSON;"
        " other options as python -m jepsen_like.checkers)",
    )
    c.add_argument("history")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "compare":
        if rest:
            cmp.error(f"unrecognized arguments: {' '.join(rest)}")
        from jepsen_like.compare import main as compare_main

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        return compare_main(modes, args.out, args.seed, args.time_limit)
    if args.cmd == "check":
        from jepsen_like.checkers.__main__ import main as check_main

        return check_main([args.history, *rest, *([] if args.json else ["--human"])])
    if rest:
        r.error(f"unrecognized arguments: {' '.join(rest)}")
    shapes: dict[str, list[str]] = {}
    for spec in args.shapes:
        kind, _, rest = spec.partition("=")
        shapes[kind] = [s for s in rest.split(",") if s]
    if args.replication == "controller" and args.groups == 0:
        args.groups = 1  # a controller-mode group needs the controller group
    try:
        kinds = _resolve_kinds(args.nemesis, args.groups)
    except ValueError as e:
        r.error(str(e))
    if args.groups < 0:
        r.error("--groups must be >= 0")
    multi = args.groups > 0
    if multi and args.learners:
        args.learners = 0  # broker groups are voters only in a multi-group run
    queues = args.queues if args.queues is not None else (2 * args.groups if multi else 3)
    default_cpq = 6 if multi else RunConfig.clients_per_queue  # one source, as the README says
    cpq = args.clients_per_queue if args.clients_per_queue is not None else default_cpq
    unordered = args.unordered if args.unordered is not None else 2 * args.groups
    env = {}
    if args.fault:
        env = {"DLEDGER_ENABLE_FAULTS": "1", "DLEDGER_FAULTS": ",".join(args.fault)}
    cfg = RunConfig(
        nodes=args.nodes,
        learners=args.learners,
        nemesis=kinds,
        time_limit_s=args.time_limit,
        out=args.out,
        seed=args.seed,
        queues=queues,
        producers=args.producers,
        idempotent_producers=args.producers // 2,
        readers=args.readers,
        pollers=args.pollers,
        fault_s=tuple(args.fault_seconds),
        quiet_s=tuple(args.quiet_seconds),
        node_env=env,
        use_netns=not args.no_netns,
        shapes=shapes,
        clients_per_queue=cpq,
        client_timeout_s=tuple(args.client_timeout),
        schedule=args.schedule,
        flush=args.flush,
        groups=args.groups,
        controller_nodes=args.controller_nodes,
        unordered=unordered if multi else 0,
        replication=args.replication,
        cmode=args.cmode,
    )
    try:
        if multi:
            from jepsen_like.groups import GroupsRunner

            return GroupsRunner(cfg).run()
        return Runner(cfg).run()
    except RuntimeError as e:
        print(f"VERDICT ERROR: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
