"""Node configuration and the cluster file.

Theory of operation
-------------------
A :class:`NodeConfig` is everything one node process needs: its identity,
its two listen addresses, its data directory, the cluster secret, the
address book of every member (so membership changes can reach them) and the
runtime tunables. Time is configured as a tick length (``tick_ms``) and Raft
timeouts in ticks, exactly as :class:`dledger.core.types.RaftConfig` takes
them; units are the last word of every name.

The cluster file names every member once, so the same file starts a local
cluster or deploys the nodes on different machines::

    [cluster]
    id = "local"
    secret = "..."                 # optional: HMAC-authenticated peer links

    [node]                         # optional: tunables shared by every member
    tick_ms = 20
    election_ticks = 15

    # HTTP caps (the defaults): request body (and inflated body) bytes
    # (0: max_entry_bytes + 64 KiB), messages per produce, properties per
    # message, header/body/idle timeouts, open connections per node.
    http_max_body_bytes = 0
    max_batch_messages = 4096
    max_message_properties = 64
    max_batch_properties = 16384
    http_header_timeout_ms = 10000
    http_body_timeout_ms = 30000
    http_idle_timeout_ms = 30000
    http_max_connections = 1024

    [[members]]
    id = 1
    raft = "127.0.0.1:7001"
    http = "127.0.0.1:8001"
    role = "voter"                 # or "learner"
    data_dir = "node-1"            # relative to the cluster file's directory

    [auth]                         # optional: bearer tokens on the HTTP API
    public = ["/healthz", "/readyz", "/metrics", "/openapi.json"]   # the default

    [[auth.tokens]]
    name = "orders-service"        # shows in logs; unique
    token = "..."                  # >= 16 printable ASCII characters, or:
    # token_file = "tokens/orders" # relative to the cluster file; first line
    roles = ["produce", "consume"] # of produce, consume, admin (admin: all)

It is read with :mod:`tomllib` and written by the small emitter below (no
extra dependency). Every problem is a :class:`ConfigError` that names the
offending field (``members[2].raft: ...``), never a ``KeyError``.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal, cast

from dledger import faults
from dledger.cmode.master import CmodeConfig
from dledger.core.types import ClusterConfig, RaftConfig
from dledger.errors import ConfigError
from dledger.transport.frames import DEFAULT_MAX_FRAME_SIZE

Role = Literal["voter", "learner"]
AuthRole = Literal["produce", "consume", "admin"]
AUTH_ROLES: tuple[AuthRole, ...] = ("produce", "consume", "admin")
# Routes served without a token while auth is on (unless [auth].public says otherwise).
DEFAULT_PUBLIC_PATHS: tuple[str, ...] = ("/healthz", "/readyz", "/metrics", "/openapi.json")
MIN_TOKEN_CHARS = 16
FlushMode = Literal["sync", "async"]
VerifyMode = Literal["tail", "full"]

_MAX_CLUSTER_ID_BYTES = 255  # what the transport handshake can carry


@dataclass(frozen=True, slots=True)
class MemberSpec:
    """One member of the cluster file. ``data_dir`` is as written (it may be
    relative to the cluster file's directory)."""

    id: int
    raft_host: str
    raft_port: int
    http_host: str
    http_port: int
    role: Role = "voter"
    data_dir: str = ""

    @property
    def raft_address(self) -> str:
        return f"{self.raft_host}:{self.raft_port}"

    @property
    def http_address(self) -> str:
        return f"{self.http_host}:{self.http_port}"


@dataclass(frozen=True, slots=True)
class TokenSpec:
    """One bearer token of ``[[auth.tokens]]``. ``token`` is the secret
    itself (read from ``token_file`` when the file names one)."""

    name: str
    token: str
    roles: tuple[AuthRole, ...]
    token_file: str = ""

    def __repr__(self) -> str:  # never print the secret
        return f"TokenSpec(name={self.name!r}, roles={self.roles!r})"


@dataclass(frozen=True, slots=True)
class AuthSpec:
    """HTTP API authentication: every request but those to ``public`` paths
    needs ``Authorization: Bearer <token>`` of a token with the route's role."""

    tokens: tuple[TokenSpec, ...]
    public: tuple[str, ...] = DEFAULT_PUBLIC_PATHS

    def token_with(self, role: AuthRole) -> str | None:
        """A token that holds ``role`` (operator tools use an admin one)."""
        for t in self.tokens:
            if role in t.roles or "admin" in t.roles:
                return t.token
        return None


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What one node process runs with. ``validate()`` raises ConfigError."""

    node_id: int
    cluster_id: str
    raft_host: str
    raft_port: int
    http_host: str
    http_port: int
    data_dir: str
    secret: str | None = None
    # HTTP bearer tokens and roles; None: the HTTP API is open (the default).
    auth: AuthSpec | None = None
    # Every known member (the address book); empty means a one-node cluster.
    members: tuple[MemberSpec, ...] = ()
    # Time: one tick of the Raft core, and Raft timeouts in ticks.
    tick_ms: int = 20
    election_ticks: int = 15
    # A heartbeat round every 100 ms: a third of the shortest election
    # timeout (300 ms), and what an idle node costs is mostly these rounds
    # (every 40 ms, an idle leader took 2.6 % of a core and a follower 1.4 %;
    # every 100 ms, 1.0 % and 0.55 %). The lease (election_ticks -
    # lease_drift_ticks = 240 ms from a round's send) is renewed well inside
    # its length.
    heartbeat_ticks: int = 5
    # An idle leader (nothing proposed, read or transferred and every peer
    # caught up for three election timeouts) spaces its rounds this many
    # ticks apart instead: -1 (auto) is 2/3 of the election timeout, 10
    # ticks (200 ms) with the defaults, never below heartbeat_ticks. Still
    # more than one round per shortest election timeout, so followers stay
    # sticky (a round may come 100 ms late before the first follower's timer
    # runs out, and then its pre-vote is refused); check-quorum holds while
    # answers come back within a round (the leader steps them at its next
    # one). The first request brings the short rounds back. 0: always
    # heartbeat_ticks. (Every 160 ms an idle leader used ~1.1 % of a core,
    # every 200 ms ~0.8 %, issue 17.)
    idle_heartbeat_ticks: int = -1
    lease_drift_ticks: int = 3
    # 0 (default): a commit index that moved goes to every follower at once
    # in a commit-only append, as etcd does. N > 0: it rides on the next
    # append or heartbeat, and followers that got neither get the
    # commit-only append N ticks later. With one request at a time that
    # saves one frame and one loop pass per follower and message (server
    # CPU per message -15%, issue 17), but followers apply, and serve to
    # consumers reading from them, the last write of a burst up to N ticks
    # later: a produce followed at once by a consume from a follower misses
    # it more often. Off by default for that.
    commit_notify_ticks: int = 0
    # Durability: "sync" fsyncs every group commit; "async" fsyncs every
    # flush_interval_ms and loses acknowledged writes if a majority loses power.
    flush: FlushMode = "sync"
    flush_interval_ms: int = 200
    # Back-pressure and sizes.
    max_inflight_proposals: int = 10000
    max_inflight_msgs: int = 256
    # entry bytes in flight to one follower: bounds the leader's work per
    # acknowledgement while it catches a far-behind follower up
    max_inflight_bytes: int = 8 << 20
    max_msg_bytes: int = 1 << 20
    max_entry_bytes: int = 4 << 20
    max_apply_bytes: int = 8 << 20
    max_inbox_msgs: int = 100_000
    transfer_max_lag: int = 1024
    # Snapshots: snapshot the state machine every this many applied entries
    # (0: never) and compact the log behind it, keeping
    # snapshot_trailing_entries so slightly-behind followers still get entries.
    snapshot_every_entries: int = 50_000
    snapshot_trailing_entries: int = 1024
    # Recently persisted entries the leader keeps in memory to send to
    # followers without reading them back from disk (also after the log
    # behind them was compacted): at most this many bytes.
    log_cache_bytes: int = 64 << 20
    # Snapshot streaming (dledger/snapshot_stream.py): a snapshot goes to a
    # far-behind follower in chunks of snapshot_chunk_bytes, at most
    # snapshot_window_chunks unacknowledged; a transfer without progress for
    # snapshot_stream_timeout_ms is given up (and retried by Raft). A node
    # refuses to receive a snapshot above snapshot_max_bytes.
    snapshot_chunk_bytes: int = 1 << 20
    snapshot_window_chunks: int = 4
    snapshot_stream_timeout_ms: int = 10_000
    snapshot_max_bytes: int = 8 << 30
    # Storage.
    # LMDB's map is address space, not memory or disk (the file grows as
    # pages are written). Big from the start: growing it is only safe with no
    # transaction open in the process, and the broker's records and index
    # live in the same environment as the log.
    map_size_bytes: int = 64 << 30
    verify: VerifyMode = "tail"
    verify_tail_entries: int = 1024
    # HTTP: how long a proposal or read waits for its answer by default.
    request_timeout_ms: int = 10_000
    # HTTP request caps (the HTTP server shares its event loop with Raft, so
    # no request may hold more work than one loop pass can afford; compare
    # Kafka's message.max.bytes / max.request.size). A request body above
    # http_max_body_bytes is refused with 413, before it is read when its
    # Content-Length says so; a compressed body (Content-Encoding gzip or
    # deflate) is inflated in steps and refused with 413 as soon as it
    # inflates past the same cap. 0: max_entry_bytes + 64 KiB.
    http_max_body_bytes: int = 0
    # At most this many messages in one produce request (422 above). Every
    # node applies a batch in one step (~10 us a message with the broker's
    # index and bodies): 4096 keeps that step far below the election
    # timeout; at 10,000 the worst-request test's other client saw a p99 of
    # 220-290 ms against a 300 ms election timeout, at 4096 80-120 ms.
    max_batch_messages: int = 4096
    # At most this many properties on one message, and in one produce
    # request (422 above): the work of a batch grows with its properties
    # (~60 us each to check, encode and apply), and a body at the byte cap
    # could otherwise carry ~450,000 of them.
    max_message_properties: int = 64
    max_batch_properties: int = 16_384
    # HTTP connection limits: a client must send a complete request header
    # within http_header_timeout_ms of connecting (or of its first byte after
    # a previous answer), and its whole body within http_body_timeout_ms of
    # the header (408, connection closed); an idle keep-alive connection is
    # closed after http_idle_timeout_ms. Above http_max_connections open
    # connections a new one is answered 503 (the envelope) and closed.
    http_header_timeout_ms: int = 10_000
    http_body_timeout_ms: int = 30_000
    http_idle_timeout_ms: int = 30_000
    http_max_connections: int = 1024
    # The express lane (http_api/protocol.py): a plain one-connection produce
    # request (no query, auth, encoding or unusual header, body <= 64 KiB)
    # is parsed and answered without aiohttp's request machinery; anything
    # else, and everything after it on that connection, goes through aiohttp.
    # Same checks and answers either way; false sends everything to aiohttp.
    http_express: bool = True
    # What committed entries are applied to: "broker" (broker_adapter, with
    # the /v1 message API) or "log" (records only, the bare Raft log).
    state_machine: str = "broker"
    # Broker: a produce to an unknown topic creates it with this many queues
    # (0: it is refused with UNKNOWN_TOPIC).
    auto_create_topic_queues: int = 0
    # How the group replicates: "raft" (quorum commit, elections inside the
    # group, a leader lease) or "controller" (RocketMQ 5's design,
    # dledger.cmode: a master the controller group elects, slaves, a
    # SyncStateSet; needs a group file naming the controller). The settings
    # below are the seed's, for "controller" only.
    replication: str = "raft"
    all_ack_in_sync_state_set: bool = False
    in_sync_replicas: int = 1
    min_in_sync_replicas: int = 1
    enable_auto_in_sync_replicas: bool = False
    enable_elect_unclean_master: bool = False
    ha_max_gap_bytes: int = 256 << 10
    ha_max_lag_ms: int = 3000
    # Planted bugs (simulator and checker self-tests only): core switches
    # (dledger.core.raft.CORE_FAULTS) and node ones (dledger.node.NODE_FAULTS).
    faults: frozenset[str] = frozenset()

    # -- derived -------------------------------------------------------------
    def cmode_config(self) -> CmodeConfig:
        """The controller-mode settings."""
        return CmodeConfig(
            all_ack_in_sync_state_set=self.all_ack_in_sync_state_set,
            in_sync_replicas=self.in_sync_replicas,
            min_in_sync_replicas=self.min_in_sync_replicas,
            enable_auto_in_sync_replicas=self.enable_auto_in_sync_replicas,
            enable_elect_unclean_master=self.enable_elect_unclean_master,
            max_gap_bytes=self.ha_max_gap_bytes,
            max_lag_ms=self.ha_max_lag_ms,
        )

    @property
    def idle_heartbeat_interval_ticks(self) -> int:
        """``idle_heartbeat_ticks`` with -1 (auto) resolved."""
        if self.idle_heartbeat_ticks != -1:
            return self.idle_heartbeat_ticks
        return max(self.heartbeat_ticks, self.election_ticks * 2 // 3)

    @property
    def election_timeout_ms(self) -> int:
        return self.election_ticks * self.tick_ms

    @property
    def http_body_cap_bytes(self) -> int:
        """The effective request body cap (compressed and inflated alike)."""
        return self.http_max_body_bytes or self.max_entry_bytes + (64 << 10)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode("utf-8") if self.secret is not None else None

    def voters(self) -> tuple[int, ...]:
        if not self.members:
            return (self.node_id,)
        return tuple(sorted(m.id for m in self.members if m.role == "voter"))

    def learners(self) -> tuple[int, ...]:
        return tuple(sorted(m.id for m in self.members if m.role == "learner"))

    def member(self, node_id: int) -> MemberSpec | None:
        for m in self.members:
            if m.id == node_id:
                return m
        return None

    def raft_config(self) -> RaftConfig:
        return RaftConfig(
            node_id=self.node_id,
            peers=ClusterConfig(self.voters(), self.learners()),
            election_ticks=self.election_ticks,
            heartbeat_ticks=self.heartbeat_ticks,
            idle_heartbeat_ticks=self.idle_heartbeat_interval_ticks,
            lease_drift_ticks=self.lease_drift_ticks,
            commit_notify_ticks=self.commit_notify_ticks,
            max_inflight_msgs=self.max_inflight_msgs,
            max_inflight_bytes=self.max_inflight_bytes,
            max_msg_bytes=self.max_msg_bytes,
            max_apply_bytes=self.max_apply_bytes,
            transfer_max_lag=self.transfer_max_lag,
            snapshot_trailing_entries=self.snapshot_trailing_entries,
            log_cache_bytes_max=self.log_cache_bytes,
            # planted bugs, tests only (dledger/faults.py, the simulator)
            faults=faults.core_faults() | self.faults,
        )

    def validate(self) -> None:
        if self.node_id < 1:
            raise ConfigError(f"node_id must be >= 1, got {self.node_id}")
        if not self.cluster_id or len(self.cluster_id.encode("utf-8")) > _MAX_CLUSTER_ID_BYTES:
            raise ConfigError(f"cluster_id must be 1..{_MAX_CLUSTER_ID_BYTES} UTF-8 bytes")
        for name in ("raft_port", "http_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ConfigError(f"{name} must be within 1..65535, got {port}")
        if (self.raft_host, self.raft_port) == (self.http_host, self.http_port):
            raise ConfigError("raft and http must listen on different addresses")
        if not self.data_dir:
            raise ConfigError("data_dir must be set")
        if self.secret is not None and not self.secret:
            raise ConfigError("secret must be omitted (no authentication) or non-empty")
        for name in (
            "tick_ms",
            "flush_interval_ms",
            "max_inflight_proposals",
            "max_inflight_msgs",
            "max_msg_bytes",
            "max_entry_bytes",
            "max_apply_bytes",
            "max_inbox_msgs",
            "verify_tail_entries",
            "request_timeout_ms",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.http_max_body_bytes != 0 and not 1024 <= self.http_max_body_bytes <= 1 << 30:
            raise ConfigError(
                "http_max_body_bytes must be 0 (max_entry_bytes + 64 KiB) or within "
                f"1024..{1 << 30}, got {self.http_max_body_bytes}"
            )
        if not 1 <= self.max_batch_messages <= 1_000_000:
            raise ConfigError(
                f"max_batch_messages must be within 1..1000000, got {self.max_batch_messages}"
            )
        if not 0 <= self.max_message_properties <= 65535:
            raise ConfigError(
                f"max_message_properties must be within 0..65535, got {self.max_message_properties}"
            )
        if not 0 <= self.max_batch_properties <= 10_000_000:
            raise ConfigError(
                f"max_batch_properties must be within 0..10000000, got {self.max_batch_properties}"
            )
        for name in ("http_header_timeout_ms", "http_body_timeout_ms", "http_idle_timeout_ms"):
            if not 100 <= getattr(self, name) <= 3_600_000:
                raise ConfigError(f"{name} must be within 100..3600000, got {getattr(self, name)}")
        if not 1 <= self.http_max_connections <= 1_000_000:
            raise ConfigError(
                f"http_max_connections must be within 1..1000000, got {self.http_max_connections}"
            )
        if self.max_msg_bytes + self.max_entry_bytes + (1 << 20) > DEFAULT_MAX_FRAME_SIZE:
            # One append message carries up to max_msg_bytes plus one entry.
            raise ConfigError(
                "max_msg_bytes + max_entry_bytes must stay 1 MiB under the transport's "
                f"{DEFAULT_MAX_FRAME_SIZE}-byte frame limit"
            )
        if self.snapshot_every_entries < 0:
            raise ConfigError(
                f"snapshot_every_entries must be >= 0 (0: never), got {self.snapshot_every_entries}"
            )
        if self.log_cache_bytes < 0:
            raise ConfigError(f"log_cache_bytes must be >= 0, got {self.log_cache_bytes}")
        if self.snapshot_trailing_entries < 0:
            raise ConfigError(
                f"snapshot_trailing_entries must be >= 0, got {self.snapshot_trailing_entries}"
            )
        if not 1024 <= self.snapshot_chunk_bytes <= 16 << 20:
            raise ConfigError(
                f"snapshot_chunk_bytes must be within 1024..{16 << 20}, got {self.snapshot_chunk_bytes}"
            )
        if not 1 <= self.snapshot_window_chunks <= 64:
            raise ConfigError(
                f"snapshot_window_chunks must be within 1..64, got {self.snapshot_window_chunks}"
            )
        if self.snapshot_chunk_bytes * self.snapshot_window_chunks > DEFAULT_MAX_FRAME_SIZE // 2:
            # The window must fit the transport's per-peer queue with room
            # for the Raft traffic that shares it.
            raise ConfigError(
                "snapshot_chunk_bytes * snapshot_window_chunks must stay within "
                f"{DEFAULT_MAX_FRAME_SIZE // 2} bytes"
            )
        if self.snapshot_stream_timeout_ms < 100:
            raise ConfigError(
                f"snapshot_stream_timeout_ms must be >= 100, got {self.snapshot_stream_timeout_ms}"
            )
        if self.snapshot_max_bytes < 1 << 20:
            raise ConfigError(f"snapshot_max_bytes must be >= 1 MiB, got {self.snapshot_max_bytes}")
        if self.map_size_bytes < 1 << 16:
            raise ConfigError(f"map_size_bytes must be >= 65536, got {self.map_size_bytes}")
        if self.flush not in ("sync", "async"):
            raise ConfigError(f"flush must be 'sync' or 'async', got {self.flush!r}")
        if self.verify not in ("tail", "full"):
            raise ConfigError(f"verify must be 'tail' or 'full', got {self.verify!r}")
        if self.state_machine not in ("broker", "log"):
            raise ConfigError(
                f"state_machine must be 'broker' or 'log', got {self.state_machine!r}"
            )
        if self.replication not in ("raft", "controller"):
            raise ConfigError(
                f"replication must be 'raft' or 'controller', got {self.replication!r}"
            )
        if self.replication == "controller":
            self.cmode_config().validate(len(self.members) or 1)
        if not 0 <= self.auto_create_topic_queues <= 1024:
            raise ConfigError(
                f"auto_create_topic_queues must be within 0..1024, got {self.auto_create_topic_queues}"
            )
        ids = [m.id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"members: duplicate ids in {sorted(ids)}")
        if self.members and self.member(self.node_id) is None:
            raise ConfigError(f"node_id {self.node_id} is not a member (members: {sorted(ids)})")
        if self.members and not self.voters():
            raise ConfigError("members: at least one member must be a voter")
        try:
            self.raft_config().validate()
        except ConfigError as exc:
            raise ConfigError(f"raft timing: {exc}") from None


# Tunables a cluster file may set in its [node] table: every NodeConfig field
# that is not identity, address book or secret.
_IDENTITY = frozenset(
    {
        "node_id",
        "cluster_id",
        "raft_host",
        "raft_port",
        "http_host",
        "http_port",
        "data_dir",
        "secret",
        "auth",
        "members",
    }
)
TUNABLES: dict[str, object] = {
    # planted-bug switches are never a cluster-file setting
    f.name: f.default
    for f in fields(NodeConfig)
    if f.name not in _IDENTITY and f.name != "faults"
}


@dataclass(frozen=True, slots=True)
class ClusterFile:
    """A parsed cluster file. ``base_dir`` resolves relative data dirs."""

    cluster_id: str
    members: tuple[MemberSpec, ...]
    secret: str | None = None
    settings: tuple[tuple[str, object], ...] = ()
    base_dir: str = "."
    auth: AuthSpec | None = None

    def member(self, node_id: int) -> MemberSpec:
        for m in self.members:
            if m.id == node_id:
                return m
        raise ConfigError(
            f"node {node_id} is not in the cluster file "
            f"(members: {', '.join(str(m.id) for m in self.members)})"
        )

    def data_dir(self, node_id: int) -> str:
        d = self.member(node_id).data_dir or f"node-{node_id}"
        return d if os.path.isabs(d) else os.path.normpath(os.path.join(self.base_dir, d))

    def node_config(self, node_id: int, *, secret: str | None = None) -> NodeConfig:
        """The config of member ``node_id``; ``secret`` overrides the file's."""
        m = self.member(node_id)
        members = tuple(replace(x, data_dir=self.data_dir(x.id)) for x in self.members)
        cfg = NodeConfig(
            node_id=node_id,
            cluster_id=self.cluster_id,
            raft_host=m.raft_host,
            raft_port=m.raft_port,
            http_host=m.http_host,
            http_port=m.http_port,
            data_dir=self.data_dir(node_id),
            secret=secret if secret is not None else self.secret,
            auth=self.auth,
            members=members,
        )
        cfg = replace(cfg, **dict(self.settings))  # type: ignore[arg-type]
        cfg.validate()
        return cfg


# ---------------------------------------------------------------------------
# reading


def _parse_hostport(where: str, value: object) -> tuple[str, int]:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a 'host:port' string, got {value!r}")
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ConfigError(f"{where}: expected 'host:port', got {value!r}")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port must be within 1..65535, got {port}")
    return host.strip("[]"), port


def _table(where: str, value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
    return cast(dict[str, object], value)


def _check_keys(where: str, table: Mapping[str, object], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})"
        )


