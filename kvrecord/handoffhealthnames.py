"""Closed label sets of handoff health (docs/handoff-health.md): where an open handoff
waits, and the states of KV pinned on P. Re-exported by
:mod:`kvrecord.semconv`, the one place names are read from."""

from __future__ import annotations

import enum
from typing import Final


class OpenPhase(str, enum.Enum):
    """Where an open handoff waits, per (mode, side): the ``phase`` label of
    ``kvlens_handoffs_open`` and ``kvlens_handoff_oldest_open_start_timestamp_seconds``."""

    AWAITING_KV = "awaiting_kv"
    """Push D: blocks staged (``registration.stage``) -> P's WRITE reported done (``kv.ready``)."""
    READING = "reading"
    """Pull D: blocks allocated (``alloc``) -> D's READ done (``kv.ready``)."""
    AWAITING_READ = "awaiting_read"
    """Pull P: prefill finished, blocks held (``prefill.finished``) -> D's read-done notification or the lease."""
    AWAITING_REGISTRATION = "awaiting_registration"
    """Push P: finished blocks reached the worker -> D's registration matched them (or the lease)."""
    AWAITING_PREFILL = "awaiting_prefill"
    """Push P: D's registration received -> P's finished blocks matched it."""
    WRITING = "writing"
    """Push P: matched (WRITE posted or waiting for the handshake) -> WRITE done (or the lease)."""


#: The phases each (mode, role) side waits in.
OPEN_PHASES: Final = {
    ("push", "decode"): (OpenPhase.AWAITING_KV,),
    ("pull", "decode"): (OpenPhase.READING,),
    ("pull", "prefill"): (OpenPhase.AWAITING_READ,),
    ("push", "prefill"): (OpenPhase.AWAITING_REGISTRATION, OpenPhase.AWAITING_PREFILL, OpenPhase.WRITING),
}


class PinnedState(str, enum.Enum):
    """The ``state`` label of the pinned-KV gauges (KV held on P waiting for D)."""

    AWAITING_READ = "awaiting_read"
    """Pull: finished, blocks held for D's READ."""
    UNREGISTERED_PREFILL = "unregistered_prefill"
    """Push: finished blocks without a D registration."""
    UNMATCHED_REGISTRATION = "unmatched_registration"
    """Push: a D registration without finished blocks (the blocks counted are D's, staged for the WRITE)."""


#: Open phase -> the pinned state it is.
PINNED_OF: Final = {
    OpenPhase.AWAITING_READ: PinnedState.AWAITING_READ,
    OpenPhase.AWAITING_REGISTRATION: PinnedState.UNREGISTERED_PREFILL,
    OpenPhase.AWAITING_PREFILL: PinnedState.UNMATCHED_REGISTRATION,
}
#: Pinned state -> its mode.
PINNED_MODE: Final = {
    PinnedState.AWAITING_READ: "pull",
    PinnedState.UNREGISTERED_PREFILL: "push",
    PinnedState.UNMATCHED_REGISTRATION: "push",
}
