"""Instrumented NIXL connectors: vLLM's own push / pull facades, with kvlens recording.

The facades here build the instrumented scheduler (:mod:`~instrumented_connector.scheduler`)
or worker (:mod:`~instrumented_connector.worker`) for their role, as vLLM's own
facades do, and connect it to the process's recorder
(:func:`exporters.pipeline.get_recorder`). Every hook calls vLLM's method
unchanged and records around it; a failure inside kvlens is logged once and
skipped, while vLLM's own exceptions pass through untouched.

Load with stock vLLM::

    --kv-transfer-config '{"kv_connector": "InstrumentedNixlPushConnector",
                           "kv_connector_module_path": "instrumented_connector", ...}'
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlBaseConnector, NixlPullConnector, NixlPushConnector

from exporters import handoffhealth
from exporters.pipeline import get_recorder
from instrumented_connector import hooks, nixlagent, scheduler, worker
from kvrecord import semconv as sc
from kvrecord.config import Options
from instrumented_connector.cputap import CpuRecorder, watch_new_threads, watch_upstream
from instrumented_connector.hooks import NullRecorder
from kvrecord.logutil import log_once
from kvrecord.cpuclock import thread_ids
from kvrecord.recorder import Recorder
from instrumented_connector.scheduler import (
    InstrumentedNixlPullConnectorScheduler,
    InstrumentedNixlPushConnectorScheduler,
)
from instrumented_connector.worker import InstrumentedNixlPullConnectorWorker, InstrumentedNixlPushConnectorWorker

__all__ = [
    "DISABLED",
    "InstrumentedNixlConnector",
    "InstrumentedNixlPullConnector",
    "InstrumentedNixlPullConnectorScheduler",
    "InstrumentedNixlPullConnectorWorker",
    "InstrumentedNixlPushConnector",
    "InstrumentedNixlPushConnectorScheduler",
    "InstrumentedNixlPushConnectorWorker",
]

#: Phases this vLLM cannot record (their hook points are missing).
DISABLED: set[sc.Phase] = scheduler.DISABLED | worker.DISABLED


def _role(vllm_config) -> str:
    kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", None)
    return {"kv_producer": sc.Role.PREFILL.value, "kv_consumer": sc.Role.DECODE.value}.get(kv_role, sc.OTHER)


def _options(vllm_config) -> Options:
    """This engine's kvlens options; a bad one raises (strict at start)."""
    return Options.from_config(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _make_recorder(vllm_config, mode: str, engine_id: str, options: Options | None = None) -> Recorder | NullRecorder:
    """The process's started recorder, its handoff-health publisher attached
    (:mod:`exporters.handoffhealth`). A bad kvlens option raises (strict at start);
    any other setup failure disables telemetry with one warning."""
    options = _options(vllm_config) if options is None else options
    try:
        rec = get_recorder(_role(vllm_config), mode, engine_id, options).start()
    except Exception:
        log_once("recorder-init", "telemetry disabled: recorder setup failed", exc_info=True)
        return NullRecorder()
    try:
        handoffhealth.attach(rec, options.open_trace_after_s)
    except Exception:
        log_once("health-init", "handoff health disabled: setup failed", exc_info=True)
    return rec


def _warn_disabled() -> None:
    if DISABLED:
        log_once(
            "disabled-phases",
            "this vLLM lacks hook points for phases %s; they are not recorded (supported vLLM: %s)",
            sorted(p.value for p in DISABLED),
            ", ".join(hooks.SUPPORTED_VLLM),
        )


def _attach(connector: NixlBaseConnector, vllm_config, role, mode: str, sched_cls, worker_cls) -> None:
    """Build the instrumented scheduler / worker for ``role`` (as vLLM's own
    facade does) and connect them to this process's recorder."""
    _warn_disabled()
    options = _options(vllm_config)
    rec = CpuRecorder(_make_recorder(vllm_config, mode, connector.engine_id, options))
    # the parent's main thread: what this engine's threads wait on, blocked (the scheduler's: the API server)
    watch_upstream(frontend=role == KVConnectorRole.SCHEDULER)
    if role == KVConnectorRole.SCHEDULER:
        connector.connector_scheduler = sched_cls(vllm_config, connector.engine_id, connector.kv_cache_config)
        connector.connector_worker = None
        connector.connector_scheduler._kvl_setup(rec)
    elif role == KVConnectorRole.WORKER:
        connector.connector_scheduler = None
        before = thread_ids()  # NIXL's agent starts its progress thread in the worker's __init__
        # kvlens_nixl_progress_thread off: NIXL's agent without its progress thread (an experiment)
        with nixlagent.agent_config(options.nixl_progress_thread):
            connector.connector_worker = worker_cls(vllm_config, connector.engine_id, connector.kv_cache_config)
        connector.connector_worker._kvl_setup(rec)
        watch_new_threads(before)
    else:
        raise ValueError(f"Unsupported KVConnectorRole: {role}")


class InstrumentedNixlPushConnector(NixlPushConnector):
    """``NixlPushConnector`` with kvlens phase recording (push: P WRITEs)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        # Skip NixlPushConnector.__init__: it would build (and register with
        # NIXL) a stock worker that we would then throw away. Its only other
        # work is this check, repeated here; the contract test pins it.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        _attach(
            self,
            vllm_config,
            role,
            sc.Mode.PUSH.value,
            InstrumentedNixlPushConnectorScheduler,
            InstrumentedNixlPushConnectorWorker,
        )


class InstrumentedNixlPullConnector(NixlPullConnector):
    """``NixlPullConnector`` (= ``NixlConnector``) with kvlens phase recording (pull: D READs)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        _attach(
            self,
            vllm_config,
            role,
            sc.Mode.PULL.value,
            InstrumentedNixlPullConnectorScheduler,
            InstrumentedNixlPullConnectorWorker,
        )


InstrumentedNixlConnector = InstrumentedNixlPullConnector