def _parse_member(k: int, raw: object) -> MemberSpec:
    where = f"members[{k}]"
    t = _table(where, raw)
    _check_keys(where, t, {"id", "raft", "http", "role", "data_dir"})
    for key in ("id", "raft", "http"):
        if key not in t:
            raise ConfigError(f"{where}.{key} is missing")
    nid = t["id"]
    if not isinstance(nid, int) or isinstance(nid, bool) or nid < 1:
        raise ConfigError(f"{where}.id must be an integer >= 1, got {nid!r}")
    raft_host, raft_port = _parse_hostport(f"{where}.raft", t["raft"])
    http_host, http_port = _parse_hostport(f"{where}.http", t["http"])
    role = t.get("role", "voter")
    if role not in ("voter", "learner"):
        raise ConfigError(f"{where}.role must be 'voter' or 'learner', got {role!r}")
    data_dir = t.get("data_dir", f"node-{nid}")
    if not isinstance(data_dir, str) or not data_dir:
        raise ConfigError(f"{where}.data_dir must be a non-empty string, got {data_dir!r}")
    return MemberSpec(nid, raft_host, raft_port, http_host, http_port, role, data_dir)


def _parse_settings(raw: object) -> tuple[tuple[str, object], ...]:
    t = _table("node", raw)
    _check_keys("node", t, set(TUNABLES))
    out: list[tuple[str, object]] = []
    for key, value in sorted(t.items()):
        default = TUNABLES[key]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"node.{key} must be true or false, got {value!r}")
        elif isinstance(default, int) and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"node.{key} must be an integer, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"node.{key} must be a string, got {value!r}")
        out.append((key, value))
    return tuple(out)


