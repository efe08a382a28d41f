"""``kvlens collect`` behind its front door: the bearer token on OTLP/HTTP and
OTLP/gRPC (no token or a wrong one: 401 / UNAUTHENTICATED, nothing written,
counted ``unauthenticated``), TLS with a CA made in the test on both, client
certificates, the refusal to listen beyond loopback with no token, and the
connector's / router's exporter (:func:`exporters.pipeline.otlp_exporter`)
sending ``$KVLENS_TOKEN`` over either protocol. Real components: the
command, the SDK exporters, grpcio, httpx, the store."""

from __future__ import annotations

import ssl

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

from collect_proc import Collect
from exporters import pipeline
from collector.grpc_receiver import METHOD, SERVICE
from kvrecord.config import TOKEN_ENV
from test_collector import pb_body, record_spans, stored, trace_ids
from tlscerts import make_tls

TOKEN = "kvlens-test-token-4f9a1c"
PB = {"content-type": "application/x-protobuf"}
EXPORT = f"/{SERVICE}/{METHOD}"
REJECTED = "kvlens_collector_requests_rejected_total"


def _n_stored(db, spans) -> int:
    return sum(map(len, stored(db, trace_ids(spans)).values()))


def _grpc_call(channel: grpc.Channel, body: bytes, token: str | None):
    md = (("authorization", f"Bearer {token}"),) if token is not None else None
    return channel.unary_unary(EXPORT)(body, timeout=10, metadata=md)


def test_token_on_http_and_grpc(tmp_path, monkeypatch):
    refused, good_http, good_grpc, good_env = (record_spans(1) for _ in range(4))
    c = Collect(tmp_path, env={TOKEN_ENV: TOKEN})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert "token required" in c.lines[-1]
        # HTTP: none, wrong -> 401 with a challenge; right -> written
        url = f"{c.http}/v1/traces"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = httpx.post(url, content=pb_body(refused), headers={**PB, **headers})
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), headers
        assert httpx.get(f"{c.http}/metrics").status_code == 401  # the scrape wants the token too ...
        assert httpx.get(f"{c.http}/healthz").status_code == 200  # ... the liveness probe does not
        assert httpx.post(url, content=pb_body(good_http), headers={**PB, **auth}).status_code == 200
        # gRPC: none, wrong -> UNAUTHENTICATED; right -> written
        with grpc.insecure_channel(c.grpc) as ch:
            for token in (None, "wrong"):
                with pytest.raises(grpc.RpcError) as e:
                    _grpc_call(ch, pb_body(refused), token)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
        assert GrpcExporter(endpoint=f"http://{c.grpc}", insecure=True, timeout=10).export(refused).name == "FAILURE"
        exporter = GrpcExporter(
            endpoint=f"http://{c.grpc}", insecure=True, timeout=10, headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert exporter.export(good_grpc).name == "SUCCESS"
        # the standard variable, read by the SDK itself
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TOKEN}")
        assert HttpExporter(endpoint=url, timeout=10).export(good_env[:4]).name == "SUCCESS"
        assert (
            GrpcExporter(endpoint=f"http://{c.grpc}", insecure=True, timeout=10).export(good_env[4:]).name == "SUCCESS"
        )
        # 3 HTTP + 3 gRPC refusals (two raw calls, the SDK without a token); the scrape is not counted
        assert c.metric(REJECTED, {"reason": "unauthenticated"}, headers=auth) == 6
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert TOKEN not in out + err + " ".join(c.lines)
    assert _n_stored(c.store, refused) == 0
    for spans in (good_http, good_grpc, good_env):
        assert _n_stored(c.store, spans) == len(spans)


def test_tls_and_a_token_file_on_both_sides_and_the_connectors_exporter(tmp_path, monkeypatch):
    """The connector's and router's exporter (``otlp_exporter``) sends
    ``$KVLENS_TOKEN`` over OTLP/HTTP and OTLP/gRPC, trusting the CA in the
    standard ``$OTEL_EXPORTER_OTLP_CERTIFICATE``."""
    tls = make_tls(tmp_path / "tls")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    via_http, via_grpc, refused = record_spans(1), record_spans(1), record_spans(1)
    c = Collect(tmp_path, "--token-file", str(token_file), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
    try:
        assert c.http.startswith("https://127.0.0.1:") and "token required, TLS" in c.lines[-1]
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the test CA
            httpx.get(f"{c.http}/healthz")
        assert httpx.get(f"{c.http}/healthz", verify=ctx).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(f"{c.http.replace('https', 'http')}/healthz")

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(tls.ca))
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS", raising=False)
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        # kvlens_collector: the endpoint is the connector's otlp_endpoint option (a kvlens collector)
        assert pipeline.otlp_exporter(c.http, kvlens_collector=True).export(refused).name == "FAILURE"  # no token
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert pipeline.otlp_exporter(c.http, kvlens_collector=True).export(via_http).name == "SUCCESS"
        exporter = pipeline.otlp_exporter(f"https://{c.grpc}", "grpc", kvlens_collector=True)
        assert exporter.export(via_grpc).name == "SUCCESS"
        exporter.shutdown()
        with grpc.insecure_channel(c.grpc) as ch:  # plain gRPC to the TLS port
            with pytest.raises(grpc.RpcError) as e:
                _grpc_call(ch, pb_body(refused), TOKEN)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        rc, _, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, via_http) == len(via_http) and _n_stored(c.store, via_grpc) == len(via_grpc)
    assert _n_stored(c.store, refused) == 0


