"""frontdoor/ (credentials, flags, bearer, backoff, serving): the token and TLS settings
every kvlens server shares.
Real components: argparse, Starlette (in-process and served by uvicorn with
TLS), httpx, certificates made here (``tlscerts``)."""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
import threading

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from frontdoor import backoff, bearer, credentials, flags, serving
from kvrecord.config import TOKEN_ENV
from tlscerts import make_tls

TOKEN = "s3cret-Token_0123456789"


def _parse(argv: list[str], client_certs: bool = True) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flags.add_arguments(p, client_certs=client_certs)
    return p.parse_args(argv)


def _token_file(tmp_path, text: str = TOKEN + "\n", mode: int = 0o600):
    f = tmp_path / "token"
    f.write_text(text)
    f.chmod(mode)
    return f


# ------------------------------------------------------------ from_args
@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_needs_no_token(host):
    sec = flags.from_args(_parse([]), host, env={})
    assert sec.token is None and not sec.tls and not sec.insecure


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org", ""])
def test_beyond_loopback_without_token_is_refused_with_one_line(host):
    with pytest.raises(credentials.SecurityError) as e:
        flags.from_args(_parse([]), host, env={})
    msg = str(e.value)
    assert "\n" not in msg and TOKEN_ENV in msg and "--token-file" in msg and "--insecure" in msg


def test_insecure_or_a_token_lets_it_bind_beyond_loopback(tmp_path):
    assert flags.from_args(_parse(["--insecure"]), "0.0.0.0", env={}).insecure
    assert flags.from_args(_parse([]), "0.0.0.0", env={TOKEN_ENV: TOKEN}).token == TOKEN.encode()
    f = _token_file(tmp_path)
    assert flags.from_args(_parse(["--token-file", str(f)]), "0.0.0.0", env={}).token == TOKEN.encode()


def test_token_file_wins_over_the_environment(tmp_path):
    f = _token_file(tmp_path, "from-file-0123456789\n")
    sec = flags.from_args(_parse(["--token-file", str(f)]), "127.0.0.1", env={TOKEN_ENV: "from-env-0123456789"})
    assert sec.token == b"from-file-0123456789"
    assert "wins over" in _help()


@pytest.mark.parametrize("short", ["x", "tok", "5char", "fifteen-chars-x"])
def test_tokens_under_16_characters_are_refused(tmp_path, short):
    """Issue 42 item 10: a 5-character token was accepted for a bind on 0.0.0.0."""
    with pytest.raises(credentials.SecurityError, match=f"{len(short)} characters, under the minimum of 16"):
        flags.from_args(_parse([]), "0.0.0.0", env={TOKEN_ENV: short})
    f = _token_file(tmp_path, short + "\n")
    with pytest.raises(credentials.SecurityError, match="--token-file .* under the minimum of 16"):
        flags.from_args(_parse(["--token-file", str(f)]), "0.0.0.0", env={})
    p = argparse.ArgumentParser()
    flags.add_arguments(p, roles=credentials.ROLES)
    with pytest.raises(credentials.SecurityError, match="KVLENS_ADMIN_TOKEN: the token is"):
        flags.from_args(p.parse_args([]), "127.0.0.1", env={"KVLENS_ADMIN_TOKEN": short})
    assert flags.from_args(_parse([]), "0.0.0.0", env={TOKEN_ENV: "x" * 16}).token == b"x" * 16


def _roles_parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flags.add_arguments(p, roles=credentials.ROLES)
    return p.parse_args(argv)


