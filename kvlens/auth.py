"""The front door of everything kvlens serves: a bearer token and TLS, shared
by the collector (HTTP and gRPC), the router and the dashboard.

The token comes from the environment (:data:`TOKEN_ENV`) or from a file
(``--token-file``), never from a flag value: ``ps`` shows every process's
argv to every user of the host. It is compared in constant time
(:func:`hmac.compare_digest`). A server bound beyond loopback must have a
token, or be told ``--insecure`` explicitly (:func:`from_args` refuses
otherwise), so "listening on 0.0.0.0 for anyone" is never a default.

Decisions, and why:

* ``--token-file`` wins over ``$KVLENS_TOKEN`` when both are set. The
  variable is also what kvlens *clients* send (:func:`client_headers`: the
  router exporting its spans, a benchmark), so it may be present for the
  client side of a process that listens with its own token; an explicit flag
  names the intent. ``--help`` says so.
* A token file that others (group or world) can read is a warning, not a
  refusal: Kubernetes and Docker mount secrets 0644 by default, inside a
  directory only the pod reads, and refusing would break that common
  deployment. The warning names the file and the ``chmod`` that silences it.
* Leading and trailing whitespace of the token (a file's newline) is
  stripped; a token with whitespace or control characters inside is refused
  (it could not travel in an HTTP header or gRPC metadata), and so is one
  under :data:`MIN_TOKEN_CHARS` characters (guessable).
* Credentials are scoped by role (issue 42): an **ingest** token (exporters
  -> ``/v1/traces`` and gRPC ``Export``), a **read** token (``/metrics``,
  health details, the dashboard), an **admin** token (``/admin/*``), each
  from ``--<role>-token-file`` or ``$KVLENS_<ROLE>_TOKEN``
  (:data:`ROLE_ENV`). ``$KVLENS_TOKEN`` / ``--token-file`` stays the
  one-token shortcut: it opens every role. Once any credential is set, a
  route whose role has none is closed (401 naming the token it needs),
  never open: setting an admin token alone does not open ``/metrics``.
* Repeated failures from one client (its address) are slowed
  (:class:`FailureBackoff`): after :data:`BACKOFF_FAILURES` refusals in
  :data:`BACKOFF_WINDOW_S` seconds, every guarded request from it gets 429
  with ``Retry-After`` until the window ends, without its token being
  compared (no oracle for a guesser who ignores Retry-After). Memory is
  bounded (:data:`BACKOFF_CLIENTS` clients, least recently failed dropped).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import math
import os
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# TOKEN_ENV ($KVLENS_TOKEN): the bearer token, from the environment (servers: when no --token-file;
# clients: what they send). Defined in the bottom layer, which the OTLP exporters read too.
from kvrecord.config import TOKEN_ENV, client_token

__all__ = [
    "TOKEN_ENV",
    "ROLES",
    "ROLE_ENV",
    "MIN_TOKEN_CHARS",
    "FailureBackoff",
    "DEFAULT_EXEMPT",
    "SecurityError",
    "Security",
    "BearerAuthMiddleware",
    "add_arguments",
    "from_args",
    "is_loopback",
    "token_ok",
    "uvicorn_ssl_kwargs",
    "grpc_credentials",
    "client_token",
    "client_headers",
]

#: Paths a :class:`BearerAuthMiddleware` lets through without a token (liveness probes).
DEFAULT_EXEMPT = ("/health", "/healthz")
#: The scoped credentials: exporters sending spans, readers of metrics and
#: health details, operators changing a router live.
ROLES = ("ingest", "read", "admin")
#: Each role's token in the environment (``--<role>-token-file`` wins, as ``--token-file`` does).
ROLE_ENV = {r: f"KVLENS_{r.upper()}_TOKEN" for r in ROLES}
#: Shorter tokens are refused: 16 random characters are out of reach of guessing over HTTP.
MIN_TOKEN_CHARS = 16
#: The ASGI scope key a :class:`BearerAuthMiddleware` sets: True when the
#: request may see details (health), i.e. it proved the read role, or the
#: server asks for no credential at all.
DETAILS_SCOPE_KEY = "kvlens.details"
#: Refusals of one client within :data:`BACKOFF_WINDOW_S` before it gets 429 (:class:`FailureBackoff`).
BACKOFF_FAILURES = 20
BACKOFF_WINDOW_S = 60.0
#: Clients remembered at most (the least recently failing one is forgotten first).
BACKOFF_CLIENTS = 4096
#: What a client that needs no token is told (RFC 6750).
_CHALLENGE = 'Bearer realm="kvlens"'


class SecurityError(ValueError):
    """A bad security configuration; ``str()`` is one line naming the problem."""


def add_arguments(p: argparse.ArgumentParser, *, client_certs: bool = False, roles: Iterable[str] = ()) -> None:
    """Add ``--token-file``, ``--tls-cert``, ``--tls-key``, ``--insecure`` (and
    ``--tls-client-ca`` when ``client_certs``; ``--<role>-token-file`` for
    each of ``roles``) to ``p``, in a group of their own."""
    g = p.add_argument_group(
        "security",
        f"A bearer token from ${TOKEN_ENV} or --token-file (never a flag value: ps shows\n"
        "argv), and TLS. Listening beyond loopback needs a token or --insecure.",
    )
    g.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help=f"file holding the bearer token clients must send (Authorization: Bearer TOKEN); "
        f"wins over ${TOKEN_ENV} when both are set (default: ${TOKEN_ENV}, else no token); "
        f"it opens every role below. At least {MIN_TOKEN_CHARS} characters",
    )
    for role in roles:
        g.add_argument(
            f"--{role}-token-file",
            metavar="PATH",
            default=None,
            help=f"file holding the {role} token: {_ROLE_HELP[role]} (default: ${ROLE_ENV[role]}; "
            f"the --token-file / ${TOKEN_ENV} token opens it too)",
        )
    g.add_argument(
        "--tls-cert", metavar="PATH", default=None, help="serve TLS with this certificate (PEM; with --tls-key)"
    )
    g.add_argument("--tls-key", metavar="PATH", default=None, help="private key of --tls-cert (PEM)")
    if client_certs:
        g.add_argument(
            "--tls-client-ca",
            metavar="PATH",
            default=None,
            help="require client certificates signed by this CA (PEM; needs --tls-cert)",
        )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding an address other than loopback with no token (anyone who reaches it may use it)",
    )


_ROLE_HELP = {
    "ingest": "what exporters send with their spans (POST /v1/traces, gRPC Export)",
    "read": "what opens /metrics, health details and the dashboard",
    "admin": "what opens /admin/* (the router's live split)",
}


@dataclass(frozen=True)
class Security:
    """What a server checks: ``token`` (bytes, or None; the all-roles
    shortcut), the role tokens ``ingest_token`` / ``read_token`` /
    ``admin_token`` (bytes or None), TLS files (paths or None) and whether
    ``--insecure`` was given. No token at all: no check. Its repr and str
    never show a token."""

    token: bytes | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    insecure: bool = False
    ingest_token: bytes | None = field(default=None, repr=False)
    read_token: bytes | None = field(default=None, repr=False)
    admin_token: bytes | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        tok = "set" if self.token else "None"
        roles = "".join(f", {r}_token=set" for r in ROLES if self.role_token(r))
        return (
            f"Security(token={tok}{roles}, tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}, "
            f"tls_client_ca={self.tls_client_ca!r}, insecure={self.insecure})"
        )

    def role_token(self, role: str) -> bytes | None:
        """``role``'s own token (not the shortcut), or None."""
        return {"ingest": self.ingest_token, "read": self.read_token, "admin": self.admin_token}.get(role)

    def credentials(self, role: str) -> tuple[bytes, ...]:
        """The tokens that open ``role``: its own and the shortcut ``token``."""
        return tuple(t for t in (self.role_token(role), self.token) if t)

    @property
    def any_token(self) -> bool:
        """Some credential is set: every guarded route then needs one."""
        return bool(self.token) or any(self.role_token(r) for r in ROLES)

    def allows(self, role: str, header: str | bytes | None, also: Iterable[bytes] = ()) -> bool:
        """True when the ``Authorization`` header opens ``role`` (its token,
        the shortcut, or one of ``also``: the router's API key), or when no
        credential is set at all (and ``also`` is empty). Constant time in each token."""
        creds = (*self.credentials(role), *also)
        if not creds:
            return not self.any_token
        return opens(header, creds)

    __str__ = __repr__

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http`` (for the address a server prints)."""
        return "https" if self.tls else "http"

    def describe(self) -> str:
        """One line for a server's start-up message, e.g. ``token required, TLS, client certificates required``."""
        parts = ["token required" if self.token else "no token"]
        roles = [r for r in ROLES if self.role_token(r)]
        if roles:
            parts[0] = f"{parts[0]}, role tokens: {', '.join(roles)}"
        parts.append("TLS" if self.tls else "no TLS")
        if self.tls_client_ca:
            parts.append("client certificates required")
        return ", ".join(parts)


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (bracketed or not); False
    for everything else, wildcard addresses and other host names included."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _check_token(raw: bytes, where: str) -> bytes:
    tok = raw.strip()
    if not tok:
        raise SecurityError(f"{where} is empty; put the bearer token in it")
    if any(b <= 0x20 or b >= 0x7F for b in tok):
        raise SecurityError(f"{where}: the token must be printable ASCII with no spaces (it travels in a header)")
    if len(tok) < MIN_TOKEN_CHARS:
        raise SecurityError(
            f"{where}: the token is {len(tok)} characters, under the minimum of {MIN_TOKEN_CHARS} "
            "(guessable); make one with: openssl rand -hex 32"
        )
    return tok


