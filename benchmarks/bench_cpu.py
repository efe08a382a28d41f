"""What kvlens costs vLLM's processes in CPU time, measured deterministically: the
check that building spans in a sidecar (not inline, on the engine's GIL) pays off.

    .venv/bin/python benchmarks/bench_cpu.py                          # push + pull, stock vs instrumented
    .venv/bin/python benchmarks/bench_cpu.py --builders inline,sidecar  # before (in-process spans) and after
    .venv/bin/python benchmarks/bench_cpu.py --modes push --requests 20

For each mode and each variant (``stock``: vLLM's own NIXL connector;
``inline`` / ``sidecar``: the instrumented connector with that
``KVLENS_SPAN_BUILDER``) it starts a real P/D pair plus router
(:class:`kvlens.stack.launch.Stack`), sends the same fixed load (``--requests``
prompts of ``--input-len`` tokens, ``--output-len`` tokens each,
``--concurrency`` at a time) and reads, for every process below P and D
(vLLM's API server, EngineCore, workers; kvlens sidecars), the CPU time
(utime + stime, ``/proc/<pid>/stat``; exited threads included) of each
process and of each kvlens thread (``/proc/<pid>/task/<tid>/schedstat``,
ns resolution) before and after the load.

Attributed to kvlens, per vLLM process:

* its own threads (native names ``kvlens-*``: the recorder or shipping
  thread, export threads);
* the inline cost: events recorded in that process during the load (the
  recorders' counters, :data:`kvrecord.procstats.STATS_DIR_ENV`)
  times the per-event cost of ``Recorder.record`` measured here first
  (``benchmarks/bench_recorder.py``'s loop);
* sidecar processes are reported on their own line: kvlens CPU, but not
  on the engine's GIL.

CPU time does not depend on placement the way latency does. What it does
include: a CPU vLLM engine spins while idle, so a process's CPU over the
load window depends on the window's length too; read ``ratio`` (measured
engine CPU per request, instrumented / stock) next to ``attributed``
(1 + kvlens CPU / the rest of the process's CPU), which does not.

Nothing lost: after the load the P/D events recorded (recorders' counters,
warm-up included) are compared with the P/D spans in the store plus the
losses counted. Nothing is asserted; every figure is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recorder import bench_recorder  # noqa: E402

from kvrecord.ids import new_trace_id  # noqa: E402
from kvrecord.procstats import STATS_DIR_ENV  # noqa: E402
from kvlens.bench.load import one_request  # noqa: E402
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)
from kvlens.bench.prompts import PromptMaker  # noqa: E402
from kvlens.bench.prompts import rng as seeded_rng  # noqa: E402
from kvlens.signals import sigterm_as_interrupt  # noqa: E402
from kvlens.stack.supervise import descendants, signals_ignored  # noqa: E402
from kvlens.stack.launch import Stack  # noqa: E402
from kvtrace import store  # noqa: E402

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # tests/store_sql.py: what a benchmark needs beneath the store API
import store_sql  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
ENGINE_KINDS = ("api_server", "engine_core", "worker")


def _stat(path: str) -> tuple[str, float] | None:
    """(comm, utime + stime seconds) of a /proc stat file, None when gone."""
    try:
        with open(path) as f:
            raw = f.read()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    return comm, (int(fields[11]) + int(fields[12])) / TICK


def _thread_ns(pid: int, tid: str, fallback_s: float) -> float:
    """CPU seconds of one thread at ns resolution (``schedstat``'s run time;
    ``stat`` counts 10 ms ticks, too coarse for kvlens' threads)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return fallback_s


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kind(pid: int, comm: str) -> str | None:
    cmd = _cmdline(pid)
    if "exporters.sidecar" in cmd:
        return "sidecar"
    if comm.startswith("VLLM::EngineCor") or "EngineCore" in cmd:
        return "engine_core"
    if comm.startswith("VLLM::Worker") or "Worker" in comm:
        return "worker"
    if "vllm.entrypoints" in cmd or ("vllm" in cmd and " serve" in cmd):
        return "api_server"
    return None  # the guard, resource trackers, compilers: not vLLM's serving processes


@dataclass
class Snap:
    """CPU seconds per process, and of its kvlens threads."""

    total: dict[int, float] = field(default_factory=dict)
    kvlens: dict[int, float] = field(default_factory=dict)
    meta: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (role, kind)


def snapshot(stack: Stack) -> Snap:
    s = Snap()
    for child in stack.children:
        if child.name not in ("prefill", "decode") or child.proc is None:
            continue
        for p in descendants(child.proc.pid):
            stat = _stat(f"/proc/{p.pid}/stat")
            if stat is None:
                continue
            kind = _kind(p.pid, stat[0])
            if kind is None:
                continue
            s.meta[p.pid] = (child.name, kind)
            s.total[p.pid] = stat[1]
            kv = 0.0
            try:
                tids = os.listdir(f"/proc/{p.pid}/task")
            except OSError:
                tids = []
            for tid in tids:
                t = _stat(f"/proc/{p.pid}/task/{tid}/stat")
                if t and t[0].startswith("kvlens-"):
                    kv += _thread_ns(p.pid, tid, t[1])
            s.kvlens[p.pid] = kv
    return s


def recorder_stats(d: Path) -> dict[int, dict]:
    """pid -> summed counters of the recorders of that process (roles P/D)."""
    out: dict[int, dict] = {}
    for f in d.glob("*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        acc = out.setdefault(int(rec["pid"]), {"role": rec["role"]})
        for k, v in rec.items():
            if isinstance(v, int) and not isinstance(v, bool) and k not in ("pid", "sidecar_pid"):
                acc[k] = acc.get(k, 0) + v
        acc["sidecar"] = acc.get("sidecar", False) or bool(rec.get("sidecar"))
    return out


async def _load(url: str, prompts: list[str], a) -> list:
    import httpx

    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10)) as client:

        async def one(p: str):
            async with sem:
                return await one_request(client, url, None, p, a.output_len, new_trace_id())

        return await asyncio.gather(*(one(p) for p in prompts))


