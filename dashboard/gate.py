"""The dashboard's front door: a bearer token checked before Streamlit sees
a request (:class:`TokenGate`, pure ASGI middleware on ``st.App``, see
``dashboard/serve.py``).

Why a middleware and not a check inside the page: a Streamlit script runs
only once the browser has loaded Streamlit's JavaScript and opened its
websocket (``/_stcore/stream``); a check there (``st.context.headers``,
cookies) would still serve the static files, the host config, media and the
websocket itself to anyone, and would rely on every page calling it. Streamlit's
``st.App(..., middleware=[...])`` (1.67, the version pyproject requires) runs our ASGI middleware in
front of every route Streamlit serves, the websocket included, on
Streamlit's own server (its TLS, ``server.sslCertFile``). So nothing is
served without the token: not a page, not a script, not the websocket.

How a browser logs in. A browser cannot be told to send an
``Authorization`` header, so the gate also accepts a session cookie:

* ``GET`` of any page without credentials answers 401 with a small login
  form; the form POSTs the token to :data:`LOGIN_PATH`, which sets the
  cookie and redirects (303) to the page asked for. The token is never in a
  URL that way.
* ``?token=TOKEN`` on any URL also works (a link for a colleague, a
  bookmark): the gate sets the cookie and redirects (303) to the same URL
  without ``token``, so the page, Streamlit's query params and the address
  bar never hold it (the first request's URL may still be in the browser's
  history and in a proxy's access log: prefer the form).
* ``Authorization: Bearer TOKEN`` works for scripts and ``curl``.

The cookie (:data:`COOKIE`) holds HMAC-SHA256(token, a fixed label), not the
token: a stolen cookie opens this dashboard but does not reveal a token the
collector or the router may share; changing the token ends every session.
It is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's
page sends it, so no cross-site websocket), ``Path=/``, ``Secure`` when the
request came over TLS, and a session cookie (gone when the browser closes).
Every comparison is constant time (:func:`hmac.compare_digest`).

``/_stcore/health`` stays open (it answers ``ok`` and nothing else) for
load balancers and ``kvlens dashboard``'s own readiness check.

Where a sign-in goes back to (the form's ``next``, the ``?token=`` URL
without its token) is a path on this site or ``/`` (:func:`safe_next`): a
browser strips tabs and newlines from a URL, so ``/<TAB>/evil.example/``
would take it to ``//evil.example/``, another site.

Guessing is slowed (:class:`SignInBackoff`): a wrong token in the form, in
``?token=`` or in ``Authorization`` counts against the client's address;
after :data:`BACKOFF_FREE` of them, each further attempt from that address
gets 429 with ``Retry-After`` (2 s, doubling per failure, at most
:data:`BACKOFF_MAX_S`) and its token is not compared. A valid session
cookie still passes (it is not guessable). The key is the address the
server sees: behind a reverse proxy every user shares the proxy's.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import math
import time
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit

#: Paths served without a token: Streamlit's liveness probe (answers "ok").
EXEMPT = frozenset({"/_stcore/health"})
#: Where the login form posts the token (handled here, never reaches Streamlit).
LOGIN_PATH = "/_kvlens/login"
#: Ends the session: clears the cookie.
LOGOUT_PATH = "/_kvlens/logout"
#: The session cookie's name.
COOKIE = "kvlens_session"
#: A login form body larger than this is refused (a token is < 1 KiB).
MAX_FORM_BYTES = 8 * 1024
_LABEL = b"kvlens dashboard session v1"
#: Wrong tokens one client address may send before it must wait (:class:`SignInBackoff`).
BACKOFF_FREE = 5
#: The first wait after :data:`BACKOFF_FREE` failures; it doubles per further failure, up to :data:`BACKOFF_MAX_S`.
BACKOFF_FIRST_S = 2.0
BACKOFF_MAX_S = 300.0
#: A client's failures are forgotten after this long without one (longer than the longest wait).
BACKOFF_FORGET_S = 600.0
#: Client addresses remembered at most (the least recently failing one is dropped first).
BACKOFF_CLIENTS = 4096


def session_value(token: bytes) -> str:
    """The cookie's value for ``token``: HMAC-SHA256(token, label), hex."""
    return hmac.new(token, _LABEL, hashlib.sha256).hexdigest()


def _header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return v
    return None


