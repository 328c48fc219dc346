"""HTTP load generators (keep-alive connections, one request in flight each).

* :func:`closed_loop`: ``concurrency`` workers, each sends its next request
  when the previous one is answered. It finds the saturation rate; its
  latencies are *not* what a user at that rate sees (a stalled server slows
  the senders down: coordinated omission).
* :func:`open_loop`: request ``i`` is due at ``start + i / rate`` whatever
  happened before; latency is measured from that intended send time, so a
  stall is charged to every request that should have been sent during it.
  Requests wait for a free connection from a bounded pool (that wait is
  part of their latency, as it would be in a real client).

Both run in the benchmark process, on the same two cores as the nodes; the
client's CPU is part of what is measured (the peer's driver runs inside its
leader process and pays nothing for a client). So the default client is
lean (``client="lean"``): one asyncio protocol per connection that writes a
request built once and reads the status line and the body's length
(``Content-Length`` or chunked), about 45 us of CPU per request here.
aiohttp's client (``client="aiohttp"``) costs 165-195 us per request, half
a core at 32 clients, and it charged some servers more than others: side by
side, one message per request with 32 clients, it held etcd to 59-66% of
what the lean client drew from it and ours to 71-72%.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from benchmarks.stats import summarize

JSON = "application/json"
CLIENTS = ("lean", "aiohttp")
_WATCH_S = 0.1  # how often the lean client looks for requests past their timeout


def _session(connections: int, timeout_s: float, content_type: str = JSON) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, force_close=False)
    return aiohttp.ClientSession(
        connector=conn,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        headers={"content-type": content_type},
    )


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(url, data=body, allow_redirects=False) as r:
        await r.read()
        return r.status


class ResponseError(Exception):
    """The server's answer is not HTTP/1.x this client can frame."""


def parse_response(buf: bytearray) -> tuple[int, int, bool] | None:
    """``(status, bytes used, keep-alive)`` of the first complete response in
    ``buf``, or None while it is incomplete. Bodies are framed by
    ``Content-Length`` or chunked transfer coding; a response with neither
    must be one with no body (1xx, 204, 304) or it is an error."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > 65536:
            raise ResponseError("no end of headers in 64 KiB")
        return None
    head = bytes(buf[:end]).lower()
    if not head.startswith(b"http/1.") or len(head) < 12:
        raise ResponseError(f"not an HTTP/1.x status line: {bytes(buf[:40])!r}")
    try:
        status = int(head[9:12])
    except ValueError:
        raise ResponseError(f"bad status line: {bytes(buf[:40])!r}") from None
    keep = b"\r\nconnection: close" not in head and not head.startswith(b"http/1.0")
    pos = end + 4
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        try:
            n = int(head[i + 17 : j if j > 0 else len(head)])
        except ValueError:
            raise ResponseError("bad Content-Length") from None
        return (status, pos + n, keep) if len(buf) >= pos + n else None
    if b"\r\ntransfer-encoding:" in head and b"chunked" in head:
        while True:
            k = buf.find(b"\r\n", pos)
            if k < 0:
                return None
            try:
                size = int(bytes(buf[pos:k]).split(b";")[0], 16)
            except ValueError:
                raise ResponseError("bad chunk size") from None
            if size == 0:
                # last chunk, then optional trailers, then an empty line
                t = buf.find(b"\r\n\r\n", k)
                if t == k:
                    return status, k + 4, keep
                if t < 0:
                    return None
                return status, t + 4, keep
            if len(buf) < k + 2 + size + 2:
                return None
            pos = k + 2 + size + 2
    if status < 200 or status in (204, 304):
        return status, pos, keep
    raise ResponseError("a response with a body but neither Content-Length nor chunked")


class _Conn(asyncio.Protocol):
    """One keep-alive connection of the lean client, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.sent_at = 0.0
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.open = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        w = self.waiter
        if w is None or w.done():
            return
        try:
            got = parse_response(self.buf)
        except ResponseError as exc:
            self.fail(exc)
            return
        if got is None:
            return
        status, used, keep = got
        del self.buf[:used]
        self.waiter = None
        if not keep:
            self.close()
        w.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("connection closed before the response"))

    def fail(self, exc: BaseException) -> None:
        w, self.waiter = self.waiter, None
        self.close()
        if w is not None and not w.done():
            w.set_exception(exc)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


class LeanClient:
    """POSTs one prebuilt request over keep-alive connections (see the module
    docstring). A request unanswered after ``timeout_s`` fails with
    TimeoutError and its connection is dropped; one timer for all of them."""

    def __init__(self, url: str, body: bytes, content_type: str, timeout_s: float) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the lean client speaks plain http://host:port/...: {url!r}")
        self.host, self.port = u.hostname, u.port or 80
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        self.timeout_s = timeout_s
        self.conns: list[_Conn] = []
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LeanClient:
        self._watch = asyncio.create_task(self._watchdog())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for c in self.conns:
            c.close()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            late = time.perf_counter() - self.timeout_s
            for c in self.conns:
                if c.waiter is not None and c.sent_at < late:
                    c.fail(TimeoutError(f"no response in {self.timeout_s} s"))

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        self.conns = [c for c in self.conns if c.open]
        self.conns.append(conn)
        return conn

    async def post(self, conn: _Conn) -> int:
        """Status of one request on ``conn`` (which must be open and idle)."""
        assert conn.transport is not None and conn.waiter is None
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        conn.waiter = fut
        conn.sent_at = time.perf_counter()
        conn.transport.write(self.request)
        return await fut


