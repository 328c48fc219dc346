"""Fixtures for the Spark tests: one local SparkSession for the whole test
session (starting the JVM is the slow part), and one live 3-node cluster
shared by the tests that only add topics; tests that break the cluster on
purpose (retention, failover) get their own or put it back. Node processes
are stopped by PID at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from dledger.cluster import LocalCluster
from pipeline.session import build_session
from tests.http.apiclient import START_TIMEOUT_S, ApiCluster


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    s = build_session(
        "local[2]",
        "dledger-tests",
        {
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            # Python workers connect back and authenticate within this (default
            # 15 s, passed to them as SPARK_AUTH_SOCKET_TIMEOUT); on a machine
            # loaded far beyond its cores that is not always enough. Workers
            # are forked by one daemon and reused (Spark's defaults, stated
            # here because every fresh Python start is the slow part). The one
            # start Spark gives a fixed 10 s, the streaming source's own
            # process, is retried by tests.spark.helpers.started.
            "spark.python.authenticate.socketTimeout": "120s",
            "spark.python.use.daemon": "true",
            "spark.python.worker.reuse": "true",
        },
    )
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


def _start(d: Path) -> ApiCluster:
    LocalCluster.create(d, voters=3, secret="spark-secret")
    c = ApiCluster(d)
    c.start_all()
    c.wait_leader(START_TIMEOUT_S)
    return c


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiCluster]:
    c = _start(tmp_path_factory.mktemp("spark-cluster") / "c")
    try:
        yield c
    finally:
        c.down(timeout_s=5)


@pytest.fixture
def cluster(shared_cluster: ApiCluster) -> Iterator[ApiCluster]:
    """The shared cluster, with every node running again after the test."""
    yield shared_cluster
    shared_cluster.start_all()
    shared_cluster.wait_leader(START_TIMEOUT_S)


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[Callable[[], ApiCluster]]:
    made: list[ApiCluster] = []

    def make() -> ApiCluster:
        c = _start(tmp_path / f"c{len(made)}")
        made.append(c)
        return c

    yield make
    for c in made:
        c.down(timeout_s=5)
