"""``kvlens up --prefill-instances N --decode-instances M --router ...``:
flag checks, and the command lines, environments, CPUs and ``stack.json``
built for N x M instances, without starting anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvlens.stack.errors import StackError
from stack_settings import offline_stack


def _stack(tmp_path, **kw):
    return offline_stack(tmp_path, **{"mode": "push", **kw})


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    for k in ("KVLENS_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(k, raising=False)


# ------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    "flag,value",
    [
        ("--prefill-instances", "0"),
        ("--prefill-instances", "9"),
        ("--decode-instances", "-1"),
        ("--decode-instances", "two"),
        ("--router", "nginx"),
        ("--router", ","),
        ("--vllm-router-port", "0"),
    ],
)
def test_bad_instance_and_router_flags_are_usage_errors(capsys, flag, value):
    from kvlens.cli import main

    with pytest.raises(SystemExit) as e:
        main(["up", "--mode", "pull", f"{flag}={value}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"kvlens up: error: argument {flag}:")


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--mode", "push", "--router", "vllm-router"], "needs --mode pull: vLLM's router sends P first"),
        (["--mode", "push", "--router", "kvlens,vllm-router"], "needs --mode pull"),
        (["--mode", "pull", "--router", "vllm-router", "--api-key", "sk"], "keeps keys off command lines"),
        (
            ["--mode", "pull", "--router", "vllm-router", "--separate-homes", "--collector", "router"],
            "--collector router needs kvlens' router",
        ),
        (["--mode", "pull", "--vllm-router-port", "9999"], "--vllm-router-port needs --router vllm-router"),
    ],
)
def test_what_vllm_router_cannot_do_is_refused_before_anything_starts(tmp_path, capsys, argv, words):
    from kvlens.cli import main

    rc = main(["up", *argv, "--log-dir", str(tmp_path / "run"), "--model", str(tmp_path / "none")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "kvlens up: error:" in err and words in err
    assert not (tmp_path / "run").exists()  # refused before the model check or any start


def test_up_flags_reach_the_stack(tmp_path):
    import argparse

    from kvlens import up, upargs

    p = argparse.ArgumentParser()
    upargs.add_arguments(p)
    args = p.parse_args(
        [
            "--mode",
            "pull",
            "--prefill-instances",
            "2",
            "--decode-instances",
            "3",
            "--router",
            "vllm-router, kvlens",
            "--log-dir",
            str(tmp_path / "run"),
        ]
    )
    s = up._stack(args)
    assert (s.prefill_instances, s.decode_instances, s.routers) == (2, 3, ("kvlens", "vllm-router"))
    with pytest.raises(StackError, match="--decode-instances must be 1..8"):
        _stack(tmp_path, decode_instances=9)


# ------------------------------------------ what N x M instances run
def test_two_p_three_d_commands_and_environments(tmp_path):
    s = _stack(tmp_path, prefill_instances=2, decode_instances=3)
    s.preflight()
    ps, ds = s.prefills, s.decodes
    assert [i.engine_id for i in ps] == ["p0", "p1"] and [i.engine_id for i in ds] == ["d0", "d1", "d2"]
    assert (ps[0].port, ds[0].port, ps[0].side_port) == (s.prefill_port, s.decode_port, s.prefill_side_port)
    assert (s.prefill_url, s.decode_url) == ("", "")  # set by start(); the instances know theirs
    children = [s.roles.server(i.role, i.index) for i in [*ps, *ds]]
    assert [c.name for c in children] == ["prefill", "prefill-p1", "decode", "decode-d1", "decode-d2"]
    ports = [s.port] + [i.port for i in ps + ds] + [i.side_port for i in ps + ds]
    assert len(set(ports)) == len(ports) and all(ports)  # every instance its own HTTP and side-channel port
    for inst, c in zip([*ps, *ds], children):
        argv = c.argv
        assert argv[argv.index("--port") + 1] == str(inst.port) and c.url == inst.url
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc["engine_id"] == inst.engine_id
        assert ktc["kv_role"] == ("kv_producer" if inst.role == "prefill" else "kv_consumer")
        assert c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(inst.side_port)
        assert c.env["PROMETHEUS_MULTIPROC_DIR"] == str(Path(s.log_dir) / f"prometheus-{inst.name}")
        assert c.log == Path(s.log_dir) / f"{inst.name}.log"
        assert "KVLENS_HANDOFF_FROM" not in c.env  # kvlens' router resolves the handoff
    assert len({c.env["PROMETHEUS_MULTIPROC_DIR"] for c in children}) == 5
    r = s.roles.router("overlapped", s.port).argv
    pairs = [(r[i + 1], r[i + 3], r[i + 5]) for i, a in enumerate(r) if a == "--prefill"]
    assert pairs == [(p.url, p.engine_id, str(p.side_port)) for p in ps]
    assert [r[i + 1] for i, a in enumerate(r) if a == "--decode"] == [d.url for d in ds]
    assert [r[i + 1] for i, a in enumerate(r) if a == "--decode-engine-id"] == ["d0", "d1", "d2"]


def test_the_router_built_for_n_x_m_parses(tmp_path):
    from kvlens.cli import build_parser
    from proxy.cli import check, config

    s = _stack(tmp_path, prefill_instances=3, decode_instances=2)
    s.preflight()
    argv = s.roles.router("overlapped", s.port).argv
    cfg = config(build_parser().parse_args(argv[argv.index("proxy") :]))
    check(cfg)  # overlapped push: every P's side channel known
    assert [(p.url, p.engine_id, p.side_port) for p in cfg.prefills] == [
        (p.url, p.engine_id, p.side_port) for p in s.prefills
    ]
    assert [(d.url, d.engine_id) for d in cfg.decodes] == [(d.url, d.engine_id) for d in s.decodes]


def test_without_kvlens_router_d_resolves_the_handoff(tmp_path):
    s = _stack(tmp_path, mode="pull", routers="vllm-router", prefill_instances=2)
    s.preflight()
    assert s.vllm_router_port == s.port and s.vllm_router_metrics_port not in (None, s.port)
    for inst in [*s.prefills, *s.decodes]:
        assert s.roles.server(inst.role, inst.index).env["KVLENS_HANDOFF_FROM"] == "decode"
    v = s.roles.vllm_router()
    assert v.name == "vllm-router" and v.argv[v.argv.index("--port") + 1] == str(s.port)
    assert [v.argv[i + 1] for i, a in enumerate(v.argv) if a == "--prefill"] == [p.url for p in s.prefills]
    both = _stack(tmp_path, mode="pull", routers=["kvlens", "vllm-router"])
    both.preflight()
    assert both.vllm_router_port not in (None, both.port)
    sep = _stack(tmp_path, mode="pull", routers="vllm-router", separate_homes=True)
    sep.preflight()
    assert sep.roles.collector().env["KVLENS_HANDOFF_FROM"] == "decode"  # the only store with both ends
    assert "KVLENS_HANDOFF_FROM" not in sep.roles.server("decode").env


# ------------------------------------------------------------- the CPUs
def test_cpu_binding_rule():
    from kvlens.stack.pinning import cpu_binding

    def plan(n_p, n_d, cpus):
        return (
            [cpu_binding("prefill", i, n_p, n_d, cpus) for i in range(n_p)],
            [cpu_binding("decode", j, n_p, n_d, cpus) for j in range(n_d)],
        )

    assert plan(1, 1, [0, 1]) == (["0"], ["1"])  # as a pair always ran
    assert plan(2, 3, [0, 1]) == (["0", "0"], ["1", "1", "1"])  # 2 cores: P on one, D on the other
    assert plan(2, 1, [0]) == (["0", "0"], ["0"])
    assert plan(2, 2, [0, 1, 2, 3]) == (["0", "1"], ["2", "3"])  # a core each
    assert plan(2, 1, [4, 5, 6, 7]) == (["4", "5"], ["6"])  # the CPUs this process may use
    p, d = plan(4, 2, [0, 1, 2])
    assert p == ["0", "1", "0", "1"] and d == ["2", "2"]  # never a P and a D on one CPU


# ------------------------------------------------------------ stack.json
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_manifest_lists_every_instance_and_leftovers_still_read_it(tmp_path):
    import os

    from kvlens.stack.leftovers import find_leftovers
    from kvlens.stack.supervise import Child, stop_children

    s = _stack(
        tmp_path,
        mode="pull",
        prefill_instances=2,
        decode_instances=2,
        routers="kvlens,vllm-router",
        log_dir=tmp_path / "home" / "runs" / "pull-2x2",
    )
    s.preflight()
    Path(s.log_dir).mkdir(parents=True)
    c = Child(
        "prefill-p1",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        dict(os.environ),
        tmp_path / "p1.log",
        s.prefills[1].url,
    )
    c.start()
    try:
        s.children.append(c)
        s.write_manifest()
        m = json.loads((Path(s.log_dir) / "stack.json").read_text())
        assert [i["engine_id"] for i in m["instances"]["prefill"]] == ["p0", "p1"]
        assert m["instances"]["prefill"][1]["pid"] == c.proc.pid and m["instances"]["prefill"][0]["pid"] is None
        assert [i["url"] for i in m["instances"]["decode"]] == [d.url for d in s.decodes]
        assert m["routers"] == ["kvlens", "vllm-router"] and m["engine_ids"] == {"prefill": "p0", "decode": "d0"}
        assert all(isinstance(v, int) for v in m["ports"].values())
        assert {"p1", "p1_side_channel", "d1", "vllm_router", "vllm_router_metrics"} <= set(m["ports"])
        (lo,) = find_leftovers(Path(s.kvlens_home) / "runs", me=0)
        assert lo.names == ["prefill-p1"] and s.prefills[1].port in lo.ports and s.vllm_router_port in lo.ports
    finally:
        stop_children([c], grace_s=5)
