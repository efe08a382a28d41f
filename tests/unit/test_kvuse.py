"""KV used or recomputed (kvtrace/kvuse.py and the D scheduler hook's count):
the first step's recomputed prompt tokens, the partial-block rule, the
trace's ``kv_use``, the counter and the CLI line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtrace import kvuse, tracemodel
from kvrecord import semconv as sc


def _first_step(tokens, block_size=16):
    attrs = {sc.ATTR_KV_RECOMPUTED_TOKENS: tokens, sc.ATTR_BLOCK_SIZE: block_size}
    return tracemodel.Span(name="decode.first_step", role="decode", start_ns=10, end_ns=20, attributes=attrs)


@pytest.mark.parametrize(
    "tokens,block,want",
    [
        (1, 16, False),
        (15, 16, False),
        (16, 16, False),
        (17, 16, True),
        (150, 16, True),
        (40, 64, False),
        (0, 16, False),
    ],
)
def test_more_than_the_last_partial_block_is_a_recompute(tokens, block, want):
    assert kvuse.is_recomputed(_first_step(tokens, block).attributes) is want


def test_missing_or_bad_counts_are_unknown_not_zero():
    assert kvuse.recomputed_tokens({}) is None and kvuse.recomputed_tokens({sc.ATTR_KV_RECOMPUTED_TOKENS: True}) is None
    assert kvuse.trace_kv_use([tracemodel.Span(name="kv.ready", role="decode", start_ns=1, end_ns=1)]) is None
    assert not kvuse.is_recomputed({sc.ATTR_KV_RECOMPUTED_TOKENS: -3})
    assert kvuse.is_recomputed({sc.ATTR_KV_RECOMPUTED_TOKENS: 17})  # no block size on the span: vLLM's 16


def test_trace_kv_use_and_the_waterfall_line():
    spans = [_first_step(150)]
    assert kvuse.trace_kv_use(spans) == {"recomputed_tokens": 150, "recomputed": True}
    from kvlens.traces import waterfall

    tr = tracemodel.Trace(trace_id="a" * 32, spans=spans)
    assert "KV recomputed: D computed 150 prompt tokens itself" in waterfall(tr)
    assert "KV recomputed" not in waterfall(tracemodel.Trace(trace_id="b" * 32, spans=[_first_step(3)]))


def test_scheduler_reads_the_prompt_minus_the_tokens_in_place():
    from instrumented_connector.scheduler import _recomputed

    new = [
        SimpleNamespace(req_id="r1", prompt_token_ids=list(range(150)), num_computed_tokens=144),
        SimpleNamespace(req_id="r2", prompt_token_ids=list(range(150)), num_computed_tokens=0),
    ]
    out = SimpleNamespace(scheduled_new_reqs=new)
    assert _recomputed(out, "r1", 6) == 6 and _recomputed(out, "r2", 150) == 150
    assert _recomputed(out, "r3", 9) == 9  # not a new request: what this step scheduled


def test_the_counter_counts_recomputes_only():
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from exporters.metrics import PhaseMetricsProcessor

    reg = CollectorRegistry()
    tp = TracerProvider()
    tp.add_span_processor(PhaseMetricsProcessor(registry=reg, store_path="/nonexistent/traces.db", handoff_from="off"))
    tracer = tp.get_tracer("t")
    for tokens in (1, 150, 200):
        attrs = {
            sc.ATTR_MODE: "pull",
            sc.ATTR_ROLE: "decode",
            sc.ATTR_KV_RECOMPUTED_TOKENS: tokens,
            sc.ATTR_BLOCK_SIZE: 16,
        }
        tracer.start_span("decode.first_step", attributes=attrs, start_time=0).end(end_time=1_000_000)
    assert reg.get_sample_value("kvlens_kv_recomputed_total", {"mode": "pull"}) == 2
