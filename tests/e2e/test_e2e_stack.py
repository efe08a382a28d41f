"""``kvlens up`` / ``kvlens proxy`` on a real vLLM P/D pair (CPU build).

Order matters: the stack tests are grouped by stack (push, then pull) so the
session starts each pair once; only one pair is alive at a time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Hello world, the cache is fast and the river is blue. Once upon a time"


# ------------------------------------------------------------ e2e helpers
def _complete(url: str, stream: bool, chat: bool = False, max_tokens: int = 6, **extra) -> tuple[int, str]:
    if chat:
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **extra,
        }
        path = "/v1/chat/completions"
    else:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
        path = "/v1/completions"
    with httpx.Client(timeout=180, trust_env=False) as c:
        if not stream:
            r = c.post(url + path, json=body)
            if r.status_code != 200:
                return r.status_code, r.text
            ch = r.json()["choices"][0]
            return 200, ch["message"]["content"] if chat else ch["text"]
        text = []
        with c.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                assert "error" not in ev, ev
                ch = ev["choices"][0] if ev.get("choices") else {}
                text.append((ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or "")
        return 200, "".join(text)


def _local(url: str, max_tokens: int = 6) -> str:
    """Greedy output computed on one instance alone (no KV handoff)."""
    with httpx.Client(timeout=180, trust_env=False) as c:
        r = c.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def _check_stack(stack) -> None:
    manifest = json.loads((Path(stack.log_dir) / "stack.json").read_text())
    assert manifest["router_url"] == stack.router_url
    assert manifest["mode"] == stack.mode
    r = httpx.get(stack.router_url + "/health", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.json()["prefill"] == "ok" and r.json()["decode"] == "ok"
    r = httpx.get(stack.router_url + "/v1/models", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.json()["data"]


# ------------------------------------------------------------ e2e: push
@pytest.mark.e2e
def test_push_stack_up(push_stack):
    _check_stack(push_stack)


def _worker_cpus(stack, name: str) -> list[set[int]]:
    """CPU sets of every thread of the vLLM worker process(es) under the
    named server (``prefill`` or ``decode``)."""
    import psutil

    child = next(c for c in stack.children if c.name == name)
    sets = []
    for proc in psutil.Process(child.proc.pid).children(recursive=True):
        if proc.name().startswith("VLLM::Worker"):
            sets += [set(os.sched_getaffinity(t.id)) for t in proc.threads()]
    return sets


@pytest.mark.e2e
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: P and D share it anyway")
def test_worker_threads_stay_on_their_own_cpu(push_stack):
    """vLLM's CPU NIXL worker pins each worker's main thread to the host's
    last core, the same one for P and D; ``kvlens up`` moves every worker
    thread back to the CPU its instance was given (requests stalled for tens
    of seconds otherwise, docs/benchmark.md, "CPU pinning")."""
    from kvlens.stack.pinning import parse_cpu_list

    want = {
        c.name: parse_cpu_list(c.env["VLLM_CPU_OMP_THREADS_BIND"])
        for c in push_stack.children
        if c.name in ("prefill", "decode")
    }
    assert want["prefill"] == {0} and want["decode"] == {1}, want
    for name, cpus in want.items():
        sets = _worker_cpus(push_stack, name)
        assert len(sets) > 5, f"no worker threads found under {name}"
        assert all(s == cpus for s in sets), (name, cpus, sets)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_push_overlapped_completions(push_stack, stream):
    status, text = _complete(push_stack.router_url, stream)
    assert status == 200, text
    assert text


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_push_chat_completions(push_stack, stream):
    status, text = _complete(push_stack.router_url, stream, chat=True)
    assert status == 200, text
    assert text


@pytest.mark.e2e
def test_push_greedy_matches_single_instance(push_stack):
    status, text = _complete(push_stack.router_url, False)
    assert status == 200, text
    assert text == _local(push_stack.prefill_url)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_push_sequential_completions(push_stack, stream):
    url = push_stack.sequential_router_url
    status, text = _complete(url, stream)
    assert status == 200, text
    assert text


@pytest.mark.e2e
def test_push_upstream_error_is_json_and_fast(push_stack):
    t0 = time.monotonic()
    with httpx.Client(timeout=60, trust_env=False) as c:
        r = c.post(push_stack.router_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": -1})
    assert time.monotonic() - t0 < 30
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["upstream"] in ("prefill", "decode") and err["upstream_status"] == 400


# ------------------------------------------------------------ e2e: pull
@pytest.mark.e2e
def test_pull_stack_up(pull_stack):
    _check_stack(pull_stack)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pull_completions(pull_stack, stream):
    status, text = _complete(pull_stack.router_url, stream)
    assert status == 200, text
    assert text


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pull_chat_completions(pull_stack, stream):
    status, text = _complete(pull_stack.router_url, stream, chat=True)
    assert status == 200, text
    assert text


@pytest.mark.e2e
def test_pull_greedy_matches_single_instance(pull_stack):
    status, text = _complete(pull_stack.router_url, False)
    assert status == 200, text
    assert text == _local(pull_stack.prefill_url)


# ------------------------------------------------------- e2e: shutdown
def _up(tiny_model, log_dir) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--stock", "--model", str(tiny_model)]
    argv += ["--port", "0", "--log-dir", str(log_dir)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_signal_leaves_no_children(stack_factory, tiny_model, tmp_path):
    """SIGTERM (a clean stop) to one ``kvlens up`` and SIGKILL (an OOM kill:
    nothing of kvlens up runs) to another, started side by side, once vLLM
    has spawned each one's engine processes: every process of both trees is
    gone afterwards (SIGKILL: through the parent-death guard of each child,
    which stops its whole process group). One test for both signals: the two
    stacks start together (one start's wait instead of two)."""
    import psutil

    stack_factory.stop()  # the shared pair frees the cores
    sigs = {signal.SIGTERM: _up(tiny_model, tmp_path / "term"), signal.SIGKILL: _up(tiny_model, tmp_path / "kill")}
    seen: dict[int, dict[int, psutil.Process]] = {sig: {} for sig in sigs}
    try:
        deadline = time.monotonic() + 300
        waiting = dict(sigs)
        while waiting and time.monotonic() < deadline:
            for sig, proc in list(waiting.items()):
                try:
                    kids = psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    kids = []
                for k in kids:
                    seen[sig].setdefault(k.pid, k)
                names = []
                for k in kids:
                    try:
                        names.append(k.name())
                    except psutil.Error:
                        pass
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                if sum("EngineCore" in n for n in names) >= 2:
                    del waiting[sig]
            time.sleep(1)
        assert all(len(s) >= 4 for s in seen.values()), f"vLLM never spawned its processes: {seen}"
        for sig, proc in sigs.items():
            proc.send_signal(sig)
        for sig, proc in sigs.items():
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL), (sig, out)
    finally:
        for proc in sigs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    # after SIGKILL the guards give their servers the usual grace (15 s) before SIGKILL
    for sig, procs in seen.items():
        gone, alive = psutil.wait_procs(list(procs.values()), timeout=10 if sig == signal.SIGTERM else 60)
        assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], (sig, alive)
