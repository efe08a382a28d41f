"""The live verdict: push against pull on the requests of one window of the
store, compared like with like (``kvlens verdict``, the dashboard's headline).

Pure functions of stored traces. :func:`load` reads the window's requests
(one summary row each, plus the few span attributes the verdict needs: the
prompt length, the split's weight, the TPOT); :func:`compute` turns them into
a :class:`Verdict`: per figure (TTFT p50 and p90, handoff p50, TPOT p50) the
push/pull ratio stratified by prompt-length bucket
(:func:`kvtrace.stats.stratified_ratio`), with its interval, its answer and
the counts per mode and bucket (docs/verdict.md).

Which traces: where the window holds requests whose mode a router's split
drew (``kvlens.split`` on the root span: a canary, both modes on the same
traffic at the same time), only those; otherwise every request of both
modes, and the verdict says so (benchmarks or separate stacks: not the same
traffic, not the same time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

from kvrecord import semconv as sc
from kvtrace import stats, store
from kvtrace.store.writer import TOKEN_SPANS

#: Upper ends (prompt tokens, inclusive) of the prompt-length buckets; one
#: more bucket holds the longer prompts.
BUCKET_EDGES: tuple[int, ...] = (512, 2048, 8192)
#: The bucket of a request whose prompt length no stored span gives (its
#: spans not kept under ``--keep sampled``, or recorded without it).
UNKNOWN_LENGTH = "length unknown"
#: Most requests one verdict reads (the newest of the window): bounded memory
#: and a bounded wait for the dashboard's headline.
MAX_REQUESTS = 20_000
#: The figures compared: (key, request field, percentile, words).
METRICS: tuple[tuple[str, str, float, str], ...] = (
    ("ttft_p50", "ttft_s", 50.0, "TTFT p50"),
    ("ttft_p90", "ttft_s", 90.0, "TTFT p90"),
    ("handoff_p50", "handoff_s", 50.0, "handoff p50"),
    ("tpot_p50", "tpot_s", 50.0, "TPOT p50"),
    ("handoff_nowait_p50", "handoff_nowait_s", 50.0, "CPU wait removed: handoff p50"),
)
#: Most requests whose handoff is split into CPU wait and the rest (their spans
#: are read: :mod:`kvtrace.cpusplit`): the newest of the window.
MAX_CPU_REQUESTS = 2000
#: A mode's median CPU-wait share of the handoff from which the verdict says the
#: host's contention decides the comparison.
CPU_DECIDES_SHARE = 0.25
#: The root span (split weight, TPOT); the prompt length is on TOKEN_SPANS (P's
#: first: the length P computed), the spans the store's fold reads too.
_ROOT = sc.Phase.REQUEST.value
PUSH, PULL = sc.Mode.PUSH.value, sc.Mode.PULL.value
NEEDS_BOTH = "needs both modes in the window"


def bucket_of(tokens: int | None, edges: Sequence[int] = BUCKET_EDGES) -> str:
    """The prompt-length bucket's name: ``<=512 tokens``, ``513-2048``, ..., ``>8192``."""
    if tokens is None:
        return UNKNOWN_LENGTH
    lo = 0
    for i, hi in enumerate(edges):
        if tokens <= hi:
            return f"<={hi} tokens" if i == 0 else f"{lo + 1}-{hi}"
        lo = hi
    return f">{edges[-1]}"


def bucket_names(edges: Sequence[int] = BUCKET_EDGES) -> list[str]:
    """Every bucket's name in length order, :data:`UNKNOWN_LENGTH` last."""
    return [bucket_of(e, edges) for e in edges] + [f">{edges[-1]}", UNKNOWN_LENGTH]


