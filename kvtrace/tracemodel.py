"""The one trace model: a request's trace with its spans, which spans are on
the critical path, its handoff and outcome, and its JSON form.

``kvlens traces`` (text waterfall and ``--json``), the dashboard (Traces page,
per-phase breakdown) and the bench's store join all read traces through
this module, so they cannot disagree on what a trace says.

The critical-path rule (docs/phases.md, "Critical path") is decided here and
nowhere else:

* The **handoff window** of a trace is ``prefill.finished`` (P) ->
  ``kv.ready`` (D); a trace without both has none, and no span of it is on
  the critical path.
* ``request`` (the root span: it contains everything) and ``prefill`` (it
  ends where the window starts) are never handoff phases
  (:data:`NOT_HANDOFF_PHASES`).
* Any other span's cost is the part of it inside the window
  (:func:`critical_ns`); the rest of it is **overlap** (it ran while P was
  still computing). The split is measured per span, not assumed from the
  phase name: in overlapped push the ``registration.*`` phases
  (``semconv.PUSH_OVERLAP_PHASES``) and most of ``match`` land before
  ``prefill.finished`` and so are overlap.
* A span is **on the critical path** (:func:`on_critical_path`) when a
  positive part of it lies inside the window; a point span (zero length)
  when it lies within the window, ends included.
* Where positions are unknown (Prometheus holds durations only),
  :func:`static_path` stands in: push's registration phases are overlap,
  every other handoff phase critical.

Tiling the handoff, the derived phases and the breakdown in words live in
:mod:`kvtrace.tiling` and are re-exported here (:func:`tile`,
:func:`derive`, :func:`summarize`, :func:`dominant_words`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvtrace import cpusplit, kvuse, ranks, store, stuck
from kvtrace.derivedread import d_shift_ns, derived_of  # noqa: F401 (re-exported: the one trace model's API)
from kvtrace.tiling import (  # noqa: F401 (re-exported: the one trace model's API)
    DERIVED_NAMES,
    DERIVATION_ATTRIBUTES,
    DERIVATION_INPUTS,
    Derived,
    KVLENS_PHASES,
    POINT_NAMES,
    NOT_HANDOFF_PHASES,
    SPLIT_PHASES,
    UNATTRIBUTED,
    Breakdown,
    Tiling,
    derive,
    derived_from,
    derived_spans,
    dominant_words,
    phase_words,
    release_json,
    release_of,
    summarize,
    tile,
)
from kvrecord import semconv as sc
from kvrecord.keeprule import NOT_KEPT

#: Why a summary-only request lists no spans (``kvlens traces --json``).
NOT_KEPT_NOTE = (
    "summary only: spans not kept under --keep sampled (not failed, clock bounded, not slow, outside the keep ratio)"
)

#: Labels of the two sides of the split (the dashboard shows them as is).
CRITICAL = "critical path"
OVERLAP = "overlapped with prefill"

_PUSH_OVERLAP = frozenset(p.value for p in sc.PUSH_OVERLAP_PHASES)


# ------------------------------------------------------------------ the rule
def is_point(name: str, start_ns: int, end_ns: int) -> bool:
    """A point phase (``semconv.POINT_PHASES``) or any zero-length span."""
    return start_ns == end_ns or name in POINT_NAMES


def critical_ns(name: str, start_ns: int, end_ns: int, pf_ns: int | None, kv_ns: int | None) -> int:
    """Nanoseconds of the span inside the handoff window ``[pf_ns, kv_ns]``
    (0 without a window, for a non-handoff phase, or a span outside it)."""
    if pf_ns is None or kv_ns is None or name in NOT_HANDOFF_PHASES or name not in KVLENS_PHASES:
        return 0
    return max(0, min(end_ns, kv_ns) - max(start_ns, pf_ns))


def on_critical_path(name: str, start_ns: int, end_ns: int, pf_ns: int | None, kv_ns: int | None) -> bool:
    """Whether the span is on the critical path (see the module docstring)."""
    if pf_ns is None or kv_ns is None or name in NOT_HANDOFF_PHASES or name not in KVLENS_PHASES:
        return False
    if is_point(name, start_ns, end_ns):
        return pf_ns <= start_ns <= kv_ns
    return critical_ns(name, start_ns, end_ns, pf_ns, kv_ns) > 0


def static_path(mode: str, phase: str) -> str | None:
    """:data:`CRITICAL` / :data:`OVERLAP` for a phase whose position against
    the window is unknown (Prometheus durations); ``None`` for phases that
    are not handoff cost at all (root, prefill, point phases)."""
    if phase in NOT_HANDOFF_PHASES or phase in POINT_NAMES:
        return None
    return OVERLAP if mode == sc.Mode.PUSH.value and phase in _PUSH_OVERLAP else CRITICAL


# ------------------------------------------------------------------ records
@dataclass(frozen=True)
class Span:
    """One span of a trace, with its place against the handoff window."""

    name: str
    role: str | None
    start_ns: int
    end_ns: int
    span_id: str | None = None
    parent_id: str | None = None
    outcome: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    point: bool = False
    critical: bool = False

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_json(self) -> dict[str, Any]:
        """The span object of ``kvlens traces --json``."""
        return {
            "name": self.name,
            "role": self.role,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "outcome": self.outcome,
            "attributes": self.attributes,
        }


@dataclass(frozen=True)
class Trace:
    """A request's trace: the store's summary row plus its spans (ordered by
    start time). Times in wall-clock ns, durations in seconds; ``None`` where
    unknown (``handoff_s`` needs both prefill.finished and kv.ready)."""

    trace_id: str
    request_id: str | None = None
    mode: str | None = None
    dispatch: str | None = None
    outcome: str | None = None
    start_ns: int | None = None
    end_ns: int | None = None
    ttft_s: float | None = None
    prefill_finished_ns: int | None = None
    kv_ready_ns: int | None = None
    handoff_s: float | None = None
    n_spans: int = 0
    spans: tuple[Span, ...] = ()
    handoff_err_s: float | None = None
    handoff_raw_s: float | None = None
    clock_offset_s: float | None = None
    clock_lo_s: float | None = None
    clock_hi_s: float | None = None
    handoff_note: str | None = None
    p_engine: str | None = None
    d_engine: str | None = None
    #: ``router`` (client-seen, kvlens' router) or ``engines`` (P's arrival ->
    #: D's first token, corrected like the handoff, true within ``ttft_err_s``)
    ttft_source: str | None = None
    ttft_err_s: float | None = None
    #: Whether its spans are stored, and why (:mod:`kvrecord.keeprule`): None
    #: (written before kvlens recorded it: all kept), ``all``, a reason, ``no``.
    keep: str | None = None
    #: The prompt's tokens, the router's weight of the mode it drew (None: not
    #: drawn) and the client-seen time per output token of a stream, from the
    #: summary row (schema 7: kept with it; None on rows written before)
    prompt_tokens: int | None = None
    split: float | None = None
    tpot_s: float | None = None
    #: Each recorded phase's longest duration in seconds, from the summary
    #: row: there whether the spans were kept or not.
    phases: Mapping[str, float] = field(default_factory=dict)
    #: The sides still waiting (a partial trace: :mod:`kvtrace.stuck`), oldest first; () when none.
    open: tuple[stuck.OpenSide, ...] = ()
    #: A span says its KV moved after P released it: possibly served from reused memory.
    stale: bool = False
    #: The kernel's scheduler record of the host, where one was kept and read
    #: (:func:`kvtrace.schedtrace.load`): the CPU split walks phases through it
    #: (:func:`kvtrace.cpusplit.handoff_cpu`); attach with ``dataclasses.replace``.
    sched: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_rows(cls, summary: Mapping[str, Any], spans: Sequence[Mapping[str, Any]] = ()) -> Trace:
        """Build from a ``store.slowest`` row and its ``store.spans_for`` rows.

        D's spans and ``kv_ready_ns`` are moved onto P's clock by the store's
        ``clock_offset_s`` (0 when P's and D's clocks could not be told apart),
        so positions against the handoff window compare like with like.
        Partial-trace spans: those :func:`kvtrace.stuck.visible_spans` keeps."""
        spans = stuck.visible_spans(spans)
        open_sides = stuck.open_sides(summary["trace_id"], spans, summary.get("request_id"))
        off = d_shift_ns(summary.get("clock_offset_s"))
        pf, kv = summary.get("prefill_finished_ns"), summary.get("kv_ready_ns")
        if kv is not None:
            kv -= off
        marked = []
        for s in spans:
            d = off if s.get("role") == sc.Role.DECODE.value else 0
            t0, t1 = s["start_ns"] - d, s["end_ns"] - d
            marked.append(
                Span(
                    name=s["name"],
                    role=s.get("role"),
                    start_ns=t0,
                    end_ns=t1,
                    span_id=s.get("span_id"),
                    parent_id=s.get("parent_id"),
                    outcome=s.get("outcome"),
                    attributes=s.get("attributes") or {},
                    point=is_point(s["name"], t0, t1),
                    critical=on_critical_path(s["name"], t0, t1, pf, kv),
                )
            )
        for d in derived_spans(marked):
            attrs: dict[str, Any] = {sc.ATTR_DERIVED: True}
            if d.rank is not None:  # cut from one rank's span: drawn in that rank's lane
                attrs[sc.ATTR_RANK] = d.rank
            marked.append(
                Span(
                    name=d.name,
                    role=d.role,
                    start_ns=d.start_ns,
                    end_ns=d.end_ns,
                    outcome=d.outcome,
                    attributes=attrs,
                    critical=on_critical_path(d.name, d.start_ns, d.end_ns, pf, kv),
                )
            )
        marked.sort(key=lambda x: x.start_ns)  # stable: recorded order kept among equal starts
        phase_cols = store.PHASE_COLUMNS
        skip = {"n_spans", "kv_ready_ns", *phase_cols.values()}
        fields = {k: summary.get(k) for k in store.SUMMARY_COLUMNS if k not in skip}
        phases = {p: summary[c] for p, c in phase_cols.items() if summary.get(c) is not None}
        return cls(
            spans=tuple(marked),
            kv_ready_ns=kv,
            n_spans=summary.get("n_spans") or 0,
            phases=phases,
            open=open_sides,
            stale=stuck.is_stale(spans) or summary.get("outcome") == sc.Outcome.STALE.value,
            **fields,
        )

    @property
    def half(self) -> str | None:
        """``"prefill"`` / ``"decode"``: only that side's spans joined this
        trace (docs/phases.md, "Trace correlation"); ``None`` for a whole one."""
        if self.p_engine is not None and self.d_engine is None:
            return sc.Role.PREFILL.value
        if self.d_engine is not None and self.p_engine is None:
            return sc.Role.DECODE.value
        return None

    @property
    def window(self) -> tuple[int, int] | None:
        """The handoff window (prefill.finished, kv.ready) in ns, if both are known."""
        if self.prefill_finished_ns is None or self.kv_ready_ns is None:
            return None
        return self.prefill_finished_ns, self.kv_ready_ns

    @property
    def t0_ns(self) -> int:
        """The earliest start among the trace and its spans (the waterfall's origin)."""
        starts = [s.start_ns for s in self.spans] + ([self.start_ns] if self.start_ns is not None else [])
        return min(starts) if starts else 0

    def tiling(self, *, derived: bool = True) -> Tiling | None:
        """The handoff split exclusively by phase (:func:`tile`); ``None``
        without a window. ``derived=False``: recorded phases only (what a
        store named before derived phases existed)."""
        spans = self.spans if derived else [s for s in self.spans if s.name not in DERIVED_NAMES]
        return tile(spans, self.window)

    def decomposition(self) -> dict[str, float | None]:
        """Client-seen TTFT = ``queue_prefill_s`` (router arrival ->
        prefill.finished) + ``handoff_s`` + ``first_decode_s`` (kv.ready ->
        first token); seconds, ``None`` where a part is unknown."""
        dec: dict[str, float | None] = {"queue_prefill_s": None, "handoff_s": self.handoff_s, "first_decode_s": None}
        req = next((s for s in self.spans if s.name == sc.Phase.REQUEST.value), None)
        pf, kv = self.prefill_finished_ns, self.kv_ready_ns
        if req is not None and pf is not None:
            dec["queue_prefill_s"] = (pf - req.start_ns) / 1e9
            if kv is not None and self.ttft_s is not None:
                dec["first_decode_s"] = self.ttft_s - (kv - req.start_ns) / 1e9  # ns ints: no float cancellation
        return dec

    def to_json(self) -> dict[str, Any]:
        """The ``kvlens traces --json`` object (one per line; keys are a contract).

        ``handoff_s`` is corrected for the P/D clock offset and true to within
        ``handoff_err_s``; both are null when unknown, with ``handoff_note``
        saying why. ``clock_offset_s`` (D minus P, applied to D's span times
        here) lies in ``clock_interval_s``; ``handoff_raw_s`` is the
        uncorrected two-clock difference."""
        interval = None if self.clock_lo_s is None else [self.clock_lo_s, self.clock_hi_s]
        return {
            "trace_id": self.trace_id,
            "request_id": self.request_id,
            "mode": self.mode,
            "dispatch": self.dispatch,
            "outcome": self.outcome,
            "ttft_s": self.ttft_s,
            "handoff_s": self.handoff_s,
            "handoff_err_s": self.handoff_err_s,
            "handoff_raw_s": self.handoff_raw_s,
            "handoff_note": self.handoff_note,
            "clock_offset_s": self.clock_offset_s,
            "clock_interval_s": interval,
            "p_engine": self.p_engine,
            "d_engine": self.d_engine,
            "start_ns": self.start_ns,
            "ttft_source": self.ttft_source,
            "ttft_err_s": self.ttft_err_s,
            "prompt_tokens": self.prompt_tokens,
            "split": self.split,
            "tpot_s": self.tpot_s,
            "half": self.half,
            "ranks": self.ranks_json(),
            "transfer": ranks.transfer_json(self.spans),
            "release": release_json(self.spans, self.kv_ready_ns),
            "kv_use": kvuse.trace_kv_use(self.spans),
            "keep": self.keep,
            "open": [o.to_json() for o in self.open],
            "stale": self.stale,
            "phases_s": self.phases_json(),
            **cpusplit.handoff_cpu(self).to_json(),
            "wire_progress_cpu_s": cpusplit.wire_progress(self),
            "spans": [s.to_json() for s in self.spans],
            **({"spans_note": NOT_KEPT_NOTE} if self.keep == NOT_KEPT else {}),
        }

    def phases_json(self) -> dict[str, float]:
        """Each phase's longest duration, seconds: the summary row's recorded
        phases plus the derived ones the spans allow (``write.wire``,
        ``read.noticed``, ...: what the waterfall shows)."""
        out = dict(self.phases)
        for s in self.spans:
            if (s.attributes or {}).get(sc.ATTR_DERIVED):
                out[s.name] = max(out.get(s.name, 0.0), s.duration_s)
        return out

    def ranks_json(self) -> dict[str, Any] | None:
        """Tensor-parallel ranks of the trace (:mod:`kvtrace.ranks`): ranks
        seen per role and the straggler of each per-rank completion phase
        (the transfer over ranks is the JSON's ``transfer``); None where no
        span carries a rank."""
        tp = ranks.tp_sizes(self.spans)
        if not tp:
            return None
        return {"tp": tp, "stragglers": [x.to_json() for x in ranks.stragglers(self.spans)]}


def trace_record(summary: Mapping[str, Any], spans: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``kvlens traces --json`` object for a store summary row and its spans."""
    return Trace.from_rows(summary, spans).to_json()


# ------------------------------------------------------------------ loading
def slowest(conn, n: int = 10, *, with_spans: bool = True, **filters: Any) -> list[Trace]:
    """``store.slowest`` (same filters and order) as :class:`Trace` records,
    with their spans unless ``with_spans=False``. Runs on the caller's thread."""
    rows = store.slowest(conn, n, **filters)
    spans = store.spans_for(conn, [r["trace_id"] for r in rows]) if with_spans else {}
    return [Trace.from_rows(r, spans.get(r["trace_id"], ())) for r in rows]


def find(conn, trace_ids: Iterable[str], *, with_spans: bool = True) -> dict[str, Trace]:
    """The traces among ``trace_ids`` that the store has, by trace id (the
    bench joins its requests to the store with this)."""
    ids = list(trace_ids)
    return {t.trace_id: t for t in slowest(conn, len(ids), trace_ids=ids, with_spans=with_spans)}
