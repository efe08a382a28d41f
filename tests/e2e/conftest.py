"""Shared fixtures: one real P/D stack per (mode, connector) for the whole
session, and at most one alive at a time (2 cores, 24 GiB: two pairs at once
starve each other). Asking for a different stack stops the current one, so
keep tests that use the same stack in the same module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stack_settings import FAULT_KV_LEASE_S, FAULT_REGISTRATION_TIMEOUT_S


class StackManager:
    """Starts stacks on demand and keeps only the last one alive."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.current_key: tuple | None = None
        self.current = None
        self.failed: dict[tuple, str] = {}

    def get(self, mode: str, stock: bool = False, dispatch: str = "overlapped", **stack_kw):
        """The stack for this key; ``stack_kw`` (e.g. short vLLM timeouts for
        fault tests) are ``Stack`` fields and part of the key."""
        from kvlens.stack.errors import StackError
        from kvlens.stack.launch import Stack

        key = (mode, stock, dispatch, tuple(sorted((k, repr(v)) for k, v in stack_kw.items())))
        if key in self.failed:
            pytest.fail(f"stack {key} failed to start earlier: {self.failed[key]}")
        if self.current_key == key and self.current is not None:
            dead = self.current.dead_child()
            if dead is None:
                return self.current
        self.stop()
        stack = Stack(
            mode=mode,
            dispatch=dispatch,
            model=self.model(),
            port=0,
            stock=stock,
            kvlens_home=self.home,
            log_dir=self.home / "runs" / f"{mode}-{'stock' if stock else 'instr'}-{dispatch}{_tag(stack_kw)}",
            quiet=True,
            **stack_kw,
        )
        try:
            # several instances / TP ranks start slower: the stack's own default grows with them
            stack.start(timeout=max(float(os.environ.get("KVLENS_TEST_STACK_TIMEOUT", "420")), stack.default_timeout_s))
        except StackError as e:
            self.failed[key] = str(e)
            pytest.fail(f"could not start {key} stack: {e}")
        self.current_key, self.current = key, stack
        return stack

    def model(self) -> Path:
        from kvlens.model import ensure_model

        return ensure_model(self.home / "model")

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
        self.current, self.current_key = None, None


def _tag(stack_kw: dict) -> str:
    if stack_kw.get("prefill_tp", 1) != 1 or stack_kw.get("decode_tp", 1) != 1:
        return "-tp"
    if stack_kw.get("separate_homes"):
        return "-fleet"
    if stack_kw.get("prefill_instances", 1) > 1 or stack_kw.get("decode_instances", 1) > 1:
        return f"-{stack_kw.get('prefill_instances', 1)}p{stack_kw.get('decode_instances', 1)}d"
    return "-faults" if stack_kw else ""


#: D's wall clock in the "three hosts" stacks, against P's and the router's
#: (tests/e2e/clockshift/sitecustomize.py shifts it; nothing else moves).
FLEET_CLOCK_SHIFT_S = {"push": 0.25, "pull": -0.25}
_CLOCKSHIFT_DIR = Path(__file__).resolve().parent / "clockshift"


#: The push fleet's collector token (``kvlens collect`` wants it; P, D and the router send it).
FLEET_TOKEN = "e2e-fleet-token-7d41"


def fleet_stack_kw(mode: str, collector_store: str | None = None) -> dict:
    """P, D and the router with their own homes, spans over OTLP to one
    collector (push: a ``kvlens collect`` process, writing ``collector_store``
    when given (a PostgreSQL URL); pull: hosted by the router, writing its
    home's SQLite file), and D's clock shifted by FLEET_CLOCK_SHIFT_S[mode].

    Push: the collector wants :data:`FLEET_TOKEN` (``$KVLENS_TOKEN``). P and
    D send it from ``$KVLENS_TOKEN`` (the connector's exporter) and from the
    standard ``$OTEL_EXPORTER_OTLP_HEADERS`` (vLLM's own ``llm_request``
    exporter reads only that); the router from ``$OTEL_EXPORTER_OTLP_HEADERS``
    alone (read by the SDK itself)."""
    clock = {"PYTHONPATH": str(_CLOCKSHIFT_DIR), "KVLENS_TEST_CLOCK_SHIFT_S": str(FLEET_CLOCK_SHIFT_S[mode])}
    role_env: dict[str, dict[str, str]] = {"decode": clock}
    if mode == "push":
        header = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{FLEET_TOKEN}"}
        engine = {"KVLENS_TOKEN": FLEET_TOKEN, **header}
        role_env = {
            "collector": {"KVLENS_TOKEN": FLEET_TOKEN},
            "prefill": engine,
            "decode": {**clock, **engine},
            "router": header,
        }
    return {
        "separate_homes": True,
        "collector": "process" if mode == "push" else "router",
        **({"collector_store": collector_store} if collector_store else {}),
        "role_env": role_env,
    }


