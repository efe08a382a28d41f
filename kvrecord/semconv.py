"""kvlens semantic conventions: the one closed vocabulary of phases, roles,
modes, outcomes and attribute keys. Everything that names a span, a label or
an attribute imports it from here (docs/architecture.md, "names in one place").

Cardinality: every enum here is a small closed set and may be used as a
Prometheus label; request and trace ids are attributes only, never labels.
"""

from __future__ import annotations

import enum
from typing import Final

from kvrecord.words import PHASE_WORDS as _PHASE_WORDS


class Phase(str, enum.Enum):
    """Span names. The value is the OTel span name and the ``phase`` label.

    Listed in the order a request meets them (the display order of
    waterfalls and of the per-phase breakdown). Each docstring says exactly
    which interval the phase is; "derived" phases are not recorded by any
    process: :mod:`kvtrace.tracemodel` builds them from two recorded
    timestamps (:data:`DERIVED_PHASES`), where no one process sees both ends.
    """

    # router (kvlens proxy)
    REQUEST = "request"
    """Root span: router arrival -> last byte to the client. Attr ``ttft_s``."""

    # P side (both modes)
    PREFILL = "prefill"
    """P scheduler: request arrival -> prefill done (queue + prefill compute)."""
    PREFILL_FINISHED = "prefill.finished"
    """P scheduler, point: ``request_finished`` handed the blocks to the connector."""
    PREFILL_RESPOND = "prefill.respond"
    """Derived (:data:`DERIVED_PHASES`): P ``prefill.finished`` -> the router
    received P's response (``relay`` start). P's output path: EngineCore ->
    API server (detokenize, HTTP response) -> the router. Pull and sequential
    push; the router's clock is taken as P's (docs/phases.md)."""

    # router -> D (pull, sequential push)
    RELAY = "relay"
    """Router: P's response received -> D's request sent (pull, sequential push)."""
    DECODE_INTAKE = "decode.intake"
    """Derived (:data:`DERIVED_PHASES`): the router sent D's request (``relay``
    end) -> D's frontend stamped the request's arrival (``decode.queue``
    start): HTTP transit and request parsing on D. Pull and sequential push."""
    ROUTER_HOP = "router.hop"
    """Derived (:data:`DERIVED_PHASES`), only where the trace has no
    ``relay`` span (a router other than kvlens', e.g. vLLM's ``vllm-router``):
    P ``prefill.finished`` -> D's frontend stamped the request's arrival
    (``decode.queue`` start). The whole hop between the engines in one
    phase: P's output path and HTTP response, the router, D's HTTP intake.
    Pull and sequential push; on P's clock (D's end moved by the store's
    clock offset)."""
    DECODE_QUEUE = "decode.queue"
    """D scheduler (EngineCore), both modes: the request's arrival (vLLM's
    ``Request.arrival_time``, stamped by D's frontend when it starts rendering
    the prompt) -> D's scheduler allocated its blocks (``alloc`` in pull,
    ``registration.stage`` in push): tokenizing, the frontend -> EngineCore
    hop and the wait for a scheduler step. Overlap in overlapped push (D gets
    its request together with P)."""

    # push, D side
    REGISTRATION_STAGE = "registration.stage"
    """D scheduler, point: D allocated and staged its destination blocks."""
    REGISTRATION_DISPATCH = "registration.dispatch"
    """Derived (:data:`DERIVED_PHASES`), push: D ``registration.stage`` (D's
    scheduler) -> D's writer thread dequeued the registration
    (``registration.send`` start): D's next engine step carrying it to the
    worker and D's writer thread waking up for it."""
    REGISTRATION_SEND = "registration.send"
    """D writer thread: staged registration dequeued -> PUSH_REG notif sent."""
    # push, P side
    REGISTRATION_RECEIVE = "registration.receive"
    """P writer thread, point: D's PUSH_REG notif decoded on P."""
    PREFILL_DISPATCH = "prefill.dispatch"
    """Derived (:data:`DERIVED_PHASES`), push: P ``prefill.finished`` (P's
    scheduler) -> P's worker handed the finished blocks to its writer thread
    (``writer.wake`` start): P's next engine step carrying them to the worker."""
    WRITER_WAKE = "writer.wake"
    """P worker, push: the engine thread queued the finished blocks for the
    writer thread (``start_load_kv``) -> the writer thread took them
    (``_pop_matching_registration``). The writer thread's wake-up lag, apart
    from waiting for D (``match``)."""
    MATCH = "match"
    """P worker, push: waiting for the other side. The first of (D's
    registration decoded by the writer thread, P's finished blocks queued for
    the writer by the engine thread in ``start_load_kv``) -> the second of
    them. ``kvlens.match.first`` says which came first."""

    # pull, D side
    ALLOC = "alloc"
    """D scheduler, point: blocks allocated for the remote prefill."""
    DECODE_DISPATCH = "decode.dispatch"
    """Derived (:data:`DERIVED_PHASES`), pull: D ``alloc`` (D's scheduler) ->
    D's worker starts on the request (``handshake`` or ``descriptor.prep``
    start): the scheduler step's output reaching D's worker."""

    # the transfer (push: P WRITEs; pull: D READs)
    HANDSHAKE = "handshake"
    """NIXL handshake wait on the request's path (P->D push, D->P pull)."""
    DESCRIPTOR_PREP = "descriptor.prep"
    """Block-id mapping and ReadSpec build before the first transfer post."""
    WRITE_POST = "write.post"
    """P: descriptor ids + ``make_prepped_xfer`` + ``transfer`` for every rank."""
    WRITE_COMPLETE = "write.complete"
    """P: WRITE posted -> transfer state DONE observed by the engine thread
    (the wire and the wait for vLLM's next poll together)."""
    WRITE_WIRE = "write.wire"
    """Derived (:class:`Split`), push, per rank: ``write.complete`` start -> + NIXL's
    ``kvlens.nixl_xfer_s``, clipped to it. NIXL times a transfer from its post:
    true on our clock to within the post's own length (``write.post``)."""
    WRITE_NOTICED = "write.noticed"
    """Derived (:class:`Split`), push, per rank: ``write.wire`` end -> ``write.complete`` end (vLLM noticing)."""
    WRITE_NOTIFY = "write.notify"
    """Derived (:data:`DERIVED_PHASES`), push: P saw its WRITE done
    (``write.complete`` end) -> D reported the KV ready (``kv.ready``): D
    learning of the completion (the NIXL notification drained by D's writer
    thread, handed to D's engine thread, reported on D's next step)."""
    READ_POST = "read.post"
    """D: descriptor ids + ``make_prepped_xfer`` + ``transfer`` for every rank."""
    READ_COMPLETE = "read.complete"
    """D: READ posted -> transfer state DONE observed (wire + noticing)."""
    READ_WIRE = "read.wire"
    """Derived (:class:`Split`), pull, per rank: as ``write.wire``, of ``read.complete``."""
    READ_NOTICED = "read.noticed"
    """Derived (:class:`Split`), pull, per rank: as ``write.noticed``, of ``read.complete``."""
    # pull, P side
    KV_RELEASED = "kv.released"
    """P worker, point: D's read-done notification received (P frees the
    blocks). Off the critical path; it bounds the P/D clock offset."""

    # D side, both modes
    KV_READY = "kv.ready"
    """D worker, point: request reported in ``finished_recving``."""
    KV_HOLD = "kv.hold"
    """Derived, P: D's ``kv.ready`` -> P's last release (``kv.released``, ``write.complete``
    end, or the lease's ``expired`` point), where it is later. After the handoff:
    off the critical path, but P's memory. Its outcome is the release's."""
    DECODE_FIRST_STEP = "decode.first_step"
    """D scheduler, after the handoff: the first engine step that schedules
    the request once its KV arrived (``build_connector_meta``) -> that step's
    output reached the scheduler (``update_connector_output``): D sampled
    the first token. Its end is D's first token, the end of the TTFT kvlens
    proves from the engines' own timestamps (``kvlens.ttft.source =
    engines``) where no kvlens router measured it at the client."""


