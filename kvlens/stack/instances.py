"""A stack's P and D instances and its routers: names, engine ids, port
names, and which routers run (``kvlens``, ``vllm-router`` or both). Pure.

Naming, kept from the one-pair stack so that its callers (logs, tests,
``stack.json`` readers) see nothing new: the first P is the child
``prefill`` (engine id ``p0``, log ``prefill.log``), the first D
``decode`` (``d0``); the others are ``prefill-p1``, ``decode-d1``, ...
Engine ids are ``p0..p{N-1}`` and ``d0..d{M-1}``, as ``kvlens proxy``
defaults them.

A mixed fleet (``kvlens up --mode push,pull``): N P and M D per mode,
numbered on: push's first (``p0..p{N-1}``, ``d0..d{M-1}``), then pull's
(``pN..p{2N-1}``, ``dM..d{2M-1}``); every instance names its mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvlens.stack.errors import StackError

#: Most P (and most D) instances one stack starts: each is a whole vLLM
#: server (~1-2 GiB and a CPU on a CPU host); more is a cluster, not a stack.
MAX_INSTANCES = 8
ROLES = ("prefill", "decode")
ROUTERS = ("kvlens", "vllm-router")
MODES = ("push", "pull")


def parse_modes(spec: str | Iterable[str]) -> tuple[str, ...]:
    """``"push"``, ``"pull"`` or ``"push,pull"`` (a mixed fleet) as a tuple
    in :data:`MODES` order; StackError on an unknown, repeated or empty one."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    got = [x.strip().lower() for x in items if x.strip()]
    if not got or any(m not in MODES for m in got) or len(set(got)) != len(got):
        raise StackError(f"mode must be push, pull or push,pull (a mixed fleet), got {spec!r}")
    return tuple(m for m in MODES if m in got)


def engine_id(role: str, index: int) -> str:
    """``p<index>`` or ``d<index>``."""
    return f"{'p' if role == 'prefill' else 'd'}{index}"


def child_name(role: str, index: int) -> str:
    """``prefill`` / ``decode`` for the first, ``prefill-p1`` ... after."""
    return role if index == 0 else f"{role}-{engine_id(role, index)}"


def port_names(role: str, index: int) -> tuple[str, str]:
    """(HTTP port name, NIXL side-channel port name) as errors name them."""
    who = role if index == 0 else engine_id(role, index)
    return f"{who} port", f"{who} side-channel port"


VLLM_ROUTER_PORT = "vllm-router port"
VLLM_ROUTER_METRICS_PORT = "vllm-router metrics port"


def more_ports(
    n_prefill: int,
    n_decode: int,
    routers: tuple[str, ...],
    vllm_router_port: int | None = None,
    vllm_router_metrics_port: int | None = None,
) -> dict[str, int | None]:
    """The ports a stack needs beyond the first P's and D's and kvlens'
    router's, by name (None: pick a free one): every later instance's HTTP
    and side-channel ports, and vLLM's router's (its own port only next to
    kvlens' router: alone it takes the router port) and its metrics port."""
    out: dict[str, int | None] = {}
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        for i in range(1, n):
            out.update(dict.fromkeys(port_names(role, i)))
    if "vllm-router" in routers:
        if "kvlens" in routers:
            out[VLLM_ROUTER_PORT] = vllm_router_port
        out[VLLM_ROUTER_METRICS_PORT] = vllm_router_metrics_port
    return out


def check_count(what: str, n: int) -> int:
    """``n`` when it is 1..:data:`MAX_INSTANCES`, else StackError naming ``what``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_INSTANCES:
        raise StackError(f"{what} must be 1..{MAX_INSTANCES}, got {n!r}")
    return n


def parse_routers(spec: str | Iterable[str]) -> tuple[str, ...]:
    """``"kvlens"``, ``"vllm-router"``, ``"kvlens,vllm-router"`` (or a list)
    as a tuple in :data:`ROUTERS` order; StackError on an unknown or empty one."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    got = {x.strip() for x in items if x.strip()}
    bad = sorted(got - set(ROUTERS))
    if bad or not got:
        raise StackError(
            f"router must be one or both of {', '.join(ROUTERS)} (comma-separated), got "
            f"{','.join(items) if not isinstance(spec, str) else spec!r}"
        )
    return tuple(r for r in ROUTERS if r in got)


def check_routers(routers: tuple[str, ...], mode: str, api_key: str | None, separate: bool, collector: str) -> None:
    """What vLLM's router cannot do, refused before anything starts (StackError)."""
    if "vllm-router" not in routers:
        return
    if mode != "pull":
        raise StackError(
            "--router vllm-router needs --mode pull: vLLM's router sends P first, then D with P's "
            "kv_transfer_params (NIXL pull); it cannot tell D about P in advance as a push needs"
        )
    if api_key:
        raise StackError(
            "--router vllm-router with an API key: vllm-router takes the workers' key only on its "
            "command line (--api-key), where every user of the host can read it (ps); kvlens keeps "
            "keys off command lines. Unset --api-key / KVLENS_API_KEY / VLLM_API_KEY"
        )
    if "kvlens" not in routers and separate and collector == "router":
        raise StackError("--collector router needs kvlens' router (--router kvlens or kvlens,vllm-router)")


@dataclass(frozen=True)
class Instance:
    """One vLLM server of a stack, as callers see it (ports None until
    chosen, ``pid`` None until started: the pid of its guard, which leads
    its process group)."""

    role: str
    index: int
    host: str
    port: int | None
    side_port: int | None
    pid: int | None = None
    #: tensor-parallel size (ranks)
    tp: int = 1
    #: its handoff mode (push / pull)
    mode: str = "push"

    @property
    def engine_id(self) -> str:
        return engine_id(self.role, self.index)

    @property
    def name(self) -> str:
        return child_name(self.role, self.index)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def record(self) -> dict:
        """What ``stack.json`` keeps of it."""
        return {
            "name": self.name,
            "engine_id": self.engine_id,
            "url": self.url,
            "port": self.port,
            "side_channel_port": self.side_port,
            "pid": self.pid,
            "tp_size": self.tp,
            "mode": self.mode,
        }
