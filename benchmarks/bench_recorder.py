"""Per-event cost of kvlens in the recording process, inline and background:

* inline: ``Recorder.record`` on the caller's thread (timestamp + append),
  next to an inline OpenTelemetry span (start + end, same attributes, SDK
  with a BatchSpanProcessor as a real setup would have);
* background, in-process span building (``span_builder=inline``, the
  router's path and the fallback): events -> SDK spans -> processors;
* background, sidecar path (``span_builder=sidecar``, vLLM's processes):
  the engine's shipping thread (pop, pickle, pipe write), CPU time of that
  thread per event, and separately the sidecar process's CPU per event
  (spans, the real store, metrics; not on the engine's GIL).

    .venv/bin/python benchmarks/bench_recorder.py [--events 20000]

The goal: inline + engine-side background <= 5 us per event (building spans
on the engine's thread cost ~43 us of its GIL per event; exporters.shipping).
Reports medians / CPU times (never asserted: machines are noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from exporters import pipeline
from exporters.shipping import ShippingRecorder
from kvrecord import semconv as sc
from kvrecord.openhandoffs import HandoffTable
from kvrecord.recorder import Recorder
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)

BATCH = 2001  # a multiple of 3: the three-event handoff loop
_AWAITING_REGISTRATION, _WRITING = sc.OpenPhase.AWAITING_REGISTRATION.value, sc.OpenPhase.WRITING.value
CHUNK = 2000  # events per burst in the background figures
REPEATS = 25


class _Null(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


def bench_recorder(shipping: bool = False, table: bool = False) -> list[float]:
    """``record`` on the caller's thread; ``shipping``: the sidecar path's
    recorder (vLLM's processes), whose ``record`` also checks the idle flag.
    ``table``: each event also does one open-handoff table operation
    (:mod:`kvrecord.openhandoffs`: open, move, close in turn, as push P's
    hooks do per handoff): an upper bound, the hooks do about 3 of them per
    ~8 events of a handoff side (docs/handoff-health.md)."""
    kw = dict(role="prefill", mode="push", capacity=BATCH * 4, pipeline_factory=None)
    r = ShippingRecorder(sidecar_spec={}, **kw) if shipping else Recorder(**kw)
    r._thread = object()  # measure the caller's cost only; nothing drains
    out = []
    rid = "cmpl-4bf92f3577b34da6a3ce929d0e0e4736-0-deadbeef"
    if table:
        tab = HandoffTable("push", "prefill")
        tab.own(sc.OPEN_PHASES[("push", "prefill")])
        rids = [f"cmpl-{i:032x}-0-deadbeef" for i in range(BATCH)]
        for _ in range(REPEATS):
            r._q.clear()
            t0 = time.perf_counter_ns()
            for i in range(0, BATCH - 2, 3):
                rid = rids[i]
                t = time.time_ns()
                r.record(sc.Phase.WRITER_WAKE, rid, t, time.time_ns(), "ok", {sc.ATTR_BLOCKS: 12})
                tab.open(rid, _AWAITING_REGISTRATION, t, 12)
                t = time.time_ns()
                r.record(sc.Phase.MATCH, rid, t, time.time_ns(), "ok", {sc.ATTR_MATCH_FIRST: "prefill"})
                tab.open(rid, _WRITING, t)
                t = time.time_ns()
                r.record(sc.Phase.WRITE_COMPLETE, rid, t, time.time_ns(), "ok", {sc.ATTR_BYTES: 4096})
                tab.close(rid, "ok")
            out.append((time.perf_counter_ns() - t0) / (BATCH - BATCH % 3))
        return out
    for _ in range(REPEATS):
        r._q.clear()
        t0 = time.perf_counter_ns()
        for i in range(0, BATCH - 2, 3):  # the same three events, without the table
            t = time.time_ns()
            r.record(sc.Phase.WRITER_WAKE, rid, t, time.time_ns(), "ok", {sc.ATTR_BLOCKS: 12})
            t = time.time_ns()
            r.record(sc.Phase.MATCH, rid, t, time.time_ns(), "ok", {sc.ATTR_MATCH_FIRST: "prefill"})
            t = time.time_ns()
            r.record(sc.Phase.WRITE_COMPLETE, rid, t, time.time_ns(), "ok", {sc.ATTR_BYTES: 4096})
        out.append((time.perf_counter_ns() - t0) / (BATCH - BATCH % 3))
    return out


def bench_health_tick(open_n: int = 1000) -> float:
    """The background side of the open table: one publisher tick (gauges,
    counters, partial traces) with ``open_n`` handoffs open, µs (recorder
    thread, once a second; never on vLLM's threads)."""
    from prometheus_client import CollectorRegistry

    from exporters.handoffhealth import HealthPublisher

    tab = HandoffTable("push", "decode")
    tab.own(sc.OPEN_PHASES[("push", "decode")])
    t = time.time_ns() - 60_000_000_000
    for i in range(open_n):
        tab.open(f"cmpl-{i:032x}-0-deadbeef", sc.OpenPhase.AWAITING_KV, t + i, 12)
    r = Recorder(role="decode", mode="push", capacity=100_000, pipeline_factory=None)
    r._thread = object()
    pub = HealthPublisher(r, CollectorRegistry(), open_trace_after_s=5.0, tables=lambda: [tab])
    times = []
    for _ in range(REPEATS):
        pub.every_ns = 0  # every open handoff due each time: the worst tick (64 partial traces)
        t0 = time.perf_counter_ns()
        pub.tick()
        times.append((time.perf_counter_ns() - t0) / 1000)
        r._q.clear()
    return statistics.median(times)


def bench_inline_otel() -> list[float]:
    p = TracerProvider()
    p.add_span_processor(BatchSpanProcessor(_Null(), max_queue_size=BATCH * 4))
    tracer = p.get_tracer("bench")
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            s = tracer.start_span(
                "write.post",
                attributes={sc.ATTR_BLOCKS: 12, sc.ATTR_REMOTE_RANK: 0, sc.ATTR_MODE: "push", sc.ATTR_ROLE: "prefill"},
            )
            s.end()
        out.append((time.perf_counter_ns() - t0) / BATCH)
        p.force_flush()
    p.shutdown()
    return out


def bench_drain() -> float:
    """Background cost: events -> OTel spans -> (null) exporter, per event."""

    def factory(id_generator):
        p = TracerProvider(id_generator=id_generator)
        p.add_span_processor(BatchSpanProcessor(_Null(), max_queue_size=100_000))
        return p

    r = Recorder(role="prefill", mode="push", capacity=100_000, pipeline_factory=factory)
    r.flush()
    n = 20_000
    t = time.time_ns()
    for i in range(n):
        r.record(sc.Phase.WRITE_POST, f"cmpl-{i:032x}-0-deadbeef", t, t + 1000, "ok", {sc.ATTR_BLOCKS: 12})
    t0 = time.perf_counter()
    r.drain()
    dt = time.perf_counter() - t0
    r.close()
    return dt / n * 1e6


def _event_attrs(i: int) -> dict:
    return {sc.ATTR_BLOCKS: 12, sc.ATTR_REMOTE_RANK: 0, sc.ATTR_BYTES: 4096 * (i % 7 + 1)}


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_sidecar(n: int) -> tuple[float, float, int]:
    """Sidecar path with a real sidecar and a real store (temp home): the
    engine-side shipping cost per event (CPU of the calling thread while it
    drains, pickles and writes) and the sidecar's CPU per event; also the
    spans the store holds afterwards (= n when nothing was lost)."""
    home = str(scratch_dir("kvlens-bench-recorder-"))
    r = pipeline.get_recorder("prefill", "push", f"bench-{os.getpid()}", {"kvlens_home": home}, span_builder="sidecar")
    r.capacity = n + 1
    r._thread = object()  # no background thread: this thread drains, so its CPU clock is the cost
    r._setup_if_needed()  # starts the sidecar, waits until it is ready
    if r.mode_in_use != "sidecar":
        raise SystemExit("the sidecar did not start (see the warning above)")
    side0 = _proc_cpu_s(r.sidecar_pid)
    engine = 0.0
    t = time.time_ns()
    # chunks, each exported before the next: a burst of all n at once would
    # overflow the store's export queue (4096; counted queue_full), as it would inline
    for lo in range(0, n, CHUNK):
        for i in range(lo, min(lo + CHUNK, n)):
            r.record(sc.Phase.WRITE_POST, f"cmpl-{i:032x}-0-deadbeef", t, t + 1000, "ok", _event_attrs(i))
        c0 = time.thread_time()
        while r._q or r._pending:
            r.drain()
            if r._q or r._pending:
                time.sleep(0.002)  # the pipe is full: the sidecar catches up (sleep is not CPU)
        engine += time.thread_time() - c0
        r.flush(timeout_s=60)
    side = _proc_cpu_s(r.sidecar_pid) - side0
    r._thread = None
    r.close()
    from kvtrace import store

    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1] / "tests")
    )  # tests/store_sql.py: what a benchmark needs beneath the store API
    import store_sql

    conn = store.connect(os.path.join(home, "traces.db"), readonly=True)
    try:
        stored = store_sql.span_count(conn)
    finally:
        conn.close()
    pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)
    return engine / n * 1e6, side / n * 1e6, stored