def _read_token_file(path: str, warn: Callable[[str], None], flag: str = "--token-file") -> bytes:
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise SecurityError(f"{flag} {path} is a directory; give the file holding the token")
        raw = Path(path).read_bytes()
    except SecurityError:
        raise
    except OSError as e:
        raise SecurityError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    tok = _check_token(raw, f"{flag} {path}")
    if st.st_mode & 0o077:
        warn(f"warning: {flag} {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 {path}")
    return tok


def _token_from(
    file: str | None, env: Mapping[str, str], var: str, flag: str, warn: Callable[[str], None]
) -> bytes | None:
    """The token in ``file`` (``flag``'s value; it wins), else in ``$var``, else None."""
    if file:
        return _read_token_file(file, warn, flag)
    if env.get(var, "") != "":
        return _check_token(env[var].encode("utf-8", "replace"), f"${var}")
    return None


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise SecurityError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def _stderr(line: str) -> None:
    print(f"kvlens: {line}", file=sys.stderr, flush=True)


def from_args(
    args: argparse.Namespace, host: str, *, env: Mapping[str, str] = os.environ, warn: Callable[[str], None] = _stderr
) -> Security:
    """The :class:`Security` that ``args`` (from :func:`add_arguments`) and
    ``env`` ask for, for a server about to bind ``host``. Raises
    :class:`SecurityError` (one line) on a bad combination; ``warn`` gets the
    warnings (default: stderr)."""
    token_file = getattr(args, "token_file", None)
    cert = getattr(args, "tls_cert", None)
    key = getattr(args, "tls_key", None)
    ca = getattr(args, "tls_client_ca", None)
    insecure = bool(getattr(args, "insecure", False))

    token = _token_from(token_file, env, TOKEN_ENV, "--token-file", warn)
    roles = {
        f"{r}_token": _token_from(getattr(args, f"{r}_token_file", None), env, ROLE_ENV[r], f"--{r}-token-file", warn)
        for r in roles_of(args)
    }

    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise SecurityError(f"{given} needs {missing} as well")
    if ca and not cert:
        raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
        if path:
            _readable(flag, path)

    sec = Security(token=token, tls_cert=cert, tls_key=key, tls_client_ca=ca, insecure=insecure, **roles)
    for r in roles_of(args):
        if sec.any_token and not sec.credentials(r):
            warn(
                f"warning: no {r} token (--{r}-token-file, ${ROLE_ENV[r]} or ${TOKEN_ENV}): "
                f"every request that needs it is refused ({_ROLE_HELP[r]})"
            )
    if not sec.any_token and not insecure and not is_loopback(host):
        raise SecurityError(
            f"refusing to listen on {host} (beyond loopback) without a token: set ${TOKEN_ENV} or --token-file, "
            "or pass --insecure to let anyone who reaches it in"
        )
    return sec


