"""Several broker groups and a controller group on one machine.

A multi-group deployment is one Raft group per broker group plus one for
the controller. Each group is an ordinary cluster directory (its cluster
file, one data directory per member: :class:`dledger.cluster.LocalCluster`)
with a **group file**, ``group.toml``, next to its ``cluster.toml``::

    [group]
    name = "g1"                 # the broker group's name (its cluster id too)
    role = "broker"             # or "controller"
    controller = ["127.0.0.1:7101", "127.0.0.1:7103", "127.0.0.1:7105"]

``dledger node --cluster DIR/g1/cluster.toml --id 2`` reads the group file
next to the cluster file when there is one: a ``broker`` node then
heartbeats to the controller and serves the routes, a ``controller`` node
runs the controller's state machine and API instead of the broker's. The
same two files deploy a group's nodes on separate machines.

``dledger cluster up --groups 3 --nodes 3`` lays out::

    DIR/layout.json        {"controller": "controller", "groups": ["g1", "g2", "g3"]}
    DIR/controller/        the controller group (3 nodes)
    DIR/g1/ DIR/g2/ ...    the broker groups
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dledger.cluster import LocalCluster
from dledger.config import AuthSpec, toml_value
from dledger.errors import ConfigError

GROUP_FILE = "group.toml"
LAYOUT_FILE = "layout.json"
CONTROLLER_DIR = "controller"


@dataclass(frozen=True, slots=True)
class GroupFile:
    name: str
    role: str  # "broker" | "controller"
    controller: tuple[str, ...]  # the controller nodes' HTTP host:port


def group_file_path(cluster_file: str | os.PathLike[str]) -> Path:
    return Path(cluster_file).resolve().parent / GROUP_FILE


def load_group_file(cluster_file: str | os.PathLike[str]) -> GroupFile | None:
    """The group file next to ``cluster_file``, None when there is none (a
    single-group cluster). Raises ConfigError when it is malformed."""
    p = group_file_path(cluster_file)
    if not p.exists():
        return None
    try:
        doc = tomllib.loads(p.read_text("utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"group file {p}: {exc}") from None
    g = doc.get("group")
    if not isinstance(g, dict) or set(doc) != {"group"}:
        raise ConfigError(f"group file {p}: needs exactly one [group] table")
    unknown = set(g) - {"name", "role", "controller"}
    if unknown:
        raise ConfigError(f"group file {p}: unknown keys {sorted(unknown)}")
    name, role, ctl = g.get("name"), g.get("role", "broker"), g.get("controller", [])
    if not isinstance(name, str) or not name:
        raise ConfigError(f"group file {p}: group.name must be a non-empty string")
    if role not in ("broker", "controller"):
        raise ConfigError(f"group file {p}: group.role must be 'broker' or 'controller'")
    if not isinstance(ctl, list) or not all(isinstance(a, str) and ":" in a for a in ctl):
        raise ConfigError(f"group file {p}: group.controller must list host:port strings")
    if role == "broker" and not ctl:
        raise ConfigError(f"group file {p}: a broker group needs the controller's addresses")
    return GroupFile(name, role, tuple(ctl))


def write_group_file(directory: Path, gf: GroupFile) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        "# dledger group file: which group these nodes form and where the controller is.",
        "[group]",
        f"name = {toml_value(gf.name)}",
        f"role = {toml_value(gf.role)}",
        f"controller = {toml_value(list(gf.controller))}",
        "",
    ]
    (directory / GROUP_FILE).write_text("\n".join(lines), "utf-8")


class MultiCluster:
    """A multi-group layout directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory).resolve()
        self.layout_path = self.dir / LAYOUT_FILE
        # one LocalCluster per group, so the processes it started are its children
        self._clusters: dict[str, LocalCluster] = {}

    def _cluster(self, sub: str) -> LocalCluster:
        lc = self._clusters.get(sub)
        if lc is None:
            lc = self._clusters[sub] = LocalCluster(self.dir / sub)
        return lc

    @staticmethod
    def is_multi(directory: str | os.PathLike[str]) -> bool:
        return (Path(directory) / LAYOUT_FILE).exists()

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        groups: int,
        nodes: int = 3,
        controller_nodes: int = 3,
        secret: str | None = None,
        settings: dict[str, object] | None = None,
        auth: AuthSpec | None = None,
    ) -> MultiCluster:
        """Write every group's cluster and group files (free ports); refuses
        to overwrite an existing layout. ``auth``: the same bearer tokens in
        every group's cluster file (broker nodes heartbeat with an admin one)."""
        mc = cls(directory)
        if mc.layout_path.exists() or (mc.dir / "cluster.toml").exists():
            raise ConfigError(f"{mc.dir} already holds a cluster; reuse it or pick another --dir")
        if groups < 1:
            raise ConfigError(f"need >= 1 broker group, got {groups}")
        used: set[int] = set()

        def create(sub: str, **kw: Any) -> LocalCluster:
            # Each group's ports are free when picked, but released before
            # the next group picks its own: one could come back. Pick again.
            for _ in range(20):
                lc = LocalCluster.create(mc.dir / sub, secret=secret, auth=auth, **kw)
                ports = {p for m in lc.spec.members for p in (m.raft_port, m.http_port)}
                if not ports & used:
                    used.update(ports)
                    return lc
                shutil.rmtree(lc.dir)
            raise ConfigError(f"could not find free ports for {sub}")

        ctl = create(
            CONTROLLER_DIR,
            voters=controller_nodes,
            cluster_id="controller",
            settings={"state_machine": "log", **(settings or {})},
        )
        ctl_http = tuple(m.http_address for m in ctl.spec.members)
        write_group_file(ctl.dir, GroupFile("controller", "controller", ctl_http))
        names = [f"g{k + 1}" for k in range(groups)]
        for name in names:
            lc = create(name, voters=nodes, cluster_id=name, settings=settings)
            write_group_file(lc.dir, GroupFile(name, "broker", ctl_http))
        mc.layout_path.write_text(
            json.dumps({"controller": CONTROLLER_DIR, "groups": names}, indent=1)
        )
        mc._clusters = {CONTROLLER_DIR: ctl}
        return mc

    def _layout(self) -> dict[str, object]:
        try:
            v = json.loads(self.layout_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.layout_path}: {exc}") from None
        if not isinstance(v, dict):
            raise ConfigError(f"{self.layout_path}: not a layout")
        return v

    def group_names(self) -> list[str]:
        g = self._layout().get("groups")
        if not isinstance(g, list):
            raise ConfigError(f"{self.layout_path}: no groups")
        return [str(x) for x in g]

    def controller(self) -> LocalCluster:
        return self._cluster(str(self._layout().get("controller", CONTROLLER_DIR)))

    def group(self, name: str) -> LocalCluster:
        if name not in self.group_names():
            raise ConfigError(f"no broker group {name!r} (groups: {self.group_names()})")
        return self._cluster(name)

    def groups(self) -> dict[str, LocalCluster]:
        return {n: self._cluster(n) for n in self.group_names()}

    def all(self) -> dict[str, LocalCluster]:
        """Every group, the controller first."""
        return {"controller": self.controller(), **self.groups()}

    def down(self, proxy: subprocess.Popen[Any] | None = None) -> None:
        """Stop ``proxy`` (if one was started) and every node of every group."""
        if proxy is not None:
            stop_process(proxy)
        for lc in self.all().values():
            lc.down()

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Until every node of every group answers ``/healthz``: all their
        ports are bound, so a port picked free afterwards cannot be one of
        theirs (a proxy started earlier could take a late node's port)."""
        for lc in self.all().values():
            for nid in lc.ids():
                lc.wait_http(nid, timeout_s)

    def controller_endpoints(self) -> list[str]:
        return [m.http_address for m in self.controller().spec.members]

    def endpoints(self) -> list[str]:
        """Where routes can be asked: the controller nodes, then every broker node."""
        out = self.controller_endpoints()
        for lc in self.groups().values():
            out += [m.http_address for m in lc.spec.members]
        return out


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``timeout_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