def test_role_tokens_come_from_their_files_or_variables_and_the_shortcut_opens_every_role(tmp_path):
    ingest, read, admin = "ingest-" + "i" * 16, "read-" + "r" * 16, "admin-" + "a" * 16
    f = _token_file(tmp_path, admin + "\n")
    warned: list[str] = []
    sec = flags.from_args(
        _roles_parse(["--admin-token-file", str(f)]),
        "0.0.0.0",
        env={"KVLENS_INGEST_TOKEN": ingest, "KVLENS_READ_TOKEN": read, "KVLENS_ADMIN_TOKEN": "loses-to-the-file-0"},
        warn=warned.append,
    )
    assert (sec.ingest_token, sec.read_token, sec.admin_token, sec.token) == (
        ingest.encode(), read.encode(), admin.encode(), None
    )  # fmt: skip
    assert warned == [] and sec.any_token
    for text in (repr(sec), str(sec)):
        assert ingest not in text and read not in text and admin not in text
    # each role opens with its own token only; none opens another's
    for role, tok in (("ingest", ingest), ("read", read), ("admin", admin)):
        for other in ("ingest", "read", "admin"):
            assert sec.allows(other, f"Bearer {tok}") == (other == role), (role, other)
    assert not sec.allows("admin", None) and not sec.allows("admin", "Bearer ")
    # the shortcut opens all of them
    both = credentials.Security(token=TOKEN.encode(), admin_token=admin.encode())
    assert all(both.allows(r, f"Bearer {TOKEN}") for r in credentials.ROLES)
    assert both.allows("admin", f"Bearer {admin}") and not both.allows("read", f"Bearer {admin}")
    # a role with no token of its own and no shortcut is closed once any credential is set, and said so
    only_read = flags.from_args(_roles_parse([]), "127.0.0.1", env={"KVLENS_READ_TOKEN": read}, warn=warned.append)
    assert not only_read.allows("ingest", f"Bearer {read}") and not only_read.allows("ingest", None)
    assert any("no ingest token" in w for w in warned) and any("no admin token" in w for w in warned)
    assert credentials.Security().allows("admin", None)  # nothing set at all: open (loopback only: the bind check)
    help_text = argparse.ArgumentParser()
    flags.add_arguments(help_text, roles=credentials.ROLES)
    out = help_text.format_help()
    for flag in ("--ingest-token-file", "--read-token-file", "--admin-token-file", "KVLENS_ADMIN_TOKEN"):
        assert flag in out


def test_role_tokens_let_a_server_bind_beyond_loopback_and_are_checked():
    env = {"KVLENS_INGEST_TOKEN": "i" * 20}
    assert flags.from_args(_roles_parse([]), "0.0.0.0", env=env, warn=lambda _l: None).ingest_token == b"i" * 20
    with pytest.raises(credentials.SecurityError, match="KVLENS_READ_TOKEN: the token must be printable"):
        flags.from_args(_roles_parse([]), "127.0.0.1", env={"KVLENS_READ_TOKEN": "two words here xxxxx"})
    with pytest.raises(credentials.SecurityError, match="cannot read --ingest-token-file"):
        flags.from_args(_roles_parse(["--ingest-token-file", "/nonexistent/x"]), "127.0.0.1", env={})


def test_failure_backoff_blocks_after_n_refusals_per_client_and_stays_bounded():
    now = [100.0]
    b = backoff.FailureBackoff(failures=3, window_s=10.0, max_clients=4, clock=lambda: now[0])
    for _ in range(2):
        b.failed("10.0.0.1")
    assert b.wait("10.0.0.1") == 0.0
    b.failed("10.0.0.1")
    assert b.wait("10.0.0.1") == pytest.approx(10.0) and b.wait("10.0.0.2") == 0.0
    now[0] += 4
    assert b.wait("10.0.0.1") == pytest.approx(6.0)
    now[0] += 6
    assert b.wait("10.0.0.1") == 0.0  # the window is over
    b.failed("10.0.0.1")
    assert b.wait("10.0.0.1") == 0.0  # a new window, one refusal in it
    for i in range(100):  # a flood of addresses: bounded memory
        b.failed(f"192.0.2.{i}")
    assert len(b) == 4 and b.wait("10.0.0.1") == 0.0


def _help() -> str:
    p = argparse.ArgumentParser()
    flags.add_arguments(p, client_certs=True)
    return p.format_help()


