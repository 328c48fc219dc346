"""Holding answers to /openapi.json: the status must be one the operation
declares, required response headers must be there, and a JSON body must
match the status's schema (JSON Schema 2020-12, refs resolved in the
document). Used by the in-process API tests, the live-cluster tests (every
ApiCluster.call) and the fuzz test."""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_URN = "urn:dledger:openapi"


class Nonconforming(AssertionError):
    pass


@dataclass
class Conformance:
    doc: dict[str, Any]
    checked: int = 0
    _registry: Registry[Any] = field(init=False)
    _paths: list[tuple[re.Pattern[str], str]] = field(init=False)
    _validators: dict[str, Draft202012Validator] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._registry = Registry().with_resource(
            _URN, Resource(contents=self.doc, specification=DRAFT202012)
        )
        pats = []
        for p in self.doc["paths"]:
            rx = "^" + re.sub(r"\\{\w+\\}", "[^/]+", re.escape(p)) + "$"
            pats.append((re.compile(rx), p))
        # Literal paths first, so /v1/topics never reads as a template.
        self._paths = sorted(pats, key=lambda x: x[1].count("{"))

    def operation(self, method: str, url: str) -> tuple[str, dict[str, Any]] | None:
        path = urllib.parse.urlsplit(url).path
        for rx, template in self._paths:
            if rx.match(path):
                op = self.doc["paths"][template].get(method.lower())
                return (template, op) if op is not None else None
        return None

    def _validator(self, schema: dict[str, Any]) -> Draft202012Validator:
        key = json.dumps(schema, sort_keys=True)
        v = self._validators.get(key)
        if v is None:
            if "$ref" in schema and schema["$ref"].startswith("#"):
                schema = {"$ref": _URN + schema["$ref"]}
            v = Draft202012Validator(schema, registry=self._registry)
            self._validators[key] = v
        return v

    def check(
        self,
        method: str,
        url: str,
        status: int,
        headers: dict[str, str],
        body: bytes | Any,
    ) -> None:
        """Raise Nonconforming unless the answer is what the document says.
        ``body``: raw bytes, or already-decoded JSON. ``headers``: any case."""
        found = self.operation(method, url)
        if found is None:
            # Not a documented route: only the router's own answers may come.
            if status not in (404, 405, 401):
                raise Nonconforming(f"{method} {url}: {status} from an undocumented route")
            return
        template, op = found
        responses = op["responses"]
        resp = responses.get(str(status))
        if resp is None:
            raise Nonconforming(
                f"{method} {template} ({url}): status {status} is not declared "
                f"(declared: {sorted(responses)})"
            )
        lower = {k.lower(): v for k, v in headers.items()}
        for h, spec in resp.get("headers", {}).items():
            if spec.get("required") and h.lower() not in lower:
                raise Nonconforming(f"{method} {template}: {status} without header {h}")
        content = resp.get("content", {})
        # another declared media type (an Arrow page): the body is opaque here
        ctype = lower.get("content-type", "").split(";")[0].strip().lower()
        other = ctype != "application/json" and ctype in content
        if "application/json" in content and not other:
            if isinstance(body, bytes | bytearray):
                try:
                    body = json.loads(body)
                except ValueError:
                    raise Nonconforming(
                        f"{method} {template}: {status} body is not JSON: {bytes(body)[:200]!r}"
                    ) from None
            errors = sorted(
                self._validator(content["application/json"]["schema"]).iter_errors(body),
                key=lambda e: list(e.absolute_path),
            )
            if errors:
                e = errors[0]
                raise Nonconforming(
                    f"{method} {template} ({url}) {status}: body does not match the schema at "
                    f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                )
        self.checked += 1
