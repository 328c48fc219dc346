"""dledger.core is pure: no I/O, no clocks, no threads, no hidden randomness.

Checked statically (``ast``) on every module of the package, and dynamically
(importing the core in a fresh interpreter must not load an I/O module).
The one use of ``random`` allowed is the ``random.Random`` type of the
injected generator: no call of a module-level random function and no
``random.Random(...)`` constructed inside the core.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dledger.core.raft

CORE_DIR = Path(dledger.core.raft.__file__).parent
MODULES = sorted(CORE_DIR.glob("*.py"))

FORBIDDEN = {
    "asyncio",
    "time",
    "socket",
    "lmdb",
    "aiohttp",
    "threading",
    "selectors",
    # the same spirit: no processes, signals, files, wall clocks or pickle
    "os",
    "subprocess",
    "multiprocessing",
    "concurrent",
    "signal",
    "datetime",
    "pickle",
    "shutil",
    "tempfile",
}
# dledger modules the core may depend on
ALLOWED_INTERNAL = ("dledger.core", "dledger.errors", "dledger.storage.base")
FORBIDDEN_BUILTIN_CALLS = {"open", "print", "input", "exec", "eval", "__import__", "breakpoint"}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    out: list[tuple[str, list[str], int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append(
                    (
                        "dledger.core." + (node.module or ""),
                        [a.name for a in node.names],
                        node.lineno,
                    )
                )
            else:
                out.append((node.module or "", [a.name for a in node.names], node.lineno))
    return out


def test_core_has_modules() -> None:
    names = {p.name for p in MODULES}
    assert {"raft.py", "log.py", "progress.py", "codec.py", "types.py"} <= names


def import_violations(tree: ast.Module, name: str) -> list[str]:
    bad = []
    for mod, _, line in _imports(tree):
        top = mod.split(".")[0]
        if top in FORBIDDEN:
            bad.append(f"{name}:{line}: import {mod}")
        if top == "dledger" and not mod.startswith(ALLOWED_INTERNAL):
            bad.append(f"{name}:{line}: core depends on {mod}")
    return bad


def random_violations(tree: ast.Module, name: str) -> list[str]:
    bad = []
    for mod, names, line in _imports(tree):
        if mod == "random" and any(n != "Random" for n in names):
            bad.append(f"{name}:{line}: from random import {names}")
    for node in ast.walk(tree):
        # random.random(), random.randrange(...), random.choice, random.seed, ...
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
            and node.attr != "Random"
        ):
            bad.append(f"{name}:{node.lineno}: random.{node.attr}")
        # and no generator of its own: random.Random(...) / Random(...) calls
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in {"Random", "SystemRandom"}) or (
                isinstance(f, ast.Name) and f.id in {"Random", "SystemRandom"}
            ):
                bad.append(f"{name}:{node.lineno}: constructs its own random generator")
    return bad


def builtin_violations(tree: ast.Module, name: str) -> list[str]:
    return [
        f"{name}:{node.lineno}: {node.func.id}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in FORBIDDEN_BUILTIN_CALLS
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_imports_no_io_module(path: Path) -> None:
    bad = import_violations(_parse(path), path.name)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_uses_random_only_as_the_injected_type(path: Path) -> None:
    bad = random_violations(_parse(path), path.name)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_calls_no_io_builtin(path: Path) -> None:
    bad = builtin_violations(_parse(path), path.name)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, check",
    [
        ("import asyncio", import_violations),
        ("import time as t", import_violations),
        ("from socket import socket", import_violations),
        ("import threading", import_violations),
        ("from selectors import DefaultSelector", import_violations),
        ("import lmdb", import_violations),
        ("from aiohttp import web", import_violations),
        ("from dledger.storage.lmdb_store import LmdbStore", import_violations),
        ("from dledger.transport import tcp", import_violations),
        ("def f():\n    import os\n", import_violations),
        ("import random\nx = random.random()", random_violations),
        ("import random\nx = random.randrange(3)", random_violations),
        ("import random\nrandom.shuffle([])", random_violations),
        ("import random\nrandom.seed(1)", random_violations),
        ("from random import choice", random_violations),
        ("import random\nr = random.Random(1)", random_violations),
        ("from random import Random\nr = Random()", random_violations),
        ("open('x')", builtin_violations),
        ("print(1)", builtin_violations),
    ],
)
def test_purity_checker_catches(source: str, check: object) -> None:
    """The checks above are not vacuous: each catches a typical violation."""
    assert callable(check)
    assert check(ast.parse(source), "snippet")


def test_purity_checker_allows_the_injected_random_type() -> None:
    src = "import random\ndef f(rng: random.Random) -> int:\n    return rng.randrange(3)\n"
    assert random_violations(ast.parse(src), "snippet") == []


def test_raft_takes_its_randomness_injected() -> None:
    """RawNode gets a random.Random; with the same seed two nodes behave the
    same (the only randomness is the election timeout)."""
    from tests.unit.raft_harness import new_node, read_messages

    def first_campaign_tick(seed: int) -> int:
        r = new_node(1, seed=seed)
        for t in range(1, 100):
            r.tick()
            if read_messages(r):
                return t
        raise AssertionError("never campaigned")

    for seed in range(5):
        assert first_campaign_tick(seed) == first_campaign_tick(seed)


def test_importing_the_core_loads_no_io_module() -> None:
    """Transitively too (e.g. a package __init__ that pulls in LMDB or the
    transport would make the core impure); checked in a fresh interpreter."""
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import dledger.core.raft, dledger.core.log, dledger.core.progress\n"
        "import dledger.core.codec, dledger.core.types\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = json.loads(out.stdout)
    bad = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert not bad, f"importing dledger.core loads {bad}"
