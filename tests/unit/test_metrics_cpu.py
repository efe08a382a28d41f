"""CPU or wire in Prometheus: ``kvlens_phase_cpu_wait_seconds_total`` /
``kvlens_phase_cpu_seconds_total`` / ``kvlens_phase_cpu_span_seconds_total``
from the spans that carry CPU figures (in-process and across processes as
vLLM runs them), and the recording rule ``kvlens:handoff_cpu_wait_share:ratio_5m``
(its phases, and its value under ``promtool test rules``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry

from exporters.metrics import PhaseMetricsProcessor
from exporters.prometheus_server import rules_path
from exporters.spanobs import CPU_PHASES
from kvrecord import semconv as sc
from kvtrace.tracemodel import CRITICAL, static_path

RULE = "kvlens:handoff_cpu_wait_share:ratio_5m"


@pytest.fixture
def feed():
    reg = CollectorRegistry()
    provider = TracerProvider()
    provider.add_span_processor(PhaseMetricsProcessor(reg, handoff_from="off"))
    tracer = provider.get_tracer("t")

    def emit(name, dur_s, mode="pull", role="decode", **attrs):
        end = time.time_ns()
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(7, 0x1234, True, TraceFlags(1))))
        a = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: role, sc.ATTR_OUTCOME: "ok", **attrs}
        tracer.start_span(name, context=ctx, attributes=a, start_time=end - int(dur_s * 1e9)).end(end_time=end)

    yield reg, emit
    provider.shutdown()


def fig(on, wait):
    return {sc.ATTR_CPU_ON_S: on, sc.ATTR_CPU_WAIT_S: wait, sc.ATTR_CPU_TID: 4242}


def cpu(reg, which, mode, role, phase):
    return reg.get_sample_value(f"kvlens_phase_cpu{which}_seconds_total", {"mode": mode, "role": role, "phase": phase})


def test_counters_sum_the_figures_of_the_spans_that_carry_them(feed):
    reg, emit = feed
    emit("read.complete", 0.010, **fig(0.002, 0.003), **{sc.ATTR_BYTES: 4096})
    emit("read.complete", 0.020, **fig(0.001, 0.0125))
    # unknown figures: no counter moves (a share over measured spans only), never a 0 figure
    emit("read.complete", 0.050, **{sc.ATTR_CPU_UNKNOWN: "schedstat missing"})
    assert cpu(reg, "_wait", "pull", "decode", "read.complete") == pytest.approx(0.0155)
    assert cpu(reg, "", "pull", "decode", "read.complete") == pytest.approx(0.003)
    assert cpu(reg, "_span", "pull", "decode", "read.complete") == pytest.approx(0.030)
    # the phase's other metrics are still observed beside them
    assert reg.get_sample_value("kvlens_transfer_bytes_count", {"mode": "pull", "role": "decode"}) == 1
    dur = {"mode": "pull", "role": "decode", "phase": "read.complete", "outcome": "ok"}
    assert reg.get_sample_value("kvlens_phase_duration_seconds_count", dur) == 3


def test_the_span_counter_holds_the_figures_of_a_gap(feed):
    """The figures run from the thread's last reading at or before the start
    (``kvlens.cpu.gap_s`` before it). A busy thread's figures can exceed the
    span (5 ms of wait over a 2 ms span read 4 ms back: P's write.complete on
    a real stack): the span counter takes the shortest stretch that holds
    them, so the share stays a fraction (CI read 1.33 with the span alone). A
    blocked thread's (D's decode.queue, gaps of seconds) fit the span: the
    gap does not dilute the share."""
    reg, emit = feed
    emit("write.complete", 0.002, **fig(0.001, 0.005), **{sc.ATTR_CPU_GAP_S: 0.004})  # 6 ms in 2 + 4
    emit("write.complete", 0.002, **fig(0.001, 0.003), **{sc.ATTR_CPU_GAP_S: 0.004})  # 4 ms of 2 + 4
    emit("write.complete", 0.003, **fig(0.0005, 0.001), **{sc.ATTR_CPU_GAP_S: 0.0})
    wait, on, span = (cpu(reg, w, "pull", "decode", "write.complete") for w in ("_wait", "", "_span"))
    assert span == pytest.approx(0.006 + 0.004 + 0.003) and wait == pytest.approx(0.009)
    assert 0 <= wait / span <= 1
    emit("decode.queue", 0.004, **fig(0.001, 0.001), **{sc.ATTR_CPU_GAP_S: 2.0})
    assert cpu(reg, "_span", "pull", "decode", "decode.queue") == pytest.approx(0.004)


def test_a_phase_whose_spans_never_carry_figures_has_no_series(feed):
    reg, emit = feed
    emit("decode.queue", 0.004, **{sc.ATTR_CPU_UNKNOWN: "no reading of the thread at or before the phase's start"})
    assert cpu(reg, "_wait", "pull", "decode", "decode.queue") is None  # unknown, not 0
    # a derived phase or the router's root span is no one thread's: figures there are ignored
    emit("write.notify", 0.004, mode="push", role="decode", **fig(0.001, 0.001))
    emit("request", 0.004, mode="push", role="router", **fig(0.001, 0.001))
    assert cpu(reg, "_wait", "push", "decode", "write.notify") is None
    assert cpu(reg, "_wait", "push", "router", "request") is None
    # malformed figures (negative, text) count nothing
    emit("match", 0.004, mode="push", role="prefill", **fig(-1.0, 0.001))
    emit("match", 0.004, mode="push", role="prefill", **fig("1", 0.001))
    assert cpu(reg, "_span", "push", "prefill", "match") is None
    emit("match", 0.004, mode="push", role="prefill", **fig(0.001, 0.0))
    assert cpu(reg, "_wait", "push", "prefill", "match") == 0.0  # measured: no wait at all
    assert cpu(reg, "_span", "push", "prefill", "match") == pytest.approx(0.004)


def test_labels_are_closed(feed):
    reg, emit = feed
    emit("write.post", 0.002, mode="sideways", role="nobody", **fig(0.001, 0.0005))
    assert cpu(reg, "_wait", "_OTHER", "_OTHER", "write.post") == pytest.approx(0.0005)
    assert cpu(reg, "", "_OTHER", "_OTHER", "write.post") == pytest.approx(0.001)


def test_cpu_phases_are_the_recorded_phases_with_a_length():
    assert {"read.complete", "write.complete", "decode.queue", "match", "handshake"} <= CPU_PHASES
    assert not CPU_PHASES & {p.value for p in sc.POINT_PHASES}
    assert not CPU_PHASES & {"request", "relay", "write.notify", "prefill.dispatch", "write.wire", "read.wire"}


def test_counters_across_processes_like_vllm(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR (vLLM's worker and the kvlens sidecar write
    there, vLLM's API server serves it): the counters sum over processes."""
    mp = tmp_path / "mp"
    mp.mkdir()
    worker = textwrap.dedent("""
        from opentelemetry.sdk.trace import TracerProvider
        from exporters.metrics import PhaseMetricsProcessor
        p = TracerProvider(); p.add_span_processor(PhaseMetricsProcessor(handoff_from="off"))
        a = {"kvlens.mode": "push", "kvlens.role": "prefill", "kvlens.outcome": "ok",
             "kvlens.cpu.on_s": 0.001, "kvlens.cpu.wait_s": 0.004}
        p.get_tracer("w").start_span("write.complete", attributes=a, start_time=1_000_000).end(end_time=11_000_000)
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=60)
    server = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, multiprocess, generate_latest
        r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)
        print(generate_latest(r).decode())
    """)
    out = subprocess.run(
        [sys.executable, "-c", server], env=env, check=True, timeout=60, capture_output=True, text=True
    ).stdout
    lab = '{mode="push",phase="write.complete",role="prefill"}'
    assert f"kvlens_phase_cpu_wait_seconds_total{lab} 0.008" in out, out
    assert f"kvlens_phase_cpu_seconds_total{lab} 0.002" in out
    assert f"kvlens_phase_cpu_span_seconds_total{lab} 0.02" in out


