"""Open handoffs read back from the store: which side of a request still
waits, in which phase, since when (docs/handoff-health.md, "Partial traces").

A process writes a ``handoff.open`` span (:data:`kvrecord.semconv.SPAN_HANDOFF_OPEN`)
for each of its handoffs open longer than ``open_trace_after_s``, and again
every few seconds while it stays open: start = when that side began to wait,
end = the snapshot. The rule, decided here and nowhere else:

* A trace is **open on a side** (``kvlens.role`` of the span: the side that
  waits) while it has a ``handoff.open`` span of that side and no span that
  ends a handoff on that side (:data:`HANDOFF_ENDS`).
* Of a side's ``handoff.open`` spans the **latest snapshot** counts; the
  others are history. Once the side has ended, all of them are hidden: the
  complete trace replaces the partial one.
* A handoff is **stuck now** (:func:`stuck`, ``kvlens traces --open``, the
  dashboard's list) when it is open and its process reported it recently
  (the caller's ``since_ns``): one that stopped being reported ended where
  kvlens saw no end (its process died, vLLM dropped it) and is no longer
  "now".

Pure functions of span rows (dicts as ``store.spans_for`` reads them, or
:class:`kvtrace.tracemodel.Span` records), plus :func:`stuck`, which reads
the store on the caller's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from kvrecord import semconv as sc
from kvrecord.ids import base_request_id
from kvtrace import store

OPEN = sc.SPAN_HANDOFF_OPEN

#: The spans that end a handoff on each side (docs/handoff-health.md, "Phases of an
#: open handoff"): D's ``kv.ready`` (the KV arrived, failed, or the request
#: ended without it); P's release of the blocks: ``kv.released`` (pull, D's
#: read-done), ``write.complete`` (push, the WRITE seen done, or the lease's
#: ``expired`` point), ``read.complete`` (pull, the lease's ``expired`` point).
HANDOFF_ENDS: Mapping[str, frozenset[str]] = {
    sc.Role.DECODE.value: frozenset({sc.Phase.KV_READY.value}),
    sc.Role.PREFILL.value: frozenset(
        {sc.Phase.KV_RELEASED.value, sc.Phase.WRITE_COMPLETE.value, sc.Phase.READ_COMPLETE.value}
    ),
}
_END_NAMES = frozenset().union(*HANDOFF_ENDS.values())
#: The summary column that says push P's WRITE (or its lease) ended P's side.
_WRITE_COMPLETE_COL = store.PHASE_COLUMNS[sc.Phase.WRITE_COMPLETE.value]

#: How the lanes name a side.
SIDE = {sc.Role.PREFILL.value: "P", sc.Role.DECODE.value: "D"}

#: The words for a stale trace (dashboard, ``kvlens traces``).
STALE_WORDS = "possibly served from reused memory"
STALE_WHY = "its KV was read or written after P released it at the lease"


@dataclass(frozen=True)
class OpenSide:
    """One side of one request still waiting, as its latest ``handoff.open`` says.
    Times: wall-clock ns of the side's own clock."""

    trace_id: str
    request_id: str | None
    mode: str | None
    #: the side that waits: ``prefill`` or ``decode``
    role: str
    #: where it waits (:class:`kvrecord.semconv.OpenPhase` value)
    phase: str | None
    #: when the side began to wait
    since_ns: int
    #: the snapshot: when its process last reported it open
    seen_ns: int
    blocks: int | None = None
    engine: str | None = None
    registration_timeout: bool = False

    @property
    def side(self) -> str:
        return SIDE.get(self.role, self.role)

    @property
    def waited_s(self) -> float:
        """How long it had waited at the last report."""
        return max(self.seen_ns - self.since_ns, 0) / 1e9

    def age_s(self, now_ns: int) -> float:
        """How long it has waited by ``now_ns`` (it may have ended since the last report)."""
        return max(now_ns - self.since_ns, 0) / 1e9

    def to_json(self, now_ns: int | None = None) -> dict[str, Any]:
        """The ``kvlens traces --open --json`` object (keys are a contract)."""
        out = {
            "trace_id": self.trace_id,
            "request_id": self.request_id,
            "mode": self.mode,
            "waiting": self.role,
            "phase": self.phase,
            "since_ns": self.since_ns,
            "last_seen_ns": self.seen_ns,
            "waited_s": self.waited_s,
            "blocks": self.blocks,
            "engine": self.engine,
            "registration_timeout": self.registration_timeout,
        }
        if now_ns is not None:
            out["age_s"] = self.age_s(now_ns)
            out["last_seen_ago_s"] = max(now_ns - self.seen_ns, 0) / 1e9
        return out


def _get(s: Any, key: str) -> Any:
    return s.get(key) if isinstance(s, Mapping) else getattr(s, key, None)


def _attrs(s: Any) -> Mapping[str, Any]:
    return _get(s, "attributes") or {}


def is_open_span(s: Any) -> bool:
    return _get(s, "name") == OPEN


