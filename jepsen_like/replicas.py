"""Replica convergence: every replica serves the same messages at the same offsets.

Theory of operation
-------------------
Once every fault is healed, each live node is asked for its status until its
applied index reaches the leader's commit index (it holds everything the
leader committed), then every queue is read from it, whole, with
``consistency=committed`` (served from that replica's own state, never
redirected). Two replicas *diverge* at ``(queue, offset)`` when both hold
that offset with different values; a replica that holds fewer offsets than
the leader is *behind*, not divergent (it was still catching up). The
checker is ``valid`` only with zero divergent offsets and no replica that
could not be read.

A replica whose data file the ``corrupt`` nemesis damaged may start (the
damage lay outside the tail it verifies at start-up) and find the damage
only when a read reaches it. It must then answer ``503 STORAGE_CORRUPTED``
and stop (exit 2, to be rebuilt), never serve around it: such a replica is
listed under ``refused_damaged_nodes`` and does not make the run invalid.
The same answer from a replica nothing damaged is a defect of ours and is
listed under ``unreadable_nodes``.

This is the check issue 20 asks of every power-loss run: after a majority
power loss in ``flush = "async"`` mode the acknowledged tail may be lost,
but the replicas must never keep different histories.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

import aiohttp

from jepsen_like.control import Cluster


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, Any]:
    try:
        async with session.get(
            url, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            return r.status, await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return 0, None


class DamageReported(Exception):
    """The replica answered ``STORAGE_CORRUPTED``: it found damage in its store."""


async def read_queue(
    session: aiohttp.ClientSession, http: str, topic: str, queue: int, timeout_s: float = 5.0
) -> list[tuple[int, str]] | None:
    """Every message of one queue as served by the node at ``http`` (committed
    reads from its own state); None when it did not answer. Raises
    :class:`DamageReported` when it refuses a read on damage in its store."""
    out: list[tuple[int, str]] = []
    offset = 0
    deadline = time.monotonic() + timeout_s * 6
    while time.monotonic() < deadline:
        status, body = await _get(
            session,
            f"http://{http}/v1/topics/{topic}/queues/{queue}/messages?offset={offset}"
            f"&max_messages=500&encoding=utf-8&consistency=committed",
            timeout_s,
        )
        if status == 416:
            return out
        if status == 503 and _code(body) == "STORAGE_CORRUPTED":
            raise DamageReported(str(body["error"].get("message", "")))
        if status != 200 or not isinstance(body, dict):
            await asyncio.sleep(0.2)
            continue
        msgs = body.get("messages") or []
        out.extend((int(m["queue_offset"]), str(m["value"])) for m in msgs)
        if not msgs or int(body.get("next_offset", 0)) >= int(body.get("max_offset", 0)):
            return out
        offset = out[-1][0] + 1
    return None


def _code(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else None


async def compare(
    cluster: Cluster,
    topic: str,
    queues: int,
    *,
    damaged: Collection[int] = (),
    timeout_s: float = 60.0,
    examples: int = 10,
) -> dict[str, Any]:
    """The ``replicas`` checker's result for the live nodes of ``cluster``;
    ``damaged``: the nodes whose data the corrupt nemesis damaged and that
    were not rebuilt since (their ``STORAGE_CORRUPTED`` answers are right)."""
    deadline = time.monotonic() + timeout_s
    target: int | None = None
    caught_up: dict[int, bool] = {}
    while time.monotonic() < deadline:
        st = await cluster.statuses()
        lead = next((s for s in st.values() if s.get("role") == "leader"), None)
        if lead is not None:
            target = int(lead.get("commit", 0))
            caught_up = {i: int(s.get("applied", 0)) >= target for i, s in st.items()}
            live = [i for i in cluster.ids if cluster.alive(i)]
            if all(caught_up.get(i, False) for i in live):
                break
        await asyncio.sleep(0.3)
    session = await cluster.session()
    views: dict[int, dict[int, list[tuple[int, str]]]] = {}
    unreadable: list[int] = []
    refused_damaged: list[int] = []
    damage_reports: dict[int, str] = {}
    for i in cluster.ids:
        if not cluster.alive(i):
            continue
        view: dict[int, list[tuple[int, str]]] = {}
        try:
            for q in range(queues):
                got = await read_queue(session, cluster.members[i].http, topic, q)
                if got is None:
                    unreadable.append(i)
                    break
                view[q] = got
            else:
                views[i] = view
        except DamageReported as exc:
            damage_reports[i] = str(exc)[:300]
            (refused_damaged if i in damaged else unreadable).append(i)
    divergent: list[dict[str, Any]] = []
    n_divergent = 0
    for q in range(queues):
        by_offset: dict[int, dict[str, list[int]]] = {}
        for i, view in views.items():
            for off, value in view[q]:
                by_offset.setdefault(off, {}).setdefault(value, []).append(i)
        for off in sorted(by_offset):
            if len(by_offset[off]) > 1:
                n_divergent += 1
                if len(divergent) < examples:
                    divergent.append({"queue": q, "offset": off, "values": by_offset[off]})
    lengths = {i: {q: len(v[q]) for q in range(queues)} for i, v in views.items()}
    verdict = "valid" if n_divergent == 0 and not unreadable and views else "invalid"
    return {
        "checker": "replicas",
        "verdict": verdict,
        "divergent_offsets": n_divergent,
        "examples": divergent,
        "messages_per_node": lengths,
        "unreadable_nodes": unreadable,
        "refused_damaged_nodes": refused_damaged,
        "damage_reports": damage_reports,
        "caught_up": caught_up,
        "leader_commit": target,
    }
