"""``kvlens proxy`` behind its token and TLS (issue 33, item 2): the real
command as a process, over HTTPS with a certificate made here, in front of
the fake P and D of ``tests/fakes.py``, hosting the OTLP receiver
(``--collect``) fed by the OpenTelemetry SDK's own OTLP/HTTP exporter.

No token -> 401 and nothing reaches P, D or the store; a wrong token -> 401;
the right one -> served, and the token never goes to P or D nor onto a
command line."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fakes import FakeVllm, d_answers, p_ok
from proxy import cli
from frontdoor.flags import API_KEY_ENV
from kvrecord import semconv as sc
from kvrecord.config import TOKEN_ENV
from kvrecord.guard import parent_death_signal
from kvrecord.ports import free_port
from kvrecord.recorder import Recorder
from kvtrace import store
from tlscerts import make_tls

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-" + secrets.token_hex(16)


def _dies_with_us() -> None:
    """In the child: SIGTERM when this test process dies, so an interrupted run leaves no server behind."""
    parent_death_signal(signal.SIGTERM)


def _spans(n: int = 3) -> list:
    """Finished SDK spans of ``n`` prefills, as P's recorder makes them."""
    exporter = InMemorySpanExporter()

    def build(id_generator):
        tp = TracerProvider(
            resource=Resource.create({"service.name": "kvlens-prefill", "kvlens.role": "prefill"}),
            id_generator=id_generator,
        )
        tp.add_span_processor(SimpleSpanProcessor(exporter))
        return tp

    rec = Recorder(role="prefill", mode="pull", engine_id="p0", pipeline_factory=build)
    t0 = time.time_ns() - 10**9
    for i in range(n):
        rid = f"cmpl-{secrets.token_hex(16)}-0-{secrets.token_hex(4)}"
        rec.record(sc.Phase.PREFILL, rid, t0 + i * 10**6, t0 + (i + 5) * 10**6, "ok", {sc.ATTR_TOKENS: 16})
    rec.flush()
    spans = list(exporter.get_finished_spans())
    rec.close()
    return spans


def _ca(path: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(path))


def _tids(spans) -> list[str]:
    return sorted({format(s.context.trace_id, "032x") for s in spans})


def _export(url: str, spans, ca: Path, token: str | None) -> str:
    """The SDK's OTLP/HTTP exporter, as P and D send their spans."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    headers = {"authorization": f"Bearer {token}"} if token else None
    exp = OTLPSpanExporter(endpoint=url + "/v1/traces", certificate_file=str(ca), headers=headers, timeout=10)
    try:
        return exp.export(spans).name
    finally:
        exp.shutdown()


@pytest.fixture
def router_proc(tmp_path):
    """``kvlens proxy --collect`` over TLS with ``$KVLENS_TOKEN``, in front of fake P and D."""
    tls = make_tls(tmp_path / "tls")
    p, d = FakeVllm(p_ok), FakeVllm(d_answers)
    port = free_port()
    env = {**os.environ, "KVLENS_HOME": str(tmp_path / "home"), TOKEN_ENV: TOKEN, "PYTHONPATH": str(REPO)}
    for k in API_KEY_ENV:
        env.pop(k, None)
    argv = [
        sys.executable, "-m", "kvlens.cli", "proxy", "--mode", "pull", "--prefill", p.url, "--decode", d.url,
        "--port", str(port), "--collect", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_dies_with_us
    )
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(url + "/health", verify=_ca(tls.ca), timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield proc, url, tls, p, d, tmp_path / "home" / "traces.db"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        p.close()
        d.close()


def test_router_and_its_receiver_need_the_token_over_tls(router_proc, monkeypatch):
    proc, url, tls, p, d, db = router_proc
    # requests (under the SDK's exporter) lets these variables win over the session's CA file
    # (certificate_file), so a host that sets them would make it verify against the system CAs
    for k in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(k, raising=False)
    assert TOKEN not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()  # ps shows it to every user

    def call(headers: dict) -> list[int]:
        with httpx.Client(base_url=url, verify=_ca(tls.ca), timeout=20, trust_env=False, headers=headers) as c:
            return [
                c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code,
                c.get("/v1/models").status_code,
                c.get("/metrics/").status_code,
            ]

    refused_spans, kept_spans = _spans(), _spans()
    assert call({}) == [401, 401, 401]
    assert call({"Authorization": "Bearer wrong"}) == [401, 401, 401]
    assert call({"Authorization": TOKEN}) == [401, 401, 401]  # no scheme
    assert _export(url, refused_spans, tls.ca, None) == "FAILURE"
    assert _export(url, refused_spans, tls.ca, "wrong") == "FAILURE"
    assert not p.requests and not d.requests  # nothing spent on a refused request
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, verify=_ca(tls.ca), timeout=20, trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(httpx.HTTPError):  # TLS only: plain HTTP on that port is not served
        httpx.get(url.replace("https", "http") + "/health", timeout=5, trust_env=False)

    assert call({"Authorization": f"Bearer {TOKEN}"}) == [200, 200, 200]
    assert _export(url, kept_spans, tls.ca, TOKEN) == "SUCCESS"
    assert len(p.requests) == 1 and len(d.requests) == 1
    # the router's token is its own: not P's or D's to see
    assert "Authorization" not in p.requests[0]["headers"] and "Authorization" not in d.requests[0]["headers"]

    proc.send_signal(signal.SIGTERM)  # flushes the receiver's queue
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal once shut down
    assert TOKEN not in out
    with store.reading(db) as c:
        kept = store.spans_for(c, _tids(kept_spans))
        refused = store.spans_for(c, _tids(refused_spans))
    assert sum(map(len, kept.values())) == len(kept_spans)
    assert not any(refused.values())  # a refused export wrote nothing


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["--mode", "pull", "--prefill", "http://p:1", "--decode", "http://d:2", *argv])


def test_router_refuses_an_open_host_without_token_or_key(monkeypatch, tmp_path, capsys):
    for k in (TOKEN_ENV, *API_KEY_ENV):
        monkeypatch.delenv(k, raising=False)
    assert cli.run(_args("--host", "0.0.0.0")) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in err and "--insecure" in err and TOKEN_ENV in err
    # what lets it bind: a token, an API key (what OpenAI clients send), or --insecure
    assert cli.security(_args("--host", "0.0.0.0", "--insecure"), None).insecure
    assert cli.security(_args("--host", "0.0.0.0"), "sk-1").token is None
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    sec = cli.security(_args("--host", "0.0.0.0"), None)
    assert sec.token == TOKEN.encode() and TOKEN not in repr(sec)
    cfg = cli.config(_args(), sec.token)
    assert cfg.client_key == TOKEN and TOKEN not in repr(cfg)
    (tmp_path / "tok").write_text("from-file-0123456789\n")
    (tmp_path / "tok").chmod(0o600)
    assert cli.security(_args("--token-file", str(tmp_path / "tok")), None).token == b"from-file-0123456789"
    # TLS needs both files; a missing one is named
    assert cli.run(_args("--tls-cert", str(tmp_path / "nope.pem"))) == 2
    assert "--tls-cert needs --tls-key" in capsys.readouterr().err