def roles_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The roles ``args`` has a ``--<role>-token-file`` flag for (:func:`add_arguments`)."""
    return tuple(r for r in ROLES if hasattr(args, f"{r}_token_file"))


def opens(header: str | bytes | None, creds: Iterable[bytes]) -> bool:
    """True when ``header`` is ``Bearer <one of creds>``; every one is
    compared in constant time, so the time does not say which matched."""
    given = bearer_of(header)
    ok = False
    for c in creds:
        ok |= given is not None and hmac.compare_digest(given, c)
    return ok


def bearer_of(header: str | bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (scheme
    case-insensitive, as RFC 7235 says), or None for another scheme or none."""
    if not header:
        return None
    h = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, given = h.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return given.strip()


def token_ok(security: Security, authorization_header: str | bytes | None) -> bool:
    """True when ``security`` asks for no token at all, or the header is
    ``Bearer <its token>`` (the all-roles shortcut; scheme case-insensitive,
    as RFC 7235 says); constant time in the token. Role tokens:
    :meth:`Security.allows`."""
    if not security.any_token:
        return True
    if security.token is None:
        return False
    given = bearer_of(authorization_header)
    return given is not None and hmac.compare_digest(given, security.token)


class FailureBackoff:
    """Per-client count of refused credentials (a client: its address):
    after ``failures`` refusals within ``window_s`` seconds (a window starts
    at a client's first refusal), :meth:`blocked` says how long it must
    wait. At most ``max_clients`` are remembered, the least recently failing
    forgotten first, so a flood of addresses cannot grow it. Any thread."""

    def __init__(
        self,
        failures: int = BACKOFF_FAILURES,
        window_s: float = BACKOFF_WINDOW_S,
        max_clients: int = BACKOFF_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures, self.window_s, self.max_clients, self.clock = failures, window_s, max_clients, clock
        self._seen: OrderedDict[str, list] = OrderedDict()  # client -> [window start, refusals]
        self._lock = threading.Lock()

    def blocked(self, client: str) -> float:
        """Seconds ``client`` must still wait (0: not blocked)."""
        with self._lock:
            e = self._seen.get(client)
            if e is None or e[1] < self.failures:
                return 0.0
            return max(0.0, e[0] + self.window_s - self.clock())

    def failed(self, client: str) -> None:
        """Count one refusal of ``client``."""
        now = self.clock()
        with self._lock:
            e = self._seen.get(client)
            if e is None or now - e[0] >= self.window_s:
                e = self._seen[client] = [now, 0]
            e[1] += 1
            self._seen.move_to_end(client)
            while len(self._seen) > self.max_clients:
                self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


def client_of(scope: dict) -> str:
    """The address a request came from (the backoff's key)."""
    c = scope.get("client")
    return str(c[0]) if c else "?"


def authorization(scope: dict) -> bytes | None:
    """The request's ``Authorization`` header, or None."""
    return next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)


