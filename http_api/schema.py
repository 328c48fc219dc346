"""Requests checked against the OpenAPI document the node publishes.

:func:`compile_schema` turns a JSON Schema of :mod:`http_api.openapi` (the
subset it uses: ``$ref``, ``type``, ``enum``, ``const``, ``minimum``,
``maximum``, ``minLength``, ``maxLength``, ``pattern``, ``required``,
``properties``, ``additionalProperties``, ``minItems``, ``maxItems``,
``maxProperties``, ``items``, ``oneOf``, ``allOf``) into a checker that
raises :class:`~broker_adapter.errors.InvalidArgument` (422) naming the
field at fault (``messages[3].encodng``). Anything the document does not
allow is refused: unknown fields, values out of bounds, unknown enum values.

Query and path values are text: an integer is ASCII digits only (no sign,
no spaces, no fullwidth or other Unicode digits), at most 19 of them; a
parameter the operation does not declare, or given twice, is refused.

Checkers are compiled once per schema; they build a field's path only on
error. A component may come with a *quick* predicate for its common shape
(the plain message of a produce: :data:`http_api.openapi.QUICK`): items of
an array it says yes to are not walked, so the predicate must say yes only
to values the schema accepts. Big arrays (a produce of many messages) are
checked in slices with a yield to the event loop between them
(:func:`check_body`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Any

from broker_adapter.errors import InvalidArgument

Check = Callable[[Any, str], None]
# A predicate that only says yes to values its schema accepts (never the
# other way round): items of an array it answers yes for skip the checker.
Quick = Callable[[Any], bool]

# Items of one array checked between two yields to the event loop.
YIELD_EVERY = 512
_DIGITS = re.compile(r"[0-9]{1,19}")
_NUMBER = re.compile(r"[0-9]{1,19}(\.[0-9]{1,19})?")
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: type(v) is str,
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) is int or type(v) is float,
    "boolean": lambda v: type(v) is bool,
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "null": lambda v: v is None,
}


def _where(path: str) -> str:
    return path or "the body"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fail(path: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{_where(path)} {message}", field=path or "body")


class Compiler:
    """Compiles schemas that may ``$ref`` the document's components."""

    def __init__(
        self, components: Mapping[str, dict[str, Any]], quick: Mapping[str, Quick] | None = None
    ) -> None:
        self.components = components
        # Per component name: a shortcut for the common shape of its values
        # (see Quick), e.g. the plain message of a batch of thousands.
        self.quick = dict(quick or {})
        self._refs: dict[str, Check] = {}
        self._cache: dict[int, tuple[Mapping[str, Any], Check]] = {}

    def checker(self, schema: Mapping[str, Any]) -> Check:
        """:meth:`compile`, once per schema object."""
        hit = self._cache.get(id(schema))
        if hit is None or hit[0] is not schema:
            hit = self._cache[id(schema)] = (schema, self.compile(schema))
        return hit[1]

    def quick_of(self, schema: Mapping[str, Any]) -> Quick | None:
        """The shortcut of a schema that is just a ``$ref`` to a component
        that has one."""
        if len(schema) != 1 or "$ref" not in schema:
            return None
        return self.quick.get(str(schema["$ref"]).rsplit("/", 1)[1])

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        while "$ref" in schema:
            schema = self.components[str(schema["$ref"]).rsplit("/", 1)[1]]
        return schema

    def ref(self, name: str) -> Check:
        got = self._refs.get(name)
        if got is None:
            slot: list[Check] = []

            def late(v: Any, path: str) -> None:  # a schema that refers to itself
                slot[0](v, path)

            self._refs[name] = late
            slot.append(self.compile(self.components[name]))
            self._refs[name] = got = slot[0]
        return got

    def compile(self, schema: Mapping[str, Any]) -> Check:
        if "$ref" in schema:
            return self.ref(str(schema["$ref"]).rsplit("/", 1)[1])
        checks: list[Check] = []
        kinds = schema.get("type")
        if kinds is not None:
            names = [kinds] if isinstance(kinds, str) else list(kinds)
            tests = [_TYPES[n] for n in names]
            text = " or ".join(names)

            def typ(v: Any, path: str) -> None:
                for t in tests:
                    if t(v):
                        return
                raise _fail(path, f"must be {'an' if text[0] in 'aio' else 'a'} {text}")

            checks.append(typ)
        if "const" in schema:
            const = schema["const"]

            def cst(v: Any, path: str) -> None:
                if v != const or type(v) is not type(const):
                    raise _fail(path, f"must be {const!r}")

            checks.append(cst)
        if "enum" in schema:
            allowed = list(schema["enum"])

            def enum(v: Any, path: str) -> None:
                if type(v) is bool or v not in allowed:
                    shown = ", ".join(repr(a) for a in allowed)
                    raise _fail(path, f"must be one of {shown}")

            checks.append(enum)
        checks += self._numeric(schema) + self._string(schema)
        object_words = ("properties", "required", "additionalProperties", "maxProperties")
        if any(w in schema for w in object_words):
            checks.append(self._object(schema))
        if "items" in schema or "minItems" in schema or "maxItems" in schema:
            checks.append(self._array(schema))
        if "oneOf" in schema:
            alts = [self.compile(s) for s in schema["oneOf"]]

            def one_of(v: Any, path: str) -> None:
                ok = 0
                for alt in alts:
                    try:
                        alt(v, path)
                    except InvalidArgument:
                        continue
                    ok += 1
                if ok != 1:
                    raise _fail(path, "matches none of its allowed shapes")

            checks.append(one_of)
        if "allOf" in schema:
            checks += [self.compile(s) for s in schema["allOf"]]
        if len(checks) == 1:
            return checks[0]

        def all_(v: Any, path: str) -> None:
            for c in checks:
                c(v, path)

        return all_

    @staticmethod
    def _numeric(schema: Mapping[str, Any]) -> list[Check]:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is None and hi is None:
            return []

        def bounds(v: Any, path: str) -> None:
            if type(v) is bool or not isinstance(v, int | float):
                return  # the type check names it
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                a = "" if lo is None else str(lo)
                b = "" if hi is None else str(hi)
                raise _fail(path, f"must be within {a}..{b}, got {v}")

        return [bounds]

    @staticmethod
    def _string(schema: Mapping[str, Any]) -> list[Check]:
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        pattern = schema.get("pattern")
        if lo is None and hi is None and pattern is None:
            return []
        rx = re.compile(pattern) if pattern is not None else None

        def text(v: Any, path: str) -> None:
            if type(v) is not str:
                return
            if (lo is not None and len(v) < lo) or (hi is not None and len(v) > hi):
                raise _fail(path, f"must be {lo or 0}..{hi if hi is not None else ''} characters")
            if rx is not None and not rx.search(v):
                raise _fail(path, f"must match {pattern}")

        return [text]

    def _object(self, schema: Mapping[str, Any]) -> Check:
        props = {k: self.compile(s) for k, s in schema.get("properties", {}).items()}
        required = list(schema.get("required", []))
        extra = schema.get("additionalProperties", True)
        extra_check = self.compile(extra) if isinstance(extra, dict) else None
        max_props = schema.get("maxProperties")

        def obj(v: Any, path: str) -> None:
            if type(v) is not dict:
                return
            if max_props is not None and len(v) > max_props:
                raise _fail(path, f"has {len(v)} fields, at most {max_props} allowed")
            for name in required:
                if name not in v:
                    raise InvalidArgument(
                        f"{_join(path, name)} is required", field=_join(path, name)
                    )
            for key, value in v.items():
                c = props.get(key)
                if c is not None:
                    c(value, _join(path, key))
                elif extra_check is not None:
                    extra_check(value, _join(path, key))
                elif extra is False:
                    where = _join(path, key)
                    raise InvalidArgument(
                        f"{where[:200]} is not a field of {_where(path)}", field=where[:200]
                    )

        return obj

    def _array(self, schema: Mapping[str, Any]) -> Check:
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        item = self.compile(schema["items"]) if "items" in schema else None
        quick = self.quick_of(schema["items"]) if "items" in schema else None

        def arr(v: Any, path: str) -> None:
            if type(v) is not list:
                return
            _array_bounds(v, path, lo, hi)
            if item is not None:
                for k, x in enumerate(v):
                    if quick is None or not quick(x):
                        item(x, f"{path}[{k}]")

        return arr


