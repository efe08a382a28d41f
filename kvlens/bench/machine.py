"""What the machine was doing during one bench cell.

Each row carries the CPU the machine spent busy (``/proc/stat``, in CPUs:
1.0 is one CPU busy the whole cell), what each process of the stack used
(the stack's children and their descendants: vLLM's API servers, engine
cores, workers, kvlens' sidecars, the router), what this bench process used,
and the rest: load from outside the stack. With ``--proxy`` the stack's
processes are not known: the rest then includes the stack, and the row says
so. A stack started by the bench also says whether its placement held: every
vLLM worker thread on the CPU list its rank was given.

A cell where more than :data:`BUSY_OUTSIDE_CPUS` of a CPU went to other work
is flagged, and the report says that its verdict may not hold.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvlens.stack.supervise import descendants

#: CPUs used outside the stack and the bench, averaged over a cell, above
#: which the cell's figures are flagged (a quarter of a CPU: on a 2-core host
#: an eighth of its capacity taken from P and D).
BUSY_OUTSIDE_CPUS = 0.25
_TICK = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / _TICK  # all minus idle and iowait


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            x = f.read().rsplit(")", 1)[1].split()
        return (int(x[11]) + int(x[12]) + int(x[13]) + int(x[14])) / _TICK  # with reaped children
    except (OSError, IndexError, ValueError):
        return 0.0


def _stack_cpu(stack: Any) -> dict[str, float]:
    out = {}
    for c in getattr(stack, "children", None) or ():
        if getattr(c, "proc", None) is not None:
            pid = c.proc.pid
            out[c.name] = sum(_cpu_s(p) for p in (pid, *(d.pid for d in descendants(pid))))
    return out


def placement(stack: Any) -> str | None:
    """``"as asked"``, or ``"not as asked: ..."`` naming the first server
    whose vLLM worker threads are off their rank's CPU list (or whose NIXL
    progress thread was not found); None when the stack is not known."""
    if stack is None or not hasattr(os, "sched_getaffinity"):
        return None
    from kvlens.stack import pinning

    for c in getattr(stack, "children", None) or ():
        env = getattr(c, "env", None) or {}
        lists = pinning.parse_rank_cpu_lists(env.get("VLLM_CPU_OMP_THREADS_BIND"))
        if not lists or getattr(c, "proc", None) is None:
            continue
        try:
            off = pinning.off_placement(c.proc.pid, lists)
        except Exception as e:  # noqa: BLE001 - a check, never a failure of the bench
            return f"unknown: {c.name}: {e}"
        if off:
            return f"not as asked: {c.name}: {off}"
    progress = getattr(stack, "progress", None)
    missing = {n: m for n, m in (progress.missing if progress else {}).items() if m}
    if missing:
        return "not as asked: no NIXL progress thread found in " + ", ".join(
            f"{n} worker {p}" for n, ps in missing.items() for p in ps
        )
    return "as asked"


class MachineWatch:
    """CPU over one cell: :meth:`start` before the load, :meth:`stop` after."""

    def __init__(self, stack: Any = None) -> None:
        self.stack = stack

    def start(self) -> "MachineWatch":
        self.t0, self.busy0, self.me0 = time.monotonic(), _busy_s(), _cpu_s(os.getpid())
        self.stack0 = _stack_cpu(self.stack)
        return self

    def stop(self) -> dict[str, Any]:
        """The row's machine fields (CPUs, averaged over the cell)."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy = (_busy_s() - self.busy0) / wall
        bench = (_cpu_s(os.getpid()) - self.me0) / wall
        now = _stack_cpu(self.stack)
        stack = {k: round(max(0.0, now.get(k, 0.0) - v) / wall, 3) for k, v in self.stack0.items()}
        outside = max(0.0, busy - bench - sum(stack.values()))
        known = self.stack is not None
        return {
            "cpu_busy": round(busy, 3),
            "cpu_bench": round(bench, 3),
            "cpu_stack": stack if known else None,
            "cpu_outside": round(outside, 3) if known else None,
            "cpu_not_bench": None if known else round(max(0.0, busy - bench), 3),
            "machine_busy": bool(known and outside > BUSY_OUTSIDE_CPUS),
            "placement": placement(self.stack),
        }
