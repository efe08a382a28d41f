"""Several P and D behind ``kvlens proxy``: the round-robin balancer, the
per-P identity D gets in an overlapped push, ``/health`` over every
upstream, one dead upstream among live ones, and the repeated flags
(against the fake P and D servers of tests/fakes.py, as in test_proxy.py)."""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import pytest
from fakes import TID, FakeVllm, closed_port_url, d_echo, p_echo_id
from test_proxy import _post, recorder, router  # noqa: F401 (recorder: a fixture)

from proxy.bodies import overlapped_d_params
from proxy.balancer import Balancer
from proxy.config import Decode, Prefill, ProxyConfig


def _prefills(n: int) -> list[Prefill]:
    return [Prefill(f"http://p{i}", f"p{i}", "127.0.0.1", 5600 + i) for i in range(n)]


def _decodes(n: int) -> list[Decode]:
    return [Decode(f"http://d{i}", f"d{i}") for i in range(n)]


# ----------------------------------------------------------- the balancer
def test_round_robin_cycles_over_every_pair():
    b = Balancer(_prefills(3), _decodes(2))
    picks = [b.pick() for _ in range(6)]
    assert [r.prefill.engine_id for r in picks] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [r.decode.engine_id for r in picks] == ["d0", "d1", "d0", "d1", "d0", "d1"]
    assert len({(r.prefill.engine_id, r.decode.engine_id) for r in picks}) == 6 == b.pairs
    assert picks[0].attrs() == {
        "kvlens.prefill.url": "http://p0",
        "kvlens.prefill.engine_id": "p0",
        "kvlens.decode.url": "http://d0",
        "kvlens.decode.engine_id": "d0",
    }
    # N and M with a common divisor: two counters stepped together would only
    # ever meet P0-D0 and P1-D1; the cycle meets all four, each P and D twice
    b = Balancer(_prefills(2), _decodes(2))
    pairs = [(r.prefill.engine_id, r.decode.engine_id) for r in (b.pick() for _ in range(4))]
    assert pairs == [("p0", "d0"), ("p1", "d1"), ("p0", "d1"), ("p1", "d0")]
    b = Balancer(_prefills(1), _decodes(3))
    assert [b.pick().decode.engine_id for _ in range(4)] == ["d0", "d1", "d2", "d0"]
    with pytest.raises(ValueError):
        Balancer([], _decodes(1))


