"""A mixed fleet behind one router (issue 31, a canary): the split's
parsing and draws, URLs tagged with their mode, each request dispatched as
its drawn mode needs to that mode's instances, the root span's mode, split
weight, prompt tokens and TPOT, ``X-Kvlens-Mode``, ``/admin/split`` live and
behind the key, one half failing without the other, and ``kvlens up
--mode push,pull``'s instances and router command line. Fake P and D on
loopback (no vLLM: tests/e2e/test_e2e_demo.py runs the real fleet)."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from typing import Iterator

import httpx
import pytest

from kvrecord import semconv as sc
from proxy.app import create_app
from proxy.config import Decode, Prefill, ProxyConfig
from proxy import cli as proxy_cli
from proxy import telemetry
from proxy.split import Split, parse_split
from proxy.sse import TextTimes
from fakes import P_KV, FakeVllm, closed_port_url, send_json, wait_for
from uvicorn_thread import serve


class FakeRecorder:
    def __init__(self) -> None:
        self.roots: list[tuple] = []
        self.spans: list[tuple] = []
        self.lock = threading.Lock()

    def record_root(self, trace_id, parent_span_id, t0, t1, outcome="ok", attrs=None) -> None:
        with self.lock:
            self.roots.append((trace_id, outcome, dict(attrs or {})))

    def record(self, phase, request_id, t0, t1, outcome="ok", attrs=None) -> None:
        with self.lock:
            self.spans.append((phase, request_id, dict(attrs or {})))

    def close(self) -> None:
        pass


@pytest.fixture
def recorder(monkeypatch) -> FakeRecorder:
    rec = FakeRecorder()
    monkeypatch.setattr(telemetry, "get_recorder", lambda **kw: rec)
    return rec


@contextlib.contextmanager
def router(cfg: ProxyConfig) -> Iterator[str]:
    with serve(create_app(cfg)) as url:
        yield url


def p_usage(h, body) -> None:
    """P answering as vLLM does, with its prompt's token count."""
    send_json(
        h,
        200,
        {
            "choices": [{"index": 0, "text": "A"}],
            "kv_transfer_params": P_KV,
            "usage": {"prompt_tokens": 17, "completion_tokens": 1},
        },
    )


def d_slow_stream(h, body) -> None:
    """D streaming 3 tokens 50 ms apart (plain answers at once)."""
    if not body.get("stream"):
        send_json(h, 200, {"choices": [{"index": 0, "text": "abc"}]})
        return
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    for tok in ("a", "b", "c"):
        h.wfile.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": tok}]}).encode() + b"\n\n")
        h.wfile.flush()
        time.sleep(0.05)
    h.wfile.write(b"data: [DONE]\n\n")


@contextlib.contextmanager
def fleet(pull_decode_down: bool = False):
    """A push pair and a pull pair of fakes (the pull D down when asked)."""
    fakes = {
        "push": (FakeVllm(p_usage), FakeVllm(d_slow_stream)),
        "pull": (FakeVllm(p_usage), None if pull_decode_down else FakeVllm(d_slow_stream)),
    }
    try:
        yield fakes
    finally:
        for p, d in fakes.values():
            p.close()
            if d is not None:
                d.close()


def _mixed_cfg(fakes, tmp_path, **kw) -> ProxyConfig:
    (pp, pd), (lp, ld) = fakes["push"], fakes["pull"]
    ld_url = ld.url if ld is not None else closed_port_url()
    return ProxyConfig.of(
        [Prefill(pp.url, "p0", side_port=5600, mode="push"), Prefill(lp.url, "p1", mode="pull")],
        [Decode(pd.url, "d0", mode="push"), Decode(ld_url, "d1", mode="pull")],
        mode="push",
        kvlens_home=str(tmp_path),
        **kw,
    )


def _roots(rec: FakeRecorder, n: int) -> list[tuple]:
    assert wait_for(lambda: len(rec.roots) >= n, 20), f"{len(rec.roots)} of {n} root spans"
    return list(rec.roots)


