"""A real local cluster for /v1 API tests, stopped by PID at teardown
(SIGTERM, then SIGKILL) whether the test passed or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dledger.cluster import LocalCluster
from dledger.config import AuthSpec
from tests.http.apiclient import START_TIMEOUT_S, ApiCluster


@pytest.fixture
def api_cluster(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ApiCluster]]:
    made: list[ApiCluster] = []

    def make(
        voters: int = 3,
        learners: int = 0,
        settings: dict[str, object] | None = None,
        auth: AuthSpec | None = None,
    ) -> ApiCluster:
        d = tmp_path / f"cluster{len(made)}"
        LocalCluster.create(
            d, voters=voters, learners=learners, secret="api-secret", settings=settings, auth=auth
        )
        c = ApiCluster(d)
        made.append(c)
        c.start_all()
        c.wait_leader(START_TIMEOUT_S)
        return c

    yield make
    for c in made:
        try:
            rep = getattr(request.node, "rep_call", None)
            if rep is not None and rep.failed:
                for nid in c.ids():
                    print(f"----- node {nid} log tail -----\n{c.log_tail(nid, 40)}")
        finally:
            c.down(timeout_s=5)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
