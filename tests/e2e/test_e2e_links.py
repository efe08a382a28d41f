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
3. Loss (``p-d=20ms,5%``): dropped packets and TCP retransmissions counted
   (``network.counters``), the read phases slower than at the same delay
   without loss, every request one trace joined to its P and D.
4. Clock bounds with real round trips (``router-d=100ms``): each request's
   own interval still contains D's shift and widens by the router->D
   one-way delay (pull's P->D bound is P's answer relayed by the router).
5. A 100 Mbit/s rate and exactly 2048-token prompts: kvlens' bandwidth
   figure within 15 % of the measured TCP goodput, and the read phases grow
   from 512 to 2048 tokens by the extra bytes over that rate.
6. After stop, and after SIGKILL of a ``kvlens up --hosts`` being started:
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
from kvtrace import cpusplit, schedtrace, store, tracemodel
from kvtrace.stats import bootstrap_diff
import store_sql

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6
DELAY_S = 0.02
N = 8
#: the loss step's drop probability per packet, each way on P<->D (docs/links.md, "Loss")
LOSS = 0.05
#: the clock step's one-way delay on router<->D: well above the ~10-20 ms the interval's other parts move by
#: between two batches of 8 on a busy machine (50 ms left a 40 % tolerance only ~10 ms from a CI run's noise)
CLOCK_DELAY_S = 0.1
RATE_TOKENS = 2048
#: the rate step's link: 2048 tokens (2 MiB of KV) take ~170 ms at 100 Mbit/s, so the ~5-20 ms a READ waits
#: for the engine loops (not bytes) stays well inside 15 % (200 Mbit/s, 84 ms: 4-12 % below the goodput in CI)
RATE_BPS = 100e6
RATE_SPEC = f"p-d=1ms,{RATE_BPS / 1e6:g}mbit"
READ_PHASES = ("read.wire", "read.complete", "read.noticed")
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


def _send(url: str, n: int, words: int, tag: str, prompts: list[str] | None = None) -> dict[str, int]:
    """``n`` requests one after another (``prompts``, else ``words`` + i words each): trace id -> the
    prompt tokens vLLM counted (its ``usage``)."""
    ids = {}
    with httpx.Client(timeout=300, trust_env=False) as c:
        for i in range(n):
            tid = uuid.uuid4().hex
            prompt = prompts[i] if prompts else f"{tag} {i} {uuid.uuid4().hex} " + "tokens " * words
            r = c.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       headers={"X-Request-Id": tid})  # fmt: skip
            assert r.status_code == 200, r.text
            ids[tid] = r.json()["usage"]["prompt_tokens"]
    return ids


