"""The HTTP caps and timeouts of the cluster file (issue #13): documented
defaults, validated values, and the cluster file's [node] table takes them."""

from __future__ import annotations

import dataclasses

import pytest

from dledger.config import TUNABLES, NodeConfig, parse_cluster_file
from dledger.errors import ConfigError

BASE = NodeConfig(
    node_id=1,
    cluster_id="c",
    raft_host="127.0.0.1",
    raft_port=7001,
    http_host="127.0.0.1",
    http_port=8001,
    data_dir="d",
)

DEFAULTS = {
    "http_max_body_bytes": 0,
    "max_batch_messages": 4096,
    "max_message_properties": 64,
    "max_batch_properties": 16384,
    "http_header_timeout_ms": 10_000,
    "http_body_timeout_ms": 30_000,
    "http_idle_timeout_ms": 30_000,
    "http_max_connections": 1024,
}


def test_defaults_are_the_documented_ones() -> None:
    import dledger.config as config_module

    doc = config_module.__doc__ or ""
    for name, value in DEFAULTS.items():
        assert TUNABLES[name] == value
        assert f"{name} = {value}" in doc, name
    BASE.validate()
    assert BASE.http_body_cap_bytes == BASE.max_entry_bytes + (64 << 10)
    assert dataclasses.replace(BASE, http_max_body_bytes=4096).http_body_cap_bytes == 4096


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("http_max_body_bytes", 100),
        ("http_max_body_bytes", -1),
        ("max_batch_messages", 0),
        ("max_message_properties", -1),
        ("max_batch_properties", -1),
        ("http_header_timeout_ms", 99),
        ("http_body_timeout_ms", 0),
        ("http_idle_timeout_ms", 3_600_001),
        ("http_max_connections", 0),
    ],
)
def test_bad_values_are_refused_naming_the_field(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(BASE, **{field: value}).validate()


def test_the_cluster_file_sets_them() -> None:
    doc = {
        "cluster": {"id": "c"},
        "node": {"max_batch_messages": 100, "http_header_timeout_ms": 2000},
        "members": [{"id": 1, "raft": "127.0.0.1:7001", "http": "127.0.0.1:8001"}],
    }
    cfg = parse_cluster_file(doc).node_config(1)
    assert cfg.max_batch_messages == 100 and cfg.http_header_timeout_ms == 2000
    doc["node"] = {"http_max_connections": 0}
    with pytest.raises(ConfigError, match="http_max_connections"):
        parse_cluster_file(doc)
