"""What the machine did during a bench cell (kvlens/bench/machine.py), on
real processes: a "stack" child that spins, load from outside the stack
that spins too, a worker off its CPU list, and the report's caveats."""

from __future__ import annotations

import os
import subprocess
import time
from types import SimpleNamespace

import pytest

from kvlens.bench import machine
from kvlens.bench.report import format_table, machine_caveats
from kvlens.stack import pinning

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 30: pass\n"
WORKER = (
    "import ctypes, time\nctypes.CDLL(None).prctl(15, b'VLLM::Worker', 0, 0, 0)\n"
    "print('up', flush=True)\ntime.sleep(60)\n"
)


@pytest.fixture
def procs(spawn_python):
    return spawn_python


def _cpus(pids, seconds: float) -> tuple[list[float], float]:
    """Each pid's CPU (in CPUs) over ``seconds``, read as the watch reads it."""
    t0, c0 = time.monotonic(), [machine._cpu_s(p) for p in pids]
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return [(machine._cpu_s(p) - c) / wall for p, c in zip(pids, c0)], wall


# The spinners' own share of the CPUs is measured alongside, not assumed: on a
# loaded machine two spinners get far less than a CPU each, and what matters is
# that the watch gives each its own share (stack, or outside the stack).
def test_stack_and_outside_cpu_are_told_apart(procs):
    inside, outside = procs(SPIN), procs(SPIN)
    stack = SimpleNamespace(children=[SimpleNamespace(name="prefill", proc=inside, env={})])
    time.sleep(0.3)
    watch = machine.MachineWatch(stack).start()
    (cpu_in, cpu_out), _ = _cpus([inside.pid, outside.pid], 1.5)
    got = watch.stop()
    assert cpu_in > 0 and cpu_out > 0, (cpu_in, cpu_out)
    assert abs(got["cpu_stack"]["prefill"] - cpu_in) <= 0.1 + 0.1 * cpu_in, (got, cpu_in)
    assert got["cpu_outside"] >= cpu_out - 0.1, (got, cpu_out)  # the other spinner, and whatever else runs
    assert got["machine_busy"] == (got["cpu_outside"] > machine.BUSY_OUTSIDE_CPUS), got
    assert got["cpu_busy"] >= got["cpu_stack"]["prefill"] + got["cpu_outside"] - 0.05, got


def test_without_the_stack_the_load_is_not_split(procs):
    spinner = procs(SPIN)
    watch = machine.MachineWatch(None).start()
    (cpu,), _ = _cpus([spinner.pid], 1.0)
    got = watch.stop()
    assert got["cpu_stack"] is None and got["cpu_outside"] is None and got["placement"] is None
    assert got["cpu_not_bench"] >= cpu - 0.1 and got["machine_busy"] is False, (got, cpu)


@pytest.mark.skipif(len(pinning.available_cpus()) < 2, reason="needs two CPUs")
def test_a_worker_off_its_cpu_list_is_named(procs):
    w = procs(WORKER, stdout=subprocess.PIPE, text=True)
    assert w.stdout.readline().strip() == "up"
    os.sched_setaffinity(w.pid, {0})
    assert pinning.off_placement(os.getpid(), [{0}]) is None
    off = pinning.off_placement(os.getpid(), [{1}])
    assert off and f"worker {w.pid}" in off and "on CPUs [0], asked [1]" in off
    server = SimpleNamespace(
        name="decode", proc=SimpleNamespace(pid=os.getpid()), env={"VLLM_CPU_OMP_THREADS_BIND": "1"}
    )
    assert machine.placement(SimpleNamespace(children=[server])).startswith("not as asked: decode: worker")


def test_busy_cells_and_placement_are_said_in_the_report():
    row = {"mode": "push", "dispatch": "overlapped", "input_len": 256, "qps": 1.0, "completed": 8, "failed": 0}
    rows = [
        {**row, "cpu_busy": 1.9, "cpu_outside": 0.8, "machine_busy": True, "placement": "as asked"},
        {
            **row,
            "mode": "pull",
            "dispatch": None,
            "cpu_busy": 1.1,
            "cpu_outside": 0.05,
            "machine_busy": False,
            "placement": "not as asked: decode: worker 7 thread 9 on CPUs [0], asked [1]",
        },
    ]
    lines = machine_caveats(rows)
    assert any("busy during 1 of 2 rows (push in=256 qps=1)" in x and "0.80 CPU" in x for x in lines), lines
    assert any("Placement not as asked" in x and "worker 7" in x for x in lines), lines
    table = format_table(rows, wide=True)
    assert "CPU outside" in table and "0.80 !" in table and "0.05" in table
    assert machine_caveats([{**row, "cpu_busy": 1.0, "cpu_stack": None, "cpu_outside": None}])[-1].startswith(
        "The stack's processes are not known"
    )
