"""What one grid cell measured: the client's per-request results, the
router's traces of exactly those requests (read back from the store by
trace id), D's own TPOT histogram over the cell, and the row that
summarizes them (schema: :mod:`kvtrace.benchrows`).

TPOT is only reported where it was measured: a request whose first and
last generated tokens reached the client in the same network read (a
starved client or router delivers a whole answer at once) has no TPOT
(None, never 0); the row counts such requests (``tpot_untimed``) and, when
no request of the cell could be timed, gives ``tpot_mean_s`` None and the
reason in ``tpot_note``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvtrace import store
from kvtrace.benchrows import INTERVAL_KEYS
from kvlens.bench.grid import BenchOptions
from kvtrace.stats import mean, percentile, rel_diff

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One router to load: its mode, push dispatch (None for pull), URL."""

    mode: str
    dispatch: str | None
    url: str
    #: D's base URL, for the TPOT cross-check against D's own ``/metrics`` (None: not checked)
    decode_url: str | None = None
    #: sent as ``Authorization: Bearer`` to the router (``kvlens proxy --api-key``)
    api_key: str | None = field(default=None, repr=False, compare=False)
    #: the stack behind it when the bench started it (its processes' CPU per cell); None with --proxy
    stack: Any = field(default=None, repr=False, compare=False)
    #: send ``X-Kvlens-Mode: <mode>`` with each request: one half of a mixed fleet (``kvlens up --mode push,pull``)
    force_mode: bool = False
    #: the shaped link its traffic crosses (:func:`kvlens.bench.links.link_record`); None: links kvlens did not shape
    link: dict | None = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.dispatch}" if self.dispatch else self.mode


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds from ``send_s``
    (a ``time.perf_counter`` reading)."""

    request_id: str  # the trace id sent as X-Request-Id
    ok: bool
    #: the trace its spans are under (``ids.trace_of_response``): ``request_id``
    #: unless the router replaced the id (set from the response's ``id``)
    trace_id: str | None = None
    #: the router answered with our id as its X-Request-Id (kvlens' router
    #: does): its root span, with the client-seen TTFT, will be in the store
    kvlens_router: bool = False
    status: int | None = None
    error: str | None = None
    send_s: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    latency_s: float | None = None  # send -> end of stream
    last_token_s: float | None = None  # send -> last token
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    #: network reads that carried generated text (None: not counted, e.g. built by hand)
    text_reads: int | None = None

    @property
    def trace(self) -> str:
        """The trace id to look this request up by in the store."""
        return self.trace_id or self.request_id

    @property
    def tpot_untimed(self) -> bool:
        """True for a completed request of 2+ tokens whose tokens reached the
        client together (first and last in one read, or no time between
        them): its time per output token was not measured."""
        if not self.ok or self.ttft_s is None or self.last_token_s is None or (self.output_tokens or 0) < 2:
            return False
        return (self.text_reads is not None and self.text_reads < 2) or self.last_token_s <= self.ttft_s

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None when not measured
        (failed, fewer than 2 tokens, or :attr:`tpot_untimed`)."""
        if not self.ok or self.ttft_s is None or self.last_token_s is None or not self.output_tokens:
            return None
        if self.output_tokens < 2 or self.tpot_untimed:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Cell:
    """One finished cell: results, their traces (trace id -> ``store.slowest``
    row) and the summary row."""

    target: Target
    qps: float
    input_len: int
    results: list[RequestResult]
    traces: dict[str, dict]
    duration_s: float
    row: dict = field(default_factory=dict)
    #: D's ``(sum, count)`` TPOT histogram growth over the cell (:func:`~kvlens.bench.probe.decode_tpot`)
    decode_tpot: tuple[float, float] | None = None
    #: why ``decode_tpot`` is None
    decode_tpot_note: str | None = None
    #: which round of ``kvlens bench --repeat`` measured it (1-based)
    round: int = 1
    #: what the machine did during the cell (:class:`~kvlens.bench.machine.MachineWatch`)
    machine: dict = field(default_factory=dict)


def samples(cell: Cell, metric: str) -> list[float]:
    """The per-request figures behind a row's ``ttft_p50_s`` (the client's
    TTFT of completed requests) or ``handoff_p50_s`` (their handoff in the
    store), the ones its intervals resample."""
    ok = [r for r in cell.results if r.ok]
    if metric.startswith("ttft_"):
        return [r.ttft_s for r in ok if r.ttft_s is not None]
    if metric.startswith("handoff_"):
        tr = [cell.traces.get(r.trace) for r in ok]
        return [t["handoff_s"] for t in tr if t and t.get("handoff_s") is not None]
    raise ValueError(f"no per-request samples for {metric!r}")


