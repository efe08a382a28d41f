"""A real Prometheus (Debian ``prometheus`` 2.42) scraping kvlens metrics:
values, ``job``/``instance`` labels, recording rules, alert rules (loaded, and
two of them firing on handoff-health series) and exemplars; and the wrapper's
input validation and clean shutdown. ``promtool`` checks and rule tests: tests/unit/test_alert_rules.py."""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from exporters.metrics import PhaseMetricsProcessor
from exporters.prometheus_server import RULE_FILES, PrometheusError, PrometheusServer, alert_rules_path, rules_path
from kvtrace.store import StoreSpanExporter
from kvrecord import semconv as sc
from kvrecord.ports import free_port

PROMETHEUS = Path("/usr/bin/prometheus")
needs_prometheus = pytest.mark.skipif(
    not PROMETHEUS.exists(), reason="install Debian package prometheus: apt-get install prometheus"
)


class Feed:
    """Spans -> store + metrics, as one kvlens host would produce them."""

    def __init__(self, tmp_path: Path) -> None:
        self.reg = CollectorRegistry()
        db = tmp_path / "traces.db"
        self.proc = PhaseMetricsProcessor(self.reg, store_path=db, handoff_poll_s=0.02)
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
        self.provider.add_span_processor(self.proc)
        self.tracer = self.provider.get_tracer("test")
        self.n = 0
        self.trace_ids: list[str] = []

    def _span(self, name, tid, t0, t1, attrs):
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(int(tid, 16), 7, True, TraceFlags(1))))
        a = {sc.ATTR_OUTCOME: "ok"}
        a.update(attrs)
        self.tracer.start_span(name, context=ctx, attributes=a, start_time=t0).end(end_time=t1)

    def request(self, mode: str, handoff_s: float, ttft_s: float) -> str:
        self.n += 1
        tid = f"{self.n:032x}"
        t = time.time_ns()
        h = int(handoff_s * 1e9)
        P = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: "prefill"}
        D = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: "decode"}
        self._span("prefill.finished", tid, t, t, P)
        # one message each way between P and D, which bound the clocks (one host: the raw figure stands)
        if mode == "push":
            self._span("registration.send", tid, t - 3000, t - 2500, D)
            self._span("registration.receive", tid, t - 2000, t - 2000, P)
            self._span("write.post", tid, t + 100, t + 200, P)
        else:
            self._span("alloc", tid, t + 100, t + 100, D)
            self._span("read.post", tid, t + 200, t + 300, D)
            self._span("kv.released", tid, t + h, t + h, P)
        self._span("kv.ready", tid, t + h, t + h, D)
        self._span(
            "request",
            tid,
            t - 1000,
            t + h + 1000,
            {sc.ATTR_MODE: mode, sc.ATTR_ROLE: "router", sc.ATTR_TTFT_S: ttft_s, sc.ATTR_DISPATCH: "overlapped"},
        )
        self.trace_ids.append(tid)
        return tid

    def flush(self) -> None:
        assert self.proc.force_flush(5000)

    def close(self) -> None:
        self.provider.shutdown()


@pytest.fixture
def target(tmp_path):
    feed = Feed(tmp_path)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=feed.reg)
    yield feed, f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()
    feed.close()


@pytest.fixture
def health_target():
    """A second scrape target with handoff-health series as the connector exports
    them (names: docs/handoff-health.md), in a registry of their own: one stuck decode
    handoff (oldest open started a minute ago), an idle prefill side (NaN), a
    stale counter at 0 that the test then increments."""
    reg = CollectorRegistry()
    oldest = Gauge(
        "kvlens_handoff_oldest_open_start_timestamp_seconds", "oldest open", ("mode", "role", "phase"), registry=reg
    )
    oldest.labels("push", "decode", "awaiting_kv").set(time.time() - 60)
    oldest.labels("pull", "prefill", "awaiting_read").set(math.nan)
    opened = Gauge("kvlens_handoffs_open", "open", ("mode", "role", "phase"), registry=reg)
    opened.labels("push", "decode", "awaiting_kv").set(1)
    opened.labels("pull", "prefill", "awaiting_read").set(0)
    stale = Counter("kvlens_kv_stale", "stale", ("mode",), registry=reg)
    stale.labels("pull")  # 0 before the first event
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=reg)
    yield stale, f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def alert_states(prom: PrometheusServer) -> dict[str, list[dict]]:
    """Alert name -> its active alerts (pending or firing), from ``/api/v1/rules``."""
    return {
        r["name"]: r.get("alerts") or [] for g in prom.rule_groups() for r in g["rules"] if r.get("type") == "alerting"
    }


def wait_for(prom: PrometheusServer, promql: str, ok, timeout: float = 30.0):
    last = None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        last = prom.query(promql)
        if ok(last):
            return last
        time.sleep(0.25)
    raise AssertionError(f"{promql}: condition not met in {timeout}s, last result {last}")


