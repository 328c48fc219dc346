"""NodeConfig's snapshot settings: validated, passed to the core, settable
from a cluster file."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dledger.config import TUNABLES, NodeConfig
from dledger.errors import ConfigError


def cfg() -> NodeConfig:
    return NodeConfig(
        node_id=1,
        cluster_id="c",
        raft_host="127.0.0.1",
        raft_port=7001,
        http_host="127.0.0.1",
        http_port=8001,
        data_dir="/tmp/unused",
    )


def test_defaults_and_raft_config() -> None:
    c = cfg()
    c.validate()
    assert c.snapshot_every_entries == 50_000
    assert replace(c, snapshot_trailing_entries=7).raft_config().snapshot_trailing_entries == 7
    assert "snapshot_every_entries" in TUNABLES and "snapshot_trailing_entries" in TUNABLES


@pytest.mark.parametrize(
    ("field", "value"), [("snapshot_every_entries", -1), ("snapshot_trailing_entries", -1)]
)
def test_negative_values_are_refused(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(cfg(), **{field: value}).validate()


def test_zero_disables_snapshots() -> None:
    replace(cfg(), snapshot_every_entries=0, snapshot_trailing_entries=0).validate()


def test_stream_settings_defaults_and_tunables() -> None:
    c = cfg()
    assert c.snapshot_chunk_bytes == 1 << 20 and c.snapshot_window_chunks == 4
    assert c.snapshot_max_bytes == 8 << 30
    for name in (
        "snapshot_chunk_bytes",
        "snapshot_window_chunks",
        "snapshot_stream_timeout_ms",
        "snapshot_max_bytes",
    ):
        assert name in TUNABLES
    replace(c, snapshot_chunk_bytes=64 << 10, snapshot_window_chunks=8).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("snapshot_chunk_bytes", 1023),
        ("snapshot_chunk_bytes", (16 << 20) + 1),
        ("snapshot_window_chunks", 0),
        ("snapshot_window_chunks", 65),
        ("snapshot_stream_timeout_ms", 99),
        ("snapshot_max_bytes", 1000),
    ],
)
def test_stream_settings_are_validated(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(cfg(), **{field: value}).validate()


def test_stream_window_must_fit_the_transport_queue() -> None:
    with pytest.raises(ConfigError, match="snapshot_window_chunks"):
        replace(cfg(), snapshot_chunk_bytes=16 << 20, snapshot_window_chunks=4).validate()


def test_idle_heartbeat_ticks_auto_explicit_and_refused() -> None:
    """-1 (the default) is 2/3 of the election timeout, never below the
    heartbeat interval, so lowering election_ticks alone never makes a
    configuration invalid; an explicit value is passed as is, and checked."""
    c = cfg()
    assert c.idle_heartbeat_ticks == -1 and "idle_heartbeat_ticks" in TUNABLES
    assert c.raft_config().idle_heartbeat_ticks == 10  # 200 ms of 20 ms ticks
    small = replace(c, election_ticks=6, heartbeat_ticks=3)
    small.validate()
    assert small.raft_config().idle_heartbeat_ticks == 4  # 2/3 of 6
    assert replace(c, idle_heartbeat_ticks=0).raft_config().idle_heartbeat_ticks == 0
    assert replace(c, idle_heartbeat_ticks=12).raft_config().idle_heartbeat_ticks == 12
    for bad in (-2, 4, 15):
        with pytest.raises(ConfigError, match="idle_heartbeat_ticks"):
            replace(c, idle_heartbeat_ticks=bad).validate()