def pool_cells(cells: Sequence[Cell]) -> Cell:
    """One cell holding the requests of several rounds of the same variant and
    grid cell (their row is the pooled row). D's TPOT histogram growth is
    summed where every round has it."""
    first = cells[0]
    traces: dict[str, dict] = {}
    for c in cells:
        traces.update(c.traces)
    grown = [c.decode_tpot for c in cells]
    pooled = Cell(
        first.target,
        first.qps,
        first.input_len,
        [r for c in cells for r in c.results],
        traces,
        sum(c.duration_s for c in cells),
        round=first.round,
    )
    if all(g is not None for g in grown):
        pooled.decode_tpot = (sum(g[0] for g in grown), sum(g[1] for g in grown))
    else:
        pooled.decode_tpot_note = next((c.decode_tpot_note for c in cells if c.decode_tpot is None), None)
    return pooled


def _trace_figures(cell: Cell) -> dict:
    """The row's keys that come from the store's traces."""
    ok = [r for r in cell.results if r.ok]
    tr_ok = [cell.traces.get(r.trace) for r in ok]
    handoffs = [t["handoff_s"] for t in tr_ok if t and t.get("handoff_s") is not None]
    # the store's TTFT is the kvlens router's client-seen one, or the one the
    # engines prove (another router: P's arrival -> D's first token), which
    # leaves out the router's own time: only the first is cross-checked
    by_src: dict[str, list[float]] = {}
    for t in tr_ok:
        if t and t.get("ttft_s") is not None:
            by_src.setdefault(t.get("ttft_source") or "router", []).append(t["ttft_s"])
    router_ttfts = by_src.get("router", [])
    diffs = [
        rel_diff(r.ttft_s, t.get("ttft_s")) for r, t in zip(ok, tr_ok) if t and t.get("ttft_source") in (None, "router")
    ]
    outcomes: dict[str, int] = {}
    for r in cell.results:
        if not r.ok:
            o = (cell.traces.get(r.trace) or {}).get("outcome") or "not in store"
            outcomes[o] = outcomes.get(o, 0) + 1
    waits = [(t["handoff_s"], t.get("handoff_cpu_wait_s")) for t in tr_ok if t and t.get("handoff_s") is not None]
    known = [(h, w) for h, w in waits if w is not None]
    return {
        "handoff_p50_s": percentile(handoffs, 50),
        "handoff_p99_s": percentile(handoffs, 99),
        # issue 41: how much of the handoff was threads waiting for a CPU, and the handoff without it
        # (None: no request carries CPU figures)
        "handoff_cpu_wait_share_p50": percentile((w / h for h, w in known if h > 0), 50),
        "handoff_nowait_p50_s": percentile((h - w for h, w in known), 50),
        "handoff_cpu_n": len(known),
        "router_ttft_p50_s": percentile(router_ttfts, 50),
        "engines_ttft_p50_s": percentile(by_src.get("engines", []), 50),
        "store_ttft_source": "+".join(sorted(by_src)) or None,
        "ttft_client_vs_router_rel_diff_p50": percentile(diffs, 50),
        "handoff_n": len(handoffs),
        "traces_in_store": sum(1 for r in cell.results if r.trace in cell.traces),
        "traces_ok_in_store": sum(1 for t in cell.traces.values() if t.get("outcome") == "ok"),
        "failed_outcomes": outcomes,
    }


def tpot_figures(cell: Cell) -> dict:
    """The row's TPOT keys: the client's mean over the requests it could time,
    how many it could not (``tpot_untimed``) and why (``tpot_note``, None when
    all were timed), and D's own mean over the cell with the relative
    difference between the two (the cross-check)."""
    ok = [r for r in cell.results if r.ok]
    timed = [r.tpot_s for r in ok if r.tpot_s is not None]
    untimed = sum(1 for r in ok if r.tpot_untimed)
    client = mean(timed)
    note = None
    if not ok:
        note = "no completed request"
    elif untimed and not timed:
        note = (
            f"unknown: all {untimed} completed requests' tokens reached the client in one read "
            "(client or router starved of CPU?), so no time per output token was measured"
        )
    elif untimed:
        note = f"from {len(timed)} requests; {untimed} not timed (their tokens reached the client in one read)"
    elif not timed:
        note = "no request had 2 or more output tokens"
    d_mean = d_n = None
    if cell.decode_tpot is not None and cell.decode_tpot[1] > 0:
        d_mean, d_n = cell.decode_tpot[0] / cell.decode_tpot[1], int(cell.decode_tpot[1])
    return {
        "tpot_mean_s": client,
        "tpot_untimed": untimed,
        "tpot_note": note,
        "tpot_decode_mean_s": d_mean,
        "tpot_decode_n": d_n,
        "tpot_decode_note": None
        if d_mean is not None
        else (cell.decode_tpot_note or "D's TPOT histogram did not grow during the cell"),
        "tpot_client_vs_decode_rel_diff": rel_diff(client, d_mean),
    }