PUSH_PHASES: Final = (
    Phase.PREFILL_FINISHED,
    Phase.DECODE_QUEUE,
    Phase.REGISTRATION_STAGE,
    Phase.REGISTRATION_SEND,
    Phase.REGISTRATION_RECEIVE,
    Phase.WRITER_WAKE,
    Phase.MATCH,
    Phase.DESCRIPTOR_PREP,
    Phase.WRITE_POST,
    Phase.WRITE_COMPLETE,
    Phase.KV_READY,
)
"""Recorded phases every completed push request must have (``handshake`` only
on first contact; ``writer.wake`` only where P's finished blocks went through
the writer's inbox, which is every request on this vLLM)."""

PULL_PHASES: Final = (
    Phase.PREFILL_FINISHED,
    Phase.DECODE_QUEUE,
    Phase.ALLOC,
    Phase.DESCRIPTOR_PREP,
    Phase.READ_POST,
    Phase.READ_COMPLETE,
    Phase.KV_READY,
)
"""Phases every completed pull request must have (``relay`` when routed by kvlens)."""

#: Phases that, in push mode, run while P is still computing: shown as
#: overlap, not as handoff cost (docs/phases.md, "Critical path").
PUSH_OVERLAP_PHASES: Final = frozenset(
    {
        Phase.DECODE_QUEUE,
        Phase.REGISTRATION_STAGE,
        Phase.REGISTRATION_DISPATCH,
        Phase.REGISTRATION_SEND,
        Phase.REGISTRATION_RECEIVE,
    }
)

