"""Issue 42 against the real servers: credentials scoped by role (item 4),
the Host / Origin / Content-Type guard (item 5), health without details
(item 6) on ``kvlens collect``; the router's receiver behind the ingest
token, never the API key; and kvlens' OTLP exporter sending its token only
to a kvlens collector, never over plain http beyond loopback (item 3).

Real components: the ``kvlens collect`` command, the router app under
uvicorn, the SDK's OTLP exporters, grpcio, httpx, the store. Every refused
request is shown to have written nothing."""

from __future__ import annotations

import contextlib
import logging
import socket
import time

import grpc
import httpx
import pytest

from collect_proc import Collect
from exporters import pipeline
from proxy.app import create_app
from proxy.config import ProxyConfig
from kvrecord.config import COLLECTORS_ENV, TOKEN_ENV
from test_collector import pb_body, record_spans, stored, trace_ids
from test_collector_auth import _grpc_call
from uvicorn_thread import serve

INGEST = "ingest-" + "i" * 24
READ = "read-" + "r" * 24
PB = {"content-type": "application/x-protobuf"}
REJECTED = "kvlens_collector_requests_rejected_total"


def _bearer(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


def _n_stored(db, spans) -> int:
    return sum(map(len, stored(db, trace_ids(spans)).values()))


def test_collector_roles_health_and_guard(tmp_path):
    """Ingest and read tokens of their own, no all-roles token: each opens
    its routes only; /healthz says only ok without the read token (no store
    path); a rebinding Host or a form's Content-Type is refused with the
    right token too. Nothing refused is stored."""
    refused, via_http, via_grpc = record_spans(2), record_spans(1), record_spans(1)
    c = Collect(tmp_path, env={"KVLENS_INGEST_TOKEN": INGEST, "KVLENS_READ_TOKEN": READ})
    url = f"{c.http}/v1/traces"
    try:
        assert "role tokens: ingest, read" in c.lines[-1]
        body = pb_body(refused)
        for headers in ({}, _bearer(READ), _bearer("x" * 24)):  # the read token does not ingest
            r = httpx.post(url, content=body, headers={**PB, **headers})
            assert r.status_code == 401, headers
        r = httpx.post(url, content=body, headers={**PB, **_bearer(INGEST), "Host": "evil.example"})
        assert r.status_code == 403 and "--allowed-host" in r.json()["message"]
        r = httpx.post(url, content=body, headers={"content-type": "text/plain", **_bearer(INGEST)})
        assert r.status_code == 415
        r = httpx.post(url, content=body, headers={**PB, **_bearer(INGEST), "Origin": "https://evil.example"})
        assert r.status_code == 403
        assert httpx.post(url, content=pb_body(via_http), headers={**PB, **_bearer(INGEST)}).status_code == 200
        with grpc.insecure_channel(c.grpc) as ch:
            with pytest.raises(grpc.RpcError) as e:
                _grpc_call(ch, body, READ)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _grpc_call(ch, pb_body(via_grpc), INGEST) == b""
        assert httpx.get(f"{c.http}/metrics", headers=_bearer(INGEST)).status_code == 401
        assert httpx.get(f"{c.http}/metrics", headers=_bearer(READ)).status_code == 200
        for path in ("/healthz", "/health"):
            for headers in ({}, _bearer(INGEST)):
                r = httpx.get(c.http + path, headers=headers)
                assert r.status_code == 200 and r.json() == {"status": "ok"}, (path, headers)
                assert str(c.store) not in r.text
            full = httpx.get(c.http + path, headers=_bearer(READ)).json()
            assert full["status"] == "ok" and full["store"] == str(c.store) and "queue_spans" in full
        assert c.metric(REJECTED, {"reason": "unauthenticated"}, headers=_bearer(READ)) == 4
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert INGEST not in out + err and READ not in out + err
    assert _n_stored(c.store, refused) == 0
    assert _n_stored(c.store, via_http) == len(via_http) and _n_stored(c.store, via_grpc) == len(via_grpc)


def test_an_open_loopback_collector_refuses_what_a_web_page_could_send(tmp_path):
    """No token (the default on loopback): a form's POST, a rebinding Host,
    another site's Origin are refused; nothing is stored."""
    refused, kept = record_spans(1), record_spans(1)
    c = Collect(tmp_path, "--no-grpc")
    url = f"{c.http}/v1/traces"
    try:
        for headers, status in (
            ({"content-type": "text/plain"}, 415),
            ({"content-type": "application/x-www-form-urlencoded"}, 415),
            ({**PB, "Host": "evil.example"}, 403),
            ({**PB, "Host": "kvlens.attacker.example:4318"}, 403),
            ({**PB, "Origin": "http://evil.example"}, 403),
        ):
            assert httpx.post(url, content=pb_body(refused), headers=headers).status_code == status, headers
        assert httpx.post(url, content=pb_body(kept), headers=PB).status_code == 200
        port = c.http.rsplit(":", 1)[1]
        assert httpx.get(f"http://localhost:{port}/healthz").status_code == 200  # a loopback name passes
    finally:
        rc, _, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, refused) == 0 and _n_stored(c.store, kept) == len(kept)