def summarize_cell(cell: Cell, opts: BenchOptions, run_id: str, prefix_caching: str) -> dict:
    """The row for one finished cell (pure given the cell); JSON-serializable."""
    res = cell.results
    ok = [r for r in res if r.ok]
    ttfts = [r.ttft_s for r in ok]
    tr = _trace_figures(cell)
    return {
        "run_id": run_id,
        "mode": cell.target.mode,
        "dispatch": cell.target.dispatch,
        "qps": float(cell.qps),
        "input_len": int(cell.input_len),
        "output_len": int(opts.output_len),
        "num_prompts": len(res),
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "ttft_mean_s": mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        **tpot_figures(cell),
        "handoff_p50_s": tr.pop("handoff_p50_s"),
        "handoff_p99_s": tr.pop("handoff_p99_s"),
        "req_per_s": (len(ok) / cell.duration_s) if cell.duration_s > 0 and ok else None,
        "e2e_p50_s": percentile((r.latency_s for r in ok), 50),
        "e2e_p99_s": percentile((r.latency_s for r in ok), 99),
        **tr,
        **cell.machine,
        "prompt_tokens_mean": mean(r.prompt_tokens for r in ok),
        "output_tokens_mean": mean(r.output_tokens for r in ok),
        "duration_s": cell.duration_s,
        "prefix_caching": prefix_caching,
        "url": cell.target.url,
        "link": cell.target.link,
        # set by kvlens.bench.rounds.add_intervals, which needs the cell's pull rounds too
        **dict.fromkeys(INTERVAL_KEYS),
        "rounds": 1,
    }


def _read_traces(where: store.StoreLocation, ids: list[str]) -> dict[str, dict] | None:
    """trace id -> ``store.slowest`` row; None when the store cannot be read yet."""
    try:
        conn = store.connect(where, readonly=True)
        try:
            rows = store.slowest(conn, len(ids), trace_ids=ids)
        finally:
            conn.close()
    except FileNotFoundError:
        return None
    except Exception as e:  # locked / half-created: try again
        logger.debug("store read failed: %s", e)
        return None
    return {r["trace_id"]: r for r in rows}


def wait_for_traces(where: store.StoreLocation, results: Sequence[RequestResult], timeout_s: float) -> dict[str, dict]:
    """Poll the store (read-only, every 0.5 s; blocks the calling thread) until
    every request has a trace and every completed one has its handoff and
    TTFT (the router's, for a request kvlens' router answered: the engines'
    TTFT can settle before the router's root span replaces it), or
    ``timeout_s`` passes. Returns what is there (trace id ->
    ``store.slowest`` row)."""
    ids = [r.trace for r in results]
    need_handoff = {r.trace for r in results if r.ok}
    routed = {r.trace for r in results if r.ok and r.kvlens_router}
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict] = {}
    while True:
        got = _read_traces(where, ids)
        if got is not None:
            found = got
        complete = all(i in found for i in ids) and all(
            found[i].get("handoff_s") is not None
            and found[i].get("ttft_s") is not None
            and (i not in routed or found[i].get("ttft_source") == "router")
            for i in need_handoff
        )
        if complete or time.monotonic() >= deadline:
            return _with_cpu_wait(where, found)
        time.sleep(0.5)


def _with_cpu_wait(where: store.StoreLocation, found: dict[str, dict]) -> dict[str, dict]:
    """``found`` with each completed trace's handoff CPU wait (``handoff_cpu_wait_s``,
    :mod:`kvtrace.cpusplit`; None: unknown), from one more read of their spans."""
    from kvtrace import cpusplit, tracemodel

    ids = [i for i, r in found.items() if r.get("handoff_s") is not None]
    try:
        with store.reading(where) as conn:
            trs = tracemodel.find(conn, ids) if ids else {}
    except Exception as e:  # the figures stay unknown; the row's other figures stand
        logger.warning("could not read the spans for the CPU split: %s", e)
        trs = {}
    for i in ids:
        t = trs.get(i)
        found[i] = {**found[i], "handoff_cpu_wait_s": cpusplit.handoff_cpu(t).cpu_wait_s if t else None}
    return found
