"""End-to-end with a real Prometheus server scraping the real stack: the
router's, P's and D's /metrics (issue: phase metrics in Prometheus).

Counts are compared as deltas: the shared stack has served the warm-up and
earlier tests before Prometheus starts, and a first scrape records that."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from kvrecord import semconv as sc

pytestmark = pytest.mark.e2e
N = 4


def _safe(fn):
    """``fn()``, or None when Prometheus is slow to answer (a timeout on a busy machine): waits try again."""
    import httpx

    from exporters.promapi import PrometheusError

    try:
        return fn()
    except (httpx.TimeoutException, PrometheusError):
        return None


def _value(prom, q: str) -> float | None:
    """The query's first value; None (not yet) when Prometheus is slow to answer
    (a query timeout on a busy machine), so the caller's wait tries again."""
    res = _safe(lambda: prom.query(q))
    return float(res[0]["value"][1]) if res else None


def _wait(pred, timeout: float = 90.0, step: float = 1.0):
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v or time.time() > deadline:
            return v
        time.sleep(step)


def _prom(stack):
    prom = stack.start_prometheus(port=0)

    def healthy() -> bool:
        t = _safe(prom.targets_health)
        return bool(t) and len(t) >= 3 and all(x["health"] == "up" for x in t)

    up = _wait(healthy)
    assert up, _safe(prom.targets_health)
    return prom


