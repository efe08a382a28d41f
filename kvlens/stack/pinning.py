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
doing this once after start-up is enough for one pair. With several
instances it is not: a ready engine's workers spin on that core (vLLM's shm
broadcast polling), and a 2P2D stack's fourth server, still zeroing its KV
cache there, made no progress for 10+ minutes; the stack therefore re-pins
every server on each health poll while the others start.

With tensor parallelism (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, one CPU list
per rank) vLLM pins every rank's main thread, which also runs the rank's
share of the model, to that same last core, so the ranks of P and of D
would all compute on one CPU. :func:`repin` moves each rank's worker process
(process title ``VLLM::Worker_TP<i>``) back to the ``i``-th list.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping, Sequence

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


def parse_rank_cpu_lists(spec: str | None) -> list[set[int]] | None:
    """CPU ids per rank of a ``VLLM_CPU_OMP_THREADS_BIND`` value: ``"1"`` ->
    ``[{1}]``, ``"0|1"`` -> ``[{0}, {1}]`` (rank *i*'s list is the *i*-th
    part, as vLLM's ``OMPProcessManager`` splits it); None when any part is
    not a CPU list (``auto``, ``nobind``, ...)."""
    if not spec:
        return None
    lists = [parse_cpu_list(part) for part in spec.split("|")]
    return None if any(c is None for c in lists) else lists  # type: ignore[return-value]


#: The TP rank in a worker's process title (vLLM: ``VLLM::Worker_TP1``,
#: ``VLLM::Worker_PP0_TP1``, ...); the kernel's 15-character ``comm`` cuts the
#: digit off, so it is read from the command line the title rewrites (where
#: psutil's ``name()`` also finds it, but only when the title starts it).
_TP_RANK = re.compile(r"Worker\w*?_TP(\d+)")


def _worker_rank(proc) -> int | None:
    """The TP rank of a vLLM worker process (psutil), None when its title has none."""
    m = _TP_RANK.search(" ".join(proc.cmdline()))
    return int(m.group(1)) if m else None


def repin_worker_threads(server_pid: int, cpus: set[int] | Sequence[set[int]]) -> tuple[int, int]:
    """Pin every thread of the vLLM worker processes under ``server_pid`` to
    ``cpus`` (see the module docstring for why): one set for every worker,
    or one per TP rank (rank *i*'s worker to ``cpus[i]``; a worker whose
    rank cannot be read is left alone). Returns (worker processes pinned,
    threads whose CPU set changed). Raises when psutil is missing."""
    if psutil is None:
        raise RuntimeError("psutil is not installed")
    per_rank = None if isinstance(cpus, (set, frozenset)) else list(cpus)
    workers, moved = 0, 0
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if not proc.name().startswith("VLLM::Worker"):
                continue
            want = cpus
            if per_rank is not None:
                rank = _worker_rank(proc)
                if rank is None or rank >= len(per_rank):
                    continue
                want = per_rank[rank]
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        workers += 1
        for tid in tids:
            try:
                if set(os.sched_getaffinity(tid)) != want:
                    os.sched_setaffinity(tid, want)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return workers, moved


def off_placement(server_pid: int, lists: Sequence[set[int]]) -> str | None:
    """The first vLLM worker thread under ``server_pid`` whose CPU set is not
    its rank's list (``lists``: one per rank; one list: every worker), as
    ``"worker <pid> thread <tid> on CPUs [..], asked [..]"``; None when all
    are where they were put. Raises when psutil is missing."""
    if psutil is None:
        raise RuntimeError("psutil is not installed")
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if not proc.name().startswith("VLLM::Worker"):
                continue
            rank = 0 if len(lists) == 1 else _worker_rank(proc)
            if rank is None or rank >= len(lists):
                continue
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                got = set(os.sched_getaffinity(tid))
            except OSError:  # ended meanwhile
                continue
            if got != lists[rank]:
                return f"worker {proc.pid} thread {tid} on CPUs {sorted(got)}, asked {sorted(lists[rank])}"
    return None


def repin(c: Child, say: Callable[[str], None]) -> None:
    """Undo vLLM's CPU NIXL worker pinning for one server child, rank by
    rank at TP > 1; the stack still serves without it (with long stalls), so
    a failure is a warning passed to ``say``, never an exception."""
    lists = parse_rank_cpu_lists(c.env.get("VLLM_CPU_OMP_THREADS_BIND"))
    if lists is None or c.proc is None or not hasattr(os, "sched_setaffinity"):
        return
    target: set[int] | list[set[int]] = lists[0] if len(lists) == 1 else lists
    where = "|".join(",".join(map(str, sorted(x))) for x in lists)
    try:
        workers, moved = repin_worker_threads(c.proc.pid, target)
    except Exception as e:  # noqa: BLE001 - never fail a start-up over this
        say(f"warning: could not pin {c.name}'s worker threads to CPU {where}: {e}")
        return
    if workers < len(lists):
        say(
            f"warning: {workers} of {c.name}'s {len(lists)} vLLM worker process(es) found and re-pinned; "
            "the others keep vLLM's CPU pinning"
        )
    elif moved:
        say(
            f"{c.name}: {moved} worker threads moved back to CPU {where} (one list per rank; vLLM's CPU NIXL "
            "worker pins every worker's main thread to one shared core)"
        )