def test_client_certificates_required_on_both_sides(tmp_path):
    tls = make_tls(tmp_path / "tls")
    spans = record_spans(1)
    c = Collect(tmp_path, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-client-ca", str(tls.ca))
    try:
        assert "client certificates required" in c.lines[-1]
        ca = tls.ca.read_bytes()
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(f"{c.http}/healthz", verify=ctx)
        with grpc.secure_channel(c.grpc, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                _grpc_call(ch, pb_body(spans), None)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ctx.load_cert_chain(str(tls.client_cert), str(tls.client_key))
        assert httpx.get(f"{c.http}/healthz", verify=ctx).status_code == 200
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=tls.client_key.read_bytes(),
            certificate_chain=tls.client_cert.read_bytes(),
        )
        with grpc.secure_channel(c.grpc, creds) as ch:
            assert _grpc_call(ch, pb_body(spans), None) == b""
    finally:
        rc, _, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, spans) == len(spans)


def test_beyond_loopback_without_a_token_is_refused_before_binding(tmp_path, capsys, monkeypatch):
    from kvlens.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    db = str(tmp_path / "c.db")
    assert main(["collect", "--host", "0.0.0.0", "--port", "0", "--grpc-port", "0", "--store", db]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "refusing to listen on 0.0.0.0" in err and TOKEN_ENV in err and "--insecure" in err
    assert not (tmp_path / "c.db").exists()  # refused before anything was opened
    # the other bad combinations: one line each, exit 2
    (tmp_path / "empty").write_text("")
    cases = [
        (["--token-file", str(tmp_path / "empty")], "is empty"),
        (["--token-file", str(tmp_path / "missing")], "cannot read --token-file"),
        (["--tls-cert", str(tmp_path / "empty")], "--tls-cert needs --tls-key"),
    ]
    for extra, why in cases:
        assert main(["collect", "--port", "0", "--no-grpc", "--store", db, *extra]) == 2
        assert why in capsys.readouterr().err


def test_help_explains_the_front_door(capsys):
    from kvlens.cli import main

    with pytest.raises(SystemExit):
        main(["collect", "--help"])
    out = capsys.readouterr().out
    for what in (
        "--grpc-port",
        "--no-grpc",
        "--token-file",
        TOKEN_ENV,
        "--tls-cert",
        "--tls-client-ca",
        "--insecure",
        "4317",
    ):
        assert what in out, what


def test_exporter_headers_and_protocol_come_from_the_environment_and_options(tmp_path):
    from kvrecord.config import Options

    assert pipeline.otlp_headers({}) is None  # the SDK reads OTEL_EXPORTER_OTLP_HEADERS itself
    env = {TOKEN_ENV: TOKEN, "OTEL_EXPORTER_OTLP_HEADERS": "X-Tenant=a,other=b"}
    assert pipeline.otlp_headers(env) == {"x-tenant": "a", "other": "b", "authorization": f"Bearer {TOKEN}"}
    env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = "Authorization=Basic%20xyz"  # an explicit standard header wins
    assert pipeline.otlp_headers(env) == {"authorization": "Basic xyz"}

    opts = Options.from_config({"kvlens_home": str(tmp_path)})
    assert pipeline.otlp_protocol(opts, {}) == "http/protobuf"
    assert pipeline.otlp_protocol(opts, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    configured = Options.from_config({"kvlens_home": str(tmp_path), "otlp_endpoint": "http://c:4318"})
    assert pipeline.otlp_protocol(configured, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "http/protobuf"
    grpc_opts = Options.from_config({"kvlens_home": str(tmp_path), "otlp_protocol": "GRPC"})
    assert grpc_opts.otlp_protocol == "grpc" and pipeline.otlp_protocol(grpc_opts, {}) == "grpc"
    assert Options.from_config(grpc_opts.to_config()) == grpc_opts
    with pytest.raises(ValueError, match="otlp_protocol must be one of http/protobuf, grpc"):
        Options.from_config({"otlp_protocol": "http/json"})
    with pytest.raises(ValueError, match="otlp_protocol"):
        Options.from_config({"otlp_protocoll": "grpc"})  # a typo names the option