def _send(url: str, n: int) -> None:
    with httpx.Client(timeout=180) as c:
        for i in range(n):
            r = c.post(
                url + "/v1/completions",
                headers={"X-Request-Id": uuid.uuid4().hex},
                json={"prompt": f"prometheus {i} " + "word " * 60, "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200, r.text


def _check_mode(stack, mode: str, phases, owner_job: str, post_phase: str, complete_phase: str) -> None:
    prom = _prom(stack)
    q_handoff = f'sum(kvlens_handoff_seconds_count{{mode="{mode}"}})'
    q_req = f'sum(kvlens_requests_total{{mode="{mode}",outcome="ok"}})'

    def both():  # one reading of both: a query may time out on a loaded machine (None), never mix readings
        h, r = _value(prom, q_handoff), _value(prom, q_req)
        return (h, r) if h is not None and r is not None else None

    before = _wait(both)
    assert before, "router metrics never scraped"
    h0, r0 = before
    health0 = _wait(lambda: _health(prom, mode))
    assert health0, "handoff health metrics never scraped"
    # handoffs an earlier test on this stack left open (a request D never read stays open on P
    # until its lease): ours must all close, theirs may still be open or expire meanwhile
    read0 = _wait(
        lambda: (lambda v: None if v is None else [v])(_value(prom, f'sum(kvlens_handoffs_open{{mode="{mode}"}})'))
    )
    assert read0, "kvlens_handoffs_open never scraped"  # a list: a reading of 0 is an answer, not a retry
    open0 = read0[0]
    _send(stack.router_url, N)
    assert _wait(lambda: _value(prom, q_handoff) == h0 + N), (_value(prom, q_handoff), h0)
    assert _wait(lambda: _value(prom, q_req) == r0 + N), (_value(prom, q_req), r0)
    _check_health(prom, mode, health0, open0)

    # every phase of the mode has a series, scraped from vLLM's own /metrics
    by_phase = _wait(
        lambda: _safe(lambda: prom.query(f'count by (phase) (kvlens_phase_duration_seconds_count{{mode="{mode}"}})'))
    )
    got = {r["metric"]["phase"] for r in by_phase or []}
    assert {p.value for p in phases} <= got, got
    by_job = _wait(
        lambda: _safe(lambda: prom.query(f'count by (job) (kvlens_phase_duration_seconds_count{{mode="{mode}"}})'))
    )
    jobs = {r["metric"]["job"] for r in by_job or []}
    assert {"vllm-prefill", "vllm-decode", "kvlens-router"} <= jobs
    _check_cpu(prom, mode, complete_phase, owner_job.removeprefix("vllm-"))

    # the recording rules evaluate (interval 2 s; rate windows need 2 samples)
    assert _wait(lambda: _safe(lambda: prom.query(f'kvlens:handoff_seconds:p50_1m{{mode="{mode}"}}')), timeout=60)

    # reconciliation with vLLM's own NIXL histogram on the side that owns the
    # transfer: one completion span per NIXL transfer (TP=1); NIXL's
    # xferDuration starts inside the post and ends at NIXL's completion, so it
    # lies within our post + (post end -> DONE seen by the engine loop).
    # transfers only, on their owner's side: P's lease reaper also records a
    # completion point, outcome "expired", for an earlier test's unread request
    # (pull: on P, not the READ's owner); it is no NIXL transfer
    owner = owner_job.removeprefix("vllm-")
    q_ours = (
        f'sum(kvlens_phase_duration_seconds_count{{mode="{mode}",phase="{complete_phase}",role="{owner}",'
        'outcome!="expired"})'
    )
    q_vllm = f'sum(vllm:nixl_xfer_time_seconds_count{{job="{owner_job}"}})'
    assert _wait(lambda: _value(prom, q_vllm) is not None and _value(prom, q_ours) == _value(prom, q_vllm)), (
        _value(prom, q_ours),
        _value(prom, q_vllm),
    )
    ours_sum = _value(
        prom, f'sum(kvlens_phase_duration_seconds_sum{{mode="{mode}",phase=~"{post_phase}|{complete_phase}"}})'
    )
    vllm_sum = _value(prom, f'sum(vllm:nixl_xfer_time_seconds_sum{{job="{owner_job}"}})')
    assert ours_sum >= vllm_sum * 0.99, (ours_sum, vllm_sum)


def _check_cpu(prom, mode: str, phase: str, role: str) -> None:
    """CPU or wire: the transfer's completion spans carry the engine thread's
    schedstat figures, and they reach Prometheus from vLLM's own /metrics (the
    sidecar's multiprocess files): on-CPU and span time > 0, the CPU wait a
    series (>= 0: how much the host made it wait is not ours to fix). Where
    this kernel has no schedstat the figures are unknown: no series at all."""
    from kvrecord import cpuclock

    sel = f'{{mode="{mode}",phase="{phase}",role="{role}"}}'
    names = (
        "kvlens_phase_cpu_seconds_total",
        "kvlens_phase_cpu_wait_seconds_total",
        "kvlens_phase_cpu_span_seconds_total",
    )
    if cpuclock.probe()[0] is not None:
        assert all(_value(prom, f"sum({n}{sel})") is None for n in names)
        return
    got = _wait(
        lambda: (lambda v: v if None not in v and v[0] > 0 else None)([_value(prom, f"sum({n}{sel})") for n in names])
    )
    assert got, [_value(prom, f"sum({n}{sel})") for n in names]
    on, wait, span = got
    assert on > 0 and wait >= 0 and span > 0, got
    # the recording rule: the handoff's CPU-wait share of this mode, a fraction
    rule = f'kvlens:handoff_cpu_wait_share:ratio_5m{{mode="{mode}"}}'
    share = _wait(lambda: (lambda v: [v] if v is not None and 0 <= v <= 1 else None)(_value(prom, rule)), timeout=60)
    assert share, _safe(lambda: prom.query(rule))  # a list: a share of 0 is an answer


def _by_role(prom, q: str) -> dict[str, float] | None:
    res = _safe(lambda: prom.query(q))
    out = {r["metric"].get("role"): float(r["value"][1]) for r in res or []}
    return out if {"prefill", "decode"} <= set(out) else None


def _health(prom, mode: str) -> tuple[dict, dict] | None:
    """(attempts, ok outcomes) by side, summed over the P and D instances."""
    att = _by_role(prom, f'sum by (role) (kvlens_handoff_attempts_total{{mode="{mode}"}})')
    ok = _by_role(prom, f'sum by (role) (kvlens_handoff_outcomes_total{{mode="{mode}",outcome="ok"}})')
    return (att, ok) if att is not None and ok is not None else None


def _check_health(prom, mode: str, before, open0: float) -> None:
    """docs/handoff-health.md on real vLLM: every healthy request is one attempt and
    one ok outcome on each side, nothing stays open (the oldest start is NaN),
    nothing is flagged stale, and every outcome series exists from the start."""
    att0, ok0 = before

    def settled():
        h = _health(prom, mode)
        return h if h and all(h[0][r] == att0[r] + N and h[1][r] == ok0[r] + N for r in ("prefill", "decode")) else None

    assert _wait(settled), (_health(prom, mode), before)
    q_open = f'sum(kvlens_handoffs_open{{mode="{mode}"}})'
    assert _wait(lambda: (lambda v: v is not None and v <= open0)(_value(prom, q_open))), (_value(prom, q_open), open0)
    if _value(prom, q_open) == 0.0:
        oldest = _wait(
            lambda: _safe(lambda: prom.query(f'kvlens_handoff_oldest_open_start_timestamp_seconds{{mode="{mode}"}}'))
        )
        assert oldest and all(r["value"][1] == "NaN" for r in oldest), oldest  # none open: NaN, never 0
    assert _value(prom, f'sum(kvlens_kv_stale_total{{mode="{mode}"}})') == 0.0  # no healthy request flagged
    n_outcomes = _value(prom, f'count(kvlens_handoff_outcomes_total{{mode="{mode}",job="vllm-prefill"}})')
    assert n_outcomes == 2 * len(sc.Outcome), n_outcomes  # both sides x every outcome, at 0 before the first


def test_push_metrics_in_a_real_prometheus(push_stack):
    _check_mode(push_stack, "push", sc.PUSH_PHASES, "vllm-prefill", "write.post", "write.complete")


def test_pull_metrics_in_a_real_prometheus(pull_stack):
    _check_mode(pull_stack, "pull", sc.PULL_PHASES, "vllm-decode", "read.post", "read.complete")
