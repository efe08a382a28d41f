"""The handoff resolver: ``kvlens_handoff_seconds`` read back from the trace store.

Where it is computed, and why
-----------------------------
The handoff's two ends come from different processes: ``prefill.finished``
ends in P's scheduler, ``kv.ready`` in D's worker, so no single span
processor sees both. Both land in the host's trace store, whose ``traces``
row folds them (``handoff_s``). The metric is therefore read from the store,
and it is read **in the router**, when the router's root ``request`` span
ends (:class:`exporters.metrics.PhaseMetricsProcessor` submits it):

* exactly one ``request`` span per request, and only the router emits it, so
  ``count(kvlens_handoff_seconds{mode})`` + ``kvlens_handoff_unresolved_total``
  equals ``kvlens_requests_total`` per mode, and each observation matches one
  store row with ``handoff_s`` set (the reconciliation the tests check);
* the request span ends after the last byte went to the client, long after
  P's and D's spans were exported in the usual case; a bounded retry queue
  (``max_pending`` entries, each polled until ``deadline_s``) absorbs the
  store's export lag (recorder flush ~0.1 s + batch export ~0.2 s). A request
  whose row never gets both ends (P failed, store off) is counted once in
  ``kvlens_handoff_unresolved_total{reason="missing"}``, never observed;
* the router is a single process served by :func:`exporters.metrics.metrics_app`
  with OpenMetrics, so handoff observations keep their ``trace_id`` exemplar
  (vLLM's ``/metrics`` runs prometheus_client in multiprocess mode, which
  drops exemplars).

The lookup happens on a small daemon thread (``kvlens-handoff``), batched
(one :func:`kvtrace.store.handoffs` call per poll), so ``on_end`` only
appends to a dict. Deployments without the kvlens router (a third-party
router on one host) can set ``KVLENS_HANDOFF_FROM=decode``: the trigger then
is D's ``kv.ready`` span, with the same store lookup (no exemplars there).
Across hosts the store is per host, so the router needs P's and D's spans on
its host (same store file) or hosts the OTLP receiver (``kvlens proxy
--collect``); otherwise ``kvlens collect`` runs this resolver.

The observed value is the store's settled handoff: corrected for the P/D
clock offset (:mod:`kvtrace.clockbounds`), never clamped; one whose clocks
could not be bounded is counted ``unresolved{reason="clock_unknown"}``. Each
observation also sets ``kvlens_clock_offset_seconds`` (the middle of the
pair's interval for D's clock minus P's) and
``kvlens_clock_offset_width_seconds`` (its width), labelled by the engine
ids seen (at most :data:`MAX_PAIRS` pairs). The same pass reads the
resolved traces' spans back and observes their derived phases
(``derived.DERIVED_PHASES``, e.g. ``prefill.respond``) in
``kvlens_phase_duration_seconds``: no single process sees those intervals.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvtrace import store, tracemodel
from kvrecord import procstats
from kvrecord import semconv as sc
from kvrecord.keeprule import NOT_KEPT
from kvrecord.logutil import log_once

#: Bound on the (P engine, D engine) label pairs of the clock gauges.
MAX_PAIRS = 64
#: Trace ids remembered as looked up, so a second trigger span of the same
#: request (root span and ``kv.ready`` with ``handoff_from="any"``) is
#: not counted again: far more than arrive within one trigger's spread.
DONE_CAP = 100_000


HOLD_WARN_ENV = "KVLENS_HOLD_WARN_S"
#: A ``kv.hold`` longer than this counts in ``kvlens_kv_hold_long_total``:
#: P lets go within an engine step or two of D's kv.ready (milliseconds);
#: 5 s is vLLM's lease heartbeat interval (``kv_lease_duration`` 30 s / 6),
#: so a longer hold is one P's lease had to be kept alive for, and every
#: lease that ran out (30 s) counts.
DEFAULT_HOLD_WARN_S = 5.0


def hold_warn_s() -> float:
    """The long-hold threshold, seconds (env ``KVLENS_HOLD_WARN_S``; the
    default when unset or not a number >= 0)."""
    try:
        v = float(os.environ.get(HOLD_WARN_ENV) or DEFAULT_HOLD_WARN_S)
    except ValueError:
        return DEFAULT_HOLD_WARN_S
    return v if v >= 0 and v != float("inf") else DEFAULT_HOLD_WARN_S


class HandoffResolver:
    """Bounded queue of trace ids whose handoff is read from the trace store.

    ``submit`` (any thread) only touches a dict; a daemon thread polls the
    store every ``poll_s`` seconds with one batched query and observes each
    handoff exactly once, or counts it unresolved after ``deadline_s``.

    ``fam``: the metric families (:class:`exporters.metrics` ``Families``:
    ``child()``, ``handoff``, ``unresolved``) the results go to."""

    def __init__(
        self,
        fam: Any,
        store_path: "store.StoreLocation | str | Path",
        *,
        deadline_s: float,
        max_pending: int,
        poll_s: float,
        exemplars: bool,
    ) -> None:
        self.fam = fam
        self.location = store.StoreLocation.parse(store_path)  # a file or a postgresql:// URL
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self.poll_s = poll_s
        self.exemplars = exemplars
        self._pending: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn = None
        self._pid = os.getpid()
        self._pairs: set[tuple[str, str]] = set()
        self.hold_warn_s = hold_warn_s()
        #: Under --keep sampled: the span rows of unkept requests, by trace id
        #: (``Keeper.unkept_rows``); a handoff then waits for its request's
        #: decision, and an exemplar names only a kept request.
        self.held: Any = None
        #: The least wait of every submit (under --keep sampled: the keep
        #: decision's grace, before which a request is not worth reading).
        self.min_wait_s = 0.0
        #: trace ids looked up already, newest last (bounded: :data:`DONE_CAP`)
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()

    def submit(self, trace_id: str, mode: str, wait_s: float = 0.0) -> None:
        """Queue ``trace_id`` (32 hex) for lookup. Any thread; never blocks on I/O.
        A trace already pending or looked up (several trigger spans of one
        request: the router's root and D's ``kv.ready``) counts once.
        ``wait_s``: read it no sooner than this (D's ``kv.ready`` where a
        router's spans may still be on their way: its ``relay`` decides the
        derived phases); a later submit without a wait lifts it."""
        now = time.monotonic()
        wait_s = max(wait_s, self.min_wait_s)
        with self._lock:
            if trace_id in self._done:
                return
            held = self._pending.get(trace_id)
            if held is not None:
                if now + wait_s < held[2]:
                    self._pending[trace_id] = (held[0], held[1], now + wait_s)
                return
            if len(self._pending) >= self.max_pending:
                overflow = True
            else:
                overflow = False
                self._pending[trace_id] = (mode, now + self.deadline_s, now + wait_s)
        if overflow:
            self.fam.child(self.fam.unresolved, (mode, "overflow")).inc()
            return
        if self._thread is None or self._pid != os.getpid():
            self._start()

    def pending(self) -> int:
        return len(self._pending)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._conn = None
            t = threading.Thread(target=self._run, name="kvlens-handoff", daemon=True)
            self._thread = t
            t.start()

    def _run(self) -> None:
        procstats.name_native_thread("kvlens-handoff")  # per-thread CPU accounting (benchmarks/bench_cpu.py)
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            try:
                self.resolve_once()
            except Exception as e:
                log_once("handoff:" + type(e).__name__, "handoff lookup failed (%s); retrying", e, exc_info=True)

    def _connection(self):
        if self._conn is None:
            self._conn = store.connect(self.location, readonly=True, timeout_s=1.0)
        return self._conn

    def _lookup(self, trace_ids: list[str]) -> tuple[dict[str, dict], bool]:
        """(trace_id -> settled row (``store.HANDOFF_COLUMNS``), whether the store could be read)."""
        try:
            return store.handoffs(self._connection(), trace_ids), True
        except FileNotFoundError:
            log_once("handoff-store", "trace store %s not found yet; handoff metrics wait for it", self.location)
        except Exception as e:
            log_once("handoff-read:" + type(e).__name__, "trace store read failed (%s); retrying", e)
            self._close_conn()
        return {}, False

    def resolve_once(self, *, expire: bool = True) -> int:
        """One pass: observe settled handoffs, expire overdue ones. Returns resolved count.

        A trace is observed once its own clock crossings have all arrived
        (its settled figure is final), or at its deadline with whatever the
        store settled by then; a handoff the store could not bound is counted
        ``unresolved{reason="clock_unknown"}``, never observed.

        Resolver thread (or ``flush`` on the caller's); reads the store."""
        with self._lock:
            now = time.monotonic()  # only those that may resolve now are read (not before their wait)
            items = [(t, v) for t, v in self._pending.items() if now >= v[2] or (expire and now >= v[1])]
        if not items:
            return 0
        found, store_ok = self._lookup([t for t, _ in items])
        now = time.monotonic()
        resolved, expired = [], []
        with self._lock:
            for tid, (mode, deadline, not_before) in items:
                # pop() decides: a concurrent pass (thread vs force_flush) may
                # have taken this id already, and each id counts exactly once.
                row = found.get(tid)
                due = expire and now >= deadline
                ready = row is not None and row["complete"] and (self.held is None or row["keep"] is not None)
                if row is not None and ((ready and now >= not_before) or due):
                    if self._pending.pop(tid, None) is not None:
                        resolved.append((tid, mode, row))
                        self._mark_done(tid)
                elif due:
                    if self._pending.pop(tid, None) is not None:
                        expired.append((tid, mode))
                        self._mark_done(tid)
        fam = self.fam
        for tid, mode, row in resolved:
            self._observe(tid, mode, row)
        if resolved:
            self._observe_derived({tid: (mode, row["clock_offset_s"], row["keep"]) for tid, mode, row in resolved})
        reason = "missing" if store_ok else "no_store"
        for _, mode in expired:
            fam.child(fam.unresolved, (mode, reason)).inc()
        if expired and store_ok:
            self._count_halves(expired)
        return len(resolved)

    def _mark_done(self, tid: str) -> None:
        """Remember a looked-up trace (caller holds the lock)."""
        done = self._done
        done[tid] = None
        if len(done) > DONE_CAP:
            done.popitem(last=False)

    def _count_halves(self, expired: list[tuple[str, str]]) -> None:
        """Of the traces that expired without a handoff, count those holding
        one side's spans only (``kvlens_traces_unjoined_total``): P's and D's
        records of one request did not join (docs/phases.md, "Trace correlation")."""
        try:
            sides = store.halves(self._connection(), [t for t, _ in expired])
        except Exception as e:
            log_once("handoff-halves:" + type(e).__name__, "half traces not counted (%s); skipped", e)
            return
        fam = self.fam
        for tid, mode in expired:
            side = sides.get(tid)
            if side is not None:
                why = "no_decode_side" if side == sc.Role.PREFILL.value else "no_prefill_side"
                fam.child(fam.unjoined, (mode, why)).inc()

    def _observe(self, tid: str, mode: str, row: dict) -> None:
        fam = self.fam
        h = row["handoff_s"]
        if h is None:  # both ends known, the clocks not bounded: unknown, not clamped
            fam.child(fam.unresolved, (mode, "clock_unknown")).inc()
        else:
            child = fam.child(fam.handoff, (mode,))
            if self._exemplar(row.get("keep")):
                child.observe(float(h), {"trace_id": tid})
            else:
                child.observe(float(h))
        lo, hi = row["clock_lo_s"], row["clock_hi_s"]
        pair = (row["p_engine"], row["d_engine"])
        if lo is None or hi is None or None in pair:
            return
        if pair not in self._pairs:
            if len(self._pairs) >= MAX_PAIRS:
                log_once("handoff-pairs", "more than %d P/D engine pairs; clock gauges skip the rest", MAX_PAIRS)
                return
            self._pairs.add(pair)
        fam.child(fam.clock_offset, pair).set((lo + hi) / 2)
        fam.child(fam.clock_width, pair).set(hi - lo)

    def _exemplar(self, keep: str | None) -> bool:
        """Whether an observation of a request whose decision is ``keep`` names
        it: only where its spans are stored (under --keep sampled: decided, not ``no``)."""
        return self.exemplars and keep != NOT_KEPT and (self.held is None or keep is not None)

    def _observe_derived(self, traces: dict[str, tuple[str, float | None, str | None]]) -> None:
        """The derived phases of traces just resolved (trace id -> (mode,
        clock offset, keep decision)): ``derived.DERIVED_PHASES``, intervals between two
        processes, which no span processor sees whole, and the wire / noticed
        split of each rank's completion span, into
        ``kvlens_phase_duration_seconds`` like every recorded phase: the
        resolver is the one place that reads the trace back, once per
        request, and only the spans the derivation needs
        (:func:`kvtrace.tracemodel.derived_of`). A ``kv.hold`` over
        :func:`hold_warn_s` counts in ``kvlens_kv_hold_long_total``. One read
        per pass; a failed read skips these for the pass (logged once), never the handoff."""
        try:
            held = self.held([t for t in traces if traces[t][2] == NOT_KEPT]) if self.held is not None else None
            derived = tracemodel.derived_of(self._connection(), {t: v[1] for t, v in traces.items()}, held)
        except Exception as e:
            log_once("handoff-derived:" + type(e).__name__, "derived phases not read (%s); skipped", e)
            return
        fam = self.fam
        hold, ok, warn_s = sc.Phase.KV_HOLD.value, sc.Outcome.OK.value, self.hold_warn_s
        children: dict[tuple, Any] = {}  # (mode, role, phase, outcome) as derived -> child, for this pass
        for tid, ds in derived.items():
            mode, _, keep = traces[tid]
            exemplar = self._exemplar(keep)
            for name, role, start_ns, end_ns, _, outcome in ds:  # splits per rank; kv.hold: its release's outcome
                key = (mode, role, name, outcome)
                child = children.get(key)
                if child is None:  # the closed labels once per pass (sc.closed walks its enum)
                    labels = (mode, sc.closed(role, sc.Role), name, sc.closed(outcome or ok, sc.Outcome))
                    child = children[key] = fam.child(fam.phase, labels)
                duration_s = (end_ns - start_ns) / 1e9
                if exemplar:
                    child.observe(duration_s, {"trace_id": tid})
                else:
                    child.observe(duration_s)
                if name == hold and duration_s > warn_s:
                    fam.child(fam.hold_long, (mode,)).inc()

    def flush(self, timeout_s: float) -> bool:
        """Resolve until nothing is pending or ``timeout_s`` passed (tests, shutdown). Blocks."""
        end = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < end:
            self.resolve_once()
            if self._pending:
                time.sleep(min(self.poll_s, 0.05))
        return not self._pending

    def close(self) -> None:
        """Stop the resolver thread (waits up to 2 s) and drop the connection."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)
        self._close_conn()

    def _close_conn(self) -> None:
        """Drop the read-only store connection (reopened on the next poll)."""
        try:
            if self._conn is not None:
                self._conn.close()
        except Exception:
            pass
        self._conn = None
