"""Per-event recording cost on the caller's thread: kvlens Recorder.record
(timestamp + append) vs an inline OpenTelemetry span (start + end with the
same attributes, SDK with a BatchSpanProcessor as a real setup would have).

    .venv/bin/python benchmarks/bench_recorder.py

Reports medians over repeated batches (never asserted: machines are noisy).
"""

from __future__ import annotations

import statistics
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from instrumented_connector import semconv as sc
from instrumented_connector.recorder import Recorder

BATCH = 2000
REPEATS = 25


class _Null(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


def bench_recorder() -> list[float]:
    r = Recorder(role="prefill", mode="push", capacity=BATCH * 4, pipeline_factory=None)
    r._thread = object()  # measure the caller's cost only; nothing drains
    out = []
    rid = "cmpl-4bf92f3577b34da6a3ce929d0e0e4736-0-deadbeef"
    for _ in range(REPEATS):
        r._q.clear()
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            t = time.time_ns()
            r.record(sc.Phase.WRITE_POST, rid, t, time.time_ns(), "ok", {sc.ATTR_BLOCKS: 12, sc.ATTR_REMOTE_RANK: 0})
        out.append((time.perf_counter_ns() - t0) / BATCH)
    return out


def bench_inline_otel() -> list[float]:
    p = TracerProvider()
    p.add_span_processor(BatchSpanProcessor(_Null(), max_queue_size=BATCH * 4))
    tracer = p.get_tracer("bench")
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            s = tracer.start_span("write.post", attributes={sc.ATTR_BLOCKS: 12, sc.ATTR_REMOTE_RANK: 0,
                                                             sc.ATTR_MODE: "push", sc.ATTR_ROLE: "prefill"})
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


if __name__ == "__main__":
    rec = bench_recorder()
    otel = bench_inline_otel()
    print(f"Recorder.record per event (median of {REPEATS}x{BATCH}): {statistics.median(rec) / 1000:.3f} us")
    print(f"inline OTel span per event (median):              {statistics.median(otel) / 1000:.3f} us")
    print(f"ratio inline/recorder: {statistics.median(otel) / statistics.median(rec):.1f}x")
    print(f"background span build per event (off the hot path): {bench_drain():.1f} us")
