"""The two storage tiers: every request's summary row, spans only for the
requests a :class:`~kvrecord.keeprule.KeepRule` keeps (docs/fleet.md).

A :class:`Keeper` stands where :func:`~kvtrace.store.writer.write_spans`
stood. With ``keep all`` it is that call. With ``keep sampled``:

1. each batch's summary upserts are written at once (the summary, the clock
   windows and the settled handoff are exact whatever is decided later);
   the span rows of undecided requests wait in memory, bounded by
   :attr:`KeepRule.max_spans` (past it the oldest requests are decided early
   and counted ``forced``);
2. a request is decided :attr:`KeepRule.grace_s` after its router root span
   arrived, or :attr:`KeepRule.wait_s` after its first span, whichever comes
   first; the decision reads the request's settled summary back (one query
   per batch of decisions), writes the kept requests' spans and every
   decision into ``traces.keep``. The first decision a store records for a
   request stands (``COALESCE``): several processes deciding one request
   (P's and D's exporters on one store) agree on every rule but a live
   percentile, whose windows are each process's own; partial-trace spans
   (``handoff.open``) are written at once, undecided or not kept: they are for
   seeing a request while it is stuck;
3. a span that arrives after its request was decided still folds into the
   summary; it is stored when the request was kept, else counted
   (``late_dropped``). Decisions are remembered (bounded,
   :data:`DECIDED_CAP`); a late span of a forgotten one follows the store's
   ``keep`` column.

Every decision is counted by reason (:attr:`Keeper.counts`). The state
changes only after its transaction committed, so a caller may retry a
failed :meth:`Keeper.write` with the same spans; a failed decision after
the batch committed is logged and retried with the next call (the request
is still held), never raised to make the caller write the batch twice."""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from kvrecord.keeprule import NOT_KEPT, KeepRule
from kvrecord.semconv import SPAN_HANDOFF_OPEN
from kvrecord.logutil import log_once
from kvtrace.store.schema import PARAM, params, write_tx
from kvtrace.store.writer import insert_span_rows, prepare_span_rows, span_rows, write_rows

#: Decisions remembered for late spans (beyond: the store's ``keep`` column).
DECIDED_CAP = 200_000
#: Unkept requests' span rows held until the metrics read their derived
#: phases (:meth:`Keeper.unkept_rows`, which takes them), at most this many
#: spans; older ones are let go and counted (``unkept_evicted``).
UNKEPT_MAX_SPANS = 50_000
#: Handoffs / TTFTs per (mode, dispatch, P, D) window, and the fewest that give a percentile.
WINDOW = 1000
MIN_WINDOW = 20
_OUTCOMES_KEPT = ("failed", "timeout", "expired", "stale")
_ROOT = "request"
#: Partial-trace spans are stored at once whatever the decision (docs/handoff-health.md): a
#: stuck request is what they are for, and it is undecided while it is stuck.
_OPEN = SPAN_HANDOFF_OPEN

_DECISION_COLUMNS = (
    "trace_id",
    "mode",
    "dispatch",
    "p_engine",
    "d_engine",
    "outcome",
    "handoff_s",
    "ttft_s",
    "prefill_finished_ns",
    "kv_ready_ns",
    "keep",
)
_SET_KEEP = f"UPDATE traces SET keep = COALESCE(keep, {PARAM}) WHERE trace_id = {PARAM}"


@dataclass
class _Pending:
    first: float
    rows: list = field(default_factory=list)


class _Window:
    """The recent handoffs and TTFTs of one (mode, dispatch, P, D) key, and
    their percentile: each kept in arrival order (what leaves first) and in
    sorted order (the percentile is an index). A value costs a binary
    search and a C memmove on each, against re-sorting the window."""

    __slots__ = ("values", "ranked")

    def __init__(self) -> None:
        self.values = (collections.deque(), collections.deque())
        self.ranked: tuple[list[float], list[float]] = ([], [])

    def above(self, i: int, v: float | None, pct: float) -> bool | None:
        """Whether ``v`` is above the window's percentile (None: too few to say); then adds ``v``."""
        if v is None:
            return False
        vals, ranked = self.values[i], self.ranked[i]
        out = None
        if len(ranked) >= MIN_WINDOW:
            out = v > ranked[min(len(ranked) - 1, int(len(ranked) * pct / 100.0))]
        if len(vals) >= WINDOW:
            del ranked[bisect.bisect_left(ranked, vals.popleft())]
        vals.append(v)
        bisect.insort(ranked, v)
        return out


def ratio_pick(trace_id: str, ratio: float) -> bool:
    """Whether ``trace_id`` is in the ``ratio`` share (its last 8 hex digits,
    random in a W3C trace id): the same answer in every process."""
    if ratio >= 1.0:
        return True
    return int(trace_id[-8:], 16) < ratio * 0x1_0000_0000


