"""FastHistogram (exporters/fasthistogram.py) and the span metrics built on
it expose exactly what prometheus_client's own classes expose for the same
observations: names, help, labels, buckets, counts, sums, exemplars."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from exporters import families
from collector.wire import WireSpan
from exporters.families import PHASE_BUCKETS, Families
from exporters.fasthistogram import FastHistogram, observe_trace
from exporters.metrics import PhaseMetricsProcessor
from kvrecord import semconv as sc

_TS = re.compile(r"^(\S*_created(?:\{[^}]*\})?) \S+$|( # \{[^}]*\} \S+) \S+$", re.M)


def _same_text(text: str) -> str:
    """The exposition with the times left out (_created, exemplar timestamps): they are the clock's."""
    return _TS.sub(lambda m: m.group(1) or m.group(2), text)


def _samples(reg: CollectorRegistry) -> list:
    out = []
    for mf in reg.collect():
        for s in mf.samples:
            if s.name.endswith("_created"):
                continue
            ex = (s.exemplar.labels, s.exemplar.value) if s.exemplar else None
            out.append((mf.name, mf.documentation, mf.type, s.name, s.labels, repr(s.value), ex))
    return out


def _pair(labels=("mode",)):
    regs = (CollectorRegistry(), CollectorRegistry())
    hists = [
        cls("kvlens_t_seconds", "Help.", labels, buckets=PHASE_BUCKETS, registry=r)
        for cls, r in zip((Histogram, FastHistogram), regs)
    ]
    return regs, hists


def test_fast_histogram_exposes_what_the_stock_one_does():
    regs, (stock, fast) = _pair()
    tid = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    values = [0.0, 0.0001, 0.00011, 0.3, 1.0, 59.9, 60.0, 61.0, math.inf, -1.0, 0.1 + 0.2, 7, 1e-9, 0.3]
    for k, v in enumerate(values):
        for mode in ("push", "pull"):
            tid_k = tid + k if k % 3 else None
            stock.labels(mode).observe(v, {"trace_id": f"{tid_k:032x}"} if tid_k is not None else None)
            observe_trace(fast.labels(mode), v, tid_k if mode == "push" else (f"{tid_k:032x}" if tid_k else None))
    for h in (stock, fast):
        h.labels("push").observe(0.002, {"trace_id": "ab" * 16})  # the generic observe: a dict exemplar
        h.labels("pull").observe(0.004)  # no exemplar: the bucket keeps its last one
        h.labels("nan").observe(0.5, {"trace_id": "cd" * 16})
        h.labels("nan").observe(math.nan, {"trace_id": "x" * 200})  # NaN: in the sum alone, exemplar unchecked
        with pytest.raises(ValueError):  # too long an exemplar: counted, then refused, as stock does
            h.labels("pull").observe(0.003, {"trace_id": "x" * 200})
        with pytest.raises(ValueError):  # a labelled parent observes nothing
            h.observe(1.0)
        with pytest.raises(TypeError):
            h.labels("push").observe("1.0")
    assert _samples(regs[1]) == _samples(regs[0])
    assert any(s[-1] for s in _samples(regs[1]))  # exemplars were compared
    for expo in (generate_latest, om_latest):
        assert _same_text(expo(regs[1]).decode()) == _same_text(expo(regs[0]).decode())


def test_stock_histogram_where_prometheus_client_is_multiprocess(monkeypatch):
    from prometheus_client import values

    monkeypatch.setattr(values.ValueClass, "_multiprocess", True, raising=False)
    assert type(Families(CollectorRegistry()).phase) is Histogram


def _span(name, k, mode="push", role="prefill", dur_ns=1_500_000, **attrs):
    a = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: role, sc.ATTR_OUTCOME: attrs.pop("outcome", "ok"), **attrs}
    t1 = 1_700_000_000_000_000_000 + k * 1000
    tid, sid = 0x1000 + k, k + 1
    return WireSpan(name, tid, sid, None, t1 - dur_ns, t1, a, f"{tid:032x}", f"{sid:016x}", None)


