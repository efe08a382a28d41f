"""The dashboard's token gate (issue 33, item 2): :class:`dashboard.gate.TokenGate`
on its own (a browser's sign-in: form, ``?token=`` then a cookie), then the
real ``kvlens dashboard`` (Streamlit's server) over TLS with a certificate
made here: nothing served without the token, not the page, not a script,
not the websocket; the token on no command line."""

from __future__ import annotations

import argparse
import base64
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from dashboard.gate import COOKIE, LOGIN_PATH, TokenGate, session_value
from frontdoor import credentials
from kvlens import dashboard_cmd
from kvrecord.config import TOKEN_ENV
from kvrecord.guard import parent_death_signal
from kvrecord.ports import free_port
from test_tls_settings import handshake
from tlscerts import make_tls

REPO = Path(__file__).resolve().parents[2]
TOKEN = "dash-" + secrets.token_hex(16)


def _dies_with_us() -> None:
    """In the child: SIGTERM when this test process dies, so an interrupted run leaves no server behind."""
    parent_death_signal(signal.SIGTERM)


# ------------------------------------------------------------ the gate alone
def _inner() -> Starlette:
    async def page(request):
        return PlainTextResponse(f"page {request.url.path} {sorted(request.query_params.items())}")

    async def stream(ws):
        await ws.accept()
        await ws.send_text("streamed")
        await ws.close()

    async def health(request):
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/_stcore/health", health), WebSocketRoute("/_stcore/stream", stream), Route("/{p:path}", page)]
    )


@pytest.fixture
def gated() -> TestClient:
    return TestClient(TokenGate(_inner(), TOKEN.encode()), base_url="https://dash.test")


def test_the_gate_refuses_without_the_token(gated):
    c = gated
    r = c.get("/compare", headers={"Accept": "text/html"})
    assert r.status_code == 401 and "<form" in r.text and LOGIN_PATH in r.text and "page" not in r.text
    assert 'value="/compare"' in r.text  # back to the page asked for, after signing in
    r = c.get("/compare")
    assert r.status_code == 401 and "unauthorized" in r.json()["error"] and r.headers["www-authenticate"]
    assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/", headers={"Authorization": TOKEN}).status_code == 401  # no scheme
    assert c.get("/", headers={"Cookie": f"{COOKIE}={'0' * 64}"}).status_code == 401
    assert c.get("/", headers={"Cookie": f"{COOKIE}={TOKEN}"}).status_code == 401  # the cookie is not the token
    r = c.get("/?token=wrong&x=1", headers={"Accept": "text/html"}, follow_redirects=False)
    assert r.status_code == 401 and "not this dashboard" in r.text and "wrong" not in r.text
    with pytest.raises(WebSocketDisconnect):
        with c.websocket_connect("/_stcore/stream") as ws:
            ws.receive_text()
    assert c.get("/_stcore/health").text == "ok"  # the liveness probe alone stays open