class Request(NamedTuple):
    """One request of the window, as the verdict reads it (seconds; None: unknown)."""

    trace_id: str
    mode: str | None
    dispatch: str | None
    outcome: str | None
    start_ns: int | None
    tokens: int | None
    split: float | None
    ttft_s: float | None
    handoff_s: float | None
    tpot_s: float | None
    #: the handoff's critical-path CPU wait (kvtrace.cpusplit); None: unknown (no figures, spans not read)
    cpu_wait_s: float | None = None

    @property
    def handoff_nowait_s(self) -> float | None:
        """The handoff with its CPU wait removed (None where either is unknown)."""
        if self.handoff_s is None or self.cpu_wait_s is None:
            return None
        return self.handoff_s - self.cpu_wait_s

    @property
    def cpu_wait_share(self) -> float | None:
        if self.cpu_wait_s is None or not self.handoff_s or self.handoff_s <= 0:
            return None
        return self.cpu_wait_s / self.handoff_s


def _num(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return float(v) if ok else None


def load(
    conn, *, since_ns: int | None, until_ns: int | None = None, limit: int = MAX_REQUESTS, sched: Any = None
) -> list[Request]:
    """The window's requests, newest first, at most ``limit`` (runs on the
    caller's thread); ``sched``: the kernel's scheduler record, where one was
    kept (:func:`with_cpu_wait`). One read of the summaries, which carry the prompt
    length, split weight and TPOT since schema 7 (also for requests kept as
    their summary only); a second read of span attributes only for the rows
    that lack them (written before schema 7): the few spans named in
    :data:`kvtrace.store.writer.TOKEN_SPANS` and the root."""
    rows = store.slowest(conn, limit, order="start", since_ns=since_ns, until_ns=until_ns)
    old = [r["trace_id"] for r in rows if r.get("prompt_tokens") is None]
    attrs = store.attributes_of(conn, old, (*TOKEN_SPANS, _ROOT)) if old else {}
    per: dict[str, dict[str, dict]] = {}
    for (tid, _role, name, _t0, _t1), a in attrs.items():
        per.setdefault(tid, {}).setdefault(name, a)
    out = []
    for r in rows:
        tokens, split, tpot = r.get("prompt_tokens"), r.get("split"), r.get("tpot_s")
        if tokens is None:
            spans = per.get(r["trace_id"], {})
            root = spans.get(_ROOT, {})
            # P's count first; the router's root span carries it too (from P's answer)
            tokens = next((spans[n].get(sc.ATTR_TOKENS) for n in TOKEN_SPANS if n in spans), root.get(sc.ATTR_TOKENS))
            split = split if split is not None else root.get(sc.ATTR_SPLIT)
            tpot = tpot if tpot is not None else root.get(sc.ATTR_TPOT_S)
        out.append(
            Request(
                r["trace_id"],
                r["mode"],
                r["dispatch"],
                r["outcome"],
                r["start_ns"],
                int(tokens) if _num(tokens) is not None else None,
                _num(split),
                _num(r["ttft_s"]),
                _num(r["handoff_s"]),
                _num(tpot),
            )
        )
    return with_cpu_wait(conn, out, sched=sched)


def with_cpu_wait(conn, requests: list[Request], limit: int = MAX_CPU_REQUESTS, sched: Any = None) -> list[Request]:
    """``requests`` with the handoff's CPU wait of the newest ``limit`` that
    have a handoff (their spans read: :func:`kvtrace.cpusplit.handoff_cpu`,
    through ``sched``, the kernel's scheduler record, where one was kept)."""
    from kvtrace import cpusplit, tracemodel  # the split reads spans: only here

    want = [r.trace_id for r in requests if r.handoff_s is not None][:limit]
    waits: dict[str, float | None] = {}
    for i in range(0, len(want), 500):
        for tid, tr in tracemodel.find(conn, want[i : i + 500]).items():
            waits[tid] = cpusplit.handoff_cpu(tr, sched).cpu_wait_s
    return [r._replace(cpu_wait_s=waits.get(r.trace_id)) for r in requests]


@dataclass(frozen=True)
class Verdict:
    """What :func:`compute` found: ``status`` is ``ok`` or :data:`NEEDS_BOTH`
    (with ``message``); ``ratios`` by metric key; ``counts[mode][bucket]``."""

    status: str
    message: str
    selection: str
    used: int
    left_out: int
    counts: dict[str, dict[str, int]]
    ratios: dict[str, stats.StratifiedRatio] = field(default_factory=dict)
    dispatches: dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    #: per mode: the median CPU-wait share of the handoff (None: no figures), and how many requests had one
    cpu_share: dict[str, float | None] = field(default_factory=dict)
    cpu_n: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "message": self.message,
            "selection": self.selection,
            "requests_used": self.used,
            "requests_left_out": self.left_out,
            "truncated": self.truncated,
            "buckets": bucket_names(),
            "counts": self.counts,
            "push_dispatch": self.dispatches,
            "min_per_stratum": stats.MIN_PER_STRATUM,
            "ratios": {k: r.to_json() for k, r in self.ratios.items()},
            "handoff_cpu_wait_share_p50": self.cpu_share,
            "handoff_cpu_requests": self.cpu_n,
            "cpu_words": cpu_words(self),
        }

    def selection_words(self) -> str:
        return "canary: split-assigned requests" if self.selection == "split" else "all requests, no split"