def _array_bounds(v: list[Any], path: str, lo: int | None, hi: int | None) -> None:
    if lo is not None and len(v) < lo:
        raise _fail(path, f"must hold at least {lo} item(s)")
    if hi is not None and len(v) > hi:
        raise _fail(path, f"holds {len(v)} items, at most {hi} allowed")


async def check_body(
    compiler: Compiler, schema: Mapping[str, Any], body: Any, yield_every: int = YIELD_EVERY
) -> None:
    """Check a decoded request body; a top-level object's big arrays are
    checked in slices of ``yield_every`` items with a yield to the loop
    between them, so a big (accepted) request does not hold the loop."""
    schema = compiler.resolve(schema)
    if type(body) is not dict or schema.get("type") != "object":
        compiler.checker(schema)(body, "")
        return
    props: dict[str, Any] = schema.get("properties", {})
    big = [
        k
        for k, sub in props.items()
        if type(body.get(k)) is list and len(body[k]) > yield_every and "items" in sub
    ]
    if not big:
        compiler.checker(schema)(body, "")
        return
    for name in schema.get("required", []):
        if name not in body:
            raise InvalidArgument(f"{name} is required", field=name)
    for key, value in body.items():
        sub = props.get(key)
        if sub is None:
            raise InvalidArgument(f"{key[:200]} is not a field of the body", field=key[:200])
        if key not in big:
            compiler.checker(sub)(value, key)
    for key in big:
        sub = props[key]
        value = body[key]
        _array_bounds(value, key, sub.get("minItems"), sub.get("maxItems"))
        item = compiler.checker(sub["items"])
        quick = compiler.quick_of(sub["items"])
        for start in range(0, len(value), yield_every):
            for k in range(start, min(start + yield_every, len(value))):
                x = value[k]
                if quick is None or not quick(x):
                    item(x, f"{key}[{k}]")
            await asyncio.sleep(0)


def parse_query_value(name: str, raw: str, schema: Mapping[str, Any], compiler: Compiler) -> Any:
    """The typed value of one query or path parameter (422 naming it)."""
    schema = compiler.resolve(schema)
    kind = schema.get("type")
    value: Any = raw
    if kind == "integer":
        if not _DIGITS.fullmatch(raw):
            raise InvalidArgument(
                f"{name} must be an integer of ASCII digits, got {raw[:40]!r}", field=name
            )
        value = int(raw)
    elif kind == "number":
        if not _NUMBER.fullmatch(raw):
            raise InvalidArgument(f"{name} must be a decimal number, got {raw[:40]!r}", field=name)
        value = float(raw)
    compiler.checker(schema)(value, name)
    return value
