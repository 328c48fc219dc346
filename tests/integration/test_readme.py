"""README.md's shell and Spark snippets, run as a reader would paste them,
against the live cluster the first one starts, so the README cannot drift
from the code.

The snippets the README marks with ``<!-- readme-test: NAME -->`` run in a
scratch directory that has ``.venv`` (a link to this interpreter's
environment) and nothing else, so ``run/cluster`` is theirs; this checkout's
code is imported (``PYTHONPATH``). Every node is stopped by PID at the end
(``dledger cluster down``, then by the PIDs the cluster recorded). The curl
snippet needs curl, the Spark one pyspark and Java: each is skipped, saying
why, without them."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dledger.cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)```", re.S)


def snippets() -> dict[str, tuple[str, str]]:
    """name -> (language, code) of every marked snippet."""
    return {m[1]: (m[2], m[3]) for m in MARK.finditer(README.read_text(encoding="utf-8"))}


def test_the_readme_starts_with_the_two_commands_then_its_title() -> None:
    text = README.read_text(encoding="utf-8")
    block, _, rest = text.partition("```\n\n")
    lines = block.splitlines()
    assert lines[0] == "```bash" and len(lines) == 3, lines
    assert lines[1].startswith("bash scripts/demo.sh ")
    assert lines[2].startswith("bash scripts/test.sh ")
    assert rest.startswith("# DLedger-py\n")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in ci  # CI runs the README's test command
    assert set(snippets()) == {"cli", "curl", "spark"}
    # every link in it points into the repository
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert not re.match(r"\w+://|\.\./|/", target), target
        assert (REPO / target.split("#")[0]).exists(), target
    for _lang, code in snippets().values():
        assert "sudo" not in code


@dataclass
class Scratch:
    cwd: Path
    env: dict[str, str]

    def run(self, argv: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def bash(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(["bash", "-euo", "pipefail", "-c", code])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scratch]:
    d = tmp_path_factory.mktemp("readme")
    (d / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    if not (d / ".venv" / "bin" / "dledger").exists():
        pytest.skip(f"no dledger command next to {sys.executable} (not a set-up .venv)")
    env = {k: v for k, v in os.environ.items() if k not in ("DLEDGER_ENDPOINTS", "DLEDGER_TOKEN")}
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    s = Scratch(d, env)
    try:
        yield s
    finally:
        s.run([".venv/bin/dledger", "cluster", "down"], timeout_s=60)
        if (d / "run" / "cluster" / "cluster.toml").exists():
            LocalCluster(d / "run" / "cluster").down(timeout_s=5)  # by PID, if any is left


@pytest.fixture(scope="module")
def cli_run(scratch: Scratch) -> subprocess.CompletedProcess[str]:
    """The CLI snippet, which also starts the cluster the others use."""
    return scratch.bash(snippets()["cli"][1])


def test_cli_snippet(cli_run: subprocess.CompletedProcess[str]) -> None:
    r = cli_run
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "created topic orders with 4 queue(s)" in r.stdout
    assert "produced 2 message(s) to orders" in r.stdout
    assert "consumed 2 message(s) from orders as group billing" in r.stderr
    assert "topic orders: 4 queue(s), 2 message(s)" in r.stdout
    consumed = [ln.split() for ln in r.stdout.splitlines() if ln.endswith(("hello", "world"))]
    assert len(consumed) == 4  # two produced, two consumed, on the key's one queue
    assert len({row[0] for row in consumed}) == 1


@pytest.fixture(scope="module")
def curl_run(
    scratch: Scratch, cli_run: subprocess.CompletedProcess[str]
) -> subprocess.CompletedProcess[str] | None:
    """The curl snippet (None without curl)."""
    if shutil.which("curl") is None:
        return None
    assert cli_run.returncode == 0, cli_run.stderr
    return scratch.bash(snippets()["curl"][1])


def test_curl_snippet(curl_run: subprocess.CompletedProcess[str] | None) -> None:
    if curl_run is None:
        pytest.skip("curl is not installed")
    r = curl_run
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = r.stdout.replace(" ", "")
    assert '"name":"payments"' in out
    assert '"queue":1' in out  # customer-1's queue, as the README says
    assert '"value":"paid"' in out
    assert '"keys":["customer-1"]' in out


@pytest.mark.spark
def test_spark_snippet(
    scratch: Scratch,
    cli_run: subprocess.CompletedProcess[str],
    curl_run: subprocess.CompletedProcess[str] | None,
) -> None:
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip("pyspark is not installed (DLEDGER_EXTRAS=dev,spark bash scripts/setup.sh)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java 17")
    assert cli_run.returncode == 0, cli_run.stderr
    (scratch.cwd / "read.py").write_text(snippets()["spark"][1], encoding="utf-8")
    r = scratch.run([".venv/bin/python", "read.py"], timeout_s=400)
    if curl_run is None:  # no payments topic: the snippet subscribes to it
        assert r.returncode != 0
        return
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-4000:]}"
    rows = [ln.split("|") for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in rows[0][1:-1]] == ["topic", "queue", "queue_offset", "key", "value"]
    got = sorted((c[1].strip(), c[4].strip(), c[5].strip()) for c in rows[1:])
    # the key given to `produce --key` and to `keys` over HTTP is the key column
    assert got == [
        ("orders", "customer-1", "hello"),
        ("orders", "customer-1", "world"),
        ("payments", "customer-1", "paid"),
    ], r.stdout
