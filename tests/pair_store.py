"""A trace store with several (P, D) pairs (xPyD), through the real
pipeline as in ``store_fixture``: each pair's push and pull requests are
recorded by recorders carrying its engine ids. A pair can be given a D
clock that runs ahead of P's (``skew_ms``: every D timestamp moved, so the
store must bound and correct it) and a slow handoff (``slow_ms``: D's
``kv.ready`` and the client's first token that much later, in the modes
``slow_modes``).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import NamedTuple

from kvtrace import store
from exporters.pipeline import provider_factory
from kvtrace.store.schema import write_tx
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder
from store_fixture import record_requests


class Pair(NamedTuple):
    p: str
    d: str
    skew_ms: float = 0.0
    slow_ms: float = 0.0
    slow_modes: tuple[str, ...] = ("push", "pull")


class _DecodeClock:
    """A decode recorder on a clock ``skew_ns`` ahead of P's, with ``kv.ready`` ``slow_ns`` late."""

    def __init__(self, inner: Recorder, skew_ns: int, slow_ns: int):
        self.inner, self.skew_ns, self.slow_ns = inner, skew_ns, slow_ns

    def record(self, phase, request_id, start_ns, end_ns, outcome="ok", attrs=None) -> None:
        k = self.skew_ns + (self.slow_ns if phase == sc.Phase.KV_READY else 0)
        self.inner.record(phase, request_id, start_ns + k, end_ns + k, outcome, attrs)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


class _LateRouter(_DecodeClock):
    """A router recorder whose requests' first token (and end) come ``slow_ns`` late."""

    def __init__(self, inner: Recorder, slow_ns: int):
        super().__init__(inner, 0, 0)
        self.late_ns = slow_ns

    def record(self, *args, **kwargs) -> None:
        self.inner.record(*args, **kwargs)

    def record_root(self, trace_id, parent, start_ns, end_ns, outcome="ok", attrs=None) -> None:
        attrs = dict(attrs or {})
        if attrs.get(sc.ATTR_TTFT_S) is not None:
            attrs[sc.ATTR_TTFT_S] += self.late_ns / 1e9
        self.inner.record_root(trace_id, parent, start_ns, end_ns + self.late_ns, outcome, attrs)


def make_pair_store(
    home: Path, pairs: list[Pair], n_per_mode: int = 10, seed: int = 5, span_s: float = 300.0
) -> tuple[Path, dict[Pair, dict[str, list[str]]]]:
    """``n_per_mode`` push and pull requests per pair over the last ``span_s``
    seconds into ``home/traces.db``; (its path, the trace ids by pair and mode)."""
    cfg = {"kvlens_home": str(home), "kvlens_metrics": "off"}
    base = time.time_ns() - int(span_s * 1e9)
    ids = {}
    for i, pair in enumerate(pairs):
        recs = {}
        for mode in ("push", "pull"):
            for role, eng in (("router", None), ("prefill", pair.p), ("decode", pair.d)):
                r = Recorder(
                    role=role,
                    mode=mode,
                    engine_id=eng,
                    pipeline_factory=provider_factory(role=role, mode=mode, engine_id=eng, config=cfg),
                )
                slow_ns = int(pair.slow_ms * 1e6) if mode in pair.slow_modes else 0
                if role == "decode":
                    r = _DecodeClock(r, int(pair.skew_ms * 1e6), slow_ns)
                elif role == "router" and slow_ns:
                    r = _LateRouter(r, slow_ns)
                recs[(role, mode)] = r
        ids[pair] = record_requests(recs, random.Random(seed + i), base, n_per_mode, span_s)
    path = home / "traces.db"
    # settle every trace once more with all of them stored (as synthetic_store does): each
    # pair's window is then the one over all its requests, whatever the export timing
    conn = store.connect(path)
    try:
        with write_tx(conn):
            store.settle(conn, [t for by_mode in ids.values() for v in by_mode.values() for t in v])
    finally:
        conn.close()
    return path, ids
