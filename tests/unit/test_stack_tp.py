"""``kvlens up --tp N`` / ``--prefill-tp`` / ``--decode-tp``: flag checks,
and the command lines, CPU bindings, router flags, deadline and
``stack.json`` built for tensor-parallel instances, without starting vLLM.
The rank-aware re-pinning runs on real processes titled as vLLM titles its
TP workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvlens.stack.errors import StackError
from stack_settings import offline_stack


def _stack(tmp_path, **kw):
    return offline_stack(tmp_path, **{"mode": "pull", **kw})


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    for k in ("KVLENS_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(k, raising=False)


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


# ------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    "flag,value",
    [
        ("--tp", "0"),
        ("--tp", "9"),
        ("--tp", "two"),
        ("--prefill-tp", "2,x"),
        ("--decode-tp", "9"),
        ("--decode-tp", "0,1"),
        ("--prefill-tp", ""),
    ],
)
def test_bad_tp_flags_are_usage_errors(capsys, flag, value):
    from kvlens.cli import main

    with pytest.raises(SystemExit) as e:
        main(["up", "--mode", "pull", f"{flag}={value}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"kvlens up: error: argument {flag}:")


def test_a_size_per_instance_must_match_the_instances(tmp_path, capsys):
    from kvlens.cli import main

    rc = main(
        [
            "up",
            "--mode",
            "pull",
            "--decode-instances",
            "2",
            "--decode-tp",
            "2,1,1",
            "--log-dir",
            str(tmp_path / "run"),
            "--model",
            str(tmp_path / "none"),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "kvlens up: error: --decode-tp gives 3 sizes for 2 instance(s)" in err
    assert not (tmp_path / "run").exists()  # refused before anything starts
    for bad in (0, 9, True, "2", (2, 0)):
        with pytest.raises(StackError, match=r"--prefill-tp must be 1\.\.8"):
            _stack(tmp_path, prefill_tp=bad)
    with pytest.raises(StackError, match="not in the vLLM arguments"):
        _stack(tmp_path, vllm_args=["--tensor-parallel-size", "2"])
    with pytest.raises(StackError, match="not in the vLLM arguments"):
        _stack(tmp_path, vllm_args=["-tp=2"])


def test_tp_flags_reach_the_stack(tmp_path):
    import argparse

    from kvlens import up, upargs

    p = argparse.ArgumentParser()
    upargs.add_arguments(p)

    def stack(*argv):
        return up._stack(p.parse_args(["--mode", "pull", "--log-dir", str(tmp_path / "run"), *argv]))

    s = stack()
    assert (s.prefill_tp, s.decode_tp) == ((1,), (1,))
    s = stack("--tp", "2")
    assert (s.prefill_tp, s.decode_tp) == ((2,), (2,))
    s = stack("--tp", "2", "--decode-tp", "1")  # the per-side flag wins
    assert (s.prefill_tp, s.decode_tp) == ((2,), (1,))
    s = stack("--prefill-tp", "2", "--decode-instances", "2", "--decode-tp", "2,1")
    assert (s.prefill_tp, s.decode_tp) == ((2,), (2, 1))
    s = stack("--prefill-instances", "3", "--prefill-tp", "4")  # one for all
    assert s.prefill_tp == (4, 4, 4) and s.decode_tp == (1,)


# ------------------------------------------------------------- the CPUs
def test_cpu_binding_gives_every_rank_a_cpu_list():
    from kvlens.stack.pinning import cpu_binding

    def plan(p_tp, d_tp, cpus):
        tps = {"prefill": p_tp, "decode": d_tp}
        return (
            [cpu_binding("prefill", i, len(p_tp), len(d_tp), cpus, tps) for i in range(len(p_tp))],
            [cpu_binding("decode", j, len(p_tp), len(d_tp), cpus, tps) for j in range(len(d_tp))],
        )

    # 2 cores: rank i on CPU i for P and D alike; a TP 1 D keeps D's CPU
    assert plan([2], [2], [0, 1]) == (["0|1"], ["0|1"])
    assert plan([2], [1], [0, 1]) == (["0|1"], ["1"])
    assert plan([2], [2, 1], [0, 1]) == (["0|1"], ["0|1", "1"])
    # a CPU per rank: P's ranks low, D's high, never shared
    assert plan([2], [2], [0, 1, 2, 3]) == (["0|1"], ["2|3"])
    assert plan([2], [2, 1], [4, 5, 6, 7, 8]) == (["4|5"], ["6|7", "8"])
    assert plan([1, 2], [1], [0, 1, 2, 3]) == (["0", "1|2"], ["3"])
    # fewer CPUs than ranks, but enough in the role for its ranks
    assert plan([2], [2], [0, 1, 2]) == (["0|1"], ["1|2"])
    assert plan([1], [4], [0, 1, 2]) == (["0"], ["0|1|2|0"])
    # one CPU: every rank on it
    assert plan([2], [1], [0]) == (["0|0"], ["0"])
    # TP 1 everywhere: the one-rank rule, unchanged
    assert plan([1, 1], [1, 1, 1], [0, 1]) == (["0", "0"], ["1", "1", "1"])
    assert plan([1, 1, 1, 1], [1, 1], [0, 1, 2]) == (["0", "1", "0", "1"], ["2", "2"])


def test_rank_cpu_lists():
    from kvlens.stack.pinning import parse_cpu_list, parse_rank_cpu_lists

    assert parse_rank_cpu_lists("1") == [{1}]
    assert parse_rank_cpu_lists("0|1") == [{0}, {1}]
    assert parse_rank_cpu_lists("0-1,3|2") == [{0, 1, 3}, {2}]
    for spec in ("auto", "nobind", "0|auto", "0|", "", None):
        assert parse_rank_cpu_lists(spec) is None, spec
    assert parse_cpu_list("0|1") is None  # the one-rank parser still refuses a multi-rank value


_WORKER = (
    "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); print('up', flush=True); time.sleep(60)"
)
_SERVER = (
    "import subprocess, sys; ps = [subprocess.Popen([sys.executable, '-c', sys.argv[1], t], "
    "stdout=subprocess.PIPE, text=True) for t in sys.argv[2:]]; [p.stdout.readline() for p in ps]; "
    "print('up', flush=True); [p.wait() for p in ps]"
)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to move threads between",
)
def test_repin_moves_each_rank_to_its_own_list():
    """A process with two children titled as vLLM titles TP workers
    (``VLLM::Worker_TP0`` / ``_TP1``, via setproctitle as vLLM does): each
    rank's threads go to its list; the kernel's 15-character name alone
    could not tell them apart."""
    psutil = pytest.importorskip("psutil")
    from kvlens.stack.pinning import repin_worker_threads

    a, b = sorted(os.sched_getaffinity(0))[:2]
    srv = subprocess.Popen(
        [sys.executable, "-c", _SERVER, _WORKER, "VLLM::Worker_TP0", "VLLM::Worker_TP1", "VLLM::EngineCore"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert srv.stdout.readline().strip() == "up"
        kids = {p.cmdline()[0]: p.pid for p in psutil.Process(srv.pid).children()}
        with open(f"/proc/{kids['VLLM::Worker_TP1']}/comm") as f:
            assert f.read().strip() == "VLLM::Worker_TP"  # the kernel's name cuts the rank off
        workers, moved = repin_worker_threads(srv.pid, [{b}, {a}])  # rank 0 on the second CPU, rank 1 on the first
        assert workers == 2 and moved >= 2
        assert os.sched_getaffinity(kids["VLLM::Worker_TP0"]) == {b}
        assert os.sched_getaffinity(kids["VLLM::Worker_TP1"]) == {a}
        assert os.sched_getaffinity(kids["VLLM::EngineCore"]) == os.sched_getaffinity(0)  # not a worker
        assert repin_worker_threads(srv.pid, [{a}]) == (1, 1)  # a rank beyond the lists is left alone
        assert os.sched_getaffinity(kids["VLLM::Worker_TP1"]) == {a}
    finally:
        os.killpg(srv.pid, 9)
        srv.wait(10)
        time.sleep(0.1)


# ------------------------------------------------ what a TP stack runs
def test_tp_servers_commands_environments_and_router(tmp_path):
    from kvlens.cli import build_parser
    from proxy.cli import check, config
    from kvlens.stack.pinning import available_cpus, cpu_binding

    s = _stack(tmp_path, mode="push", prefill_tp=2, decode_instances=2, decode_tp=(2, 1))
    s.preflight()
    insts = [*s.prefills, *s.decodes]
    assert [(i.engine_id, i.tp) for i in insts] == [("p0", 2), ("d0", 2), ("d1", 1)]
    for inst in insts:
        c = s.roles.server(inst.role, inst.index)
        bind = c.env["VLLM_CPU_OMP_THREADS_BIND"]
        assert len(bind.split("|")) == inst.tp, (inst.name, bind)
        assert bind == cpu_binding(inst.role, inst.index, 1, 2, available_cpus(), {"prefill": (2,), "decode": (2, 1)})
        want = [str(inst.tp)] if inst.tp > 1 else []
        assert _flag(c.argv, "--tensor-parallel-size") == want, (inst.name, c.argv)
    if available_cpus() == [0, 1]:  # this 2-core host: what ran in docs/tensor-parallel.md
        assert [s.roles.server(i.role, i.index).env["VLLM_CPU_OMP_THREADS_BIND"] for i in insts] == ["0|1", "0|1", "1"]
    r = s.roles.router("overlapped", s.port).argv
    assert _flag(r, "--prefill-tp-size") == ["2"]
    cfg = config(build_parser().parse_args(r[r.index("proxy") :]))
    check(cfg)
    assert [p.tp_size for p in cfg.prefills] == [2]


def test_per_p_tp_sizes_reach_the_router(tmp_path):
    from kvlens.cli import build_parser
    from proxy.cli import config

    s = _stack(tmp_path, mode="push", prefill_instances=2, prefill_tp=(1, 2))
    s.preflight()
    r = s.roles.router("overlapped", s.port).argv
    assert _flag(r, "--prefill-tp-size") == ["1", "2"]
    cfg = config(build_parser().parse_args(r[r.index("proxy") :]))
    assert [(p.engine_id, p.tp_size) for p in cfg.prefills] == [("p0", 1), ("p1", 2)]


def test_one_rank_stack_is_unchanged(tmp_path):
    s = _stack(tmp_path, mode="push")
    s.preflight()
    for inst in [*s.prefills, *s.decodes]:
        c = s.roles.server(inst.role, inst.index)
        assert "--tensor-parallel-size" not in c.argv and "|" not in c.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert "--prefill-tp-size" not in s.roles.router("overlapped", s.port).argv


def test_startup_deadline_grows_with_engine_processes(tmp_path):
    from kvlens.stack.commands import DEFAULT_TIMEOUT_S
    from kvlens.stack.tp import STARTUP_S_PER_EXTRA_PROCESS

    pair = _stack(tmp_path).default_timeout_s
    assert pair == DEFAULT_TIMEOUT_S
    assert (
        _stack(tmp_path, prefill_instances=2, decode_instances=2).default_timeout_s
        == DEFAULT_TIMEOUT_S + 2 * STARTUP_S_PER_EXTRA_PROCESS
    )
    tp = _stack(tmp_path, prefill_tp=2, decode_instances=2, decode_tp=(2, 1)).default_timeout_s
    assert tp == DEFAULT_TIMEOUT_S + 3 * STARTUP_S_PER_EXTRA_PROCESS  # 5 ranks


def test_manifest_records_each_instance_tp(tmp_path):
    s = _stack(tmp_path, prefill_tp=2, decode_instances=2, decode_tp=(2, 1))
    s.preflight()
    m = s.manifest()
    assert [i["tp_size"] for i in m["instances"]["prefill"]] == [2]
    assert [i["tp_size"] for i in m["instances"]["decode"]] == [2, 1]
    json.dumps(m)


def test_start_waves_bring_the_largest_tp_up_first():
    """Mixed TP sizes start in waves, largest first (a started TP 1 engine
    starved the TP 2 ranks' import on 2 cores); equal sizes start at once."""
    from kvlens.stack.tp import start_waves

    assert start_waves([("p0", 2), ("d0", 2), ("d1", 1)]) == [["p0", "d0"], ["d1"]]
    assert start_waves([("p0", 1), ("d0", 4), ("d1", 2)]) == [["d0"], ["d1"], ["p0"]]
    assert start_waves([("p0", 1), ("p1", 1), ("d0", 1)]) == [["p0", "p1", "d0"]]
