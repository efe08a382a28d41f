"""kvlens semantic conventions: the one closed vocabulary of phases, roles,
modes, outcomes and attribute keys. Everything that names a span, a label or
an attribute imports it from here (docs/architecture.md, "names in one place").

Cardinality: every enum here is a small closed set and may be used as a
Prometheus label; request and trace ids are attributes only, never labels.
"""

from __future__ import annotations

import enum
from typing import Final


class Phase(str, enum.Enum):
    """Span names. The value is the OTel span name and the ``phase`` label."""

    # router (kvlens proxy)
    REQUEST = "request"
    """Root span: router arrival -> last byte to the client. Attr ``ttft_s``."""
    RELAY = "relay"
    """Router: P's response received -> D's request sent (pull, sequential push)."""

    # P side (both modes)
    PREFILL = "prefill"
    """P scheduler: request arrival -> prefill done (queue + prefill compute)."""
    PREFILL_FINISHED = "prefill.finished"
    """P scheduler, point: ``request_finished`` handed the blocks to the connector."""

    # push, D side
    REGISTRATION_STAGE = "registration.stage"
    """D scheduler, point: D allocated and staged its destination blocks."""
    REGISTRATION_SEND = "registration.send"
    """D writer thread: staged registration dequeued -> PUSH_REG notif sent."""
    # push, P side
    REGISTRATION_RECEIVE = "registration.receive"
    """P writer thread, point: D's PUSH_REG notif decoded on P."""
    MATCH = "match"
    """P writer thread: first of (registration, finished blocks) seen -> both seen."""
    HANDSHAKE = "handshake"
    """NIXL handshake wait on the request's path (P->D push, D->P pull)."""
    DESCRIPTOR_PREP = "descriptor.prep"
    """Block-id mapping and ReadSpec build before the first transfer post."""
    WRITE_POST = "write.post"
    """P: descriptor ids + ``make_prepped_xfer`` + ``transfer`` for every rank."""
    WRITE_COMPLETE = "write.complete"
    """P: WRITE posted -> transfer state DONE observed by the engine thread."""

    # pull, D side
    ALLOC = "alloc"
    """D scheduler, point: blocks allocated for the remote prefill."""
    READ_POST = "read.post"
    """D: descriptor ids + ``make_prepped_xfer`` + ``transfer`` for every rank."""
    READ_COMPLETE = "read.complete"
    """D: READ posted -> transfer state DONE observed."""
    # pull, P side
    KV_RELEASED = "kv.released"
    """P worker, point: D's read-done notification received (P frees the
    blocks). Off the critical path; it bounds the P/D clock offset."""

    # D side, both modes
    KV_READY = "kv.ready"
    """D worker, point: request reported in ``finished_recving``."""


PUSH_PHASES: Final = (
    Phase.PREFILL_FINISHED,
    Phase.REGISTRATION_STAGE,
    Phase.REGISTRATION_SEND,
    Phase.REGISTRATION_RECEIVE,
    Phase.MATCH,
    Phase.DESCRIPTOR_PREP,
    Phase.WRITE_POST,
    Phase.WRITE_COMPLETE,
    Phase.KV_READY,
)
"""Phases every completed push request must have (``handshake`` only on first contact)."""

PULL_PHASES: Final = (
    Phase.PREFILL_FINISHED,
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
    {Phase.REGISTRATION_STAGE, Phase.REGISTRATION_SEND, Phase.REGISTRATION_RECEIVE}
)

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
#: (:mod:`exporters.clockbounds`; docs/phases.md "Clocks across hosts"):
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
ATTR_BLOCKS: Final = "kvlens.blocks"
"""Number of KV blocks (logical, summed over cache groups)."""
ATTR_BYTES: Final = "kvlens.bytes"
"""Bytes moved by NIXL for this request (NIXL telemetry), unit bytes."""
ATTR_DESCRIPTORS: Final = "kvlens.descriptors"
"""NIXL descriptor count for this request's transfers."""
ATTR_NIXL_XFER_S: Final = "kvlens.nixl_xfer_s"
"""NIXL's own xferDuration for the request's transfers, seconds (summed)."""
ATTR_MATCH_FIRST: Final = "kvlens.match.first"
"""Which side reached P's writer first: registration | prefill."""
ATTR_TOKENS: Final = "kvlens.tokens"
"""Prompt tokens (count only; never text)."""
ATTR_TTFT_S: Final = "kvlens.ttft_s"
"""Client-seen time to first token measured at the router, seconds."""
ATTR_STATUS_CODE: Final = "http.response.status_code"
"""HTTP status the router returned."""
ATTR_DEFERRED: Final = "kvlens.deferred"
"""True when the step waited for a NIXL handshake first."""
ATTR_CLIENT_REQUEST_ID: Final = "kvlens.client.request_id"
"""Router root span: the client's ``X-Request-Id`` when the router used another id (clipped)."""
ATTR_CLIENT_TRACE_ID: Final = "kvlens.client.trace_id"
"""Router root span: the client's ``traceparent`` trace id when the router used another id."""
ATTR_ERROR: Final = "kvlens.error"
"""Short error text for failed outcomes (exception class and message)."""