@pytest.fixture(scope="session")
def stack_factory(kvlens_home, tiny_model):
    mgr = StackManager(kvlens_home)
    yield mgr
    mgr.stop()


@pytest.fixture
def push_stack(stack_factory):
    """Instrumented push pair, overlapped router."""
    return stack_factory.get("push")


#: the instrumented pull pair's settings (the bench grid reuses that pair)
PULL_STACK_KW = {"kv_load_failure_policy": "recompute"}


@pytest.fixture
def pull_stack(stack_factory):
    """Instrumented pull pair; D recomputes KV that fails to load (vLLM's
    ``kv_load_failure_policy: recompute``; tests/e2e/test_e2e_kv_use.py
    makes a load fail; a request whose KV arrives is served the same)."""
    return stack_factory.get("pull", **PULL_STACK_KW)


@pytest.fixture
def stock_push_stack(stack_factory):
    """vLLM's own NixlPushConnector (baseline / greedy-equality tests)."""
    return stack_factory.get("push", stock=True)


@pytest.fixture
def stock_pull_stack(stack_factory):
    """vLLM's own NixlConnector (baseline / greedy-equality tests)."""
    return stack_factory.get("pull", stock=True)


@pytest.fixture
def fault_push_stack(stack_factory):
    """Instrumented push pair with short registration timeout and KV lease.
    Its tests may kill D, so nothing else shares it."""
    return stack_factory.get(
        "push", push_registration_timeout_s=FAULT_REGISTRATION_TIMEOUT_S, kv_lease_s=FAULT_KV_LEASE_S
    )


@pytest.fixture
def fault_pull_stack(stack_factory):
    """Instrumented pull pair with the fault tests' short KV lease
    (tests/e2e/test_e2e_health.py freezes D past it, then kills P: the
    pair ends with that module, so nothing else shares it)."""
    return stack_factory.get("pull", kv_lease_s=FAULT_KV_LEASE_S)


@pytest.fixture
def fault_prometheus(tmp_path, fault_table):
    """``start(stack)``: a real Prometheus scraping the stack's P and D every
    second, with the recording rules and a test copy of the shipped alert
    rules (``for:`` cut to 5 s, bounds as shipped; fault_harness). Stopped
    after the test."""
    import fault_harness as fh
    from exporters.prometheus_server import rules_path

    started = []

    def start(stack):
        alerts = rules_path().parent / "alert_rules.yml"
        if not alerts.is_file():
            pytest.fail(f"no alert rules at {alerts} (issue 37, item 6)")
        targets = {
            "vllm-prefill": [stack.prefill_url.split("://")[1]],
            "vllm-decode": [stack.decode_url.split("://")[1]],
        }
        server, shortened = fh.start_prometheus(targets, tmp_path / f"prometheus-{len(started)}", alerts)
        started.append(server)
        fault_table.append({"fault": "(prometheus)", "shortened": shortened})
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def fault_table(kvlens_home):
    """Rows of the fault-detection table (fault_harness.Detect.row), written
    to ``$KVLENS_HOME/fault-detection.json`` and printed at the end."""
    import json

    rows: list[dict] = []
    yield rows
    faults = [r for r in rows if r.get("fault") != "(prometheus)"]
    if faults:
        (kvlens_home / "fault-detection.json").write_text(json.dumps(rows, indent=1) + "\n")
        print("\nfault detection (s after the fault):")
        for r in faults:
            print("  " + json.dumps(r))


#: The push fleet's PostgreSQL port, in the stack's ``store`` namespace (a network stack of its own: always free).
FLEET_PG_PORT = 5432


