"""Span-derived Prometheus metrics (in the spirit of the Collector's spanmetrics).

:class:`PhaseMetricsProcessor` is an OTel ``SpanProcessor`` that
:mod:`exporters.pipeline` adds to every kvlens process (router, P and D
scheduler/worker). ``on_end`` runs on the recorder's background thread (the
SDK calls processors synchronously from ``span.end()``), never on vLLM's
engine loop; it costs a few dict look-ups and one ``observe`` per span, never
blocks on I/O and never raises (a failure is logged once and the span is
skipped).

Metrics (labels are closed sets from :mod:`kvrecord.semconv`;
anything else becomes ``_OTHER``; request and trace ids are never labels)::

    kvlens_phase_duration_seconds{mode,role,phase,outcome}   histogram
        # p99 of one phase, by mode:
        # histogram_quantile(0.99, sum by (le, mode, phase) (rate(kvlens_phase_duration_seconds_bucket[1m])))
    kvlens_handoff_seconds{mode}                              histogram (router)
        # critical path prefill.finished (P) -> kv.ready (D):
        # histogram_quantile(0.5, sum by (le, mode) (rate(kvlens_handoff_seconds_bucket[1m])))
    kvlens_handoff_unresolved_total{mode,reason}              counter (router)
        # requests whose handoff could not be read: reason missing|overflow|no_store
    kvlens_ttft_seconds{mode,dispatch}                        histogram (router)
    kvlens_requests_total{mode,outcome}                       counter (router)
    kvlens_tpot_seconds{mode}                                 histogram (router; root span's kvlens.tpot_s)
        # mean TPOT by mode: sum by (mode) (rate(kvlens_tpot_seconds_sum[5m]))
        #                  / sum by (mode) (rate(kvlens_tpot_seconds_count[5m]))
        # error ratio: sum by (mode) (rate(kvlens_requests_total{outcome!="ok"}[5m]))
        #              / sum by (mode) (rate(kvlens_requests_total[5m]))
    kvlens_transfer_bytes{mode,role}                          histogram (write/read.complete; per rank)
    kvlens_rank_phase_duration_seconds{mode,role,phase,rank}  histogram (transfer phases, TP > 1 only)
        # throughput: sum by (mode) (rate(kvlens_transfer_bytes_sum[1m]))
    kvlens_transfer_descriptors{mode,role}                    histogram (write/read.complete)
    kvlens_transfer_gbps{mode,role}                           histogram (bytes / NIXL's xferDuration, per rank)
    kvlens_transfer_implausible_total{mode,role}              counter (that figure above KVLENS_LINK_GBPS)
    kvlens_kv_hold_long_total{mode}                           counter (kv.hold > KVLENS_HOLD_WARN_S; resolver)
    kvlens_kv_recomputed_total{mode}                          counter (D computed more than the last partial block)
    kvlens_phase_cpu_wait_seconds_total{mode,role,phase}      counter (spans with CPU figures: kvlens.cpu.wait_s)
    kvlens_phase_cpu_seconds_total{mode,role,phase}           counter (kvlens.cpu.on_s)
    kvlens_phase_cpu_span_seconds_total{mode,role,phase}      counter (those spans' wall time; unknown figures: none)
        # a phase's CPU-wait share: sum by (mode, phase) (rate(kvlens_phase_cpu_wait_seconds_total[5m]))
        #                         / sum by (mode, phase) (rate(kvlens_phase_cpu_span_seconds_total[5m]))
        # the handoff's, per mode: recording rule kvlens:handoff_cpu_wait_share:ratio_5m
    kvlens_push_registrations_waiting                         gauge (P, push)
    kvlens_push_prefills_waiting                              gauge (P, push)
    kvlens_telemetry_dropped_total{role,reason}               counter
        # spans lost before a sink had them, reason buffer_full|queue_full|store|export_failed|shutdown
        # (a span lost in two sinks counts once per sink):
        # sum by (reason) (increase(kvlens_telemetry_dropped_total[1h]))

Handoff
-------
Its two ends come from different processes, so it is read back from the
trace store when the router's root ``request`` span ends: see
:mod:`exporters.handoff` for where and why.

Push waiting gauges
-------------------
Derived from spans in the P processes: ``registration.receive`` +1
registration; ``prefill.finished`` (push, ok) +1 prefill; ``match`` -1 of
each (a match always pairs one of each); ``write.complete`` with outcome
``expired`` -1 prefill (lease reaped with no registration). The scheduler
(+prefill) and the worker (-prefill) may be different processes: in vLLM's
multiprocess mode the gauges use ``multiprocess_mode='livesum'``, so the
instance's ``/metrics`` shows the sum, which is the real count. Exact for
TP=1; registrations that expire on P without a match are not seen (no span),
so the registration gauge can overstate after D-side timeouts.

Exemplars and multiprocess
--------------------------
Histogram observations carry ``{"trace_id": <32 hex>}``, exposed only in the
OpenMetrics exposition (Prometheus negotiates it; ``--enable-feature=
exemplar-storage`` stores them). With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM
always sets one), metrics of the EngineCore/worker process on the default
registry are written to that directory and vLLM's API server serves them,
without exemplars (prometheus_client drops them there); the router's
:func:`metrics_app` has them. Metric families are created once per (process,
registry) and shared by every processor of the process.
"""