# ------------------------------------------------------------ the split itself
@pytest.mark.parametrize(
    "text,push",
    [("push=0.25", 0.25), ("pull=0.25", 0.75), ("pull=0.7", 0.3), ("0.1", 0.1), (" PUSH = 1 ", 1.0), ("pull=1", 0.0)],
)
def test_split_parses_either_mode_weight(text, push):
    assert parse_split(text) == push  # exact: the weight is recorded on every root span


@pytest.mark.parametrize("text", ["push=1.5", "push=-0.1", "both=0.5", "push=x", "", "push="])
def test_split_refuses_what_is_not_a_weight(text):
    with pytest.raises(ValueError, match="split"):
        parse_split(text)


def test_seeded_split_draws_as_its_rng_and_changes_live():
    s = Split(0.3, seed=7)
    rng = random.Random(7)
    want = ["push" if rng.random() < 0.3 else "pull" for _ in range(200)]
    assert [s.draw()[0] for _ in range(200)] == want
    assert s.set(1.0) == 0.3 and all(s.draw() == ("push", 1.0) for _ in range(20))
    s.set(0.0)
    assert all(s.draw() == ("pull", 0.0) for _ in range(20))
    with pytest.raises(ValueError):
        s.set(2)
    s.count("pull", "ok")
    s.count("pull", "timeout")
    assert s.to_json()["requests"]["pull"] == {"ok": 1, "failed": 1}


# ------------------------------------------------------------ the CLI and config
def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    proxy_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_tagged_urls_make_a_mixed_fleet_at_the_default_split():
    args = _args(
        "--prefill", "push=http://127.0.0.1:8100", "--prefill", "pull=http://127.0.0.1:8101",
        "--decode", "push=http://127.0.0.1:8200", "--decode", "pull=http://127.0.0.1:8201",
        "--prefill-side-port", "5600", "--prefill-side-port", "5601",
    )  # fmt: skip
    cfg = proxy_cli.config(args)
    proxy_cli.check(cfg)
    assert cfg.mixed and cfg.modes == ("push", "pull") and cfg.split == 0.5
    assert [(p.engine_id, p.mode) for p in cfg.prefills] == [("p0", "push"), ("p1", "pull")]
    assert [(d.engine_id, d.mode) for d in cfg.decodes] == [("d0", "push"), ("d1", "pull")]
    assert cfg.dispatch_for("push") == "overlapped" and cfg.dispatch_for("pull") == "sequential"
    assert proxy_cli.config(_args(*args_list(args), "--split", "pull=0.75")).split == 0.25


def args_list(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, vals in (("--prefill", args.prefill), ("--decode", args.decode)):
        for mode, url in vals:
            out += [flag, f"{mode}={url}" if mode else url]
    for port in args.prefill_side_port or ():
        out += ["--prefill-side-port", str(port)]
    return out


def test_old_single_mode_syntax_is_unchanged():
    cfg = proxy_cli.config(_args("--prefill", "http://127.0.0.1:8100", "--decode", "http://d:1", "--mode", "pull"))
    assert cfg.modes == ("pull",) and not cfg.mixed and cfg.mode == "pull"


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--prefill", "http://p:1", "--decode", "http://d:1"], "has no mode"),
        (
            ["--prefill", "push=http://p:1", "--decode", "pull=http://d:1"],
            "mode push has prefill instances but no decode",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--mode", "pull", "--split", "push=0.3"],
            "--split needs",
        ),
    ],
)
def test_bad_fleets_are_named(argv, match):
    with pytest.raises(ValueError, match=match):
        proxy_cli.config(_args(*argv))


def test_a_url_with_a_wrong_mode_tag_is_a_usage_error():
    with pytest.raises(SystemExit):
        _args("--prefill", "pish=http://p:1", "--decode", "http://d:1", "--mode", "pull")


