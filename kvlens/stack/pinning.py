"""CPU pinning of a stack's vLLM workers (CPU-only hosts).

On a CPU-only host vLLM's NIXL worker calls
``os.sched_setaffinity(0, [last core of each NUMA node])`` on the worker's
main thread (the thread that also runs the model), meant to keep KV transfer
off the forward pass. With P and D on one host that puts both instances'
main threads, their push writer threads, and D's spinning NIXL progress
thread on the same core, away from the core each instance was given
(``VLLM_CPU_OMP_THREADS_BIND``). Measured on a 2-core box: requests stalled
10-85 s in every phase (prefill, registration, WRITE, decode); with each
worker's threads back on its own core, 260 requests at 4-8 in flight finished
in at most 1.5 s. Threads created later inherit the main thread's set, so
doing this once after start-up is enough.
"""

from __future__ import annotations

import os
from typing import Callable

from kvlens.stack.supervise import Child

try:  # psutil ships with vLLM, not with kvlens
    import psutil
except ImportError:  # pragma: no cover
    psutil = None  # type: ignore[assignment]


def parse_cpu_list(spec: str | None) -> set[int] | None:
    """CPU ids of a one-rank ``VLLM_CPU_OMP_THREADS_BIND`` value ("1",
    "0-3,6"); None for "auto", "nobind", a multi-rank "a|b" or anything else
    this launcher did not choose itself. (vLLM's own parser,
    ``vllm.utils.cpu_resource_utils.parse_id_list``, would import the vllm
    package into the launcher, which otherwise never imports it.)"""
    if not spec or "|" in spec:
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
    except ValueError:
        return None
    return cpus or None


def repin_worker_threads(server_pid: int, cpus: set[int]) -> tuple[int, int]:
    """Pin every thread of the vLLM worker processes under ``server_pid`` to
    ``cpus`` (see the module docstring for why); returns (worker processes
    found, threads whose CPU set changed). Raises when psutil is missing."""
    if psutil is None:
        raise RuntimeError("psutil is not installed")
    workers, moved = 0, 0
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if not proc.name().startswith("VLLM::Worker"):
                continue
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        workers += 1
        for tid in tids:
            try:
                if set(os.sched_getaffinity(tid)) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return workers, moved


def repin(c: Child, say: Callable[[str], None]) -> None:
    """Undo vLLM's CPU NIXL worker pinning for one server child; the stack
    still serves without it (with long stalls), so a failure is a warning
    passed to ``say``, never an exception."""
    cpus = parse_cpu_list(c.env.get("VLLM_CPU_OMP_THREADS_BIND"))
    if cpus is None or c.proc is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        workers, moved = repin_worker_threads(c.proc.pid, cpus)
    except Exception as e:  # noqa: BLE001 - never fail a start-up over this
        say(f"warning: could not pin {c.name}'s worker threads to CPU {sorted(cpus)}: {e}")
        return
    if workers == 0:
        say(f"warning: no vLLM worker process found under {c.name}; CPU pinning left as vLLM set it")
    elif moved:
        say(f"{c.name}: {moved} worker threads moved back to CPU {sorted(cpus)} "
            "(vLLM's CPU NIXL worker pins P's and D's main threads to one shared core)")


def available_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity), sorted; its
    children inherit that set, so a binding outside it would fail."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cpu_binding(role: str, index: int, n_prefill: int, n_decode: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` (one CPU id) of the ``index``-th
    instance of ``role`` (prefill/decode) in a stack of ``n_prefill`` P and
    ``n_decode`` D, on ``cpus`` (default :func:`available_cpus`).

    The rule: P instances on the low CPUs, D instances on the high ones, and
    never a P and a D on one CPU when there are two or more:

    * one CPU: every instance on it;
    * a CPU for every instance: P ``i`` on the ``i``-th, D ``j`` on the
      ``n_prefill + j``-th (one P and one D: P on the first, D on the second,
      as a pair has always run);
    * fewer: the CPUs are split between the roles in proportion to their
      instance counts (at least one each) and a role's instances take its
      CPUs in turn; on 2 CPUs every P shares the first and every D the second.

    Why roles stay apart: P's prefill is a burst of compute, D's decode a
    steady run of small steps beside a spinning NIXL progress thread. A P
    and a D on one CPU would make D's token times and the handoff follow P's
    load, which is what kvlens measures; instances of one role sharing a CPU
    only slow each other, the same way a busier instance would."""
    cpus = list(cpus) if cpus is not None else available_cpus()
    is_p = role == "prefill"
    if len(cpus) < 2:
        return str(cpus[0] if cpus else 0)
    total = n_prefill + n_decode
    if len(cpus) >= total:
        return str(cpus[index if is_p else n_prefill + index])
    n_p_cpus = min(len(cpus) - 1, max(1, len(cpus) * n_prefill // total))
    mine = cpus[:n_p_cpus] if is_p else cpus[n_p_cpus:]
    return str(mine[index % len(mine)])
