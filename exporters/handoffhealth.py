"""Handoff health on ``/metrics`` and as partial traces (docs/handoff-health.md).

The hooks keep this process's open handoffs in
:class:`kvrecord.openhandoffs.HandoffTable` s; :class:`HealthPublisher`
reads them once a second on the recorder's background thread
(:meth:`kvrecord.recorder.Recorder.add_periodic`), never on vLLM's threads:

* sets the gauges from a snapshot and adds the counters' new increments;
* writes a ``handoff.open`` span (:data:`kvrecord.semconv.SPAN_HANDOFF_OPEN`)
  for each handoff open longer than ``open_trace_after_s``, again every
  :data:`REEMIT_S` while it stays open;
* runs the reconcilers the hooks registered (entries vLLM itself dropped).

Why not computed at scrape time: in vLLM's processes the metrics reach the
instance's ``/metrics`` through ``PROMETHEUS_MULTIPROC_DIR`` files that the
API server reads; a custom collector in the engine process is never asked.
So the gauges are written once a second (``multiprocess_mode`` ``livemax``
for counts, ``livemin`` for the oldest start: one process writes each
series; with TP > 1 only rank 0's worker keeps a table).

Metrics (labels are closed sets; counters exist at 0 for every label value
from start-up)::

    kvlens_handoffs_open{mode,role,phase}                               gauge
    kvlens_handoff_oldest_open_start_timestamp_seconds{mode,role,phase} gauge, Unix s; NaN when none is open
        # a handoff stuck for over 30 s: time() - kvlens_handoff_oldest_open_start_timestamp_seconds > 30
    kvlens_handoff_attempts_total{mode,role}                            counter
    kvlens_handoff_outcomes_total{mode,role,outcome}                    counter (ok|failed|timeout|expired|stale)
    kvlens_kv_stale_total{mode}                                         counter
    kvlens_kv_pinned_requests{mode,state}                               gauge (P)
    kvlens_kv_pinned_blocks{mode,state}                                 gauge (P)
    kvlens_kv_pinned_oldest_start_timestamp_seconds{mode,state}         gauge, Unix s; NaN when none
    kvlens_registration_timeouts_total{mode}                            counter (D, push)
    kvlens_handoff_untracked_total{mode,role}                           counter (table full: not tracked)
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from kvrecord import openhandoffs
from kvrecord import semconv as sc
from kvrecord.logutil import log_once

#: How often the publisher runs (the recorder thread's periodic call).
PERIOD_S = 1.0
#: A partial trace is written again at most this often while its handoff stays open.
REEMIT_S = 5.0
#: Partial traces written per tick at most (oldest first): bounded work when many are stuck.
MAX_OPEN_SPANS_PER_TICK = 64

_MODES = tuple(m.value for m in sc.Mode)
_SIDES = (sc.Role.PREFILL.value, sc.Role.DECODE.value)
_NAN = math.nan

_OLDEST_HELP = (
    "Unix time (s) the oldest handoff open in this phase entered it (for a side with one phase, the handoff's "
    "start on that side); NaN when none is open, so time() - x > bound is false."
)
_PINNED_OLDEST_HELP = "Unix time (s) the oldest request pinned in this state started it; NaN when none."


class HealthFamilies:
    """The health metric families of one registry (created once per process and registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._open_handoffs(registry)
        self._pinned_kv(registry)
        self._watch_limits(registry)
        # every counter at 0 for every label value from the start
        for mode in _MODES:
            self.stale.labels(mode)
            self.reg_timeouts.labels(mode)
            for role in _SIDES:
                self.attempts.labels(mode, role)
                self.untracked.labels(mode, role)
                for outcome in openhandoffs.OUTCOMES:
                    self.outcomes.labels(mode, role, outcome)

    def _open_handoffs(self, r: CollectorRegistry) -> None:
        """Open handoffs, attempts and outcomes."""
        self.open = Gauge(
            "kvlens_handoffs_open",
            "Handoffs open on this instance, by the phase they wait in (docs/handoff-health.md).",
            ("mode", "role", "phase"),
            registry=r,
            multiprocess_mode="livemax",
        )
        self.oldest = Gauge(
            "kvlens_handoff_oldest_open_start_timestamp_seconds",
            _OLDEST_HELP,
            ("mode", "role", "phase"),
            registry=r,
            multiprocess_mode="livemin",
        )
        self.attempts = Counter("kvlens_handoff_attempts", "Handoffs begun on this side.", ("mode", "role"), registry=r)
        self.outcomes = Counter(
            "kvlens_handoff_outcomes",
            "Handoffs ended on this side, by outcome (ok, failed, timeout, expired, stale; a stale request is "
            "counted expired at P's lease and again stale at the late read / write).",
            ("mode", "role", "outcome"),
            registry=r,
        )

    def _pinned_kv(self, r: CollectorRegistry) -> None:
        """KV pinned on P while it waits for D, and KV used after P let it go (stale)."""
        self.pinned_requests = Gauge(
            "kvlens_kv_pinned_requests",
            "Requests holding KV on P while waiting for D, by state.",
            ("mode", "state"),
            registry=r,
            multiprocess_mode="livemax",
        )
        self.pinned_blocks = Gauge(
            "kvlens_kv_pinned_blocks",
            "KV blocks those requests hold (unmatched_registration: D's staged blocks named by the registration).",
            ("mode", "state"),
            registry=r,
            multiprocess_mode="livemax",
        )
        self.pinned_oldest = Gauge(
            "kvlens_kv_pinned_oldest_start_timestamp_seconds",
            _PINNED_OLDEST_HELP,
            ("mode", "state"),
            registry=r,
            multiprocess_mode="livemin",
        )
        self.stale = Counter(
            "kvlens_kv_stale",
            "Requests whose KV was read (pull) or written / notified (push) after P released its blocks.",
            ("mode",),
            registry=r,
        )

    def _watch_limits(self, r: CollectorRegistry) -> None:
        """What the watch itself ran into: push's registration watchdog firing, a full open-handoff table."""
        self.reg_timeouts = Counter(
            "kvlens_registration_timeouts",
            "Push registrations whose D-side soft watchdog fired while the request kept waiting.",
            ("mode",),
            registry=r,
        )
        self.untracked = Counter(
            "kvlens_handoff_untracked",
            "Handoffs not tracked in the open table because it was full.",
            ("mode", "role"),
            registry=r,
        )


_families: dict[int, tuple[CollectorRegistry, HealthFamilies]] = {}
_families_lock = threading.Lock()


def health_families(registry: CollectorRegistry | None = None) -> HealthFamilies:
    """The families of ``registry`` (default: prometheus_client's REGISTRY)."""
    registry = REGISTRY if registry is None else registry
    with _families_lock:
        hit = _families.get(id(registry))
        if hit is not None and hit[0] is registry:
            return hit[1]
        fam = HealthFamilies(registry)
        _families[id(registry)] = (registry, fam)
        return fam


class HealthPublisher:
    """Publishes this process's open-handoff tables (module docstring).

    ``recorder``: where partial traces go (its ``record``). ``tick`` runs on
    the recorder's background thread; it never raises."""

    def __init__(
        self,
        recorder: Any,
        registry: CollectorRegistry | None = None,
        *,
        open_trace_after_s: float = 5.0,
        reemit_s: float = REEMIT_S,
        tables: Callable[[], list[openhandoffs.HandoffTable]] = openhandoffs.tables,
    ) -> None:
        if open_trace_after_s < 0:
            raise ValueError(f"open_trace_after_s must be >= 0 (0: off), got {open_trace_after_s!r}")
        self.rec = recorder
        self.fam = health_families(registry)
        self.after_ns = int(open_trace_after_s * 1e9)
        self.every_ns = int(reemit_s * 1e9)
        self._tables = tables
        self._seen: dict[tuple[int, str], int] = {}  # (table id, counter) -> value published
        self._reconcilers: list[Callable[[], None]] = []
        self.open_spans = 0  # partial traces written

    def add_reconciler(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at each tick, before the snapshot (drops entries vLLM dropped)."""
        self._reconcilers.append(fn)

    def tick(self) -> None:
        for fn in list(self._reconcilers):
            try:
                fn()
            except Exception:
                log_once("health-reconcile", "open-handoff reconciliation failed; skipped", exc_info=True)
        tables = self._tables()
        for t in tables:
            for fn in list(t.reconcilers):
                try:
                    fn()
                except Exception:
                    log_once("health-reconcile", "open-handoff reconciliation failed; skipped", exc_info=True)
        now_ns = time.time_ns()
        for t in tables:
            try:
                self._publish(t)
            except Exception:
                log_once("health-publish", "handoff health metrics failed; skipped", exc_info=True)
            if self.after_ns > 0:
                try:
                    self._open_spans(t, now_ns)
                except Exception:
                    log_once("health-open-spans", "partial traces failed; skipped", exc_info=True)

    # ----------------------------------------------------------------------
    def _publish(self, t: openhandoffs.HandoffTable) -> None:
        fam, mode, role = self.fam, t.mode, t.role
        for ph, (n, oldest_ns, blocks) in t.snapshot().items():
            oldest = _NAN if oldest_ns is None else oldest_ns / 1e9
            fam.open.labels(mode, role, ph).set(n)
            fam.oldest.labels(mode, role, ph).set(oldest)
            state = sc.PINNED_OF.get(sc.OpenPhase(ph))
            if state is not None and role == sc.Role.PREFILL.value:
                fam.pinned_requests.labels(mode, state.value).set(n)
                fam.pinned_blocks.labels(mode, state.value).set(blocks)
                fam.pinned_oldest.labels(mode, state.value).set(oldest)
        self._inc(t, "attempts", t.attempts, fam.attempts.labels(mode, role))
        for outcome, v in list(t.outcomes.items()):
            self._inc(t, "outcome:" + outcome, v, fam.outcomes.labels(mode, role, outcome))
        self._inc(t, "stale", t.stale, fam.stale.labels(mode))
        self._inc(t, "reg_timeouts", t.registration_timeouts, fam.reg_timeouts.labels(mode))
        self._inc(t, "dropped", t.dropped, fam.untracked.labels(mode, role))

    def _inc(self, t, key: str, value: int, child) -> None:
        k = (id(t), key)
        last = self._seen.get(k, 0)
        if value > last:
            child.inc(value - last)
            self._seen[k] = value

    def _open_spans(self, t: openhandoffs.HandoffTable, now_ns: int) -> None:
        for rid, e in t.due(now_ns, self.after_ns, self.every_ns, MAX_OPEN_SPANS_PER_TICK):
            f = openhandoffs.entry_fields(e)
            attrs = {
                sc.ATTR_OPEN: True,
                sc.ATTR_OPEN_PHASE: f["phase"],
                sc.ATTR_ROLE: t.role,
                sc.ATTR_MODE: t.mode,
                sc.ATTR_OPEN_BLOCKS: f["blocks"],
                sc.ATTR_JOIN_REQUEST_ID: f["join"],
            }
            flags = f["flags"]
            if flags:
                attrs.update(flags)
                since = flags.get(_TIMEOUT_AT)
                if since is not None:
                    attrs.pop(_TIMEOUT_AT, None)
                    attrs[sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S] = max(now_ns - since, 0) / 1e9
            self.rec.record(sc.SPAN_HANDOFF_OPEN, rid, f["start_ns"], max(now_ns, f["start_ns"]), "ok", attrs)
            self.open_spans += 1


#: Flag key (not an attribute): when the registration watchdog fired, ns
#: (instrumented_connector.hooks.TIMEOUT_AT, which imports no exporter).
_TIMEOUT_AT = "_registration_timeout_at_ns"

_publishers: dict[int, HealthPublisher] = {}
_publishers_lock = threading.Lock()


def attach(recorder: Any, open_trace_after_s: float = 5.0, registry: CollectorRegistry | None = None):
    """This process's publisher, run by ``recorder``'s background thread once
    a second (created on the first call; later calls return it). None when
    the recorder has no background thread to lend (telemetry off)."""
    pid = os.getpid()
    p = _publishers.get(pid)
    if p is not None:
        return p
    add = getattr(recorder, "add_periodic", None)
    if add is None:
        return None
    with _publishers_lock:
        p = _publishers.get(pid)
        if p is None:
            p = HealthPublisher(recorder, registry, open_trace_after_s=open_trace_after_s)
            add(p.tick, PERIOD_S)
            _publishers[pid] = p
    return p