def _parse_token(k: int, raw: object, base_dir: str) -> TokenSpec:
    where = f"auth.tokens[{k}]"
    t = _table(where, raw)
    _check_keys(where, t, {"name", "token", "token_file", "roles"})
    name = t.get("name", f"token-{k}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a non-empty string, got {name!r}")
    if ("token" in t) == ("token_file" in t):
        raise ConfigError(f"{where}: set exactly one of token and token_file")
    token_file = t.get("token_file", "")
    if "token_file" in t:
        if not isinstance(token_file, str) or not token_file:
            raise ConfigError(f"{where}.token_file must be a non-empty string")
        path = token_file if os.path.isabs(token_file) else os.path.join(base_dir, token_file)
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}.token_file: cannot read {path}: {exc}") from None
        token: object = lines[0].strip() if lines else ""
    else:
        token = t["token"]
    if (
        not isinstance(token, str)
        or len(token) < MIN_TOKEN_CHARS
        or not all("!" <= ch <= "~" for ch in token)
    ):
        raise ConfigError(
            f"{where}.token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
            "without spaces"
        )
    roles = t.get("roles")
    if (
        not isinstance(roles, list)
        or not roles
        or not all(isinstance(r, str) and r in AUTH_ROLES for r in roles)
    ):
        raise ConfigError(
            f"{where}.roles must be a non-empty list of {', '.join(AUTH_ROLES)}, got {roles!r}"
        )
    return TokenSpec(name, token, tuple(cast(list[AuthRole], roles)), cast(str, token_file))


