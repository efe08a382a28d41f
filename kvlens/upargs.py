"""``kvlens up``'s command line: every flag, its type and its help
(:func:`add_arguments`); :mod:`kvlens.up` checks and runs them."""

from __future__ import annotations

import argparse
from pathlib import Path

from frontdoor.flags import add_api_key_arguments
from kvrecord.ports import DEFAULT_HOST
from kvrecord.argtypes import from_parser, int_in, port_arg, positive
from kvlens.stack.commands import DEFAULT_KV_LEASE_S, DEFAULT_PUSH_REGISTRATION_TIMEOUT_S, DEFAULT_TIMEOUT_S
from kvlens.stack.errors import StackError
from proxy.split import parse_split
from kvlens.stack.instances import MAX_INSTANCES, ROUTERS, parse_modes, parse_routers
from kvlens.stack.spinners import MODES as SPIN_MODES
from kvlens.stack.tp import MAX_TP, STARTUP_S_PER_EXTRA_PROCESS, parse_tp
from kvrecord.location import StoreLocation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        type=_MODES,
        required=True,
        metavar="push|pull|push,pull",
        help="KV handoff protocol; push,pull: a mixed fleet (a canary), push pairs and pull pairs behind "
        "one kvlens router that draws each request's mode (kvlens proxy --split, default push=0.5; "
        "live: POST /admin/split); --prefill-instances / --decode-instances then count per mode",
    )
    p.add_argument(
        "--dispatch",
        choices=["overlapped", "sequential"],
        default="overlapped",
        help="push only: send D its request at once (overlapped) or after P answers (sequential)",
    )
    p.add_argument(
        "--split",
        type=_SPLIT,
        default=None,
        metavar="push=W",
        help="with --mode push,pull: the router's push weight at start (pull=W: pull's; default push=0.5); "
        "change it live with POST /admin/split on the router",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model dir (default: generated tiny model in $KVLENS_HOME/model)"
    )
    p.add_argument(
        "--port", type=port_arg(allow_zero=True), default=8000, help="router port (default 8000; 0: a free one)"
    )
    p.add_argument(
        "--prefill-port",
        type=port_arg(allow_zero=True),
        default=None,
        help="the first P's HTTP port (default: a free one; the other P always get free ones)",
    )
    p.add_argument(
        "--decode-port",
        type=port_arg(allow_zero=True),
        default=None,
        help="the first D's HTTP port (default: a free one; the other D always get free ones)",
    )
    _add_count_arguments(p)
    _add_tp_arguments(p)
    _add_router_arguments(p)
    _add_push_arguments(p)
    _add_topology_arguments(p)


def _add_count_arguments(p: argparse.ArgumentParser) -> None:
    """How many P and D (per mode in a mixed fleet)."""
    p.add_argument(
        "--prefill-instances",
        type=int_in(1, MAX_INSTANCES, "a number of instances"),
        default=1,
        metavar="N",
        help=f"how many P to start, engine ids p0..p(N-1) (default 1, at most {MAX_INSTANCES}); per mode "
        "with --mode push,pull (push's first, then pull's)",
    )
    p.add_argument(
        "--decode-instances",
        type=int_in(1, MAX_INSTANCES, "a number of instances"),
        default=1,
        metavar="M",
        help=f"how many D to start, engine ids d0..d(M-1) (default 1, at most {MAX_INSTANCES}); per mode "
        "with --mode push,pull",
    )