def _prompts(model: Path, n: int, tokens: int, tag: str) -> list[str]:
    """``n`` distinct prompts of exactly ``tokens`` tokens for the model's tokenizer (its BOS included,
    as vLLM counts them): " token" is one token of the tiny model's vocabulary, "tokens" two."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    out = []
    for i in range(n):
        head = f"{tag} {i} {uuid.uuid4().hex}"
        k = tokens - len(tok(head).input_ids)
        for _ in range(20):
            got = len(tok(head + " token" * k).input_ids)
            if got == tokens:
                break
            k += tokens - got
        assert got == tokens, (got, tokens)
        out.append(head + " token" * k)
    return out


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
    # the row lists every shaped direction of the stack (router<->D too, unshaped now): the spec's are P<->D
    pd = [d for d in row["link"]["directions"] if {d["src"], d["dst"]} == {"p0", "d0"}]
    assert len(pd) == 2, row["link"]["directions"]
    for d in pd:
        assert d["asked_rate_bps"] == RATE_BPS and d["rtt_s"] == measured[(d["src"], d["dst"])]["rtt_s"], d
    assert f"{spec}: round trip" in row["link"]["summary"], row["link"]["summary"]


def _read_s(t) -> float:
    """A trace's time in the read phases (post -> done -> noticed: the READ's round trips)."""
    return sum(ns for (_r, p), ns in t.tiling().phases.items() if p in READ_PHASES) / 1e9


def _own_widths(db, ids) -> dict[str, tuple[int, int]]:
    """Each request's own clock interval (ns, D's clock minus P's: the store's ``xlo_ns``, ``xhi_ns``)
    before the pair's window tightens it: what one request's crossings bound."""
    deadline = time.monotonic() + 60  # P's kv.released (the D->P bound's end) follows kv.ready, in a later batch
    while True:
        with store.reading(db) as conn:
            got = store_sql.own_intervals(conn, list(ids))
        if len(got) == len(ids) or time.monotonic() > deadline:
            assert len(got) == len(ids), (len(got), len(ids))
            return got
        time.sleep(0.5)


def _joined(db, sent: dict[str, int]) -> dict:
    """Every request one trace, joined to its P and its D: the prompt tokens P's and D's spans
    recorded are the ones vLLM counted for that request (a mis-join would mix two). D's scheduler
    spans (alloc) may come in a later export batch than its worker's: waited for."""
    deadline = time.monotonic() + 60
    while True:
        traces = _traces(db, sent)
        bad = {}
        for tid, t in traces.items():
            toks: dict[str, set] = {}
            for sp in t.spans:
                if sp.role in ("prefill", "decode") and sp.attributes.get("kvlens.tokens") is not None:
                    toks.setdefault(sp.role, set()).add(sp.attributes["kvlens.tokens"])
            if (t.p_engine, t.d_engine) != ("p0", "d0") or not toks.get("prefill") == toks.get("decode") == {sent[tid]}:
                bad[tid] = (t.p_engine, t.d_engine, toks, sent[tid])
        if not bad or time.monotonic() > deadline:
            assert sorted(traces) == sorted(sent) and not bad, bad
            return traces
        time.sleep(1)


def _delay_is_not_cpu_wait(base: dict, delayed: dict, d_handoff: float, sched=None) -> None:
    """Issue 41's known answer for the wire: a link delay's rise in the handoff
    lies outside CPU wait (>= 70 %), the CPU wait rises by no more than its own
    spread without the delay (p90 - p10 of the baseline's per-request CPU wait:
    the noise), and the read phases' CPU wait stays a small part of their rise."""
    split = {k: [cpusplit.handoff_cpu(t, sched) for t in v.values()] for k, v in (("base", base), ("delayed", delayed))}
    waits = {k: [h.cpu_wait_s for h in v] for k, v in split.items()}
    assert all(w is not None for v in waits.values() for w in v), waits  # every request carries its figures
    med = {k: statistics.median(v) for k, v in waits.items()}
    q = statistics.quantiles(waits["base"], n=10)
    noise = q[-1] - q[0]
    rise = med["delayed"] - med["base"]
    read_wait = {
        k: statistics.median(sum(h.phases_wait_s.get(p) or 0.0 for p in READ_PHASES) for h in v)
        for k, v in split.items()
    }
    print(f"{'kernel record: ' if sched is not None else ''}CPU wait p50 {med['base'] * 1e3:.1f} -> {med['delayed'] * 1e3:.1f} ms (noise p90-p10 without the "
          f"delay {noise * 1e3:.1f} ms); read phases' CPU wait p50 {read_wait['base'] * 1e3:.1f} -> "
          f"{read_wait['delayed'] * 1e3:.1f} ms; handoff +{d_handoff * 1e3:.1f} ms")  # fmt: skip
    assert d_handoff - rise >= 0.7 * d_handoff, (d_handoff, med)
    # the rise is a difference of two medians of 8: it must not be resolvably above the noise. Its bootstrap
    # interval's low end is held to the noise (a clean clone's suite failed the bare comparison: +5.0 ms against
    # a 4.7 ms spread). Calling the delay CPU wait would still fail: a ~40 ms rise
    low, _hi = bootstrap_diff([waits["delayed"]], [waits["base"]])
    print(f"CPU wait rise {rise * 1e3:.1f} ms, its 95 % bootstrap interval's low end {low * 1e3:.1f} ms")
    assert low <= noise, (rise, low, noise, waits)


