"""Tensor-parallel ranks, traced rank by rank (kvtrace/ranks.py): several
real worker processes, one per rank, record one request through their own
recorder, the real sidecar (span building off the engine's GIL), the real
store and the trace model -- the multi-rank path as vLLM's multiprocess
executor runs it, without a model (vLLM CPU's TP > 1 start-up is covered by
docs/tensor-parallel.md).

Each rank process wraps its recorder as the worker hooks do
(``taps.RankedRecorder``), so every span carries ``kvlens.rank``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace import ranks, tracemodel
from kvrecord import semconv as sc
from rank_store import make_rank_store


@pytest.fixture(scope="module")
def ranked(tmp_path_factory) -> tuple[Path, tracemodel.Trace]:
    """(home, trace): :func:`rank_store.make_rank_store`'s one request."""
    home = tmp_path_factory.mktemp("ranks")
    return home, make_rank_store(home)


def test_ranks_of_one_request_in_separate_processes_join_with_the_last_rank_critical(ranked):
    tr = ranked[1]
    assert tr.half is None and tr.handoff_s is not None
    kvs = [s for s in tr.spans if s.name == "kv.ready"]
    assert sorted(ranks.rank_of(s) for s in kvs) == [0, 1]
    # the handoff ends at the last rank's kv.ready
    assert tr.kv_ready_ns == max(s.end_ns for s in kvs)
    (slow_read, slow_ready) = [x for x in ranks.stragglers(tr.spans) if x.role == "decode"]
    assert (slow_read.phase, slow_read.rank, slow_read.first_rank) == ("read.complete", 1, 0)
    assert slow_read.lag_s == pytest.approx(0.004)
    assert slow_ready.phase == "kv.ready" and slow_ready.rank == 1
    tot = ranks.transfer_totals(tr.spans)
    assert (tot.ranks, tot.bytes, tot.descriptors) == (2, 4096 + 8192, 16)  # summed over ranks
    assert tot.xfer_s == pytest.approx(0.007) and tot.complete_s == pytest.approx(0.007)  # the slowest rank's
    js = tr.to_json()["ranks"]
    assert js["tp"] == {"decode": 2, "prefill": 2} and js["stragglers"][0]["rank"] == 1
    # the tiling counts each stretch once, however many ranks cover it
    til = tr.tiling()
    assert til.named_ns <= til.handoff_ns
    assert sum(til.phases.values()) == til.named_ns
    from kvlens.traces import waterfall

    text = waterfall(tr)
    assert "D r0" in text and "D r1" in text and "straggler: D rank 1 finished read.complete last" in text


def test_traces_page_draws_a_lane_per_rank_and_names_the_straggler(ranked, monkeypatch):
    """The dashboard's Traces page on the store the rank processes wrote:
    the ranks per side, the straggler, one lane per rank (collapsible)."""
    import json
    import sys

    from streamlit.testing.v1 import AppTest

    home, tr = ranked
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(home / "traces.db")])
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py"), default_timeout=60)
    at.query_params["page"] = "traces"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(c.value for c in at.caption)
    assert "Tensor parallel: D 2 ranks, P 2 ranks." in text, text
    assert "Straggler: D rank 1 finished `read.complete` last, 4.00 ms after rank 0 (2 ranks" in text, text

    def lanes() -> set[str]:
        """The waterfall's lanes, from the Arrow data Streamlit sends the browser."""
        import pyarrow as pa

        (wf,) = [
            e for e in at.main if getattr(e, "type", "") == "vega_lite_chart" and "layer" in json.loads(e.proto.spec)
        ]
        out = set()
        for ds in wf.proto.datasets:
            table = pa.ipc.open_stream(ds.data.data).read_all()
            if "lane" in table.column_names:
                out |= set(table.column("lane").to_pylist())
        return out

    got = lanes()
    assert {
        "decode r0 · read.complete",
        "decode r1 · read.complete",
        "prefill r0 · kv.released",
        "prefill r1 · kv.released",
        "prefill · prefill",
    } <= got, got
    table = at.dataframe[1].value
    assert sorted(set(table.loc[table["phase"] == "read.complete", "rank"])) == ["0", "1"]
    at.toggle(key="tr_rank_lanes").set_value(False).run()
    got = lanes()
    assert "decode · read.complete" in got and not any(" r1 " in lane for lane in got), got


def test_single_rank_traces_have_no_rank_section():
    span = tracemodel.Span(name="kv.ready", role="decode", start_ns=1, end_ns=1)
    assert ranks.tp_sizes([span]) == {} and ranks.stragglers([span]) == []
    assert ranks.lane("D", span, True) == "D"


def test_rank_label_is_bounded_and_only_for_tp_engines():
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from exporters.metrics import PhaseMetricsProcessor

    reg = CollectorRegistry()
    proc = PhaseMetricsProcessor(registry=reg, store_path="/nonexistent/traces.db", handoff_from="off")
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(proc)
    tracer = tracer_provider.get_tracer("t")
    for rank, size in ((0, 2), (1, 2), (99, 128), (0, 1)):
        attrs = {sc.ATTR_MODE: "pull", sc.ATTR_ROLE: "decode", sc.ATTR_RANK: rank, sc.ATTR_TP_SIZE: size}
        tracer.start_span("read.complete", attributes=attrs, start_time=0).end(end_time=2_000_000)
    val = reg.get_sample_value
    key = {"mode": "pull", "role": "decode", "phase": "read.complete"}
    assert val("kvlens_rank_phase_duration_seconds_count", {**key, "rank": "0"}) == 1  # the TP 1 span adds none
    assert val("kvlens_rank_phase_duration_seconds_count", {**key, "rank": "1"}) == 1
    assert val("kvlens_rank_phase_duration_seconds_count", {**key, "rank": "_OTHER"}) == 1
    assert val("kvlens_phase_duration_seconds_count", {**key, "outcome": "ok"}) == 4