def _need_hosts(queue: bool) -> None:
    """Skip unless ``kvlens up --hosts`` can run here (root; ip, tc, iptables-legacy; fnfqueue for ``queue``)."""
    from kvlens.stack.errors import StackError
    from kvlens.stack.netns import check_tools

    if os.geteuid() != 0:
        pytest.skip("--hosts needs root")
    try:
        check_tools(need_queue=queue)
    except StackError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def fleet_pg(stack_factory):
    """The push fleet's shared store on a "host" of its own: a PostgreSQL
    cluster of its own (tests/pg_server.py) that the stack runs in its
    ``store`` namespace (``store_command``: docs/links.md). Its database is
    made here on loopback first; its owner must give a password
    (``pg_server.PW_USER``) and the URL holds it, as a user may type it: the
    stack must pass it on without showing it (tests/e2e/test_e2e_fleet.py).
    The host ``store`` stands for the namespace's address. Yields (URL, the
    postmaster's argv)."""
    from pg_server import PW_USER, PgServer, missing_reason

    if why := missing_reason():
        pytest.skip(why)
    pg = PgServer(net="198.18.0.0/15")
    try:
        pg.init().start()
        url, password = pg.new_password_database("fleet")
        pg.stop()  # from here on the stack runs it, in its namespace
        db = url.rsplit("/", 1)[1]
        argv = pg.postmaster_argv(port=FLEET_PG_PORT, listen="*")
        yield f"postgresql://{PW_USER}:{password}@store:{FLEET_PG_PORT}/{db}", argv
    finally:
        cur = stack_factory.current
        if cur is not None and cur.store_command:
            stack_factory.stop()  # the server stops with its stack, before its directory goes
        pg.remove()


@pytest.fixture
def fleet_push_stack(stack_factory, fleet_pg):
    """ "Three hosts" push on real network stacks: the collector (``kvlens
    collect``), PostgreSQL, P, D and the router each in its own network
    namespace (``hosts``), separate homes, the collector writing the store
    PostgreSQL database, D's clock +0.25 s."""
    _need_hosts(queue=False)
    url, argv = fleet_pg
    return stack_factory.get("push", hosts=True, store_command=tuple(argv), **fleet_stack_kw("push", url))


@pytest.fixture
def links_stack(stack_factory):
    """ "Three hosts" pull on real links (docs/links.md): every role in its own
    network namespace (``hosts``), separate homes, receiver in the router, D's
    clock -0.25 s, and P<->D and router<->D through delayers (no delay at
    start; the test re-shapes them). It replaced the loopback "three hosts" pull stack: its
    checks run on this one (tests/e2e/test_e2e_links.py)."""
    from kvlens.stack.errors import StackError
    from kvlens.stack.netns import check_tools

    if os.geteuid() != 0:
        pytest.skip("--hosts needs root")
    try:
        check_tools(need_queue=True)
    except StackError as e:
        pytest.skip(str(e))
    return stack_factory.get("pull", hosts=True, links=("p-d=0ms", "router-d=0ms"), **fleet_stack_kw("pull"))


#: ``KVLENS_TEST_TP=0``: the xPyD stack at TP 1 everywhere (its TP checks skip).
TP_ON = os.environ.get("KVLENS_TEST_TP") != "0"


@pytest.fixture(scope="module", params=["pull", "push"])
def xpyd_stack(request, stack_factory):
    """2 P + 2 D instances (real vLLM), p0 and d0 at TP 2 (rank i on CPU
    i), p1 and d1 at TP 1 (all at TP 1 when ``KVLENS_TEST_TP=0``), once per
    mode (module scope: the module's tests run per mode, one start each):
    push behind kvlens' router (overlapped); pull behind kvlens' router and
    vLLM's ``vllm-router``. The TP 1 instances start after the TP 2 ones
    (:func:`kvlens.stack.tp.start_waves`)."""
    mode = request.param
    routers = "kvlens,vllm-router" if mode == "pull" else "kvlens"
    tp = {"prefill_tp": (2, 1), "decode_tp": (2, 1)} if TP_ON else {}
    return stack_factory.get(mode, prefill_instances=2, decode_instances=2, routers=routers, **tp)


# Stack start-ups dominate the suite's time (~1-2 min each on 2 cores). Run
# the e2e tests grouped by the stack they need, so each pair starts once:
# stock push, fleet push, stock pull, the fault pairs (push, then pull),
# fleet pull on real links, instrumented pull, the bench grid (it takes the
# pull pair still up, then starts the instrumented push pair that the next
# group uses), instrumented push, xPyD with TP, then the tests that drive
# stacks themselves (the demo, whose live fleet carries the canary checks; SIGTERM).
_STACK_ORDER = (
    "stock_push_stack",
    "fleet_push_stack",
    "stock_pull_stack",
    "fault_push_stack",
    "fault_pull_stack",
    "links_stack",
    "pull_stack",
    "grid_run",
    "push_stack",
    "xpyd_stack",
)


def _stack_group(item) -> int:
    if item.get_closest_marker("e2e") is None:
        return 0
    names = getattr(item, "fixturenames", ())
    for i, fx in enumerate(_STACK_ORDER, start=1):
        if fx in names:
            return i
    return len(_STACK_ORDER) + 1


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_stack_group)  # stable: module order kept within a group


@pytest.fixture(scope="session")
def greedy_outputs():
    """Greedy completions per (mode, connector), shared across tests."""
    return {}