def _parse_auth(raw: object, base_dir: str) -> AuthSpec:
    t = _table("auth", raw)
    _check_keys("auth", t, {"tokens", "public"})
    raw_tokens = t.get("tokens")
    if not isinstance(raw_tokens, list) or not raw_tokens:
        raise ConfigError("auth.tokens must list at least one [[auth.tokens]] table")
    tokens = tuple(_parse_token(k, x, base_dir) for k, x in enumerate(raw_tokens))
    names = [x.name for x in tokens]
    if len(set(names)) != len(names):
        raise ConfigError(f"auth.tokens: duplicate names in {sorted(names)}")
    if len({x.token for x in tokens}) != len(tokens):
        raise ConfigError("auth.tokens: two tokens have the same secret")
    public = t.get("public", list(DEFAULT_PUBLIC_PATHS))
    if not isinstance(public, list) or not all(
        isinstance(p, str) and p in DEFAULT_PUBLIC_PATHS for p in public
    ):
        raise ConfigError(
            f"auth.public must be a list drawn from {', '.join(DEFAULT_PUBLIC_PATHS)}, "
            f"got {public!r}"
        )
    return AuthSpec(tokens, tuple(cast(list[str], public)))


def parse_cluster_file(doc: Mapping[str, object], base_dir: str = ".") -> ClusterFile:
    """Validate a decoded cluster file (see the module docstring)."""
    _check_keys("cluster file", doc, {"cluster", "node", "members", "auth"})
    if "cluster" not in doc:
        raise ConfigError("[cluster] table is missing")
    cl = _table("cluster", doc["cluster"])
    _check_keys("cluster", cl, {"id", "secret"})
    cid = cl.get("id")
    if not isinstance(cid, str) or not cid:
        raise ConfigError(f"cluster.id must be a non-empty string, got {cid!r}")
    if len(cid.encode("utf-8")) > _MAX_CLUSTER_ID_BYTES:
        raise ConfigError(f"cluster.id must be at most {_MAX_CLUSTER_ID_BYTES} UTF-8 bytes")
    secret = cl.get("secret")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise ConfigError("cluster.secret must be a non-empty string when present")
    raw_members = doc.get("members")
    if not isinstance(raw_members, list) or not raw_members:
        raise ConfigError("[[members]] is missing: the cluster file must list every member")
    members = tuple(_parse_member(k, m) for k, m in enumerate(raw_members))
    seen: dict[int, int] = {}
    addrs: dict[tuple[str, int], str] = {}
    for k, m in enumerate(members):
        if m.id in seen:
            raise ConfigError(f"members[{k}].id: {m.id} is already used by members[{seen[m.id]}]")
        seen[m.id] = k
        for what, addr in (
            ("raft", (m.raft_host, m.raft_port)),
            ("http", (m.http_host, m.http_port)),
        ):
            if addr in addrs:
                raise ConfigError(
                    f"members[{k}].{what}: {addr[0]}:{addr[1]} is already used by {addrs[addr]}"
                )
            addrs[addr] = f"members[{k}].{what}"
    if not any(m.role == "voter" for m in members):
        raise ConfigError("members: at least one member must have role = 'voter'")
    settings = _parse_settings(doc["node"]) if "node" in doc else ()
    auth = _parse_auth(doc["auth"], base_dir) if "auth" in doc else None
    cf = ClusterFile(cid, members, secret, settings, base_dir, auth)
    # Catch bad tunables (e.g. election_ticks <= heartbeat_ticks) at load time.
    cf.node_config(members[0].id)
    return cf