from __future__ import annotations

import os
import time
from _thread import get_ident as _get_ident
from bisect import bisect_left as _bisect_left
from pathlib import Path
from typing import Any, Callable, Mapping

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import format_trace_id
from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app, multiprocess

from kvtrace import ranks
from exporters.families import families_for
from exporters.spanobs import ROLE_LABELS, closed_label, label_table, plan
from exporters.handoff import HandoffResolver
from kvrecord import config
from kvrecord import semconv as sc
from kvrecord.location import StoreLocation
from kvrecord.logutil import log_once
from kvrecord.recorder import DropReason

HANDOFF_FROM_ENV = "KVLENS_HANDOFF_FROM"
#: With ``handoff_from="any"``, how long a lookup triggered by D's
#: ``kv.ready`` waits for a router's spans (its ``relay`` decides which
#: derived phases the trace has); the router's root span ends the wait.
KV_READY_WAIT_S = 3.0

_OTHER = sc.OTHER
#: Bound of a processor's cache of :func:`exporters.spanobs.plan` s: the
#: attribute values are open sets; past this many keys a span's are closed each time.
_MAX_PLANS = 4096
_monotonic, _time = time.monotonic, time.time
_EMPTY: Mapping[str, Any] = {}
_A_MODE, _A_ROLE, _A_OUTCOME = sc.ATTR_MODE, sc.ATTR_ROLE, sc.ATTR_OUTCOME


# ----------------------------------------------------------- dropped telemetry
DroppedSource = Callable[[], "Mapping[Any, int] | int"]
_no_drops: DroppedSource = dict  # a processor given no source sees no drops
_drop_override: DroppedSource | None = None
_REASONS = label_table(DropReason)
_BUFFER_FULL = DropReason.BUFFER_FULL.value


def set_dropped_source(fn: DroppedSource | None) -> None:
    """Override where every processor of this process reads drop counts from.

    ``fn()`` returns monotonic totals: a mapping (role, reason) -> total
    (what :func:`exporters.pipeline.dropped_counts` gives), a mapping
    role -> total (reason ``buffer_full``), or an int (role ``_OTHER``,
    reason ``buffer_full``). It is polled at most once a second from a
    processor's ``on_end``, and on flush and shutdown;
    ``kvlens_telemetry_dropped_total`` grows by the delta. ``None`` removes
    the override: each processor reads its own ``dropped_source`` again
    (:mod:`exporters.pipeline` passes :func:`exporters.pipeline.dropped_counts`,
    every kvlens recorder and span processor of the process).
    """
    global _drop_override
    _drop_override = fn


def _drop_key(key: Any) -> tuple[str, str]:
    """(role, reason) label values, closed, of one ``dropped_source`` key."""
    role, reason = key if isinstance(key, tuple) and len(key) == 2 else (key, _BUFFER_FULL)
    return closed_label(role, ROLE_LABELS, sc.Role), closed_label(reason, _REASONS, DropReason)


