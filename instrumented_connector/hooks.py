"""Hook-point contract: which private vLLM methods kvlens overrides, for which
phase, and the check that disables a phase when its hook point is missing;
plus the small helpers every hook class shares (no vLLM import here).

vLLM's NIXL internals are private and move between releases. At import the
instrumented classes (:mod:`~instrumented_connector.scheduler`,
:mod:`~instrumented_connector.worker`) drop every override whose base method
is gone (so vLLM never calls into a half-hooked path); at start-up the
connector logs one warning naming the disabled phases.
``tests/unit/test_hooks_contract.py`` pins the supported vLLM versions
against this table.
"""

from __future__ import annotations

import time
from typing import Final

from kvrecord.cpuclock import CLOCK
from kvrecord.logutil import log_once
from kvrecord import semconv as sc
from kvrecord.semconv import Phase

SUPPORTED_VLLM: Final = ("0.32", "0.33")
"""vLLM minor versions whose NIXL layout this table was checked against."""

# (base class name, method) -> phases that depend on it.
SCHEDULER_HOOKS: Final[dict[str, dict[str, tuple[Phase, ...]]]] = {
    "NixlPushConnectorScheduler": {
        "request_finished": (Phase.PREFILL, Phase.PREFILL_FINISHED),
        "update_state_after_alloc": (Phase.REGISTRATION_STAGE, Phase.DECODE_QUEUE),
        # registration-timeout outcome; D's first step after the KV arrived
        "build_connector_meta": (Phase.KV_READY, Phase.DECODE_FIRST_STEP),
        "update_connector_output": (Phase.DECODE_FIRST_STEP,),
    },
    "NixlPullConnectorScheduler": {
        "request_finished": (Phase.PREFILL, Phase.PREFILL_FINISHED),
        "update_state_after_alloc": (Phase.ALLOC, Phase.DECODE_QUEUE),
        "build_connector_meta": (Phase.DECODE_FIRST_STEP,),
        "update_connector_output": (Phase.DECODE_FIRST_STEP,),
    },
}

WORKER_COMMON_HOOKS: Final[dict[str, tuple[Phase, ...]]] = {
    "get_transfer_results": (Phase.KV_READY,),
    "_pop_done_transfers": (Phase.WRITE_COMPLETE, Phase.READ_COMPLETE),
    "_reap_expired_send_leases": (Phase.WRITE_COMPLETE,),
}

WORKER_HOOKS: Final[dict[str, dict[str, tuple[Phase, ...]]]] = {
    "NixlPushConnectorWorker": {
        **WORKER_COMMON_HOOKS,
        "_send_registration_to_p": (Phase.REGISTRATION_SEND,),
        "_do_send_reg_notif": (Phase.REGISTRATION_SEND,),
        "_pop_matching_finished_blocks": (Phase.REGISTRATION_RECEIVE, Phase.MATCH),
        "_pop_matching_registration": (Phase.MATCH, Phase.WRITER_WAKE),
        "start_load_kv": (Phase.WRITER_WAKE,),  # finished blocks queued for the writer (engine thread)
        "_do_start_push_kv": (Phase.HANDSHAKE,),
        "_xfer_blocks_for_req": (Phase.DESCRIPTOR_PREP, Phase.WRITE_POST),
        "_xfer_blocks": (Phase.WRITE_POST,),
    },
    "NixlPullConnectorWorker": {
        **WORKER_COMMON_HOOKS,
        "_background_nixl_handshake": (Phase.HANDSHAKE,),
        "_read_blocks_for_req": (Phase.DESCRIPTOR_PREP, Phase.READ_POST, Phase.HANDSHAKE),
        "_read_blocks": (Phase.READ_POST,),
        "_get_new_notifs": (Phase.KV_RELEASED,),
    },
}

#: Instance attributes read (never written) by the hooks, per base class.
WORKER_ATTRS: Final = ("nixl_wrapper", "_recving_transfers")
PUSH_SCHEDULER_ATTRS: Final = ("_push_registration_deadlines",)

