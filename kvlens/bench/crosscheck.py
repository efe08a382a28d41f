"""The cross-checks of a bench run: every request's client figures (TTFT,
TPOT, outcome) against its trace in the store, over all cells (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvlens.bench.probe import DECODE_TPOT_METRICS
from kvlens.bench.results import Cell, tpot_figures
from kvtrace.stats import percentile, rel_diff

TTFT_CROSSCHECK_WARN = 0.02  # median relative client-vs-router TTFT difference
#: median relative client-vs-D TPOT difference: the client's figure also
#: carries the router hop and the client's event loop on every token
TPOT_CROSSCHECK_WARN = 0.10


def _ms_or_unknown(v: float | None) -> str:
    return "unknown" if v is None else f"{v * 1000:.1f} ms"


@dataclass
class CrossCheck:
    """Client figures against the store's traces, over all cells of a run."""

    n_compared: int
    ttft_rel_diff_p50: float | None
    ttft_diff_p50_s: float | None  # client - router, signed
    completed: int
    ok_traces_in_store: int
    sent: int
    traces_in_store: int
    handoff_missing: int
    failed: list[tuple[str, str, str, str]]  # (variant, request id, client error, store outcome)
    #: per cell: (cell label, :func:`~kvlens.bench.results.tpot_figures`)
    tpot: list[tuple[str, dict]] = field(default_factory=list)
    #: requests whose store TTFT the engines proved (no kvlens router), and
    #: the median client minus that figure (what the router and last hop add)
    n_engines: int = 0
    engines_diff_p50_s: float | None = None

    @property
    def tpot_rel_diff_p50(self) -> float | None:
        return percentile((f["tpot_client_vs_decode_rel_diff"] for _, f in self.tpot), 50)

    @property
    def tpot_untimed(self) -> int:
        return sum(f["tpot_untimed"] for _, f in self.tpot)

    @property
    def ttft_warn(self) -> bool:
        return self.ttft_rel_diff_p50 is not None and self.ttft_rel_diff_p50 > TTFT_CROSSCHECK_WARN

    def _ttft_lines(self) -> list[str]:
        eng = []
        if self.n_engines:
            eng = [
                f"client TTFT vs the engines' TTFT (traces.ttft_s with ttft_source=engines: P's arrival -> "
                f"D's first token; no kvlens router measured it), {self.n_engines} requests: median "
                f"client-minus-engines {self.engines_diff_p50_s * 1000:+.2f} ms (the router, the client's "
                "hops and detokenizing; not an error)"
            ]
        if not self.n_compared:
            return eng or ["client TTFT vs router span TTFT: no request had both figures (traces missing?)"]
        return self._router_ttft_lines() + eng

    def _router_ttft_lines(self) -> list[str]:
        out = [
            f"client TTFT vs router span TTFT (traces.ttft_s), {self.n_compared} requests: median relative "
            f"difference {self.ttft_rel_diff_p50 * 100:.2f}%, median client-minus-router "
            f"{self.ttft_diff_p50_s * 1000:+.2f} ms"
        ]
        if self.ttft_warn:
            out.append(
                f"WARNING: client and router TTFT differ by more than {TTFT_CROSSCHECK_WARN:.0%} at the median "
                "(client-side overhead: HTTP hop, event loop under load)"
            )
        return out

    def _tpot_lines(self) -> list[str]:
        both = [f for _, f in self.tpot if f["tpot_client_vs_decode_rel_diff"] is not None]
        head = f"client TPOT vs D's own {DECODE_TPOT_METRICS[0]} (mean over each cell)"
        if both:
            out = [f"{head}, {len(both)} cells: median relative difference {self.tpot_rel_diff_p50 * 100:.2f}%"]
        else:
            why = next((f["tpot_decode_note"] for _, f in self.tpot if f["tpot_decode_note"]), None)
            out = [f"{head}: no cell had both figures" + (f" ({why})" if why else "")]
        for c, f in self.tpot:
            d, cl = f["tpot_decode_mean_s"], f["tpot_mean_s"]
            if cl is None and d is None and not f["tpot_untimed"]:
                continue
            line = f"  {c}: client {_ms_or_unknown(cl)}, D {_ms_or_unknown(d)}"
            if f["tpot_client_vs_decode_rel_diff"] is not None:
                line += f" ({(cl - d) / d * 100:+.1f}%)"
            if f["tpot_untimed"]:
                line += f"; client TPOT {f['tpot_note']}"
            out.append(line)
        if both and self.tpot_rel_diff_p50 > TPOT_CROSSCHECK_WARN:
            out.append(
                f"WARNING: client and D TPOT differ by more than {TPOT_CROSSCHECK_WARN:.0%} at the median "
                "(router hop, client event loop under load)"
            )
        if self.tpot_untimed:
            out.append(
                f"WARNING: {self.tpot_untimed} completed requests could not be timed for TPOT "
                "(all their tokens reached the client in one read); their TPOT is not reported"
            )
        return out

    def _failed_lines(self) -> list[str]:
        if not self.failed:
            return ["failed requests: none"]
        out = [f"failed requests ({len(self.failed)}):"]
        for v, rid, err, outcome in self.failed[:20]:
            out.append(f"  {v} {rid}: store outcome {outcome}; client: {err}")
        if len(self.failed) > 20:
            out.append(f"  ... and {len(self.failed) - 20} more")
        return out

    def lines(self) -> list[str]:
        out = self._ttft_lines() + self._tpot_lines()
        same = self.completed == self.ok_traces_in_store
        out.append(
            f"completed requests {self.completed} vs ok traces in the store for this run {self.ok_traces_in_store}: "
            + ("match" if same else "MISMATCH")
            + f" ({self.traces_in_store} of {self.sent} sent requests have a trace)"
        )
        if self.handoff_missing:
            out.append(f"WARNING: {self.handoff_missing} completed requests have no handoff in the store")
        return out + self._failed_lines()


def cross_check(cells: Sequence[Cell]) -> CrossCheck:
    """Compare every request's client figures with its trace (pure)."""
    diffs, signed, engines = [], [], []
    completed = ok_in_store = sent = in_store = missing = 0
    failed, tpot = [], []
    rounds = any(c.round > 1 for c in cells)
    for c in cells:
        tag = f" round {c.round}" if rounds else ""
        tpot.append((f"{c.target.label} in={c.input_len} qps={c.qps:g}{tag}", tpot_figures(c)))
        for r in c.results:
            sent += 1
            t = c.traces.get(r.trace)
            if t is not None:
                in_store += 1
            if not r.ok:
                failed.append(
                    (c.target.label, r.trace, r.error or f"HTTP {r.status}", (t or {}).get("outcome") or "not in store")
                )
                continue
            completed += 1
            if t is not None and t.get("outcome") == "ok":
                ok_in_store += 1
            if t is None or t.get("handoff_s") is None:
                missing += 1
            rt = (t or {}).get("ttft_s")
            if rt is not None and r.ttft_s is not None:
                if t.get("ttft_source") == "engines":
                    engines.append(r.ttft_s - rt)
                    continue
                diffs.append(rel_diff(r.ttft_s, rt))
                signed.append(r.ttft_s - rt)
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
        tpot=tpot,
        n_engines=len(engines),
        engines_diff_p50_s=percentile(engines, 50),
    )