def _host_address() -> str | None:
    """This host's address beyond loopback (the interface of its default route), or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: UDP connect only picks the route
        ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    return None


def test_the_exporter_sends_its_token_only_to_a_marked_collector_and_never_in_clear(tmp_path, monkeypatch, caplog):
    """Item 3: kvlens' OTLP exporter with ``$KVLENS_TOKEN`` set. Plain http
    to an address beyond loopback: no token sent (the collector refuses the
    spans: nothing stored), one error naming the endpoint, and the exporter
    still works (serving goes on). An endpoint named only by the standard
    variables and not marked: no token either. Marked (kvlens' own option,
    or ``$KVLENS_COLLECTOR_ENDPOINTS``) on loopback: sent."""
    ip = _host_address()
    if ip is None:
        pytest.skip("this host has no address beyond loopback")
    in_clear, unmarked, listed, own = (record_spans(1) for _ in range(4))
    c = Collect(tmp_path, "--host", "0.0.0.0", "--no-grpc", env={TOKEN_ENV: INGEST})
    port = c.http.rsplit(":", 1)[1]
    monkeypatch.setenv(TOKEN_ENV, INGEST)
    for k in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", COLLECTORS_ENV):
        monkeypatch.delenv(k, raising=False)
    caplog.set_level(logging.ERROR, logger="kvlens")
    try:
        clear = f"http://{ip}:{port}"
        for _ in range(2):  # a second exporter to the same endpoint logs nothing more
            assert pipeline.otlp_exporter(clear, kvlens_collector=True).export(in_clear).name == "FAILURE"
        errors = [r.getMessage() for r in caplog.records if clear in r.getMessage()]
        assert len(errors) == 1 and "plain http beyond loopback" in errors[0] and INGEST not in errors[0]
        loop = f"http://127.0.0.1:{port}"
        assert pipeline.otlp_exporter(loop).export(unmarked).name == "FAILURE"
        assert any("not marked as a kvlens collector" in r.getMessage() for r in caplog.records)
        monkeypatch.setenv(COLLECTORS_ENV, f"https://other:4318, 127.0.0.1:{port}")
        assert pipeline.otlp_exporter(loop).export(listed).name == "SUCCESS"
        monkeypatch.delenv(COLLECTORS_ENV)
        assert pipeline.otlp_exporter(loop, kvlens_collector=True).export(own).name == "SUCCESS"
        assert c.metric(REJECTED, {"reason": "unauthenticated"}, headers=_bearer(INGEST)) == 3
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, in_clear) == 0 and _n_stored(c.store, unmarked) == 0
    assert _n_stored(c.store, listed) == len(listed) and _n_stored(c.store, own) == len(own)


@pytest.mark.parametrize(
    "endpoint, marked, env, refused",
    [
        ("http://10.0.0.5:4318", True, {}, "plain http beyond loopback"),
        ("http://collector.internal:4318", True, {}, "plain http beyond loopback"),
        ("https://vendor.example:4318", False, {}, "not marked"),
        ("https://vendor.example:4318", False, {COLLECTORS_ENV: "https://collector:4318"}, "not marked"),
        ("https://collector:4318/v1/traces", False, {COLLECTORS_ENV: "https://collector:4318"}, None),
        ("https://collector:4318", False, {COLLECTORS_ENV: "collector:4318"}, None),
        ("https://collector:4318", False, {COLLECTORS_ENV: "http://collector:4318"}, "not marked"),
        ("https://collector:4318", True, {}, None),
        ("http://[::1]:4318", True, {}, None),
        ("http://localhost:4318", True, {}, None),
    ],
)
def test_token_refusal_rules(endpoint, marked, env, refused):
    why = pipeline.token_refusal(endpoint, marked, env)
    assert (why is None) if refused is None else (refused in why and endpoint in why)
    headers = pipeline.otlp_headers({**env, "KVLENS_INGEST_TOKEN": INGEST, TOKEN_ENV: "o" * 20}, endpoint, marked)
    assert headers == (None if refused else {"authorization": f"Bearer {INGEST}"})  # the ingest token first


@contextlib.contextmanager
def _router(cfg: ProxyConfig):
    with serve(create_app(cfg)) as url:
        yield url


def test_the_routers_receiver_takes_the_ingest_token_never_the_api_key(tmp_path):
    """Item 4: with ``--collect``, every OpenAI client holds the API key; it
    must not post spans into the router's store. The ingest token does. The
    real ``kvlens proxy --collect`` (a process: its receiver registers its
    metrics in the process-wide registry)."""
    import os
    import signal
    import subprocess
    import sys

    from kvrecord.guard import parent_death_signal
    from kvrecord.ports import free_port

    forged, kept = record_spans(1), record_spans(1)
    key = "sk-" + "k" * 20
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "KVLENS_API_KEY", "VLLM_API_KEY")}
    env.update(KVLENS_HOME=str(tmp_path), KVLENS_INGEST_TOKEN=INGEST, KVLENS_API_KEY=key)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "proxy", "--mode", "pull", "--prefill", "http://127.0.0.1:9",
         "--decode", "http://127.0.0.1:9", "--port", str(port), "--collect", "--no-telemetry"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: parent_death_signal(signal.SIGTERM),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "router did not start"
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2, trust_env=False)
                break
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=20, trust_env=False) as c:
            for headers in ({}, _bearer(key), _bearer(READ)):
                r = c.post("/v1/traces", content=pb_body(forged), headers={**PB, **headers})
                assert r.status_code == 401, headers
            assert c.post("/v1/traces", content=pb_body(kept), headers={**PB, **_bearer(INGEST)}).status_code == 200
            assert c.get("/metrics/", headers=_bearer(key)).status_code == 200  # the API key reads metrics
            assert c.get("/metrics/", headers=_bearer(INGEST)).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)  # flushes the receiver's queue
        out, _ = proc.communicate(timeout=30)
    assert INGEST not in out and key not in out
    db = tmp_path / "traces.db"
    assert _n_stored(db, forged) == 0 and _n_stored(db, kept) == len(kept)


# ------------------------------------------------------------ item 8: the API key off the command line
def test_the_api_key_comes_from_a_file_and_the_flag_warns(tmp_path):
    """``kvlens proxy --api-key-file``: the real command in front of fake P
    and D; the key is not in its command line, clients must send it, P and D
    get it. ``--api-key`` still works, with a warning naming ps."""
    import os
    import signal
    import subprocess
    import sys

    from fakes import FakeVllm, d_answers, p_ok
    from kvrecord.guard import parent_death_signal
    from kvrecord.ports import free_port

    key = "sk-file-" + "k" * 24
    f = tmp_path / "api-key"
    f.write_text(key + "\n")
    f.chmod(0o600)
    p, d = FakeVllm(p_ok), FakeVllm(d_answers)
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "KVLENS_API_KEY", "VLLM_API_KEY")}
    env["KVLENS_HOME"] = str(tmp_path / "home")
    port = free_port()
    argv = [
        sys.executable, "-m", "kvlens.cli", "proxy", "--mode", "pull", "--prefill", p.url, "--decode", d.url,
        "--port", str(port), "--api-key-file", str(f), "--no-telemetry",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: parent_death_signal(signal.SIGTERM),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "router did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            time.sleep(0.2)
        assert key not in open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        with httpx.Client(base_url=url, timeout=20, trust_env=False) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers=_bearer(key)).status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=_bearer(key))
            assert r.status_code == 200
            assert c.post("/admin/split", json={"push": 1}, headers=_bearer(key)).status_code == 401
        assert p.requests[0]["headers"]["Authorization"] == f"Bearer {key}"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        p.close()
        d.close()
    assert "warning" not in out and key not in out

    # the flag still works, with the warning; both, or a bad file: exit 2 naming the problem
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvlens.cli", "proxy", "--mode", "pull", "--prefill", "http://127.0.0.1:9",
             "--decode", "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "1", *extra],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    both = run("--api-key", key, "--api-key-file", str(f))
    assert both.returncode == 2 and "not both" in both.stderr
    (tmp_path / "empty").write_text("\n")
    bad = run("--api-key-file", str(tmp_path / "empty"))
    assert bad.returncode == 2 and "--api-key-file" in bad.stderr and "one line" in bad.stderr
    gone = run("--api-key-file", str(tmp_path / "nope"))
    assert gone.returncode == 2 and "cannot read --api-key-file" in gone.stderr
    flag = run("--api-key", key, "--tls-cert", str(tmp_path / "nope.pem"))  # stops after the key is read
    assert flag.returncode == 2 and "ps shows it to every user" in flag.stderr and key not in flag.stderr


@pytest.mark.parametrize("command", ["up", "bench", "proxy"])
def test_help_names_the_api_key_file_and_the_risk_of_the_flag(command, capsys):
    from kvlens.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--api-key-file" in out and "ps shows it" in out and "KVLENS_API_KEY" in out


@pytest.mark.parametrize("command", [["up", "--mode", "push"], ["bench", "--proxy", "http://127.0.0.1:9"]])
def test_up_and_bench_refuse_an_unreadable_api_key_file_before_starting_anything(command, tmp_path, capsys):
    from kvlens.cli import main

    assert main([*command, "--api-key-file", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "cannot read --api-key-file" in err and str(tmp_path / "nope") in err


def test_the_dashboard_takes_the_read_token(monkeypatch):
    """Item 4: the dashboard only reads. Its gate gets the read token when one
    is set, else the all-roles token; neither variable leaks to Streamlit
    otherwise, and a short read token is refused like any token."""
    import argparse

    from frontdoor import credentials, flags
    from kvlens import dashboard_cmd

    p = argparse.ArgumentParser()
    dashboard_cmd.add_arguments(p)
    monkeypatch.setenv(TOKEN_ENV, "all-roles-" + "t" * 16)
    monkeypatch.setenv("KVLENS_READ_TOKEN", READ)
    sec = flags.from_args(p.parse_args([]), "0.0.0.0")
    env = dashboard_cmd.child_env(security=sec)
    assert env[TOKEN_ENV] == READ and "KVLENS_READ_TOKEN" not in env
    monkeypatch.delenv("KVLENS_READ_TOKEN")
    sec = flags.from_args(p.parse_args([]), "0.0.0.0")
    assert dashboard_cmd.child_env(security=sec)[TOKEN_ENV] == "all-roles-" + "t" * 16
    monkeypatch.setenv("KVLENS_READ_TOKEN", "short")
    with pytest.raises(credentials.SecurityError, match="KVLENS_READ_TOKEN: the token is 5 characters"):
        flags.from_args(p.parse_args([]), "127.0.0.1")
    assert "--read-token-file" in p.format_help()


def test_the_router_slows_a_guesser_down(tmp_path):
    """Item 10 on the router: after BACKOFF_FAILURES refusals from one
    address, 429 with Retry-After, the key no longer compared; /health and
    other clients unaffected; no request reached the routes."""
    from frontdoor import backoff

    key = "sk-" + "k" * 24
    cfg = ProxyConfig(
        prefill_url="http://127.0.0.1:9", decode_url="http://127.0.0.1:9", mode="pull",
        kvlens_home=str(tmp_path), telemetry=False, api_key=key,
    )  # fmt: skip
    with _router(cfg) as url:
        guess = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), trust_env=False, timeout=20)
        with guess:
            bad = _bearer("g" * 24)
            codes = [guess.get(url + "/admin/split", headers=bad).status_code for _ in range(backoff.BACKOFF_FAILURES)]
            assert codes == [401] * backoff.BACKOFF_FAILURES
            r = guess.get(url + "/v1/models", headers=_bearer(key))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert guess.get(url + "/health").json() == {"status": "unhealthy"}  # never slowed (P, D: none here)
        assert httpx.get(url + "/admin/split", headers=bad, timeout=20).status_code == 401  # 127.0.0.1: its own count


def test_bench_reads_the_routers_mode_with_the_read_token(tmp_path, monkeypatch):
    """Item 6: the mode is a /health detail now; ``kvlens bench --proxy`` sends
    $KVLENS_READ_TOKEN (else $KVLENS_TOKEN, else its API key) to read it."""
    from fakes import FakeVllm, d_answers, p_ok
    from kvlens.bench.probe import probe_router

    p, d = FakeVllm(p_ok), FakeVllm(d_answers)
    cfg = ProxyConfig(
        prefill_url=p.url, decode_url=d.url, mode="pull", kvlens_home=str(tmp_path), telemetry=False,
        read_token=READ, token="all-roles-" + "t" * 16,
    )  # fmt: skip
    for k in (TOKEN_ENV, "KVLENS_READ_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    try:
        with _router(cfg) as url:
            assert probe_router(url).mode is None  # no credential: {"status": "ok"} only
            monkeypatch.setenv("KVLENS_READ_TOKEN", READ)
            assert probe_router(url).mode == "pull"
            monkeypatch.delenv("KVLENS_READ_TOKEN")
            monkeypatch.setenv(TOKEN_ENV, cfg.token)
            assert probe_router(url).mode == "pull"
    finally:
        p.close()
        d.close()