def dashboard_exprs() -> list[str]:
    import json

    path = rules_path().parent / "grafana_dashboard.json"
    dash = json.loads(path.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_uses_known_series_and_datasource_input():
    import re

    rules = rules_path().read_text()
    recorded = set(re.findall(r"record: (\S+)", rules))
    exprs = dashboard_exprs()
    assert exprs
    for e in exprs:
        for name in re.findall(r"kvlens:[a-z0-9_:]+", e):
            assert name in recorded, name
        for name in re.findall(r"\bkvlens_[a-z_]+", e):
            assert re.sub(r"_(bucket|count|sum|total)$", "", name) in KNOWN_FAMILIES, name
    text = (rules_path().parent / "grafana_dashboard.json").read_text()
    assert '"uid": "${DS_PROMETHEUS}"' in text


KNOWN_FAMILIES = {
    "kvlens_phase_duration_seconds",
    "kvlens_handoff_seconds",
    "kvlens_handoff_unresolved",
    "kvlens_ttft_seconds",
    "kvlens_requests",
    "kvlens_transfer_bytes",
    "kvlens_transfer_descriptors",
    "kvlens_push_registrations_waiting",
    "kvlens_push_prefills_waiting",
    "kvlens_telemetry_dropped",
    "kvlens_clock_offset_seconds",
    "kvlens_clock_offset_width_seconds",
}


def _value(res) -> float:
    return float(res[0]["value"][1])


@needs_prometheus
def test_real_prometheus_scrapes_rules_and_exemplars(target, health_target, tmp_path):
    feed, addr = target
    stale, health_addr = health_target
    for i in range(3):
        feed.request("push", 0.004 + i * 0.001, 0.05)
    for i in range(2):
        feed.request("pull", 0.02, 0.08)
    feed.flush()

    prom = PrometheusServer(
        {"kvlens-router": [addr], "vllm-decode": [health_addr]},
        port=0,
        data_dir=tmp_path / "prom",
        scrape_interval="1s",
    )
    with prom:
        pid = prom.proc.pid
        # both rule files loaded: the recording group and every alert of alert_rules.yml
        groups = prom.rule_groups()
        assert {Path(g["file"]).name for g in groups} == set(RULE_FILES)
        import yaml

        shipped = {r["alert"] for g in yaml.safe_load(alert_rules_path().read_text())["groups"] for r in g["rules"]}
        assert set(alert_states(prom)) == shipped
        assert all(g["rules"] and all(r["health"] != "err" for r in g["rules"]) for g in groups), groups

        res = wait_for(prom, 'sum(kvlens_handoff_seconds_count{mode="push"})', lambda r: r and _value(r) == 3)
        assert _value(res) == 3
        assert _value(prom.query('sum(kvlens_handoff_seconds_count{mode="pull"})')) == 2
        assert _value(prom.query('sum(kvlens_requests_total{mode="pull",outcome="ok"})')) == 2
        series = prom.query('kvlens_handoff_seconds_count{mode="push"}')
        assert series[0]["metric"]["job"] == "kvlens-router"
        assert series[0]["metric"]["instance"] == addr

        # rates need traffic between two scrapes: keep feeding until the rules see it
        def more():
            feed.request("push", 0.003, 0.04)
            feed.request("pull", 0.03, 0.09)
            feed.flush()

        end = time.monotonic() + 40
        got = []
        while time.monotonic() < end:
            more()
            got = prom.query("kvlens:handoff_seconds:p50_push_over_pull_1m")
            if got and not math.isnan(_value(got)):
                break
            time.sleep(0.5)
        assert got, "recording rule kvlens:handoff_seconds:p50_push_over_pull_1m produced no sample"
        ratio = _value(got)
        assert 0 < ratio < 1, ratio  # push handoffs here are ~5x shorter than pull
        p99 = prom.query('kvlens:handoff_seconds:p99_1m{mode="pull"}')
        assert 0.025 <= _value(p99) <= 0.05  # pull handoffs are 20-30 ms: inside the 25-50 ms bucket
        assert prom.query('kvlens:ttft_seconds:p50_1m{mode="push"}')

        # every dashboard query parses and runs on this Prometheus
        for expr in dashboard_exprs():
            prom.query(expr.replace("$__rate_interval", "1m").replace("$mode", "push|pull"))

        now = time.time()
        ex = prom.query_exemplars('kvlens_handoff_seconds_bucket{mode="push"}', now - 300, now + 60)
        seen = {e["labels"].get("trace_id") for s in ex for e in s["exemplars"]}
        assert seen & set(feed.trace_ids), ex

        # alerts on the health series: the stuck decode handoff fires (after its for: 5s), the
        # NaN prefill side does not; a stale handoff fires once the counter moves from its scraped 0
        wait_for(prom, 'kvlens_kv_stale_total{mode="pull"}', lambda r: r and _value(r) == 0)
        stale.labels("pull").inc()
        end = time.monotonic() + 60
        states: dict[str, list[dict]] = {}
        while time.monotonic() < end:
            states = alert_states(prom)
            firing = {n for n, al in states.items() for a in al if a["state"] == "firing"}
            if {"KvlensHandoffStuck", "KvlensStaleKV"} <= firing:
                break
            time.sleep(0.5)
        stuck = [a for a in states["KvlensHandoffStuck"] if a["state"] == "firing"]
        assert [a["labels"]["role"] for a in stuck] == ["decode"], states["KvlensHandoffStuck"]
        labels = stuck[0]["labels"]
        assert (labels["instance"], labels["mode"], labels["phase"]) == (health_addr, "push", "awaiting_kv")
        assert stuck[0]["annotations"]["runbook_url"] == "docs/handoff-health.md#kvlenshandoffstuck"
        assert health_addr in stuck[0]["annotations"]["summary"]
        st = [a for a in states["KvlensStaleKV"] if a["state"] == "firing"]
        assert [a["labels"]["mode"] for a in st] == ["pull"], states["KvlensStaleKV"]
        assert not states["KvlensHandoffsFailing"] and not states["KvlensPinnedKVGrowing"]

        # the dashboard's health strip reads the same series (its PromQL on a real Prometheus)
        from dashboard import prom as dash_prom

        figs = dash_prom.prom_health(prom.url, "5m")
        assert figs["open"].value == 1 and figs["oldest_s"].value >= 60
        assert figs["stale"].value >= 1
        # no outcome or registration-timeout series here: unknown, with the metric named, never 0
        assert figs["expired"].value is None and "kvlens_handoff_outcomes_total" in figs["expired"].unknown
        assert figs["reg_timeouts"].value is None and figs["reg_timeouts"].unknown
    assert not prom.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone: reaped, no orphan


def test_validation_errors():
    with pytest.raises(ValueError, match="empty"):
        PrometheusServer({})
    with pytest.raises(ValueError, match="port"):
        PrometheusServer({"kvlens-router": ["127.0.0.1:1"]}, port=70000)
    with pytest.raises(ValueError, match="port"):
        PrometheusServer({"kvlens-router": ["127.0.0.1:1"]}, port="9090")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host:port"):
        PrometheusServer({"vllm-decode": ["http://127.0.0.1:8000/metrics"]})
    with pytest.raises(ValueError, match="non-empty list"):
        PrometheusServer({"vllm-decode": []})
    with pytest.raises(ValueError, match="non-empty list"):
        PrometheusServer({"vllm-decode": "127.0.0.1:8000"})
    with pytest.raises(ValueError, match="job name"):
        PrometheusServer({"bad job": ["127.0.0.1:8000"]})
    with pytest.raises(ValueError, match="scrape_interval"):
        PrometheusServer({"vllm-decode": ["127.0.0.1:8000"]}, scrape_interval="fast")


def test_missing_binary_says_how_to_install(tmp_path):
    p = PrometheusServer(
        {"vllm-prefill": ["127.0.0.1:8000"]}, port=0, data_dir=tmp_path, binary=tmp_path / "no-prometheus"
    )
    with pytest.raises(PrometheusError, match="apt-get install prometheus"):
        p.start()


def test_busy_port_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = PrometheusServer(
            {"vllm-prefill": ["127.0.0.1:8000"]},
            port=port,
            data_dir=tmp_path,
            binary=PROMETHEUS if PROMETHEUS.exists() else "/bin/true",
        )
        with pytest.raises(PrometheusError, match="busy"):
            p.start()
        assert p.proc is None


def test_config_has_the_three_jobs_and_rules(tmp_path):
    p = PrometheusServer(
        {
            "kvlens-router": ["127.0.0.1:8000"],
            "vllm-prefill": ["10.0.0.1:8100", "10.0.0.2:8100"],
            "vllm-decode": ["10.0.0.3:8200"],
        },
        data_dir=tmp_path,
    )
    path = p.write_config()
    import json

    cfg = json.loads(path.read_text())
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["kvlens-router", "vllm-prefill", "vllm-decode"]
    assert cfg["scrape_configs"][1]["static_configs"][0]["targets"] == ["10.0.0.1:8100", "10.0.0.2:8100"]
    assert cfg["rule_files"] == ["recording_rules.yml", "alert_rules.yml"]
    assert (tmp_path / "recording_rules.yml").read_text() == rules_path().read_text()
    assert (tmp_path / "alert_rules.yml").read_text() == alert_rules_path().read_text()


@needs_prometheus
def test_start_failure_leaves_no_process(tmp_path):
    # a rules file Prometheus rejects: start() must raise and reap the child
    p = PrometheusServer({"vllm-prefill": ["127.0.0.1:8000"]}, port=0, data_dir=tmp_path)
    p.write_config()
    orig = p.write_config

    def broken():
        orig()
        (tmp_path / "recording_rules.yml").write_text("groups: [{name: x, rules: [{record: 'bad name', expr: '('}]}]")
        return p.config_path

    p.write_config = broken  # type: ignore[method-assign]
    with pytest.raises(PrometheusError, match="exited"):
        p.start(timeout=20)
    assert p.proc is not None and p.proc.poll() is not None
