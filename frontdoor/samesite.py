"""What a browser could make a kvlens server do on a page's behalf: the
guard against cross-site requests and DNS rebinding (issue 42, item 5),
shared by the router (``kvlens proxy``, ``kvlens up``'s router) and the
collector (``kvlens collect``), in front of their bearer check
(:mod:`frontdoor.bearer`).

A server on loopback with no token trusts everyone who reaches it, and a
web page the operator opens reaches it: a form can POST ``text/plain`` to
``http://127.0.0.1:8000/admin/split`` (a "simple" request: no CORS
preflight), and a name the attacker controls can be re-pointed at
127.0.0.1 (DNS rebinding), after which the page reads the answers too.
:class:`SameSiteGuard`, an ASGI middleware in front of everything, refuses
what a browser would send in those cases and a real client does not:

* **Host** must name this server: a loopback name (``localhost``,
  ``*.localhost``), a loopback address, the bind address, or a name given
  with ``--allowed-host``. A rebinding page's requests carry the attacker's
  name. An IP literal cannot be rebound, so a server bound to a wildcard
  or another non-loopback address accepts any address; it accepts any name
  too unless ``--allowed-host`` names some (clients beyond loopback reach
  it by names it cannot know; the token guards it there). 403 otherwise.
* **Origin**, where a request has one (browsers send it on cross-site
  POSTs, fetches and websockets; other clients do not), must be this very
  server (``scheme://`` + the Host header). 403 otherwise; ``null`` too.
* **POST bodies** must be ``application/json`` (and, on ``/v1/traces``, the
  OTLP/HTTP ``application/x-protobuf``): a form's ``text/plain``,
  ``multipart/form-data`` and ``application/x-www-form-urlencoded`` are the
  types a page may send without a preflight. 415 otherwise, before the body
  is read.

Refusals are one JSON line naming what was wrong (``body(status, message)``
shapes it: the router answers OpenAI-style, the collector a google.rpc.Status).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Iterable

from frontdoor.bearer import respond
from frontdoor.credentials import is_loopback

#: POST content types per path; every other path takes :data:`JSON_TYPES`.
JSON_TYPES = frozenset({"application/json"})
OTLP_TYPES = frozenset({"application/json", "application/x-protobuf"})
#: Methods that carry a body a page could forge (GET/HEAD are read-only here).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"code": status, "message": message}).encode()


def _is_ip(h: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(h)
        return True
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The host name of a Host header's value (``[::1]:8000`` -> ``::1``), lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


class SameSiteGuard:
    """Pure ASGI middleware (module docstring). ``bind_host``: the address
    the server listens on; ``allowed_hosts``: names clients may use besides
    loopback ones; ``post_types``: path -> allowed media types of a POST
    (others: :data:`JSON_TYPES`); ``body``: the refusal body."""

    def __init__(
        self,
        app,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        *,
        post_types: dict[str, frozenset[str]] | None = None,
        body: Callable[[int, str], bytes] = _error_body,
    ) -> None:
        self.app = app
        self.bind = _split_host(bind_host) if bind_host else ""
        self.allowed = frozenset(h.strip().lower() for h in allowed_hosts if h.strip())
        self.post_types = post_types or {}
        self.body = body
        wildcard = self.bind in ("", "0.0.0.0", "::")
        #: names not listed pass: the server is reached beyond loopback by names it cannot know
        self.any_name = (wildcard or not is_loopback(self.bind)) and not self.allowed
        self.any_ip = wildcard or not is_loopback(self.bind)

    def host_ok(self, host: str) -> bool:
        h = _split_host(host)
        if not h:
            return False
        if h == "localhost" or h.endswith(".localhost") or h in self.allowed or h == self.bind:
            return True
        if _is_ip(h):
            return is_loopback(h) or self.any_ip
        return self.any_name

    def problem(self, scope: dict) -> tuple[int, str] | None:
        """(status, message) of what is wrong with this request, or None."""
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k, v.decode("latin-1"))
        host = headers.get(b"host", "")
        if not self.host_ok(host):
            return 403, (
                f"Host {host[:80]!r} is not a name of this server (a loopback name, {self.bind or 'its address'}"
                + (f", {', '.join(sorted(self.allowed))}" if self.allowed else "")
                + "); give the name clients use with --allowed-host"
            )
        origin = headers.get(b"origin")
        if origin is not None:
            u = urllib.parse.urlsplit(origin.strip())
            if origin.strip().lower() == "null" or not u.netloc or u.netloc.lower() != host.strip().lower():
                return 403, f"cross-site request refused: Origin {origin[:80]!r} is not this server ({host[:80]})"
        if scope.get("type") == "http" and scope.get("method") in BODY_METHODS:
            ctype = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
            want = self.post_types.get(scope.get("path", ""), JSON_TYPES)
            if ctype not in want:
                return 415, (
                    f"Content-Type {ctype or '(none)'!r} refused: send {' or '.join(sorted(want))} "
                    "(a form's types would let any web page post here)"
                )
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        bad = self.problem(scope)
        if bad is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await respond(send, bad[0], self.body(*bad))


def add_arguments(p) -> None:
    """``--allowed-host NAME`` (repeatable) on a server's parser."""
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients reach this server by (the Host header); repeat for several. "
        "Requests naming another host are refused (403: DNS rebinding). Loopback names and "
        "addresses and the bind address always pass; beyond loopback any name passes unless this is given",
    )
