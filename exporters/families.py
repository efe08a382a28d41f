"""The Prometheus metric families kvlens exports (names, help, labels,
buckets), created once per (process, registry) and shared by every
processor and resolver of the process (:mod:`exporters.metrics`,
:mod:`exporters.handoff`)."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from exporters.fasthistogram import histogram_class

# ------------------------------------------------------------------ buckets
#: Phases range from a few microseconds (point phases, descriptor prep) to
#: tens of seconds (handshake on a cold start, prefill under load).
PHASE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Handoff: sub-ms (same-host push that overlapped) to seconds (handshake).
HANDOFF_BUCKETS = PHASE_BUCKETS
#: Client TTFT: milliseconds to minutes (queueing under overload).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Client-seen time per output token: under a millisecond (a small model) to seconds (a starved D).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: KV bytes per request: 4 KiB .. 64 GiB in powers of 4 (a block is KiB-MiB).
BYTES_BUCKETS = tuple(float(4096 * 4**i) for i in range(13))
#: NIXL descriptors per request: 1 .. 65536 in powers of 2... of 4 past 64.
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)
#: Gb/s of one rank's transfer: a loopback of a tiny model (~1) .. NVLink (3600, the default ceiling).
GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3600.0)

_DROPPED_HELP = (
    "kvlens spans lost before reaching a sink, by reason: buffer_full (recorder buffer), queue_full "
    "(export queue), store (trace store locked or unwritable), export_failed (OTLP), shutdown "
    "(still queued at exit)."
)


# ------------------------------------------------------------ metric families
_UNJOINED_HELP = (
    "Requests whose trace holds only one side's spans when its handoff was looked up (reason "
    "no_decode_side: P's spans alone; no_prefill_side: D's alone): a router gave P and D unrelated "
    "request ids and no kv_transfer_params link, or a side's spans were lost. Shown in kvlens traces "
    'as half traces (--half). Also counted in kvlens_handoff_unresolved_total{reason="missing"}.'
)


_RANK_HELP = (
    "Duration of a per-rank transfer phase (write/read.post, write/read.complete) on one tensor-parallel rank, "
    "seconds; only engines with TP > 1. Per rank: a request's transfer time is its slowest rank's (the request "
    "waits for the last); rank values 0..63, others _OTHER."
)


_GBPS_HELP = (
    "Bandwidth of one request's transfer on one rank (write/read.complete), Gb/s: kvlens.bytes x 8 / NIXL's "
    "xferDuration (kvlens.nixl_xfer_s, from the post until NIXL saw the transfer complete), per rank; not the "
    "post -> seen-done span. Figures above the link ceiling (KVLENS_LINK_GBPS) are counted in "
    "kvlens_transfer_implausible_total instead."
)
_IMPLAUSIBLE_HELP = (
    "Transfers (one request on one rank) whose bytes / NIXL's xferDuration is above the link ceiling "
    "(KVLENS_LINK_GBPS): NIXL's duration is implausible, so no bandwidth was observed for them."
)
_CPU_WAIT_HELP = (
    "Seconds the thread that ended a phase span was runnable but waiting for a CPU during it (schedstat "
    "run-queue wait: host contention), summed over the spans that carry CPU figures (kvlens.cpu.wait_s; docs/phases.md, "
    "'CPU or wire'). Spans whose figures are unknown (kvlens.cpu.unknown) add nothing here nor to "
    "kvlens_phase_cpu_span_seconds_total."
)
_CPU_ON_HELP = (
    "Seconds the thread that ended a phase span was on a CPU during it (kvlens.cpu.on_s: work, or polling where "
    "the thread spins), summed over the spans that carry CPU figures."
)
_CPU_SPAN_HELP = (
    "Wall-clock seconds of the phase spans that carry CPU figures, each the shortest stretch that holds its "
    "figures: the span, or on-CPU + wait where a busy thread's figures exceed it (they run from its start reading, "
    "kvlens.cpu.gap_s before the span), at most span + gap. The denominator of the CPU-wait share "
    "(kvlens:handoff_cpu_wait_share:ratio_5m); off-CPU = this - cpu - cpu_wait."
)
_HOLD_HELP = (
    "Requests whose P held the KV blocks longer than KVLENS_HOLD_WARN_S (default 5 s) after D's kv.ready "
    "(the kv.hold phase: until D's read-done notification in pull, P's WRITE seen done or the lease's expiry "
    "in push); counted by the handoff resolver."
)


class Families:
    """Metric families of one registry (created once per process and registry).

    Labelled children are bound once and cached by their closed label tuple,
    so the cache is bounded by the product of the closed sets."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        Histogram = histogram_class()  # noqa: N806  (prometheus_client's, cheaper children where it can)
        self.phase = Histogram(
            "kvlens_phase_duration_seconds",
            "Duration of one kvlens phase (span) of a P/D KV handoff, seconds.",
            ("mode", "role", "phase", "outcome"),
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.dropped = Counter("kvlens_telemetry_dropped", _DROPPED_HELP, ("role", "reason"), registry=r)
        self._handoff(r)
        self._router(r)
        self._transfer(r)
        self._push_waiting(r)
        self._cpu(r)
        self.lock = threading.Lock()
        self.children: dict[Any, dict[tuple, Any]] = {}  # metric -> label tuple -> child
        self.drop_seen: dict[Any, int] = {}

    def _handoff(self, r: CollectorRegistry) -> None:
        """The handoff resolver's (exporters.handoff): the critical path read back from the trace store, what it could not resolve, the P/D clock bounds and P's long holds."""
        Histogram = histogram_class()  # noqa: N806
        self.handoff = Histogram(
            "kvlens_handoff_seconds",
            "Critical-path handoff prefill.finished (P) -> kv.ready (D), seconds; read from the trace store.",
            ("mode",),
            buckets=HANDOFF_BUCKETS,
            registry=r,
        )
        self.unresolved = Counter(
            "kvlens_handoff_unresolved",
            "Requests whose handoff is unknown (missing end, clocks not bounded, queue overflow, no store).",
            ("mode", "reason"),
            registry=r,
        )
        self.unjoined = Counter("kvlens_traces_unjoined", _UNJOINED_HELP, ("mode", "reason"), registry=r)
        self.clock_offset = Gauge(
            "kvlens_clock_offset_seconds",
            "Estimated wall-clock offset D minus P (middle of the bounded interval), seconds.",
            ("p_engine", "d_engine"),
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.clock_width = Gauge(
            "kvlens_clock_offset_width_seconds",
            "Width of the interval that must contain the D minus P clock offset, seconds.",
            ("p_engine", "d_engine"),
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.hold_long = Counter("kvlens_kv_hold_long", _HOLD_HELP, ("mode",), registry=r)

    def _router(self, r: CollectorRegistry) -> None:
        """What the kvlens router sees of a request: TTFT, TPOT and the request count."""
        Histogram = histogram_class()  # noqa: N806
        self.ttft = Histogram(
            "kvlens_ttft_seconds",
            "Client-seen time to first token measured at the kvlens router, seconds.",
            ("mode", "dispatch"),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "kvlens_requests", "Requests finished by the kvlens router.", ("mode", "outcome"), registry=r
        )
        self.tpot = Histogram(
            "kvlens_tpot_seconds",
            "Client-seen time per output token after the first, measured at the kvlens router (the root "
            "span's kvlens.tpot_s), seconds; by mode, so a mixed fleet has each mode's.",
            ("mode",),
            buckets=TPOT_BUCKETS,
            registry=r,
        )

    def _transfer(self, r: CollectorRegistry) -> None:
        """NIXL's transfer per rank: bytes, descriptors, bandwidth, the per-rank phases, and KV moved but recomputed."""
        Histogram = histogram_class()  # noqa: N806
        self.xfer_bytes = Histogram(
            "kvlens_transfer_bytes",
            "KV bytes NIXL moved for one request on one rank (write/read.complete), "
            "bytes. Per rank: a TP N engine observes N per request; the request's bytes are their sum.",
            ("mode", "role"),
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.xfer_desc = Histogram(
            "kvlens_transfer_descriptors",
            "NIXL descriptors of one request on one rank (write/read.complete). "
            "Per rank, as kvlens_transfer_bytes: the request's count is their sum.",
            ("mode", "role"),
            buckets=DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.xfer_gbps = Histogram(
            "kvlens_transfer_gbps", _GBPS_HELP, ("mode", "role"), buckets=GBPS_BUCKETS, registry=r
        )
        self.xfer_implausible = Counter("kvlens_transfer_implausible", _IMPLAUSIBLE_HELP, ("mode", "role"), registry=r)
        self.rank_phase = Histogram(
            "kvlens_rank_phase_duration_seconds",
            _RANK_HELP,
            ("mode", "role", "phase", "rank"),
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.kv_recomputed = Counter(
            "kvlens_kv_recomputed",
            "Requests whose D computed more than the prompt's last partial block itself at "
            "its first step after the transfer (kvlens.kv.recomputed_tokens on decode.first_step): KV that moved "
            "but was not used, e.g. a failed load under kv_load_failure_policy=recompute.",
            ("mode",),
            registry=r,
        )

    def _push_waiting(self, r: CollectorRegistry) -> None:
        """Push's waiting gauges on P: registrations not yet matched, prefills waiting for one."""
        self.regs_waiting = Gauge(
            "kvlens_push_registrations_waiting",
            "Push: D registrations received on P and not yet matched with a finished prefill.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefills_waiting = Gauge(
            "kvlens_push_prefills_waiting",
            "Push: finished prefills on P waiting for D's registration.",
            registry=r,
            multiprocess_mode="livesum",
        )

    def _cpu(self, r: CollectorRegistry) -> None:
        """The phases' CPU figures (kvlens.cpu.*: docs/phases.md, "CPU or wire")."""
        labels = ("mode", "role", "phase")
        self.cpu_wait = Counter("kvlens_phase_cpu_wait_seconds", _CPU_WAIT_HELP, labels, registry=r)
        self.cpu_on = Counter("kvlens_phase_cpu_seconds", _CPU_ON_HELP, labels, registry=r)
        self.cpu_span = Counter("kvlens_phase_cpu_span_seconds", _CPU_SPAN_HELP, labels, registry=r)

    def child(self, metric, key: tuple):
        """Cached labelled child of ``metric`` for the closed label tuple ``key``."""
        cache = self.children.get(metric)
        if cache is None:
            with self.lock:
                cache = self.children.setdefault(metric, {})
        c = cache.get(key)
        if c is None:
            with self.lock:
                c = cache.get(key)
                if c is None:
                    c = metric.labels(*key)
                    cache[key] = c
        return c


_families: dict[int, tuple[CollectorRegistry, Families]] = {}
_families_lock = threading.Lock()


def families_for(registry: CollectorRegistry) -> Families:
    key = id(registry)
    with _families_lock:
        hit = _families.get(key)
        if hit is not None and hit[0] is registry:
            return hit[1]
        fam = Families(registry)
        _families[key] = (registry, fam)
        return fam
