"""The one bearer-token middleware (:class:`BearerAuth`), in front of the
router, the collector's OTLP/HTTP side and the dashboard.

Pure ASGI, in front of every route (a route added later cannot forget it):
with a credential set, an HTTP request without the right ``Authorization:
Bearer`` header gets 401 (``WWW-Authenticate: Bearer``), a websocket is
closed before it is accepted (code :data:`WS_POLICY`; the server answers
403), and nothing behind it runs: no body read, no span, nothing written.
What the three services word differently are parameters:

* ``exempt=``: paths that pass without a token (liveness: ``/health``,
  ``/healthz``, Streamlit's ``/_stcore/health``), with
  :data:`DETAILS_SCOPE_KEY` set in the scope: True when the header opens the
  read role (the health details);
* ``body=``: what a refusal says (:class:`Refusal` in, content type and
  bytes out): the collector a google.rpc.Status-like JSON
  (:func:`json_body`), the router an OpenAI-style error, the dashboard its
  sign-in page or a JSON line; ``realm=`` names the server in
  ``WWW-Authenticate``;
* ``role_of=``: the role a request needs (the collector: ingest on
  ``/v1/traces``, read elsewhere; the router per route); None: only the
  all-roles token opens anything. ``also=``: more credentials per role (the
  router's API key opens its OpenAI routes and ``/metrics``);
  ``open_roles=``: roles open while none of their credentials is set (the
  router's ``api``: an admin token alone does not close the OpenAI routes).
  Every other role without a credential is closed once any is set;
* ``signed_in=``: another credential a request may carry (the dashboard's
  session cookie), checked first;
* ``backoff=``: the client slowing policy (:mod:`frontdoor.backoff`):
  a blocked client gets 429 with ``Retry-After`` and its token is not
  compared; ``count_missing=False`` counts and slows only requests that
  carry a bearer token (the dashboard: a browser's first visit has none, and
  gets the sign-in page);
* ``on_reject=``: called with the scope of each refusal (a counter); an
  exception in it is swallowed.

With no credential at all (no token, nothing in ``also``) everything passes
untouched (loopback; the bind check refuses that beyond it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from frontdoor.backoff import Backoff, FailureBackoff
from frontdoor.credentials import ROLE_ENV, ROLES, Security, bearer_of, opens

#: Paths a :class:`BearerAuth` lets through without a token by default (liveness probes).
DEFAULT_EXEMPT = ("/health", "/healthz")
#: The ASGI scope key a :class:`BearerAuth` sets on exempt paths: True when
#: the request may see details (health), i.e. it proved the read role, or the
#: server asks for no credential at all.
DETAILS_SCOPE_KEY = "kvlens.details"
#: The websocket close code of a refusal (RFC 6455: policy violation).
WS_POLICY = 1008


@dataclass(frozen=True)
class Refusal:
    """A refused request, for a ``body=`` to word: ``status`` 401 (``why``:
    ``missing`` or ``wrong``; ``role``: what the route needs) or 429
    (``wait_s``: how long its client must wait); ``message``: kvlens' own
    words for it."""

    status: int
    message: str
    why: str = ""
    role: str | None = None
    wait_s: float = 0.0

    @property
    def retry_after_s(self) -> int:
        """Whole seconds for ``Retry-After`` (at least 1)."""
        return max(1, math.ceil(self.wait_s))


#: What a refusal says: (scope, refusal) -> (content type, body).
Body = Callable[[dict, Refusal], tuple[bytes, bytes]]


def json_body(scope: dict, refusal: Refusal) -> tuple[bytes, bytes]:
    """The default body: ``{"code": 16, "message": ...}`` (google.rpc
    UNAUTHENTICATED; 8, RESOURCE_EXHAUSTED, for a 429)."""
    code = 8 if refusal.status == 429 else 16
    return b"application/json", json.dumps({"code": code, "message": refusal.message}).encode()


def header(scope: dict, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) of an ASGI request, or None."""
    for k, v in scope.get("headers") or ():
        if k == name:
            return v
    return None


def authorization(scope: dict) -> bytes | None:
    """The request's ``Authorization`` header, or None."""
    return header(scope, b"authorization")


def client_of(scope: dict) -> str:
    """The address a request came from (the backoff's key)."""
    c = scope.get("client")
    return str(c[0]) if c else "?"


