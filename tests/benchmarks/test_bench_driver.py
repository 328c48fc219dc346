"""dledger.bench (the in-leader load driver behind POST /raft/bench): a
leader that refuses proposals mid-run ends the run with the refusals
counted, instead of recursing once per remaining proposal."""

from __future__ import annotations

import asyncio

from dledger import bench
from dledger.errors import NotLeader


class _LosesLeadership:
    """Accepts ``accept`` proposals (completing them at once), then refuses."""

    def __init__(self, accept: int) -> None:
        self.accept = accept
        self.submitted = 0

    def submit(self, data: bytes) -> asyncio.Future[object]:
        if self.submitted >= self.accept:
            raise NotLeader(2)
        self.submitted += 1
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def test_refusal_after_lost_leadership_counts_the_rest() -> None:
    n = 20_000  # far past the interpreter's recursion limit
    out = await bench.pipelined(_LosesLeadership(accept=10), n, 100, window=n)
    assert out["ops"] == 10
    assert out["errors"] == {"NotLeader": n - 10}


async def test_refused_from_the_start() -> None:
    out = await bench.pipelined(_LosesLeadership(accept=0), 500, 100, window=50)
    assert out["ops"] == 0
    assert out["errors"] == {"NotLeader": 500}
