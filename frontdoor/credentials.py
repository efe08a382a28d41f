"""The credentials a kvlens server checks, and the one way to check a token.

A server's credentials are a :class:`Security`: bearer tokens scoped by role
(issue 42), TLS files and whether ``--insecure`` was given. Where they come
from (files, variables, flags) is :mod:`frontdoor.flags`.

* The roles (:data:`ROLES`): an **ingest** token (exporters ->
  ``/v1/traces`` and gRPC ``Export``), a **read** token (``/metrics``,
  health details, the dashboard), an **admin** token (``/admin/*``).
  ``$KVLENS_TOKEN`` / ``--token-file`` is the one-token shortcut: it opens
  every role. Once any credential is set, a route whose role has none is
  closed (401 naming the token it needs), never open: setting an admin
  token alone does not open ``/metrics``.
* Every token is compared in constant time (:func:`hmac.compare_digest`),
  each candidate in turn, so the time does not say which one matched
  (:func:`matches`, :func:`opens`); the dashboard's sign-in form and
  ``?token=`` use the same function as the ``Authorization`` header.
* "Beyond loopback" has one rule (:func:`is_loopback`): the bind check, the
  same-site guard and the harness's flag checks all ask it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvrecord.config import client_token

#: The scoped credentials: exporters sending spans, readers of metrics and
#: health details, operators changing a router live.
ROLES = ("ingest", "read", "admin")
#: Each role's token in the environment (``--<role>-token-file`` wins, as ``--token-file`` does).
ROLE_ENV = {r: f"KVLENS_{r.upper()}_TOKEN" for r in ROLES}
#: What each role opens, for help texts and refusals.
ROLE_HELP = {
    "ingest": "what exporters send with their spans (POST /v1/traces, gRPC Export)",
    "read": "what opens /metrics, health details and the dashboard",
    "admin": "what opens /admin/* (the router's live split)",
}


class SecurityError(ValueError):
    """A bad security configuration; ``str()`` is one line naming the problem."""


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

    def role_token(self, role: str | None) -> bytes | None:
        """``role``'s own token (not the shortcut), or None."""
        return {"ingest": self.ingest_token, "read": self.read_token, "admin": self.admin_token}.get(role)

    def credentials(self, role: str | None) -> tuple[bytes, ...]:
        """The tokens that open ``role``: its own and the shortcut ``token``
        (a role kvlens does not scope, or None: the shortcut only)."""
        return tuple(t for t in (self.role_token(role), self.token) if t)

    @property
    def any_token(self) -> bool:
        """Some credential is set: every guarded route then needs one."""
        return bool(self.token) or any(self.role_token(r) for r in ROLES)

    def allows(self, role: str | None, header: str | bytes | None) -> bool:
        """True when the ``Authorization`` header opens ``role`` (its token or
        the shortcut; None: the shortcut only), or when no credential is set
        at all. Constant time in each token."""
        creds = self.credentials(role)
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


def matches(given: bytes | None, creds: Iterable[bytes]) -> bool:
    """True when ``given`` is one of ``creds``; every one is compared in
    constant time, so the time does not say which matched. None matches nothing."""
    ok = False
    for c in creds:
        ok |= given is not None and hmac.compare_digest(given, c)
    return ok


def opens(header: str | bytes | None, creds: Iterable[bytes]) -> bool:
    """True when ``header`` is ``Bearer <one of creds>`` (:func:`matches`)."""
    return matches(bearer_of(header), creds)


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
    ``Bearer <its token>`` (the all-roles shortcut); constant time in the
    token. Role tokens: :meth:`Security.allows`."""
    return security.allows(None, authorization_header)


def client_headers(env: Mapping[str, str] = os.environ) -> dict:
    """Headers a kvlens client sends to a kvlens server: ``Authorization:
    Bearer $KVLENS_TOKEN`` when it is set, else ``{}``."""
    tok = client_token(env)
    return {"Authorization": f"Bearer {tok}"} if tok else {}
