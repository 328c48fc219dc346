"""Fixtures for integration tests: real node processes on 127.0.0.1.

Every cluster a test makes is stopped by PID in the fixture's finalizer
(SIGTERM, then SIGKILL), whether the test passed or not. When a test fails,
the tail of each node's log is printed with the report.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request

# Generous: the machine is shared and every node is a Python process.
START_TIMEOUT_S = 60.0
CONVERGE_TIMEOUT_S = 60.0


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@dataclass(frozen=True)
class Outcome:
    """A client's view of one proposal: ``ok`` (acknowledged: it must
    survive), ``fail`` (certainly not applied) or ``unknown`` (may or may not)."""

    kind: str
    index: int = 0
    term: int = 0
    status: int = 0
    detail: str = ""
    node: int = 0
    done_at: float = 0.0


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


class TestCluster(LocalCluster):
    """LocalCluster plus a small client for tests (thread-safe)."""

    __test__ = False  # not a test class for pytest
    wait_for = staticmethod(wait_for)

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.leader_hint: int | None = None
        self._lock = threading.Lock()

    def _node_of(self, address: str) -> int:
        for m in self.spec.members:
            if m.http_address == address:
                return m.id
        return 0

    def propose(self, data: bytes, timeout_s: float = 5.0, via: int | None = None) -> Outcome:
        """POST /raft/propose to ``via`` (default: the last known leader),
        following one redirect to the leader."""
        nid = via or self.leader_hint or self.ids()[0]
        address = self.http(nid)
        path = f"/raft/propose?timeout_ms={int(timeout_s * 1000)}"
        for _ in range(3):
            node = self._node_of(address)
            try:
                r = http_request(address, "POST", path, data, timeout_s=timeout_s + 5)
            except ConnectionRefusedError as exc:
                return Outcome("fail", detail=repr(exc), node=node, done_at=time.monotonic())
            except HTTP_ERRORS as exc:
                # The request may have reached the node: outcome unknown.
                return Outcome("unknown", detail=repr(exc), node=node, done_at=time.monotonic())
            if r.status == 200:
                j = r.json()
                if via is None:
                    self.leader_hint = node
                return Outcome(
                    "ok", j["index"], j["term"], 200, node=node, done_at=time.monotonic()
                )
            if r.status == 307:
                address = urllib.parse.urlsplit(r.headers["location"]).netloc
                continue
            kind = "unknown" if r.status == 504 else "fail"
            return Outcome(
                kind,
                status=r.status,
                detail=r.body.decode(errors="replace"),
                node=node,
                done_at=time.monotonic(),
            )
        return Outcome("fail", detail="redirect loop", done_at=time.monotonic())

    def refresh_leader(self, among: list[int] | None = None) -> int | None:
        lead = self.leader(among)
        if lead is not None:
            self.leader_hint = lead
        return lead

    def wait_leader(
        self, timeout_s: float = START_TIMEOUT_S, among: Any = None, poll_s: float = 0.1
    ) -> int:
        lead = super().wait_leader(timeout_s, among, poll_s)
        self.leader_hint = lead
        return lead

    def propose_ok(self, data: bytes, attempts_timeout_s: float = 30.0) -> Outcome:
        """Propose until acknowledged (retrying only definite failures)."""
        deadline = time.monotonic() + attempts_timeout_s
        while True:
            out = self.propose(data)
            if out.kind == "ok":
                return out
            if out.kind == "unknown" or time.monotonic() > deadline:
                raise AssertionError(f"proposal not acknowledged: {out}")
            time.sleep(0.1)
            self.refresh_leader()

    def records(self, node_id: int) -> list[tuple[int, int, int]] | None:
        """Every (index, term, crc) the node applied, None if it does not answer."""
        out: list[tuple[int, int, int]] = []
        start = 1
        while True:
            try:
                r = http_request(
                    self.http(node_id),
                    "GET",
                    f"/raft/applied?from={start}&max=10000",
                    timeout_s=5,
                )
            except HTTP_ERRORS:
                return None
            if r.status != 200:
                return None
            j = r.json()
            out.extend((i, t, c) for i, t, c in j["records"])
            if j["next"] is None:
                return out
            start = j["next"]

    def wait_converged(
        self, ids: list[int], min_index: int, timeout_s: float = CONVERGE_TIMEOUT_S
    ) -> list[tuple[int, int, int]]:
        """Wait until every node in ``ids`` applied at least ``min_index`` and
        all applied exactly the same records; returns them."""

        def check() -> list[tuple[int, int, int]] | None:
            recs = [self.records(n) for n in ids]
            if any(r is None or not r or r[-1][0] < min_index for r in recs):
                return None
            first = recs[0]
            assert first is not None
            n = min(len(r) for r in recs if r is not None)
            for nid, r in zip(ids, recs, strict=True):
                assert r is not None
                # Same order everywhere: a shorter log is a prefix of a longer one.
                assert r[:n] == first[:n], f"node {nid} applied a different log than {ids[0]}"
            if all(r == first for r in recs):
                return first
            return None

        result: list[tuple[int, int, int]] = wait_for(
            check, timeout_s, f"nodes {ids} to apply >= {min_index} identically", poll_s=0.2
        )
        return result


@pytest.fixture
def make_cluster(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., TestCluster]]:
    """``make_cluster(voters=3, learners=0, secret=..., settings=...)`` ->
    a running cluster with a leader; every node is stopped at teardown."""
    made: list[TestCluster] = []

    def make(
        voters: int = 3,
        learners: int = 0,
        secret: str | None = "integration-secret",
        start: bool = True,
        name: str | None = None,
        settings: dict[str, object] | None = None,
    ) -> TestCluster:
        d = tmp_path / (name or f"cluster{len(made)}")
        LocalCluster.create(d, voters=voters, learners=learners, secret=secret, settings=settings)
        c = TestCluster(d)
        made.append(c)
        if start:
            c.start_all()
            c.wait_leader(START_TIMEOUT_S)
        return c

    def attach(directory: Path) -> TestCluster:
        """A tracked TestCluster for a cluster file a test wrote itself."""
        c = TestCluster(directory)
        made.append(c)
        return c

    make.attach = attach  # type: ignore[attr-defined]
    yield make

    rep = getattr(request.node, "rep_call", None)
    failed = rep is not None and rep.failed
    for c in made:
        try:
            if failed:
                for nid in c.ids():
                    print(f"----- {c.dir.name} node {nid} log tail -----\n{c.log_tail(nid, 40)}")
        finally:
            c.down(timeout_s=5)