def quiet(_line: str) -> None:
    """A ``say`` for :func:`repin` that says nothing (re-pinning while a
    stack's servers still start, before their workers all exist)."""


def available_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity), sorted; its
    children inherit that set, so a binding outside it would fail."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cpu_binding(
    role: str,
    index: int,
    n_prefill: int,
    n_decode: int,
    cpus: list[int] | None = None,
    tps: Mapping[str, Sequence[int]] | None = None,
) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of the ``index``-th instance of ``role``
    (prefill/decode) in a stack of ``n_prefill`` P and ``n_decode`` D, on
    ``cpus`` (default :func:`available_cpus`): one CPU id per rank, the
    ranks' lists joined by ``|`` as vLLM's CPU backend requires (a server at
    TP *N* needs exactly *N* lists, docs/tensor-parallel.md). ``tps``: role
    -> TP size of each of its instances (default: all 1).

    The rule, in ranks (a TP 1 instance is one rank): P's ranks on the low
    CPUs, D's on the high ones, apart whenever the CPUs allow:

    * a CPU for every rank: P ``i``'s ranks on the next CPUs in order, then
      D's (one P and one D at TP 1: P on the first CPU, D on the second, as a
      pair has always run; P TP 2 and D TP 2 on 4 CPUs: ``0|1`` and ``2|3``);
    * one CPU: every rank on it;
    * fewer CPUs than ranks: the CPUs are split between the roles in
      proportion to their rank counts (at least one each). A TP 1 instance
      takes its role's CPUs in turn (on 2 CPUs every TP 1 P shares the first
      and every TP 1 D the second). A TP *N* instance puts its ranks on *N*
      distinct CPUs of its role when the role has *N*, else on *N* distinct
      CPUs of the host, rank *i* on CPU *i* (on 2 CPUs: ``0|1`` for P and D
      alike, whatever the rest of the stack).

    Why roles stay apart: P's prefill is a burst of compute, D's decode a
    steady run of small steps beside a spinning NIXL progress thread. A P
    and a D on one CPU would make D's token times and the handoff follow P's
    load, which is what kvlens measures; instances of one role sharing a CPU
    only slow each other, the same way a busier instance would.

    Why one instance's ranks go on distinct CPUs even where that puts P and
    D together: the ranks of an engine run in lockstep, every layer ends in
    an all-reduce (vLLM CPU's shared-memory one, which waits for every rank),
    so two ranks on one CPU serialise each other on every step. ``0|1`` for
    both P and D is what ran here (docs/tensor-parallel.md)."""
    cpus = list(cpus) if cpus is not None else available_cpus()
    tps = tps or {}
    role_tps = {r: list(tps.get(r) or [1] * n) for r, n in (("prefill", n_prefill), ("decode", n_decode))}
    is_p = role == "prefill"
    tp = role_tps[role][index]
    if not cpus:
        cpus = [0]
    ranks_p, ranks_d = sum(role_tps["prefill"]), sum(role_tps["decode"])
    if len(cpus) >= ranks_p + ranks_d and len(cpus) >= 2:
        first = sum(role_tps[role][:index]) + (0 if is_p else ranks_p)
        return "|".join(str(c) for c in cpus[first : first + tp])
    if len(cpus) < 2:
        return "|".join([str(cpus[0])] * tp)
    n_p_cpus = min(len(cpus) - 1, max(1, len(cpus) * ranks_p // (ranks_p + ranks_d)))
    return _shared(cpus, cpus[:n_p_cpus] if is_p else cpus[n_p_cpus:], tp, sum(role_tps[role][:index]), index)


def _shared(cpus: list[int], mine: list[int], tp: int, ranks_before: int, index: int) -> str:
    """:func:`cpu_binding` with fewer CPUs than ranks: ``mine`` are the role's
    CPUs, ``ranks_before`` the ranks of the role's instances before this one."""
    if tp == 1:
        return str(mine[index % len(mine)])
    if len(mine) >= tp:
        start = ranks_before % len(mine)
        return "|".join(str(mine[(start + r) % len(mine)]) for r in range(tp))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
