"""The phases no process records, and how each is derived: from two
recorded timestamps (a pair of :class:`Boundary`), or cut from a span by its
duration attribute (:class:`Split`). Vocabulary, like :mod:`kvrecord.semconv`;
the arithmetic is :mod:`kvtrace.tiling`'s."""

from __future__ import annotations

from typing import Final, NamedTuple

from kvrecord.semconv import ATTR_NIXL_XFER_S, Phase


class Boundary(NamedTuple):
    """One end of a derived phase: the ``start`` or ``end`` of the span
    ``phase`` recorded by ``role``."""

    role: str
    phase: Phase
    end: str  # "start" | "end"


class Split(NamedTuple):
    """A phase cut from each ``phase`` span by its duration attribute ``attr`` (s, from the
    start): ``head`` [start, start + d], else [start + d, end], clipped; none where d is 0 or missing."""

    phase: Phase
    attr: str
    head: bool


class Derivation(NamedTuple):
    """How a derived phase is built: the side whose work it is (its lane in
    the waterfall), the (from, to) boundary pairs to try, in order, and a
    recorded phase whose presence means the interval is better named by
    others (``unless``: ``router.hop`` only where there is no ``relay``). ``latest``: every
    pair counts, ending at the latest ``to``. ``split``: cut from a span instead (no pairs)."""

    role: str
    pairs: tuple[tuple[Boundary, Boundary], ...]
    unless: "Phase | None" = None
    latest: bool = False
    split: "Split | None" = None


#: Phases no process records: :mod:`kvtrace.tracemodel` derives each from
#: two recorded timestamps (``from`` -> ``to``, the first pair whose ends a
#: trace both has), where no one process sees the whole interval. They are
#: shown and counted like recorded phases (waterfall, breakdown), carry
#: ``kvlens.derived = true`` in ``kvlens traces --json``, and reach
#: ``kvlens_phase_duration_seconds`` through the handoff resolver. A ``split``
#: phase is cut from each span it names instead (per rank).
#: D's ends are on P's clock by then (the store's clock offset); the
#: router's clock is taken as P's (docs/phases.md, "Clocks across hosts").
DERIVED_PHASES: Final[dict[Phase, Derivation]] = {
    Phase.PREFILL_RESPOND: Derivation(
        "prefill", ((Boundary("prefill", Phase.PREFILL_FINISHED, "end"), Boundary("router", Phase.RELAY, "start")),)
    ),
    Phase.DECODE_INTAKE: Derivation(
        "decode", ((Boundary("router", Phase.RELAY, "end"), Boundary("decode", Phase.DECODE_QUEUE, "start")),)
    ),
    Phase.ROUTER_HOP: Derivation(
        "router",
        ((Boundary("prefill", Phase.PREFILL_FINISHED, "end"), Boundary("decode", Phase.DECODE_QUEUE, "start")),),
        unless=Phase.RELAY,
    ),
    Phase.REGISTRATION_DISPATCH: Derivation(
        "decode",
        ((Boundary("decode", Phase.REGISTRATION_STAGE, "end"), Boundary("decode", Phase.REGISTRATION_SEND, "start")),),
    ),
    Phase.PREFILL_DISPATCH: Derivation(
        "prefill",
        ((Boundary("prefill", Phase.PREFILL_FINISHED, "end"), Boundary("prefill", Phase.WRITER_WAKE, "start")),),
    ),
    Phase.DECODE_DISPATCH: Derivation(
        "decode",
        (
            (Boundary("decode", Phase.ALLOC, "end"), Boundary("decode", Phase.HANDSHAKE, "start")),
            (Boundary("decode", Phase.ALLOC, "end"), Boundary("decode", Phase.DESCRIPTOR_PREP, "start")),
        ),
    ),
    Phase.WRITE_NOTIFY: Derivation(
        "decode", ((Boundary("prefill", Phase.WRITE_COMPLETE, "end"), Boundary("decode", Phase.KV_READY, "end")),)
    ),
    # per completion span (so per rank): NIXL's own transfer time, and the rest
    Phase.WRITE_WIRE: Derivation("prefill", (), split=Split(Phase.WRITE_COMPLETE, ATTR_NIXL_XFER_S, True)),
    Phase.WRITE_NOTICED: Derivation("prefill", (), split=Split(Phase.WRITE_COMPLETE, ATTR_NIXL_XFER_S, False)),
    Phase.READ_WIRE: Derivation("decode", (), split=Split(Phase.READ_COMPLETE, ATTR_NIXL_XFER_S, True)),
    Phase.READ_NOTICED: Derivation("decode", (), split=Split(Phase.READ_COMPLETE, ATTR_NIXL_XFER_S, False)),
    # P's release: pull, D's read-done notification; push, its WRITE seen
    # done; either mode, the lease reaped (an ``expired`` point on P)
    Phase.KV_HOLD: Derivation(
        "prefill",
        tuple(
            (Boundary("decode", Phase.KV_READY, "end"), Boundary("prefill", p, "end"))
            for p in (Phase.KV_RELEASED, Phase.WRITE_COMPLETE, Phase.READ_COMPLETE)
        ),
        latest=True,
    ),
}
