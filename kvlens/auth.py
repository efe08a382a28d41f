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
  (it could not travel in an HTTP header or gRPC metadata).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# TOKEN_ENV ($KVLENS_TOKEN): the bearer token, from the environment (servers: when no --token-file;
# clients: what they send). Defined in the bottom layer, which the OTLP exporters read too.
from kvrecord.config import TOKEN_ENV, client_token

__all__ = [
    "TOKEN_ENV",
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
#: What a client that needs no token is told (RFC 6750).
_CHALLENGE = 'Bearer realm="kvlens"'


class SecurityError(ValueError):
    """A bad security configuration; ``str()`` is one line naming the problem."""


def add_arguments(p: argparse.ArgumentParser, *, client_certs: bool = False) -> None:
    """Add ``--token-file``, ``--tls-cert``, ``--tls-key``, ``--insecure`` (and
    ``--tls-client-ca`` when ``client_certs``) to ``p``, in a group of their
    own."""
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
        f"wins over ${TOKEN_ENV} when both are set (default: ${TOKEN_ENV}, else no token)",
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


@dataclass(frozen=True)
class Security:
    """What a server checks: ``token`` (bytes, or None: no check), TLS files
    (paths or None) and whether ``--insecure`` was given. Its repr and str
    never show the token."""

    token: bytes | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    insecure: bool = False

    def __repr__(self) -> str:
        tok = "set" if self.token else "None"
        return (
            f"Security(token={tok}, tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}, "
            f"tls_client_ca={self.tls_client_ca!r}, insecure={self.insecure})"
        )

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
    return tok


def _read_token_file(path: str, warn: Callable[[str], None]) -> bytes:
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise SecurityError(f"--token-file {path} is a directory; give the file holding the token")
        raw = Path(path).read_bytes()
    except SecurityError:
        raise
    except OSError as e:
        raise SecurityError(f"cannot read --token-file {path}: {e.strerror or e}") from None
    tok = _check_token(raw, f"--token-file {path}")
    if st.st_mode & 0o077:
        warn(
            f"warning: --token-file {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod 600 {path}"
        )
    return tok


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

    token: bytes | None = None
    if token_file:
        token = _read_token_file(token_file, warn)
    elif env.get(TOKEN_ENV, "") != "":
        token = _check_token(env[TOKEN_ENV].encode("utf-8", "replace"), f"${TOKEN_ENV}")

    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise SecurityError(f"{given} needs {missing} as well")
    if ca and not cert:
        raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
        if path:
            _readable(flag, path)

    if token is None and not insecure and not is_loopback(host):
        raise SecurityError(
            f"refusing to listen on {host} (beyond loopback) without a token: set ${TOKEN_ENV} or --token-file, "
            "or pass --insecure to let anyone who reaches it in"
        )
    return Security(token=token, tls_cert=cert, tls_key=key, tls_client_ca=ca, insecure=insecure)


def token_ok(security: Security, authorization_header: str | bytes | None) -> bool:
    """True when ``security`` asks for no token, or the header is ``Bearer
    <its token>`` (scheme case-insensitive, as RFC 7235 says); constant time
    in the token."""
    if security.token is None:
        return True
    if not authorization_header:
        return False
    h = (
        authorization_header.encode("latin-1", "replace")
        if isinstance(authorization_header, str)
        else authorization_header
    )
    scheme, _, given = h.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given.strip(), security.token)


class BearerAuthMiddleware:
    """Pure ASGI middleware: with a token set, an HTTP request without the
    right ``Authorization: Bearer`` header gets 401, ``WWW-Authenticate:
    Bearer`` and a JSON body; a websocket is closed before it is accepted
    (the server answers 403). ``exempt`` paths pass (liveness probes);
    lifespan passes. ``on_reject(scope)`` is called for each refusal (a
    counter); an exception in it is swallowed. Without a token it passes
    everything through untouched."""

    def __init__(
        self,
        app: Any,
        security: Security,
        *,
        exempt: Iterable[str] = DEFAULT_EXEMPT,
        on_reject: Callable[[dict], None] | None = None,
    ) -> None:
        self.app = app
        self.security = security
        self.exempt = frozenset(exempt)
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if self.security.token is None or kind not in ("http", "websocket") or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
                break
        if token_ok(self.security, header):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            try:
                self.on_reject(scope)
            except Exception:  # a counter must not turn a 401 into a 500
                pass
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        why = "missing" if header is None else "wrong"
        body = json.dumps(
            {"code": 16, "message": f"unauthenticated: {why} bearer token (send Authorization: Bearer TOKEN)"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", _CHALLENGE.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


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