def ratio_words(r: stats.StratifiedRatio) -> str:
    """``0.82 [0.74-0.91]: push faster``, ``1.03 [0.95-1.12]: no resolvable difference``,
    ``not enough data (why)``."""
    if r.status == stats.NOT_ENOUGH:
        return f"{stats.NOT_ENOUGH} ({r.note})" if r.note else stats.NOT_ENOUGH
    head = f"{r.ratio:.2f} [{r.lo:.2f}-{r.hi:.2f}]"
    if r.status == stats.NO_DIFFERENCE:
        return f"{head}: {stats.NO_DIFFERENCE}"
    return f"{head}: push {'faster' if r.hi < 1 else 'slower'}"


def cpu_words(v: Verdict) -> str | None:
    """What the host's CPU did to the handoff, in one sentence (None: no figures)."""
    sh = v.cpu_share
    if not sh or all(x is None for x in sh.values()):
        return None

    def pct(m: str) -> str:
        x = sh.get(m)
        return "unknown (no CPU figures)" if x is None else f"{x * 100:.0f} %"

    head = (
        f"on this host {pct(PUSH)} of push's and {pct(PULL)} of pull's handoff (median) was threads waiting for a CPU"
    )
    if any(x is not None and x >= CPU_DECIDES_SHARE for x in sh.values()):
        return head + ": the host's contention decides this comparison; see the handoff with CPU wait removed"
    return head


def _select(requests: Sequence[Request]) -> tuple[str, list[Request], int]:
    """("split" | "all", the requests used, how many were left out)."""
    known = [r for r in requests if r.mode in (PUSH, PULL)]
    split = [r for r in known if r.split is not None]
    if split:
        return "split", split, len(requests) - len(split)
    return "all", known, len(requests) - len(known)


