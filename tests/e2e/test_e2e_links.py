"""End-to-end on real links (docs/links.md): a pull stack with every role in
its own network namespace (``kvlens up --hosts``), P<->D through a delayer
and, later, a tbf rate; the "three hosts" layout on top (separate homes,
the receiver in the router, D's clock shifted -0.25 s). One stack start:
the link is re-shaped between the steps and measured each time.

1. The cross-host pull checks of tests/e2e/test_e2e_fleet.py, now over
   namespaces (joined traces, clock bound contains the shift, metrics,
   vLLM's own spans), at no injected delay: the baseline.
2. One-way delay d on P<->D: pull's critical path crosses P<->D at least
   twice (the READ's request and its data, docs/links.md), so the handoff
   grows by at least the measured round trip, by at most one more per TCP
   window the KV needs, in ``read.wire``, and nowhere else.
3. A 200 Mbit/s rate and 2048-token prompts: kvlens' bandwidth figure
   within 15 % of the measured TCP goodput.
4. After stop, and after SIGKILL of a ``kvlens up --hosts`` being started:
   no namespace, veth, iptables rule (they live in the namespaces) or delayer
   (their command lines, from ``/proc`` as ``ps`` shows them).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import FLEET_CLOCK_SHIFT_S
from kvtrace import store, tracemodel

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6
DELAY_S = 0.02
N = 8
#: TCP's initial congestion window (10 segments of a 1500-byte MTU's 1448-byte MSS, RFC 6928)
INITIAL_WINDOW_BYTES = 10 * 1448


def _need_root():
    from kvlens.stack.errors import StackError
    from kvlens.stack.netns import check_tools

    if os.geteuid() != 0:
        pytest.skip("--hosts needs root")
    try:
        check_tools(need_queue=True)
    except StackError as e:
        pytest.skip(str(e))


def _send(url: str, n: int, words: int, tag: str) -> list[str]:
    ids = []
    with httpx.Client(timeout=300, trust_env=False) as c:
        for i in range(n):
            tid = uuid.uuid4().hex
            prompt = f"{tag} {i} {uuid.uuid4().hex} " + "tokens " * words
            r = c.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       headers={"X-Request-Id": tid})  # fmt: skip
            assert r.status_code == 200, r.text
            ids.append(tid)
    return ids


def _traces(db, ids, timeout=120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        with store.reading(db) as conn:
            got = tracemodel.find(conn, ids)
        ok = all(t in got and got[t].handoff_s is not None and got[t].tiling() is not None for t in ids)
        if ok or time.monotonic() > deadline:
            assert ok, {t: (got.get(t) and got[t].handoff_note) for t in ids}
            return got


def _phase_medians(traces) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    for t in traces.values():
        for (_role, phase), ns in t.tiling().phases.items():
            per.setdefault(phase, []).append(ns / 1e9)
    n = len(traces)
    return {p: statistics.median(v + [0.0] * (n - len(v))) for p, v in per.items()}


def delayers(word: str) -> list[str]:
    """Command lines of the live delayers whose arguments contain ``word`` (``/proc``, as ``ps`` reads it)."""
    from kvlens.stack.leftovers import cmdline

    out = []
    for d in os.listdir("/proc"):
        argv = cmdline(int(d)) if d.isdigit() else None
        if argv and "kvlens.stack.delayer" in argv and any(word in a for a in argv):
            out.append(" ".join(argv))
    return out


def _tx_bytes(ns: str) -> int:
    return int(subprocess.check_output(["ip", "netns", "exec", ns, "cat", "/sys/class/net/kvl0/statistics/tx_bytes"]))


def _leftovers(sid: str, log_dir) -> dict:
    """What of stack ``sid`` is left: namespaces (its veths, qdiscs and iptables rules live there),
    the root veth, processes inside, and its delayers (``ps``: their control files are in ``log_dir``)."""
    from kvlens.stack import netclean

    return {**netclean.objects(sid), "delayers": delayers(str(log_dir))}


def _bench_row_names_its_link(stack, spec: str, links: list[dict]) -> None:
    """A small bench cell (``kvlens.bench.runner``) on the running stack: every
    request completes and its row records the link asked and measured."""
    from kvlens.bench.grid import BenchOptions
    from kvlens.bench.runner import bench_routers, new_run, stack_targets

    opts = BenchOptions(qps=[8.0], input_lens=[64], output_len=2, num_prompts=3, warmup=0, trace_wait_s=60.0,
                        store=stack.store, progress=False, model=stack.model, links=(spec,))  # fmt: skip
    (row,) = bench_routers(stack_targets(stack, "pull", [None], opts), opts, run=new_run(opts)).rows
    assert row["completed"] == 3 and row["handoff_p50_s"] is not None, row
    assert row["link"]["spec"] == [spec]
    measured = {(x["src"], x["dst"]): x["measured"] for x in links}
    for d in row["link"]["directions"]:
        assert d["asked_rate_bps"] == 200e6 and d["rtt_s"] == measured[(d["src"], d["dst"])]["rtt_s"], d


def test_links_pull_delay_rate_clock_and_cleanup(links_stack, stack_factory, kvlens_home):
    from test_e2e_fleet import _check_fleet

    stack = links_stack
    net = stack.net
    m = json.loads((Path(stack.log_dir) / "stack.json").read_text())
    assert m["network"]["addresses"]["router"] in stack.router_url
    assert {x["src"] + ">" + x["dst"] for x in m["network"]["links"]} == {"p0>d0", "d0>p0"}
    assert all(x["measured"]["rtt_s"] is not None for x in m["network"]["links"])
    shift = FLEET_CLOCK_SHIFT_S["pull"]

    # 1. the cross-host checks, over namespaces (also the baseline's warm-up)
    _check_fleet(stack, "pull")

    # 2. baseline, then one-way delay d on P<->D
    base = _traces(stack.store, _send(stack.router_url, N, 300, "base"))
    links = stack.reshape(f"p-d={DELAY_S * 1e3:g}ms")
    rtt = statistics.median(x["measured"]["rtt_min_s"] for x in links)
    delayed = _traces(stack.store, _send(stack.router_url, N, 300, "delayed"))
    b_med, d_med = _phase_medians(base), _phase_medians(delayed)
    d_handoff = statistics.median(t.handoff_s for t in delayed.values()) - statistics.median(
        t.handoff_s for t in base.values()
    )
    increase = {p: d_med.get(p, 0.0) - b_med.get(p, 0.0) for p in set(b_med) | set(d_med)}
    print(f"\nlink probe rtt {rtt * 1e3:.2f} ms; handoff +{d_handoff * 1e3:.1f} ms; per phase (ms):",
          {p: round(v * 1e3, 1) for p, v in sorted(increase.items())})  # fmt: skip
    print("baseline medians (ms):", {p: round(v * 1e3, 1) for p, v in sorted(b_med.items())})
    wire = increase.get("read.wire", 0.0) + increase.get("read.complete", 0.0) + increase.get("read.noticed", 0.0)
    kv_bytes = statistics.median(t.to_json()["transfer"]["bytes"] for t in delayed.values())
    # pull's READ puts at least one round trip (request D->P, data P->D) on the critical path, plus one per
    # further TCP window the data needs (docs/links.md: at most log2(bytes / initial window) in slow start)
    most = 1 + max(0.0, math.log2(kv_bytes / INITIAL_WINDOW_BYTES))
    print(
        f"KV {kv_bytes} bytes: handoff +{d_handoff / rtt:.2f} round trips (protocol floor 1, window bound {most:.1f})"
    )
    # each delayed READ spans at least one round trip (its request goes to P, its data comes back) ...
    wire_of = lambda med: sum(med.get(p, 0.0) for p in ("read.wire", "read.complete", "read.noticed"))  # noqa: E731
    assert wire_of(d_med) >= 0.95 * rtt, (wire_of(d_med), rtt, d_med)
    # ... but the handoff grows by less than that when the baseline's own READ wait (the engine loop seeing
    # NIXL's DONE on its next step) is absorbed by the delay: the floor is one round trip less that wait
    assert 0.9 * rtt - wire_of(b_med) <= d_handoff <= (most + 0.5) * rtt, (d_handoff, rtt, most, increase, b_med)
    assert wire >= 0.9 * d_handoff, (wire, d_handoff, increase)  # in the read phases
    others = {p: v for p, v in increase.items() if not p.startswith("read.") and abs(v) > 0.5 * rtt}
    assert not others, others  # and nowhere else
    for t in delayed.values():  # the clock bound still holds the shift, with real round trips
        assert t.clock_lo_s - EPS <= shift <= t.clock_hi_s + EPS, (t.trace_id, t.clock_lo_s, t.clock_hi_s)

    # 3. the rate: 2048-token prompts over 200 Mbit/s (a short delay keeps TCP's window open)
    links = stack.reshape("p-d=1ms,200mbit")
    goodput = next(x["measured"]["goodput_bps"] for x in links if x["src"] == "p0")
    tx0 = _tx_bytes(net.ns("p0"))
    rated = _traces(stack.store, _send(stack.router_url, 4, 2000, "rated"))
    figs = [t.to_json()["transfer"] for t in rated.values()]
    # the KV went over P's veth (UCX over TCP on kvl0), not shared memory or loopback
    assert _tx_bytes(net.ns("p0")) - tx0 >= sum(f["bytes"] for f in figs), figs
    gbps = statistics.median(f["gbps"] for f in figs if f and f["gbps"])
    print(f"goodput {goodput / 1e6:.1f} Mbit/s, kvlens bandwidth {gbps * 1e3:.1f} Mbit/s, bytes {figs[0]['bytes']}")
    assert abs(gbps * 1e9 - goodput) <= 0.15 * goodput, (gbps, goodput, figs)

    # 3b. `kvlens bench --link`'s rows on this link (the library calls its CLI makes, on this running stack)
    _bench_row_names_its_link(stack, "p-d=1ms,200mbit", links)

    # 4. nothing left after stop
    sid = net.sid
    assert _leftovers(sid, stack.log_dir)["delayers"]
    stack_factory.stop()
    assert _leftovers(sid, stack.log_dir) == {"namespaces": [], "veths": [], "pids": [], "delayers": []}


def test_links_sigkill_leaves_nothing(tmp_path, kvlens_home, tiny_model):
    """``kvlens up --hosts`` SIGKILLed while its servers start: the keeper's
    guard removes the network, the guards stop every child and delayer."""
    _need_root()
    env = {**os.environ, "KVLENS_HOME": str(kvlens_home)}
    logs = tmp_path / "logs"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--hosts", "--link", "p-d=5ms,1gbit",
         "--port", "0", "--model", str(tiny_model), "--log-dir", str(logs)],
        stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        _kill_while_starting(up, logs, tmp_path / "up.log")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)


def _kill_while_starting(up, logs: Path, out: Path) -> None:
    deadline = time.monotonic() + 120
    sid = None
    while time.monotonic() < deadline:
        try:
            m = json.loads((logs / "stack.json").read_text())
            if "prefill" in m.get("pids", {}):
                sid = m["network"]["id"]
                break
        except (OSError, ValueError, KeyError):
            pass
        assert up.poll() is None, f"kvlens up exited {up.returncode}: {out.read_text(errors='replace')[-3000:]}"
        time.sleep(0.3)
    assert sid, "the stack never reached its servers"
    assert _leftovers(sid, logs)["namespaces"] and _leftovers(sid, logs)["delayers"]
    os.kill(up.pid, signal.SIGKILL)
    up.wait()
    deadline = time.monotonic() + 60
    while any(_leftovers(sid, logs).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _leftovers(sid, logs) == {"namespaces": [], "veths": [], "pids": [], "delayers": []}