#: Handoff-health signals (docs/handoff-health.md) -> the vLLM worker instance
#: attributes they read, checked once at set-up: a missing one disables that
#: signal with one warning. ``stale`` replays vLLM's own "unrecognized
#: request" test (``req_id not in _reqs_to_send and not in _reqs_to_process``)
#: at the moment vLLM makes it; push D also wraps ``_pending_completion_notifs``
#: (a ``queue.Queue``) to see which notification vLLM just took.
HEALTH_ATTRS: Final[dict[str, dict[str, tuple[str, ...]]]] = {
    "NixlPullConnectorWorker": {"stale": ("_reqs_to_send", "_reqs_to_process", "nixl_wrapper")},
    "NixlPushConnectorWorker": {
        "stale": ("_reqs_to_send", "_reqs_to_process", "_recving_metadata", "_pending_completion_notifs"),
        "unmatched_registration": ("_pending_d_registrations",),
    },
}


def missing_attrs(obj, signals: dict[str, tuple[str, ...]]) -> set[str]:
    """The signals of ``signals`` that ``obj`` lacks an attribute for (one warning each)."""
    off = set()
    for signal, attrs in signals.items():
        gone = [a for a in attrs if not hasattr(obj, a)]
        if gone:
            off.add(signal)
            log_once(
                "health-attr:" + signal,
                "this vLLM lacks %s; handoff-health signal %r is disabled (supported vLLM: %s)",
                ", ".join(gone),
                signal,
                ", ".join(SUPPORTED_VLLM),
            )
    return off


def all_hooks() -> dict[str, dict[str, tuple[Phase, ...]]]:
    return {**SCHEDULER_HOOKS, **WORKER_HOOKS}


def prune(cls: type, base: type, hooks: dict[str, tuple[Phase, ...]]) -> set[Phase]:
    """Remove from ``cls`` each override whose hook point ``base`` lacks.

    Returns the phases disabled as a result. Idempotent."""
    disabled: set[Phase] = set()
    for name, phases in hooks.items():
        if not callable(getattr(base, name, None)):
            if name in cls.__dict__:
                delattr(cls, name)
            disabled.update(phases)
    return disabled


# ------------------------------------------------------------ shared helpers
#: Hooks' clock: wall-clock ns, what the recorder and the store expect; where
#: schedstat can be read, each call also reads the calling thread's CPU
#: counters (:mod:`kvrecord.cpuclock`: the CPU figures of every phase).
now = CLOCK.now if CLOCK.enabled else time.time_ns


def _no_sample() -> None:
    pass


#: A CPU reading of the calling thread without a timestamp: once per engine
#: step, so every thread's readings lie close before any phase's start.
sample = CLOCK.sample if CLOCK.enabled else _no_sample

#: Cap on per-request bookkeeping kept between hooks (entries, not bytes).
PENDING_CAP = 8192


class Pending(dict):
    """Insertion-ordered dict with a size cap: the oldest entry goes first.

    Entries for requests whose second hook never fires (aborts) must not
    accumulate forever. Each instance is used by one thread (the hook's)."""

    def put(self, key, value) -> None:
        if len(self) >= PENDING_CAP:
            try:
                del self[next(iter(self))]
            except (StopIteration, KeyError, RuntimeError):
                pass
        self[key] = value

    def put_first(self, key, value) -> None:
        if key not in self:
            self.put(key, value)


class NullRecorder:
    """Stands in for the recorder before setup, or when its setup failed."""

    dropped = 0

    def start(self) -> "NullRecorder":
        return self

    def record(self, *a, **k) -> None:
        pass

    def point(self, *a, **k) -> None:
        pass

    # no add_periodic: no background thread, so no health publisher either


def nblocks(block_ids) -> int:
    """Logical block count over cache groups (BlockIds or a flat list)."""
    if not block_ids:
        return 0
    first = block_ids[0]
    if isinstance(first, (list, tuple)):
        return sum(len(g) for g in block_ids)
    return len(block_ids)


#: Flag key of an open handoff (not a span attribute): when push's
#: registration watchdog fired, wall-clock ns (exporters.handoffhealth reads it too).
TIMEOUT_AT: Final = "_registration_timeout_at_ns"


def timeout_attrs(flags: dict | None, t_ns: int) -> dict:
    """Span attributes of an open handoff's registration-timeout flags at
    ``t_ns``: the flag, and how long D has waited since the watchdog fired."""
    if not flags or not flags.get(sc.ATTR_REGISTRATION_TIMEOUT):
        return {}
    at = flags.get(TIMEOUT_AT) or t_ns
    return {sc.ATTR_REGISTRATION_TIMEOUT: True, sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S: max(t_ns - at, 0) / 1e9}


def fail(key: str) -> None:
    """Log a failed hook once (with its traceback); the phase is skipped."""
    log_once("hook:" + key, "hook %s failed; this phase is skipped", key, exc_info=True)