# what a failed request raises, by client
_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    TimeoutError,
    OSError,
    ResponseError,
)


class _Pool:
    """At most ``size`` lean connections; a request waits for a free one."""

    def __init__(self, client: LeanClient, size: int) -> None:
        self.client, self.size = client, size
        self.idle: list[_Conn] = []
        self.count = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def post(self) -> int:
        while not self.idle and self.count >= self.size:
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiters.append(w)
            await w
        if self.idle:
            conn = self.idle.pop()
        else:
            self.count += 1
            try:
                conn = await self.client.connect()
            except BaseException:
                self.count -= 1
                self._wake()
                raise
        try:
            status = await self.client.post(conn)
        finally:
            if conn.open:
                self.idle.append(conn)
            else:
                self.count -= 1
            self._wake()
        return status

    def _wake(self) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return


class _Poster:
    """``async with _Poster(...) as post``: ``await post()`` sends one request
    and returns its status, through the chosen client."""

    def __init__(
        self, client: str, url: str, body: bytes, content_type: str, timeout_s: float, size: int
    ) -> None:
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {CLIENTS}, not {client!r}")
        self.kind, self.url, self.body = client, url, body
        self.content_type, self.timeout_s, self.size = content_type, timeout_s, size
        self._session: aiohttp.ClientSession | None = None
        self._lean: LeanClient | None = None

    async def __aenter__(self) -> Callable[[], Awaitable[int]]:
        if self.kind == "aiohttp":
            session = self._session = _session(self.size, self.timeout_s, self.content_type)
            return lambda: _post(session, self.url, self.body)
        self._lean = await LeanClient(
            self.url, self.body, self.content_type, self.timeout_s
        ).__aenter__()
        return _Pool(self._lean, self.size).post

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
        if self._lean is not None:
            await self._lean.__aexit__(*exc)


def _result(
    lat_s: list[float], errors: dict[str, int], elapsed: float, msgs_per_req: int
) -> dict[str, Any]:
    ok = len(lat_s)
    return {
        "requests_ok": ok,
        "errors": errors,
        "elapsed_s": elapsed,
        "req_per_s": ok / elapsed if elapsed > 0 else 0.0,
        "msg_per_s": ok * msgs_per_req / elapsed if elapsed > 0 else 0.0,
        "latency_ms": summarize([x * 1000.0 for x in lat_s]),
    }


async def closed_loop(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration_s: float,
    msgs_per_req: int,
    timeout_s: float = 10.0,
    total_requests: int | None = None,
    content_type: str = JSON,
    client: str = "lean",
) -> dict[str, Any]:
    """``total_requests``: stop after that many successful requests, or after
    ``duration_s`` (a time limit then) whichever comes first."""
    lat: list[float] = []
    claimed = 0
    errors: dict[str, int] = {}
    async with _Poster(client, url, body, content_type, timeout_s, concurrency) as post:
        stop_at = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal claimed
            while True:
                if time.perf_counter() >= stop_at:
                    return
                if total_requests is not None and claimed >= total_requests:
                    return
                claimed += 1
                t = time.perf_counter()
                try:
                    st = await post()
                except _ERRORS as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    claimed -= 1
                    await asyncio.sleep(0.01)
                    continue
                if st == 200:
                    lat.append(time.perf_counter() - t)
                else:
                    claimed -= 1
                    errors[str(st)] = errors.get(str(st), 0) + 1
                    await asyncio.sleep(0.01)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    out = _result(lat, errors, elapsed, msgs_per_req)
    out["concurrency"] = concurrency
    out["client"] = client
    return out


async def open_loop(
    url: str,
    body: bytes,
    *,
    rate: float,
    duration_s: float,
    msgs_per_req: int,
    connections: int,
    timeout_s: float = 10.0,
    max_outstanding: int = 20_000,
    content_type: str = JSON,
    client: str = "lean",
) -> dict[str, Any]:
    """Offered ``rate`` requests/s for ``duration_s``; see the module docstring.

    Requests that would exceed ``max_outstanding`` are not sent and count as
    ``shed`` errors (the generator itself would otherwise run out of memory
    far past saturation)."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    n_total = max(1, int(rate * duration_s))
    outstanding = 0
    last_done = 0.0
    async with _Poster(client, url, body, content_type, timeout_s, connections) as post:
        tasks: set[asyncio.Task[None]] = set()

        async def one(due: float) -> None:
            nonlocal outstanding, last_done
            try:
                st = await post()
            except _ERRORS as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                return
            finally:
                outstanding -= 1
            now = time.perf_counter()
            last_done = now
            if st == 200:
                lat.append(now - due)
            else:
                errors[str(st)] = errors.get(str(st), 0) + 1

        start = time.perf_counter() + 0.01
        i = 0
        while i < n_total:
            now = time.perf_counter()
            due = start + i / rate
            if due > now:
                await asyncio.sleep(min(due - now, 0.002))
                continue
            while i < n_total and start + i / rate <= now:
                due_i = start + i / rate
                i += 1
                if outstanding >= max_outstanding:
                    errors["shed"] = errors.get("shed", 0) + 1
                    continue
                outstanding += 1
                t = asyncio.create_task(one(due_i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = max(last_done - start, duration_s * 0.5)
    out = _result(lat, errors, elapsed, msgs_per_req)
    out["offered_req_per_s"] = rate
    out["offered_msg_per_s"] = rate * msgs_per_req
    out["connections"] = connections
    out["client"] = client
    return out