def test_balancer_is_thread_safe():
    b = Balancer(_prefills(3), _decodes(1))
    got: list[str] = []
    lock = threading.Lock()

    def work():
        mine = [b.pick().prefill.engine_id for _ in range(3000)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(got) == {"p0": 8000, "p1": 8000, "p2": 8000}


def test_config_lists_and_one_pair_names():
    cfg = ProxyConfig.of(_prefills(2), _decodes(3), mode="pull", kvlens_home="/tmp")
    assert [p.engine_id for p in cfg.prefills] == ["p0", "p1"] and len(cfg.decodes) == 3
    assert (cfg.prefill_url, cfg.decode_url, cfg.prefill_side_port) == ("http://p0", "http://d0", 5600)
    cfg.prefill_url = "http://elsewhere"  # the one-pair names stay the first instance's
    assert cfg.prefills[0].url == "http://elsewhere"
    one = ProxyConfig("http://p/", "http://d", kvlens_home="/tmp")
    assert one.prefills == [Prefill("http://p")] and one.decodes == [Decode("http://d")]
    with pytest.raises(ValueError, match="prefill engine ids must be distinct"):
        ProxyConfig.of([Prefill("http://a", "p0"), Prefill("http://b", "p0")], _decodes(1), kvlens_home="/tmp")
    # overlapped push: D is told the chosen P, not the first one
    d = overlapped_d_params(cfg.prefills[1], "/v1/completions", TID)
    assert (d["remote_engine_id"], d["remote_port"]) == ("p1", 5601)
    assert overlapped_d_params(cfg, "/v1/completions", TID)["remote_engine_id"] == "p0"


# ------------------------------------------------- the router, 2 P x 2 D
@pytest.fixture
def fakes():
    made = [FakeVllm(p_echo_id), FakeVllm(p_echo_id), FakeVllm(d_echo), FakeVllm(d_echo)]
    yield made
    for f in made:
        f.close()


def _ids(fake: FakeVllm) -> list[str]:
    return [r["headers"]["X-Request-Id"] for r in fake.requests]


@pytest.mark.parametrize("mode,dispatch", [("pull", "sequential"), ("push", "overlapped")])
def test_router_balances_and_names_p_and_d(tmp_path, recorder, fakes, mode, dispatch):  # noqa: F811
    p0, p1, d0, d1 = fakes
    cfg = ProxyConfig.of(
        [Prefill(p0.url, "p0", "127.0.0.1", 5600), Prefill(p1.url, "p1", "127.0.0.1", 5601)],
        [Decode(d0.url, "d0"), Decode(d1.url, "d1")],
        mode=mode,
        dispatch=dispatch,
        kvlens_home=str(tmp_path),
    )
    with router(cfg) as url:
        rs = [_post(url, {"prompt": f"q{i}", "max_tokens": 3}) for i in range(4)]
    assert [r.status_code for r in rs] == [200] * 4
    used = [r.headers["x-request-id"] for r in rs]
    assert _ids(p0) == [used[0], used[2]] and _ids(p1) == [used[1], used[3]]
    assert _ids(d0) == [used[0], used[3]] and _ids(d1) == [used[1], used[2]]  # the pair cycle
    for p_fake, eid, side in ((p0, "p0", 5600), (p1, "p1", 5601)):
        for tid in _ids(p_fake):  # D got the kv_transfer_params of the P that served the same request
            d_req = next(r for f in (d0, d1) for r in f.requests if r["headers"]["X-Request-Id"] == tid)
            kv = d_req["body"]["kv_transfer_params"]
            if mode == "push":
                assert (kv["remote_engine_id"], kv["remote_port"]) == (eid, side)
            else:
                assert kv["remote_request_id"] == f"cmpl-{tid}-0-1234abcd"
    roots = {r[0]: r[5] for r in recorder.roots}
    assert roots[used[1]]["kvlens.prefill.engine_id"] == "p1" and roots[used[1]]["kvlens.prefill.url"] == p1.url
    assert roots[used[3]]["kvlens.decode.engine_id"] == "d0" and roots[used[3]]["kvlens.decode.url"] == d0.url


def test_a_dead_p_does_not_stop_the_others(tmp_path, recorder, fakes):  # noqa: F811
    p0, _, d0, _ = fakes
    dead = closed_port_url()
    cfg = ProxyConfig.of(
        [Prefill(p0.url, "p0"), Prefill(dead, "p1")], [Decode(d0.url)], mode="pull", kvlens_home=str(tmp_path)
    )
    with router(cfg) as url:
        rs = [_post(url, {"prompt": f"q{i}", "max_tokens": 3}) for i in range(4)]
        health = httpx.get(url + "/health", timeout=20, trust_env=False)
    assert [r.status_code for r in rs] == [200, 502, 200, 502]
    assert rs[1].json()["error"]["upstream"] == "prefill" and len(p0.requests) == 2
    failed = next(r[5] for r in recorder.roots if r[0] == rs[1].headers["x-request-id"])
    assert failed["kvlens.prefill.engine_id"] == "p1" and failed["http.response.status_code"] == 502
    assert health.status_code == 503
    h = health.json()
    assert h["status"] == "unhealthy" and h["prefill"] == "ConnectError" and h["decode"] == "ok"
    assert h["instances"] == {"prefill": {"p0": "ok", "p1": "ConnectError"}, "decode": {"d0": "ok"}}
    assert dead.rsplit(":", 1)[1] not in health.text  # no instance address to a client


def test_health_of_every_upstream_ok(tmp_path, recorder, fakes):  # noqa: F811
    p0, p1, d0, d1 = fakes
    cfg = ProxyConfig.of(
        [Prefill(p0.url, "p0"), Prefill(p1.url, "p1")],
        [Decode(d0.url), Decode(d1.url, "d1")],
        mode="pull",
        kvlens_home=str(tmp_path),
    )
    with router(cfg) as url:
        h = httpx.get(url + "/health", timeout=20, trust_env=False)
    assert h.status_code == 200 and h.json()["instances"]["decode"] == {"d0": "ok", "d1": "ok"}
    assert all(any(g["path"] == "/health" for g in f.gets) for f in fakes)


# ------------------------------------------------------------- the flags
def _args(*argv: str):
    from kvlens.cli import build_parser

    return build_parser().parse_args(["proxy", *argv])


def test_repeated_flags_pair_by_position():
    from proxy.cli import check, config

    args = _args(
        "--mode",
        "push",
        "--prefill",
        "http://h:1/",
        "--prefill",
        "https://h2:2",
        "--decode",
        "http://d:3",
        "--prefill-side-port",
        "5600",
        "--prefill-side-port",
        "5601",
        "--prefill-tp-size",
        "2",
    )
    cfg = config(args)
    check(cfg)
    assert [(p.url, p.engine_id, p.side_port, p.tp_size, p.side_host) for p in cfg.prefills] == [
        ("http://h:1", "p0", 5600, 2, "127.0.0.1"),
        ("https://h2:2", "p1", 5601, 2, "127.0.0.1"),
    ]
    assert cfg.decodes == [Decode("http://d:3", "d0")]
    named = config(
        _args(
            "--mode",
            "pull",
            "--prefill",
            "http://a:1",
            "--prefill",
            "http://b:1",
            "--decode",
            "http://d:1",
            "--prefill-engine-id",
            "pa",
            "--prefill-engine-id",
            "pb",
        )
    )
    assert [p.engine_id for p in named.prefills] == ["pa", "pb"]


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--prefill-engine-id", "p0"], "--prefill-engine-id given 1 times for 2 --prefill"),
        (["--prefill-side-port", "5600"], "--prefill-side-port given 1 times for 2 --prefill"),
        (
            ["--prefill-side-host", "a", "--prefill-side-host", "b", "--prefill-side-host", "c"],
            "--prefill-side-host given 3 times for 2 --prefill (give it 1 or 2 times",
        ),
        (["--decode-engine-id", "d0", "--decode-engine-id", "d1"], "--decode-engine-id given 2 times for 1 --decode"),
        (["--prefill-engine-id", "x", "--prefill-engine-id", "x"], "prefill engine ids must be distinct"),
        ([], "overlapped push needs --prefill-side-port"),
    ],
)
def test_mismatched_flags_are_refused_before_serving(capsys, extra, words):
    from kvlens.cli import main

    rc = main(
        [
            "proxy",
            "--mode",
            "push",
            "--prefill",
            "http://a:1",
            "--prefill",
            "http://b:1",
            "--decode",
            "http://d:1",
            *extra,
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlens proxy: error:") and words in err


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:8100", "ftp://h:1", "http://", "http://h:99999", "http://h:x", "http://h:1?q=1"]
)
def test_bad_urls_are_usage_errors(capsys, bad):
    from kvlens.cli import main

    with pytest.raises(SystemExit) as e:
        main(["proxy", "--mode", "pull", "--prefill", bad, "--decode", "http://d:1"])
    assert e.value.code == 2
    assert "argument --prefill: not an http(s)://host:port URL" in capsys.readouterr().err