class Keeper:
    """Writes batches of spans under a :class:`KeepRule` (one writer thread).
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, rule: KeepRule | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule or KeepRule()
        self._clock = clock
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        self._roots: collections.deque[tuple[float, str]] = collections.deque()
        self._decided: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._unkept: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._unkept_spans = 0
        self._windows: dict[tuple, _Window] = {}
        self.buffered = 0  # span rows waiting for their request's decision
        #: decisions by reason (and ``no``), ``forced`` (decided early, buffer
        #: full), ``late_kept`` / ``late_dropped`` spans, ``unkept`` spans never stored
        self.counts: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------ writing
    def write(self, conn: Any, spans: Sequence) -> int:
        """Write one batch (the summaries now; spans as decided) and decide
        what is due. Returns the span rows stored by this call."""
        if not spans:  # a tick: only decisions can be due (none under keep all)
            return self.decide(conn)
        rows, ups = span_rows(spans)
        if not self.rule.sampled:
            write_rows(conn, rows, ups)
            return len(rows)
        now = self._clock()
        now_rows, held, late = self._sort(conn, rows, ups)
        write_rows(conn, now_rows, ups, keep=None)
        for r in held:  # committed: hold the rest
            p = self._pending.get(r[0])
            if p is None:
                p = self._pending[r[0]] = _Pending(now)
            p.rows.append(r)
            if r[3] == _ROOT:
                self._roots.append((now, r[0]))
        self.buffered += len(held)
        self.counts["late_kept"] += sum(1 for r in now_rows if r[3] != _OPEN)
        self.counts["late_dropped"] += late
        self.counts["unkept"] += late
        try:  # the batch is committed: a failed decision must not make the caller write it again
            decided = self.decide(conn, now)
        except Exception as e:
            log_once(
                "keep-decide:" + type(e).__name__, "keep decisions not written (%s); retried with the next batch", e
            )
            decided = 0
        return len(now_rows) + decided

    def _sort(self, conn: Any, rows: list, trace_ids: Iterable[str]) -> tuple[list, list, int]:
        """(rows of kept decided requests, rows to hold, late rows of unkept
        ones); ``trace_ids``: the batch's requests (each looked up once, not per row)."""
        decided, pending = self._decided, self._pending
        state: dict[str, bool | None] = {}
        unknown = []
        for t in trace_ids:
            d = state[t] = decided.get(t)
            if d is None and t not in pending:
                unknown.append(t)
        if unknown:  # a request this keeper does not remember: another process may have decided it
            for t, k in _stored_keep(conn, set(unknown)).items():
                state[t] = k != NOT_KEPT
        now_rows, held, late = [], [], 0
        for r in rows:
            d = state[r[0]]
            if r[3] == _OPEN:  # a partial trace's snapshot: worth seeing only while the handoff is open
                now_rows.append(r)
            elif d is None:
                held.append(r)
            elif d:
                now_rows.append(r)
            else:
                late += 1
        return now_rows, held, late

    # ----------------------------------------------------------- deciding
    def due_in(self) -> float | None:
        """Seconds until the next request is due (None: nothing held)."""
        if not self._pending:
            return None
        now = self._clock()
        t = next(iter(self._pending.values())).first + self.rule.wait_s
        if self._roots:
            t = min(t, self._roots[0][0] + self.rule.grace_s)
        return max(0.0, t - now)

    def decide(self, conn: Any, now: float | None = None, *, everything: bool = False) -> int:
        """Decide the requests that are due (``everything``: all held ones,
        at shutdown). Returns the span rows stored."""
        now = self._clock() if now is None else now
        due, forced = self._due(now, everything)
        if not due:
            return 0
        summaries = _summaries(conn, due)
        keep_rows, marks, decisions = [], [], {}
        for tid in due:
            row = summaries.get(tid)
            reason = NOT_KEPT if row is None else (row["keep"] or self.reason(tid, row))
            decisions[tid] = reason
            marks.append((reason, tid))
            if reason != NOT_KEPT:
                keep_rows += self._pending[tid].rows
        prepare_span_rows(conn, keep_rows)
        with write_tx(conn):
            insert_span_rows(conn, keep_rows)
            conn.executemany(_SET_KEEP, sorted(marks, key=lambda m: m[1]))
        self.counts["forced"] += forced  # committed
        for tid, reason in decisions.items():
            p = self._pending.pop(tid)
            self.buffered -= len(p.rows)
            self.counts[reason] += 1
            kept = reason != NOT_KEPT
            self._remember(tid, kept)
            if not kept:
                self.counts["unkept"] += len(p.rows)
                self._hold_unkept(tid, p.rows)
        return len(keep_rows)

    def _due(self, now: float, everything: bool) -> tuple[list[str], int]:
        """(the requests to decide now, how many of them early for room)."""
        pend, rule = self._pending, self.rule
        if everything:
            return list(pend), 0
        due = []
        for tid, p in pend.items():  # first-seen order: the due ones are a prefix
            if p.first + rule.wait_s > now:
                break
            due.append(tid)
        while self._roots and self._roots[0][0] + rule.grace_s <= now:
            tid = self._roots.popleft()[1]
            if tid in pend and tid not in due:
                due.append(tid)
        held, forced = self.buffered, 0
        for tid in due:
            held -= len(pend[tid].rows)
        if held > rule.max_spans:  # full: the oldest go early, counted
            seen = set(due)
            for tid, p in pend.items():
                if held <= rule.max_spans:
                    break
                if tid not in seen:
                    due.append(tid)
                    held -= len(p.rows)
                    forced += 1
        return due, forced

    def reason(self, trace_id: str, row: dict) -> str:
        """Why a request is kept, or ``no`` (:data:`kvrecord.keeprule.KEEP_REASONS`, first match)."""
        rule = self.rule
        if row["outcome"] in _OUTCOMES_KEPT:
            return row["outcome"]
        h, ttft = row["handoff_s"], row["ttft_s"]
        if h is None and row["prefill_finished_ns"] is not None and row["kv_ready_ns"] is not None:
            return "clock_unknown"
        if rule.slow_s is not None:
            if (h is not None and h > rule.slow_s) or (ttft is not None and ttft > rule.slow_s):
                return "slow"
        else:
            key = (row["mode"], row["dispatch"], row["p_engine"], row["d_engine"])
            w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window()
            a, b = w.above(0, h, rule.slow_pct), w.above(1, ttft, rule.slow_pct)
            if a or b:
                return "slow"
            if a is None or b is None:
                return "warmup"
        return "ratio" if ratio_pick(trace_id, rule.ratio) else NOT_KEPT

    def _hold_unkept(self, tid: str, rows: list) -> None:
        u = self._unkept
        u[tid] = rows
        self._unkept_spans += len(rows)
        while self._unkept_spans > UNKEPT_MAX_SPANS and u:
            try:
                _, old = u.popitem(last=False)
            except KeyError:  # taken by the reader meanwhile
                break
            self._unkept_spans -= len(old)
            self.counts["unkept_evicted"] += len(old)

    def _remember(self, tid: str, kept: bool) -> None:
        d = self._decided
        d[tid] = kept
        if len(d) > DECIDED_CAP:
            d.popitem(last=False)

    # ------------------------------------------------------------- queries
    def surely_kept(self, trace_id: str) -> bool:
        """Whether ``trace_id``'s spans are (or will be) stored, known now
        (decided kept, or in the ratio share): what may carry an exemplar."""
        if not self.rule.sampled:
            return True
        d = self._decided.get(trace_id)
        return d if d is not None else ratio_pick(trace_id, self.rule.ratio)

    def unkept_rows(self, trace_ids: Iterable[str]) -> dict[str, list]:
        """Take the span rows of recently decided unkept requests among
        ``trace_ids`` (the metrics' derived phases; each is handed out once)."""
        u, out = self._unkept, {}
        for t in list(trace_ids):  # another thread (the metrics' resolver): one dict operation each
            rows = u.pop(t, None)
            if rows is not None:
                out[t] = rows
                self._unkept_spans -= len(rows)  # a racy int: a bound, not an account
        return out

    def flush(self, conn: Any) -> int:
        """Decide every held request now (shutdown). Returns span rows stored."""
        return self.decide(conn, everything=True)


def _summaries(conn: Any, trace_ids: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    cols = ", ".join(_DECISION_COLUMNS)
    for i in range(0, len(trace_ids), 500):
        chunk = trace_ids[i : i + 500]
        for r in conn.execute(f"SELECT {cols} FROM traces WHERE trace_id IN ({params(len(chunk))})", chunk):
            d = dict(zip(_DECISION_COLUMNS, tuple(r)))
            out[d["trace_id"]] = d
    return out


def _stored_keep(conn: Any, trace_ids: set[str]) -> dict[str, str]:
    """The recorded decisions of requests this keeper does not remember."""
    ids = sorted(trace_ids)
    out: dict[str, str] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        sql = f"SELECT trace_id, keep FROM traces WHERE keep IS NOT NULL AND trace_id IN ({params(len(chunk))})"
        out.update((r[0], r[1]) for r in conn.execute(sql, chunk))
    return out