# ------------------------------------------------------------ the router
def test_each_request_goes_as_its_drawn_mode_to_that_modes_instances(tmp_path, recorder):
    n = 40
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path, split=0.5, split_seed=3)) as url:
        with httpx.Client(timeout=20, trust_env=False) as c:
            for i in range(n):
                r = c.post(url + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 3, "stream": i % 2 == 0})
                assert r.status_code == 200, r.text
        roots = _roots(recorder, n)
        (pp, pd), (lp, ld) = fakes["push"], fakes["pull"]
        rng = random.Random(3)
        want = ["push" if rng.random() < 0.5 else "pull" for _ in range(n)]
        assert sorted(r[2][sc.ATTR_MODE] for r in roots) == sorted(want)
        by_tid = {r[0]: r[2] for r in roots}
        for fake_p, fake_d, mode in ((pp, pd, "push"), (lp, ld, "pull")):
            assert len(fake_p.requests) == len(fake_d.requests) == want.count(mode)
            for req in fake_p.requests:
                a = by_tid[req["headers"]["X-Request-Id"]]
                assert a[sc.ATTR_MODE] == mode and a[sc.ATTR_SPLIT] == 0.5
                assert a[sc.ATTR_DISPATCH] == ("overlapped" if mode == "push" else "sequential")
                assert a[sc.ATTR_PREFILL_ENGINE_ID] == ("p0" if mode == "push" else "p1")
                assert a[sc.ATTR_TOKENS] == 17
        # pull's D got P's kv_transfer_params verbatim; push's D P's identity up front
        assert all(r["body"]["kv_transfer_params"] == P_KV for r in ld.requests)
        assert all(r["body"]["kv_transfer_params"]["remote_engine_id"] == "p0" for r in pd.requests)
        assert all(r["body"]["kv_transfer_params"] != P_KV for r in pd.requests)
        # the relay span (pull only) names its mode
        assert recorder.spans and all(s[2][sc.ATTR_MODE] == "pull" for s in recorder.spans)
        # streams carry a TPOT (3 tokens 50 ms apart), plain answers none
        tpots = [a.get(sc.ATTR_TPOT_S) for a in by_tid.values()]
        assert sum(t is not None for t in tpots) == n // 2 and all(t > 0 for t in tpots if t is not None)
        health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
        assert health["mode"] == "push,pull" and health["split"] == {"push": 0.5, "pull": 0.5}


def test_a_request_may_name_its_mode_and_is_then_not_drawn(tmp_path, recorder):
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path, split=1.0)) as url:
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "x"},
            headers={"X-Kvlens-Mode": "pull"},
            timeout=20,
            trust_env=False,
        )
        assert r.status_code == 200
        bad = httpx.post(
            url + "/v1/completions",
            json={"prompt": "x"},
            headers={"X-Kvlens-Mode": "both"},
            timeout=20,
            trust_env=False,
        )
        assert bad.status_code == 400 and "X-Kvlens-Mode" in bad.json()["error"]["message"]
        (root, _) = _roots(recorder, 2)[:2]
    assert root[2][sc.ATTR_MODE] == "pull" and sc.ATTR_SPLIT not in root[2]


def test_a_mode_without_instances_is_a_clear_error(tmp_path, recorder):
    p, d = FakeVllm(p_usage), FakeVllm(d_slow_stream)
    try:
        cfg = ProxyConfig(p.url, d.url, mode="pull", kvlens_home=str(tmp_path))
        with router(cfg) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"X-Kvlens-Mode": "push"}, timeout=20)
            assert r.status_code == 503 and "no push instances" in r.json()["error"]["message"]
            s = httpx.post(url + "/admin/split", json={"push": 0.5}, timeout=20)
            assert s.status_code == 409 and "only pull instances" in s.json()["error"]["message"]
            # a one-mode router draws nothing and records no weight
            assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=20).status_code == 200
            root = [r for r in _roots(recorder, 2) if r[1] == "ok"][0]
            assert root[2][sc.ATTR_MODE] == "pull" and sc.ATTR_SPLIT not in root[2]
    finally:
        p.close()
        d.close()