def _cookie(scope: dict, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    for part in raw.decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


def _bearer(header: bytes | None) -> bytes | None:
    if not header:
        return None
    scheme, _, given = header.strip().partition(b" ")
    return given.strip() if scheme.lower() == b"bearer" else None


def safe_next(target: str | None) -> str:
    """Where to send a browser after it signed in: ``target`` when it is a
    path on this site, else ``/``. A path means: it starts with one ``/``,
    holds no character below 0x21 and no DEL (browsers strip tabs and
    newlines from URLs, so ``/<TAB>/evil.example`` would become
    ``//evil.example``, another host) and no ``\\`` (browsers read it as
    ``/``), and once a browser's stripping is applied (tab, CR, LF removed)
    :func:`urllib.parse.urlsplit` finds no scheme and no host in it."""
    if not target or not target.startswith("/"):
        return "/"
    if "\\" in target or any(ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        return "/"
    stripped = target.replace("\t", "").replace("\r", "").replace("\n", "")
    if stripped.startswith("//"):  # scheme-relative: another host, whatever urlsplit says of ///x
        return "/"
    parts = urlsplit(stripped)
    if parts.scheme or parts.netloc:
        return "/"
    return target


class SignInBackoff:
    """Wrong tokens per client address (module docstring): after ``free``
    failures, each further one makes that address wait ``first_s`` seconds,
    doubling, at most ``max_s``; a client without a failure for ``forget_s``
    starts afresh, and a correct token clears it. At most ``max_clients``
    addresses are kept (least recently failing dropped first), so a flood of
    addresses cannot grow it. Event loop only (Streamlit's server has one)."""

    def __init__(
        self,
        free: int = BACKOFF_FREE,
        first_s: float = BACKOFF_FIRST_S,
        max_s: float = BACKOFF_MAX_S,
        forget_s: float = BACKOFF_FORGET_S,
        max_clients: int = BACKOFF_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.first_s, self.max_s, self.forget_s = free, first_s, max_s, forget_s
        self.max_clients, self.clock = max_clients, clock
        self._seen: OrderedDict[str, list[float]] = OrderedDict()  # client -> [failures, last failure, wait until]

    def wait(self, client: str) -> float:
        """Seconds ``client`` must still wait before a token of it is compared (0: none)."""
        e = self._seen.get(client)
        return 0.0 if e is None else max(0.0, e[2] - self.clock())

    def failed(self, client: str) -> None:
        """One wrong token from ``client``."""
        now = self.clock()
        e = self._seen.get(client)
        if e is None or now - e[1] >= self.forget_s:
            e = self._seen[client] = [0, now, now]
        e[0] += 1
        e[1] = now
        if e[0] >= self.free:
            e[2] = now + min(self.max_s, self.first_s * 2 ** min(e[0] - self.free, 32))
        self._seen.move_to_end(client)
        while len(self._seen) > self.max_clients:
            self._seen.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """``client`` gave the right token: its failures are forgotten."""
        self._seen.pop(client, None)

    def __len__(self) -> int:
        return len(self._seen)


def _client(scope: dict) -> str:
    c = scope.get("client")
    return str(c[0]) if c else "?"


def _login_page(next_path: str, problem: str | None) -> bytes:
    note = f'<p class="err">{html.escape(problem)}</p>' if problem else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvlens dashboard: sign in</title>
<meta name="viewport" content="width=device-width,initial-scale=1">
<style>body{{font-family:sans-serif;max-width:28rem;margin:4rem auto;padding:0 1rem}}
input{{width:100%;padding:.5rem;margin:.5rem 0;box-sizing:border-box}}.err{{color:#b00}}</style></head>
<body><h1>kvlens dashboard</h1>
<p>This dashboard needs its token (the one <code>kvlens dashboard</code> was given in
<code>$KVLENS_TOKEN</code> or <code>--token-file</code>).</p>{note}
<form method="post" action="{LOGIN_PATH}">
<input type="password" name="token" autocomplete="current-password" placeholder="token" autofocus required>
<input type="hidden" name="next" value="{html.escape(next_path, quote=True)}">
<input type="submit" value="Sign in"></form></body></html>""".encode()


class TokenGate:
    """Pure ASGI middleware: with ``token`` set (bytes), an HTTP request or a
    websocket passes only with ``Authorization: Bearer <token>`` or the
    session cookie; everything else gets 401 (a login page for a browser, a
    JSON body otherwise; a websocket is closed before it is accepted, which
    the server answers 403). Handles :data:`LOGIN_PATH`, :data:`LOGOUT_PATH`
    and ``?token=`` itself (module docstring). A client address that sent
    too many wrong tokens gets 429 (``backoff``, :class:`SignInBackoff`).
    ``token=None`` passes everything through untouched (loopback, or
    ``--insecure``)."""

    def __init__(self, app: Any, token: bytes | None = None, backoff: SignInBackoff | None = None) -> None:
        self.app = app
        self.token = token
        self.session = session_value(token) if token else None
        self.backoff = backoff if backoff is not None else SignInBackoff()

    def _session_ok(self, scope: dict) -> bool:
        cookie = _cookie(scope, COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("latin-1"), self.session.encode())

    def _token_ok(self, scope: dict, given: bytes) -> bool:
        """Compare a token the client sent (the caller checked the backoff); count the result."""
        if hmac.compare_digest(given, self.token):
            self.backoff.succeeded(_client(scope))
            return True
        self.backoff.failed(_client(scope))
        return False

    def _set_cookie(self, scope: dict) -> tuple[bytes, bytes]:
        secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
        return (b"set-cookie", f"{COOKIE}={self.session}; Path=/; HttpOnly; SameSite=Strict{secure}".encode())

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if self.token is None or kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path") or "/"
        if kind == "http" and path == LOGIN_PATH:
            await self._login(scope, receive, send)
            return
        if kind == "http" and path == LOGOUT_PATH:
            clear = (b"set-cookie", f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict".encode())
            await _redirect(send, "/", [clear])
            return
        if path in EXEMPT:
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        params = parse_qsl(query, keep_blank_values=True)
        if kind == "http" and any(k == "token" for k, _ in params):
            await self._token_in_url(scope, send, path, params)
            return
        if self._session_ok(scope):
            await self.app(scope, receive, send)
            return
        given = _bearer(_header(scope, b"authorization"))
        wait = self.backoff.wait(_client(scope)) if given is not None else 0.0
        if given is not None and not wait and self._token_ok(scope, given):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if wait:
            await self._too_many(scope, send, "/", wait)
            return
        await self._refuse(scope, send, path + (f"?{query}" if query else ""), None)

    async def _token_in_url(self, scope: dict, send, path: str, params: list[tuple[str, str]]) -> None:
        """``?token=``: the cookie and a redirect to the URL without it (a
        path on this site: :func:`safe_next`), or 401 (429 while the client waits)."""
        given = next(v for k, v in params if k == "token").encode("utf-8", "replace")
        rest = [(k, v) for k, v in params if k != "token"]
        target = safe_next(path + (f"?{urlencode(rest)}" if rest else ""))
        wait = self.backoff.wait(_client(scope))
        if wait:
            await self._too_many(scope, send, target, wait)
        elif self._token_ok(scope, given):
            await _redirect(send, target, [self._set_cookie(scope)])
        else:
            await self._refuse(scope, send, target, "That token is not this dashboard's.")

    async def _login(self, scope: dict, receive, send) -> None:
        """POST of the login form: the cookie and a redirect, or the form
        again with 401 (429 while the client waits)."""
        if scope.get("method") != "POST":
            await self._refuse(scope, send, "/", None)
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > MAX_FORM_BYTES:
                await _respond(send, 413, b"login form too large", b"text/plain; charset=utf-8")
                return
        form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        target = safe_next(form.get("next"))
        given = form.get("token", "").strip().encode("utf-8", "replace")
        wait = self.backoff.wait(_client(scope))
        if wait:
            await self._too_many(scope, send, target, wait)
        elif given and self._token_ok(scope, given):
            await _redirect(send, target, [self._set_cookie(scope)])
        else:
            await self._refuse(scope, send, target, "That token is not this dashboard's.")

    async def _too_many(self, scope: dict, send, next_path: str, wait: float) -> None:
        """429 with ``Retry-After``: the client sent too many wrong tokens; nothing was compared."""
        secs = max(1, math.ceil(wait))
        problem = f"Too many wrong tokens from this address: try again in {secs} s."
        await self._refuse(scope, send, next_path, problem, 429, [(b"retry-after", str(secs).encode())])

    async def _refuse(
        self, scope: dict, send, next_path: str, problem: str | None, status: int = 401, more: list | None = None
    ) -> None:
        accept = (_header(scope, b"accept") or b"").decode("latin-1")
        extra = [(b"www-authenticate", b'Bearer realm="kvlens dashboard"'), *(more or [])]
        if "text/html" in accept:
            body = _login_page(safe_next(next_path), problem)
            await _respond(send, status, body, b"text/html; charset=utf-8", extra)
            return
        msg = problem or "unauthorized: send Authorization: Bearer TOKEN, or sign in from a browser"
        await _respond(send, status, json.dumps({"error": msg}).encode(), b"application/json", extra)


async def _respond(send, status: int, body: bytes, ctype: bytes, extra: list | None = None) -> None:
    headers = [
        (b"content-type", ctype),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _redirect(send, location: str, extra: list) -> None:
    headers = [
        (b"location", location.encode("latin-1", "replace")),
        (b"content-length", b"0"),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
