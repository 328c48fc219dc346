"""``dledger``: run one node, or a whole local cluster.

    dledger node --cluster FILE --id ID [--secret S] [--log-level info]
    dledger cluster up [--nodes 3|5] [--learners K] [--dir DIR] [--secret S]
    dledger cluster up --groups 3 [--nodes 3]   # 3 broker groups + a 3-node controller group
    dledger cluster status [--dir DIR] [--json]
    dledger cluster endpoints [--dir DIR]       # host:port,host:port,... (HTTP)
    dledger cluster down [--dir DIR]
    dledger cluster kill ID [--signal KILL|TERM|STOP|CONT] [--dir DIR]
    dledger cluster restart ID [--dir DIR]
    dledger proxy [--listen H:P] [--routes H:P,... | --dir DIR]   # multi-group /v1 proxy
    dledger produce TOPIC [--file F | VALUE...] [--endpoints H:P,...] [--token T]
    dledger consume TOPIC --group G [--from earliest|latest] [--max N] [--follow]
    dledger topics list | create NAME [--queues N] | describe NAME | delete NAME

The client commands (produce, consume, topics: :mod:`http_api.cli`) talk
to ``--endpoints`` (default ``$DLEDGER_ENDPOINTS``, else the local cluster
file) with ``--token`` (default ``$DLEDGER_TOKEN``).

Exit codes: 0 ok; 1 failure (a port in use, no leader in time, ...);
2 operator action needed: a bad cluster file or command line, or a damaged
data directory (``StorageCorrupted``: the message names the directory and
the log index; rebuild that replica from a healthy peer; also
``REPLICA_DIVERGED``); 3 the disk failed a write or an fsync (``DISK_FAILED``:
the node stopped without acknowledging the failed writes; fix the disk and
restart it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import secrets
import signal
import sys
from collections.abc import Sequence
from typing import Any, cast

import orjson

from broker_adapter.node_sm import BrokerStateMachine
from controller.node_sm import ControllerStateMachine
from dledger.admin_http import AdminServer
from dledger.cluster import DEFAULT_DIR, LocalCluster
from dledger.cmode.node import CmodeNode
from dledger.config import NodeConfig, load_cluster_file
from dledger.errors import ConfigError, StorageCorrupted, StorageFailed
from dledger.http_auth import ROUTE_ROLES as APP_ROUTE_ROLES
from dledger.node import Node
from dledger_app import multi_cli, proxy
from dledger_app.broker_agent import GroupAgent
from dledger_app.controller_node import ControllerServer
from dledger_app.groups import GroupFile, MultiCluster, load_group_file
from http_api import cli as client_cli
from http_api.server import PRODUCE_HOOKS, NodeServer, make_node_app, make_state_machine

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_OPERATOR = 2  # bad configuration or damaged data: a human must act
EXIT_DISK = 3  # the disk refused a write or an fsync: fix it, then restart

logger = logging.getLogger("dledger")


def _setup_logging(level: str, node_id: int) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s.%(msecs)03d %(levelname)-7s n{node_id} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


# ---------------------------------------------------------------------------
# dledger node


def _pin_mmap_threshold() -> None:
    """Blocks of 1 MiB and more (snapshots, checkpoints, big reads) get
    their own mappings, given back when freed. glibc otherwise raises its
    threshold to the size of the largest block freed, after which such
    blocks come from the heap and its holes: a node's memory crept up by
    every snapshot it built (+34 MB from 1M to 5M messages)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to pin


