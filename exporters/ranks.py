"""Tensor-parallel ranks in one trace: a phase seen on several ranks is one
phase with per-rank children, and the last rank done is the request's.

With tensor parallelism every rank's worker posts its own WRITEs (push, P)
or READs (pull, D) and reports its own completion; D's request is ready only
when every rank is (vLLM aggregates the ranks' ``finished_recving``). So:

* the handoff ends at the **last** rank's ``kv.ready`` (the store folds
  ``kv_ready_ns`` to the latest; :mod:`exporters.store.writer`);
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

from typing import Any, Iterable, NamedTuple

from instrumented_connector import semconv as sc

#: The per-rank phases whose last rank decides when the request moves on.
COMPLETION_PHASES: frozenset[str] = frozenset({sc.Phase.WRITE_COMPLETE.value, sc.Phase.READ_COMPLETE.value,
                                               sc.Phase.KV_READY.value})


def rank_of(span: Any) -> int | None:
    """The TP rank a span was recorded on (``kvlens.rank``), else None."""
    r = (getattr(span, "attributes", None) or {}).get(sc.ATTR_RANK)
    return r if isinstance(r, int) else None


def ranks_by_phase(spans: Iterable[Any]) -> dict[tuple[str | None, str], dict[int, Any]]:
    """(role, phase) -> rank -> the rank's span (the last one when a rank
    recorded a phase twice), for phases recorded with a rank."""
    out: dict[tuple[str | None, str], dict[int, Any]] = {}
    for s in spans:
        r = rank_of(s)
        if r is not None:
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
        return {"role": self.role, "phase": self.phase, "ranks": self.ranks, "rank": self.rank,
                "first_rank": self.first_rank, "lag_s": self.lag_s}


def stragglers(spans: Iterable[Any]) -> list[Straggler]:
    """Per completion phase seen on two or more ranks: which rank finished
    last, and its lag behind the first (by span end). Ordered by phase."""
    out = []
    for (role, name), by_rank in ranks_by_phase(spans).items():
        if name not in COMPLETION_PHASES or len(by_rank) < 2:
            continue
        last = max(by_rank, key=lambda r: (by_rank[r].end_ns, r))
        first = min(by_rank, key=lambda r: (by_rank[r].end_ns, r))
        out.append(Straggler(role, name, len(by_rank), last, first,
                             (by_rank[last].end_ns - by_rank[first].end_ns) / 1e9))
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
    done = [s for s in spans if s.name in (sc.Phase.WRITE_COMPLETE.value, sc.Phase.READ_COMPLETE.value)]
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
