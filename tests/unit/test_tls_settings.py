"""TLS settings set, not inherited (issue 42, items 9 and 11): each kind of
kvlens server, started as users start it (``kvlens collect`` over OTLP/HTTP
and OTLP/gRPC, ``kvlens proxy``; the dashboard's Streamlit in
tests/unit/test_dashboard_auth.py), refuses a TLS 1.1 client and a TLS 1.2
client that offers only CBC suites, and serves a modern one. Each refused
client is first shown to work against a server that allows it (else the
refusal would prove nothing: OpenSSL's security level can forbid TLS 1.1 on
the client side, hence ``@SECLEVEL=0``). And ``limit_concurrency``: a
kvlens uvicorn server past its cap answers 503 at once."""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import threading
import time
import warnings
from typing import Iterator

import httpx
import pytest

from collect_proc import Collect
from frontdoor import credentials, serving
from kvrecord.config import TOKEN_ENV
from test_router_auth import router_proc  # noqa: F401 (the fixture: the real kvlens proxy over TLS)
from tlscerts import make_tls

TOKEN = "kvlens-tls-" + secrets.token_hex(12)
#: TLS 1.2 suites with CBC encryption (no AEAD): Python's default server list accepts the SHA-256/384 ones
CBC_ONLY = "ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES256-SHA384:ECDHE-RSA-AES128-SHA256:ECDHE-RSA-AES256-SHA384"


def _client(kind: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the certificate is checked elsewhere; this is about the protocol
    if kind == "tls1.1":
        with warnings.catch_warnings():  # TLSv1 and TLSv1_1 are deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = ssl.TLSVersion.TLSv1
            ctx.maximum_version = ssl.TLSVersion.TLSv1_1
        ctx.set_ciphers("ALL:@SECLEVEL=0")
    elif kind == "cbc-only":
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(CBC_ONLY)
    return ctx


def handshake(host: str, port: int, kind: str) -> str:
    """The TLS version a ``kind`` client ("tls1.1", "cbc-only", "modern")
    agrees with the server, or ``"refused: <why>"``."""
    with socket.create_connection((host, port), timeout=20) as raw:
        try:
            with _client(kind).wrap_socket(raw, server_hostname=host) as s:
                return f"{s.version()} {s.cipher()[0]}"
        except (ssl.SSLError, ConnectionResetError) as e:
            return f"refused: {e}"


@contextlib.contextmanager
def lenient_server(tls) -> Iterator[int]:
    """A TLS server that takes TLS 1.0+ and any cipher: the clients' control."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
    ctx.set_ciphers("ALL:@SECLEVEL=0")
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError):
                with ctx.wrap_socket(conn, server_side=True) as s:
                    s.recv(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        lsock.close()


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """The certificate, after checking the refused clients work where allowed."""
    tls = make_tls(tmp_path_factory.mktemp("tls"))
    with lenient_server(tls) as port:
        got = {kind: handshake("127.0.0.1", port, kind) for kind in ("tls1.1", "cbc-only")}
    if not got["tls1.1"].startswith("TLSv1.1"):
        pytest.skip(f"this OpenSSL cannot speak TLS 1.1 even at @SECLEVEL=0: {got['tls1.1']}")
    assert got["cbc-only"].startswith("TLSv1.2") and "SHA" in got["cbc-only"], got
    return tls


def _refuses_old_serves_modern(host: str, port: int) -> None:
    for kind in ("tls1.1", "cbc-only"):
        got = handshake(host, port, kind)
        assert got.startswith("refused"), (kind, got)
    modern = handshake(host, port, "modern")
    assert modern.split()[0] in ("TLSv1.2", "TLSv1.3"), modern


def test_the_collector_refuses_old_tls_on_http_and_grpc(tmp_path, control):
    c = Collect(tmp_path, "--tls-cert", str(control.cert), "--tls-key", str(control.key), env={TOKEN_ENV: TOKEN})
    try:
        http_port = int(c.http.rsplit(":", 1)[1])
        _refuses_old_serves_modern("127.0.0.1", http_port)  # uvicorn: kvlens' settings
        _refuses_old_serves_modern("127.0.0.1", int(c.grpc.rsplit(":", 1)[1]))  # gRPC: BoringSSL's defaults
        # and the collector still serves over TLS
        r = httpx.get(c.http + "/healthz", verify=ssl.create_default_context(cafile=str(control.ca)), timeout=10)
        assert r.status_code == 200
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err


def test_the_router_refuses_old_tls(router_proc, control):  # noqa: F811
    proc, url, tls, p, d, db = router_proc
    _refuses_old_serves_modern("127.0.0.1", int(url.rsplit(":", 1)[1]))


def test_the_tls_context_is_kvlens_own(tmp_path):
    tls = make_tls(tmp_path / "tls")
    sec = credentials.Security(token=TOKEN.encode(), tls_cert=str(tls.cert), tls_key=str(tls.key))
    cfg = serving.config(lambda *a: None, sec)
    cfg.load()
    assert cfg.ssl.minimum_version == ssl.TLSVersion.TLSv1_2
    names = {c["name"] for c in cfg.ssl.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert names and all(("GCM" in n or "CHACHA20" in n) and n.startswith("ECDHE") for n in names), names
    assert cfg.limit_concurrency == serving.MAX_CONCURRENCY
    plain = serving.config(lambda *a: None, credentials.Security())
    assert "ssl_ciphers" not in serving.tls_kwargs(credentials.Security()) and plain.ssl_certfile is None


def test_past_its_concurrency_cap_a_server_answers_503(tmp_path):
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        serving.config(app, credentials.Security(), log_level="warning", lifespan="off", limit_concurrency=2)
    )
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = sock.getsockname()[1]
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # two open connections: the cap
    try:
        while len(server.server_state.connections) < 2:
            assert time.monotonic() < deadline, "connections not seen"
            time.sleep(0.02)
        r = httpx.get(f"http://127.0.0.1:{port}/", timeout=10, trust_env=False)
        assert r.status_code == 503
        for s in held:
            s.close()
        while len(server.server_state.connections) > 0:
            assert time.monotonic() < deadline + 20, "connections not closed"
            time.sleep(0.02)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10, trust_env=False).text == "ok"
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()