@pytest.mark.parametrize(
    "text, why",
    [("", "is empty"), ("  \n", "is empty"), ("two words", "printable ASCII"), ("tab\there", "printable ASCII")],
)
def test_bad_token_files_are_refused(tmp_path, text, why):
    f = _token_file(tmp_path, text)
    with pytest.raises(credentials.SecurityError, match=why):
        flags.from_args(_parse(["--token-file", str(f)]), "127.0.0.1", env={})


def test_missing_or_directory_token_file_is_refused(tmp_path):
    with pytest.raises(credentials.SecurityError, match="cannot read --token-file .*nope"):
        flags.from_args(_parse(["--token-file", str(tmp_path / "nope")]), "127.0.0.1", env={})
    with pytest.raises(credentials.SecurityError, match="is a directory"):
        flags.from_args(_parse(["--token-file", str(tmp_path)]), "127.0.0.1", env={})


def test_empty_environment_token_means_none_but_a_bad_one_is_refused():
    assert flags.from_args(_parse([]), "127.0.0.1", env={TOKEN_ENV: ""}).token is None
    with pytest.raises(credentials.SecurityError, match=TOKEN_ENV):
        flags.from_args(_parse([]), "127.0.0.1", env={TOKEN_ENV: "a b"})


def test_a_token_file_others_can_read_warns_and_is_used(tmp_path):
    f = _token_file(tmp_path, mode=0o644)
    warned: list[str] = []
    sec = flags.from_args(_parse(["--token-file", str(f)]), "127.0.0.1", env={}, warn=warned.append)
    assert sec.token == TOKEN.encode()
    assert len(warned) == 1 and "chmod 600" in warned[0] and str(f) in warned[0]
    warned.clear()
    f.chmod(0o600)
    flags.from_args(_parse(["--token-file", str(f)]), "127.0.0.1", env={}, warn=warned.append)
    assert warned == []