def test_links_pull_delay_rate_clock_and_cleanup(links_stack, stack_factory, kvlens_home):
    from test_e2e_fleet import _check_fleet

    stack = links_stack
    net = stack.net
    m = json.loads((Path(stack.log_dir) / "stack.json").read_text())
    assert m["network"]["addresses"]["router"] in stack.router_url
    pairs = {x["src"] + ">" + x["dst"]: x for x in m["network"]["links"]}
    assert set(pairs) == {"p0>d0", "d0>p0", "router>d0", "d0>router"}
    assert all(x["measured"]["rtt_s"] is not None for x in m["network"]["links"])
    rd_rtt0 = pairs["router>d0"]["measured"]["rtt_min_s"]
    shift = FLEET_CLOCK_SHIFT_S["pull"]
    timing = {}

    def took(step: str, t0: float) -> None:
        timing[step] = time.monotonic() - t0
        print(f"[step {step}: {timing[step]:.1f} s]")

    # 1. the cross-host checks, over namespaces (also the baseline's warm-up)
    t0 = time.monotonic()
    _check_fleet(stack, "pull")
    took("fleet", t0)

    # 2. baseline, then one-way delay d on P<->D
    t0 = time.monotonic()
    sched_dir = Path(stack.log_dir) / "sched-delay"
    with stack.record_sched(sched_dir):  # the kernel's record of both batches (kvlens up --sched-trace)
        base = _traces(stack.store, _send(stack.router_url, N, 300, "base"))
        links = stack.reshape(f"p-d={DELAY_S * 1e3:g}ms")
        rtt = statistics.median(x["measured"]["rtt_min_s"] for x in links if "p0" in (x["src"], x["dst"]))
        delayed = _traces(stack.store, _send(stack.router_url, N, 300, "delayed"))
    b_med, d_med = _phase_medians(base), _phase_medians(delayed)
    d_handoff = statistics.median(t.handoff_s for t in delayed.values()) - statistics.median(
        t.handoff_s for t in base.values()
    )
    increase = {p: d_med.get(p, 0.0) - b_med.get(p, 0.0) for p in set(b_med) | set(d_med)}
    print(f"\nlink probe rtt {rtt * 1e3:.2f} ms; handoff +{d_handoff * 1e3:.1f} ms; per phase (ms):",
          {p: round(v * 1e3, 1) for p, v in sorted(increase.items())})  # fmt: skip
    print("baseline medians (ms):", {p: round(v * 1e3, 1) for p, v in sorted(b_med.items())})
    wire = sum(increase.get(p, 0.0) for p in READ_PHASES)
    kv_bytes = statistics.median(t.to_json()["transfer"]["bytes"] for t in delayed.values())
    # pull's READ puts at least one round trip (request D->P, data P->D) on the critical path, plus one per
    # further TCP window the data needs (docs/links.md: at most log2(bytes / initial window) in slow start)
    most = 1 + max(0.0, math.log2(kv_bytes / INITIAL_WINDOW_BYTES))
    print(
        f"KV {kv_bytes} bytes: handoff +{d_handoff / rtt:.2f} round trips (protocol floor 1, window bound {most:.1f})"
    )
    # each delayed READ spans at least one round trip (its request goes to P, its data comes back) ...
    wire_of = lambda med: sum(med.get(p, 0.0) for p in READ_PHASES)  # noqa: E731
    assert wire_of(d_med) >= 0.95 * rtt, (wire_of(d_med), rtt, d_med)
    # ... but the handoff grows by less than that when the baseline's own READ wait (the engine loop seeing
    # NIXL's DONE on its next step) is absorbed by the delay: the floor is one round trip less that wait
    assert 0.9 * rtt - wire_of(b_med) <= d_handoff <= (most + 0.5) * rtt, (d_handoff, rtt, most, increase, b_med)
    # the delay is in the read phases (the floor above: each delayed READ holds a round trip, against a baseline
    # READ of ~10 ms) and nowhere else: no other phase's median moves by a crossing (half a round trip). Not
    # checked: that the read phases hold all of the handoff's increase. A batch of 8 on a busy machine moves every
    # phase by a few ms the same way (a full clean-clone run: read phases +38.0 of a +49.5 ms handoff, the other five
    # +0.5 to +4.8 ms each, 14.6 ms together), so a bound on their sum is a bound on the machine's load
    others = {p: v for p, v in increase.items() if not p.startswith("read.") and abs(v) > 0.5 * rtt}
    assert not others, (others, wire, d_handoff)
    for t in delayed.values():  # the clock bound still holds the shift, with real round trips
        assert t.clock_lo_s - EPS <= shift <= t.clock_hi_s + EPS, (t.trace_id, t.clock_lo_s, t.clock_hi_s)
    _delay_is_not_cpu_wait(base, delayed, d_handoff)
    # the same answer, each phase walked in the kernel's record
    _delay_is_not_cpu_wait(base, delayed, d_handoff, schedtrace.load(sched_dir))
    took("delay", t0)

    # 3. loss on P<->D, on top of the delay: TCP retransmits, the READs take longer, nothing is lost or mis-joined
    t0 = time.monotonic()
    links = stack.reshape(f"p-d={DELAY_S * 1e3:g}ms,{LOSS * 100:g}%")
    probe_pd = next(x["measured"] for x in links if x["src"] == "p0")
    c0 = net.counters()
    sent = _send(stack.router_url, N, 300, "lossy", [f"lossy {i} {uuid.uuid4().hex} " + "tokens " * (300 + 16 * i)
                                                     for i in range(N)])  # fmt: skip
    lossy = _joined(stack.store, sent)
    c1 = net.counters()
    drops = {k: c1["links"][k]["dropped_packets"] - c0["links"][k]["dropped_packets"] for k in ("p0>d0", "d0>p0")}
    retrans = {k: c1["tcp"][k]["retrans_segs"] - c0["tcp"][k]["retrans_segs"] for k in ("p0", "d0")}
    lossy_read = [_read_s(t) for t in lossy.values()]
    delayed_read = [_read_s(t) for t in delayed.values()]
    print(f"loss {LOSS:.0%}: probe goodput {probe_pd['goodput_bps'] / 1e6:.0f} Mbit/s, "
          f"{probe_pd.get('retrans_segs')} retransmitted of {probe_pd.get('out_segs')}; requests: dropped {drops}, "
          f"retransmitted segments {retrans}; read phases (ms) {sorted(round(x * 1e3, 1) for x in lossy_read)} "
          f"against {sorted(round(x * 1e3, 1) for x in delayed_read)} without loss")  # fmt: skip
    m = json.loads((Path(stack.log_dir) / "stack.json").read_text())
    assert m["network"]["counters"]["links"]["p0>d0"]["dropped_packets"] > 0, m["network"]["counters"]
    assert probe_pd["retrans_segs"] > 0, probe_pd  # the probe's transfer saw the loss too
    # counted: the rule dropped the requests' packets, and P (which sends the KV) retransmitted
    assert drops["p0>d0"] > 0 and retrans["p0"] > 0, (drops, retrans)
    # slower: every lost data packet costs its READ at least one more round trip (the loss is detected by the
    # next acknowledgments, or a timer), on top of the same delay's READs. The drop rule sees the sender's GSO
    # segments whole (veth passes them on unsplit: up to 64 KiB; 6 drops, 180 retransmitted segments in one run),
    # so a 640 KB READ meets ~10-20 "packets" and some READs lose none: the mean
    # grows, and the slowest lossy READ exceeds the usual delayed one by more than half a round trip. (Not the
    # slowest delayed one: a delayed READ that needs a second TCP window takes two round trips too; one run had
    # one at 90 ms against lossy ones of 87-94 ms.)
    assert statistics.mean(lossy_read) > statistics.mean(delayed_read), (lossy_read, delayed_read)
    assert max(lossy_read) > statistics.median(delayed_read) + 0.5 * rtt, (lossy_read, delayed_read)
    took("loss", t0)

    # 4. the clock bound with a real round trip on router<->D: pull's P->D bound is P's answer relayed by the
    # router (prefill.finished -> D's alloc), so each request's own interval widens by router->D's one-way delay
    t0 = time.monotonic()
    stack.reshape("p-d=0ms", probe=False)
    links = stack.reshape(f"router-d={CLOCK_DELAY_S * 1e3:g}ms")
    rd_rtt = next(x["measured"]["rtt_min_s"] for x in links if x["src"] == "router")
    clocked = _traces(stack.store, _send(stack.router_url, N, 300, "clock"))
    w_base, w_rd = _own_widths(stack.store, base), _own_widths(stack.store, clocked)
    w_delay = _own_widths(stack.store, delayed)
    for lo, hi in [*w_base.values(), *w_rd.values(), *w_delay.values()]:
        assert lo - EPS * 1e9 <= shift * 1e9 <= hi + EPS * 1e9, (lo, hi, shift)
    for t in clocked.values():
        assert t.clock_lo_s - EPS <= shift <= t.clock_hi_s + EPS, (t.trace_id, t.clock_lo_s, t.clock_hi_s)
    med_w = lambda w: statistics.median(hi - lo for lo, hi in w.values()) / 1e9  # noqa: E731
    tight = lambda w: (min(hi for _, hi in w.values()) - max(lo for lo, _ in w.values())) / 1e9  # noqa: E731
    grown, expect = med_w(w_rd) - med_w(w_base), (rd_rtt - rd_rtt0) / 2
    stored = statistics.median(t.clock_hi_s - t.clock_lo_s for t in clocked.values())
    # theta is the same for all: the growth of each end is the growth of its message's latency
    p2d = (statistics.median(hi for _, hi in w_rd.values()) - statistics.median(hi for _, hi in w_base.values())) / 1e9
    d2p = (statistics.median(lo for lo, _ in w_base.values()) - statistics.median(lo for lo, _ in w_rd.values())) / 1e9
    print(f"clock: router<->D rtt {rd_rtt0 * 1e3:.2f} -> {rd_rtt * 1e3:.2f} ms; own interval width (median) "
          f"{med_w(w_base) * 1e3:.1f} -> {med_w(w_rd) * 1e3:.1f} ms (+{grown * 1e3:.1f}, expected +{expect * 1e3:.1f}: "
          f"P->D end +{p2d * 1e3:.1f}, D->P end {d2p * 1e3:+.1f}); tightest of each batch {tight(w_base) * 1e3:.1f} "
          f"-> {tight(w_rd) * 1e3:.1f} ms; with p-d={DELAY_S * 1e3:g}ms {med_w(w_delay) * 1e3:.1f} ms (P<->D rtt "
          f"{rtt * 1e3:.1f}); stored (the pair's 60 s window) {stored * 1e3:.1f} ms")  # fmt: skip
    print("own widths (ms): base", sorted(round((h - lo) / 1e6, 1) for lo, h in w_base.values()),
          "router-d", sorted(round((h - lo) / 1e6, 1) for lo, h in w_rd.values()))  # fmt: skip
    # one crossing router->D: the P->D end and the width grow by half the round trip (the other half, D->router,
    # carries D's answer, off the bound), the D->P end by nothing. What else is in the interval moves between
    # batches of 8: a few ms on the P->D end (P's answer, the relay, D's scheduling of the alloc), up to ~10 ms
    # on the D->P end (when P's engine loop notices the READ's done notification): tolerance 40 % of a 100 ms
    # crossing (40 ms); one crossing too many or too few is 100 %
    assert abs(p2d - expect) <= 0.4 * expect, (p2d, expect)
    assert d2p <= 0.5 * expect, (d2p, expect)
    assert abs(grown - expect) <= 0.4 * expect, (grown, expect)
    # and with the delay on P<->D the D->P bound (READ request, data, done notification) takes the READ's
    # round trip(s) and one more crossing: wider by at least one P<->D round trip, less the baseline's own READ
    # wait that the delay absorbs (as for the handoff's floor in step 2; measured +52 to +57 ms at a 41 ms rtt)
    assert med_w(w_delay) - med_w(w_base) >= 0.9 * rtt - wire_of(b_med), (med_w(w_delay), med_w(w_base), rtt, b_med)
    stack.reshape("router-d=0ms", probe=False)
    took("clock", t0)

    # 5. the rate: 2048-token prompts over 100 Mbit/s (a short delay keeps TCP's window open); 512-token ones
    # for the slope: the wire grows by bytes / rate
    t0 = time.monotonic()
    links = stack.reshape(RATE_SPEC)
    goodput = next(x["measured"]["goodput_bps"] for x in links if x["src"] == "p0")
    tx0 = _tx_bytes(net.ns("p0"))
    sent = _send(stack.router_url, 4, 0, "", _prompts(Path(stack.model), 4, RATE_TOKENS, "rated"))
    assert set(sent.values()) == {RATE_TOKENS}, sent
    rated = _joined(stack.store, sent)
    figs = [t.to_json()["transfer"] for t in rated.values()]
    # the KV went over P's veth (UCX over TCP on kvl0), not shared memory or loopback
    assert _tx_bytes(net.ns("p0")) - tx0 >= sum(f["bytes"] for f in figs), figs
    gbps = statistics.median(f["gbps"] for f in figs if f and f["gbps"])
    small = _traces(stack.store, _send(stack.router_url, 4, 0, "", _prompts(Path(stack.model), 4, 512, "small")))
    big_b, small_b = (statistics.median(t.to_json()["transfer"]["bytes"] for t in x.values()) for x in (rated, small))
    big_w, small_w = (statistics.median(_read_s(t) for t in x.values()) for x in (rated, small))
    slope_bps = (big_b - small_b) * 8 / (big_w - small_w)
    print(f"goodput {goodput / 1e6:.1f} Mbit/s, kvlens bandwidth {gbps * 1e3:.1f} Mbit/s, bytes {figs[0]['bytes']} "
          f"({RATE_TOKENS} tokens); read {small_w * 1e3:.1f} ms for {small_b} bytes, {big_w * 1e3:.1f} ms for "
          f"{big_b}: {slope_bps / 1e6:.1f} Mbit/s")  # fmt: skip
    assert abs(gbps * 1e9 - goodput) <= 0.15 * goodput, (gbps, goodput, figs)
    # the extra bytes cost the extra read time at the link's rate (what is not bytes, the round trip and the
    # post, is the same for both sizes and cancels). 25 %: a difference of two medians of 4, each a few ms
    # noisy (when D's loop notices the READ done), over the ~125 ms that 1.5 MiB more takes at 100 Mbit/s
    assert abs(slope_bps - goodput) <= 0.25 * goodput, (slope_bps, goodput, big_w, small_w, big_b, small_b)
    took("rate", t0)

    # 5b. `kvlens bench --link`'s rows on this link (the library calls its CLI makes, on this running stack)
    _bench_row_names_its_link(stack, RATE_SPEC, links)

    # 6. nothing left after stop
    sid = net.sid
    assert _leftovers(sid, stack.log_dir)["delayers"]
    stack_factory.stop()
    assert _leftovers(sid, stack.log_dir) == {"namespaces": [], "veths": [], "pids": [], "delayers": []}
    print("step seconds:", {k: round(v, 1) for k, v in timing.items()})


def test_links_sigkill_leaves_nothing(tmp_path, kvlens_home, tiny_model):
    """``kvlens up --hosts`` SIGKILLed while its servers start: the keeper's
    guard removes the network, the guards stop every child and delayer."""
    _need_root()
    env = {**os.environ, "KVLENS_HOME": str(kvlens_home)}
    logs = tmp_path / "logs"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--hosts", "--insecure", "--link", "p-d=5ms,1gbit",
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
