"""``kvlens bench``: a push-vs-pull benchmark grid on a real P/D stack.

For each stack variant (pull; push with each dispatch) and each grid cell
(input length x QPS) it sends ``num_prompts`` random prompts of exactly that
many tokens as an open-loop Poisson process, streaming, ``ignore_eos`` so
every request yields ``output_len`` tokens, and records client-side TTFT,
TPOT and end-to-end latency. Every request carries its own 32-hex
``X-Request-Id``; the router keeps it as the trace id, so after a cell the
span-derived handoff (``prefill.finished`` -> ``kv.ready``) of exactly those
requests is read back from the trace store and joined to the client figures.

Rows go to the store (``bench_rows``, for the dashboard) and, with
``--json``, to a JSON-lines file as each cell completes, so Ctrl-C keeps
what finished. Pull runs first so that each push row can carry its
push/pull ratios when it is written.

The load generator is small and self-contained (asyncio + httpx, prompts
from the model's own ``tokenizers`` file, built the way vLLM's
``RandomDataset`` builds them). vLLM's ``vllm.benchmarks`` was the first
choice, but importing it pulls in most of vLLM (over a minute of wall time
on a loaded 2-core host, competing with the servers under test), and its
request function starts the TTFT clock on the first chunk even when the
chunk has no text, while the router's span TTFT starts on the first chunk
with text: the cross-check would compare two definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import secrets
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from kvlens import home as kvhome

logger = logging.getLogger("kvlens.bench")

MODES = ("push", "pull")
DISPATCHES = ("overlapped", "sequential")
DEFAULT_MAX_MODEL_LEN = 4096
TTFT_CROSSCHECK_WARN = 0.02  # median relative client-vs-router TTFT difference

#: Keys every row has (the ``--json`` contract; the dashboard reads these).
ROW_KEYS = (
    "mode", "dispatch", "qps", "input_len", "output_len", "num_prompts", "completed", "failed",
    "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "handoff_p50_s", "handoff_p99_s",
    "req_per_s",
)  # fmt: skip


class BenchError(ValueError):
    """Bad input found before any load is sent (exit code 2)."""


# =================================================================== pure part
def parse_list(text: str, kind: type, what: str) -> list:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]``; a clear BenchError otherwise."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise BenchError(f"{what}: empty list")
    out = []
    for t in items:
        try:
            v = kind(t)
        except ValueError:
            raise BenchError(f"{what}: {t!r} is not a{'n integer' if kind is int else ' number'}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise BenchError(f"{what}: {t!r} is not a finite number")
        out.append(v)
    return out


def parse_names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not names:
        raise BenchError(f"{what}: empty list")
    for n in names:
        if n not in allowed:
            raise BenchError(f"unknown {what} {n!r}: choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def validate_grid(
    *,
    modes: Sequence[str],
    dispatches: Sequence[str],
    qps: Sequence[float],
    input_lens: Sequence[int],
    output_len: int,
    num_prompts: int,
    max_model_len: int | None = None,
) -> None:
    """Raise BenchError naming the first problem with the grid."""
    for m in modes:
        if m not in MODES:
            raise BenchError(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if not modes:
        raise BenchError("no mode given")
    for d in dispatches:
        if d not in DISPATCHES:
            raise BenchError(f"unknown dispatch {d!r}: choose from {', '.join(DISPATCHES)}")
    if not qps:
        raise BenchError("no QPS given")
    for q in qps:
        if not (isinstance(q, (int, float)) and math.isfinite(q) and q > 0):
            raise BenchError(f"QPS must be > 0, got {q}")
    if not input_lens:
        raise BenchError("no input length given")
    for n in input_lens:
        if int(n) != n or n < 1:
            raise BenchError(f"input length must be a positive integer, got {n}")
    if int(output_len) != output_len or output_len < 1:
        raise BenchError(f"output length must be a positive integer, got {output_len}")
    if int(num_prompts) != num_prompts or num_prompts < 1:
        raise BenchError(f"num-prompts must be a positive integer, got {num_prompts}")
    if max_model_len:
        for n in input_lens:
            if n + output_len > max_model_len:
                raise BenchError(
                    f"input length {n} + output length {output_len} = {n + output_len} tokens "
                    f"exceeds the model's max-model-len {max_model_len}"
                )


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest
    ranks (numpy's default); None for no values. None entries are ignored."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def rel_diff(a: float | None, b: float | None) -> float | None:
    """|a - b| / b (None when undefined)."""
    if a is None or b is None or b <= 0:
        return None
    return abs(a - b) / b


def cell_key(row: dict) -> tuple:
    return (int(row["input_len"]), int(row["output_len"]), float(row["qps"]))


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set ``ttft_p50_push_over_pull`` and ``handoff_p50_push_over_pull`` on
    every push row that has a pull row for the same cell (None elsewhere).
    Each push dispatch is compared with pull. Returns ``rows`` (mutated)."""
    pull = {cell_key(r): r for r in rows if r["mode"] == "pull"}
    for r in rows:
        p = pull.get(cell_key(r)) if r["mode"] == "push" else None
        r["ttft_p50_push_over_pull"] = ratio(r.get("ttft_p50_s"), p.get("ttft_p50_s")) if p else None
        r["handoff_p50_push_over_pull"] = ratio(r.get("handoff_p50_s"), p.get("handoff_p50_s")) if p else None
    return rows


