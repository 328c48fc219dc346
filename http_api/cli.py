"""The client half of the ``dledger`` command: produce, consume and topics
over the /v1 API (with :class:`http_api.client.Client`)::

    dledger produce TOPIC [--file F | VALUE...] [--key K | --queue Q] [--tag T]
    dledger consume TOPIC --group G [--from earliest|latest] [--max N] [--follow]
    dledger topics list | create NAME [--queues N] | describe NAME | delete NAME

Every command takes ``--endpoints host:port,...`` (default:
``$DLEDGER_ENDPOINTS``, else the HTTP addresses in the local cluster's
file, ``run/cluster/cluster.toml``) and ``--token`` (default:
``$DLEDGER_TOKEN``). Output is one line per message or topic, in columns.
Exit codes: 0 ok; 1 the service refused or could not be reached (the
error is printed to stderr); 2 a bad command line.

``produce`` uses an idempotent producer, so the client's retries across a
leader change never duplicate a message. ``consume`` starts from the
group's committed offsets (``--from`` for queues the group has not
committed yet), commits after each page, and stops when it has caught up
on every queue, unless ``--follow`` keeps it long-polling.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from dledger.cluster import CLUSTER_FILE, DEFAULT_DIR
from dledger.config import load_cluster_file
from dledger.errors import ConfigError
from http_api.client import ApiError, Batch, Client, OutMessage
from http_api.routing import RoutingClient

ENDPOINTS_ENV = "DLEDGER_ENDPOINTS"
LAYOUT_FILE = "layout.json"  # a multi-group cluster directory (dledger_app.groups)
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
PRODUCE_BATCH = 100
DEFAULT_TIMEOUT_S = 5.0


class UsageError(Exception):
    pass


def endpoints(arg: str | None, cluster_dir: str) -> list[str]:
    """``--endpoints``, else ``$DLEDGER_ENDPOINTS``, else the local cluster file."""
    raw = arg or os.environ.get(ENDPOINTS_ENV)
    if raw:
        out = [e.strip().removeprefix("http://").rstrip("/") for e in raw.split(",") if e.strip()]
        if not out or not all(e.rpartition(":")[2].isdigit() for e in out):
            raise UsageError(f"--endpoints must be host:port[,host:port...], got {raw!r}")
        return out
    layout = Path(cluster_dir) / LAYOUT_FILE
    if layout.exists():  # a multi-group cluster: the controller's nodes, then every group's
        try:
            lay = json.loads(layout.read_text())
            subs = [str(lay.get("controller", "controller")), *map(str, lay["groups"])]
            return [
                m.http_address
                for sub in subs
                for m in load_cluster_file(Path(cluster_dir) / sub / CLUSTER_FILE).members
            ]
        except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
            raise UsageError(f"{layout}: {exc}") from None
    path = Path(cluster_dir) / CLUSTER_FILE
    if not path.exists():
        raise UsageError(
            f"no --endpoints, no ${ENDPOINTS_ENV}, and no local cluster file {path} "
            "(start one with `dledger cluster up`)"
        )
    try:
        return [m.http_address for m in load_cluster_file(path).members]
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _client(args: argparse.Namespace) -> Client | RoutingClient:
    """A client for one group, or a routing client when the endpoints
    serve ``/v1/routes`` (a multi-group cluster: controller or broker nodes)."""
    # --timeout bounds each request, retries included (a long poll gets its
    # wait on top), so an unreachable cluster is reported within it.
    budget = args.timeout + getattr(args, "wait_ms", 0) / 1000
    eps = endpoints(args.endpoints, args.dir)
    client = Client(eps, timeout_s=budget, retry_for_s=budget, token=args.token)
    try:
        client.request("GET", "/v1/routes", safe=True, retry_for_s=min(budget, 2.0))
    except ApiError as exc:
        if exc.status != 503:  # 404: a single group; anything else: its own error later
            return client
    return RoutingClient(eps, timeout_s=budget, group_retry_s=budget, token=args.token)


def show_value(value: bytes) -> str:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode()
    return text if text.isprintable() else repr(text)


def _print_row(out: TextIO, cols: Sequence[object]) -> None:
    widths = (6, 8, 14, 34)
    cells = [f"{c!s:<{w}}" for c, w in zip(cols, widths, strict=False)]
    out.write(" ".join(cells + [str(c) for c in cols[len(widths) :]]).rstrip() + "\n")


MESSAGE_HEADER = ("QUEUE", "OFFSET", "COMMIT_OFFSET", "MSG_ID", "VALUE")


# ---------------------------------------------------------------------------
# produce


def _values(args: argparse.Namespace) -> Iterator[bytes]:
    if args.file is not None and args.values:
        raise UsageError("give values or --file, not both")
    if args.file is None:
        if not args.values:
            raise UsageError("nothing to produce: give values or --file F ('-' for stdin)")
        for v in args.values:
            yield v.encode("utf-8")
        return
    f = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")  # noqa: SIM115
    try:
        for line in f:
            line = line.rstrip(b"\r\n")
            if line:
                yield line
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def cmd_produce(args: argparse.Namespace) -> int:
    if args.key is not None and args.queue is not None:
        raise UsageError("--key and --queue exclude each other")
    client = _client(args)
    producer = client.producer()
    out = sys.stdout
    batch: list[bytes] = []
    total = 0

    def send() -> None:
        nonlocal total
        if not batch:
            return
        keys = (args.key,) if args.key else ()
        msgs = [OutMessage(v, tags=args.tag or "", keys=keys) for v in batch]
        acks = producer.send(args.topic, msgs, queue=args.queue, sharding_key=args.key)
        if total == 0:  # the header only once something was written: errors come alone
            _print_row(out, MESSAGE_HEADER)
        for v, a in zip(batch, acks, strict=True):
            _print_row(out, (a.queue, a.queue_offset, a.commit_offset, a.msg_id, show_value(v)))
        total += len(batch)
        batch.clear()
        out.flush()

    for v in _values(args):
        batch.append(v)
        if len(batch) >= PRODUCE_BATCH:
            send()
    send()
    print(f"produced {total} message(s) to {args.topic} (producer {producer.producer_id})")
    return EXIT_OK


# ---------------------------------------------------------------------------
# consume


class _Stop:
    def __init__(self) -> None:
        self.flag = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.flag = True


def _read(client: Client | RoutingClient, topic: str, queue: int, offset: int, n: int) -> Batch:
    try:
        return client.consume(topic, queue, offset, max_messages=n)
    except ApiError as exc:
        if exc.status != 416 or not isinstance(exc.details.get("min_offset"), int):
            raise
        oldest: int = exc.details["min_offset"]
    # Retention removed what the group had not read yet: go on from the oldest kept.
    print(f"queue {queue}: offset {offset} is gone, continuing at {oldest}", file=sys.stderr)
    return client.consume(topic, queue, max(offset, oldest), max_messages=n)


def cmd_consume(args: argparse.Namespace) -> int:
    client = _client(args)
    topic = client.topic(args.topic)
    queues = [q["queue"] for q in topic["queues"]]
    committed = client.offsets(args.group, args.topic)
    start = "min_offset" if args.start == "earliest" else "max_offset"
    pos = {q["queue"]: committed.get((args.topic, q["queue"]), q[start]) for q in topic["queues"]}
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    out = sys.stdout
    _print_row(out, MESSAGE_HEADER)
    out.flush()
    seen = 0
    limit = args.max if args.max is not None else -1
    caught_up: set[int] = set()
    while not stop.flag and seen != limit:
        progressed = False
        for q in queues:
            if seen == limit:
                break
            want = 500 if limit < 0 else min(500, limit - seen)
            b = _read(client, args.topic, q, pos[q], want)
            records = b.records
            for r in records:
                _print_row(
                    out, (r.queue, r.queue_offset, r.commit_offset, r.msg_id, show_value(r.value))
                )
            seen += len(records)
            if b.next_offset != pos[q]:
                pos[q] = b.next_offset
                client.commit(args.group, {(args.topic, q): pos[q]})
                progressed = True
            if b.next_offset >= b.max_offset:
                caught_up.add(q)
            out.flush()
        if not args.follow and len(caught_up) == len(queues) and not progressed:
            break
        if args.follow and not progressed:
            # Long-poll the first queue (wakes on any new message there); the
            # others are polled right after. One queue: pure long-poll.
            q0 = queues[0]
            b = client.consume(args.topic, q0, pos[q0], max_messages=1, wait_ms=args.wait_ms)
            if not b.records and len(queues) > 1:
                time.sleep(min(0.2, args.wait_ms / 1000))
    print(f"consumed {seen} message(s) from {args.topic} as group {args.group}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------------
# topics


def _messages_in(t: dict[str, Any]) -> int:
    return sum(q["max_offset"] - q["min_offset"] for q in t["queues"])


def cmd_topics(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.topics_command == "list":
        print(f"{'TOPIC':<32} {'QUEUES':>6} {'MESSAGES':>10}")
        for t in client.topics():
            print(f"{t['name']:<32} {len(t['queues']):>6} {_messages_in(t):>10}")
        return EXIT_OK
    if args.topics_command == "create":
        t = client.create_topic(args.name, args.queues)
        print(f"created topic {t['name']} with {len(t['queues'])} queue(s)")
        return EXIT_OK
    if args.topics_command == "describe":
        t = client.topic(args.name)
        print(f"topic {t['name']}: {len(t['queues'])} queue(s), {_messages_in(t)} message(s)")
        print(f"{'QUEUE':>6} {'MIN_OFFSET':>12} {'MAX_OFFSET':>12}")
        for q in t["queues"]:
            print(f"{q['queue']:>6} {q['min_offset']:>12} {q['max_offset']:>12}")
        return EXIT_OK
    client.delete_topic(args.name)
    print(f"deleted topic {args.name}")
    return EXIT_OK


# ---------------------------------------------------------------------------
# wiring


def _common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--endpoints",
        help=f"host:port of nodes, comma-separated (default: ${ENDPOINTS_ENV}, else the "
        f"local cluster file in --dir)",
    )
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"local cluster directory ({DEFAULT_DIR})")
    p.add_argument("--token", help="bearer token (default: $DLEDGER_TOKEN)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="give up on a request after this many seconds, retries across nodes and "
        f"leader changes included (default {DEFAULT_TIMEOUT_S:g})",
    )
    return p


def add_commands(sub: Any) -> None:
    """Add produce, consume and topics to the ``dledger`` parser's subparsers."""
    pr = _common(sub.add_parser("produce", help="produce messages (values or lines of a file)"))
    pr.add_argument("topic")
    pr.add_argument("values", nargs="*", help="message values (UTF-8)")
    pr.add_argument("--file", help="one message per line ('-': stdin)")
    pr.add_argument(
        "--key",
        help="message key: every message with the same key goes to the same queue "
        "(the key is the sharding key and is stored as the message's keys)",
    )
    pr.add_argument("--queue", type=int, help="explicit queue")
    pr.add_argument("--tag", help="tag for every message")
    pr.set_defaults(func=cmd_produce)

    co = _common(sub.add_parser("consume", help="consume a topic as a consumer group"))
    co.add_argument("topic")
    co.add_argument("--group", required=True, help="consumer group (offsets committed)")
    co.add_argument(
        "--from",
        dest="start",
        choices=["earliest", "latest"],
        default="earliest",
        help="where to start on queues the group has not committed (default earliest)",
    )
    co.add_argument("--max", type=int, help="stop after N messages")
    co.add_argument("--follow", action="store_true", help="keep waiting for new messages")
    co.add_argument("--wait-ms", type=int, default=1000, help="long-poll wait with --follow")
    co.set_defaults(func=cmd_consume)

    tp = sub.add_parser("topics", help="list, create, describe or delete topics")
    tsub = tp.add_subparsers(dest="topics_command", required=True)
    _common(tsub.add_parser("list", help="every topic")).set_defaults(func=cmd_topics)
    c = _common(tsub.add_parser("create", help="create a topic"))
    c.add_argument("name")
    c.add_argument("--queues", type=int, default=8)
    c.set_defaults(func=cmd_topics)
    for name in ("describe", "delete"):
        d = _common(tsub.add_parser(name, help=f"{name} a topic"))
        d.add_argument("name")
        d.set_defaults(func=cmd_topics)


def run(args: argparse.Namespace) -> int:
    """Run a client command; errors become a message and an exit code."""
    try:
        code: int = args.func(args)
        return code
    except UsageError as exc:
        print(f"dledger {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ApiError as exc:
        print(f"dledger {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # e.g. `dledger consume ... | head`
        return EXIT_OK
    except OSError as exc:
        print(f"dledger {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
