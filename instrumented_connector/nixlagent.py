"""NIXL's agent without its UCX progress thread: an experiment, never the default.

nixl's ``nixl_agent_config(enable_prog_thread=False)`` creates the agent
with no progress thread: UCX then progresses only from the agent's own calls
(vLLM's ``check_xfer_state`` / ``get_new_notifs`` on every engine step, its
posts). vLLM does not expose the flag: its worker builds the config in
``NixlBaseConnectorWorker.__init__`` from the ``nixl_agent_config`` its
module imported. With the connector option ``kvlens_nixl_progress_thread``
off (``kvlens up --nixl-progress off``), :func:`agent_config` swaps that
module name for one that adds ``enable_prog_thread=False`` (and nixl's
``STRICT`` lock, :func:`_strict_sync`), only while the worker's ``__init__``
runs, and puts vLLM's back after. Where the hook point
is missing (another vLLM or nixl), one warning and vLLM's own configuration.
What it does to the handoff on a small host: docs/links.md, "Without NIXL's
progress thread". ``tests/unit/test_hooks_contract.py`` pins the hook point.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator

from kvrecord.logutil import log_once

#: The module whose ``nixl_agent_config`` vLLM's worker __init__ calls, the name, and the flag.
HOOK_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
HOOK_NAME = "nixl_agent_config"
FLAG = "enable_prog_thread"
#: nixl's thread-safety mode of the agent (None: nixl's default, no lock without a listener thread)
SYNC = "sync_mode"

logger = logging.getLogger("kvlens")


def hook_point(module: ModuleType | None = None) -> tuple[ModuleType, Callable[..., Any]]:
    """vLLM's worker module and the config factory it calls; LookupError
    naming what is missing (the module, the name, or the flag)."""
    if module is None:
        try:
            module = importlib.import_module(HOOK_MODULE)
        except ImportError as e:
            raise LookupError(f"{HOOK_MODULE} not importable ({e})") from None
    factory = getattr(module, HOOK_NAME, None)
    if factory is None:
        raise LookupError(f"{module.__name__}.{HOOK_NAME} is missing (nixl not installed, or vLLM moved it)")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if FLAG not in params:
        raise LookupError(f"{module.__name__}.{HOOK_NAME} takes no {FLAG}")
    return module, factory


def _strict_sync(factory: Callable[..., Any], sig: inspect.Signature) -> Any:
    """nixl's ``NIXL_THREAD_SYNC_STRICT`` where the factory takes ``sync_mode``, else None.

    Without the progress thread nothing serializes the agent's UCX worker:
    vLLM calls the agent from more than one thread (push D: the writer
    thread's ``send_notif`` beside the engine thread's ``check_xfer_state``),
    and with nixl's default for an agent without a listener (``NONE``: no
    lock) push D's worker died in ``uct_tcp_ep_am_zcopy`` under ``genNotif``
    on its first request (docs/links.md). ``STRICT`` takes the agent's lock
    around every call."""
    if SYNC not in sig.parameters:
        return None
    enum = getattr(sys.modules.get(getattr(factory, "__module__", "") or ""), "nixl_thread_sync_t", None)
    return getattr(enum, "NIXL_THREAD_SYNC_STRICT", None)


class Outcome:
    """What :func:`agent_config` did: ``applied`` (configs built without the
    thread while vLLM's __init__ ran), or ``reason`` why not."""

    def __init__(self) -> None:
        self.applied = 0
        self.reason: str | None = None


@contextmanager
def agent_config(progress_thread: bool, module: ModuleType | None = None) -> Iterator[Outcome]:
    """Around vLLM's worker ``__init__``: with ``progress_thread`` false, the
    NIXL agent it creates has no progress thread. True: nothing is touched.
    Never raises on its own account: a missing hook point is one warning and
    vLLM's own configuration."""
    out = Outcome()
    if progress_thread:
        yield out
        return
    try:
        mod, factory = hook_point(module)
    except LookupError as e:
        out.reason = str(e)
        log_once("nixl-prog-thread", "kvlens_nixl_progress_thread off ignored: %s; NIXL keeps vLLM's agent config", e)
        yield out
        return
    sig = inspect.signature(factory)
    strict = _strict_sync(factory, sig)

    def without_thread(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind_partial(*args, **kwargs)
            bound.arguments[FLAG] = False
            if strict is not None and bound.arguments.get(SYNC) is None:
                bound.arguments[SYNC] = strict
            args, kwargs = bound.args, bound.kwargs
        except TypeError:  # vLLM's own call is wrong: let the factory say so
            return factory(*args, **kwargs)
        out.applied += 1
        return factory(*args, **kwargs)

    setattr(mod, HOOK_NAME, without_thread)
    try:
        yield out
    finally:
        if getattr(mod, HOOK_NAME, None) is without_thread:
            setattr(mod, HOOK_NAME, factory)
    if out.applied:
        logger.info("kvlens: NIXL agent created without its progress thread (kvlens_nixl_progress_thread off)")
    else:
        out.reason = f"vLLM's worker did not call {HOOK_NAME}"
        log_once("nixl-prog-thread", "kvlens_nixl_progress_thread off ignored: %s", out.reason)
