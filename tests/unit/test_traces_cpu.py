"""CPU or wire in ``kvlens traces``: the CPU-wait glyph in each span's bar,
the handoff's split under the waterfall (with the progress thread's figures
and what they mean where it spins), the legend, and the median CPU-wait share
per mode in ``--breakdown``."""

from __future__ import annotations

import pytest

from kvlens import traces
from kvlens.cli import main
from kvrecord import semconv as sc
from kvtrace import cpusplit, tracemodel
from kvtrace.tracemodel import Trace

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
PF, KV = T0 + 50 * MS, T0 + 70 * MS
TID = "ab" * 16
POST = {sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: 0.004}
WIRE = {
    sc.ATTR_CPU_ON_S: 0.002,
    sc.ATTR_CPU_WAIT_S: 0.006,
    sc.ATTR_NIXL_XFER_S: 0.005,
    sc.ATTR_CPU_PROGRESS_ON_S: 0.009,
    sc.ATTR_CPU_PROGRESS_WAIT_S: 0.001,
    sc.ATTR_CPU_PROGRESS_SPINS: True,
}


def _span(name, role, start, end, **attrs):
    return {"name": name, "role": role, "start_ns": start, "end_ns": end, "outcome": "ok", "attributes": attrs}


def _trace(post=POST, wire=WIRE):
    spans = [
        _span("prefill.finished", "prefill", PF, PF),
        _span("write.post", "prefill", PF, PF + 8 * MS, **post),
        _span("write.complete", "prefill", PF + 8 * MS, PF + 18 * MS, **wire),
        _span("kv.ready", "decode", KV, KV),
    ]
    summary = {
        "trace_id": TID,
        "request_id": TID,
        "mode": "push",
        "outcome": "ok",
        "start_ns": PF,
        "end_ns": KV,
        "prefill_finished_ns": PF,
        "kv_ready_ns": KV,
        "handoff_s": (KV - PF) / 1e9,
        "n_spans": len(spans),
    }
    return Trace.from_rows(summary, spans)


def _bar(text: str, name: str) -> str:
    line = next(ln for ln in text.splitlines() if f" {name} " in ln and "[" in ln)
    return line[line.index("[") + 1 : line.index("]")].strip()


def test_the_wait_glyph_fills_the_bar_in_proportion():
    text = traces.waterfall(_trace(), 81)
    for name, share in (("write.post", 0.004 / 0.008), ("write.complete", 0.006 / 0.010)):
        bar = _bar(text, name)
        assert set(bar) == {traces.CPU_WAIT, "#"}, bar  # critical path: # after the wait
        waits = bar.count(traces.CPU_WAIT)
        assert waits == round(len(bar) * share) and bar.startswith(traces.CPU_WAIT * waits), bar
    # a derived phase has no thread and no glyph
    assert traces.CPU_WAIT not in _bar(text, "write.notify")


def test_the_split_under_the_waterfall():
    text = traces.waterfall(_trace())
    split = cpusplit.handoff_cpu(_trace())
    line = " ".join(text.split("  handoff 20.0 ms:", 1)[1].split("progress thread")[0].split())
    head = (
        f"handoff 20.0 ms: CPU wait {split.cpu_wait_s * 1000:.1f} ms ({split.cpu_wait_s / 0.020 * 100:.0f} %), "
        f"CPU work {split.cpu_on_s * 1000:.1f} ms, off-CPU {split.off_cpu_s * 1000:.1f} ms, "
        f"unknown {split.unknown_s * 1000:.1f} ms (the transfer itself, derived phases, unnamed gaps)"
    )
    assert ("handoff 20.0 ms: " + line).startswith(head)
    # write.post's 4 ms, and write.noticed's share (half) of write.complete's 6 ms (no kvlens.cpu.noticed.* here:
    # spans recorded before them); the transfer itself counts as neither
    assert split.cpu_wait_s == pytest.approx(0.004 + 0.003)
    assert "no CPU figures on write.wire" in line and "the transfer itself" in line
    below = text.split("handoff 20.0 ms:", 1)[1]
    assert all(len(ln) <= traces.TEXT_WIDTH for ln in below.splitlines())  # wrapped at spaces
    flat = " ".join(below.split())
    assert "progress thread over write.complete: on CPU 9.0 ms, CPU wait 1.0 ms" in flat
    assert " ".join(cpusplit.SPIN_NOTE.split()) in flat


def test_no_figures_says_unknown_with_the_reason_and_draws_no_glyph():
    off = {sc.ATTR_CPU_UNKNOWN: "turned off (KVLENS_CPU_ACCOUNTING=0)"}
    text = traces.waterfall(_trace(off, {**off, sc.ATTR_NIXL_XFER_S: 0.005}))
    assert traces.CPU_WAIT not in text
    assert "handoff 20.0 ms: CPU wait unknown (turned off (KVLENS_CPU_ACCOUNTING=0))" in text
    assert "CPU wait 0" not in text and "progress thread" not in text
    # figures on one phase only: the other's reason is named, its time counted as unknown
    text = traces.waterfall(_trace(POST, {**off, sc.ATTR_NIXL_XFER_S: 0.005}))
    assert "CPU wait 4.0 ms (20 %)" in text
    flat = " ".join(text.split())
    assert "no CPU figures on write.noticed (in unknown): turned off" in flat
    assert "no CPU figures on write.wire (in unknown): the transfer itself" in flat


def test_breakdown_gives_the_median_cpu_wait_share():
    b = tracemodel.summarize([("pull", tracemodel.Tiling(10 * MS, {("decode", "read.complete"): 10 * MS}, ()))] * 4)[
        "pull"
    ]
    for wait in (0.001, 0.002, 0.006):
        b.add_cpu(wait, 0.010, "")
    b.add_cpu(None, 0.010, "no reading of the thread at or before the phase's start")
    out = traces.breakdown_text({"pull": b})
    assert "CPU wait: 20.0 % of the handoff at the median" in out
    assert "3 requests with CPU figures; 1 without CPU figures" in out
    none = tracemodel.summarize([("push", tracemodel.Tiling(10 * MS, {}, ()))])["push"]
    none.add_cpu(None, 0.010, cpusplit.NO_FIGURES)
    assert f"CPU wait: unknown ({cpusplit.NO_FIGURES})" in traces.breakdown_text({"push": none})


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    from store_fixture import make_store

    return make_store(tmp_path_factory.mktemp("kvlens_home"), n_per_mode=2, bench=False)


def test_store_without_figures_unknown_in_breakdown_and_legend_printed(small_store, capsys):
    """A store written before CPU figures existed: every request unknown, with the reason; never 0 %."""
    from kvtrace import costs, store

    with store.reading(small_store) as conn:
        groups = costs.breakdown(conn)
    assert groups and all(not b.cpu_wait_shares and sum(b.cpu_unknown.values()) == b.requests for b in groups.values())
    assert main(["traces", "--store", str(small_store), "--breakdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("CPU wait: unknown (") == len(groups) and "CPU wait: 0" not in out
    assert main(["traces", "--store", str(small_store), "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert traces.LEGEND in " ".join(out.split()) and traces.CPU_WAIT in traces.LEGEND
    legend = ("legend:" + out.split("legend:", 1)[1]).split("\n\n")[0]
    assert all(len(ln) <= traces.TEXT_WIDTH for ln in legend.splitlines())
    assert "CPU wait unknown (" in out