def bench_inline_real(n: int) -> float:
    """In-process span building with the real pipeline (store + metrics),
    what the sidecar runs and what the engine paid before the sidecar: CPU of
    the draining thread per event (its processors' threads come on top)."""
    home = str(scratch_dir("kvlens-bench-inline-"))
    r = Recorder(
        role="prefill",
        mode="push",
        capacity=n + 1,
        pipeline_factory=pipeline.provider_factory(
            role="prefill", mode="push", engine_id="bench-inline", config={"kvlens_home": home}
        ),
    )
    r.flush()
    t = time.time_ns()
    for i in range(n):
        r.record(sc.Phase.WRITE_POST, f"cmpl-{i:032x}-0-deadbeef", t, t + 1000, "ok", _event_attrs(i))
    c0 = time.thread_time()
    r.drain()
    dt = time.thread_time() - c0
    r.close()
    return dt / n * 1e6  # one burst: spans past the store's queue are dropped (counted), not built twice


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20_000, help="events for the background figures")
    a = ap.parse_args()
    rec = bench_recorder()
    otel = bench_inline_otel()
    inline_us = statistics.median(bench_recorder(shipping=True)) / 1000
    print(f"inline: Recorder.record per event (median of {REPEATS}x{BATCH}): {statistics.median(rec) / 1000:.3f} us")
    print(f"inline: ShippingRecorder.record (sidecar path) per event:     {inline_us:.3f} us")
    table_us = statistics.median(bench_recorder(shipping=True, table=True)) / 1000
    print(f"inline: the same + one open-handoff table op per event:       {table_us:.3f} us (upper bound)")
    print(f"background: one health tick, 1000 handoffs open:     {bench_health_tick():.0f} us (once a second)")
    print(f"inline OTel span per event (median):                 {statistics.median(otel) / 1000:.3f} us")
    print(f"ratio inline OTel / Recorder.record: {statistics.median(otel) / statistics.median(rec):.1f}x")
    print(f"background, in-process span build, null exporter:    {bench_drain():.1f} us/event (wall)")
    print(
        f"background, in-process span build, store + metrics:  {bench_inline_real(a.events):.1f} us/event "
        "(CPU of the draining thread; span_builder=inline)"
    )
    eng, side, stored = bench_sidecar(a.events)
    print(f"background, sidecar path, engine side (pop+pickle+write): {eng:.2f} us/event (CPU of the shipping thread)")
    print(f"sidecar process (spans, store, metrics; off the engine's GIL): {side:.1f} us/event (process CPU)")
    print(f"engine process total, inline + background (sidecar path): {inline_us + eng:.2f} us/event (goal <= 5)")
    print(f"events shipped {a.events}, spans stored {stored}" + ("" if stored == a.events else "  (MISMATCH)"))