#: Phases that only say one side waits for the other (P's writer for D's
#: registration, or for its own finished blocks). When the handoff is split
#: among overlapping phases (``kvtrace.tiling.tile``) they get only the
#: time no other phase names: what they wait for is the better name.
WAITING_PHASES: Final = frozenset({Phase.MATCH})

#: Point phases: recorded as zero-length spans (start == end).
POINT_PHASES: Final = frozenset(
    {
        Phase.PREFILL_FINISHED,
        Phase.REGISTRATION_STAGE,
        Phase.REGISTRATION_RECEIVE,
        Phase.ALLOC,
        Phase.KV_READY,
        Phase.KV_RELEASED,
    }
)


PHASE_ORDER: Final = {p.value: i for i, p in enumerate(Phase)}
"""Display order of phases (waterfalls, tables)."""

PHASE_WORDS: Final[dict[str, str]] = _PHASE_WORDS
"""Every phase in a few words (:mod:`kvrecord.words`)."""


class Mode(str, enum.Enum):
    PUSH = "push"
    PULL = "pull"


class Role(str, enum.Enum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


class Outcome(str, enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    FAILED = "failed"
    EXPIRED = "expired"
    STALE = "stale"
    """KV read (pull) or written / notified (push) after P released its blocks
    (P's lease ran out first): the answer may come from reused memory (docs/handoff-health.md)."""


class TtftSource(str, enum.Enum):
    """Values of :data:`ATTR_TTFT_SOURCE` (and the store's ``ttft_source``)."""

    ROUTER = "router"
    ENGINES = "engines"


class Dispatch(str, enum.Enum):
    OVERLAPPED = "overlapped"
    SEQUENTIAL = "sequential"


OTHER: Final = "_OTHER"
"""Label value for anything outside a closed set."""


def closed(value: object, enum_cls: type[enum.Enum]) -> str:
    """Map ``value`` into ``enum_cls``'s values, or ``_OTHER`` (bounded labels)."""
    v = getattr(value, "value", value)
    for member in enum_cls:
        if member.value == v:
            return v  # type: ignore[return-value]
    return OTHER


#: Messages that cross between P and D, by (role, span name) -> (column,
#: which end of the span). They bound the P/D clock offset
#: (:mod:`kvtrace.clockbounds`; docs/phases.md "Clocks across hosts"):
#: ``d2p_*`` a message from D to P, ``p2d_*`` one from P to D; ``sent`` is
#: taken before the message left, ``recv`` after it arrived. ``kv.ready`` and
#: ``prefill.finished`` count only in the mode named.
CROSSINGS: Final = {
    ("decode", Phase.REGISTRATION_SEND.value, None): ("d2p_sent_ns", "start"),  # push: PUSH_REG notif
    ("prefill", Phase.REGISTRATION_RECEIVE.value, None): ("d2p_recv_ns", "end"),
    ("prefill", Phase.WRITE_POST.value, None): ("p2d_sent_ns", "start"),  # push: WRITE + its notif
    ("decode", Phase.KV_READY.value, "push"): ("p2d_recv_ns", "end"),
    ("decode", Phase.READ_POST.value, None): ("d2p_sent_ns", "start"),  # pull: READ + done notif
    ("prefill", Phase.KV_RELEASED.value, None): ("d2p_recv_ns", "end"),
    ("prefill", Phase.PREFILL_FINISHED.value, "pull"): ("p2d_sent_ns", "end"),  # pull: P's answer -> D's request
    ("decode", Phase.ALLOC.value, None): ("p2d_recv_ns", "end"),
}


# --- attribute keys -------------------------------------------------------
ATTR_MODE: Final = "kvlens.mode"
"""push | pull. Cardinality 2."""
ATTR_ROLE: Final = "kvlens.role"
"""router | prefill | decode. Cardinality 3."""
ATTR_DISPATCH: Final = "kvlens.dispatch"
"""overlapped | sequential (router spans). Cardinality 2."""
ATTR_OUTCOME: Final = "kvlens.outcome"
"""ok | timeout | failed | expired. Cardinality 4."""
ATTR_REQUEST_ID: Final = "kvlens.request_id"
"""vLLM request id on this side (unbounded: span attribute only)."""
ATTR_ENGINE_ID: Final = "kvlens.engine_id"
"""This instance's kv_transfer_config.engine_id."""
ATTR_REMOTE_ENGINE_ID: Final = "kvlens.remote_engine_id"
"""The peer instance's engine id."""
ATTR_REMOTE_RANK: Final = "kvlens.remote_rank"
"""Peer TP rank a transfer targeted (first one when several)."""
ATTR_REMOTE_RANKS: Final = "kvlens.remote_ranks"
"""Every peer TP rank this rank's posts for the request targeted (vLLM's ``tp_mapping``)."""
ATTR_RANK: Final = "kvlens.rank"
"""This worker's tensor-parallel rank (every worker-side span of an engine with TP > 1; absent: the only rank)."""
ATTR_TP_SIZE: Final = "kvlens.tp_size"
"""The engine's tensor-parallel size, on worker-side spans."""
ATTR_BLOCKS: Final = "kvlens.blocks"
"""Number of KV blocks (logical, summed over cache groups)."""
ATTR_BYTES: Final = "kvlens.bytes"
"""Bytes moved by NIXL for this request (NIXL telemetry), unit bytes."""
ATTR_DESCRIPTORS: Final = "kvlens.descriptors"
"""NIXL descriptor count for this request's transfers."""
ATTR_NIXL_XFER_S: Final = "kvlens.nixl_xfer_s"
"""NIXL's own xferDuration for the request's transfers on this rank, seconds
(summed; measured by NIXL from each post: the ``*.wire`` phases)."""
ATTR_CPU_ON_S: Final = "kvlens.cpu.on_s"
"""Seconds the thread that ended this phase spent on a CPU during it
(schedstat: :mod:`kvrecord.cpuclock`); absent where unknown (``kvlens.cpu.unknown``)."""
ATTR_CPU_WAIT_S: Final = "kvlens.cpu.wait_s"
"""Seconds that thread was runnable but waiting for a CPU during the phase
(host contention); the rest of the phase (wall - on - wait) it was off-CPU."""
ATTR_CPU_GAP_S: Final = "kvlens.cpu.gap_s"
"""How long before the phase's start the thread's start reading was taken
(a blocked thread's counters do not move; a busy one's include that stretch)."""
ATTR_CPU_BEFORE_AGE_S: Final = "kvlens.cpu.before.age_s"
"""The recording thread's readings before the event's start: their ages,
seconds, youngest first (with the two lists below: a derived phase ending at
this event takes its CPU figures from here, :mod:`kvtrace.cpusplit`)."""
ATTR_CPU_BEFORE_ON_S: Final = "kvlens.cpu.before.on_s"
"""On-CPU seconds from each of those readings up to the event's start."""
ATTR_CPU_BEFORE_WAIT_S: Final = "kvlens.cpu.before.wait_s"
"""CPU wait seconds from each of those readings up to the event's start."""
ATTR_CPU_BEFORE_TID: Final = "kvlens.cpu.before.tid"
"""The Linux thread id those readings are of: the thread that stamped the
event's start (a derived phase ending there is walked back from it in the
kernel's scheduler record, :mod:`kvtrace.schedtrace`)."""
ATTR_CPU_BEFORE_RUNS: Final = "kvlens.cpu.before.runs"
"""How many times the thread was put on a CPU from each of those readings up to
the event's start (schedstat's run count; -1: no reading at the start itself).
One run means the thread ran once, without a break, up to the start: its wait
lies just before that run, which places it in time (:mod:`kvtrace.cpusplit`)."""
ATTR_CPU_UP_LANDED_LO_S: Final = "kvlens.cpu.up.landed.lo_s"
"""The upstream thread's wait (``kvlens.cpu.up.pid``'s main thread: an
EngineCore's API server) before this event, by where it landed: for each pair
of per-step readings between which it grew, youngest first, the older's age
before the event's end, seconds (with the two lists below; a derived phase
in that thread's path places it from these bounds, :mod:`kvtrace.cpusplit`)."""
ATTR_CPU_UP_LANDED_HI_S: Final = "kvlens.cpu.up.landed.hi_s"
"""The newer reading's age of each such pair, seconds."""
ATTR_CPU_UP_LANDED_WAIT_S: Final = "kvlens.cpu.up.landed.wait_s"
"""The wait that ended between each such pair of readings, seconds."""
ATTR_CPU_UP_LANDED_NEWEST_S: Final = "kvlens.cpu.up.landed.newest_s"
"""The newest of those readings' age before the event's end, seconds: a phase
ending after it is not covered (a wait still running then had not landed)."""
ATTR_CPU_UP_WAIT_S: Final = "kvlens.cpu.up.wait_s"
"""CPU wait of the thread this process's engine waits on, blocked, during the
phase (a vLLM worker's EngineCore thread; an EngineCore's API server), seconds,
from readings once per engine step: contention that shows as the ending
thread's off-CPU time (:mod:`kvtrace.cpusplit` adds it, capped)."""
ATTR_CPU_UP_PID: Final = "kvlens.cpu.up.pid"
"""The process whose main thread ``kvlens.cpu.up.wait_s`` is of."""
ATTR_CPU_NOTICED_ON_S: Final = "kvlens.cpu.noticed.on_s"
"""Wire phases: the ending thread's on-CPU seconds after NIXL's transfer ended
(start + ``kvlens.nixl_xfer_s`` -> the span's end: ``*.noticed``)."""
ATTR_CPU_NOTICED_WAIT_S: Final = "kvlens.cpu.noticed.wait_s"
"""Wire phases: the ending thread's CPU wait (plus its upstream thread's, capped)
after NIXL's transfer ended: the engine loop late to notice DONE for want of a CPU."""
ATTR_CPU_TID: Final = "kvlens.cpu.tid"
"""The Linux thread id the CPU figures are of (host-local)."""
ATTR_CPU_UNKNOWN: Final = "kvlens.cpu.unknown"
"""Why this phase carries no CPU figures (schedstat missing, no reading at its start)."""
ATTR_CPU_PROGRESS_ON_S: Final = "kvlens.cpu.progress.on_s"
"""Wire phases: NIXL's UCX progress thread's on-CPU seconds during the phase
(it spins: on-CPU includes polling; summed over its progress threads)."""
ATTR_CPU_PROGRESS_WAIT_S: Final = "kvlens.cpu.progress.wait_s"
"""Wire phases: the progress thread's run-queue wait during the phase, seconds."""
ATTR_CPU_PROGRESS_SPINS: Final = "kvlens.cpu.progress.spins"
"""Wire phases: True where the progress thread polls without sleeping (its
wire time is on-CPU plus off-CPU; only its CPU wait is contention)."""
ATTR_CPU_PSI_SOME_S: Final = "kvlens.cpu.psi_some_s"
"""The host's CPU pressure (PSI ``some``) during the phase, seconds: time at
least one runnable task on the host waited for a CPU."""
ATTR_MATCH_FIRST: Final = "kvlens.match.first"
"""Which side reached P's writer first: registration | prefill."""
ATTR_TOKENS: Final = "kvlens.tokens"
"""Prompt tokens (count only; never text)."""
ATTR_KV_RECOMPUTED_TOKENS: Final = "kvlens.kv.recomputed_tokens"
"""D: prompt tokens D computed itself at its first step (not from the transfer)."""
ATTR_BLOCK_SIZE: Final = "kvlens.block_size"
"""D: the engine's KV block size in tokens (what a partial last block is short of)."""
ATTR_TTFT_S: Final = "kvlens.ttft_s"
"""Client-seen time to first token measured at the router, seconds."""
ATTR_TPOT_S: Final = "kvlens.tpot_s"
"""Router root span: the client-seen time per output token after the first,
seconds (read by ``kvlens verdict``; a router that does not record it leaves
the verdict's TPOT unknown)."""
ATTR_SPLIT: Final = "kvlens.split"
"""Router root span: the push weight of the split that assigned this
request's mode at random (``kvlens proxy --split push=W``), so a canary's
traces are told from a benchmark's or a single-mode stack's. Absent: the
mode was the stack's, not a draw."""
ATTR_TTFT_SOURCE: Final = "kvlens.ttft.source"
"""Where a trace's TTFT comes from (:class:`TtftSource`): ``router`` (kvlens'
router, client-seen) or ``engines`` (P's arrival -> D's first token, on P's
clock with the handoff's clock bound)."""
ATTR_JOIN_REQUEST_ID: Final = "kvlens.join.request_id"
"""D side: P's vLLM request id, from the ``remote_request_id`` of the
``kv_transfer_params`` D received. The span's trace is derived from it
instead of D's own request id (docs/phases.md, "Trace correlation"), so P's
and D's spans of one request join whatever router sent them."""
ATTR_STATUS_CODE: Final = "http.response.status_code"
"""HTTP status the router returned."""
ATTR_DEFERRED: Final = "kvlens.deferred"
"""True when the step waited for a NIXL handshake first."""
ATTR_CLIENT_REQUEST_ID: Final = "kvlens.client.request_id"
"""Router root span: the client's ``X-Request-Id`` when the router used another id (clipped)."""
ATTR_CLIENT_TRACE_ID: Final = "kvlens.client.trace_id"
"""Router root span: the client's ``traceparent`` trace id when the router used another id."""
ATTR_PREFILL_URL: Final = "kvlens.prefill.url"
"""Router root span: base URL of the P instance the router sent the request to."""
ATTR_PREFILL_ENGINE_ID: Final = "kvlens.prefill.engine_id"
"""Router root span: that P's engine id as the router knows it (``kvlens proxy --prefill-engine-id``)."""
ATTR_DECODE_URL: Final = "kvlens.decode.url"
"""Router root span: base URL of the D instance the router sent the request to."""
ATTR_DECODE_ENGINE_ID: Final = "kvlens.decode.engine_id"
"""Router root span: that D's engine id as the router knows it (``kvlens proxy --decode-engine-id``)."""
ATTR_DERIVED: Final = "kvlens.derived"
"""True on a phase :mod:`kvtrace.tracemodel` derived from two recorded
timestamps (:data:`DERIVED_PHASES`); never on a recorded span."""
ATTR_ERROR: Final = "kvlens.error"
"""Short error text for failed outcomes (exception class and message)."""


# --- handoff health (docs/handoff-health.md) -----------------------------------------
SPAN_HANDOFF_OPEN: Final = "handoff.open"
"""Span name of a partial trace: a handoff still open on one side, written
out by that process's background thread once it has been open longer than
``open_trace_after_s``; start = the handoff's start on that side, end = the
snapshot time. Re-emitted (a new span) while it stays open; readers take the
latest and hide them once the trace has ended on that side. Never a phase
(no ``kvlens_phase_duration_seconds`` series)."""
ATTR_OPEN: Final = "kvlens.open"
"""True on a ``handoff.open`` span: the handoff had not ended at its end time."""
ATTR_OPEN_PHASE: Final = "kvlens.open.phase"
"""``handoff.open``: the phase the handoff waits in (:class:`OpenPhase` value). Cardinality 6."""
ATTR_KV_STALE: Final = "kvlens.kv.stale"
"""True where KV moved after P released its blocks (outcome ``stale``)."""
ATTR_KV_STALE_SEEN_BY: Final = "kvlens.kv.stale.seen_by"
"""``prefill`` | ``decode``: the side that saw the late read / write / notification."""
ATTR_REGISTRATION_TIMEOUT: Final = "kvlens.registration_timeout"
"""True on D's ``kv.ready`` (and ``handoff.open``) of a push request whose
registration hit vLLM's soft watchdog (``push_registration_timeout``) while
the request kept waiting."""
ATTR_REGISTRATION_TIMEOUT_WAIT_S: Final = "kvlens.registration_timeout.wait_after_s"
"""Seconds D kept waiting after the watchdog fired, to ``kv.ready`` (or the snapshot of ``handoff.open``)."""
ATTR_OPEN_BLOCKS: Final = "kvlens.open.blocks"
"""``handoff.open``: KV blocks the open handoff holds on this side (0: unknown)."""

# the open phases and pinned states (closed label sets), defined beside their use:
from kvrecord.handoffhealthnames import OPEN_PHASES, PINNED_MODE, PINNED_OF, OpenPhase, PinnedState  # noqa: E402,F401
