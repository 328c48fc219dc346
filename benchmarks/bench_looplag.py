"""Event-loop lag of a 3-voter leader under the worst requests its HTTP caps
accept (issue #13): the most messages, the most properties, the largest
inflated body, a gzip bomb (413), a body that is not gzip (400), and two
bodies the caps refuse only after a parse (200,000 messages, 200,000
properties: 422, parsed off the loop by http_api/parse_worker.py), each
sent ``repeats`` times in a row while another client produces one message
at a time.

Per kind: the leader's loop lag p99 (from the ``dledger_loop_lag_seconds``
histogram of /metrics, when the node exports it: bucket upper bound) and
max (``status()["node"]["loop_lag_ms_max"]``, a running max: a kind's figure
is the max up to the end of that kind, so the order matters and is fixed),
the other client's p99 latency, and Raft term changes (must be 0).
"""

from __future__ import annotations

import contextlib
import gzip
import re
import threading
import time
import zlib
from typing import Any

import orjson

from benchmarks.common import TOPIC, cluster
from benchmarks.registry import BenchResult, Context, Figure, benchmark
from dledger.cluster import HTTP_ERRORS, http_request
from dledger.config import NodeConfig

_BUCKET = re.compile(r'^dledger_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)


def worst_requests(cfg: NodeConfig) -> dict[str, tuple[bytes, dict[str, str], int]]:
    """kind -> (body, headers, expected status), at the node's caps."""
    cap = cfg.http_body_cap_bytes
    dump = orjson.dumps
    json_h = {"Content-Type": "application/json"}
    most_msgs = dump({"messages": [{"value": "AA=="}] * cfg.max_batch_messages})
    m = {
        "value": "AA==",
        "properties": {f"k{i:03d}": "" for i in range(cfg.max_message_properties)},
    }
    n = min(
        cfg.max_batch_messages,
        (cap - 64) // (len(dump(m)) + 1),
        max(1, cfg.max_batch_properties // max(1, cfg.max_message_properties)),
    )
    most_props = dump({"messages": [m] * n})
    value = "A" * 4000
    big = dump({"messages": [{"value": value}] * ((cap - 64) // (len(dump({"value": value})) + 1))})
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = co.compress(b"\0" * (256 << 20)) + co.flush()
    gz = {**json_h, "Content-Encoding": "gzip"}
    return {
        "most_messages": (most_msgs, json_h, 200),
        "most_properties": (most_props, json_h, 200),
        "largest_inflated": (gzip.compress(big), gz, 200),
        "gzip_bomb": (bomb, gz, 413),
        "bad_gzip": (most_msgs[:5000], gz, 400),
        # refused by the caps, but only known after a parse (done off the loop)
        "200k_messages": (dump({"messages": [{"value": "AA=="}] * 200_000}), json_h, 422),
        "200k_properties": (
            dump(
                {
                    "messages": [
                        {"value": "AA==", "properties": {str(i): "" for i in range(200_000)}}
                    ]
                }
            ),
            json_h,
            422,
        ),
    }


def _status(addr: str) -> dict[str, Any]:
    r = http_request(addr, "GET", "/raft/status", timeout_s=10)
    out: dict[str, Any] = r.json()
    return out


def _buckets(addr: str) -> dict[float, float] | None:
    r = http_request(addr, "GET", "/metrics", timeout_s=10)
    found = _BUCKET.findall(r.body.decode("utf-8", "replace"))
    if not found:
        return None
    return {float(le): float(n) for le, n in found}


def _p99_of(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the bucket holding the p99 of the new samples."""
    diff = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0.0
    if total <= 0:
        return float("nan")
    for le, n in diff:
        if n >= 0.99 * total:
            return le
    return float("inf")


class _Producer(threading.Thread):
    def __init__(self, addr: str) -> None:
        super().__init__(daemon=True)
        self.addr = addr
        self.stamps: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = orjson.dumps({"messages": [{"value": "x", "encoding": "utf-8"}]})
        while not self.halt.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(*HTTP_ERRORS):
                http_request(self.addr, "POST", f"/v1/topics/{TOPIC}/messages", body, 30)
            self.stamps.append((t0, time.monotonic() - t0))

    def p99_since(self, t: float) -> float:
        d = sorted(x for t0, x in self.stamps if t0 >= t)
        return d[min(len(d) - 1, int(len(d) * 0.99))] if d else float("nan")


@benchmark(
    "loop_lag",
    "Leader event-loop lag under the worst requests the HTTP caps accept (issue #13)",
)
def run_loop_lag(ctx: Context) -> BenchResult:
    res = BenchResult()
    repeats = 5 if ctx.quick else 20
    settings: dict[str, object] = {"map_size_bytes": 4 << 30}
    with cluster(ctx, voters=3, settings=settings) as (lc, leader):
        addr = lc.http(leader)
        cfg = lc.spec.node_config(leader)
        term0 = {n: _status(lc.http(n))["term"] for n in lc.ids()}
        producer = _Producer(addr)
        producer.start()
        raw: dict[str, Any] = {"repeats": repeats, "election_timeout_ms": cfg.election_timeout_ms}
        try:
            time.sleep(1.0)  # the producer's warm-up
            for kind, (body, headers, want) in worst_requests(cfg).items():
                ctx.log(f"loop_lag {kind}: {repeats} x {len(body)} B")
                hist0 = _buckets(addr)
                t0 = time.monotonic()
                statuses: dict[int, int] = {}
                for _ in range(repeats):
                    try:
                        r = http_request(
                            addr, "POST", f"/v1/topics/{TOPIC}/messages", body, 60, headers
                        )
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                    except HTTP_ERRORS:
                        statuses[0] = statuses.get(0, 0) + 1
                lag_max = float(_status(addr).get("node", {}).get("loop_lag_ms_max", "nan"))
                hist1 = _buckets(addr)
                p99 = (
                    _p99_of(hist0, hist1) * 1000
                    if hist0 is not None and hist1 is not None
                    else float("nan")
                )
                other = producer.p99_since(t0) * 1000
                conf = {"kind": kind, "bytes": len(body), "expected_status": want,
                        "statuses": statuses, "repeats": repeats}  # fmt: skip
                raw[kind] = {**conf, "lag_max_ms": lag_max, "lag_p99_ms": p99,
                             "other_client_p99_ms": other}  # fmt: skip
                res.figures += [
                    Figure.of(f"loop_lag.{kind}.max_ms", f"loop lag max (running), {kind}", "ms",
                              [lag_max], higher_is_better=False, config=conf),
                    Figure.of(f"loop_lag.{kind}.p99_ms", f"loop lag p99, {kind}", "ms",
                              [p99], higher_is_better=False, config=conf),
                    Figure.of(f"loop_lag.{kind}.other_client_p99_ms",
                              f"other producer p99 latency, {kind}", "ms", [other],
                              higher_is_better=False, config=conf),
                ]  # fmt: skip
        finally:
            producer.halt.set()
            producer.join(60)
        term1 = {n: _status(lc.http(n))["term"] for n in lc.ids()}
        changes = max(term1[n] - term0[n] for n in term0)
        res.figures.append(
            Figure.of("loop_lag.term_changes", "Raft term changes during the run", "terms",
                      [changes], higher_is_better=False)
        )  # fmt: skip
        raw["term_changes"] = changes
        res.raw = raw
        if all(f.median != f.median for f in res.figures if f.key.endswith(".p99_ms")):
            res.notes.append(
                "the node exports no dledger_loop_lag_seconds histogram yet: p99 is NaN"
            )
    return res