def variant(row: dict) -> str:
    return f"push ({row['dispatch']})" if row["mode"] == "push" and row.get("dispatch") else row["mode"]


def sort_rows(rows: Iterable[dict]) -> list[dict]:
    """Display order: by input length, QPS, then push variants before pull."""
    order = {"overlapped": 0, "sequential": 1, None: 2}
    return sorted(
        rows,
        key=lambda r: (r["input_len"], r["qps"], 0 if r["mode"] == "push" else 1, order.get(r.get("dispatch"), 3)),
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


TABLE_COLUMNS = (
    ("mode", lambda r: r["mode"]),
    ("dispatch", lambda r: r.get("dispatch") or "-"),
    ("input", lambda r: str(r["input_len"])),
    ("QPS", lambda r: f"{r['qps']:g}"),
    ("TTFT mean ms", lambda r: _ms(r.get("ttft_mean_s"))),
    ("TTFT p50 ms", lambda r: _ms(r.get("ttft_p50_s"))),
    ("TTFT p99 ms", lambda r: _ms(r.get("ttft_p99_s"))),
    ("TPOT mean ms", lambda r: _ms(r.get("tpot_mean_s"))),
    ("handoff p50 ms", lambda r: _ms(r.get("handoff_p50_s"))),
    ("handoff p99 ms", lambda r: _ms(r.get("handoff_p99_s"))),
    ("req/s", lambda r: "-" if r.get("req_per_s") is None else f"{r['req_per_s']:.2f}"),
    ("completed", lambda r: str(r["completed"])),
    ("failed", lambda r: str(r["failed"])),
    ("TTFT p50 push/pull", lambda r: _x(r.get("ttft_p50_push_over_pull"))),
    ("handoff p50 push/pull", lambda r: _x(r.get("handoff_p50_push_over_pull"))),
)


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table (pure; tested). Ratios < 1: push is faster."""
    if not rows:
        return "(no rows)"
    cells = [[h for h, _ in TABLE_COLUMNS]] + [[f(r) for _, f in TABLE_COLUMNS] for r in sort_rows(rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _compare(name: str, r: float | None, push_v: float | None, pull_v: float | None) -> str:
    if r is None:
        return f"{name}: no comparison (missing figure)"
    fig = f"{_ms(push_v)} ms vs {_ms(pull_v)} ms"
    if abs(r - 1.0) < 0.02:
        return f"{name} {fig}: a tie (within 2%)"
    if r < 1:
        return f"{name} {fig}: push {(1 - r) * 100:.0f}% lower"
    return f"{name} {fig}: pull {(1 - 1 / r) * 100:.0f}% lower"


def describe(rows: Sequence[dict]) -> list[str]:
    """Plain-words findings computed from the rows: per cell who had the
    lower TTFT p50 and handoff p50, by how much, then a tally per push
    dispatch. Needs :func:`add_ratios` to have run."""
    out: list[str] = []
    push_rows = [r for r in sort_rows(rows) if r["mode"] == "push"]
    pull = {cell_key(r): r for r in rows if r["mode"] == "pull"}
    compared = [r for r in push_rows if cell_key(r) in pull]
    if not compared:
        return ["No push/pull pair ran on the same cell, so there is nothing to compare."]
    for r in compared:
        p = pull[cell_key(r)]
        out.append(
            f"input {r['input_len']} tokens, {r['qps']:g} QPS, {variant(r)} vs pull: "
            + _compare("TTFT p50", r.get("ttft_p50_push_over_pull"), r.get("ttft_p50_s"), p.get("ttft_p50_s"))
            + "; "
            + _compare("handoff p50", r.get("handoff_p50_push_over_pull"), r.get("handoff_p50_s"), p.get("handoff_p50_s"))
        )
    for d in dict.fromkeys(r.get("dispatch") for r in compared):
        mine = [r for r in compared if r.get("dispatch") == d]
        for metric, key in (("TTFT p50", "ttft_p50_push_over_pull"), ("handoff p50", "handoff_p50_push_over_pull")):
            rs = [r[key] for r in mine if r.get(key) is not None]
            if not rs:
                continue
            wins = sum(1 for x in rs if x < 1)
            med = statistics.median(rs)
            who = "push" if med < 1 else "pull"
            by = (1 - med) * 100 if med < 1 else (1 - 1 / med) * 100
            out.append(
                f"Overall, push ({d}) had the lower {metric} in {wins} of {len(rs)} cells; "
                f"median push/pull ratio {med:.2f} ({who} {by:.0f}% lower at the median; "
                f"range {min(rs):.2f}-{max(rs):.2f})."
            )
    return out


# =============================================================== data types
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
    request_id: str
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
    target: Target
    qps: float
    input_len: int
    results: list[RequestResult]
    traces: dict[str, dict]
    duration_s: float
    row: dict = field(default_factory=dict)


@dataclass
class BenchOptions:
    qps: Sequence[float] = (1.0, 2.0, 4.0)
    input_lens: Sequence[int] = (256, 1024, 2048)
    output_len: int = 32
    num_prompts: int = 32
    seed: int = 0
    warmup: int = 2
    trace_wait_s: float = 30.0
    store: Path | str | None = None
    json_path: Path | str | None = None
    prefix_caching: bool = False
    progress: bool = True
    request_timeout_s: float = 120.0
    model: Path | str | None = None  # tokenizer (and model for started stacks)


@dataclass
class BenchRun:
    run_id: str
    store: Path
    json_path: Path | None
    cells: list[Cell] = field(default_factory=list)
    interrupted: bool = False
    _sink: Any = None

    def sink(self) -> "Sink":
        if self._sink is None:
            self._sink = Sink(self)
        return self._sink

    @property
    def rows(self) -> list[dict]:
        return [c.row for c in self.cells]


def summarize_cell(cell: Cell, opts: BenchOptions, run_id: str, prefix_caching: str) -> dict:
    """The row for one finished cell (pure given the cell)."""
    res = cell.results
    ok = [r for r in res if r.ok]
    failed = [r for r in res if not r.ok]
    ttfts = [r.ttft_s for r in ok]
    tr_ok = [cell.traces.get(r.request_id) for r in ok]
    handoffs = [t["handoff_s"] for t in tr_ok if t and t.get("handoff_s") is not None]
    router_ttfts = [t["ttft_s"] for t in tr_ok if t and t.get("ttft_s") is not None]
    diffs = [
        rel_diff(r.ttft_s, (cell.traces.get(r.request_id) or {}).get("ttft_s")) for r in ok
    ]
    outcomes: dict[str, int] = {}
    for r in failed:
        t = cell.traces.get(r.request_id)
        o = (t or {}).get("outcome") or "not in store"
        outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "run_id": run_id,
        "mode": cell.target.mode,
        "dispatch": cell.target.dispatch,
        "qps": float(cell.qps),
        "input_len": int(cell.input_len),
        "output_len": int(opts.output_len),
        "num_prompts": len(res),
        "completed": len(ok),
        "failed": len(failed),
        "ttft_mean_s": mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_mean_s": mean(r.tpot_s for r in ok),
        "handoff_p50_s": percentile(handoffs, 50),
        "handoff_p99_s": percentile(handoffs, 99),
        "req_per_s": (len(ok) / cell.duration_s) if cell.duration_s > 0 and ok else None,
        "e2e_p50_s": percentile((r.latency_s for r in ok), 50),
        "e2e_p99_s": percentile((r.latency_s for r in ok), 99),
        "router_ttft_p50_s": percentile(router_ttfts, 50),
        "ttft_client_vs_router_rel_diff_p50": percentile(diffs, 50),
        "handoff_n": len(handoffs),
        "traces_in_store": sum(1 for r in res if r.request_id in cell.traces),
        "traces_ok_in_store": sum(1 for t in cell.traces.values() if t.get("outcome") == "ok"),
        "failed_outcomes": outcomes,
        "prompt_tokens_mean": mean(r.prompt_tokens for r in ok),
        "output_tokens_mean": mean(r.output_tokens for r in ok),
        "duration_s": cell.duration_s,
        "prefix_caching": prefix_caching,
        "url": cell.target.url,
    }


@dataclass
class CrossCheck:
    n_compared: int
    ttft_rel_diff_p50: float | None
    ttft_diff_p50_s: float | None  # client - router, signed
    completed: int
    ok_traces_in_store: int
    sent: int
    traces_in_store: int
    handoff_missing: int
    failed: list[tuple[str, str, str, str]]  # (variant, request id, client error, store outcome)

    @property
    def ttft_warn(self) -> bool:
        return self.ttft_rel_diff_p50 is not None and self.ttft_rel_diff_p50 > TTFT_CROSSCHECK_WARN

    def lines(self) -> list[str]:
        out = []
        if self.n_compared:
            out.append(
                f"client TTFT vs router span TTFT (traces.ttft_s), {self.n_compared} requests: median relative "
                f"difference {self.ttft_rel_diff_p50 * 100:.2f}%, median client-minus-router "
                f"{self.ttft_diff_p50_s * 1000:+.2f} ms"
            )
            if self.ttft_warn:
                out.append(
                    f"WARNING: client and router TTFT differ by more than {TTFT_CROSSCHECK_WARN:.0%} at the median "
                    "(client-side overhead: HTTP hop, event loop under load)"
                )
        else:
            out.append("client TTFT vs router span TTFT: no request had both figures (traces missing?)")
        same = self.completed == self.ok_traces_in_store
        out.append(
            f"completed requests {self.completed} vs ok traces in the store for this run {self.ok_traces_in_store}: "
            + ("match" if same else "MISMATCH")
            + f" ({self.traces_in_store} of {self.sent} sent requests have a trace)"
        )
        if self.handoff_missing:
            out.append(f"WARNING: {self.handoff_missing} completed requests have no handoff in the store")
        if self.failed:
            out.append(f"failed requests ({len(self.failed)}):")
            for v, rid, err, outcome in self.failed[:20]:
                out.append(f"  {v} {rid}: store outcome {outcome}; client: {err}")
            if len(self.failed) > 20:
                out.append(f"  ... and {len(self.failed) - 20} more")
        else:
            out.append("failed requests: none")
        return out


def cross_check(cells: Sequence[Cell]) -> CrossCheck:
    diffs, signed = [], []
    completed = ok_in_store = sent = in_store = missing = 0
    failed = []
    for c in cells:
        for r in c.results:
            sent += 1
            t = c.traces.get(r.request_id)
            if t is not None:
                in_store += 1
            if r.ok:
                completed += 1
                if t is not None and t.get("outcome") == "ok":
                    ok_in_store += 1
                if t is None or t.get("handoff_s") is None:
                    missing += 1
                rt = (t or {}).get("ttft_s")
                if rt is not None and r.ttft_s is not None:
                    diffs.append(rel_diff(r.ttft_s, rt))
                    signed.append(r.ttft_s - rt)
            else:
                failed.append((c.target.label, r.request_id, r.error or f"HTTP {r.status}",
                               (t or {}).get("outcome") or "not in store"))
    return CrossCheck(
        n_compared=len(diffs),
        ttft_rel_diff_p50=percentile(diffs, 50),
        ttft_diff_p50_s=percentile(signed, 50),
        completed=completed,
        ok_traces_in_store=ok_in_store,
        sent=sent,
        traces_in_store=in_store,
        handoff_missing=missing,
        failed=failed,
    )


def new_request_id() -> str:
    """A fresh W3C-valid trace id (32 lowercase hex, not all zero)."""
    while True:
        rid = secrets.token_hex(16)
        if int(rid, 16):
            return rid


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


# ================================================================== prompts
class PromptMaker:
    """Random prompts of an exact token count, built like vLLM's
    ``RandomDataset``: consecutive non-special token ids from a random
    offset, decoded, re-encoded and adjusted until the count matches."""

    def __init__(self, model_dir: Path | str):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BenchError(f"no tokenizer.json in {model_dir} (pass --model DIR)")
        self.tok = Tokenizer.from_file(str(path))
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.vocab = self.tok.get_vocab_size()
        self.allowed = [i for i in range(self.vocab) if i not in special]
        # tokens the server adds itself (BOS...), as vLLM subtracts them
        probe = "hello"
        self.num_special = max(
            0, len(self.tok.encode(probe, add_special_tokens=True).ids) - len(self.tok.encode(probe, add_special_tokens=False).ids)
        )

    def make(self, n_tokens: int, rng) -> str:
        """A prompt that re-encodes to exactly ``n_tokens`` (with the server's
        special tokens). Decode/encode does not always round-trip, so a few
        random starting points are tried; the closest one is the fallback."""
        target = max(1, n_tokens - self.num_special)
        best, best_err = "", None
        for _attempt in range(20):
            off = int(rng.integers(0, len(self.allowed)))
            ids = [self.allowed[(off + i) % len(self.allowed)] for i in range(target)]
            for _ in range(12):
                text = self.tok.decode(ids)
                ids = self.tok.encode(text, add_special_tokens=False).ids
                err = abs(len(ids) - target)
                if best_err is None or err < best_err:
                    best, best_err = text, err
                if err == 0:
                    return text
                if len(ids) > target:
                    ids = ids[:target]
                else:
                    extra = rng.integers(0, len(self.allowed), size=target - len(ids))
                    ids = ids + [self.allowed[int(j)] for j in extra]
        return best


# ================================================================ load side
def _sse_events(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    try:
        ev = json.loads(data)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


async def one_request(client, url: str, model: str | None, prompt: str, output_len: int, rid: str) -> RequestResult:
    """One streaming completion through the router; never raises (except on
    cancellation)."""
    import httpx

    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    res = RequestResult(request_id=rid, ok=False)
    t0 = time.perf_counter()
    res.send_s = t0
    n_text = 0
    try:
        async with client.stream(
            "POST", url.rstrip("/") + "/v1/completions", json=body, headers={"X-Request-Id": rid}
        ) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                msg = raw[:300]
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    msg = json.loads(raw)["error"]["message"][:300]
                res.error = f"HTTP {resp.status_code}: {msg}"
                return res
            async for line in resp.aiter_lines():
                ev = _sse_events(line)
                if ev is None:
                    continue
                if "error" in ev:
                    err = ev["error"]
                    res.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                    continue
                now = time.perf_counter() - t0
                for ch in ev.get("choices") or ():
                    if isinstance(ch, dict) and ch.get("text"):
                        n_text += 1
                        if res.ttft_s is None:
                            res.ttft_s = now
                        res.last_token_s = now
                        break
                usage = ev.get("usage")
                if isinstance(usage, dict):
                    res.output_tokens = usage.get("completion_tokens")
                    res.prompt_tokens = usage.get("prompt_tokens")
        res.latency_s = time.perf_counter() - t0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.output_tokens is None:
        res.output_tokens = n_text
    if res.error is None and res.ttft_s is None:
        res.error = "stream ended without any generated text"
    res.ok = res.error is None
    return res


async def run_cell_async(
    target: Target,
    model: str | None,
    prompts: Sequence[str],
    qps: float,
    output_len: int,
    rng,
    *,
    timeout_s: float = 120.0,
    pbar=None,
) -> tuple[list[RequestResult], float]:
    """Open-loop Poisson arrivals at ``qps``; returns (results in send order,
    duration from first send to last completion)."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    gaps = [0.0] + [float(g) for g in rng.exponential(1.0 / qps, size=max(0, len(prompts) - 1))]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False) as client:
        loop = asyncio.get_running_loop()
        tasks = []
        start = loop.time()
        due = 0.0

        n_failed = 0

        async def go(p: str) -> RequestResult:
            nonlocal n_failed
            r = await one_request(client, target.url, model, p, output_len, new_request_id())
            if pbar is not None:
                if not r.ok:
                    n_failed += 1
                    pbar.set_postfix_str(f"failed {n_failed}", refresh=False)
                pbar.update(1)
            return r

        try:
            for p, gap in zip(prompts, gaps):
                due += gap
                delay = start + due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(go(p)))
            results = list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
            raise
    t_first = min(r.send_s for r in results)
    t_last = max(r.send_s + (r.latency_s or 0.0) for r in results)
    return results, max(t_last - t_first, 1e-9)


