"""Bearer-token authentication and role checks for a node's HTTP routes.

Off unless the cluster file has an ``[auth]`` table (see
:mod:`dledger.config`). When on, every request except ``GET``/``HEAD`` of a
public path (``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json`` by
default) must carry ``Authorization: Bearer <token>``:

- no token, or one the file does not list: ``401`` with
  ``WWW-Authenticate: Bearer realm="dledger"`` (RFC 6750);
- a valid token without the route's role: ``403``.

Each route declares the role it needs in the application's
:data:`ROUTE_ROLES` table (``(METHOD, canonical path) -> role``), filled by
whoever registers the route; a route missing from the table needs
``admin`` (deny by default). ``any`` means any valid token (metadata reads
that producers and consumers both need). The ``admin`` role may do
everything. An unmatched path still needs a valid token before it gets its
``404``, so the route list is not probed anonymously.

Tokens are compared as SHA-256 digests with :func:`hmac.compare_digest`,
against every configured token without stopping at the first match, so
neither the time taken nor an early exit tells which prefix matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from dledger.config import AuthSpec, TokenSpec
from dledger.errors import DLedgerError

RouteRole = Literal["produce", "consume", "admin", "any", "public"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTE_ROLES = web.AppKey("route_roles", dict[tuple[str, str], RouteRole])
REALM = 'Bearer realm="dledger"'


class AuthError(DLedgerError):
    """Base of the authentication errors; ``challenge`` is the
    ``WWW-Authenticate`` value the answer carries."""

    code = "AUTH_ERROR"
    challenge = REALM


class Unauthorized(AuthError):
    """No token, a malformed header, or a token the cluster file does not list (401)."""

    code = "UNAUTHORIZED"

    def __init__(self, message: str, *, invalid: bool) -> None:
        super().__init__(message)
        if invalid:
            self.challenge = f'{REALM}, error="invalid_token"'


class Forbidden(AuthError):
    """A valid token without the role the route needs (403)."""

    code = "FORBIDDEN"
    challenge = f'{REALM}, error="insufficient_scope"'

    def __init__(self, message: str, *, needs: str) -> None:
        super().__init__(message)
        self.needs = needs


class TokenAuth:
    """The configured tokens, kept as digests."""

    def __init__(self, spec: AuthSpec) -> None:
        self.public = frozenset(spec.public)
        self._tokens: tuple[tuple[bytes, TokenSpec], ...] = tuple(
            (hashlib.sha256(t.token.encode()).digest(), t) for t in spec.tokens
        )

    def authenticate(self, header: str | None) -> TokenSpec:
        if not header:
            raise Unauthorized("this route needs an Authorization: Bearer token", invalid=False)
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'", invalid=True)
        digest = hashlib.sha256(value.strip().encode("utf-8", "replace")).digest()
        found: TokenSpec | None = None
        for known, spec in self._tokens:
            if hmac.compare_digest(digest, known):
                found = spec  # keep comparing: same work whichever token matched
        if found is None:
            raise Unauthorized("the bearer token is not valid", invalid=True)
        return found

    @staticmethod
    def allows(token: TokenSpec, need: RouteRole) -> bool:
        if need in ("any", "public") or "admin" in token.roles:
            return True
        return need in token.roles

    def check(self, request: web.Request, need: RouteRole) -> TokenSpec | None:
        """The token of ``request`` when it may call a route needing ``need``;
        raises Unauthorized / Forbidden. None for public routes."""
        if need == "public":
            return None
        token = self.authenticate(request.headers.get("Authorization"))
        if not self.allows(token, need):
            raise Forbidden(
                f"token {token.name!r} (roles {', '.join(token.roles)}) may not "
                f"{request.method} {request.path}: it needs the {need!r} role",
                needs=need,
            )
        return token


def route_key(request: web.Request) -> tuple[str, str] | None:
    """``(METHOD, canonical path)`` of the matched route (HEAD as GET), None
    when no route matched (404/405)."""
    resource = request.match_info.route.resource
    if resource is None:
        return None
    method = request.method.upper()
    return ("GET" if method == "HEAD" else method, resource.canonical)


def role_needed(app: web.Application, auth: TokenAuth, request: web.Request) -> RouteRole:
    key = route_key(request)
    if key is None:
        return "any"
    if key[0] == "GET" and key[1] in auth.public:
        return "public"
    roles: dict[tuple[str, str], RouteRole] = app.get(ROUTE_ROLES, {})
    return roles.get(key, "admin")


def auth_middleware(
    spec: AuthSpec,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    auth = TokenAuth(spec)

    @web.middleware
    async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        auth.check(request, role_needed(request.app, auth, request))
        return await handler(request)

    return _auth
