"""What a stack checks before it starts a child (:func:`preflight`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from kvrecord import config as kvconfig
from kvlens.model import ensure_model
from kvlens.stack.commands import check_model, find_vllm_router
from kvlens.stack.errors import StackError, StackInputError
from kvlens.stack.instances import VLLM_ROUTER_METRICS_PORT, VLLM_ROUTER_PORT, more_ports
from kvlens.stack.leftovers import busy_hint, find_leftovers
from kvlens.stack.ports import assign_ports

logger = logging.getLogger("kvlens.up")

#: Ports a stack picks itself when not given (in this order).
AUTO_PORTS = ("router port", "prefill port", "decode port", "prefill side-channel port", "decode side-channel port")


def preflight(stack) -> None:
    """A :class:`~kvlens.stack.launch.Stack`'s checks that need no child:
    the model directory (made when not given), vllm-router installed when
    asked for, Prometheus, leftovers of earlier stacks (named, never
    stopped), and every port (given ones free, the others picked). Fills the
    stack's ports. Raises StackInputError for what the command line names
    and cannot be used (the model, a tool not installed), StackError for a busy port."""
    if stack.model is None:
        stack.model = ensure_model(kvconfig.model_dir({"kvlens_home": str(stack.kvlens_home)}))
    try:
        stack.model = check_model(Path(stack.model))
        if "vllm-router" in stack.routers:
            find_vllm_router()  # not installed: say so before minutes of vLLM start-up
    except StackInputError:
        raise
    except StackError as e:
        raise StackInputError(str(e)) from None
    named = {
        "router port": stack.port,
        "prefill port": stack.prefill_port,
        "decode port": stack.decode_port,
        "prefill side-channel port": stack.prefill_side_port,
        "decode side-channel port": stack.decode_side_port,
    }
    if stack.prometheus:
        named["prometheus port"] = stack.prometheus_port
        if shutil.which("prometheus") is None and not Path("/usr/bin/prometheus").exists():
            raise StackInputError(
                "--prometheus needs the prometheus binary: apt-get install prometheus (make setup does it)"
            )
    more = more_ports(
        stack.prefill_instances,
        stack.decode_instances,
        stack.routers,
        stack.vllm_router_port,
        stack.vllm_router_metrics_port,
    )
    named.update(more)
    auto = (*AUTO_PORTS, *more)
    if stack.separate_homes and stack.collector == "process":
        named["collector port"] = stack.collector_port
        auto = (*auto, "collector port")
    left = find_leftovers(Path(stack.kvlens_home) / "runs")
    for lo in left:  # named, never stopped: they may be someone else's
        (logger.warning if stack.quiet else stack.say)(f"warning: {lo.line()}")
    try:
        got = assign_ports(named, stack.host, auto)
    except StackError as e:  # a busy port: say what holds it when we know
        raise StackError(busy_hint(str(e), left)) from None
    stack.port, stack.prefill_port, stack.decode_port, stack.prefill_side_port, stack.decode_side_port = (
        got[k] for k in AUTO_PORTS
    )
    stack.collector_port = got.get("collector port")
    stack.more_ports = {k: got[k] for k in more}
    if "vllm-router" in stack.routers:  # alone, it takes the router port
        stack.vllm_router_port = got.get(VLLM_ROUTER_PORT) or stack.port
        stack.vllm_router_metrics_port = got[VLLM_ROUTER_METRICS_PORT]
