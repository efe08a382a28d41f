"""Tensor-parallel ranks in one trace: a phase seen on several ranks is one
phase with per-rank children, and the last rank done is the request's.

With tensor parallelism every rank's worker posts its own WRITEs (push, P)
or READs (pull, D) and reports its own completion; D's request is ready only
when every rank is (vLLM aggregates the ranks' ``finished_recving``). So:

* the handoff ends at the **last** rank's ``kv.ready`` (the store folds
  ``kv_ready_ns`` to the latest; :mod:`kvtrace.store.writer`);
* the **critical rank** of a transfer phase is the one that finished last,
  and the trace names it: the straggler rank and its lag behind the first
  rank done (:func:`stragglers`);
* bytes and descriptors of a request are the **sum** over its ranks, its
  transfer time the **slowest** rank's (:func:`transfer_totals`).

Pure functions of span-like objects (``name``, ``role``, ``start_ns``,
``end_ns``, ``attributes``); worker-side spans carry ``kvlens.rank`` (a span
without one is rank 0 of a single-rank engine, or a scheduler-side phase).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, NamedTuple

from kvrecord import semconv as sc

#: The per-rank phases whose last rank decides when the request moves on.
COMPLETION_PHASES: frozenset[str] = frozenset(
    {sc.Phase.WRITE_COMPLETE.value, sc.Phase.READ_COMPLETE.value, sc.Phase.KV_READY.value}
)


def rank_of(span: Any) -> int | None:
    """The TP rank a span was recorded on (``kvlens.rank``), else None."""
    return rank_in(getattr(span, "attributes", None) or {})


def rank_in(attributes: Mapping[str, Any]) -> int | None:
    """:func:`rank_of` a span's attributes."""
    r = attributes.get(sc.ATTR_RANK)
    return r if isinstance(r, int) else None


def ranks_by_phase(spans: Iterable[Any]) -> dict[tuple[str | None, str], dict[int, Any]]:
    """(role, phase) -> rank -> the rank's span (the last one when a rank
    recorded a phase twice), for phases recorded with a rank; a lease's
    ``expired`` point is no rank finishing its transfer and is left out."""
    out: dict[tuple[str | None, str], dict[int, Any]] = {}
    for s in spans:
        r = rank_of(s)
        if r is not None and getattr(s, "outcome", None) != sc.Outcome.EXPIRED.value:
            out.setdefault((s.role, s.name), {})[r] = s
    return out


class Straggler(NamedTuple):
    """The rank a per-rank phase waited for."""

    role: str | None
    phase: str
    #: ranks that recorded the phase
    ranks: int
    #: the last rank done, and the first
    rank: int
    first_rank: int
    #: how much later the last rank finished than the first, seconds
    lag_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "phase": self.phase,
            "ranks": self.ranks,
            "rank": self.rank,
            "first_rank": self.first_rank,
            "lag_s": self.lag_s,
        }


def stragglers(spans: Iterable[Any]) -> list[Straggler]:
    """Per completion phase seen on two or more ranks: which rank finished
    last, and its lag behind the first (by span end). Ordered by phase."""
    out = []
    for (role, name), by_rank in ranks_by_phase(spans).items():
        if name not in COMPLETION_PHASES or len(by_rank) < 2:
            continue
        last = max(by_rank, key=lambda r: (by_rank[r].end_ns, r))
        first = min(by_rank, key=lambda r: (by_rank[r].end_ns, r))
        out.append(
            Straggler(role, name, len(by_rank), last, first, (by_rank[last].end_ns - by_rank[first].end_ns) / 1e9)
        )
    return sorted(out, key=lambda s: sc.PHASE_ORDER.get(s.phase, 99))


class TransferTotals(NamedTuple):
    """One request's transfer over its ranks (``write.complete`` / ``read.complete``)."""

    ranks: int
    #: summed over ranks
    bytes: int
    descriptors: int
    #: the slowest rank's NIXL transfer time and post -> done, seconds
    xfer_s: float | None
    complete_s: float


