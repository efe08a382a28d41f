"""NIXL's spinning progress thread found and given SCHED_IDLE
(kvlens/stack/spinners.py), on real processes: a "worker" (its ``comm`` set to
vLLM's ``VLLM::Worker``) whose main thread sleeps while another thread spins,
as an idle vLLM worker's NIXL progress thread does, and one that only sleeps."""

from __future__ import annotations

import os
import subprocess
import time
from types import SimpleNamespace

import pytest

from kvlens.stack import spinners

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")

_WORKER = r"""
import ctypes, sys, threading, time
ctypes.CDLL(None).prctl(15, b"VLLM::Worker", 0, 0, 0)  # PR_SET_NAME: the title vLLM gives its workers
if sys.argv[1] == "spin":
    def spin():
        while True:
            pass
    threading.Thread(target=spin, daemon=True).start()
print("up", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _any_spin_counts(monkeypatch):
    """What these tests check is which thread spins, not how much CPU it got:
    on a busy machine (CI beside other work) the fake spinner's share of a
    CPU in a 0.5 s sample fell below the production threshold (0.15) and it
    went unfound. The sleeping threads here use ~0, so 1 % still tells them apart."""
    monkeypatch.setattr(spinners, "MIN_SHARE", 0.01)


@pytest.fixture
def worker(spawn_python):
    """``worker("spin" | "sleep")``: a fake vLLM worker, up."""

    def start(kind: str) -> subprocess.Popen:
        p = spawn_python(_WORKER, kind, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        return p

    return start


def test_the_spinning_thread_is_found_and_demoted(worker):
    p = worker("spin")
    found, missing = spinners.demote_spinners([p.pid], rounds=5)
    assert missing == [] and set(found) == {p.pid}
    tid = found[p.pid]
    assert tid != p.pid and spinners.is_idle_class(tid)
    assert not spinners.is_idle_class(p.pid)  # the main thread keeps its class


def test_a_worker_without_a_spinner_is_reported_not_demoted(worker):
    p = worker("sleep")
    found, missing = spinners.demote_spinners([p.pid], rounds=2, sample_s=0.2)
    assert found == {} and missing == [p.pid]
    assert not any(spinners.is_idle_class(int(t)) for t in os.listdir(f"/proc/{p.pid}/task"))


def test_progress_threads_of_a_ready_server_once_and_in_the_manifest(worker):
    """The stack's tracker: only once the server is ready, once per server,
    a warning naming a worker without a spinner; as-is does nothing."""
    spin, idle = worker("spin"), worker("sleep")
    said = []
    pt = spinners.ProgressThreads("idle", said.append)
    server = SimpleNamespace(name="prefill", ready_at=None, proc=SimpleNamespace(pid=os.getpid()))
    pt.on_poll(server)  # not ready yet
    assert pt.demoted == {} and said == []
    server.ready_at = time.monotonic()
    pt.on_poll(server)
    assert set(pt.demoted["prefill"]) == {spin.pid} and pt.missing["prefill"] == [idle.pid]
    assert any("SCHED_IDLE" in s for s in said)
    assert any(f"worker pid {idle.pid}" in s and s.startswith("warning:") for s in said)
    n = len(said)
    pt.on_poll(server)  # handled once
    assert len(said) == n
    js = pt.to_json()
    assert js["mode"] == "idle" and js["demoted"]["prefill"] == {str(spin.pid): pt.demoted["prefill"][spin.pid]}
    off = spinners.ProgressThreads("as-is", said.append)
    off.on_poll(server)
    assert off.demoted == {}
    with pytest.raises(ValueError, match="--nixl-progress"):
        spinners.ProgressThreads("fast", said.append)


def test_startup_mode_restores_the_normal_class_once_every_server_is_up(worker):
    spin = worker("spin")
    said = []
    pt = spinners.ProgressThreads("startup", said.append)
    server = SimpleNamespace(name="decode", ready_at=time.monotonic(), proc=SimpleNamespace(pid=os.getpid()))
    pt.on_poll(server)
    tid = pt.demoted["decode"][spin.pid]
    assert spinners.is_idle_class(tid)
    pt.restore()
    assert not spinners.is_idle_class(tid) and pt.to_json()["restored_for_serving"] is True
    idle = spinners.ProgressThreads("idle", said.append)
    idle.restore()  # idle keeps them idle: nothing to restore
    assert idle.to_json()["restored_for_serving"] is False


def test_auto_is_idle_only_when_engine_processes_outnumber_the_cpus():
    assert spinners.resolve_mode("auto", 2, 2) == "startup"  # 1P1D on 2 cores
    assert spinners.resolve_mode("auto", 5, 2) == "idle"  # P TP 2, D TP 2 + TP 1
    assert spinners.resolve_mode("auto", 16, 64) == "startup"
    assert spinners.resolve_mode("as-is", 5, 2) == "as-is"
    with pytest.raises(ValueError, match="resolve"):
        spinners.ProgressThreads("auto", print)
