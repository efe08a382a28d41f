"""Was the KV that moved used? D's first step after the transfer says how
many prompt tokens D computed itself (``decode.first_step``'s
``kvlens.kv.recomputed_tokens``, :mod:`instrumented_connector.scheduler`).

A P/D request normally leaves D at most the prompt's last, partial block to
compute (the transfer moves whole blocks). More than one block means D
recomputed KV it should have received: a transfer that failed under vLLM's
``kv_load_failure_policy: recompute`` (blocks dropped and computed again), or
KV D could not use. Every transfer metric looks fine then; only TTFT and
D's compute show it, so kvlens marks the trace and counts it
(``kvlens_kv_recomputed_total{mode}``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kvrecord import semconv as sc

#: The block size assumed when a span does not carry D's (vLLM's default).
DEFAULT_BLOCK_SIZE = 16


def recomputed_tokens(attrs: Mapping[str, Any] | None) -> int | None:
    """Prompt tokens D computed itself, from a ``decode.first_step`` span's attributes."""
    v = (attrs or {}).get(sc.ATTR_KV_RECOMPUTED_TOKENS)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def is_recomputed(attrs: Mapping[str, Any] | None) -> bool:
    """More than the last partial block computed on D: KV moved but not used."""
    n = recomputed_tokens(attrs)
    bs = (attrs or {}).get(sc.ATTR_BLOCK_SIZE)
    bs = bs if isinstance(bs, int) and bs > 0 else DEFAULT_BLOCK_SIZE
    return n is not None and n > bs


def trace_kv_use(spans: Iterable[Any]) -> dict[str, Any] | None:
    """``{"recomputed_tokens": n, "recomputed": bool}`` from a trace's D
    ``decode.first_step`` (the largest, should there be several), else None."""
    best = None
    for s in spans:
        if s.name == sc.Phase.DECODE_FIRST_STEP.value and (n := recomputed_tokens(s.attributes)) is not None:
            if best is None or n > best[0]:
                best = (n, is_recomputed(s.attributes))
    return None if best is None else {"recomputed_tokens": best[0], "recomputed": best[1]}
