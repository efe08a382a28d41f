"""``kvlens up --router vllm-router``: the command line kvlens builds starts
vLLM's real router (PyPI ``vllm-router``) in front of fake P and D servers on
loopback (no vLLM), and it routes a request P first, then D with P's
``kv_transfer_params``; it is stopped by process group like every child."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from fakes import P_KV, FakeVllm, d_echo, send_json

from kvlens.stack.commands import find_vllm_router
from kvlens.stack.errors import StackError
from kvrecord.ports import free_port
from kvlens.stack.supervise import stop_children, wait_healthy

try:
    VLLM_ROUTER = find_vllm_router()
except StackError:  # pragma: no cover - make setup installs it (dev extra)
    VLLM_ROUTER = None


def _stack(tmp_path, p_fakes, d_fake, **kw):
    from kvlens.stack.launch import Stack

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    ports = [int(f.url.rsplit(":", 1)[1]) for f in p_fakes]
    s = Stack(
        mode="pull",
        model=model,
        kvlens_home=tmp_path / "home",
        log_dir=tmp_path / "run",
        routers="vllm-router",
        port=free_port(),
        prefill_port=ports[0],
        decode_port=int(d_fake.url.rsplit(":", 1)[1]),
        prefill_instances=len(p_fakes),
        prefill_side_port=free_port(),
        decode_side_port=free_port(),
        quiet=True,
        **kw,
    )
    s.vllm_router_port, s.vllm_router_metrics_port = s.port, free_port()
    for i, port in enumerate(ports[1:], 1):  # the later P: where the fakes listen
        s.more_ports[f"p{i} port"], s.more_ports[f"p{i} side-channel port"] = port, free_port()
    return s


def p_answers(h, body):
    send_json(h, 200, {"choices": [{"index": 0, "text": "A"}], "kv_transfer_params": P_KV})


def _header(req: dict, name: str) -> str | None:
    return next((v for k, v in req["headers"].items() if k.lower() == name.lower()), None)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(VLLM_ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
def test_vllm_router_built_by_kvlens_routes_p_then_d(tmp_path):
    p0, p1, d = FakeVllm(p_answers), FakeVllm(p_answers), FakeVllm(d_echo)
    c = None
    try:
        s = _stack(tmp_path, [p0, p1], d)
        c = s.roles.vllm_router()
        assert c.argv[:2] == [VLLM_ROUTER, "--vllm-pd-disaggregation"]
        assert c.argv.count("--prefill") == 2 and c.argv.count("--decode") == 1
        assert c.argv[c.argv.index("--policy") + 1] == "round_robin"
        assert c.argv[c.argv.index("--port") + 1] == str(s.port) and c.url == f"http://127.0.0.1:{s.port}"
        c.start()
        wait_healthy([c], time.monotonic() + 120, lambda m: None)
        tp = f"00-{'ab' * 16}-b7ad6b7169203331-01"
        rs = [
            httpx.post(
                c.url + "/v1/completions",
                json={"prompt": f"q{i}", "max_tokens": 3},
                headers={"traceparent": tp, "X-Request-Id": "client-id"},
                timeout=30,
                trust_env=False,
            )
            for i in range(2)
        ]
    finally:
        if c is not None and c.proc is not None:
            stop_children([c], grace_s=10)
        for f in (p0, p1, d):
            f.close()
    assert [r.status_code for r in rs] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in rs] == ["echo q0", "echo q1"]
    (p0_req,), (p1_req,) = p0.requests, p1.requests  # round robin over the two P
    assert [r["body"]["prompt"] for r in d.requests] == ["q0", "q1"]
    for p_req, d_req in zip((p0_req, p1_req), d.requests):
        assert p_req["t"] <= d_req["t"]  # P first, then D
        assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert d_req["body"]["kv_transfer_params"] == P_KV  # what P returned, verbatim
        rid = _header(p_req, "X-Request-Id")
        assert rid == _header(d_req, "X-Request-Id")  # one id to both, not the client's
        assert re.fullmatch(r"___prefill_addr_127\.0\.0\.1:\d+___decode_addr_127\.0\.0\.1:\d+_[0-9a-f]{32}", rid)
        assert _header(p_req, "traceparent") == _header(d_req, "traceparent") == tp
    assert c.proc.poll() is not None and _group_gone(c.proc.pid), "vllm-router outlived its process group"


def test_vllm_router_env_and_refusals(tmp_path, monkeypatch):
    from kvlens.stack.launch import Stack

    for k in ("KVLENS_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(StackError, match="needs --mode pull"):
        Stack(mode="push", routers="vllm-router", kvlens_home=tmp_path)
    with pytest.raises(StackError, match="keeps keys off command lines"):
        Stack(mode="pull", routers="kvlens,vllm-router", api_key="sk", kvlens_home=tmp_path)
    with pytest.raises(StackError, match="one or both of kvlens, vllm-router"):
        Stack(mode="pull", routers="nginx", kvlens_home=tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # not next to this python either: a clear error
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    with pytest.raises(StackError, match="pip install 'vllm-router>=0.1.17'"):
        find_vllm_router()