def _stored(store_path: Path) -> dict[str, int]:
    """P/D spans in the run's store, by role (read-only)."""
    try:
        with store.reading(store_path) as c:
            return store_sql.span_counts_by_role(c, ("prefill", "decode"))
    except (store.StoreError, sqlite3.Error):
        return {}


def run_variant(mode: str, variant: str, a, model: Path, prompts: list[str], inline_us: float) -> dict:
    home = scratch_dir(f"kvlens-cpu-{mode}-{variant}-")
    stats_dir = home / "recorder-stats"
    stats_dir.mkdir()
    env = {STATS_DIR_ENV: str(stats_dir)}
    if variant != "stock":
        env["KVLENS_SPAN_BUILDER"] = variant
    stack = Stack(
        mode=mode,
        stock=(variant == "stock"),
        model=model,
        port=None,
        kvlens_home=home,
        quiet=True,
        vllm_args=["--no-enable-prefix-caching"],
        env_extra=env,
    )
    print(f"[{mode}/{variant}] starting the pair ...", file=sys.stderr, flush=True)
    try:
        stack.start(timeout=a.start_timeout)
        time.sleep(a.settle)  # warm-up spans shipped, counters written
        ev0, s0 = recorder_stats(stats_dir), snapshot(stack)
        t0 = time.monotonic()
        res = asyncio.run(_load(stack.router_url, prompts, a))
        wall = time.monotonic() - t0
        s1 = snapshot(stack)
        time.sleep(a.settle)  # kvlens' background work on the load's events finishes
        s2, ev1 = snapshot(stack), recorder_stats(stats_dir)
        ok = sum(r.ok for r in res)
        print(f"[{mode}/{variant}] {ok}/{len(res)} ok in {wall:.1f}s", file=sys.stderr, flush=True)
        check = _check_nothing_lost(stack, stats_dir, a.settle * 10)
    finally:
        with signals_ignored():
            stack.stop()
    rows = []
    for pid, (role, kind) in sorted(s1.meta.items(), key=lambda kv: kv[1]):
        if pid not in s0.total:
            continue
        kv_late = s2.kvlens.get(pid, s1.kvlens[pid]) - s1.kvlens[pid]
        total = s1.total[pid] - s0.total[pid] + kv_late
        if kind == "sidecar":
            total = s2.total.get(pid, s1.total[pid]) - s0.total[pid]
        events = ev1.get(pid, {}).get("recorded", 0) - ev0.get(pid, {}).get("recorded", 0)
        kvlens = (
            total
            if kind == "sidecar"
            else (s2.kvlens.get(pid, s1.kvlens[pid]) - s0.kvlens[pid] + events * inline_us / 1e6)
        )
        rows.append({"role": role, "kind": kind, "pid": pid, "cpu_s": total, "kvlens_s": kvlens, "events": events})
    return {
        "mode": mode,
        "variant": variant,
        "ok": ok,
        "requests": len(res),
        "wall_s": wall,
        "rows": rows,
        "check": check,
    }


def _check_nothing_lost(stack: Stack, stats_dir: Path, wait_s: float) -> dict:
    """Recorded P/D events vs stored P/D spans + counted losses, once both settle."""
    end = time.monotonic() + wait_s
    while True:
        ev = recorder_stats(stats_dir)
        eng = [v for v in ev.values() if v["role"] in ("prefill", "decode") and not v["sidecar"]]
        recorded = sum(v.get("recorded", 0) for v in eng)
        lost = sum(
            v.get(k, 0)
            for v in ev.values()
            if v["role"] in ("prefill", "decode")
            for k in ("dropped", "shutdown_dropped", "failed_dropped", "processor_lost")
        )
        stored = sum(_stored(stack.store).values())
        if stored + lost >= recorded or time.monotonic() > end:
            return {"recorded": recorded, "stored": stored, "lost_counted": lost}
        time.sleep(0.5)


