"""What keeping the kernel's scheduler record costs serving (``kvlens up
--sched-trace``, :mod:`kvlens.stack.schedrec`): one stack, batches of the
same requests with the record off and on, interleaved ABBA (off, on, on,
off, ...) so the machine's drift falls on both, and per batch the client's
latency p50, the handoff p50 from the store, and the engine processes' CPU
seconds per request (every process of the stack, from /proc). The record's
own size and the kernel events it held are reported too.

    .venv/bin/python benchmarks/bench_schedrec.py --mode pull --rounds 4 --requests 12

Root only (the kernel's tracepoints). Nothing is asserted; docs/benchmark.md
keeps the table (medians over the batches, the on/off ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scratch import scratch_dir  # noqa: E402 (benchmarks/)

from kvlens.model import ensure_model  # noqa: E402
from kvlens.stack.launch import Stack  # noqa: E402
from kvtrace import schedtrace, store, tracemodel  # noqa: E402


def _cpu_s(pids) -> float:
    total = 0.0
    for pid in pids:
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            try:
                total += sum(p.cpu_times()[:4])
            except psutil.Error:
                pass
    return total


def _batch(stack: Stack, n: int, tag: str) -> dict:
    ids, lat = [], []
    cpu0 = _cpu_s(stack.pids())
    with httpx.Client(timeout=180) as c:
        for i in range(n):
            rid = uuid.uuid4().hex
            body = {"prompt": f"{tag} {i} " + "tokens " * (60 + 5 * i), "max_tokens": 4, "temperature": 0}
            t0 = time.perf_counter()
            r = c.post(stack.router_url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
            lat.append(time.perf_counter() - t0)
            r.raise_for_status()
            ids.append(rid)
    cpu = (_cpu_s(stack.pids()) - cpu0) / n
    deadline = time.time() + 60
    while True:
        conn = store.connect(stack.store, readonly=True)
        try:
            trs = [t for t in tracemodel.find(conn, ids).values() if t.handoff_s is not None]
        finally:
            conn.close()
        if len(trs) == n or time.time() > deadline:
            break
        time.sleep(0.5)
    return {
        "latency_p50_s": statistics.median(lat),
        "handoff_p50_s": statistics.median(t.handoff_s for t in trs) if trs else None,
        "cpu_s_per_request": cpu,
        "traces": len(trs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["push", "pull"], default="pull")
    p.add_argument("--rounds", type=int, default=4, help="ABBA rounds (each: an off and an on batch)")
    p.add_argument("--requests", type=int, default=12, help="requests per batch")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    home = scratch_dir("kvlens-bench-schedrec-")
    stack = Stack(mode=a.mode, model=ensure_model(home / "model"), port=0, kvlens_home=home, quiet=True)
    rows = []
    try:
        stack.start()
        _batch(stack, a.requests, "warm")
        for r in range(a.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                if on:
                    with stack.record_sched(home / f"sched-{r}"):
                        row = _batch(stack, a.requests, f"on{r}")
                    tl = schedtrace.load(home / f"sched-{r}")
                    row["events_per_s"] = sum(len(v) for v in tl.runs.values()) / max(
                        (tl.last_ns - tl.first_ns) / 1e9, 1e-9
                    )
                    row["record_bytes"] = (home / f"sched-{r}" / schedtrace.TEXT).stat().st_size
                else:
                    row = _batch(stack, a.requests, f"off{r}")
                row.update(record=on, round=r)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        stack.stop()
    med = {}
    for on in (False, True):
        sel = [x for x in rows if x["record"] is on]
        med[on] = {k: statistics.median(x[k] for x in sel if x.get(k) is not None)
                   for k in ("latency_p50_s", "handoff_p50_s", "cpu_s_per_request")}  # fmt: skip
    print(f"{a.mode}, {a.rounds} ABBA rounds of {a.requests} requests, medians over the batches:")
    for k in ("latency_p50_s", "handoff_p50_s", "cpu_s_per_request"):
        print(
            f"  {k}: off {med[False][k] * 1e3:.1f} ms, on {med[True][k] * 1e3:.1f} ms, on/off {med[True][k] / med[False][k]:.2f}"
        )
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "medians": {str(k): v for k, v in med.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