# -------------------------------------------------------------- the processor
class PhaseMetricsProcessor(SpanProcessor):
    """OTel span processor turning kvlens spans into Prometheus metrics.

    Thread: ``on_end`` is called by the SDK from whichever thread ends the
    span (kvlens: the recorder thread). It never blocks on I/O and never
    raises. ``registry`` defaults to prometheus_client's ``REGISTRY`` (what
    vLLM's multiprocess ``/metrics`` and :func:`metrics_app` serve).

    ``store_path``: trace store for the handoff lookup (default
    :func:`config.default_store`; a path or URL is parsed once, here). ``handoff_from``: ``"router"`` (default;
    env ``KVLENS_HANDOFF_FROM``: the root span triggers the lookup),
    ``"decode"`` (D's ``kv.ready``: behind another router), ``"any"``
    (either, each trace counted once: where every span meets, the collector)
    or ``"off"``. ``exemplars``: attach
    ``trace_id`` exemplars (default: on unless ``PROMETHEUS_MULTIPROC_DIR``
    is set, where prometheus_client cannot store them). ``dropped_source``:
    where ``kvlens_telemetry_dropped_total`` reads drop counts (see
    :func:`set_dropped_source`; default: none). ``keeper``: the
    :class:`kvtrace.store.Keeper` writing the spans this processor sees (the
    collector's), whose keep rule the exemplars and the handoff follow.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        store_path: "StoreLocation | str | Path | None" = None,
        handoff_from: str | None = None,
        handoff_deadline_s: float = 10.0,
        handoff_max_pending: int = 10000,
        handoff_poll_s: float = 0.25,
        exemplars: bool | None = None,
        dropped_source: DroppedSource | None = None,
        keeper: Any = None,
    ) -> None:
        handoff_from = (handoff_from or os.environ.get(HANDOFF_FROM_ENV) or "router").strip().lower()
        if handoff_from not in ("router", "decode", "any", "off"):
            raise ValueError(f"handoff_from must be router, decode, any or off, got {handoff_from!r}")
        if handoff_deadline_s <= 0 or handoff_poll_s <= 0:
            raise ValueError("handoff_deadline_s and handoff_poll_s must be > 0")
        if int(handoff_max_pending) <= 0:
            raise ValueError(f"handoff_max_pending must be > 0, got {handoff_max_pending!r}")
        self.registry = registry if registry is not None else REGISTRY
        self.fam = families_for(self.registry)
        if exemplars is None:
            exemplars = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.exemplars = bool(exemplars)
        self._trigger = {
            "router": (sc.Phase.REQUEST.value,),
            "decode": (sc.Phase.KV_READY.value,),
            "any": (sc.Phase.REQUEST.value, sc.Phase.KV_READY.value),
            "off": (),
        }[handoff_from]
        self.handoff = HandoffResolver(
            self.fam,
            store_path if store_path is not None else config.default_store(),
            deadline_s=float(handoff_deadline_s),
            max_pending=int(handoff_max_pending),
            poll_s=float(handoff_poll_s),
            exemplars=self.exemplars,
        )
        # Under --keep sampled (the collector's kvtrace.store.Keeper) every span
        # is still observed (counts stay exact) but an exemplar names only a
        # request whose spans are stored, and the handoff is observed once its
        # request is decided, its derived phases from the held spans if unkept.
        self._exemplar_ok = None
        # the last trace asked about and its answer: a request's spans arrive
        # together. A stale answer is safe: kept is never taken back (a ratio
        # pick is kept), and a missed exemplar is only a missed exemplar.
        self._ok_last: tuple[str | None, bool] = (None, False)
        if keeper is not None and keeper.rule.sampled:
            self._exemplar_ok = keeper.surely_kept
            self.handoff.held = keeper.unkept_rows
            self.handoff.min_wait_s = keeper.rule.grace_s
            self.handoff.deadline_s = max(self.handoff.deadline_s, keeper.rule.wait_s + handoff_deadline_s)
        self._dropped_source = dropped_source or _no_drops
        #: bandwidth above this (Gb/s, env KVLENS_LINK_GBPS) is counted implausible, not observed
        self.link_gbps = ranks.link_gbps()
        self._next_drop_check = 0.0
        self._plans: dict[tuple, tuple] = {}  # see _plan

    # SpanProcessor API ----------------------------------------------------
    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        # The phase duration inline (a Python call is a tenth of what a span
        # costs here); what a span observes is decided once per key (_plan).
        try:
            t0, t1 = span.start_time, span.end_time
            if t0 is not None and t1 is not None:
                a = span.attributes or _EMPTY
                name = span.name
                key = (name, a.get(_A_MODE), a.get(_A_ROLE), a.get(_A_OUTCOME, "ok"))
                try:
                    mode, observe, more, h = self._plans[key]
                except (KeyError, TypeError):
                    mode, observe, more, h = self._plan(key)
                tid = None  # the exemplar's trace id; an int is formatted only if a scrape reads it
                hexed = getattr(span, "trace_hex", None)  # a decoded span's (WireSpan), else the int's text below
                if self.exemplars:
                    if self._exemplar_ok is not None:
                        tid = hexed or format_trace_id(span.context.trace_id)
                        last, ok = self._ok_last
                        if tid != last:
                            ok = self._exemplar_ok(tid)
                            self._ok_last = (tid, ok)
                        if not ok:
                            tid = None
                    else:
                        tid = span.context.trace_id
                d = (t1 - t0) / 1e9 if t1 > t0 else 0.0
                if h is None:
                    observe(d, tid)
                else:  # h.observe_trace(d, tid) inline (d is no NaN): the call is a tenth of this path
                    i = _bisect_left(h._upper_bounds, d)
                    shard = h._shards.get(_get_ident()) or h.shard()
                    shard[0] += d
                    shard[i + 1] += 1
                    if tid is not None:
                        h._exemplars[i] = (tid, d, _time())
                if more is not None:
                    more(a, d, tid)
                if name in self._trigger:
                    wait = KV_READY_WAIT_S if len(self._trigger) > 1 and name == sc.Phase.KV_READY.value else 0.0
                    self.handoff.submit(hexed or format_trace_id(span.context.trace_id), mode, wait)
        except Exception as e:
            log_once("metrics:" + type(e).__name__, "span metrics failed (%s); span skipped", e, exc_info=True)
        now = _monotonic()
        if now >= self._next_drop_check:
            self._next_drop_check = now + 1.0
            try:
                self.sync_dropped()
            except Exception as e:
                log_once("metrics-dropped:" + type(e).__name__, "dropped-telemetry source failed (%s)", e)

    def shutdown(self) -> None:
        try:
            self.sync_dropped()  # the losses counted at shutdown, before the process goes
        except Exception as e:
            log_once("metrics-dropped:" + type(e).__name__, "dropped-telemetry source failed (%s)", e)
        try:
            self.handoff.flush(1.0)
            self.handoff.close()
        except Exception:
            log_once("metrics-shutdown", "span metrics shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            self.sync_dropped()
            return self.handoff.flush(timeout_millis / 1000.0)
        except Exception:
            log_once("metrics-flush", "span metrics flush failed", exc_info=True)
            return False

    # ----------------------------------------------------------------------
    def _plan(self, key: tuple) -> tuple:
        """:func:`exporters.spanobs.plan` of a span's (name, mode, role, outcome)
        attributes as they came, cached up to :data:`_MAX_PLANS` keys."""
        p = plan(self.fam, self, *key)
        try:
            if len(self._plans) < _MAX_PLANS:
                self._plans[key] = p
        except TypeError:  # an unhashable attribute value (a list): planned each time
            pass
        return p

    def sync_dropped(self) -> None:
        """Add the new losses of the drop source to ``kvlens_telemetry_dropped_total``."""
        fn = _drop_override or self._dropped_source
        src = fn()
        if isinstance(src, int):
            src = {(_OTHER, _BUFFER_FULL): src}
        fam = self.fam
        with fam.lock:
            deltas = []
            for key, total in src.items():
                seen = (fn, key)
                last = fam.drop_seen.get(seen)
                total = int(total)
                if last is None or total > last:  # a new key at 0: its series exists, reading 0
                    deltas.append((key, total - (last or 0)))
                    fam.drop_seen[seen] = total
        for key, delta in deltas:
            child = fam.child(fam.dropped, _drop_key(key))
            if delta > 0:
                child.inc(delta)


# ---------------------------------------------------------------- /metrics
def metrics_app(registry: CollectorRegistry | None = None):
    """ASGI app serving ``registry`` (default: the process's REGISTRY, or a
    multiprocess collector when ``PROMETHEUS_MULTIPROC_DIR`` is set).

    The exposition format follows the scraper's ``Accept`` header, so a
    Prometheus with exemplar storage gets OpenMetrics with exemplars. The
    router mounts it: ``app.mount("/metrics", metrics_app())``.
    """
    if registry is None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = REGISTRY
    return make_asgi_app(registry)
