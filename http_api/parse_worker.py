"""Checking big request bodies in a helper process, off the node's loop.

A JSON parse is one C call that cannot yield: 3.4 MB of 200,000 tiny
messages takes 85-200 ms on the loop that also runs Raft (measured on the
2-core test machine; a thread does not help, the parser holds the GIL).
The caps refuse such a body, but only after it is parsed. So a body whose
structure may hold more items than the caps allow (:func:`token_bound`, an
upper bound from four byte counts, ~1 ms for 4 MiB) is first parsed and
checked against its schema in a helper process (this module run as
``python -m http_api.parse_worker``): the loop only ships the bytes
(2-5 ms of loop lag measured, against 85-200 ms inline). If the helper
refuses it, the answer is its 422/400; if it accepts it, the caps it
checked bound what the loop then parses.

Protocol on the helper's stdin/stdout: a request is a JSON header line
``{"schema": name, "size": n}`` then ``n`` body bytes; the answer is one
JSON line, ``{"ok": true}`` or ``{"ok": false, "status", "code", "message",
"field"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from broker_adapter.errors import InvalidArgument
from dledger.errors import Overloaded
from http_api.errors import BadBody
from http_api.openapi import QUICK, request_schemas
from http_api.schema import Compiler

logger = logging.getLogger(__name__)


def token_bound(raw: bytes) -> int:
    """At least the number of JSON values and keys that ``raw`` holds
    (every object, array, key and separator is one of these bytes, outside
    strings; bytes inside strings only make the bound looser)."""
    return raw.count(b"{") + raw.count(b"[") + raw.count(b":") + raw.count(b",")


def check_raw(compiler: Compiler, raw: bytes, schema_name: str) -> dict[str, Any]:
    """Parse and check one body (in the helper): the answer line's object."""
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        return {"ok": False, "status": 400, "code": BadBody.code,
                "message": f"the body is not JSON: {str(exc)[:120]}"}  # fmt: skip
    try:
        compiler.checker(compiler.components[schema_name])(body, "")
    except InvalidArgument as exc:
        d = exc.to_dict()
        return {"ok": False, "status": 422, **d}
    return {"ok": True}


class ParseWorker:
    """One helper process, started on first use, one body at a time."""

    def __init__(self, max_batch_messages: int, max_message_properties: int) -> None:
        self.args = [str(max_batch_messages), str(max_message_properties)]
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def _process(self) -> asyncio.subprocess.Process:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            # the helper imports this very code (not another checkout's)
            here = str(Path(__file__).resolve().parents[1])
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
            proc = self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "http_api.parse_worker",
                *self.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 20,
                env={**os.environ, "PYTHONPATH": path},
            )
        return proc

    async def check(self, raw: bytes, schema_name: str, timeout_s: float) -> None:
        """Raise the helper's refusal (InvalidArgument 422, BadBody 400);
        Overloaded (429) when it does not answer within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._lock:
                    answer = await self._ask(raw, schema_name)
        except TimeoutError:
            self.close()  # it may be stuck mid-body: a fresh one next time
            raise Overloaded("the node is busy checking large requests; retry later") from None
        if answer.get("ok"):
            return
        if answer.get("status") == 400:
            raise BadBody(str(answer.get("message", "bad body")))
        raise InvalidArgument(
            str(answer.get("message", "invalid body")), field=str(answer.get("field", "body"))
        )

    async def _ask(self, raw: bytes, schema_name: str) -> dict[str, Any]:
        for attempt in (1, 2):
            proc = await self._process()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(orjson.dumps({"schema": schema_name, "size": len(raw)}) + b"\n")
                proc.stdin.write(raw)
                await proc.stdin.drain()
                line = await proc.stdout.readline()
                if not line:
                    raise ConnectionError("the parse helper exited")
                answer: dict[str, Any] = orjson.loads(line)
                return answer
            except (ConnectionError, orjson.JSONDecodeError) as exc:
                logger.warning("parse helper failed (%s); restarting it", exc)
                self.close()
                if attempt == 2:
                    raise Overloaded("the body could not be checked; retry later") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def main(argv: list[str]) -> int:
    """The helper: answer each request on stdin until EOF."""
    compiler = Compiler(request_schemas(int(argv[0]), int(argv[1])), QUICK)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.readline()
        if not header:
            return 0
        req = orjson.loads(header)
        raw = stdin.read(int(req["size"]))
        stdout.write(orjson.dumps(check_raw(compiler, raw, str(req["schema"]))) + b"\n")
        stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
