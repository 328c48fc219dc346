"""``dledger proxy``: a stateless HTTP proxy in front of several broker groups.

It serves the /v1 API of a broker node for plain HTTP clients (curl) and
forwards each request to the group that owns the queue it is about, using
the routes it caches (:class:`http_api.routing.RoutingClient`, run in worker
threads). It keeps nothing that a restart would lose but caches and its own
producer sessions, so any number of proxies can run side by side.

- ``POST /v1/topics/{topic}/messages``: every message goes to its queue's
  group (the queue given, the sharding key's queue, else one queue chosen
  round robin for all the request's other messages; those may move to another group when its group surely did not take it;
  see :mod:`http_api.routing`). The proxy sends each part as an
  idempotent producer of its own, so its retries inside a group never
  duplicate. The answer lists the messages in request order, each with its
  ``group``. A part that fails fails the request with that part's error
  (``503 GROUP_UNAVAILABLE`` naming the group, ``504 OUTCOME_UNKNOWN``, ...);
  when parts before it were written, the answer is ``502
  PARTIALLY_WRITTEN`` with them in ``acked`` (a status no client sends
  again on its own). Idempotent
  producers of the client's own (``producer_id``/``sequence``) are refused
  (``422``): producer ids belong to one group; use the routing client.
- ``GET /v1/topics/{topic}/queues/{queue}/messages``: the owning group.
- ``POST /v1/topics``, ``PATCH``/``DELETE /v1/topics/{topic}``,
  ``GET /v1/topics``: the controller (through the seeds).
- ``GET /v1/topics/{topic}``: each owning group's queue ranges, merged.
- ``GET /v1/routes/{topic}``: the route as cached.
- ``GET``/``POST /v1/groups/{group}/offsets``: split by owning group.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import logging
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from broker_adapter.codec import BATCH_CONTENT_TYPE
from http_api.client import Ack, ApiError, OutcomeUnknownError, OutMessage
from http_api.errors import UnsupportedMediaType, envelope, json_response
from http_api.routing import RoutedProducer, RoutingClient

logger = logging.getLogger("dledger.proxy")

T = TypeVar("T")
WORKERS = 64
MAX_BODY_BYTES = (4 << 20) + (64 << 10)


class Unprocessable(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _messages(raw: object) -> list[OutMessage]:
    if not isinstance(raw, list) or not raw:
        raise Unprocessable("messages must be a non-empty list", "messages")
    out = []
    for k, m in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise Unprocessable("each message must be an object", where)
        value, enc = m.get("value"), m.get("encoding", "base64")
        if not isinstance(value, str):
            raise Unprocessable(f"{where}.value must be a string", f"{where}.value")
        if enc == "utf-8":
            body = value.encode("utf-8")
        elif enc == "base64":
            try:
                body = binascii.a2b_base64(value, strict_mode=True)
            except ValueError:
                raise Unprocessable(
                    f"{where}.value is not valid base64", f"{where}.value"
                ) from None
        else:
            raise Unprocessable(
                f"{where}.encoding must be 'base64' or 'utf-8'", f"{where}.encoding"
            )
        keys = m.get("keys", m.get("key", ()))
        if isinstance(keys, str):
            keys = (keys,)
        if not isinstance(keys, list | tuple) or not all(isinstance(x, str) for x in keys):
            raise Unprocessable(f"{where}.keys must be strings", f"{where}.keys")
        tags = m.get("tags", m.get("tag", ""))
        if not isinstance(tags, str):
            raise Unprocessable(f"{where}.tags must be a string", f"{where}.tags")
        props = m.get("properties") or {}
        if not isinstance(props, dict) or not all(
            isinstance(a, str) and isinstance(b, str) for a, b in props.items()
        ):
            raise Unprocessable(
                f"{where}.properties must map strings to strings", f"{where}.properties"
            )
        queue = m.get("queue")
        if queue is not None and (
            not isinstance(queue, int) or isinstance(queue, bool) or queue < 0
        ):
            raise Unprocessable(f"{where}.queue must be a non-negative integer", f"{where}.queue")
        key = m.get("sharding_key")
        if key is not None and not isinstance(key, str):
            raise Unprocessable(f"{where}.sharding_key must be a string", f"{where}.sharding_key")
        out.append(OutMessage(body, tags, tuple(keys), dict(props), queue, key or None))
    return out


def _ack_json(a: Ack, group: str) -> dict[str, Any]:
    return {
        "queue": a.queue,
        "queue_offset": a.queue_offset,
        "commit_offset": a.commit_offset,
        "msg_id": a.msg_id,
        "duplicate": a.duplicate,
        "group": group,
    }


def _api_error(exc: ApiError, **extra: object) -> web.Response:
    """The envelope of a forwarded failure. An outcome the proxy does not
    know is a 504, never a 503 (clients send a 503'd request again: it
    would be written twice); other failures without an answer are 503s
    (nothing was sent)."""
    if isinstance(exc, OutcomeUnknownError) or exc.details.get("outcome_unknown"):
        status = 504
    else:
        status = exc.status or 503
    message = str(exc).split(": ", 1)[-1] if exc.status else str(exc)
    details = {k: v for k, v in exc.details.items() if k != "outcome_unknown"}
    return envelope(status, exc.code, message, **details, **extra)


class Proxy:
    def __init__(self, rc: RoutingClient, workers: int = WORKERS) -> None:
        self.rc = rc
        self.producer: RoutedProducer = rc.producer()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="proxy")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_routes(
            [
                web.post("/v1/topics/{topic}/messages", self.produce),
                web.get("/v1/topics/{topic}/queues/{queue}/messages", self.consume),
                web.post("/v1/topics", self.admin),
                web.get("/v1/topics", self.admin),
                web.patch("/v1/topics/{topic}", self.admin),
                web.delete("/v1/topics/{topic}", self.admin),
                web.get("/v1/topics/{topic}", self.describe),
                web.get("/v1/routes/{topic}", self.route),
                web.get("/v1/groups/{group}/offsets", self.get_offsets),
                web.post("/v1/groups/{group}/offsets", self.commit_offsets),
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.healthz),
            ]
        )
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except ApiError as exc:
            return _api_error(exc)
        except Unprocessable as exc:
            return envelope(422, "INVALID_ARGUMENT", str(exc), field=exc.field)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = (exc.reason or "error").upper().replace(" ", "_")
            return envelope(exc.status, code, f"{request.method} {request.path}: {exc.reason}")
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            return envelope(500, "INTERNAL", "internal error (a bug: see the proxy's log)")

    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise Unprocessable("the body is not JSON", "body") from None
        if not isinstance(body, dict):
            raise Unprocessable("the body must be a JSON object", "body")
        return body

    # -- produce ----------------------------------------------------------------------
    async def produce(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        if request.content_type == BATCH_CONTENT_TYPE:
            return envelope(
                415,
                UnsupportedMediaType.code,
                "the proxy takes JSON produce bodies only (it routes each message "
                "by queue); send application/json",
            )
        body = await self._json(request)
        for f in ("producer_id", "epoch", "sequence"):
            if f in body:
                raise Unprocessable(
                    f"{f}: idempotent producers of your own are not supported through the proxy "
                    "(producer ids belong to one broker group); the proxy sends idempotently "
                    "itself, or use http_api.routing.RoutingClient",
                    f,
                )
        unknown = set(body) - {"messages"}
        if unknown:
            raise Unprocessable(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
        msgs = _messages(body.get("messages"))
        parts: dict[tuple[int, bool], list[int]] = {}
        for k, t in enumerate(await self._run(self.rc.targets, topic, msgs)):
            parts.setdefault(t, []).append(k)
        acked: list[dict[str, Any] | None] = [None] * len(msgs)
        for (q, ordered), ks in parts.items():
            part = [msgs[k] for k in ks]
            try:
                got = await self._run(self.rc.send_batch, topic, q, part, ordered, self.producer)
            except ApiError as exc:
                done = [a for a in acked if a is not None]
                if not done:
                    return _api_error(exc)
                # Some parts are written: never a status a client retries
                # (429/503), or those parts would be written twice.
                inner = _api_error(exc)
                return envelope(
                    502,
                    "PARTIALLY_WRITTEN",
                    f"{len(done)} of {len(msgs)} messages were written (see acked); the part "
                    f"for queue {q} failed ({inner.status} {exc.code}): {exc}",
                    acked=done,
                    failed_status=inner.status,
                    failed_code=exc.code,
                )
            route = await self._run(self.rc.route, topic)  # may refresh: off the loop
            for k, a in zip(ks, got, strict=True):
                acked[k] = _ack_json(a, route.owners[a.queue])
        return json_response(
            {"topic": topic, "duplicate": False, "messages": [a for a in acked if a is not None]}
        )

    # -- consume and the rest -------------------------------------------------------------
    async def consume(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        try:
            queue = int(request.match_info["queue"])
        except ValueError:
            raise Unprocessable("queue must be an integer", "queue") from None
        route = await self._run(self.rc.route, topic)
        if not 0 <= queue < len(route.owners):
            raise Unprocessable(
                f"queue {queue} does not exist: topic {topic!r} has {len(route.owners)} queues",
                "queue",
            )
        c = self.rc.group(route.owners[queue])
        res = await self._run(lambda: c.request("GET", request.path_qs, safe=True))
        return json_response(res)

    async def admin(self, request: web.Request) -> web.Response:
        body = await self._json(request) if request.can_read_body else None
        safe = request.method == "GET"
        res = await self._run(
            lambda: self.rc.seeds.request(
                request.method, request.path_qs, body or None, safe=safe, retry_for_s=10.0
            )
        )
        return json_response(res, 201 if request.method == "POST" else 200)

    async def describe(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        route = await self._run(self.rc.route, topic)
        queues: list[dict[str, Any]] = []
        for g in sorted(set(route.owners)):
            c = self.rc.group(g)
            info = await self._run(lambda c=c: c.request("GET", f"/v1/topics/{topic}", safe=True))
            mine = set(route.queues_of(g))
            queues += [{**q, "group": g} for q in info["queues"] if q["queue"] in mine]
        queues.sort(key=lambda q: q["queue"])
        return json_response({"name": topic, "version": route.version, "queues": queues})

    async def route(self, request: web.Request) -> web.Response:
        r = await self._run(self.rc.route, request.match_info["topic"])
        return json_response(r.body)

    async def get_offsets(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        topic = request.query.get("topic")
        if not topic:
            raise Unprocessable("topic is required through the proxy", "topic")
        offs = await self._run(self.rc.offsets, group, topic)
        return json_response(
            {
                "group": group,
                "offsets": [
                    {"topic": t, "queue": q, "offset": o} for (t, q), o in sorted(offs.items())
                ],
            }
        )

    async def commit_offsets(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        body = await self._json(request)
        items = body.get("offsets")
        if not isinstance(items, list) or not items:
            raise Unprocessable("offsets must be a non-empty list", "offsets")
        offs: dict[tuple[str, int], int] = {}
        for k, it in enumerate(items):
            if not isinstance(it, dict) or not isinstance(it.get("topic"), str):
                raise Unprocessable("each offset needs topic, queue, offset", f"offsets[{k}]")
            q, o = it.get("queue"), it.get("offset")
            if not isinstance(q, int) or not isinstance(o, int):
                raise Unprocessable("queue and offset must be integers", f"offsets[{k}]")
            offs[(it["topic"], q)] = o
        await self._run(self.rc.commit, group, offs)
        return json_response(
            {
                "group": group,
                "offsets": [{"topic": t, "queue": q, "offset": o} for (t, q), o in offs.items()],
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok", "role": "proxy"})


async def serve(seeds: list[str], host: str, port: int) -> int:
    proxy = Proxy(RoutingClient(seeds))
    runner = web.AppRunner(proxy.app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as exc:
        logger.critical("cannot listen on %s:%d: %s", host, port, exc)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info("proxy on %s:%d, routes from %s", host, port, ",".join(seeds))
    await stop.wait()
    await runner.cleanup()
    proxy.close()
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from dledger_app.groups import MultiCluster

    if args.routes:
        seeds = [a.strip() for a in args.routes.split(",") if a.strip()]
    elif MultiCluster.is_multi(args.dir):
        seeds = MultiCluster(args.dir).endpoints()
    else:
        print(
            f"dledger proxy: give --routes host:port,... or --dir of a multi-group cluster "
            f"({args.dir} is not one)",
            file=sys.stderr,
        )
        return 2
    host, _, port = args.listen.rpartition(":")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s.%(msecs)03d %(levelname)-7s proxy %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    return asyncio.run(serve(seeds, host or "127.0.0.1", int(port)))


def add_command(sub: Any, default_dir: str) -> None:
    p = sub.add_parser("proxy", help="a stateless /v1 proxy in front of several broker groups")
    p.add_argument("--listen", default="127.0.0.1:8080", help="host:port to serve on")
    p.add_argument("--routes", help="controller or broker nodes' host:port,... (route source)")
    p.add_argument("--dir", default=default_dir, help="a multi-group cluster directory")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_proxy)