def transfer_totals(spans: Iterable[Any]) -> TransferTotals | None:
    """Bytes and descriptors summed over the ranks that moved the request's
    KV, transfer time the slowest rank's; None without a completion span."""
    # a lease reaped (``expired``: a point, no transfer) is no rank's transfer
    done = [
        s
        for s in spans
        if s.name in (sc.Phase.WRITE_COMPLETE.value, sc.Phase.READ_COMPLETE.value)
        and getattr(s, "outcome", None) != sc.Outcome.EXPIRED.value
    ]
    if not done:
        return None
    per_rank: dict[int | None, Any] = {}
    for s in done:
        per_rank[rank_of(s)] = s  # one per rank (a rank's later copy wins)
    spans_ = list(per_rank.values())
    attrs = [s.attributes or {} for s in spans_]
    xfer = [a.get(sc.ATTR_NIXL_XFER_S) for a in attrs if isinstance(a.get(sc.ATTR_NIXL_XFER_S), (int, float))]
    return TransferTotals(
        ranks=len(spans_),
        bytes=int(sum(a.get(sc.ATTR_BYTES) or 0 for a in attrs)),
        descriptors=int(sum(a.get(sc.ATTR_DESCRIPTORS) or 0 for a in attrs)),
        xfer_s=max(xfer) if xfer else None,
        complete_s=max((s.end_ns - s.start_ns) / 1e9 for s in spans_),
    )


# ------------------------------------------------------------------ bandwidth
LINK_GBPS_ENV = "KVLENS_LINK_GBPS"
#: The default link ceiling, Gb/s per rank: NVLink 4's 450 GB/s per
#: direction per GPU (H100/H200), the fastest path one rank's KV takes on
#: the hardware vLLM's NIXL connectors usually run on; a loopback copy on a
#: CPU host (memory bandwidth) and any single NIC (400 Gb/s NDR) are below
#: it. Set KVLENS_LINK_GBPS to the link a deployment really has (400 on one
#: NDR NIC per GPU) to flag what that link cannot carry.
DEFAULT_LINK_GBPS = 3600.0


def link_gbps() -> float:
    """The link ceiling (env ``KVLENS_LINK_GBPS``, Gb/s; :data:`DEFAULT_LINK_GBPS`
    when unset or not a positive number)."""
    try:
        v = float(os.environ.get(LINK_GBPS_ENV) or DEFAULT_LINK_GBPS)
    except ValueError:
        return DEFAULT_LINK_GBPS
    return v if math.isfinite(v) and v > 0 else DEFAULT_LINK_GBPS


def gbps(nbytes: Any, xfer_s: Any) -> float | None:
    """bytes / NIXL's transfer time, in Gb/s; None where either is unknown or 0."""
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (nbytes, xfer_s))
    return nbytes * 8 / xfer_s / 1e9 if ok else None


def implausible_note(ceiling: float) -> str:
    return f"above the link ceiling {ceiling:g} Gb/s: NIXL's duration is implausible"


def bandwidth(tot: TransferTotals, ceiling: float | None = None) -> dict[str, Any]:
    """The ``transfer`` object of ``kvlens traces --json``: the request's
    bytes and descriptors (summed over ranks), NIXL's transfer time (the
    slowest rank's), post -> seen done (the slowest rank's), and ``gbps``
    = bytes / that NIXL time, in Gb/s. Above the link ceiling (``ceiling``,
    default :func:`link_gbps`) it is not a fact: ``gbps`` null, ``gbps_flag``
    true, ``gbps_note`` says why (also where NIXL reported no time; else null)."""
    ceiling = link_gbps() if ceiling is None else ceiling
    g = gbps(tot.bytes, tot.xfer_s)
    flag = g is not None and g > ceiling
    note = implausible_note(ceiling) if flag else None
    if g is None:
        note = "no NIXL transfer time or bytes (telemetry unavailable)"
    return {**tot._asdict(), "gbps": None if flag else g, "gbps_flag": flag, "gbps_note": note, "link_gbps": ceiling}


def transfer_json(spans: Iterable[Any]) -> dict[str, Any] | None:
    """:func:`bandwidth` of :func:`transfer_totals`; None without a completion span."""
    tot = transfer_totals(spans)
    return None if tot is None else bandwidth(tot)


def lane(role_lane: str, span: Any, multi: bool) -> str:
    """The waterfall lane of a span: ``P`` / ``D``, or ``P r1`` where the
    trace has several ranks (``multi``) and the span was recorded on one."""
    r = rank_of(span)
    return f"{role_lane} r{r}" if multi and r is not None else role_lane


def tp_sizes(spans: Iterable[Any]) -> dict[str, int]:
    """role -> the number of ranks seen recording for it in this trace."""
    seen: dict[str, set[int]] = {}
    for s in spans:
        r = rank_of(s)
        if r is not None and s.role:
            seen.setdefault(s.role, set()).add(r)
    return {role: len(rs) for role, rs in seen.items()}
