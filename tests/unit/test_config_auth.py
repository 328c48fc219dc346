"""The [auth] table of the cluster file: tokens inline or in files, roles,
public paths; every mistake is a ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dledger.config import (
    DEFAULT_PUBLIC_PATHS,
    dump_cluster_file,
    load_cluster_file,
    parse_cluster_file,
)
from dledger.errors import ConfigError

TOKEN = "p" * 24


def doc(auth: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "cluster": {"id": "c"},
        "members": [{"id": 1, "raft": "127.0.0.1:7001", "http": "127.0.0.1:8001"}],
    }
    if auth is not None:
        d["auth"] = auth
    return d


def test_no_auth_table_means_open() -> None:
    cf = parse_cluster_file(doc(None))
    assert cf.auth is None and cf.node_config(1).auth is None


def test_tokens_inline_and_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("f" * 20 + "\nignored second line\n")
    cf = parse_cluster_file(
        doc(
            {
                "tokens": [
                    {"name": "prod", "token": TOKEN, "roles": ["produce"]},
                    {"name": "ops", "token_file": "tok", "roles": ["admin", "consume"]},
                ]
            }
        ),
        str(tmp_path),
    )
    assert cf.auth is not None
    assert [t.token for t in cf.auth.tokens] == [TOKEN, "f" * 20]
    assert cf.auth.tokens[1].roles == ("admin", "consume")
    assert cf.auth.public == DEFAULT_PUBLIC_PATHS
    assert cf.auth.token_with("admin") == "f" * 20
    assert cf.auth.token_with("produce") == TOKEN  # the first token that may produce
    assert cf.node_config(1).auth == cf.auth
    assert TOKEN not in repr(cf.auth) and "f" * 20 not in repr(cf.node_config(1))


def test_round_trip_through_the_toml_writer(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("g" * 16)
    cf = parse_cluster_file(
        doc(
            {
                "public": ["/healthz"],
                "tokens": [
                    {"name": "a", "token": TOKEN, "roles": ["produce", "consume"]},
                    {"name": "b", "token_file": "tok", "roles": ["admin"]},
                ],
            }
        ),
        str(tmp_path),
    )
    text = dump_cluster_file(cf)
    assert "g" * 16 not in text  # a token file stays a file reference
    (tmp_path / "cluster.toml").write_text(text)
    again = load_cluster_file(tmp_path / "cluster.toml")
    assert again.auth == cf.auth


@pytest.mark.parametrize(
    ("auth", "where"),
    [
        ({"tokens": []}, "auth.tokens"),
        ({"tokens": [{"token": "short", "roles": ["admin"]}]}, "auth.tokens[0].token"),
        ({"tokens": [{"token": "x" * 15 + " ", "roles": ["admin"]}]}, "auth.tokens[0].token"),
        ({"tokens": [{"token": TOKEN, "roles": ["write"]}]}, "auth.tokens[0].roles"),
        ({"tokens": [{"token": TOKEN, "roles": []}]}, "auth.tokens[0].roles"),
        ({"tokens": [{"token": TOKEN}]}, "auth.tokens[0].roles"),
        (
            {"tokens": [{"token": TOKEN, "token_file": "f", "roles": ["admin"]}]},
            "auth.tokens[0]: set exactly one",
        ),
        ({"tokens": [{"token_file": "missing", "roles": ["admin"]}]}, "auth.tokens[0].token_file"),
        (
            {
                "tokens": [
                    {"name": "a", "token": TOKEN, "roles": ["admin"]},
                    {"name": "a", "token": "q" * 20, "roles": ["admin"]},
                ]
            },
            "duplicate names",
        ),
        (
            {
                "tokens": [
                    {"name": "a", "token": TOKEN, "roles": ["admin"]},
                    {"name": "b", "token": TOKEN, "roles": ["produce"]},
                ]
            },
            "same secret",
        ),
        (
            {"public": ["/v1/topics"], "tokens": [{"token": TOKEN, "roles": ["admin"]}]},
            "auth.public",
        ),
        ({"tokens": [{"token": TOKEN, "roles": ["admin"], "extra": 1}]}, "unknown key"),
        ({"token": TOKEN}, "auth: unknown key"),
    ],
)
def test_mistakes_name_the_field(tmp_path: Path, auth: Any, where: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_cluster_file(doc(auth), str(tmp_path))
    assert where in str(ei.value)
    assert TOKEN not in str(ei.value)
