"""``kvlens bench --link`` (kvlens/bench/links.py): the flag's checks, the
link each row records, and the mixed fleet both modes share on one stack
(a fake router standing in for it: tests/fakes.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from kvlens.bench.grid import BenchError, plan_groups
from kvlens.bench.links import check_link_args, link_record, stack_link
from kvlens.bench.load import one_request
from kvlens.bench.report import link_lines
from kvlens.bench.runner import bench_stacks, new_run, stack_targets
from fakes import FakeRouter
from test_bench import _cli, _opts, tiny_tokenizer_dir  # noqa: F401 (a fixture)

#: ``Net.to_json()["links"]`` of a stack with ``p-d=20ms`` and ``router>d=5ms``, P<->D probed, router>d not yet.
NET_LINKS = [
    {"src": "p0", "dst": "d0", "asked": {"delay_s": 0.02, "jitter_s": 0.0, "rate_bps": 2e8, "loss": 0.0,
     "rtt_s": 0.04}, "measured": {"rtt_s": 0.0408, "rtt_min_s": 0.0405, "echoes_lost": 0, "goodput_bps": 1.9e8}},
    {"src": "d0", "dst": "p0", "asked": {"delay_s": 0.02, "jitter_s": 0.0, "rate_bps": 2e8, "loss": 0.0,
     "rtt_s": 0.04}, "measured": {"rtt_s": 0.0412, "rtt_min_s": 0.0409, "echoes_lost": 0, "goodput_bps": 1.8e8}},
    {"src": "router", "dst": "d0", "asked": {"delay_s": 0.005, "jitter_s": 0.0, "rate_bps": None, "loss": 0.0,
     "rtt_s": 0.005}, "measured": None},
]  # fmt: skip
SPECS = ["p-d=20ms,200mbit", "router>d=5ms"]


# ------------------------------------------------------------ the flag's checks
@pytest.mark.parametrize(
    "links, proxy, words",
    [
        (["p-d=20ms"], "http://127.0.0.1:1", "a running router's (--proxy) links are not ours to change"),
        (["p-d"], None, "want A-B=SHAPE"),
        (["p-d=fast"], None, "is not a time"),
        (["p-x=1ms"], None, "the ends must be two of"),
        (["p-d=1ms", "p>d=2ms"], None, "given twice"),
        (["p-collector=1ms"], None, "names collector, which a kvlens bench stack does not run"),
    ],
)
def test_bad_link_args_name_the_problem(links, proxy, words):
    with pytest.raises(BenchError) as e:
        check_link_args(links, proxy, check_tools=False)
    assert words in str(e.value)


def test_good_link_args_pass_and_none_is_nothing():
    assert check_link_args([], "http://x") == ()
    assert check_link_args(SPECS, None, check_tools=False) == tuple(SPECS)


def test_link_without_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(BenchError, match="--link: --hosts needs root"):
        check_link_args(["p-d=1ms"], None)


def test_link_without_tools_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda *a, **k: None)
    with pytest.raises(BenchError, match="iproute2"):
        check_link_args(["p-d=1ms"], None)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--link", "p-d=1ms", "--proxy", "http://127.0.0.1:9"], "not ours to change"),
        (["--link", "p-d=1parsec"], "is not a time"),
    ],
)
def test_cli_link_errors_exit_2_before_anything_starts(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    assert _cli(*argv) == 2
    err = capsys.readouterr().err
    assert "kvlens bench: error:" in err and words in err
    assert not (tmp_path / "model").exists()  # nothing generated, nothing started


def test_help_explains_link(capsys):
    with pytest.raises(SystemExit):
        _cli("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "--link SPEC" in out and "p-d=20ms,200mbit" in out and "mixed fleet" in out


# ---------------------------------------------------------- the row's link
def test_link_record_keeps_asked_and_measured_and_unknown_as_none():
    rec = link_record(SPECS, NET_LINKS)
    assert rec["spec"] == SPECS
    pd = rec["directions"][0]
    assert (pd["src"], pd["dst"], pd["asked_delay_s"], pd["asked_rate_bps"]) == ("p0", "d0", 0.02, 2e8)
    assert (pd["rtt_s"], pd["goodput_bps"], pd["asked_rtt_s"]) == (0.0408, 1.9e8, 0.04)
    rd = rec["directions"][2]
    assert rd["asked_delay_s"] == 0.005 and rd["rtt_s"] is None and rd["goodput_bps"] is None
    # the summary: per spec the median of its directions' measured round trips, "not measured" where none was
    assert rec["summary"] == (
        "p-d=20ms,200mbit: round trip 41.2 ms (asked 40), goodput 190 Mbit/s; router>d=5ms: round trip not measured (asked 5)"
    )
    json.dumps(rec)  # goes into JSON rows and the store


class _Net:
    def to_json(self):
        return {"links": NET_LINKS}


class _Instance:
    def __init__(self, url):
        self.url = url


class FakeMixedStack:
    """A started mixed ``hosts`` fleet: push pair first (p0/d0), pull pair (p1/d1), one router."""

    made: list = []

    def __init__(self, router_url="http://r", **kw):
        self.kw, self.router_url, self.net, self.stopped = kw, router_url, _Net(), False
        self.decodes = [_Instance("http://d0"), _Instance("http://d1")]
        FakeMixedStack.made.append(self)

    def mode_of(self, role, i):
        return ("push", "pull")[i]

    def start(self):
        self.reshaped = []

    def reshape(self, spec, probe=True):
        self.reshaped.append(spec)

    def probe_links(self):
        self.probed = list(self.reshaped)

    def add_router(self, d):
        raise AssertionError("a mixed fleet gets one router")

    def stop(self):
        self.stopped = True


def test_stack_targets_of_a_mixed_fleet_name_their_half_and_carry_the_link(tmp_path):
    opts = replace(_opts(tmp_path, None), links=tuple(SPECS))
    pull, push = stack_targets(FakeMixedStack(), "push,pull", ["overlapped"], opts)
    assert (pull.mode, pull.dispatch, pull.decode_url, pull.force_mode) == ("pull", None, "http://d1", True)
    assert (push.mode, push.dispatch, push.decode_url, push.force_mode) == ("push", "overlapped", "http://d0", True)
    assert pull.url == push.url == "http://r"
    assert pull.link == push.link == link_record(SPECS, NET_LINKS)
    assert stack_link(object(), SPECS) is None  # not a hosts stack: no link record


def test_plan_groups_mixes_only_both_modes_with_one_dispatch():
    assert plan_groups(["push", "pull"], ["overlapped"], mixed=True) == [("push,pull", ["overlapped"])]
    assert plan_groups(["push", "pull"], ["overlapped", "sequential"], mixed=True)[0] == ("pull", [None])
    assert plan_groups(["pull"], ["overlapped"], mixed=True) == [("pull", [None])]
    assert plan_groups(["push", "pull"], ["overlapped"]) == [("pull", [None]), ("push", ["overlapped"])]


def test_one_request_names_its_mode_in_the_header(tmp_path):
    import httpx

    seen = []

    def answer(request):
        seen.append(request.headers.get("x-kvlens-mode"))
        return httpx.Response(200, text='data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n')

    async def go(mode):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as c:
            return await one_request(c, "http://r", None, "p", 1, "a" * 32, None, mode)

    assert asyncio.run(go("push")).ok and asyncio.run(go(None)).ok
    assert seen == ["push", None]


def test_bench_with_links_runs_both_modes_on_one_mixed_hosts_stack(tmp_path, tiny_tokenizer_dir):  # noqa: F811
    opts = replace(_opts(tmp_path, tiny_tokenizer_dir, warmup=0, input_lens=[16]), links=tuple(SPECS))
    FakeMixedStack.made.clear()
    with FakeRouter(opts.store, "pull") as fake:
        run = bench_stacks(
            ["push", "pull"],
            ["overlapped"],
            opts,
            run=new_run(opts),
            stack_factory=lambda **kw: FakeMixedStack(router_url=fake.url, **kw),
        )
        seen = list(fake.modes_seen)
    (stack,) = FakeMixedStack.made  # one stack for both modes
    assert stack.kw["mode"] == "push,pull" and stack.kw["hosts"] is True
    # started unshaped (the pairs' NIXL handshakes before any delay), then shaped as asked and probed
    assert stack.kw["links"] == ("p-d=0ms", "router>d=0ms") and stack.probed == SPECS
    assert stack.stopped
    assert sorted(set(seen)) == ["pull", "push"] and None not in seen  # every request named its half
    rows = run.rows
    assert sorted(r["mode"] for r in rows) == ["pull", "push"]
    for r in rows:
        assert r["link"] == link_record(SPECS, NET_LINKS) and r["completed"] == opts.num_prompts
    push = next(r for r in rows if r["mode"] == "push")
    assert push["handoff_p50_push_over_pull"] == pytest.approx(1.0)  # the fake's handoff is the same for both
    saved = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(r["link"]["spec"] == SPECS for r in saved)
    assert link_lines(rows) == [f"links (measured by the stack's probe): {rows[0]['link']['summary']}"]


def test_rows_on_unshaped_links_say_nothing_about_links():
    assert link_lines([{"link": None}, {}]) == []
