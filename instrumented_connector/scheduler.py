"""Scheduler-side hooks: vLLM's push / pull NIXL connector schedulers with timestamps.

Thread: every hook here runs on the EngineCore busy loop. Each override calls
vLLM's method unchanged and records around it; a failure inside kvlens is
logged once and skipped (:func:`hooks.fail`), while vLLM's own exceptions
pass through untouched (docs/architecture.md, "telemetry never breaks its
host"). Recording is a timestamp and an append to the process's recorder.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler, NixlPushConnectorScheduler

from instrumented_connector import hooks
from kvrecord import semconv as sc
from kvrecord.openhandoffs import table_for
from instrumented_connector.hooks import TIMEOUT_AT, NullRecorder, Pending, fail, nblocks, now, sample, timeout_attrs

P = sc.Phase
OP = sc.OpenPhase
_AWAITING_READ, _READING, _AWAITING_KV = OP.AWAITING_READ.value, OP.READING.value, OP.AWAITING_KV.value


def _recomputed(scheduler_output, rid: str, scheduled: int) -> int:
    """Prompt tokens D computes itself for ``rid`` from this step on (its first
    after the KV arrived): the prompt minus the tokens whose KV is in place
    (``NewRequestData.num_computed_tokens``: the transfer's, or fewer where
    vLLM's recompute policy dropped blocks that failed to load); the tokens
    scheduled this step when the request is not among the new ones."""
    for r in scheduler_output.scheduled_new_reqs:
        if r.req_id == rid and r.prompt_token_ids is not None:
            return max(0, len(r.prompt_token_ids) - r.num_computed_tokens)
    return scheduled


class _SchedulerHooks:
    """Scheduler-side hooks common to push and pull. Thread: the EngineCore busy loop."""

    _kvl: Any = NullRecorder()
    _kvl_table: Any = None  # this side's open-handoff table (kvrecord.openhandoffs), None: not tracked
    #: open phases the scheduler tracks, by role (the worker tracks push P's)
    _KVL_OWN: dict[str, tuple[sc.OpenPhase, ...]] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # All hook state exists before vLLM can call a hook.
        self._kvl_loaded = Pending()  # D: rid whose KV arrived, not yet scheduled -> None
        self._kvl_sched = Pending()  # D: rid -> (ns its first step after the KV was scheduled, tokens recomputed)
        self._kvl_flagged = Pending()  # D: rid whose KV came after the registration watchdog -> its span attributes

    def _kvl_setup(self, rec) -> None:
        """Connect the recorder and this side's open-handoff table (called once, after ``__init__``)."""
        self._kvl = rec
        try:
            own = self._KVL_OWN.get(getattr(rec, "role", None), ())
            if own and hasattr(rec, "add_periodic"):
                t = table_for(rec.mode, rec.role)
                t.own(own)
                self._kvl_table = t
        except Exception:
            fail("open-handoff table")

    # -- open handoffs (docs/handoff-health.md) ---------------------------------------
    def _kvl_d_ended(self, request) -> None:
        """D's request finished (or was aborted) while its handoff was still
        open: the KV never arrived. Its kv.ready ends now, ``timeout`` when
        the registration watchdog had fired, else ``failed``."""
        t = self._kvl_table
        rid = request.request_id
        if not t.is_open(rid):
            return  # the usual case: its KV arrived
        flags = t.flags(rid)
        timed_out = bool(flags and flags.get(sc.ATTR_REGISTRATION_TIMEOUT))
        outcome = sc.Outcome.TIMEOUT.value if timed_out else sc.Outcome.FAILED.value
        if t.close(rid, outcome) is None:
            return
        attrs = timeout_attrs(flags, now())
        attrs[sc.ATTR_ERROR] = (
            "push registration timed out; the request ended before its KV arrived"
            if timed_out
            else "the request ended before its KV arrived"
        )
        self._kvl.point(P.KV_READY, rid, outcome, attrs)

    # -- D's first decode step (the end of the TTFT the engines prove) -------
    # A step: schedule() ends with build_connector_meta, the model runs, then
    # update_from_output ends with update_connector_output. The request's KV
    # arrived in one step's output (finished_recving); the next step that
    # schedules it samples its first token, seen at that step's output.
    def build_connector_meta(self, scheduler_output):
        sample()  # once per engine step: the EngineCore thread's CPU readings stay dense (kvrecord.cpuclock)
        meta = super().build_connector_meta(scheduler_output)
        loaded = self._kvl_loaded
        if loaded:
            try:
                n = scheduler_output.num_scheduled_tokens
                t = None
                for rid in [r for r in loaded if r in n]:
                    del loaded[rid]
                    t = t or now()
                    self._kvl_sched.put(rid, (t, _recomputed(scheduler_output, rid, n[rid])))
            except Exception:
                fail("build_connector_meta")
        return meta

    def update_connector_output(self, connector_output):
        res = super().update_connector_output(connector_output)
        try:
            sched = self._kvl_sched
            if sched:
                t = now()
                for rid, (t0, recomputed) in sched.items():
                    attrs = {sc.ATTR_KV_RECOMPUTED_TOKENS: recomputed, sc.ATTR_BLOCK_SIZE: self.block_size}
                    if self._kvl_flagged:  # the KV came after push's registration watchdog fired
                        attrs.update(self._kvl_flagged.pop(rid, None) or ())
                    self._kvl.record(P.DECODE_FIRST_STEP, rid, t0, max(t, t0), "ok", attrs)
                sched.clear()
            for rid in connector_output.finished_recving or ():
                self._kvl_loaded.put(rid, None)
            t = self._kvl_table
            if t is not None:
                failed = connector_output.failed_recving or ()
                for rid in connector_output.finished_recving or ():
                    if t.is_flagged(rid):  # the worker's kv.ready may be in another process: flag D's first step
                        self._kvl_flagged.put(rid, timeout_attrs(t.flags(rid), now()))
                    t.close(rid, sc.Outcome.FAILED.value if rid in failed else sc.Outcome.OK.value)
                # vLLM freed these blocks: nothing is pinned any more (the
                # worker counted the outcome where it runs in this process)
                for rid in connector_output.finished_sending or ():
                    t.close(rid, None)
        except Exception:
            fail("update_connector_output")
        return res

    def request_finished(self, request, block_ids):
        """P: prefill (arrival -> now) and the prefill.finished point."""
        params = request.kv_transfer_params
        is_p = bool(params and params.get("do_remote_decode"))
        res = super().request_finished(request, block_ids)
        if is_p:
            try:
                t = now()
                delay = bool(res and res[0])
                rid = request.request_id
                attrs = {sc.ATTR_BLOCKS: nblocks(block_ids), sc.ATTR_TOKENS: request.num_prompt_tokens}
                arrival = getattr(request, "arrival_time", None)
                if arrival:
                    self._kvl.record(P.PREFILL, rid, min(int(arrival * 1e9), t), t, "ok", attrs)
                self._kvl.record(P.PREFILL_FINISHED, rid, t, t, "ok" if delay else "failed", attrs)
                if delay and self._kvl_table is not None:
                    self._kvl_table.open(rid, _AWAITING_READ, t, attrs[sc.ATTR_BLOCKS])
            except Exception:
                fail("request_finished")
        elif self._kvl_table is not None:
            try:
                self._kvl_d_ended(request)
            except Exception:
                fail("request_finished")
        return res

    def _kvl_alloc(self, phase: P, host, request, blocks, num_external_tokens):
        """Shared body of ``update_state_after_alloc``: call vLLM's ``host``
        method, then record ``phase`` when D staged blocks for a remote prefill."""
        params = request.kv_transfer_params
        staged = bool(params and params.get("do_remote_prefill") and num_external_tokens > 0)
        res = host(request, blocks, num_external_tokens)
        if staged:
            self._kvl_after_alloc(phase, request, blocks, params)
        return res

    def _kvl_after_alloc(self, phase, request, blocks, params) -> None:
        """Record ``phase`` (a point) and ``decode.queue``: the request's
        arrival on D (``Request.arrival_time``, wall clock, stamped by D's
        frontend) -> now, the same instant as the point."""
        try:
            t = now()
            rid = request.request_id
            # Pull joins D to P by the request id P returned (any router);
            # push by D's own id, which P's matching already requires.
            join = params.get("remote_request_id") if phase is P.ALLOC else None
            attrs = {
                sc.ATTR_REMOTE_ENGINE_ID: params.get("remote_engine_id"),
                sc.ATTR_TOKENS: request.num_prompt_tokens,
                sc.ATTR_JOIN_REQUEST_ID: join,
            }
            try:
                attrs[sc.ATTR_BLOCKS] = nblocks(blocks.get_block_ids())
            except Exception:
                pass
            arrival = getattr(request, "arrival_time", None)
            if arrival:
                self._kvl.record(
                    P.DECODE_QUEUE,
                    rid,
                    min(int(arrival * 1e9), t),
                    t,
                    "ok",
                    {sc.ATTR_TOKENS: request.num_prompt_tokens, sc.ATTR_JOIN_REQUEST_ID: join},
                )
            self._kvl.record(phase, rid, t, t, "ok", attrs)
            if self._kvl_table is not None:
                self._kvl_table.open(
                    rid, _READING if phase is P.ALLOC else _AWAITING_KV, t, attrs.get(sc.ATTR_BLOCKS) or 0, join=join
                )
        except Exception:
            fail("update_state_after_alloc")


class InstrumentedNixlPushConnectorScheduler(_SchedulerHooks, NixlPushConnectorScheduler):
    _KVL_OWN = {sc.Role.DECODE.value: (OP.AWAITING_KV,)}

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """D: registration.stage point (and decode.queue up to it) once destination blocks are staged."""
        return self._kvl_alloc(
            P.REGISTRATION_STAGE, super().update_state_after_alloc, request, blocks, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output):
        """D: registrations the watchdog drops (:meth:`_kvl_watchdog`)."""
        return self._kvl_watchdog(super().build_connector_meta, scheduler_output)

    def _kvl_watchdog(self, host, scheduler_output):
        """Call vLLM's ``host`` (push ``build_connector_meta``) and flag the
        registrations its soft watchdog drops. The request keeps waiting in
        vLLM, so its handoff stays open, flagged ``registration_timeout``:
        its kv.ready comes when the KV arrives or the request ends
        (:meth:`_kvl_d_ended`). Untracked (no table): kv.ready ``timeout`` now."""
        # The stock watchdog drops registrations past their deadline inside
        # this call; find them first (the dict is deadline-ordered, so the
        # head tells whether anything expired: O(1) on the common path).
        expired = ()
        try:
            d = self._push_registration_deadlines
            if d:
                t = time.perf_counter()
                if next(iter(d.values())) <= t:
                    expired = [rid for rid, dl in d.items() if dl <= t]
        except Exception:
            fail("build_connector_meta")
        meta = host(scheduler_output)
        if expired:
            try:
                t, at = self._kvl_table, now()
                for rid in expired:
                    if t is not None:
                        t.count_registration_timeout()
                        if t.flag(rid, sc.ATTR_REGISTRATION_TIMEOUT, True):
                            t.flag(rid, TIMEOUT_AT, at)
                            continue
                    self._kvl.point(P.KV_READY, rid, "timeout", {sc.ATTR_ERROR: "push registration timed out"})
            except Exception:
                fail("build_connector_meta")
        return meta


class InstrumentedNixlPullConnectorScheduler(_SchedulerHooks, NixlPullConnectorScheduler):
    _KVL_OWN = {sc.Role.DECODE.value: (OP.READING,), sc.Role.PREFILL.value: (OP.AWAITING_READ,)}

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """D: alloc point (and decode.queue up to it) once blocks for the remote prefill are allocated."""
        return self._kvl_alloc(P.ALLOC, super().update_state_after_alloc, request, blocks, num_external_tokens)


#: Phases this vLLM cannot record: their hook points are missing (pruned at import).
DISABLED: set[sc.Phase] = hooks.prune(
    InstrumentedNixlPushConnectorScheduler,
    NixlPushConnectorScheduler,
    hooks.SCHEDULER_HOOKS["NixlPushConnectorScheduler"],
) | hooks.prune(
    InstrumentedNixlPullConnectorScheduler,
    NixlPullConnectorScheduler,
    hooks.SCHEDULER_HOOKS["NixlPullConnectorScheduler"],
)