async def send_json(send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON answer on an ASGI ``send``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def too_many(wait_s: float) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """Body and headers of a 429 for a client that must wait ``wait_s`` seconds."""
    secs = max(1, math.ceil(wait_s))
    body = json.dumps(
        {"code": 8, "message": f"too many refused credentials from this client; retry after {secs} s"}
    ).encode()
    return body, [(b"retry-after", str(secs).encode())]


def unauthenticated(why: str, role: str | None, security: Security) -> bytes:
    """The 401 body: what was wrong, and which token the route needs."""
    need = ""
    if role in ROLES and not security.credentials(role):
        need = f"; this route needs the {role} token (--{role}-token-file or ${ROLE_ENV[role]}) and none is set"
    return json.dumps(
        {"code": 16, "message": f"unauthenticated: {why} bearer token (send Authorization: Bearer TOKEN){need}"}
    ).encode()


class BearerAuthMiddleware:
    """Pure ASGI middleware: with a token set, an HTTP request without the
    right ``Authorization: Bearer`` header gets 401, ``WWW-Authenticate:
    Bearer`` and a JSON body; a websocket is closed before it is accepted
    (the server answers 403). ``role_of(scope)``: the role a request needs
    (default: only the all-roles token opens anything, as before roles
    existed); its token or the shortcut opens it. ``exempt`` paths pass
    (liveness probes) with :data:`DETAILS_SCOPE_KEY` set in the scope (True
    when the header opens the read role); lifespan passes. ``on_reject(scope)``
    is called for each refusal (a counter); an exception in it is swallowed.
    A client refused :data:`BACKOFF_FAILURES` times in a window gets 429
    (``backoff``). Without any token it passes everything through untouched."""

    def __init__(
        self,
        app: Any,
        security: Security,
        *,
        exempt: Iterable[str] = DEFAULT_EXEMPT,
        on_reject: Callable[[dict], None] | None = None,
        role_of: Callable[[dict], str | None] | None = None,
        backoff: FailureBackoff | None = None,
    ) -> None:
        self.app = app
        self.security = security
        self.exempt = frozenset(exempt)
        self.on_reject = on_reject
        self.role_of = role_of
        self.backoff = backoff if backoff is not None else FailureBackoff()

    def _ok(self, scope: dict, header: bytes | None) -> bool:
        role = self.role_of(scope) if self.role_of is not None else None
        if role is None:
            return token_ok(self.security, header)
        return self.security.allows(role, header)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if not self.security.any_token or kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = authorization(scope)
        if scope.get("path") in self.exempt:
            scope[DETAILS_SCOPE_KEY] = self.security.allows("read", header)
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        wait = self.backoff.blocked(client)
        if wait <= 0 and self._ok(scope, header):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            try:
                self.on_reject(scope)
            except Exception:  # a counter must not turn a 401 into a 500
                pass
        if kind == "websocket":
            if wait <= 0:
                self.backoff.failed(client)
            await send({"type": "websocket.close", "code": 1008})
            return
        if wait > 0:
            body, headers = too_many(wait)
            await send_json(send, 429, body, headers)
            return
        self.backoff.failed(client)
        why = "missing" if header is None else "wrong"
        role = self.role_of(scope) if self.role_of is not None else None
        await send_json(
            send, 401, unauthenticated(why, role, self.security), [(b"www-authenticate", _CHALLENGE.encode())]
        )


def uvicorn_ssl_kwargs(security: Security) -> dict:
    """Keyword arguments for ``uvicorn.Config``: TLS files, and client
    certificates required when ``tls_client_ca`` is set; ``{}`` without TLS."""
    if not security.tls:
        return {}
    import ssl

    kw: dict[str, Any] = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
    if security.tls_client_ca:
        kw["ssl_ca_certs"] = security.tls_client_ca
        kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return kw


def grpc_credentials(security: Security):
    """``grpc.ssl_server_credentials`` for ``security``'s TLS files (client
    certificates required when ``tls_client_ca`` is set), or None without TLS
    (serve with ``add_insecure_port``)."""
    if not security.tls:
        return None
    import grpc

    key = Path(security.tls_key).read_bytes()
    cert = Path(security.tls_cert).read_bytes()
    ca = Path(security.tls_client_ca).read_bytes() if security.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def client_headers(env: Mapping[str, str] = os.environ) -> dict:
    """Headers a kvlens client sends to a kvlens server: ``Authorization:
    Bearer $KVLENS_TOKEN`` when it is set, else ``{}``."""
    tok = client_token(env)
    return {"Authorization": f"Bearer {tok}"} if tok else {}