def _add_router_arguments(p: argparse.ArgumentParser) -> None:
    """Which routers front the stack, where, and the stack's logs, timeout and Prometheus."""
    p.add_argument(
        "--router",
        type=_ROUTERS,
        default=("kvlens",),
        metavar="|".join(ROUTERS),
        help="which router(s) to start in front of P and D: kvlens (default), vllm-router (vLLM's own, "
        "pull only, pip package vllm-router), or both: kvlens,vllm-router",
    )
    p.add_argument(
        "--vllm-router-port",
        type=port_arg(),
        default=None,
        help="vllm-router's port next to kvlens' router (default: a free one; alone it takes --port)",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="bind address for all servers (default loopback). Any other address needs $KVLENS_TOKEN "
        "(the router and the collector ask for it) or an API key (--api-key: P, D and the router; not the "
        "collector), or --insecure; P's NIXL side channel stays open to everyone who can reach the host",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow --host beyond loopback, or --hosts, with no token and no API key (anyone who reaches "
        "it may use it)",
    )
    p.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help="file holding the bearer token the router and the collector ask for, instead of $KVLENS_TOKEN "
        "(sudo drops the environment); every child gets it in its environment, never on a command line. "
        "At least 16 characters",
    )
    _add_engine_arguments(p)
    p.add_argument("--log-dir", type=Path, default=None, help="where child logs and stack.json go")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=None,
        help=f"seconds to wait for readiness (default {DEFAULT_TIMEOUT_S:g} for one P and one D, plus "
        f"{STARTUP_S_PER_EXTRA_PROCESS:g} per further engine process: every instance, and every TP "
        "rank, is one)",
    )
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a Prometheus server (Debian package prometheus) scraping router, P and D, "
        "with the kvlens recording rules and exemplar storage; data under the log dir",
    )
    p.add_argument("--prometheus-port", type=port_arg(), default=9090, help="Prometheus port (default 9090)")


def _add_push_arguments(p: argparse.ArgumentParser) -> None:
    """P's KV lease and push's registration timeout."""
    p.add_argument(
        "--kv-lease",
        type=positive(int),
        default=DEFAULT_KV_LEASE_S,
        metavar="S",
        help=f"vLLM kv_lease_duration: how long P keeps a request's KV for D (default {DEFAULT_KV_LEASE_S}; vLLM's own default is 30)",
    )
    p.add_argument(
        "--push-registration-timeout",
        type=positive(int),
        default=DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
        metavar="S",
        help=f"vLLM push_registration_timeout on D (default {DEFAULT_PUSH_REGISTRATION_TIMEOUT_S}; vLLM's own default is 480)",
    )


def _add_topology_arguments(p: argparse.ArgumentParser) -> None:
    """Separate homes and the collector (the cross-host layout on one host), and the API key."""
    p.add_argument(
        "--separate-homes",
        action="store_true",
        help="run P, D and the router as if on three hosts: each with its own KVLENS_HOME "
        "(<home>/hosts/<role>, its own trace store) and every span sent over OTLP/HTTP to one "
        "collector, where traces join and the handoff is corrected for the P/D clock offset; "
        "vLLM's own request spans go there too (--otlp-traces-endpoint)",
    )
    p.add_argument(
        "--collector",
        choices=["process", "router"],
        default="process",
        help="with --separate-homes: a `kvlens collect` process (default) or the router hosting "
        "the receiver (`kvlens proxy --collect`)",
    )
    p.add_argument(
        "--collector-port",
        type=port_arg(),
        default=None,
        help="with --separate-homes and --collector process: its port (default: a free one)",
    )
    p.add_argument(
        "--collector-store",
        type=_STORE,
        metavar="STORE",
        help="with --separate-homes and --collector process: the collector's trace store, a path or "
        "a postgresql://user@host:port/db URL shared by the fleet (default: the SQLite file in "
        "the collector's home)",
    )
    _add_network_arguments(p)
    add_api_key_arguments(
        p,
        "what P, D (vLLM's --api-key, handed over as VLLM_API_KEY) and the router require on /v1/*; "
        "the stack's own health checks and warm-up send it",
    )


def _add_network_arguments(p: argparse.ArgumentParser) -> None:
    """The roles' network namespaces, their links and the store's own host (docs/links.md)."""
    p.add_argument(
        "--hosts",
        action="store_true",
        help="every role in its own network namespace (each P, each D, the router, the collector, the store), "
        "joined by veths on a bridge, addresses in 198.18.0.0/15, no route out; NIXL over TCP on "
        "those links. Root only; needs ip, tc, iptables-legacy (docs/links.md)",
    )
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="A-B=DELAY[,JITTER][,RATE][,LOSS]",
        help="with --hosts: shape the link between roles p, d, router, collector, store, client (A-B: both "
        "directions, A>B: one), e.g. p-d=20ms,200mbit or p-d=2ms,1ms,10gbit,0.1%%; measured at start "
        "(stack.json's network.links). Repeatable",
    )
    p.add_argument(
        "--store-command",
        metavar="CMD",
        default=None,
        help="with --hosts and --collector-store postgresql://USER@store:PORT/DB: run CMD, the database "
        "server in the foreground (e.g. postgres -D DIR -c listen_addresses='*'), in a network namespace "
        "of its own, before the collector and stopped after it; the host `store` in the URL becomes that "
        "namespace's address (docs/links.md)",
    )