async def run_node(cfg: NodeConfig, group: GroupFile | None = None) -> int:
    """Run one node until SIGTERM/SIGINT or a fatal error; returns the exit code.
    ``group``: the node's group file (a multi-group deployment), if any."""
    _pin_mmap_threshold()
    node: Node
    if group is not None and group.role == "controller":
        node = Node(cfg, ControllerStateMachine())
    elif cfg.replication == "controller":
        # Controller mode (dledger.cmode): the controller group elects the
        # master, so a group file naming it is required. The HTTP layer and
        # the agent use the same few calls of either kind of node.
        if group is None or group.role != "broker":
            logger.critical(
                'replication = "controller" needs a broker group file (group.toml) naming '
                "the controller group: see docs/groups.md"
            )
            return EXIT_OPERATOR
        node = cast(Node, CmodeNode(cfg, make_state_machine(cfg)))
    else:
        node = Node(cfg, make_state_machine(cfg))
    try:
        await node.start()
    except StorageFailed as exc:
        logger.critical("refusing to start: DISK_FAILED: %s", exc)
        return EXIT_DISK
    except (StorageCorrupted, ConfigError) as exc:
        logger.critical("refusing to start: %s", exc)
        return EXIT_OPERATOR
    except OSError as exc:
        logger.critical("cannot listen on raft %s:%d: %s", cfg.raft_host, cfg.raft_port, exc)
        return EXIT_FAILURE
    agent: GroupAgent | None = None
    server: AdminServer
    if group is not None and group.role == "controller":
        server = ControllerServer(node)
    elif cfg.state_machine == "broker":
        app = make_node_app(node)
        if group is not None:
            assert isinstance(node.state_machine, BrokerStateMachine)
            agent = GroupAgent(node, node.state_machine, group)
            app.router.add_routes(agent.routes())
            app[APP_ROUTE_ROLES].update(GroupAgent.ROUTE_ROLES)
            app.middlewares.append(agent.middleware)  # innermost: after auth and the guard
            # what the middleware does to a produce body, for the express lane
            app.setdefault(PRODUCE_HOOKS, {})[agent.middleware] = agent.route_produce_body
        server = NodeServer(node, app)
    else:
        server = AdminServer(node)
    try:
        await server.start()
    except OSError as exc:
        logger.critical("cannot listen on http %s:%d: %s", cfg.http_host, cfg.http_port, exc)
        await node.stop()
        return EXIT_FAILURE

    # Latency: what start-up allocated is permanent; keep it out of every
    # collection, and collect the young generation less often (a node makes
    # many short-lived objects per entry; full collections over them are the
    # long pauses that show up as commit-latency tails).
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)

    if agent is not None:
        agent.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info(
        "node %d of cluster %r: raft on %s:%d, http on %s:%d, voters %s, learners %s",
        cfg.node_id,
        cfg.cluster_id,
        cfg.raft_host,
        cfg.raft_port,
        cfg.http_host,
        cfg.http_port,
        list(cfg.voters()),
        list(cfg.learners()),
    )
    stop_wait = loop.create_task(stop.wait())
    fail_wait = loop.create_task(node.failed.wait())
    await asyncio.wait({stop_wait, fail_wait}, return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    fail_wait.cancel()
    if stop.is_set():
        logger.info("signal received: stopping")
    if agent is not None:
        await agent.stop()
    await node.stop()
    await server.stop()
    if node.fatal is not None:
        # The node logged the cause when its loop stopped.
        if isinstance(node.fatal, StorageFailed):
            code = EXIT_DISK
        elif isinstance(node.fatal, StorageCorrupted):
            code = EXIT_OPERATOR
        else:
            code = EXIT_FAILURE
        logger.info("exiting with code %d", code)
        return code
    return EXIT_OK


def cmd_node(args: argparse.Namespace) -> int:
    try:
        cfg = load_cluster_file(args.cluster).node_config(args.id, secret=args.secret)
        group = load_group_file(args.cluster)
    except ConfigError as exc:
        print(f"dledger node: {exc}", file=sys.stderr)
        return EXIT_OPERATOR
    _setup_logging(args.log_level, cfg.node_id)
    return asyncio.run(run_node(cfg, group))


# ---------------------------------------------------------------------------
# dledger cluster ...


def _print_members(lc: LocalCluster) -> None:
    for m in lc.spec.members:
        pid = lc.pid(m.id)
        print(
            f"  node {m.id}  {m.role:<7}  raft {m.raft_address:<21}  http {m.http_address:<21}  "
            f"pid {pid if pid else '-':<7}  log {lc.log_path(m.id)}"
        )


def cmd_cluster_up(args: argparse.Namespace) -> int:
    if args.groups is not None or MultiCluster.is_multi(args.dir):
        if args.learners:
            print("dledger cluster up: --learners is not supported with --groups", file=sys.stderr)
            return EXIT_OPERATOR
        if args.groups is None:
            args.groups = len(MultiCluster(args.dir).group_names())
        return multi_cli.cmd_up(args)
    lc = LocalCluster(args.dir)
    if lc.cluster_path.exists():
        spec = lc.spec
        voters = sum(1 for m in spec.members if m.role == "voter")
        learners = len(spec.members) - voters
        if (args.nodes is not None and args.nodes != voters) or (
            args.learners is not None and args.learners != learners
        ):
            print(
                f"dledger cluster up: {lc.cluster_path} already describes {voters} voters and "
                f"{learners} learners; use another --dir or `dledger cluster down` and remove it",
                file=sys.stderr,
            )
            return EXIT_OPERATOR
        print(f"cluster {spec.cluster_id!r} in {lc.dir} (existing cluster file)")
    else:
        secret = args.secret if args.secret is not None else secrets.token_hex(16)
        lc = LocalCluster.create(
            args.dir,
            voters=args.nodes if args.nodes is not None else 3,
            learners=args.learners or 0,
            secret=secret,
        )
        print(f"cluster {lc.spec.cluster_id!r} in {lc.dir} (new cluster file {lc.cluster_path})")
    started = [nid for nid in lc.ids() if not lc.running(nid)]
    for nid in started:
        lc.start(nid)
    try:
        leader = lc.wait_leader(args.timeout)
    except TimeoutError as exc:
        print(f"dledger cluster up: {exc}", file=sys.stderr)
        multi_cli.report_not_running(lc, "")
        return EXIT_FAILURE
    _print_members(lc)
    st = lc.status(leader) or {}
    print(f"leader: node {leader} (http {lc.http(leader)}), term {st.get('term')}")
    return EXIT_OK


def cmd_cluster_status(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        return multi_cli.cmd_status(args)
    lc = LocalCluster(args.dir)
    statuses: dict[int, dict[str, Any] | None] = {nid: lc.status(nid) for nid in lc.ids()}
    if args.json:
        sys.stdout.write(orjson.dumps({str(k): v for k, v in statuses.items()}).decode() + "\n")
        return EXIT_OK if any(statuses.values()) else EXIT_FAILURE
    print(f"cluster {lc.spec.cluster_id!r} in {lc.dir}")
    role_w = max(
        len("pre_candidate"), *(len(str((st or {}).get("role", ""))) for st in statuses.values())
    )
    print(
        f"  {'id':>3} {'role':<{role_w}} {'pid':>7} {'term':>5} {'leader':>6} {'commit':>8} "
        f"{'applied':>8} {'last':>8}  http"
    )
    for m in lc.spec.members:
        st = statuses[m.id]
        pid = lc.pid(m.id) or "-"
        if st is None:
            state = "down" if pid == "-" else "no answer"
            print(
                f"  {m.id:>3} {state:<{role_w}} {pid:>7} {'':>5} {'':>6} {'':>8} {'':>8} {'':>8}  "
                f"{m.http_address}"
            )
            continue
        print(
            f"  {m.id:>3} {st['role']:<{role_w}} {pid:>7} {st['term']:>5} {st['leader'] or '-':>6} "
            f"{st['commit']:>8} {st['applied']:>8} {st['last_index']:>8}  {m.http_address}"
        )
    return EXIT_OK if any(statuses.values()) else EXIT_FAILURE


def cmd_cluster_endpoints(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        return multi_cli.cmd_endpoints(args)
    lc = LocalCluster(args.dir)
    if not lc.cluster_path.exists():
        print(
            f"dledger cluster endpoints: no cluster file {lc.cluster_path} "
            "(start a cluster with `dledger cluster up`)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    print(lc.endpoints())
    return EXIT_OK


def cmd_cluster_down(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        return multi_cli.cmd_down(args)
    lc = LocalCluster(args.dir)
    for nid, how in lc.down(args.timeout).items():
        print(f"node {nid}: {how}")
    return EXIT_OK


def cmd_cluster_kill(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        return multi_cli.cmd_kill(args)
    return multi_cli.kill_member(LocalCluster(args.dir), args, "")


def cmd_cluster_restart(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        return multi_cli.cmd_restart(args)
    return multi_cli.restart_member(LocalCluster(args.dir), args, "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dledger", description="DLedger-py replicated commit log")
    sub = p.add_subparsers(dest="command", required=True)

    node = sub.add_parser("node", help="run one node in the foreground")
    node.add_argument("--cluster", required=True, help="the cluster file (TOML)")
    node.add_argument("--id", type=int, required=True, help="this node's member id")
    node.add_argument("--secret", help="override the cluster file's secret")
    node.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    node.set_defaults(func=cmd_node)

    cl = sub.add_parser("cluster", help="manage a local multi-process cluster")
    csub = cl.add_subparsers(dest="cluster_command", required=True)

    def with_dir(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument(
            "--dir", default=DEFAULT_DIR, help=f"cluster directory (default {DEFAULT_DIR})"
        )
        sp.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
        return sp

    up = with_dir(csub.add_parser("up", help="create (or reuse) a cluster and start every node"))
    up.add_argument("--nodes", type=int, choices=[1, 3, 5, 7], help="voters (default 3)")
    up.add_argument("--learners", type=int, help="non-voting replicas (default 0)")
    up.add_argument("--secret", help="peer authentication secret (default: a random one)")
    up.add_argument(
        "--groups",
        type=int,
        help="broker groups (each --nodes voters) plus a 3-node controller group: "
        "a multi-group cluster (default: one group, no controller)",
    )
    up.set_defaults(func=cmd_cluster_up)

    st = with_dir(csub.add_parser("status", help="ask every node for its Raft status"))
    st.add_argument("--json", action="store_true", help="print the raw status documents")
    st.set_defaults(func=cmd_cluster_status)

    with_dir(
        csub.add_parser(
            "endpoints",
            help="print every node's HTTP address, comma-separated (for --endpoints, "
            "$DLEDGER_ENDPOINTS or Spark's endpoints option)",
        )
    ).set_defaults(func=cmd_cluster_endpoints)

    with_dir(csub.add_parser("down", help="stop every node (SIGTERM, then SIGKILL)")).set_defaults(
        func=cmd_cluster_down
    )

    k = with_dir(csub.add_parser("kill", help="signal one node (default SIGKILL)"))
    k.add_argument("id", type=int)
    k.add_argument("--signal", default="KILL", choices=["KILL", "TERM", "STOP", "CONT", "INT"])
    k.add_argument("--group", help="multi-group cluster: controller, g1, g2, ...")
    k.set_defaults(func=cmd_cluster_kill)

    r = with_dir(csub.add_parser("restart", help="stop one node (if running) and start it"))
    r.add_argument("id", type=int)
    r.add_argument("--group", help="multi-group cluster: controller, g1, g2, ...")
    r.set_defaults(func=cmd_cluster_restart)

    proxy.add_command(sub, DEFAULT_DIR)
    client_cli.add_commands(sub)
    return p


def _mark_usage(p: argparse.ArgumentParser) -> None:
    """Every subcommand's parser records itself, so that an unknown flag is
    reported with that subcommand's usage, not the top level's."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.set_defaults(usage_parser=sp)
                _mark_usage(sp)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    _mark_usage(p)
    args, rest = p.parse_known_args(argv)
    if rest:
        leaf: argparse.ArgumentParser = getattr(args, "usage_parser", None) or p
        leaf.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(_parser(), argv)
    if args.command in ("produce", "consume", "topics"):
        return client_cli.run(args)
    if args.command == "cluster":
        _setup_logging("warning", 0)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"dledger: {exc}", file=sys.stderr)
        return EXIT_OPERATOR
    except KeyboardInterrupt:
        return EXIT_FAILURE
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