# ------------------------------------------------------------------ the rule
def _rule() -> dict:
    doc = yaml.safe_load(rules_path().read_text())
    return next(r for g in doc["groups"] for r in g["rules"] if r.get("record") == RULE)


def handoff_phases(mode: str) -> set[str]:
    """The mode's handoff phases that can carry CPU figures (what the rule must select)."""
    recorded = {p.value for p in (sc.PUSH_PHASES if mode == "push" else sc.PULL_PHASES)} | {sc.Phase.HANDSHAKE.value}
    return {p for p in recorded & CPU_PHASES if static_path(mode, p) == CRITICAL}


def test_the_rule_selects_each_modes_handoff_phases():
    expr = _rule()["expr"]
    for mode in ("push", "pull"):
        sels = re.findall(r'\{mode="' + mode + r'",phase=~"([^"]+)"\}', expr)
        assert len(sels) == 2 and sels[0] == sels[1], sels  # numerator and denominator alike
        assert set(sels[0].split("|")) == handoff_phases(mode)
    assert handoff_phases("push") == {
        "writer.wake",
        "match",
        "handshake",
        "descriptor.prep",
        "write.post",
        "write.complete",
    }
    assert "decode.queue" in handoff_phases("pull")  # overlap in push, critical in pull


def test_the_rule_under_promtool(tmp_path):
    """Pull: 0.25 s of CPU wait per 1 s of handoff phase time; push: 0.125 of 2
    on its critical phases (0.0625), plus a prefill-overlapped phase the rule ignores."""
    tool = shutil.which("promtool") or "/usr/bin/promtool"
    if not os.path.exists(tool):
        pytest.fail("promtool not found: install Debian package prometheus (apt-get install prometheus)")
    shutil.copyfile(rules_path(), tmp_path / "recording_rules.yml")

    def series(name, mode, role, phase, step):
        return {
            "series": f'{name}{{mode="{mode}",role="{role}",phase="{phase}",instance="x"}}',
            "values": f"0+{step}x40",
        }

    w, s = "kvlens_phase_cpu_wait_seconds_total", "kvlens_phase_cpu_span_seconds_total"
    suite = {
        "rule_files": ["recording_rules.yml"],
        "evaluation_interval": "10s",
        "tests": [
            {
                "interval": "10s",
                "input_series": [
                    series(w, "pull", "decode", "read.complete", 0.25),
                    series(s, "pull", "decode", "read.complete", 1),
                    series(w, "push", "prefill", "write.complete", 0.125),
                    series(s, "push", "prefill", "write.complete", 2),
                    series(w, "push", "decode", "registration.send", 5),  # overlap in push: not the handoff
                    series(s, "push", "decode", "registration.send", 5),
                ],
                "promql_expr_test": [
                    {
                        "expr": RULE,
                        "eval_time": "6m",
                        "exp_samples": [
                            {"labels": f'{RULE}{{mode="pull"}}', "value": 0.25},
                            {"labels": f'{RULE}{{mode="push"}}', "value": 0.0625},
                        ],
                    }
                ],
            },
            {  # no span with figures: no sample, never 0
                "interval": "10s",
                "input_series": [series("kvlens_phase_duration_seconds_count", "pull", "decode", "read.complete", 1)],
                "promql_expr_test": [{"expr": RULE, "eval_time": "6m", "exp_samples": []}],
            },
        ],
    }
    (tmp_path / "t.yml").write_text(yaml.safe_dump(suite))
    out = subprocess.run([tool, "test", "rules", "t.yml"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
