"""What one grid cell measured: the client's per-request results, the
router's traces of exactly those requests (read back from the store by
trace id), and the row that summarizes both (schema:
:mod:`exporters.benchrows`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from exporters import store
from kvlens.bench.grid import BenchOptions
from kvlens.bench.stats import mean, percentile, rel_diff

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One router to load: its mode, push dispatch (None for pull), URL."""

    mode: str
    dispatch: str | None
    url: str

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.dispatch}" if self.dispatch else self.mode


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds from ``send_s``
    (a ``time.perf_counter`` reading)."""

    request_id: str  # = the trace id (sent as X-Request-Id)
    ok: bool
    status: int | None = None
    error: str | None = None
    send_s: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    latency_s: float | None = None  # send -> end of stream
    last_token_s: float | None = None  # send -> last token
    output_tokens: int | None = None
    prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.last_token_s is None or not self.output_tokens:
            return None
        if self.output_tokens < 2:
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


def _trace_figures(cell: Cell) -> dict:
    """The row's keys that come from the store's traces."""
    ok = [r for r in cell.results if r.ok]
    tr_ok = [cell.traces.get(r.request_id) for r in ok]
    handoffs = [t["handoff_s"] for t in tr_ok if t and t.get("handoff_s") is not None]
    router_ttfts = [t["ttft_s"] for t in tr_ok if t and t.get("ttft_s") is not None]
    diffs = [rel_diff(r.ttft_s, (cell.traces.get(r.request_id) or {}).get("ttft_s")) for r in ok]
    outcomes: dict[str, int] = {}
    for r in cell.results:
        if not r.ok:
            o = (cell.traces.get(r.request_id) or {}).get("outcome") or "not in store"
            outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "handoff_p50_s": percentile(handoffs, 50),
        "handoff_p99_s": percentile(handoffs, 99),
        "router_ttft_p50_s": percentile(router_ttfts, 50),
        "ttft_client_vs_router_rel_diff_p50": percentile(diffs, 50),
        "handoff_n": len(handoffs),
        "traces_in_store": sum(1 for r in cell.results if r.request_id in cell.traces),
        "traces_ok_in_store": sum(1 for t in cell.traces.values() if t.get("outcome") == "ok"),
        "failed_outcomes": outcomes,
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
        "tpot_mean_s": mean(r.tpot_s for r in ok),
        "handoff_p50_s": tr.pop("handoff_p50_s"),
        "handoff_p99_s": tr.pop("handoff_p99_s"),
        "req_per_s": (len(ok) / cell.duration_s) if cell.duration_s > 0 and ok else None,
        "e2e_p50_s": percentile((r.latency_s for r in ok), 50),
        "e2e_p99_s": percentile((r.latency_s for r in ok), 99),
        **tr,
        "prompt_tokens_mean": mean(r.prompt_tokens for r in ok),
        "output_tokens_mean": mean(r.output_tokens for r in ok),
        "duration_s": cell.duration_s,
        "prefix_caching": prefix_caching,
        "url": cell.target.url,
    }


def _read_traces(store_path: Path, ids: list[str]) -> dict[str, dict] | None:
    """trace id -> ``store.slowest`` row; None when the store cannot be read yet."""
    try:
        conn = store.connect(store_path, readonly=True)
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


def wait_for_traces(store_path: Path, results: Sequence[RequestResult], timeout_s: float) -> dict[str, dict]:
    """Poll the store (read-only, every 0.5 s; blocks the calling thread) until
    every request has a trace and every completed one has its handoff and
    TTFT, or ``timeout_s`` passes. Returns what is there (trace id ->
    ``store.slowest`` row)."""
    ids = [r.request_id for r in results]
    need_handoff = {r.request_id for r in results if r.ok}
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict] = {}
    while True:
        got = _read_traces(store_path, ids)
        if got is not None:
            found = got
        complete = all(i in found for i in ids) and all(
            found[i].get("handoff_s") is not None and found[i].get("ttft_s") is not None for i in need_handoff
        )
        if complete or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)