def load_cluster_file(path: str | os.PathLike[str]) -> ClusterFile:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {p}: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cluster file {p} is not valid TOML: {exc}") from None
    try:
        return parse_cluster_file(doc, str(p.resolve().parent))
    except ConfigError as exc:
        raise ConfigError(f"cluster file {p}: {exc}") from None


# ---------------------------------------------------------------------------
# writing: a tiny TOML emitter for exactly the shapes above


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write non-finite float {v!r} to TOML")
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write a {type(v).__name__} to TOML")


def _toml_table(lines: list[str], header: str, items: Mapping[str, object]) -> None:
    lines.append(header)
    for key, value in items.items():
        lines.append(f"{key} = {toml_value(value)}")
    lines.append("")


def dump_cluster_file(cf: ClusterFile) -> str:
    lines = ["# dledger cluster file: every member, its addresses, role and data directory.", ""]
    cluster: dict[str, object] = {"id": cf.cluster_id}
    if cf.secret is not None:
        cluster["secret"] = cf.secret
    _toml_table(lines, "[cluster]", cluster)
    if cf.settings:
        _toml_table(lines, "[node]", dict(cf.settings))
    if cf.auth is not None:
        _toml_table(lines, "[auth]", {"public": list(cf.auth.public)})
        for t in cf.auth.tokens:
            secret_item: dict[str, object] = (
                {"token_file": t.token_file} if t.token_file else {"token": t.token}
            )
            _toml_table(
                lines, "[[auth.tokens]]", {"name": t.name, **secret_item, "roles": list(t.roles)}
            )
    for m in cf.members:
        _toml_table(
            lines,
            "[[members]]",
            {
                "id": m.id,
                "raft": m.raft_address,
                "http": m.http_address,
                "role": m.role,
                "data_dir": m.data_dir or f"node-{m.id}",
            },
        )
    return "\n".join(lines)


def write_cluster_file(cf: ClusterFile, path: str | os.PathLike[str]) -> None:
    """Write atomically, readable by the owner only (it may hold the secret)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(dump_cluster_file(cf))
    os.replace(tmp, p)


__all__ = [
    "AUTH_ROLES",
    "DEFAULT_PUBLIC_PATHS",
    "TUNABLES",
    "AuthRole",
    "AuthSpec",
    "ClusterFile",
    "FlushMode",
    "MemberSpec",
    "NodeConfig",
    "Role",
    "TokenSpec",
    "dump_cluster_file",
    "load_cluster_file",
    "parse_cluster_file",
    "toml_value",
    "write_cluster_file",
]