def compute(
    requests: Iterable[Request], *, truncated: bool = False, seed: int = 0, resamples: int = stats.RESAMPLES
) -> Verdict:
    """The verdict over ``requests`` (:func:`load`'s): pure."""
    requests = list(requests)
    selection, used, left = _select(requests)
    counts = {m: {b: 0 for b in bucket_names()} for m in (PUSH, PULL)}
    for r in used:
        counts[r.mode][bucket_of(r.tokens)] += 1
    dispatches: dict[str, int] = {}
    for r in used:
        if r.mode == PUSH:
            dispatches[r.dispatch or "unknown"] = dispatches.get(r.dispatch or "unknown", 0) + 1
    n = {m: sum(c.values()) for m, c in counts.items()}
    args = dict(selection=selection, used=len(used), left_out=left, counts=counts, dispatches=dispatches)
    if not n[PUSH] or not n[PULL]:
        has = PUSH if n[PUSH] else PULL if n[PULL] else None
        what = f"only {has} requests ({n[has]})" if has else "no push or pull requests"
        msg = (
            f"{NEEDS_BOTH}: it holds {what}. A verdict compares push and pull on the same traffic: "
            "run both behind kvlens' router with a split (vllm-router is pull only)"
        )
        return Verdict(NEEDS_BOTH, msg, truncated=truncated, **args)
    ratios = {}
    for key, fld, q, _ in METRICS:
        num = {b: [] for b in bucket_names()}
        den = {b: [] for b in bucket_names()}
        for r in used:
            (num if r.mode == PUSH else den)[bucket_of(r.tokens)].append(getattr(r, fld))
        ratios[key] = stats.stratified_ratio(num, den, q=q, seed=seed, resamples=resamples)
        if key == "tpot_p50" and not any(r.tpot_s is not None for r in used):
            why = f"no trace carries a TPOT ({sc.ATTR_TPOT_S} on the router's root span): the router recorded none"
            ratios[key] = stats.StratifiedRatio(stats.NOT_ENOUGH, strata=ratios[key].strata, note=why)
        if key == "handoff_nowait_p50" and not any(r.cpu_wait_s is not None for r in used):
            why = "no trace carries CPU figures (kvlens.cpu.* on its spans: schedstat unreadable, or recorded before)"
            ratios[key] = stats.StratifiedRatio(stats.NOT_ENOUGH, strata=ratios[key].strata, note=why)
    cpu_share: dict[str, float | None] = {}
    cpu_n: dict[str, int] = {}
    for m in (PUSH, PULL):
        shares = [r.cpu_wait_share for r in used if r.mode == m and r.cpu_wait_share is not None]
        cpu_n[m] = len(shares)
        cpu_share[m] = stats.percentile(shares, 50.0)
    msg = f"{n[PUSH]} push and {n[PULL]} pull requests"
    return Verdict("ok", msg, truncated=truncated, ratios=ratios, cpu_share=cpu_share, cpu_n=cpu_n, **args)


def text(v: Verdict, window: str) -> str:
    """``kvlens verdict``'s report (pure)."""
    lines = [f"push vs pull over the last {window}: {v.message}"]
    if v.status != "ok":
        return "\n".join(lines)
    lines.append(
        f"requests used: {v.selection_words()} ({v.used}; {v.left_out} other requests in the window left out)"
        + ("; newest only: the window holds more" if v.truncated else "")
    )
    if v.dispatches:
        lines.append("push dispatch: " + ", ".join(f"{k} {n}" for k, n in sorted(v.dispatches.items())))
    lines.append("")
    lines.append(f"ratio push/pull, {int(stats.RESAMPLES)} resamples, 95 % interval, stratified by prompt length:")
    for key, _, _, words in METRICS:
        lines.append(f"  {words:<12} {ratio_words(v.ratios[key])}")
    cw = cpu_words(v)
    if cw:
        lines.append("")
        lines.append(
            cw[0].upper() + cw[1:] + f" (requests with CPU figures: push {v.cpu_n[PUSH]}, pull {v.cpu_n[PULL]})."
        )
    lines.append("")
    lines.append(f"requests per bucket (push / pull; a bucket needs {stats.MIN_PER_STRATUM} of each to count):")
    for b in bucket_names():
        p, q = v.counts[PUSH][b], v.counts[PULL][b]
        if p or q:
            w = next((s.weight for s in v.ratios["ttft_p50"].strata if s.name == b), 0.0)
            lines.append(f"  {b:<16} {p:>6} / {q:<6} weight {w:.2f}")
    lines.append("(ratio < 1: push is faster; the interval holding 1: no resolvable difference)")
    return "\n".join(lines)


def from_store(conn, *, since_ns: int | None, limit: int = MAX_REQUESTS, sched: Any = None, **kw: Any) -> Verdict:
    """:func:`compute` over the newest ``limit`` requests since ``since_ns``
    (``truncated`` where there were more); ``sched``: the kernel's scheduler
    record, where one was kept (the CPU-wait shares walk it)."""
    rows = load(conn, since_ns=since_ns, limit=limit + 1, sched=sched)
    return compute(rows[:limit], truncated=len(rows) > limit, **kw)
