"""The ``dledger`` source over several broker groups: each queue is planned
and read from the replicas of the group that owns it; the endpoints may be
any controller or broker nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from dledger_app.groups import MultiCluster
from dledger_app.multi_cli import wait_groups_live
from http_api.client import OutMessage
from http_api.routing import RoutingClient
from pipeline.options import SourceOptions
from pipeline.source import plan_infos

pytestmark = [pytest.mark.spark, pytest.mark.integration]


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[MultiCluster]:
    mc = MultiCluster.create(tmp_path / "mc", groups=2, nodes=1, secret="spark-groups-secret")
    try:
        for lc in mc.all().values():
            lc.start_all()
        wait_groups_live(mc, 90)
        yield mc
    finally:
        for lc in mc.all().values():
            lc.down(10)


def test_batch_read_across_groups(spark: SparkSession, groups: MultiCluster) -> None:
    rc = RoutingClient(groups.endpoints())
    rc.create_topic("spread", 6)
    p = rc.producer()
    acks = []
    for k in range(60):
        acks += p.send("spread", [OutMessage(f"v{k}-{j}".encode()) for j in range(5)])
    route = rc.route("spread")
    assert {route.owners[a.queue] for a in acks} == {"g1", "g2"}
    # planning: every queue from its own group's replicas
    eps = ",".join(groups.endpoints())
    opts = SourceOptions.parse({"endpoints": eps, "topic": "spread"}, streaming=False)
    infos, owners = plan_infos(opts)
    for q in range(6):
        g = groups.group(route.owners[q])
        assert owners[("spread", q)] == tuple(m.http_address for m in g.spec.members)
        assert infos[("spread", q)].max_offset == sum(1 for a in acks if a.queue == q)
    # reading through a broker node of g2 only as the endpoint
    g2_only = groups.group("g2").http(1)
    df = spark.read.format("dledger").option("endpoints", g2_only).option("topic", "spread").load()
    rows = df.collect()
    assert len(rows) == len(acks)
    got = {(r.queue, r.queue_offset): r.value for r in rows}
    assert len(got) == len(rows)
    want = {}
    for a, k in zip(acks, range(len(acks)), strict=True):
        want[(a.queue, a.queue_offset)] = f"v{k // 5}-{k % 5}".encode()
    assert got == want
