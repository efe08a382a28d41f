"""NIXL's UCX progress thread, kept from taking CPU time an engine needs.

nixl 1.5's Python agent creates its UCX backend with a progress thread and
hard-codes its poll delay to zero (``nixl/_api.py``: ``agent_config.pthrDelay
= 0``). The thread (``nixlUcxSharedThread::run`` in ``libplugin_UCX.so``,
seen with gdb) then calls ``poll(fds, 2, 0)`` in a loop: every vLLM worker
that creates a NIXL agent, P's and D's, each TP rank, holds one thread that
spins whenever the scheduler gives it a CPU, engine busy or idle. Measured on
this 2-core host, engines idle: 86-96 % of a CPU per thread
(``/proc/<pid>/task/<tid>/stat``), with a starting TP 1 engine's worker
getting 4 % of the CPU it was bound to (docs/tensor-parallel.md). On a GPU
node with dozens of cores one spinning core per worker goes unnoticed; on a
small CPU host it decides how long a prefill takes.

``kvlens up`` gives each such thread ``SCHED_IDLE``: it runs only when its CPU
has nothing else to run, so it still progresses UCX while an engine waits on
a transfer, and never takes time from a forward pass or from another engine
still starting. vLLM progresses UCX from its own calls too (``checkXfer`` /
``getNotifs`` on every engine step). Stock and instrumented stacks get the
same treatment, so comparing them stays fair; ``--nixl-progress as-is``
leaves the threads alone. ``--nixl-progress off`` (kvlens' connector only)
has no thread to treat: each worker's NIXL agent is created without it
(connector option ``kvlens_nixl_progress_thread``,
:mod:`instrumented_connector.nixlagent`), an experiment measured in
docs/links.md, "Without NIXL's progress thread".

The thread has no name of its own (it inherits the worker's ``comm``), so it
is found by what it does: once its engine answers ``/health`` (idle), the
thread of a worker, other than its main thread, that used the most CPU over
a short sample, and at least :data:`MIN_SHARE` of one CPU. Demoting a thread
that is not NIXL's would only slow that thread when its CPU is busy.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

try:  # psutil ships with vLLM, not with kvlens
    import psutil
except ImportError:  # pragma: no cover
    psutil = None  # type: ignore[assignment]

#: ``--nixl-progress`` values: ``auto`` is ``idle`` where the stack's engine
#: processes outnumber the CPUs, else ``startup`` (:func:`resolve_mode`);
#: ``off``: no progress thread at all (:data:`OFF_OPTION`).
MODES = ("auto", "idle", "startup", "as-is", "off")
#: The connector option ``--nixl-progress off`` sets in every engine (kvlens' connector only).
OFF_OPTION = {"kvlens_nixl_progress_thread": "off"}
#: Share of one CPU a worker's busiest non-main thread must use, engine idle,
#: to count as the spinning progress thread (a spinning one shared a CPU with
#: at most three others here: >= 20 %; an idle worker's other threads: <= 2 %).
MIN_SHARE = 0.15
#: Seconds of each CPU-time sample.
SAMPLE_S = 0.5


def _cpu_ticks(pid: int, tid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def busiest_threads(pids: Iterable[int], sample_s: float = SAMPLE_S) -> dict[int, tuple[int, float]]:
    """pid -> (tid, share of one CPU) of each process's busiest thread other
    than its main thread, over one ``sample_s`` sample taken for all at once."""
    pids = list(pids)
    before = {(p, t): _cpu_ticks(p, t) for p in pids for t in _threads(p) if t != p}
    time.sleep(sample_s)
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, float]] = {}
    for (p, t), a in before.items():
        b = _cpu_ticks(p, t)
        if a is None or b is None:
            continue
        share = (b - a) / hz / sample_s
        if p not in out or share > out[p][1]:
            out[p] = (t, share)
    return out


def is_idle_class(tid: int) -> bool:
    """Whether thread ``tid`` runs at ``SCHED_IDLE``."""
    try:
        return os.sched_getscheduler(tid) == os.SCHED_IDLE
    except OSError:
        return False


def worker_pids(server_pid: int) -> list[int]:
    """The vLLM worker processes (``VLLM::Worker*``) under a server."""
    if psutil is None:
        raise RuntimeError("psutil is not installed")
    out = []
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if proc.name().startswith("VLLM::Worker"):
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def demote_spinners(
    pids: Iterable[int], rounds: int = 3, sample_s: float = SAMPLE_S
) -> tuple[dict[int, int], list[int]]:
    """Give each process's spinning non-main thread ``SCHED_IDLE``.

    Samples up to ``rounds`` times (a spinner that shares its CPU with
    another may fall short in one sample; once one is demoted the other gets
    the CPU). Returns (pid -> demoted tid, pids where no thread spun)."""
    todo = list(pids)
    found: dict[int, int] = {}
    for _ in range(rounds):
        if not todo:
            break
        for pid, (tid, share) in busiest_threads(todo, sample_s).items():
            if share >= MIN_SHARE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                found[pid] = tid
        todo = [p for p in todo if p not in found]
    return found, todo


def resolve_mode(mode: str, engine_processes: int, cpus: int) -> str:
    """What ``auto`` means for a stack: ``idle`` (SCHED_IDLE while serving
    too) when its engine processes outnumber the CPUs, so that the spinners
    cannot each have a CPU; else ``startup`` (SCHED_IDLE until every server
    is up, then back to the normal class, as vLLM runs them). Measured on this
    2-core host, 1P1D push, interleaved fresh starts
    (benchmarks/bench_spread.py): serving with the spinners idle made the
    256-token TTFT p50 about 3x worse (211-282 ms against 69-84 ms): UCX is
    then progressed only from vLLM's own calls. With P TP 2 and two D (five
    engine processes) the spinners decided whether the stack started at all
    (docs/tensor-parallel.md). Other modes are returned as given."""
    if mode != "auto":
        return mode
    return "idle" if engine_processes > cpus else "startup"


def check_mode(value: str) -> str:
    """``value`` when it is a ``--nixl-progress`` mode, else ValueError naming the flag."""
    if value not in MODES:
        raise ValueError(f"--nixl-progress must be one of {', '.join(MODES)}, got {value!r}")
    return value


class ProgressThreads:
    """What a stack did with its servers' NIXL progress threads: demoted
    once per server, as soon as it answers ``/health`` (its engine idle, so
    the spinner is the only busy non-main thread), before later servers or
    start-up waves need the CPU."""

    def __init__(self, mode: str, say: Callable[[str], None]) -> None:
        self.mode = check_mode(mode)
        if self.mode == "auto":
            raise ValueError("resolve --nixl-progress auto first (resolve_mode)")
        #: set by :meth:`restore`: the threads went back to the normal class after start-up
        self.restored = False
        self.say = say
        #: server name -> {worker pid: demoted tid}
        self.demoted: dict[str, dict[int, int]] = {}
        #: server name -> worker pids where no thread spun
        self.missing: dict[str, list[int]] = {}

    def on_poll(self, c: Any) -> None:
        """For a server child (:class:`~kvlens.stack.supervise.Child`) that is
        ready and not handled yet: demote its workers' spinners; warn, naming
        the worker, where none is found. Never raises."""
        if self.mode not in ("idle", "startup") or c.name in self.demoted or c.ready_at is None or c.proc is None:
            return
        try:
            found, missing = demote_spinners(worker_pids(c.proc.pid))
        except Exception as e:  # noqa: BLE001 - the stack serves without it, only slower
            self.demoted[c.name] = {}
            self.say(f"warning: {c.name}: could not set NIXL's progress thread to SCHED_IDLE: {e}")
            return
        self.demoted[c.name], self.missing[c.name] = found, missing
        if found:
            self.say(
                f"{c.name}: NIXL's UCX progress thread of {len(found)} worker(s) set to SCHED_IDLE "
                "(it polls with timeout 0 and would take a CPU from the engines)"
            )
        for pid in missing:
            self.say(
                f"warning: {c.name}: no spinning NIXL progress thread found in worker pid {pid}; it keeps "
                "the scheduling vLLM gave it"
            )

    def idle_again(self) -> int:
        """The threads :meth:`restore` gave back their class, ``SCHED_IDLE``
        again (the demo's live part: a dashboard and Prometheus beside the
        stack on 2 cores would otherwise get no CPU from the spinners); how
        many. Never raises."""
        n = 0
        for found in self.demoted.values():
            for tid in found.values():
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                    n += 1
                except OSError:  # the thread ended meanwhile
                    pass
        return n

    def restore(self) -> None:
        """``startup`` mode, once every server is up: the demoted threads back
        to the normal class (``SCHED_OTHER``), so serving runs as vLLM runs it."""
        if self.mode != "startup":
            return
        for name, found in self.demoted.items():
            for tid in found.values():
                try:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                except OSError as e:  # the thread ended meanwhile
                    self.say(f"warning: {name}: NIXL progress thread {tid} not restored: {e}")
        self.restored = True
        if self.demoted:
            self.say("NIXL progress threads back to the normal scheduling class for serving (--nixl-progress startup)")

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "restored_for_serving": self.restored,
            "demoted": {n: {str(p): t for p, t in d.items()} for n, d in self.demoted.items()},
            "not_found": {n: m for n, m in self.missing.items() if m},
        }