def test_tls_flags_come_in_pairs_and_must_be_readable(tmp_path):
    tls = make_tls(tmp_path / "tls")
    with pytest.raises(credentials.SecurityError, match="--tls-cert needs --tls-key"):
        flags.from_args(_parse(["--tls-cert", str(tls.cert)]), "127.0.0.1", env={})
    with pytest.raises(credentials.SecurityError, match="--tls-key needs --tls-cert"):
        flags.from_args(_parse(["--tls-key", str(tls.key)]), "127.0.0.1", env={})
    with pytest.raises(credentials.SecurityError, match="--tls-client-ca needs --tls-cert"):
        flags.from_args(_parse(["--tls-client-ca", str(tls.ca)]), "127.0.0.1", env={})
    with pytest.raises(credentials.SecurityError, match="cannot read --tls-key .*missing"):
        flags.from_args(
            _parse(["--tls-cert", str(tls.cert), "--tls-key", str(tmp_path / "missing")]), "127.0.0.1", env={}
        )
    sec = flags.from_args(
        _parse(["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-client-ca", str(tls.ca)]),
        "127.0.0.1",
        env={},
    )
    assert sec.tls and sec.scheme == "https"
    assert "client certificates required" in sec.describe()
    kw = serving.uvicorn_ssl_kwargs(sec)
    assert kw["ssl_certfile"] == str(tls.cert) and kw["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert serving.uvicorn_ssl_kwargs(credentials.Security()) == {}
    assert serving.grpc_credentials(credentials.Security()) is None
    assert serving.grpc_credentials(sec) is not None


def test_without_client_certs_the_flag_is_absent():
    with pytest.raises(SystemExit):
        _parse(["--tls-client-ca", "x"], client_certs=False)


def test_repr_and_str_never_show_the_token():
    sec = credentials.Security(token=TOKEN.encode())
    for text in (repr(sec), str(sec), f"{sec}", repr([sec])):
        assert TOKEN not in text
    assert "token=set" in repr(sec)


# ------------------------------------------------------------ token_ok
def test_token_ok():
    sec = credentials.Security(token=TOKEN.encode())
    assert credentials.token_ok(sec, f"Bearer {TOKEN}")
    assert credentials.token_ok(sec, f"bearer {TOKEN}".encode())
    assert credentials.token_ok(sec, f"BEARER  {TOKEN} ")
    for bad in (None, "", "Bearer", "Bearer ", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN):
        assert not credentials.token_ok(sec, bad), bad
    assert credentials.token_ok(credentials.Security(), None)  # no token configured: everything passes


def test_client_headers():
    assert credentials.client_headers({}) == {}
    assert credentials.client_headers({TOKEN_ENV: "  "}) == {}
    assert credentials.client_headers({TOKEN_ENV: f"{TOKEN}\n"}) == {"Authorization": f"Bearer {TOKEN}"}


# ------------------------------------------------------------ middleware
def _app(security: credentials.Security, rejected: list) -> Starlette:
    async def hello(request):
        return PlainTextResponse("hello")

    async def ws(websocket):
        await websocket.accept()
        await websocket.send_text("hi")
        await websocket.close()

    inner = Starlette(
        routes=[
            Route("/data", hello, methods=["GET", "POST"]),
            Route("/healthz", hello),
            Route("/health", hello),
            WebSocketRoute("/ws", ws),
        ]
    )
    return bearer.BearerAuth(inner, security, on_reject=lambda scope: rejected.append(scope["path"]))


def test_middleware_refuses_missing_and_wrong_tokens_and_exempts_health():
    rejected: list[str] = []
    client = TestClient(_app(credentials.Security(token=TOKEN.encode()), rejected))
    r = client.get("/data")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "missing bearer token" in r.json()["message"]
    r = client.post("/data", headers={"Authorization": "Bearer nope"}, content=b"x")
    assert r.status_code == 401 and "wrong bearer token" in r.json()["message"]
    assert client.get("/data", headers={"Authorization": f"Bearer {TOKEN}"}).text == "hello"
    assert client.get("/healthz").status_code == 200 and client.get("/health").status_code == 200
    assert rejected == ["/data", "/data"]

    with pytest.raises(WebSocketDisconnect) as e, client.websocket_connect("/ws"):
        pass
    assert e.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        assert ws.receive_text() == "hi"
    assert rejected == ["/data", "/data", "/ws"]


def test_middleware_without_a_token_passes_everything():
    rejected: list[str] = []
    client = TestClient(_app(credentials.Security(), rejected))
    assert client.get("/data").text == "hello"
    with client.websocket_connect("/ws") as ws:
        assert ws.receive_text() == "hi"
    assert rejected == []


def test_the_router_and_the_dashboard_check_tokens_with_the_same_middleware():
    """Issue 44: one bearer middleware. The router's check and the dashboard
    gate's are :class:`frontdoor.bearer.BearerAuth`, given their own words:
    the router an OpenAI-style 401 and its realm, the dashboard its sign-in
    form; a request without a token counts against the router's backoff but
    not the dashboard's (a browser's first visit)."""
    from dashboard.gate import TokenGate
    from proxy.intake import client_auth

    async def inner(scope, receive, send):
        await PlainTextResponse("hello")(scope, receive, send)

    sec = credentials.Security(token=TOKEN.encode())
    router = client_auth(inner, sec, api_key="sk-" + "k" * 20, backoff=backoff.FailureBackoff(failures=2))
    gate = TokenGate(inner, TOKEN.encode(), backoff.SignInBackoff(free=2))
    assert type(router) is bearer.BearerAuth and type(gate.bearer) is bearer.BearerAuth

    r = TestClient(router).get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == 'Bearer realm="kvlens proxy"'
    assert TestClient(router).get("/v1/models", headers={"Authorization": "Bearer sk-" + "k" * 20}).text == "hello"
    assert TestClient(router).get("/v1/models").status_code == 401
    assert TestClient(router).get("/v1/models").status_code == 429  # two refusals, missing tokens included

    page = TestClient(gate).get("/", headers={"Accept": "text/html"})
    assert page.status_code == 401 and "<form" in page.text
    assert page.headers["www-authenticate"] == 'Bearer realm="kvlens dashboard"'
    for _ in range(3):  # no token is no guess
        assert TestClient(gate).get("/").status_code == 401
    assert len(gate.backoff) == 0
    assert TestClient(gate).get("/", headers={"Authorization": f"Bearer {TOKEN}"}).text == "hello"


def test_a_failing_on_reject_still_answers_401():
    def boom(scope):
        raise RuntimeError("counter broke")

    async def inner(scope, receive, send):  # never reached
        raise AssertionError

    app = bearer.BearerAuth(inner, credentials.Security(token=TOKEN.encode()), on_reject=boom)
    assert TestClient(app).get("/x").status_code == 401


# ------------------------------------------------------------ real TLS
@contextlib.contextmanager
def _serve(app, security: credentials.Security):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", **serving.uvicorn_ssl_kwargs(security))
    )
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        while not server.started:
            if not t.is_alive():
                raise RuntimeError("uvicorn did not start")
            threading.Event().wait(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        t.join(30)
        sock.close()


def test_uvicorn_serves_tls_and_requires_client_certs(tmp_path):
    tls = make_tls(tmp_path / "tls")
    sec = credentials.Security(token=TOKEN.encode(), tls_cert=str(tls.cert), tls_key=str(tls.key))
    with _serve(_app(sec, []), sec) as port:
        url = f"https://127.0.0.1:{port}/data"
        with pytest.raises(httpx.ConnectError):  # the default trust store does not know the test CA
            httpx.get(url)
        r = httpx.get(url, verify=ssl.create_default_context(cafile=str(tls.ca)))
        assert r.status_code == 401
        r = httpx.get(
            url, verify=ssl.create_default_context(cafile=str(tls.ca)), headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.text == "hello"

    mtls = credentials.Security(tls_cert=str(tls.cert), tls_key=str(tls.key), tls_client_ca=str(tls.ca))
    with _serve(_app(mtls, []), mtls) as port:
        url = f"https://127.0.0.1:{port}/data"
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url, verify=ctx)
        ctx.load_cert_chain(str(tls.client_cert), str(tls.client_key))
        assert httpx.get(url, verify=ctx).text == "hello"


def test_repeated_refusals_get_429_with_retry_after_from_a_real_server():
    """Issue 42 item 10: after BACKOFF_FAILURES refusals in the window, a client
    gets 429 and Retry-After, its token no longer compared (the right one
    too: no oracle); another client is not affected; nothing reached the app."""
    reached: list[str] = []

    async def data(request):
        reached.append(request.url.path)
        return PlainTextResponse("hello")

    inner = Starlette(routes=[Route("/data", data, methods=["GET", "POST"])])
    sec = credentials.Security(token=TOKEN.encode())
    with _serve(bearer.BearerAuth(inner, sec), sec) as port:
        url = f"http://127.0.0.1:{port}/data"
        bad = {"Authorization": "Bearer " + "g" * 20}
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), trust_env=False) as guesser:
            codes = [guesser.post(url, headers=bad, content=b"x").status_code for _ in range(backoff.BACKOFF_FAILURES)]
            assert codes == [401] * backoff.BACKOFF_FAILURES
            r = guesser.post(url, headers=bad, content=b"x")
            assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= backoff.BACKOFF_WINDOW_S
            assert "too many refused credentials" in r.json()["message"]
            r = guesser.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 429  # blocked: the token is not even compared
        assert reached == []
        with httpx.Client(trust_env=False) as other:  # 127.0.0.1: another client
            assert other.get(url, headers={"Authorization": f"Bearer {TOKEN}"}).text == "hello"
        assert reached == ["/data"]