ADMIN = "admin-" + "a" * 20
READ = "read-" + "r" * 20


def test_admin_split_changes_the_split_live_behind_the_admin_token(tmp_path, recorder):
    """Issue 42 item 4: the API key (every OpenAI client has it) never opens
    /admin/*; the admin token does, the API key still serves /v1/*."""
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path, api_key="k3y", admin_token=ADMIN)) as url:
        key, admin = {"Authorization": "Bearer k3y"}, {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(timeout=20, trust_env=False) as c:
            assert c.get(url + "/admin/split").status_code == 401
            assert c.post(url + "/admin/split", json={"push": 1}).status_code == 401
            r = c.post(url + "/admin/split", json={"push": 1}, headers=key)  # the API key: refused
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get(url + "/admin/split", headers=key).status_code == 401
            assert c.post(url + "/v1/completions", json={"prompt": "x"}, headers=admin).status_code == 401
            assert c.get(url + "/admin/split", headers=admin).json()["split"] == {"push": 0.5, "pull": 0.5}
            for bad in ({"push": 1.5}, {"push": True}, {"both": 1}, {"push": 1, "pull": 0}, [1]):
                assert c.post(url + "/admin/split", json=bad, headers=admin).status_code == 400, bad
            r = c.post(url + "/admin/split", json={"pull": 0}, headers=admin)
            assert r.status_code == 200 and r.json()["split"] == {"push": 1.0, "pull": 0.0}
            assert r.json()["previous"] == {"push": 0.5, "pull": 0.5}
            for _ in range(10):
                assert c.post(url + "/v1/completions", json={"prompt": "x"}, headers=key).status_code == 200
            state = c.get(url + "/admin/split", headers=admin).json()
        assert state["requests"]["push"]["ok"] == 10 and state["drawn"]["push"] == 10
        assert all(r[2][sc.ATTR_MODE] == "push" and r[2][sc.ATTR_SPLIT] == 1.0 for r in _roots(recorder, 10))


def test_an_api_key_alone_leaves_admin_closed(tmp_path, recorder):
    """The reproduced case: a router with an API key and no token answered
    POST /admin/split with the API key 200. Now 401, the split unchanged."""
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path, api_key="k3y")) as url:
        with httpx.Client(timeout=20, trust_env=False, headers={"Authorization": "Bearer k3y"}) as c:
            r = c.post(url + "/admin/split", json={"push": 1})
            assert r.status_code == 401
            assert c.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
        with _admin_view(url, ADMIN) as view:
            assert view is None  # no admin token exists: nobody reads or changes it
    assert len(_roots(recorder, 1)) == 1


@contextlib.contextmanager
def _admin_view(url: str, token: str | None):
    r = httpx.get(url + "/admin/split", headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=20)
    yield r.json()["split"] if r.status_code == 200 else None


@pytest.mark.parametrize(
    "headers, content, status",
    [
        ({"Content-Type": "text/plain"}, b'{"push": 1}', 415),  # a form's simple request: no preflight
        ({"Content-Type": "application/x-www-form-urlencoded"}, b'{"push": 1}', 415),
        ({}, b'{"push": 1}', 415),
        ({"Content-Type": "application/json", "Host": "evil.example"}, b'{"push": 1}', 403),  # DNS rebinding
        ({"Content-Type": "application/json", "Host": "evil.example:8000"}, b'{"push": 1}', 403),
        ({"Content-Type": "application/json", "Origin": "http://evil.example"}, b'{"push": 1}', 403),
        ({"Content-Type": "application/json", "Origin": "null"}, b'{"push": 1}', 403),
    ],
)
def test_cross_site_posts_to_an_open_loopback_router_change_nothing(tmp_path, recorder, headers, content, status):
    """Issue 42 item 5 (reproduced: both answered 200 and changed the split):
    a router on loopback with no token refuses what a web page could send,
    before any route runs; the split is unchanged and no request is served."""
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path)) as url:
        with httpx.Client(timeout=20, trust_env=False) as c:
            r = c.post(url + "/admin/split", content=content, headers=headers)
            assert r.status_code == status, r.text
            assert ("--allowed-host" in r.text) if status == 403 and "Host" in headers else True
            assert c.get(url + "/admin/split").json()["split"] == {"push": 0.5, "pull": 0.5}
            r = c.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
            assert r.status_code == status
            # the same request as a real client sends it is served
            ok = c.post(url + "/admin/split", json={"push": 1}, headers={"Origin": url})
            assert ok.status_code == 200 and ok.json()["split"] == {"push": 1.0, "pull": 0.0}
            assert c.get(url.replace("127.0.0.1", "localhost") + "/admin/split").status_code == 200
        assert not any(p.requests for p, _ in fakes.values())  # nothing reached P
    assert recorder.roots == []


