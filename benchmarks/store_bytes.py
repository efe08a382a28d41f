"""Bytes stored per request at several keep ratios, and what a day's drop
costs writers: the parts of ``bench_store.py`` that issue 24 asks for.

Every request keeps its summary row; a request at ratio ``r`` keeps its
spans with probability ``r``. Bytes are those of the ``spans`` and
``traces`` tables and all their indexes (SQLite: ``dbstat``; PostgreSQL:
``pg_relation_size`` of every partition, index and TOAST table), what the
populated requests added to an empty store, divided by the requests.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kvtrace import store

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # tests/store_sql.py: what a benchmark needs beneath the store API
import store_sql  # noqa: E402

KB = 1024


def _ours(rel: str) -> bool:
    return rel.startswith(("spans", "traces", "sqlite_autoindex_traces", "sqlite_autoindex_spans"))


def bytes_per_request(label: str, make_store: Callable[[str], Any], populate, ratios, n: int) -> dict[float, dict]:
    """``ratio -> {"per_request", "spans", "relations"}`` (relations: bytes per
    request of each table and index), one fresh store per ratio."""
    out: dict[float, dict] = {}
    for r in ratios:
        name = make_store(f"keep{round(r * 10000)}")
        store.connect(name).close()
        empty = store_sql.relation_bytes(name)
        t = time.perf_counter()
        n_tr, n_sp = populate(name, n, keep_ratio=r)
        took = time.perf_counter() - t
        grown = {k: v - empty.get(k, 0) for k, v in store_sql.relation_bytes(name).items() if _ours(k)}
        total = sum(grown.values())
        out[r] = {
            "per_request": total / n_tr,
            "spans": n_sp,
            "relations": {k: v / n_tr for k, v in sorted(grown.items(), key=lambda kv: -kv[1])},
        }
        print(
            f"{label}: keep {r:.0%}: {n_tr:,} requests, {n_sp:,} spans stored in {took:.0f} s: "
            f"{total / 1e6:,.1f} MB = {total / n_tr:,.0f} bytes per request",
            flush=True,
        )
        for rel, b in out[r]["relations"].items():
            if b >= 1:
                print(f"    {rel:44s} {b:8,.0f} B/request")
    return out


def print_bytes_table(by_backend: dict[str, dict[float, dict]]) -> None:
    ratios = sorted({r for v in by_backend.values() for r in v}, reverse=True)
    print("\n===== bytes per request (spans + traces, all indexes)")
    print(f"{'':14s}" + "".join(f"{f'keep {r:.0%}':>14s}" for r in ratios))
    for label, v in by_backend.items():
        print(f"{label:14s}" + "".join(f"{v[r]['per_request']:>14,.0f}" if r in v else f"{'':>14s}" for r in ratios))


def _writer_loop(name, spans: list, stop: threading.Event, lat: list[float]) -> None:
    """Small batches of fresh spans, back to back, each one's latency recorded."""
    conn = store.connect(name)
    try:
        i = 0
        while not stop.is_set() and i < len(spans):
            t = time.perf_counter()
            store.write_spans(conn, spans[i : i + 200])
            lat.append(time.perf_counter() - t)
            i += 200
    finally:
        conn.close()


def drop_with_writer(name, cutoff_ns: int, spans: list) -> dict[str, float]:
    """Retention of what started before ``cutoff_ns`` while another
    connection writes: PostgreSQL first drops the whole days (partitions),
    timed alone, then deletes the rest in batches; SQLite deletes in
    batches. Returns the times, the traces deleted and the writer's worst
    and median batch latency while it ran."""
    stop, lat = threading.Event(), []
    writer = threading.Thread(target=_writer_loop, args=(name, spans, stop, lat), daemon=True)
    conn = store.connect(name)
    writer.start()
    time.sleep(0.5)  # the writer is in its stride
    out: dict[str, float] = {}
    try:
        n0 = len(lat)
        t = time.perf_counter()
        out["days_dropped_traces"] = store.prune(conn, cutoff_ns, exact=False)
        out["drop_days_s"] = time.perf_counter() - t
        during = lat[n0:] or [0.0]
        out["writer_max_ms_during_drop"] = max(during) * 1e3
        t = time.perf_counter()
        out["batched_traces"] = store.prune(conn, cutoff_ns, batch=1000)
        out["batched_s"] = time.perf_counter() - t
    finally:
        stop.set()
        writer.join()
        conn.close()
    srt = sorted(lat) or [0.0]
    out["writer_batches"] = len(lat)
    out["writer_p50_ms"] = srt[len(srt) // 2] * 1e3
    out["writer_max_ms"] = srt[-1] * 1e3
    return out