async def respond(
    send, status: int, body: bytes, content_type: bytes = b"application/json", headers: Iterable = ()
) -> None:
    """A whole answer on an ASGI ``send``, never cached (``Cache-Control: no-store``)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_refusal(send, refusal: Refusal, answer: tuple[bytes, bytes], realm: str) -> None:
    """A refusal's answer (``answer``: content type, body) with
    ``WWW-Authenticate: Bearer realm=...`` and, on a 429, ``Retry-After``."""
    headers = [(b"www-authenticate", f'Bearer realm="{realm}"'.encode())]
    if refusal.status == 429:
        headers.append((b"retry-after", str(refusal.retry_after_s).encode()))
    await respond(send, refusal.status, answer[1], answer[0], headers)


def unauthenticated(why: str, role: str | None, need_missing: bool) -> Refusal:
    """A 401: what was wrong, and which token the route needs when none is set (``need_missing``)."""
    need = ""
    if role in ROLES and need_missing:
        need = f"; this route needs the {role} token (--{role}-token-file or ${ROLE_ENV[role]}) and none is set"
    message = f"unauthenticated: {why} bearer token (send Authorization: Bearer TOKEN){need}"
    return Refusal(401, message, why=why, role=role)


def too_many(wait_s: float) -> Refusal:
    """A 429 for a client that must wait ``wait_s`` seconds."""
    secs = max(1, math.ceil(wait_s))
    return Refusal(429, f"too many refused credentials from this client; retry after {secs} s", wait_s=wait_s)


class BearerAuth:
    """The bearer-token middleware (module docstring for each parameter).
    Runs on the server's event loop; ``backoff`` (default a fresh
    :class:`~frontdoor.backoff.FailureBackoff`, thread-safe) must suit it."""

    def __init__(
        self,
        app: Any,
        security: Security,
        *,
        exempt: Iterable[str] = DEFAULT_EXEMPT,
        body: Body = json_body,
        realm: str = "kvlens",
        role_of: Callable[[dict], str | None] | None = None,
        also: Mapping[str, Iterable[bytes]] | None = None,
        open_roles: Iterable[str] = (),
        signed_in: Callable[[dict], bool] | None = None,
        backoff: Backoff | None = None,
        count_missing: bool = True,
        on_reject: Callable[[dict], None] | None = None,
    ) -> None:
        self.app = app
        self.security = security
        self.exempt = frozenset(exempt)
        self.body = body
        self.realm = realm
        self.role_of = role_of
        self.also = {role: tuple(c for c in creds if c) for role, creds in (also or {}).items()}
        self.open_roles = frozenset(open_roles)
        self.signed_in = signed_in
        self.backoff = backoff if backoff is not None else FailureBackoff()
        self.count_missing = count_missing
        self.on_reject = on_reject
        #: nothing to check: every request passes
        self.open = not security.any_token and not any(self.also.values())

    def credentials(self, role: str | None) -> tuple[bytes, ...]:
        """What opens ``role``: its token, the all-roles token and ``also``'s."""
        return (*self.security.credentials(role), *self.also.get(role, ()))

    def allows(self, role: str | None, auth_header: bytes | None) -> bool:
        """True when ``auth_header`` opens ``role``; a role with no credential
        is open only while nothing is set at all, or when it is one of ``open_roles``."""
        creds = self.credentials(role)
        if not creds:
            return self.open or role in self.open_roles
        return opens(auth_header, creds)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        exempt = scope.get("path") in self.exempt
        if self.open:
            if exempt:
                scope[DETAILS_SCOPE_KEY] = True
            await self.app(scope, receive, send)
            return
        auth_header = authorization(scope)
        if exempt:
            scope[DETAILS_SCOPE_KEY] = self.allows("read", auth_header)
            await self.app(scope, receive, send)
            return
        if self.signed_in is not None and self.signed_in(scope):
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        presented = bearer_of(auth_header) is not None
        counted = presented or self.count_missing
        wait = self.backoff.wait(client) if counted else 0.0
        role = self.role_of(scope) if self.role_of is not None else None
        if wait <= 0 and self.allows(role, auth_header):
            if presented:
                self.backoff.succeeded(client)
            await self.app(scope, receive, send)
            return
        self._rejected(scope)
        if wait <= 0 and counted:
            self.backoff.failed(client)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": WS_POLICY})
            return
        if wait > 0:
            refusal = too_many(wait)
        else:
            why = "missing" if auth_header is None else "wrong"
            refusal = unauthenticated(why, role, not self.credentials(role))
        await send_refusal(send, refusal, self.body(scope, refusal), self.realm)

    def _rejected(self, scope: dict) -> None:
        if self.on_reject is None:
            return
        try:
            self.on_reject(scope)
        except Exception:  # a counter must not turn a 401 into a 500
            pass