def test_health_says_only_ok_without_the_read_role_and_is_cached(tmp_path, recorder):
    """Issue 42 item 6: /health without a credential is {"status": "ok"};
    the read token, the all-roles token or the API key shows the details; a
    burst of probes asks each P and D about once (cached, own pool)."""
    with fleet() as fakes, router(_mixed_cfg(fakes, tmp_path, api_key="k3y", read_token=READ)) as url:
        with httpx.Client(timeout=20, trust_env=False) as c:
            bare = c.get(url + "/health")
            assert bare.status_code == 200 and bare.json() == {"status": "ok"}
            assert c.get(url + "/health", headers={"Authorization": "Bearer wrong-" + "w" * 16}).json() == {
                "status": "ok"
            }
            for cred in (READ, "k3y"):
                full = c.get(url + "/health", headers={"Authorization": f"Bearer {cred}"}).json()
                assert full["mode"] == "push,pull" and full["split"] == {"push": 0.5, "pull": 0.5}
                assert set(full["instances"]["prefill"]) == {"p0", "p1"}
            before = _health_gets(fakes)
            for _ in range(20):
                assert c.get(url + "/health").json() == {"status": "ok"}
            after = _health_gets(fakes)
        # uncached, 20 probes were 20 GETs to each of the 4 instances; cached, one per second
        assert after - before < 20, (before, after)


def _health_gets(fakes) -> int:
    return sum(len([g for g in x.gets if g["path"] == "/health"]) for pd in fakes.values() for x in pd if x)


def test_one_half_down_loses_nothing_of_the_other(tmp_path, recorder):
    n = 30
    with fleet(pull_decode_down=True) as fakes, router(_mixed_cfg(fakes, tmp_path, split_seed=11)) as url:
        with httpx.Client(timeout=20, trust_env=False) as c:
            got = [c.post(url + "/v1/completions", json={"prompt": f"x {i}", "max_tokens": 2}) for i in range(n)]
            state = c.get(url + "/admin/split").json()
        roots = {r[0]: r for r in _roots(recorder, n)}
    for r in got:
        root = roots[r.headers["x-request-id"]]
        if root[2][sc.ATTR_MODE] == "push":
            assert r.status_code == 200 and root[1] == "ok"
        else:
            assert r.status_code == 502 and "decode instance unreachable" in r.json()["error"]["message"]
            assert root[1] == "failed" and "decode" in root[2][sc.ATTR_ERROR]
    n_pull = sum(r[2][sc.ATTR_MODE] == "pull" for r in roots.values())
    assert 0 < n_pull < n
    assert state["requests"] == {"push": {"ok": n - n_pull, "failed": 0}, "pull": {"ok": 0, "failed": n_pull}}


