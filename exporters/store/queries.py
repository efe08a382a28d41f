"""Every read of the store: parameterised queries as functions of their
parameters. Nothing outside ``exporters.store`` writes SQL."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any, Iterable, Sequence

def parse_since(text: str | None) -> int | None:
    """'10m' / '2h' / '30s' / '1d' -> a wall-clock ns lower bound (None: all)."""
    if not text:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t[-1] in units:
            secs = float(t[:-1]) * units[t[-1]]
        else:
            secs = float(t)
    except (ValueError, IndexError):
        raise ValueError(f"invalid duration {text!r}: use e.g. 30s, 10m, 2h, 1d") from None
    if secs <= 0:
        raise ValueError(f"invalid duration {text!r}: must be > 0")
    return time.time_ns() - int(secs * 1e9)


def slowest(
    conn: sqlite3.Connection,
    n: int = 10,
    *,
    mode: str | None = None,
    outcome: str | None = None,
    since_ns: int | None = None,
    until_ns: int | None = None,
    min_handoff_s: float | None = None,
    max_handoff_s: float | None = None,
    trace_ids: Iterable[str] | None = None,
    order: str = "handoff",
) -> list[dict[str, Any]]:
    """Traces ordered by handoff (or ttft) descending, with parameterised filters."""
    where, params = ["1=1"], []
    if mode:
        where.append("mode = ?")
        params.append(mode)
    if outcome:
        where.append("outcome = ?")
        params.append(outcome)
    if since_ns is not None:
        where.append("start_ns >= ?")
        params.append(since_ns)
    if until_ns is not None:
        where.append("start_ns <= ?")
        params.append(until_ns)
    if min_handoff_s is not None:
        where.append("handoff_s >= ?")
        params.append(min_handoff_s)
    if max_handoff_s is not None:
        where.append("handoff_s < ?")
        params.append(max_handoff_s)
    if trace_ids is not None:
        ids = list(trace_ids)
        if not ids:
            return []
        where.append(f"trace_id IN ({','.join('?' * len(ids))})")
        params.extend(ids)
    col = {"handoff": "handoff_s", "ttft": "ttft_s", "start": "start_ns"}.get(order)
    if col is None:
        raise ValueError(f"unknown order {order!r}")
    sql = (
        "SELECT trace_id, request_id, mode, dispatch, outcome, start_ns, end_ns, ttft_s, "
        "prefill_finished_ns, kv_ready_ns, handoff_s, n_spans FROM traces "
        f"WHERE {' AND '.join(where)} ORDER BY {col} DESC LIMIT ?"  # NULLs sort last in DESC
    )
    params.append(int(n))
    return [dict(r) for r in conn.execute(sql, params)]


def spans_for(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """All spans of the given traces, ordered by start time."""
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in trace_ids}
    if not trace_ids:
        return out
    q = (
        "SELECT trace_id, span_id, parent_id, name, role, mode, request_id, start_ns, end_ns, "
        f"outcome, attributes FROM spans WHERE trace_id IN ({','.join('?' * len(trace_ids))}) "
        "ORDER BY start_ns, end_ns"
    )
    for r in conn.execute(q, list(trace_ids)):
        d = dict(r)
        d["attributes"] = json.loads(d["attributes"] or "{}")
        out.setdefault(d["trace_id"], []).append(d)
    return out


def trace_record(summary: dict[str, Any], spans: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``kvlens traces --json`` object for one trace."""
    return {
        "trace_id": summary["trace_id"],
        "request_id": summary["request_id"],
        "mode": summary["mode"],
        "dispatch": summary.get("dispatch"),
        "outcome": summary["outcome"],
        "ttft_s": summary["ttft_s"],
        "handoff_s": summary["handoff_s"],
        "start_ns": summary["start_ns"],
        "spans": [
            {
                "name": s["name"],
                "role": s["role"],
                "start_ns": s["start_ns"],
                "end_ns": s["end_ns"],
                "span_id": s["span_id"],
                "parent_id": s["parent_id"],
                "outcome": s["outcome"],
                "attributes": s["attributes"],
            }
            for s in spans
        ],
    }


def handoffs(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, float]:
    """``trace_id -> handoff_s`` for those of ``trace_ids`` whose handoff is known."""
    out: dict[str, float] = {}
    ids = list(trace_ids)
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        q = (
            "SELECT trace_id, handoff_s FROM traces WHERE handoff_s IS NOT NULL "
            f"AND trace_id IN ({','.join('?' * len(chunk))})"
        )
        for tid, h in conn.execute(q, chunk):
            out[tid] = h
    return out


def save_bench_rows(conn: sqlite3.Connection, run_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """Persist ``kvlens bench`` rows (dicts with the --json keys)."""
    now = time.time_ns()
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(
            "INSERT INTO bench_rows (run_id, created_ns, mode, dispatch, qps, input_len, output_len, "
            "num_prompts, row) VALUES (?,?,?,?,?,?,?,?,?)",
            [
                (run_id, now, r["mode"], r.get("dispatch"), float(r["qps"]), int(r["input_len"]),
                 r.get("output_len"), r.get("num_prompts"), json.dumps(r))
                for r in rows
            ],
        )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def bench_rows(conn: sqlite3.Connection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Bench rows of one run (default: the latest run)."""
    if run_id is None:
        r = conn.execute("SELECT run_id FROM bench_rows ORDER BY created_ns DESC LIMIT 1").fetchone()
        if r is None:
            return []
        run_id = r[0]
    return [
        dict(json.loads(r["row"]), run_id=r["run_id"])
        for r in conn.execute("SELECT run_id, row FROM bench_rows WHERE run_id = ? ORDER BY rowid", (run_id,))
    ]


def bench_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Bench runs, newest first: run_id, created_ns, rows."""
    return [
        dict(r)
        for r in conn.execute(
            "SELECT run_id, MAX(created_ns) AS created_ns, COUNT(*) AS rows FROM bench_rows "
            "GROUP BY run_id ORDER BY created_ns DESC"
        )
    ]