def report(results: list[dict]) -> None:
    print(
        "\nper process, during the load (CPU seconds; kvlens = its threads + events x inline cost; "
        "sidecar = the whole process)"
    )
    print(
        f"{'mode':5s} {'variant':8s} {'role':8s} {'process':12s} {'cpu_s':>8s} {'kvlens_s':>9s} {'share':>7s} "
        f"{'cpu_ms/req':>10s} {'kvlens_ms/req':>13s} {'events':>7s}"
    )
    for r in results:
        n = max(r["ok"], 1)
        for p in r["rows"]:
            share = p["kvlens_s"] / p["cpu_s"] if p["cpu_s"] else 0.0
            print(
                f"{r['mode']:5s} {r['variant']:8s} {p['role']:8s} {p['kind']:12s} {p['cpu_s']:8.2f} "
                f"{p['kvlens_s']:9.4f} {share:7.2%} {p['cpu_s'] / n * 1e3:10.2f} {p['kvlens_s'] / n * 1e3:13.4f} "
                f"{p['events']:7d}"
            )
    print("\nengine processes (API server + EngineCore + workers of P and D), CPU per request")
    stock = {r["mode"]: r for r in results if r["variant"] == "stock"}
    for r in results:
        n = max(r["ok"], 1)
        eng = [p for p in r["rows"] if p["kind"] in ENGINE_KINDS]
        cpu = sum(p["cpu_s"] for p in eng) / n
        kv = sum(p["kvlens_s"] for p in eng) / n if r["variant"] != "stock" else 0.0
        side = sum(p["cpu_s"] for p in r["rows"] if p["kind"] == "sidecar") / n
        line = (
            f"{r['mode']:5s} {r['variant']:8s} engine {cpu * 1e3:8.2f} ms/req  kvlens in engine "
            f"{kv * 1e3:7.3f} ms/req ({kv / cpu if cpu else 0:.2%})  sidecar {side * 1e3:7.2f} ms/req  "
            f"attributed {1 + (kv / (cpu - kv) if cpu > kv else 0):.4f}"
        )
        s = stock.get(r["mode"])
        if s and r["variant"] != "stock":
            scpu = sum(p["cpu_s"] for p in s["rows"] if p["kind"] in ENGINE_KINDS) / max(s["ok"], 1)
            line += f"  ratio vs stock {cpu / scpu if scpu else float('nan'):.3f}"
        if r["variant"] != "stock":
            c = r["check"]
            verdict = "OK" if c["recorded"] == c["stored"] + c["lost_counted"] else "MISMATCH"
            line += f"  | recorded {c['recorded']} = stored {c['stored']} + lost {c['lost_counted']}: {verdict}"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--builders", default="sidecar", help="instrumented variants: sidecar, inline or both")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock connector")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to let background work finish")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    builders = [b for b in a.builders.split(",") if b]
    if set(modes) - {"push", "pull"} or set(builders) - {"sidecar", "inline"} or a.requests < 1:
        ap.error("--modes: push,pull; --builders: sidecar,inline; --requests >= 1")
    inline_us = statistics.median(bench_recorder(shipping=True)) / 1000
    print(f"inline cost per event (Recorder.record, measured here): {inline_us:.3f} us", file=sys.stderr)
    table_us = statistics.median(bench_recorder(shipping=True, table=True)) / 1000
    print(
        f"  with one open-handoff table op per event (upper bound; docs/handoff-health.md): {table_us:.3f} us",
        file=sys.stderr,
    )
    home = scratch_dir("kvlens-cpu-")
    from kvlens.model import ensure_model

    model = ensure_model(home / "model")
    maker = PromptMaker(model)
    rng = seeded_rng(a.seed)
    prompts = [maker.make(a.input_len, rng) for _ in range(a.requests)]
    variants = ([] if a.no_stock else ["stock"]) + builders
    results = []
    try:
        for mode in modes:
            for v in variants:
                results.append(run_variant(mode, v, a, model, prompts, inline_us))
    except KeyboardInterrupt:
        print("interrupted; the pair was stopped", file=sys.stderr)
    print(
        f"\nload: {a.requests} requests x {a.input_len} prompt tokens, {a.output_len} output tokens, "
        f"concurrency {a.concurrency}; inline cost {inline_us:.3f} us/event"
    )
    report(results)
    if a.json:
        a.json.write_text(json.dumps({"inline_us": inline_us, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():
        sys.exit(main())
