"""Per-node network namespaces and kernel-level partitions (iptables DROP).

Theory of operation
-------------------
Every node runs in its own network namespace ``jl-n<ID>``. A veth pair joins
it to one bridge ``jlbr0`` in the root namespace: the root side is
``jlv<ID>`` (enslaved to the bridge), the namespace side ``jlp<ID>`` with
address ``10.77.0.<10+ID>/24``. The bridge holds ``10.77.0.1``, so the
harness (in the root namespace) reaches every node directly, as Jepsen's
control node does, and partitions only ever cut node-to-node traffic.

A partition is a *grudge*: node -> the set of nodes it must not hear from.
It is applied as ``iptables -A INPUT -s <peer> -j DROP`` inside each
namespace (both directions appear in the grudge, so a cut is symmetric);
healing flushes the INPUT chain of every namespace.

Everything this module creates carries the ``jl`` prefix, and
:func:`cleanup` removes every such namespace and link (and kills, by PID,
any process still inside one of our namespaces): the harness calls it
before a run, to clear what a crashed run left, and after.

Requires root and ``ip netns``; :func:`available` says why not otherwise,
and the harness then runs every node on 127.0.0.1 without partitions.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping

PREFIX = "jl"
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.77.0"
BRIDGE_IP = f"{SUBNET}.1"


class NetError(RuntimeError):
    pass


def ns_name(node_id: int) -> str:
    return f"{PREFIX}-n{node_id}"


def node_ip(node_id: int) -> str:
    return f"{SUBNET}.{10 + node_id}"


def _run(argv: list[str], *, check: bool = True, ns: str | None = None) -> str:
    if ns is not None:
        argv = ["ip", "netns", "exec", ns, *argv]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise NetError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def available() -> str | None:
    """None when namespaces and iptables can be used, else the reason why not."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed"
    try:
        _run(["ip", "netns", "list"])
    except (NetError, OSError, subprocess.SubprocessError) as e:
        return f"'ip netns' is unavailable: {e}"
    return None


def our_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}-n")]


def cleanup() -> list[str]:
    """Remove every namespace, link and process a (possibly crashed) run left."""
    done: list[str] = []
    for ns in our_namespaces():
        pids = _run(["ip", "netns", "pids", ns], check=False).split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
                done.append(f"killed pid {pid} in {ns}")
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", ns], check=False)
        done.append(f"deleted netns {ns}")
    links = _run(["ip", "-o", "link", "show"], check=False)
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if name == BRIDGE or (name.startswith(f"{PREFIX}v") and name[3:].isdigit()):
            _run(["ip", "link", "del", name], check=False)
            done.append(f"deleted link {name}")
    return done


def setup(node_ids: Iterable[int]) -> None:
    """Create the bridge and one namespace per node (call :func:`cleanup` first)."""
    _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    for i in node_ids:
        ns, host, peer = ns_name(i), f"{PREFIX}v{i}", f"{PREFIX}p{i}"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", ns])
        _run(["ip", "link", "set", host, "master", BRIDGE])
        _run(["ip", "link", "set", host, "up"])
        _run(["ip", "addr", "add", f"{node_ip(i)}/24", "dev", peer], ns=ns)
        _run(["ip", "link", "set", peer, "up"], ns=ns)
        _run(["ip", "link", "set", "lo", "up"], ns=ns)


def apply_grudge(grudge: Mapping[int, Iterable[int]]) -> None:
    """Node ``a`` drops every packet from each node in ``grudge[a]``."""
    for a, peers in sorted(grudge.items()):
        for b in sorted(set(peers)):
            _run(["iptables", "-w", "-A", "INPUT", "-s", node_ip(b), "-j", "DROP"], ns=ns_name(a))


def heal(node_ids: Iterable[int]) -> None:
    for i in node_ids:
        _run(["iptables", "-w", "-F", "INPUT"], ns=ns_name(i), check=False)


def complete_grudge(
    components: Iterable[Iterable[int]], nodes: Iterable[int]
) -> dict[int, set[int]]:
    """The grudge that splits ``nodes`` into disjoint ``components``; the nodes
    no component names form one more component together."""
    comps = [set(c) for c in components]
    all_nodes = set(nodes)
    rest = all_nodes - set().union(*comps)
    if rest:
        comps.append(rest)
    out: dict[int, set[int]] = {}
    for n in all_nodes:
        mine = next((c for c in comps if n in c), {n})
        out[n] = all_nodes - mine
    return out
