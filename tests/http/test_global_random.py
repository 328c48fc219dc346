"""A node leaves the process-wide ``random`` state alone.

A node can share its process with other code: the in-process test servers
(tests/http/onenode.py), a broker group's agent, an application embedding
it. Code that seeds the global generator for a reproducible run, or that
checks it was not touched, as hypothesis does around every draw, must not
see it move because a node ran meanwhile. It did: LMDB's catch-up drew its
next share from ``random.random()`` about every half second, so
``test_generated.py`` failed now and then on a busy machine (hypothesis
took the moved state for a strategy using ``random``). Every draw of a
node goes to a generator of its own (``NodeEnv.rng``, the transport's,
the storage's)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from tests.http.onenode import one_node_config, serve_one_node


async def test_a_busy_node_never_moves_the_global_random_state(tmp_path: Path) -> None:
    cfg = one_node_config(tmp_path, "rnd")
    async with serve_one_node(cfg) as c:
        r = await c.post("/v1/topics", json={"name": "t", "queues": 2})
        assert r.status == 201, await r.text()

        async def commits() -> int:
            st = await (await c.get("/raft/status")).json()
            return int(st["storage"]["lmdb_commits"])

        before = await commits()
        state = random.getstate()
        # Produce until LMDB caught up from its write-ahead log at least
        # twice (about every half second): each catch-up draws the share of
        # the next one, and elections, heartbeats and the transport draw too.
        deadline = time.monotonic() + 30
        n = 0
        while await commits() < before + 2:
            assert time.monotonic() < deadline, "LMDB never caught up from its log"
            r = await c.post(
                "/v1/topics/t/messages",
                json={"messages": [{"value": f"m{n}", "encoding": "utf-8"}]},
            )
            assert r.status == 200, await r.text()
            n += 1
            await asyncio.sleep(0.01)
        assert n > 0
        assert random.getstate() == state, (
            f"the node moved the global random state while serving {n} produces"
        )