_STORE = from_parser(StoreLocation.parse, ValueError)  #: argparse ``type=`` of ``--collector-store``
_ROUTERS = from_parser(parse_routers, StackError)
_SPLIT = from_parser(parse_split, ValueError)  #: argparse ``type=`` of ``--split``
_MODES = from_parser(
    lambda text: ",".join(parse_modes(text)), StackError
)  #: argparse ``type=`` of ``--mode``  #: argparse ``type=`` of ``--router``
_TP_SIZES = from_parser(parse_tp, ValueError)  #: argparse ``type=`` of ``--prefill-tp`` / ``--decode-tp``


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """What kvlens up sets in the engines it starts besides their sizes."""
    p.add_argument("--stock", action="store_true", help="use vLLM's own NIXL connectors (no kvlens telemetry)")
    p.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        default=None,
        help="D's vLLM kv_load_failure_policy: fail the request when its KV does not arrive (vLLM's "
        "default) or recompute the prompt on D (kvlens then marks and counts the request: "
        "kvlens_kv_recomputed_total)",
    )
    p.add_argument(
        "--nixl-progress",
        choices=SPIN_MODES,
        default="auto",
        help="NIXL's UCX progress thread in every vLLM worker polls with timeout 0 and takes a whole CPU "
        "when it runs. idle: SCHED_IDLE once its server is up (it runs only when its CPU has "
        "nothing else to do); startup: idle only until every server is up, then as vLLM runs it; "
        "as-is: never touched; auto (default): idle when the engine processes (one per TP rank) "
        "outnumber the CPUs, else startup. Stock and instrumented stacks alike. off (an experiment, kvlens' "
        "connector only): each worker's NIXL agent is created without the thread, so UCX progresses only "
        "from vLLM's own calls (docs/links.md, 'Without NIXL's progress thread')",
    )
    p.add_argument(
        "--sched-trace",
        action="store_true",
        help="keep the kernel's scheduler record (sched_switch/sched_wakeup on every CPU, in a tracefs instance; root) "
        "in <log dir>/sched once the stack is ready, so `kvlens traces --sched <log dir>/sched` splits "
        "every phase into CPU work, CPU wait and off-CPU along its critical path, across threads and "
        "processes (docs/phases.md, 'The kernel's record'). --sched-buffer-mb of kernel memory in all, the newest "
        "kept",
    )
    p.add_argument(
        "--sched-buffer-mb",
        type=int_in(1, 65536, "a size in MiB"),
        default=128,
        help="with --sched-trace: the kernel memory the record may take, MiB in all, shared out per CPU "
        "(default 128: about three minutes of a serving 1P1D pair on 2 CPUs, about 100 s of a mixed fleet; "
        "older events are overwritten)",
    )


def _add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=int_in(1, MAX_TP, "a tensor-parallel size"),
        default=1,
        metavar="N",
        help="tensor-parallel size of every P and D (vLLM's --tensor-parallel-size; each rank gets its "
        f"own CPU list, docs/tensor-parallel.md; default 1, at most {MAX_TP})",
    )
    p.add_argument(
        "--prefill-tp",
        type=_TP_SIZES,
        default=None,
        metavar="N[,N...]",
        help="P's tensor-parallel size, overriding --tp: one for all P, or one per P in engine-id order",
    )
    p.add_argument(
        "--decode-tp",
        type=_TP_SIZES,
        default=None,
        metavar="N[,N...]",
        help="D's tensor-parallel size, overriding --tp: one for all D, or one per D (--decode-tp 2,1: "
        "d0 at TP 2, d1 at TP 1)",
    )