def test_the_gate_signs_a_browser_in_and_strips_the_token_from_the_url(gated):
    c = gated
    assert c.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    r = c.get(f"/traces?trace=ab&token={TOKEN}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/traces?trace=ab"
    cookie = r.headers["set-cookie"]
    assert f"{COOKIE}={session_value(TOKEN.encode())}" in cookie and TOKEN not in cookie
    for attr in ("HttpOnly", "SameSite=Strict", "Secure", "Path=/"):
        assert attr in cookie
    r = c.get("/traces?trace=ab")  # the client keeps the cookie
    assert r.status_code == 200 and r.text == "page /traces [('trace', 'ab')]"
    session = {"Cookie": f"{COOKIE}={session_value(TOKEN.encode())}"}
    with c.websocket_connect("/_stcore/stream", headers=session) as ws:
        assert ws.receive_text() == "streamed"
    c.cookies.clear()
    r = c.post(LOGIN_PATH, data={"token": TOKEN, "next": "//evil.example/x"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"  # no open redirect
    r = c.post(LOGIN_PATH, data={"token": TOKEN, "next": "/compare?a=1"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/compare?a=1"
    assert c.get("/compare").status_code == 200
    c.cookies.clear()
    r = c.post(LOGIN_PATH, data={"token": "nope", "next": "/"}, headers={"Accept": "text/html"})
    assert r.status_code == 401 and "not this dashboard" in r.text
    assert c.post(LOGIN_PATH, content=b"token=" + b"x" * 10_000).status_code == 413
    # a token change ends every session
    other = TestClient(TokenGate(_inner(), b"another"), base_url="https://dash.test")
    assert other.get("/", headers=session).status_code == 401
    # plain HTTP: the cookie is not marked Secure (the browser would not send it back)
    plain = TestClient(TokenGate(_inner(), TOKEN.encode()), base_url="http://127.0.0.1")
    assert "Secure" not in plain.get(f"/?token={TOKEN}", follow_redirects=False).headers["set-cookie"]


def test_no_token_no_gate():
    c = TestClient(TokenGate(_inner(), None))
    assert c.get("/x").status_code == 200 and c.get(f"/?token={TOKEN}").status_code == 200


# --------------------------------------------------- the command's decisions
def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    dashboard_cmd.add_arguments(p)
    return p.parse_args(list(argv))


def test_dashboard_refuses_an_open_host_without_token(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert dashboard_cmd.run(_args("--host", "0.0.0.0", "--store", str(tmp_path / "t.db"))) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in err and "--insecure" in err
    assert dashboard_cmd.run(_args("--tls-key", str(tmp_path / "k.pem"))) == 2
    assert "--tls-key needs --tls-cert" in capsys.readouterr().err
    # the token goes to Streamlit in its environment (which the app empties), never on its command line
    monkeypatch.setenv(TOKEN_ENV, "inherited")
    sec = credentials.Security(token=TOKEN.encode())
    args = _args("--tls-cert", "c.pem", "--tls-key", "k.pem")
    cmd = dashboard_cmd.command(args, tmp_path / "t.db")
    assert TOKEN not in " ".join(cmd) and cmd[4].endswith("dashboard/serve.py")
    assert cmd[cmd.index("--server.sslCertFile") + 1] == str(Path("c.pem").resolve())
    assert dashboard_cmd.child_env(security=sec)[TOKEN_ENV] == TOKEN
    assert TOKEN_ENV not in dashboard_cmd.child_env(security=credentials.Security())  # no stray inherited token


# ------------------------------------------------ the real kvlens dashboard
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


@pytest.fixture
def dashboard(tmp_path):
    """``kvlens dashboard`` with ``$KVLENS_TOKEN`` and TLS on a free loopback port."""
    tls = make_tls(tmp_path / "tls")
    port = free_port()
    env = {**os.environ, TOKEN_ENV: TOKEN, "KVLENS_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    argv = [
        sys.executable, "-m", "kvlens.cli", "dashboard", "--port", str(port), "--store", str(tmp_path / "t.db"),
        "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
    ]  # fmt: skip
    # O_APPEND: the children share this open file (and its offset) with us, and we seek(0) to
    # read it; without append their next write would land at 0, over the URL line (CI, stop 39)
    log = open(tmp_path / "dashboard.log", "a+")
    proc = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_dies_with_us
    )
    url = f"https://127.0.0.1:{port}"
    ctx = ssl.create_default_context(cafile=str(tls.ca))
    try:
        deadline = time.monotonic() + 90
        while True:
            log.seek(0)
            assert proc.poll() is None, log.read()
            assert time.monotonic() < deadline, "dashboard did not start"
            try:
                if httpx.get(url + "/_stcore/health", verify=ctx, timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield proc, url, ctx, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _ws(url: str, ctx: ssl.SSLContext, headers: dict, source: str | None = None) -> tuple[int, str | None]:
    """Ask for Streamlit's websocket (the upgrade request a browser sends, over TLS):
    the answer's status (101: upgraded) and its subprotocol. A plain socket with a
    timeout, not a websocket client: websockets 17.4's sync client over TLS can hang
    for minutes in a refused handshake (its reader thread blocked in the TLS socket's
    recv while the caller joins it; a clean-clone run stuck 6 min here), while the
    server answered each of 300 such requests at once."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    lines = [
        "GET /_stcore/stream HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
        f"Sec-WebSocket-Key: {base64.b64encode(secrets.token_bytes(16)).decode()}", "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: streamlit", f"Origin: {url}",  # Streamlit checks the Origin against its address
        *(f"{k}: {v}" for k, v in headers.items()),
    ]  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=20, source_address=(source, 0) if source else None) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                assert chunk, f"the dashboard closed the connection without an answer: {head!r}"
                head += chunk
    status, *fields = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    proto = next(
        (v.strip() for k, _, v in (f.partition(":") for f in fields) if k.lower() == "sec-websocket-protocol"), None
    )
    return int(status.split()[1]), proto


def test_kvlens_dashboard_serves_nothing_without_its_token(dashboard):
    proc, url, ctx, log = dashboard
    for pid in _tree(proc.pid):  # kvlens dashboard and Streamlit under it
        assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    with httpx.Client(base_url=url, verify=ctx, timeout=20, trust_env=False) as c:
        page = c.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 401 and "<form" in page.text and "streamlit" not in page.text.lower()
        for path in ("/", "/overview", "/_stcore/host-config", "/static/js/index.js", "/favicon.png"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert c.get("/_stcore/health").text == "ok"
    # Streamlit's TLS (its uvicorn, Python's defaults since uvicorn 0.48): a TLS 1.1 client is refused
    port = int(url.rsplit(":", 1)[1])
    assert handshake("127.0.0.1", port, "tls1.1").startswith("refused")
    assert handshake("127.0.0.1", port, "modern").split()[0] in ("TLSv1.2", "TLSv1.3")
    # refused before it is accepted: the ASGI server answers 403, never 101
    assert _ws(url, ctx, {})[0] == 403
    assert _ws(url, ctx, {"Cookie": f"{COOKIE}=bad"})[0] == 403
    assert _ws(url, ctx, {"Authorization": "Bearer wrong"})[0] == 403

    # six wrong tokens from this address (issue 42, item 10): it must wait now, even with the right one
    with httpx.Client(base_url=url, verify=ctx, timeout=20, trust_env=False) as c:
        r = c.get(f"/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and "set-cookie" not in r.headers

    # the right token, from another address: a browser's way in (?token= once, then the cookie), and a
    # script's (the header)
    other = httpx.HTTPTransport(verify=ctx, local_address="127.0.0.2")
    with httpx.Client(base_url=url, transport=other, timeout=20, trust_env=False) as c:
        # a link whose path a browser would turn into another host (tab stripped: //evil.example/): "/" instead
        r = c.get(f"/%09/evil.example/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        c.cookies.clear()
        r = c.get(f"/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/" and "Secure" in r.headers["set-cookie"]
        page = c.get("/")
        assert page.status_code == 200 and "<title>Streamlit</title>" in page.text
        script = re.search(r'src="(\./static/js/[^"]+\.js)"', page.text).group(1)
        assert c.get(script[1:]).status_code == 200
        cookie = c.cookies[COOKIE]
    assert _ws(url, ctx, {"Cookie": f"{COOKIE}={cookie}"}) == (101, "streamlit")
    assert _ws(url, ctx, {"Authorization": f"Bearer {TOKEN}"}, source="127.0.0.2") == (101, "streamlit")
    assert _ws(url, ctx, {"Authorization": f"Bearer {TOKEN}"})[0] == 403  # this address still waits
    log.seek(0)
    out = log.read()
    assert f"kvlens dashboard: https://localhost:{url.rsplit(':', 1)[1]}" in out and "token required, TLS" in out
    assert TOKEN not in out