def wait_for_traces(store_path: Path, results: Sequence[RequestResult], timeout_s: float) -> dict[str, dict]:
    """Poll the store (read-only) until every request has a trace and every
    completed one has its handoff, or ``timeout_s`` passes. Returns what is
    there (trace id -> ``store.slowest`` row)."""
    from exporters import store

    ids = [r.request_id for r in results]
    need_handoff = {r.request_id for r in results if r.ok}
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict] = {}
    while True:
        try:
            conn = store.connect(store_path, readonly=True)
            try:
                rows = store.slowest(conn, len(ids), trace_ids=ids)
            finally:
                conn.close()
            found = {r["trace_id"]: r for r in rows}
        except FileNotFoundError:
            pass
        except Exception as e:  # locked / half-created: try again
            logger.debug("store read failed: %s", e)
        complete = all(i in found for i in ids) and all(
            found[i].get("handoff_s") is not None and found[i].get("ttft_s") is not None for i in need_handoff
        )
        if complete or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


# ============================================================== orchestration
def _get_json(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    import httpx

    with httpx.Client(timeout=timeout, trust_env=False) as c:
        r = c.get(url)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


@dataclass
class RouterInfo:
    url: str
    mode: str | None
    dispatch: str | None
    model: str | None
    root: str | None
    max_model_len: int | None


def probe_router(url: str) -> RouterInfo:
    """``/health`` and ``/v1/models`` of a router; BenchError when it is not
    reachable or not healthy."""
    import httpx

    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--proxy must be an http(s) URL, got {url!r}")
    try:
        status, health = _get_json(url + "/health")
    except httpx.HTTPError as e:
        raise BenchError(f"router at {url} is unreachable ({type(e).__name__}: {e})") from None
    if status != 200:
        raise BenchError(f"router at {url} is not healthy: HTTP {status} {json.dumps(health) if health else ''}".strip())
    health = health if isinstance(health, dict) else {}
    model = root = None
    mml = None
    try:
        st, models = _get_json(url + "/v1/models")
        if st == 200 and isinstance(models, dict) and models.get("data"):
            m0 = models["data"][0]
            model, root, mml = m0.get("id"), m0.get("root"), m0.get("max_model_len")
    except httpx.HTTPError:
        pass
    mode = health.get("mode") if health.get("mode") in MODES else None
    dispatch = health.get("dispatch") if mode == "push" and health.get("dispatch") in DISPATCHES else None
    return RouterInfo(url, mode, dispatch, model, root, int(mml) if mml else None)


def model_max_len(model_dir: Path | str | None) -> int | None:
    """min(config.json max_position_embeddings, the max-model-len stacks use)."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    mpe = cfg.get("max_position_embeddings")
    return min(int(mpe), DEFAULT_MAX_MODEL_LEN) if mpe else DEFAULT_MAX_MODEL_LEN


class Sink:
    """Writes each finished row to the store and the JSON-lines file."""

    def __init__(self, run: BenchRun):
        self.run = run
        if run.json_path:
            run.json_path.parent.mkdir(parents=True, exist_ok=True)
            run.json_path.write_text("")

    def write(self, row: dict) -> None:
        from exporters import store

        conn = store.connect(self.run.store)
        try:
            store.save_bench_rows(conn, self.run.run_id, [row])
        finally:
            conn.close()
        if self.run.json_path:
            with open(self.run.json_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _rng(seed: int, *key: int):
    import numpy as np

    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *key])


def _bench_targets(
    run: BenchRun, sink: Sink, targets: Sequence[Target], opts: BenchOptions, maker: PromptMaker,
    model_name: str | None, prefix_caching: str, target_index0: int = 0,
) -> None:
    """Warm each target up, then run every cell on every target (targets
    interleaved per cell, so drift hits them alike)."""
    from tqdm import tqdm

    for ti, t in enumerate(targets):
        if opts.warmup > 0:
            rng = _rng(opts.seed, 9999, target_index0 + ti)
            prompts = [maker.make(min(opts.input_lens), rng) for _ in range(opts.warmup)]

            async def warm(t=t, prompts=prompts):
                import httpx

                async with httpx.AsyncClient(timeout=opts.request_timeout_s, trust_env=False) as c:
                    for p in prompts:
                        r = await one_request(c, t.url, model_name, p, 2, new_request_id())
                        if not r.ok:
                            logger.warning("warm-up request to %s failed: %s", t.label, r.error)

            asyncio.run(warm())
    ci = 0
    for input_len in opts.input_lens:
        for qps in opts.qps:
            ci += 1
            for ti, t in enumerate(targets):
                rng = _rng(opts.seed, target_index0 + ti, ci)
                prompts = [maker.make(int(input_len), rng) for _ in range(opts.num_prompts)]
                bar = tqdm(
                    total=len(prompts), desc=f"{t.label:<17} in={input_len:<5} qps={qps:<4g}", unit="req",
                    file=sys.stderr, disable=not opts.progress, leave=True, dynamic_ncols=True,
                )
                try:
                    results, dur = asyncio.run(
                        run_cell_async(t, model_name, prompts, float(qps), opts.output_len, rng,
                                       timeout_s=opts.request_timeout_s, pbar=bar)
                    )
                finally:
                    bar.close()
                traces = wait_for_traces(run.store, results, opts.trace_wait_s)
                cell = Cell(t, float(qps), int(input_len), results, traces, dur)
                cell.row = summarize_cell(cell, opts, run.run_id, prefix_caching)
                run.cells.append(cell)
                add_ratios(run.rows)
                sink.write(cell.row)


def _prepare(opts: BenchOptions, modes: Sequence[str], dispatches: Sequence[str],
             model_dir: Path | None, max_len: int | None) -> PromptMaker:
    validate_grid(modes=modes, dispatches=dispatches, qps=list(opts.qps), input_lens=list(opts.input_lens),
                  output_len=opts.output_len, num_prompts=opts.num_prompts, max_model_len=max_len)
    if model_dir is None or not Path(model_dir).is_dir():
        raise BenchError(f"model directory not found: {model_dir} (pass --model DIR)")
    return PromptMaker(model_dir)


def _new_run(opts: BenchOptions) -> BenchRun:
    store_path = Path(opts.store).expanduser().resolve() if opts.store else kvhome.store_path()
    jp = Path(opts.json_path).expanduser().resolve() if opts.json_path else None
    return BenchRun(new_run_id(), store_path, jp)


def bench_routers(routers: Sequence[str | Target], opts: BenchOptions, run: BenchRun | None = None) -> BenchRun:
    """Bench already running routers (e.g. the test session's shared stacks).
    A plain URL is probed for its mode/dispatch on ``/health``. Pull targets
    run first. Raises BenchError before any load on bad input."""
    targets, infos = [], []
    for r in routers:
        if isinstance(r, Target):
            info = probe_router(r.url)
            t = r
        else:
            info = probe_router(r)
            if info.mode is None:
                raise BenchError(f"router at {info.url} does not report its mode on /health: name it (Target or --modes)")
            t = Target(info.mode, info.dispatch, info.url)
        targets.append(t)
        infos.append(info)
    model_dir = Path(opts.model) if opts.model else None
    if model_dir is None:
        roots = [Path(i.root) for i in infos if i.root and (Path(i.root) / "tokenizer.json").is_file()]
        model_dir = roots[0] if roots else kvhome.model_dir()
    lens = [i.max_model_len for i in infos if i.max_model_len] or [model_max_len(model_dir)]
    max_len = min(x for x in lens if x) if any(lens) else None
    maker = _prepare(opts, [t.mode for t in targets], [t.dispatch for t in targets if t.dispatch], model_dir, max_len)
    model_name = next((i.model for i in infos if i.model), None)
    run = run or _new_run(opts)
    sink = run.sink()
    ordered = sorted(targets, key=lambda t: 0 if t.mode == "pull" else 1)
    _bench_targets(run, sink, ordered, opts, maker, model_name, "external")
    return run


def plan_groups(modes: Sequence[str], dispatches: Sequence[str]) -> list[tuple[str, list[str | None]]]:
    """Stacks to start, in order: pull first (so push rows get ratios when
    written), then push with its dispatches (one P/D pair, one router each)."""
    groups: list[tuple[str, list[str | None]]] = []
    if "pull" in modes:
        groups.append(("pull", [None]))
    if "push" in modes:
        groups.append(("push", list(dispatches)))
    return groups


def bench_stacks(modes: Sequence[str], dispatches: Sequence[str], opts: BenchOptions,
                 run: BenchRun | None = None, stack_factory: Callable[..., Any] | None = None) -> BenchRun:
    """Start one stack per mode (pull first), bench it, stop it."""
    from kvlens.up import MAX_MODEL_LEN, Stack

    if opts.model:
        model_dir = Path(opts.model).expanduser().resolve()
    else:
        from kvlens.model import ensure_model

        model_dir = ensure_model(kvhome.model_dir())
    max_len = min(model_max_len(model_dir) or MAX_MODEL_LEN, MAX_MODEL_LEN)
    maker = _prepare(opts, modes, dispatches, model_dir, max_len)
    run = run or _new_run(opts)
    if run.store.name != "traces.db":
        raise BenchError(f"stacks started by kvlens bench write to <home>/traces.db; --store must name such a file, got {run.store}")
    sink = run.sink()
    factory = stack_factory or Stack
    vllm_args = [] if opts.prefix_caching else ["--no-enable-prefix-caching"]
    for ti, (mode, ds) in enumerate(plan_groups(modes, dispatches)):
        stack = factory(mode=mode, dispatch=ds[0] or "overlapped", model=model_dir, port=None,
                        kvlens_home=run.store.parent, vllm_args=vllm_args)
        try:
            stack.start()
            targets = [Target(mode, ds[0], stack.router_url)]
            for d in ds[1:]:
                targets.append(Target(mode, d, stack.add_router(d)))
            _bench_targets(run, sink, targets, opts, maker, _served_name(stack.router_url),
                           "on" if opts.prefix_caching else "off", target_index0=10 * ti)
        finally:
            _stop_quietly(stack)
    return run


def _served_name(url: str) -> str | None:
    with contextlib.suppress(Exception):
        return probe_router(url).model
    return None


def _stop_quietly(stack) -> None:
    """Stop a stack; a second Ctrl-C while stopping must not leave orphans."""
    old = signal.getsignal(signal.SIGINT)
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stack.stop()
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, old)


def report(run: BenchRun, out=None) -> CrossCheck:
    """Print the table, findings and cross-checks for a run."""
    out = out or sys.stdout
    rows = add_ratios(run.rows)
    print("\n" + format_table(rows), file=out)
    print("(times in ms; push/pull < 1: push is faster on that cell)", file=out)
    print("\nWhat this measured:", file=out)
    for line in describe(rows):
        print("  " + line, file=out)
    cc = cross_check(run.cells)
    print("\nCross-checks:", file=out)
    for line in cc.lines():
        print("  " + line, file=out)
    where = f"run {run.run_id}: {len(rows)} rows saved to {run.store}"
    if run.json_path:
        where += f" and {run.json_path}"
    print("\n" + where, file=out, flush=True)
    return cc


# ===================================================================== CLI
def add_grid_arguments(p: argparse.ArgumentParser, *, qps: str, input_len: str, output_len: int, num_prompts: int) -> None:
    p.add_argument("--qps", default=qps, help=f"comma list of request rates (Poisson), default {qps}")
    p.add_argument("--input-len", default=input_len, help=f"comma list of prompt lengths in tokens, default {input_len}")
    p.add_argument("--output-len", type=int, default=output_len, help=f"tokens per answer (ignore_eos), default {output_len}")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests per cell, default {num_prompts}")
    p.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    p.add_argument("--prefix-caching", choices=["off", "on"], default="off",
                   help="vLLM prefix caching on started stacks (default off: every request transfers all its KV)")
    p.add_argument("--model", type=Path, default=None,
                   help="model dir (default: generated tiny model in $KVLENS_HOME/model; with --proxy: the served one)")
    p.add_argument("--store", default=None, help="trace store (default $KVLENS_HOME/traces.db)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write rows as JSON lines here")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per router before the grid (default 2)")
    p.add_argument("--trace-wait", type=float, default=30.0, help="seconds to wait for a cell's traces (default 30)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds before a request counts as failed (default 120)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None,
                   help="comma list of push, pull (default push,pull; with --proxy: the router's mode)")
    p.add_argument("--dispatch", default="overlapped",
                   help="push dispatch(es), comma list of overlapped, sequential (default overlapped)")
    p.add_argument("--proxy", default=None, metavar="URL",
                   help="bench this running router instead of starting stacks (one mode)")
    add_grid_arguments(p, qps="1,2,4", input_len="256,1024,2048", output_len=32, num_prompts=32)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.trace_wait >= 0:
        raise BenchError(f"--trace-wait must be >= 0, got {args.trace_wait}")
    if not args.request_timeout > 0:
        raise BenchError(f"--request-timeout must be > 0, got {args.request_timeout}")
    return BenchOptions(
        qps=parse_list(args.qps, float, "--qps"),
        input_lens=parse_list(args.input_len, int, "--input-len"),
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        seed=args.seed,
        warmup=args.warmup,
        trace_wait_s=args.trace_wait,
        store=args.store,
        json_path=args.json_path,
        prefix_caching=args.prefix_caching == "on",
        progress=not args.no_progress,
        request_timeout_s=args.request_timeout,
        model=args.model,
    )


class _Terminate(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C (stacks stopped, finished rows kept)."""


def _on_term(signum, frame):
    raise _Terminate()


def quiet_http_logs(args: argparse.Namespace) -> None:
    """httpx logs every request at INFO: one line per benchmark request."""
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    from kvlens.up import StackError

    quiet_http_logs(args)
    try:
        opts = options_from_args(args)
        dispatches = parse_names(args.dispatch, DISPATCHES, "dispatch")
        modes = parse_names(args.modes, MODES, "mode") if args.modes else None
        # the stacks kvlens starts serve --max-model-len 4096; a --proxy router
        # reports its own max_model_len (checked in bench_routers)
        max_len = None if args.proxy else (model_max_len(opts.model) or DEFAULT_MAX_MODEL_LEN)
        validate_grid(modes=modes or ["push"], dispatches=dispatches, qps=opts.qps, input_lens=opts.input_lens,
                      output_len=opts.output_len, num_prompts=opts.num_prompts, max_model_len=max_len)
        if args.proxy:
            info = probe_router(args.proxy)
            if info.mode is not None:
                if modes and modes != [info.mode]:
                    raise BenchError(f"router at {info.url} serves {info.mode}, but --modes says {','.join(modes)}")
                target = Target(info.mode, info.dispatch, info.url)
            else:
                if not modes or len(modes) != 1:
                    raise BenchError("with --proxy, --modes must name exactly one mode (the router does not report it)")
                target = Target(modes[0], dispatches[0] if modes[0] == "push" else None, info.url)
    except BenchError as e:
        print(f"kvlens bench: error: {e}", file=sys.stderr, flush=True)
        return 2

    old = signal.signal(signal.SIGTERM, _on_term)
    run_ = _new_run(opts)
    try:
        if args.proxy:
            bench_routers([target], opts, run=run_)
        else:
            bench_stacks(modes or list(MODES), dispatches, opts, run=run_)
    except BenchError as e:
        print(f"kvlens bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    except StackError as e:
        print(f"kvlens bench: could not start a stack: {e}", file=sys.stderr, flush=True)
        if run_.cells:
            report(run_)
        return 1
    except KeyboardInterrupt:
        run_.interrupted = True
        print(f"\nkvlens bench: interrupted; keeping {len(run_.cells)} finished cells", file=sys.stderr, flush=True)
        if run_.cells:
            report(run_)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    cc = report(run_)
    return 0 if cc.completed else 1
