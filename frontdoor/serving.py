"""What kvlens' own servers share: the uvicorn of the collector's OTLP/HTTP
side (``kvlens collect``) and of the router (``kvlens proxy``), and the TLS
credentials of the collector's gRPC side (:func:`grpc_credentials`).

**TLS is set here, not inherited** (issue 42). uvicorn before 0.48 set the
cipher string ``TLSv1`` by default (every cipher TLS 1.0 knows: CBC, SHA-1
MACs), which replaced Python's own safer default; later releases leave
OpenSSL's. Whatever uvicorn is installed, a kvlens server's context has

* ``minimum_version`` TLS 1.2 (:data:`MIN_TLS`), set on the context uvicorn
  built (:class:`Config`);
* the TLS 1.2 cipher suites :data:`CIPHERS`: ECDHE key exchange (forward
  secrecy) and AEAD encryption only. TLS 1.3's suites are OpenSSL's own
  (all AEAD). No suite in the list exists before TLS 1.2, so a TLS 1.0 or
  1.1 client finds no common cipher either way.

gRPC cannot be told either (``grpc.ssl_server_credentials`` takes no
version or ciphers): the collector's gRPC side has gRPC's own BoringSSL
defaults, TLS 1.2 minimum and ECDHE with AES-GCM suites (unless the
environment sets ``GRPC_SSL_CIPHER_SUITES``); tests/unit/test_tls_settings.py
checks that a TLS 1.1 client and a CBC-only client are refused there too.

**A cap on concurrent connections** (``limit_concurrency``): beyond
:data:`MAX_CONCURRENCY` open connections and requests, uvicorn answers 503
at once instead of reading another request body (each up to the server's
``--max-body-mb``).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import uvicorn

from frontdoor.credentials import Security

MIN_TLS = ssl.TLSVersion.TLSv1_2
#: OpenSSL cipher string for TLS 1.2: ECDHE key exchange, AES-GCM or ChaCha20-Poly1305 only.
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"
#: Open connections plus requests in flight a kvlens uvicorn server takes
#: before answering 503 (a fleet's exporters hold one or two each; the
#: router one per client request in flight).
MAX_CONCURRENCY = 1024
#: uvicorn's exit status when it could not start (a port in use): what ``uvicorn.run`` exits with.
STARTUP_FAILURE = 3


class Config(uvicorn.Config):
    """``uvicorn.Config`` whose TLS context, once uvicorn built it, refuses
    anything older than :data:`MIN_TLS` (uvicorn has no option for it)."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.minimum_version = MIN_TLS


def uvicorn_ssl_kwargs(security: Security) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: TLS files, and client
    certificates required when ``tls_client_ca`` is set; ``{}`` without TLS."""
    if not security.tls:
        return {}
    kw: dict[str, Any] = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
    if security.tls_client_ca:
        kw["ssl_ca_certs"] = security.tls_client_ca
        kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return kw


def tls_kwargs(security: Security) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for ``security``'s TLS
    (:func:`uvicorn_ssl_kwargs`) with :data:`CIPHERS`; ``{}`` without TLS."""
    kw = uvicorn_ssl_kwargs(security)
    if kw:
        kw["ssl_ciphers"] = CIPHERS
    return kw


def config(app: Any, security: Security, **kw: Any) -> Config:
    """A :class:`Config` for a kvlens server: its TLS (:func:`tls_kwargs`),
    ``limit_concurrency`` :data:`MAX_CONCURRENCY` (``kw`` may override it),
    and ``kw`` (host, port, log level, ...)."""
    kw.setdefault("limit_concurrency", MAX_CONCURRENCY)
    return Config(app, **tls_kwargs(security), **kw)


def serve(cfg: Config) -> int:
    """Run a server until it is stopped (Ctrl-C, SIGTERM), as ``uvicorn.run``
    does: 0, or :data:`STARTUP_FAILURE` when it could not start."""
    server = uvicorn.Server(cfg)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on
        pass
    return 0 if server.started else STARTUP_FAILURE


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
