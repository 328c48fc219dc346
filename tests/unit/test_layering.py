"""dledger/ is the replication library: nothing in it imports the packages
built on top of it (broker_adapter, http_api, dledger_app, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

ABOVE = (
    "broker_adapter",
    "http_api",
    "controller",
    "dledger_app",
    "jepsen_like",
    "pipeline",
    "benchmarks",
)


def test_dledger_imports_nothing_above_it() -> None:
    root = Path(__file__).parents[2] / "dledger"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [
                f"{path.relative_to(root.parent)}: {n}" for n in names if n.split(".")[0] in ABOVE
            ]
    assert bad == []
