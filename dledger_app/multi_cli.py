"""``dledger cluster up --groups N`` and the other ``cluster`` commands on a
multi-group layout (:mod:`dledger_app.groups`): the controller group plus N
broker groups, every node its own OS process on 127.0.0.1."""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import time
from typing import Any

from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request
from dledger.errors import ConfigError
from dledger_app.groups import MultiCluster

EXIT_OK, EXIT_FAILURE, EXIT_OPERATOR = 0, 1, 2


def controller_get(mc: MultiCluster, path: str, timeout_s: float = 1.0) -> Any | None:
    """GET ``path`` from the first controller node that answers 200."""
    headers = mc.controller().admin_headers()  # the cluster file's own admin token, if any
    for addr in mc.controller_endpoints():
        try:
            r = http_request(addr, "GET", path, timeout_s=timeout_s, headers=headers)
        except HTTP_ERRORS:
            continue
        if r.status == 200:
            return r.json()
    return None


def wait_groups_live(mc: MultiCluster, timeout_s: float) -> dict[str, Any]:
    """Until the controller reports every broker group live (a leader heartbeat)."""
    names = set(mc.group_names())
    deadline = time.monotonic() + timeout_s
    while True:
        b = controller_get(mc, "/v1/brokers")
        if b is not None:
            live = {g["name"] for g in b["groups"] if g["live"]}
            if names <= live:
                return dict(b)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not see every group live within {timeout_s}s")
        time.sleep(0.2)


def cmd_up(args: argparse.Namespace) -> int:
    if MultiCluster.is_multi(args.dir):
        mc = MultiCluster(args.dir)
        if len(mc.group_names()) != args.groups:
            print(
                f"dledger cluster up: {mc.dir} already holds {len(mc.group_names())} groups; "
                "use another --dir or `dledger cluster down` and remove it",
                file=sys.stderr,
            )
            return EXIT_OPERATOR
        print(f"{len(mc.group_names())} broker groups + controller in {mc.dir} (existing layout)")
    else:
        secret = args.secret if args.secret is not None else secrets.token_hex(16)
        mc = MultiCluster.create(args.dir, groups=args.groups, nodes=args.nodes or 3, secret=secret)
        print(f"{args.groups} broker groups + controller in {mc.dir} (new layout)")
    clusters = mc.all()
    for lc in clusters.values():
        lc.start_all()
    try:
        for lc in clusters.values():
            lc.wait_leader(args.timeout)
        wait_groups_live(mc, args.timeout)
    except TimeoutError as exc:
        print(f"dledger cluster up: {exc}", file=sys.stderr)
        for name, lc in clusters.items():
            report_not_running(lc, f"{name} ")
        return EXIT_FAILURE
    print_status(mc)
    return EXIT_OK


def print_status(mc: MultiCluster) -> bool:
    brokers = controller_get(mc, "/v1/brokers") or {"groups": []}
    live = {g["name"]: g for g in brokers["groups"]}
    any_up = False
    for name, lc in mc.all().items():
        lead = lc.leader()
        extra = ""
        if name in live:
            extra = f"  controller sees it {'live' if live[name]['live'] else 'NOT live'}"
        print(f"{name}: leader {f'node {lead}' if lead else '-'}{extra}")
        for m in lc.spec.members:
            st = lc.status(m.id)
            pid = lc.pid(m.id)
            any_up |= st is not None
            role = st["role"] if st else ("down" if pid is None else "no answer")
            term = st["term"] if st else ""
            commit = st["commit"] if st else ""
            print(
                f"  node {m.id}  {role:<13} pid {pid or '-':<7} term {term:<4} "
                f"commit {commit:<8} http {m.http_address}"
            )
    table = controller_get(mc, "/v1/routes")
    if table is None:
        print("routes: the controller does not answer")
    else:
        print(f"routes (version {table['version']}):")
        for topic, r in table["topics"].items():
            per: dict[str, list[int]] = {}
            for q, g in enumerate(r["queues"]):
                per.setdefault(g, []).append(q)
            spread = "; ".join(f"{g}: {qs}" for g, qs in sorted(per.items()))
            print(f"  {topic} (v{r['version']}, {len(r['queues'])} queues)  {spread}")
    return any_up


def cmd_status(args: argparse.Namespace) -> int:
    mc = MultiCluster(args.dir)
    print(f"multi-group cluster in {mc.dir}")
    return EXIT_OK if print_status(mc) else EXIT_FAILURE


def cmd_down(args: argparse.Namespace) -> int:
    mc = MultiCluster(args.dir)
    for name, lc in mc.all().items():
        for nid, how in lc.down(args.timeout).items():
            print(f"{name} node {nid}: {how}")
    return EXIT_OK


def _group(mc: MultiCluster, args: argparse.Namespace) -> LocalCluster:
    if not args.group:
        raise ConfigError(
            f"{mc.dir} is a multi-group cluster: name the group with --group "
            f"(controller, {', '.join(mc.group_names())})"
        )
    return mc.controller() if args.group == "controller" else mc.group(args.group)


def report_not_running(lc: LocalCluster, label: str) -> None:
    """After a failed start: each node of ``lc`` that is not running, with
    the end of its log (``label`` names the group, if any)."""
    for nid in lc.ids():
        if not lc.running(nid):
            print(
                f"{label}node {nid} is not running; its log ends with:\n{lc.log_tail(nid)}",
                file=sys.stderr,
            )


def kill_member(lc: LocalCluster, args: argparse.Namespace, label: str) -> int:
    """``cluster kill``: send ``args.signal`` to node ``args.id`` of ``lc``
    (one cluster, or one group of a multi-group one; ``label`` names it)."""
    sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
    lc.member(args.id)
    if not lc.kill(args.id, sig):
        print(f"{label}node {args.id} is not running", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{label}node {args.id}: sent {sig.name}")
    return EXIT_OK


def restart_member(lc: LocalCluster, args: argparse.Namespace, label: str) -> int:
    """``cluster restart``: stop node ``args.id`` of ``lc`` and start it again."""
    lc.member(args.id)
    how = lc.stop(args.id, args.timeout)
    lc.start(args.id)
    try:
        lc.wait_http(args.id, args.timeout)
    except (TimeoutError, RuntimeError) as exc:
        print(f"dledger cluster restart: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{label}node {args.id}: {how}, started again (pid {lc.pid(args.id)})")
    return EXIT_OK


def cmd_kill(args: argparse.Namespace) -> int:
    return kill_member(_group(MultiCluster(args.dir), args), args, f"{args.group} ")


def cmd_restart(args: argparse.Namespace) -> int:
    return restart_member(_group(MultiCluster(args.dir), args), args, f"{args.group} ")


def cmd_endpoints(args: argparse.Namespace) -> int:
    print(",".join(MultiCluster(args.dir).endpoints()))
    return EXIT_OK