def _spans():
    out, k = [], 0
    for i in range(40):
        mode = ("push", "pull")[i % 2]
        for name, role, extra in (
            ("request", "router", {sc.ATTR_TTFT_S: 0.01 * i, sc.ATTR_DISPATCH: ("overlapped", "weird")[i % 2]}),
            ("registration.receive", "prefill", {}),
            ("match", "prefill", {}),
            ("prefill.finished", "prefill", {"outcome": ("ok", "error")[i % 3 == 0]}),
            ("write.post", "prefill", {sc.ATTR_TP_SIZE: 1 + i % 2, sc.ATTR_RANK: i % 2}),
            (
                "write.complete",
                "prefill",
                {
                    sc.ATTR_BYTES: 4096 * (i + 1) * (i % 5 != 0),
                    sc.ATTR_DESCRIPTORS: i % 7,
                    sc.ATTR_NIXL_XFER_S: (0.001 * i, 1e-12)[i % 4 == 0],
                    sc.ATTR_TP_SIZE: 2,
                    sc.ATTR_RANK: 70 if i % 6 == 0 else 1,
                    "outcome": ("ok", "expired")[i % 4 == 1],
                },
            ),
            ("read.complete", "decode", {sc.ATTR_BYTES: 2.5e6, sc.ATTR_DESCRIPTORS: 64, sc.ATTR_NIXL_XFER_S: 0.002}),
            ("decode.first_step", "decode", {sc.ATTR_KV_RECOMPUTED_TOKENS: (0, 40, 3)[i % 3], sc.ATTR_BLOCK_SIZE: 16}),
            ("kv.ready", "decode", {}),
            ("mystery.phase", "janitor", {"outcome": "meh"}),
            ("prefill", ["not", "hashable"], {}),
        ):
            out.append(_span(name, k, mode, role, dur_ns=(k * 7919) % 40_000_000_000 - 1000, **extra))
            k += 1
    return out


def test_span_metrics_expose_what_prometheus_clients_own_classes_do(monkeypatch):
    """The processor over FastHistogram children vs over stock Histograms
    (what kvlens exported before), fed the same spans."""
    spans = _spans()
    regs = []
    for stock in (True, False):
        if stock:
            monkeypatch.setattr(families, "histogram_class", lambda: Histogram)
        else:
            monkeypatch.undo()
        reg = CollectorRegistry()
        proc = PhaseMetricsProcessor(reg, handoff_from="off", exemplars=True)
        assert type(proc.fam.phase) is (Histogram if stock else FastHistogram)
        for s in spans:
            proc.on_end(s)
        proc.shutdown()
        regs.append(reg)
    assert _samples(regs[1]) == _samples(regs[0])
    names = {s[3] for s in _samples(regs[1])}
    assert {"kvlens_transfer_gbps_sum", "kvlens_rank_phase_duration_seconds_count"} <= names
    assert {"kvlens_transfer_implausible_total", "kvlens_kv_recomputed_total"} <= names
    for expo in (generate_latest, om_latest):
        assert _same_text(expo(regs[1]).decode()) == _same_text(expo(regs[0]).decode())


def test_fast_histogram_counts_every_observation_of_concurrent_threads():
    import threading

    regs, (stock, fast) = _pair()
    values = [(k * 7919 % 1000) / 997.0 for k in range(20000)]

    def feed(h, part, observe):
        for v in part:
            observe(h.labels("push"), v)

    def run(h, observe):
        ts = [threading.Thread(target=feed, args=(h, values[k::3], observe)) for k in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run(stock, lambda c, v: c.observe(v, {"trace_id": "ab" * 16}))
    run(fast, lambda c, v: c.observe_trace(v, "ab" * 16))
    a, b = _samples(regs[0]), _samples(regs[1])
    assert [s[:5] for s in a] == [s[:5] for s in b]
    for x, y in zip(a, b):  # counts exact; the sum's last bits depend on the order the threads added in
        assert math.isclose(float(x[5]), float(y[5]), rel_tol=1e-12), (x, y)
    assert float(dict((s[3], s[5]) for s in b)["kvlens_t_seconds_count"]) == len(values)