def ended_sides(spans: Iterable[Any]) -> set[str]:
    """The roles on which a handoff ended (one of :data:`HANDOFF_ENDS` seen)."""
    return {r for s in spans if (r := _get(s, "role")) in HANDOFF_ENDS and _get(s, "name") in HANDOFF_ENDS[r]}


def latest_open(spans: Iterable[Any], ended: set[str] | None = None) -> dict[str, Any]:
    """Role -> its latest ``handoff.open`` span (by snapshot), for the roles not in ``ended``."""
    ended = ended or set()
    out: dict[str, Any] = {}
    for s in spans:
        if not is_open_span(s):
            continue
        role = _get(s, "role") or _attrs(s).get(sc.ATTR_ROLE)
        if role in ended:
            continue
        cur = out.get(role)
        if cur is None or (_get(s, "end_ns"), _get(s, "start_ns")) > (_get(cur, "end_ns"), _get(cur, "start_ns")):
            out[role] = s
    return out


def visible_spans(spans: Sequence[Any]) -> list[Any]:
    """``spans`` without the ``handoff.open`` spans a reader hides: every one of
    a side that ended, and all but the latest of a side still open."""
    if not any(is_open_span(s) for s in spans):
        return list(spans)
    keep = {id(s) for s in latest_open(spans, ended_sides(spans)).values()}
    return [s for s in spans if not is_open_span(s) or id(s) in keep]


def side_of(trace_id: str, s: Any, request_id: str | None = None) -> OpenSide:
    """The :class:`OpenSide` one ``handoff.open`` span says."""
    a = _attrs(s)
    rid = request_id or _get(s, "request_id") or a.get(sc.ATTR_REQUEST_ID)
    blocks = a.get(sc.ATTR_OPEN_BLOCKS)
    return OpenSide(
        trace_id=trace_id,
        request_id=base_request_id(rid) if isinstance(rid, str) else rid,
        mode=_get(s, "mode") or a.get(sc.ATTR_MODE),
        role=_get(s, "role") or a.get(sc.ATTR_ROLE),
        phase=a.get(sc.ATTR_OPEN_PHASE),
        since_ns=int(_get(s, "start_ns")),
        seen_ns=int(_get(s, "end_ns")),
        blocks=blocks if isinstance(blocks, int) and blocks > 0 else None,
        engine=a.get(sc.ATTR_ENGINE_ID),
        registration_timeout=a.get(sc.ATTR_REGISTRATION_TIMEOUT) is True,
    )


def open_sides(trace_id: str, spans: Sequence[Any], request_id: str | None = None) -> tuple[OpenSide, ...]:
    """The sides of one trace still open (its whole span list), oldest wait first."""
    sides = [side_of(trace_id, s, request_id) for s in latest_open(spans, ended_sides(spans)).values()]
    return tuple(sorted(sides, key=lambda o: o.since_ns))


def is_stale(spans: Iterable[Any]) -> bool:
    """Whether a span of the trace says its KV moved after P released it
    (``kvlens.kv.stale``, or the outcome ``stale``)."""
    stale = sc.Outcome.STALE.value
    return any(_get(s, "outcome") == stale or _attrs(s).get(sc.ATTR_KV_STALE) is True for s in spans)


def stuck(
    conn: Any, *, since_ns: int | None, mode: str | None = None, limit: int = store.spanrows.OPEN_SPANS_LIMIT
) -> list[OpenSide]:
    """The handoffs stuck now (see the module docstring): open on a side and
    reported at or after ``since_ns``, oldest wait first; ``mode``: only
    push or pull. Reads the partial index, the stuck traces' end spans and
    their summaries (which know D's end and push P's even where the spans
    were not kept)."""
    rows = store.open_spans(conn, since_ns=since_ns, limit=limit)
    if mode:
        rows = [r for r in rows if (r.get("mode") or r["attributes"].get(sc.ATTR_MODE)) == mode]
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_trace.setdefault(r["trace_id"], []).append(r)
    if not by_trace:
        return []
    ended: dict[str, set[str]] = {}
    for tid, name, role, *_ in store.named_spans(conn, list(by_trace), _END_NAMES):
        if name in HANDOFF_ENDS.get(role, ()):
            ended.setdefault(tid, set()).add(role)
    # the summary row folds every span, stored or not (--keep sampled keeps the
    # spans of some requests only): D's kv.ready, push P's write.complete
    for row in store.slowest(conn, len(by_trace), order="start", trace_ids=list(by_trace)):
        if row.get("kv_ready_ns") is not None:
            ended.setdefault(row["trace_id"], set()).add(sc.Role.DECODE.value)
        if row.get(_WRITE_COMPLETE_COL) is not None:
            ended.setdefault(row["trace_id"], set()).add(sc.Role.PREFILL.value)
    out = [
        side_of(tid, s) for tid, spans in by_trace.items() for s in latest_open(spans, ended.get(tid, set())).values()
    ]
    return sorted(out, key=lambda o: (o.since_ns, o.trace_id, o.role))


def now_ns() -> int:
    return time.time_ns()
