"""The dashboard's front door: a bearer token checked before Streamlit sees
a request (:class:`TokenGate`, pure ASGI middleware on ``st.App``, see
``dashboard/serve.py``). The token check itself is the services' one
(:class:`frontdoor.bearer.BearerAuth`); what is the dashboard's own is how a
browser signs in: the form, ``?token=``, the session cookie.

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

Guessing is slowed (:class:`frontdoor.backoff.SignInBackoff`): a wrong
token in the form, in ``?token=`` or in ``Authorization`` counts against the
client's address; after :data:`~frontdoor.backoff.SIGNIN_FREE` of them, each
further attempt from that address gets 429 with ``Retry-After`` (2 s,
doubling per failure, at most :data:`~frontdoor.backoff.SIGNIN_MAX_S`) and
its token is not compared. A request with no token at all (a browser's
first visit) is no guess: not counted, and answered with the form. A valid
session cookie still passes (it is not guessable). The key is the address
the server sees: behind a reverse proxy every user shares the proxy's.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from frontdoor.backoff import SignInBackoff
from frontdoor.bearer import BearerAuth, Refusal, client_of, header, respond, send_refusal
from frontdoor.credentials import Security, matches

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
#: The realm of ``WWW-Authenticate`` in every refusal.
REALM = "kvlens dashboard"
_LABEL = b"kvlens dashboard session v1"
_NOT_OURS = "That token is not this dashboard's."


def session_value(token: bytes) -> str:
    """The cookie's value for ``token``: HMAC-SHA256(token, label), hex."""
    return hmac.new(token, _LABEL, hashlib.sha256).hexdigest()


def _cookie(scope: dict, name: str) -> str | None:
    raw = header(scope, b"cookie")
    if not raw:
        return None
    for part in raw.decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


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


def _answer(scope: dict, next_path: str, problem: str | None) -> tuple[bytes, bytes]:
    """A refusal's content type and body: the sign-in form (going back to
    ``next_path``) for a browser, a JSON line otherwise."""
    accept = (header(scope, b"accept") or b"").decode("latin-1")
    if "text/html" in accept:
        return b"text/html; charset=utf-8", _login_page(safe_next(next_path), problem)
    msg = problem or "unauthorized: send Authorization: Bearer TOKEN, or sign in from a browser"
    return b"application/json", json.dumps({"error": msg}).encode()


def _wait_problem(refusal: Refusal) -> str:
    return f"Too many wrong tokens from this address: try again in {refusal.retry_after_s} s."


def _refusal_body(scope: dict, refusal: Refusal) -> tuple[bytes, bytes]:
    """What :class:`~frontdoor.bearer.BearerAuth` answers for the dashboard:
    the form going back to the page asked for (401), or to ``/`` with the
    wait (429)."""
    if refusal.status == 429:
        return _answer(scope, "/", _wait_problem(refusal))
    query = scope.get("query_string", b"").decode("latin-1")
    return _answer(scope, (scope.get("path") or "/") + (f"?{query}" if query else ""), None)


class TokenGate:
    """Pure ASGI middleware: with ``token`` set (bytes), an HTTP request or a
    websocket passes only with ``Authorization: Bearer <token>`` or the
    session cookie; everything else gets 401 (a login page for a browser, a
    JSON body otherwise; a websocket is closed before it is accepted, which
    the server answers 403). Handles :data:`LOGIN_PATH`, :data:`LOGOUT_PATH`
    and ``?token=`` itself (module docstring); every other request goes
    through the services' bearer check (:class:`frontdoor.bearer.BearerAuth`,
    the cookie as its ``signed_in``). A client address that sent too many
    wrong tokens gets 429 (``backoff``, :class:`~frontdoor.backoff.SignInBackoff`).
    ``token=None`` passes everything through untouched (loopback, or
    ``--insecure``)."""

    def __init__(self, app: Any, token: bytes | None = None, backoff: SignInBackoff | None = None) -> None:
        self.app = app
        self.token = token
        self.session = session_value(token) if token else None
        self.backoff = backoff if backoff is not None else SignInBackoff()
        self.bearer = BearerAuth(
            app,
            Security(token=token),
            exempt=EXEMPT,
            body=_refusal_body,
            realm=REALM,
            signed_in=self._session_ok,
            backoff=self.backoff,
            count_missing=False,
        )

    def _session_ok(self, scope: dict) -> bool:
        cookie = _cookie(scope, COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("latin-1"), self.session.encode())

    def _token_ok(self, scope: dict, given: bytes) -> bool:
        """Compare a token the client sent in the form or ``?token=`` (the
        caller checked the backoff), as the bearer check does; count the result."""
        if matches(given, (self.token,)):
            self.backoff.succeeded(client_of(scope))
            return True
        self.backoff.failed(client_of(scope))
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
        if kind == "http" and path not in EXEMPT:
            params = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            if any(k == "token" for k, _ in params):
                await self._token_in_url(scope, send, path, params)
                return
        await self.bearer(scope, receive, send)

    async def _token_in_url(self, scope: dict, send, path: str, params: list[tuple[str, str]]) -> None:
        """``?token=``: the cookie and a redirect to the URL without it (a
        path on this site: :func:`safe_next`), or 401 (429 while the client waits)."""
        given = next(v for k, v in params if k == "token").encode("utf-8", "replace")
        rest = [(k, v) for k, v in params if k != "token"]
        target = safe_next(path + (f"?{urlencode(rest)}" if rest else ""))
        await self._sign_in(scope, send, given, target)

    async def _login(self, scope: dict, receive, send) -> None:
        """POST of the login form: the cookie and a redirect, or the form
        again with 401 (429 while the client waits)."""
        if scope.get("method") != "POST":
            await self._refuse(scope, send, Refusal(401, "sign in with a POST of the form"), "/", None)
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
                await respond(send, 413, b"login form too large", b"text/plain; charset=utf-8")
                return
        form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        given = form.get("token", "").strip().encode("utf-8", "replace")
        await self._sign_in(scope, send, given, safe_next(form.get("next")))

    async def _sign_in(self, scope: dict, send, given: bytes, target: str) -> None:
        """A token from the form or ``?token=``: the cookie and a redirect to
        ``target``; 401 and the form again when it is wrong (or empty); 429,
        nothing compared, while the client waits."""
        wait = self.backoff.wait(client_of(scope))
        if wait:
            refusal = Refusal(429, "too many wrong tokens", wait_s=wait)
            await self._refuse(scope, send, refusal, target, _wait_problem(refusal))
        elif given and self._token_ok(scope, given):
            await _redirect(send, target, [self._set_cookie(scope)])
        else:
            await self._refuse(scope, send, Refusal(401, _NOT_OURS, why="wrong"), target, _NOT_OURS)

    async def _refuse(self, scope: dict, send, refusal: Refusal, next_path: str, problem: str | None) -> None:
        await send_refusal(send, refusal, _answer(scope, next_path, problem), REALM)


async def _redirect(send, location: str, extra: list) -> None:
    headers = [
        (b"location", location.encode("latin-1", "replace")),
        (b"content-length", b"0"),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
