"""Benchmark the span-derived metrics (figures only, no assertions).

    .venv/bin/python benchmarks/bench_metrics.py [--spans 200000]

1. ``PhaseMetricsProcessor.on_end`` throughput on one core (spans/s), on
   finished SDK spans replayed directly (what the recorder thread pays per
   span on top of building it), with exemplars on (router) and off (vLLM
   multiprocess mode).
2. Scrape cost: ``generate_latest`` (text 0.0.4) and the OpenMetrics
   exposition of (a) the series one P/D pair + router really creates and
   (b) every series kvlens can create (all modes x roles x phases x
   outcomes, plus _OTHER): the worst case.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from exporters.metrics import PhaseMetricsProcessor
from kvrecord import semconv as sc
from kvrecord.recorder import DropReason


def make_spans(n: int):
    """n finished ReadableSpans with a realistic mix of phases/attributes."""
    keep = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(keep))
    t = p.get_tracer("bench")
    mix = [
        ("write.post", "push", "prefill", {}),
        ("write.complete", "push", "prefill", {sc.ATTR_BYTES: 3 << 20, sc.ATTR_DESCRIPTORS: 96}),
        ("descriptor.prep", "pull", "decode", {}),
        ("read.complete", "pull", "decode", {sc.ATTR_BYTES: 3 << 20, sc.ATTR_DESCRIPTORS: 96}),
        ("match", "push", "prefill", {sc.ATTR_MATCH_FIRST: "registration"}),
        ("registration.receive", "push", "prefill", {}),
        ("prefill.finished", "push", "prefill", {}),
        ("kv.ready", "pull", "decode", {}),
    ]
    for i in range(n):
        name, mode, role, extra = mix[i % len(mix)]
        a = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: role, sc.ATTR_OUTCOME: "ok", sc.ATTR_REQUEST_ID: f"cmpl-{i}-0-deadbeef"}
        a.update(extra)
        s = t.start_span(name, attributes=a, start_time=1_000_000_000 + i)
        s.end(end_time=1_000_000_000 + i + 1000 * (i % 977))
    return list(keep.get_finished_spans())


def bench_on_end(spans, exemplars: bool) -> float:
    reg = CollectorRegistry()
    proc = PhaseMetricsProcessor(reg, handoff_from="off", exemplars=exemplars)
    for s in spans[:1000]:  # bind children
        proc.on_end(s)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for s in spans:
            proc.on_end(s)
        best = max(best, len(spans) / (time.perf_counter() - t0))
    return best


def full_registry() -> tuple[CollectorRegistry, int]:
    reg = CollectorRegistry()
    proc = PhaseMetricsProcessor(reg, handoff_from="off")
    fam = proc.fam
    modes = [m.value for m in sc.Mode] + [sc.OTHER]
    roles = [r.value for r in sc.Role] + [sc.OTHER]
    phases = [p.value for p in sc.Phase] + [sc.OTHER]
    outcomes = [o.value for o in sc.Outcome] + [sc.OTHER]
    for key in itertools.product(modes, roles, phases, outcomes):
        fam.child(fam.phase, key).observe(0.01, {"trace_id": "ab" * 16})
    for m in modes:
        fam.child(fam.handoff, (m,)).observe(0.01, {"trace_id": "ab" * 16})
        for d in [x.value for x in sc.Dispatch] + [sc.OTHER]:
            fam.child(fam.ttft, (m, d)).observe(0.1)
        for o in outcomes:
            fam.child(fam.requests, (m, o)).inc()
        for r in roles:
            fam.child(fam.xfer_bytes, (m, r)).observe(1 << 20)
            fam.child(fam.xfer_desc, (m, r)).observe(64)
        for reason in ("missing", "overflow", "no_store"):
            fam.child(fam.unresolved, (m, reason)).inc()
    for r in roles:
        for reason in [d.value for d in DropReason] + [sc.OTHER]:
            fam.child(fam.dropped, (r, reason)).inc()
    n = sum(len(mf.samples) for mf in reg.collect())
    return reg, n


_ROLE = {
    "request": "router",
    "relay": "router",
    "prefill": "prefill",
    "prefill.finished": "prefill",
    "registration.stage": "decode",
    "registration.send": "decode",
    "registration.receive": "prefill",
    "match": "prefill",
    "write.post": "prefill",
    "write.complete": "prefill",
    "alloc": "decode",
    "read.post": "decode",
    "read.complete": "decode",
    "kv.ready": "decode",
}


def realistic_registry() -> tuple[CollectorRegistry, int]:
    """What one P/D pair + router actually creates: each phase on its real
    role(s), both modes, outcomes ok and failed (one instance's worth)."""
    reg = CollectorRegistry()
    fam = PhaseMetricsProcessor(reg, handoff_from="off").fam
    for mode, phases in (
        ("push", sc.PUSH_PHASES + (sc.Phase.HANDSHAKE, sc.Phase.PREFILL, sc.Phase.REQUEST)),
        ("pull", sc.PULL_PHASES + (sc.Phase.HANDSHAKE, sc.Phase.PREFILL, sc.Phase.RELAY, sc.Phase.REQUEST)),
    ):
        for ph in phases:
            roles = (
                ("prefill", "decode") if ph in (sc.Phase.HANDSHAKE, sc.Phase.DESCRIPTOR_PREP) else (_ROLE[ph.value],)
            )
            for role in roles:
                for outcome in ("ok", "failed"):
                    fam.child(fam.phase, (mode, role, ph.value, outcome)).observe(0.01, {"trace_id": "ab" * 16})
        fam.child(fam.handoff, (mode,)).observe(0.01, {"trace_id": "ab" * 16})
        fam.child(fam.ttft, (mode, "overlapped")).observe(0.1)
        for o in ("ok", "failed"):
            fam.child(fam.requests, (mode, o)).inc()
        r = "prefill" if mode == "push" else "decode"
        fam.child(fam.xfer_bytes, (mode, r)).observe(1 << 20)
        fam.child(fam.xfer_desc, (mode, r)).observe(64)
    return reg, sum(len(mf.samples) for mf in reg.collect())


def bench_scrape(reg, fn, reps: int = 20) -> tuple[float, int]:
    times = []
    size = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(reg)
        times.append(time.perf_counter() - t0)
        size = len(out)
    return statistics.median(times), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    args = ap.parse_args()
    spans = make_spans(args.spans)
    print(f"python {sys.version.split()[0]}, {args.spans} spans")
    for ex in (True, False):
        print(f"on_end throughput (exemplars {'on' if ex else 'off'}): {bench_on_end(spans, ex):,.0f} spans/s")
    for label, (reg, n) in (
        ("realistic (both modes, ok+failed)", realistic_registry()),
        ("every closed-label combination incl. _OTHER", full_registry()),
    ):
        print(f"{label}: {n} samples")
        med, size = bench_scrape(reg, generate_latest)
        print(f"  generate_latest (text 0.0.4): {med * 1e3:.1f} ms, {size / 1024:.0f} KiB")
        med, size = bench_scrape(reg, om_latest)
        print(f"  OpenMetrics exposition:       {med * 1e3:.1f} ms, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
