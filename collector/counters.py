"""The collector's own counters: what it received, wrote, dropped, refused
and, under ``--keep sampled``, decided (their meaning and the sum they make:
:mod:`collector.ingest`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrecord.keeprule import KEEP_REASONS, NOT_KEPT

DROP_REASONS = ("store_error", "shutdown")
REJECT_REASONS = ("too_large", "content_type", "decode", "invalid_span", "queue_full", "shutdown", "unauthenticated")


class IngestMetrics:
    """The collector's ``kvlens_collector_*`` counters (:mod:`collector.ingest` says what each counts)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.received = Counter(
            "kvlens_collector_spans_received", "Spans the collector accepted onto its write queue.", registry=r
        )
        self.written = Counter(
            "kvlens_collector_spans_written", "Spans the collector wrote to the trace store.", registry=r
        )
        self.dropped = Counter(
            "kvlens_collector_spans_dropped",
            "Accepted spans that never reached the store (store_error, shutdown).",
            ("reason",),
            registry=r,
        )
        self.rejected = Counter(
            "kvlens_collector_requests_rejected",
            "OTLP export requests the collector refused, by reason.",
            ("reason",),
            registry=r,
        )
        self.queue = Gauge(
            "kvlens_collector_queue_spans", "Spans queued for the store or being written now.", registry=r
        )
        self._keep_metrics(r)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)

    def _keep_metrics(self, r: CollectorRegistry) -> None:
        """Those of ``--keep sampled`` (:class:`kvtrace.store.Keeper`)."""
        self.unkept = Counter(
            "kvlens_collector_spans_unkept",
            "Spans not stored because their request was kept as its summary only (--keep sampled).",
            registry=r,
        )
        self.buffer = Gauge(
            "kvlens_collector_decision_buffer_spans",
            "Spans held until their request's keep decision (--keep sampled).",
            registry=r,
        )
        self.decisions = Counter(
            "kvlens_collector_keep_decisions",
            "Requests decided under --keep sampled, by decision (a keep reason, or no: summary only).",
            ("decision",),
            registry=r,
        )
        self.forced = Counter(
            "kvlens_collector_decisions_forced",
            "Requests decided before their decision wait because the decision buffer was full.",
            registry=r,
        )
        self.late = Counter(
            "kvlens_collector_late_spans",
            "Spans that arrived after their request was decided (kept: stored; else unkept).",
            ("kept",),
            registry=r,
        )
        self.evicted = Counter(
            "kvlens_collector_held_spans_evicted",
            "Spans of unkept requests let go before the metrics read their derived phases (memory bound).",
            registry=r,
        )
        for d in (*KEEP_REASONS, NOT_KEPT):
            self.decisions.labels(d)
        for k in ("yes", "no"):
            self.late.labels(k)

    def sync(self, keeper, seen: dict[str, int]) -> None:
        """A :class:`kvtrace.store.Keeper`'s counts since the last call
        (``seen``: what was added already, updated) onto these metrics."""
        self.buffer.set(keeper.buffered)
        for key, v in keeper.counts.items():
            d = v - seen.get(key, 0)
            if not d:
                continue
            seen[key] = v
            if key == "unkept":
                self.unkept.inc(d)
            elif key == "forced":
                self.forced.inc(d)
            elif key == "unkept_evicted":
                self.evicted.inc(d)
            elif key in ("late_kept", "late_dropped"):
                self.late.labels("yes" if key == "late_kept" else "no").inc(d)
            else:
                self.decisions.labels(key).inc(d)