# ------------------------------------------------------------ TPOT
def test_text_times_tpot():
    t = TextTimes()
    ev = lambda s: b"data: " + json.dumps({"choices": [{"text": s}]}).encode() + b"\n\n"  # noqa: E731
    assert t.feed(ev("a")[:5], 1.0) is False and t.feed(ev("a")[5:], 1.5) is True
    assert t.feed(ev("b") + ev("c"), 2.5) is False
    assert t.tpot_s() == pytest.approx((2.5 - 1.5) / 2)
    usage = b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 5}}).encode() + b"\n\n"
    t.feed(usage, 3.0)
    assert t.tpot_s() == pytest.approx(1.0 / 4)
    one = TextTimes()
    one.feed(ev("a") + ev("b"), 1.0)  # all at once: not measured
    assert one.tpot_s() is None


# ------------------------------------------------------------ kvlens up --mode push,pull
def test_mixed_stack_numbers_push_then_pull_and_tags_the_router(tmp_path):
    from kvlens.stack.errors import StackError
    from kvlens.stack.launch import Stack

    s = Stack(mode="pull,push", log_dir=tmp_path / "logs", kvlens_home=tmp_path, prefill_instances=2, decode_tp=2)
    assert (s.mode, s.modes, s.per_mode) == ("push,pull", ("push", "pull"), (2, 1))
    assert (s.prefill_instances, s.decode_instances, s.decode_tp) == (4, 2, (2, 2))
    assert [(i.engine_id, i.mode) for i in s.prefills] == [
        ("p0", "push"),
        ("p1", "push"),
        ("p2", "pull"),
        ("p3", "pull"),
    ]
    assert [(i.engine_id, i.mode) for i in s.decodes] == [("d0", "push"), ("d1", "pull")]
    s.prefill_port, s.decode_port = 8100, 8200
    s.more_ports = {"p1 port": 8101, "p2 port": 8102, "p3 port": 8103, "d1 port": 8201}
    argv = s.roles.router("overlapped", 8000).argv
    assert "--mode" not in argv and "--split" not in argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill"] == [
        "push=http://127.0.0.1:8100", "push=http://127.0.0.1:8101", "pull=http://127.0.0.1:8102", "pull=http://127.0.0.1:8103",
    ]  # fmt: skip
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == [
        "push=http://127.0.0.1:8200",
        "pull=http://127.0.0.1:8201",
    ]
    m = s.manifest()
    assert m["modes"] == ["push", "pull"] and set(m["connector"]) == {"push", "pull"}
    assert [i["mode"] for i in m["instances"]["prefill"]] == ["push", "push", "pull", "pull"]
    one = Stack(mode="pull", log_dir=tmp_path / "one", kvlens_home=tmp_path)
    assert one.mode == "pull" and not one.mixed and one.roles.router("overlapped", 8000).argv[4:6] == ["--mode", "pull"]
    with pytest.raises(StackError, match="mode must be push, pull or push,pull"):
        Stack(mode="push,push", kvlens_home=tmp_path)
    with pytest.raises(StackError, match="vllm-router needs --mode pull"):
        Stack(mode="push,pull", kvlens_home=tmp_path, routers="kvlens,vllm-router")


def test_up_split_reaches_the_router_and_needs_a_mixed_fleet(tmp_path):
    import argparse as _argparse

    from kvlens import upargs
    from kvlens.stack.errors import StackError
    from kvlens.stack.launch import Stack

    s = Stack(mode="push,pull", log_dir=tmp_path / "logs", kvlens_home=tmp_path, split=0.25)
    s.prefill_port, s.decode_port, s.prefill_side_port = 8100, 8200, 5600
    s.more_ports = {"p1 port": 8101, "p1 side-channel port": 5601, "d1 port": 8201}
    argv = s.roles.router("overlapped", 8000).argv
    assert argv[argv.index("--split") + 1] == "push=0.25"
    assert proxy_cli.config(_args(*argv[argv.index("proxy") + 1 :])).split == 0.25
    with pytest.raises(StackError, match="--split needs --mode push,pull"):
        Stack(mode="push", kvlens_home=tmp_path, split=0.3)
    p = _argparse.ArgumentParser()
    upargs.add_arguments(p)
    assert p.parse_args(["--mode", "pull,push", "--split", "pull=0.75"]).split == 0.25
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "push,sideways"])
