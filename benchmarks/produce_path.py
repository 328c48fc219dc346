"""Per-message CPU cost of the produce path, stage by stage, in one process
(no network, no Raft, no disk): what the leader (and, for apply, every
replica) spends per message of a batched HTTP produce.

    .venv/bin/python -m benchmarks.produce_path [--requests N] [--batch B]
        [--body BYTES] [--repeats R] [--shape utf8,base64,rich]

Stages, each timed over the same ``N`` requests of ``B`` messages:

* ``parse``: the request body's JSON (``orjson.loads``) to the encoder's
  message rows, through the HTTP layer's own parser (``parse_messages``).
* ``encode``: the rows to one produce entry (``codec.encode_produce_rows``,
  what the produce handler calls).
* ``apply``: one replica applying the entries (``BrokerState.apply``);
  records in memory by default, or ``--bodies lmdb`` as on a node (its
  batched commits land inside the timed loop, as they do on a node).
* ``respond``: the apply result to the response bytes (``produce_json`` then
  ``orjson.dumps``, as ``json_response`` does).

Every stage is repeated ``R`` times; the report gives the min (the figure
to compare: the machine is shared, and noise only ever adds time) and the
median, in microseconds per message. Shapes: ``utf8`` is what the HTTP
benchmark sends (``{"value": ..., "encoding": "utf-8"}``), ``base64`` the
default encoding, ``rich`` adds a tag, a key, a property and a born time.
"""

from __future__ import annotations

import argparse
import base64
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from broker_adapter import BrokerState, CommandKind, encode_topic
from broker_adapter.bodies import Bodies, LmdbBodies, MemoryBodies
from broker_adapter.codec import MessageRow, encode_produce_rows
from broker_adapter.state import ProduceResult
from dledger.core.types import Entry
from http_api.app import parse_messages, produce_json

TOPIC = "bench"
STAGES = ("parse", "encode", "apply", "respond")
A = TypeVar("A")
T = TypeVar("T")


def request_bodies(n: int, batch: int, size: int, shape: str) -> list[bytes]:
    out = []
    for r in range(n):
        msgs: list[dict[str, Any]] = []
        for i in range(batch):
            v = (f"{r:06d}{i:06d}" + "m" * size)[:size]
            if shape == "utf8":
                m: dict[str, Any] = {"value": v, "encoding": "utf-8"}
            elif shape == "base64":
                m = {"value": base64.b64encode(v.encode()).decode()}
            elif shape == "rich":
                m = {
                    "value": base64.b64encode(v.encode()).decode(),
                    "tags": "t",
                    "keys": [f"k{i}"],
                    "properties": {"a": "b"},
                    "born_ts_ms": 1_700_000_000_000 + i,
                }
            else:
                raise SystemExit(f"unknown shape {shape!r}")
            msgs.append(m)
        out.append(orjson.dumps({"messages": msgs}))
    return out


def _timed(fn: Callable[[A], T], arg: A) -> tuple[float, T]:
    """(microseconds, result) of ``fn(arg)``, after a full collection so no
    garbage of the previous stage is collected on this one's time."""
    gc.collect()
    t0 = time.perf_counter_ns()
    out = fn(arg)
    return (time.perf_counter_ns() - t0) / 1000, out


def _parse(raws: list[bytes]) -> list[list[MessageRow]]:
    return [parse_messages(orjson.loads(raw)["messages"]) for raw in raws]


def _encode(batches: list[list[MessageRow]]) -> list[bytes]:
    return [encode_produce_rows(TOPIC, ms, 1_000 + k) for k, ms in enumerate(batches)]


def _apply(job: tuple[BrokerState, list[Entry]]) -> list[object]:
    st, entries = job
    return [st.apply(e) for e in entries]


def _respond(results: list[ProduceResult]) -> list[bytes]:
    return [orjson.dumps(produce_json(r)) for r in results]


def run_shape(
    n: int, batch: int, size: int, repeats: int, shape: str, bodies: str = "memory"
) -> dict[str, tuple[float, float]]:
    raws = request_bodies(n, batch, size, shape)
    total = n * batch
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    for _ in range(repeats):
        us, batches = _timed(_parse, raws)
        times["parse"].append(us / total)

        us, datas = _timed(_encode, batches)
        times["encode"].append(us / total)

        tmp = tempfile.TemporaryDirectory(prefix="produce-path-")
        store: Bodies = (
            MemoryBodies() if bodies == "memory" else LmdbBodies(os.path.join(tmp.name, "b"))
        )
        st = BrokerState("bench", store)
        first = Entry(1, 1, data=encode_topic(CommandKind.CREATE_TOPIC, TOPIC, 1, 8))
        st.apply(first)
        entries = []
        pos = first.end_pos
        for k, d in enumerate(datas):
            e = Entry(k + 2, 1, data=d, pos=pos)
            entries.append(e)
            pos = e.end_pos
        us, applied = _timed(_apply, (st, entries))
        times["apply"].append(us / total)
        store.close()
        tmp.cleanup()
        results = [r for r in applied if isinstance(r, ProduceResult)]
        assert len(results) == len(entries), applied[:1]

        us, _ = _timed(_respond, results)
        times["respond"].append(us / total)
    return {s: (min(v), statistics.median(v)) for s, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--body", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shape", default="utf8,base64,rich")
    ap.add_argument(
        "--bodies",
        choices=("memory", "lmdb"),
        default="memory",
        help="where apply stores records: a dict, or LMDB (as on a node; no fsync)",
    )
    a = ap.parse_args()
    print(
        f"{a.requests} requests x {a.batch} messages x {a.body} B, {a.repeats} repeats, "
        f"records in {a.bodies}; "
        "us per message, min / median"
    )
    for shape in a.shape.split(","):
        res = run_shape(a.requests, a.batch, a.body, a.repeats, shape, a.bodies)
        cells = "  ".join(f"{s} {res[s][0]:6.2f} / {res[s][1]:6.2f}" for s in STAGES)
        tot_min = sum(res[s][0] for s in STAGES)
        tot_med = sum(res[s][1] for s in STAGES)
        print(f"{shape:7s} {cells}  total {tot_min:6.2f} / {tot_med:6.2f}")


if __name__ == "__main__":
    main()
