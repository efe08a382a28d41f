"""Instrumented NIXL connectors: vLLM's own push / pull classes with timestamps.

Every override calls vLLM's method unchanged and records around it; the
recording is wrapped so that a failure inside kvlens is logged once and
skipped, while vLLM's own exceptions pass through untouched (STYLE.md).
Which thread runs each hook is written next to it; all of them only take
``time.time_ns()`` and append to the per-process :class:`Recorder`.

Load with stock vLLM::

    --kv-transfer-config '{"kv_connector": "InstrumentedNixlPushConnector",
                           "kv_connector_module_path": "instrumented_connector", ...}'
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
    NixlPushConnector,
    NixlPushConnectorScheduler,
    NixlPushConnectorWorker,
)

from instrumented_connector import hooks
from instrumented_connector import semconv as sc
from instrumented_connector.recorder import Recorder, base_request_id, get_recorder, log_once

P = sc.Phase
logger = logging.getLogger("kvlens")
_now = time.time_ns

#: Cap on per-request bookkeeping kept between hooks (entries, not bytes).
_PENDING_CAP = 8192


class _Pending(dict):
    """Insertion-ordered dict with a size cap: the oldest entry goes first.

    Entries for requests whose second hook never fires (aborts) must not
    accumulate forever."""

    def put(self, key, value) -> None:
        if len(self) >= _PENDING_CAP:
            try:
                del self[next(iter(self))]
            except (StopIteration, KeyError, RuntimeError):
                pass
        self[key] = value

    def put_first(self, key, value) -> None:
        if key not in self:
            self.put(key, value)


class _NullRecorder:
    dropped = 0

    def start(self) -> "_NullRecorder":
        return self

    def record(self, *a, **k) -> None:
        pass

    def point(self, *a, **k) -> None:
        pass


def _role(vllm_config) -> str:
    kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", None)
    return {"kv_producer": sc.Role.PREFILL.value, "kv_consumer": sc.Role.DECODE.value}.get(kv_role, sc.OTHER)


def _make_recorder(vllm_config, mode: str, engine_id: str) -> Recorder | _NullRecorder:
    from exporters.pipeline import validate_config

    cfg = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    validate_config(cfg)  # strict at start: a bad kvlens option raises here
    try:
        return get_recorder(_role(vllm_config), mode, engine_id, cfg).start()
    except Exception:
        log_once("recorder-init", "telemetry disabled: recorder setup failed", exc_info=True)
        return _NullRecorder()


def _nblocks(block_ids) -> int:
    """Logical block count over cache groups (BlockIds or a flat list)."""
    if not block_ids:
        return 0
    first = block_ids[0]
    if isinstance(first, (list, tuple)):
        return sum(len(g) for g in block_ids)
    return len(block_ids)


def _fail(key: str) -> None:
    log_once("hook:" + key, "hook %s failed; this phase is skipped", key, exc_info=True)


# =============================================================== schedulers
class _SchedulerHooks:
    """Scheduler-side hooks. Thread: the EngineCore busy loop."""

    _kvl: Any = _NullRecorder()

    def _kvl_setup(self, rec) -> None:
        self._kvl = rec

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        is_p = bool(params and params.get("do_remote_decode"))
        res = super().request_finished(request, block_ids)
        if is_p:
            try:
                t = _now()
                delay = bool(res and res[0])
                rid = request.request_id
                attrs = {sc.ATTR_BLOCKS: _nblocks(block_ids), sc.ATTR_TOKENS: request.num_prompt_tokens}
                arrival = getattr(request, "arrival_time", None)
                if arrival:
                    self._kvl.record(P.PREFILL, rid, min(int(arrival * 1e9), t), t, "ok", attrs)
                self._kvl.record(P.PREFILL_FINISHED, rid, t, t, "ok" if delay else "failed", attrs)
            except Exception:
                _fail("request_finished")
        return res

    def _kvl_staged(self, request, num_external_tokens) -> bool:
        params = request.kv_transfer_params
        return bool(params and params.get("do_remote_prefill") and num_external_tokens > 0)

    def _kvl_after_alloc(self, phase, request, blocks, params) -> None:
        try:
            attrs = {sc.ATTR_REMOTE_ENGINE_ID: params.get("remote_engine_id"), sc.ATTR_TOKENS: request.num_prompt_tokens}
            try:
                attrs[sc.ATTR_BLOCKS] = _nblocks(blocks.get_block_ids())
            except Exception:
                pass
            self._kvl.point(phase, request.request_id, "ok", attrs)
        except Exception:
            _fail("update_state_after_alloc")


class InstrumentedNixlPushConnectorScheduler(_SchedulerHooks, NixlPushConnectorScheduler):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        staged = self._kvl_staged(request, num_external_tokens)
        params = request.kv_transfer_params
        res = super().update_state_after_alloc(request, blocks, num_external_tokens)
        if staged:
            self._kvl_after_alloc(P.REGISTRATION_STAGE, request, blocks, params)
        return res

    def build_connector_meta(self, scheduler_output):
        # The stock watchdog drops registrations past their deadline inside
        # this call; find them first (the dict is deadline-ordered, so the
        # head tells whether anything expired: O(1) on the common path).
        expired = ()
        try:
            d = self._push_registration_deadlines
            if d:
                now = time.perf_counter()
                if next(iter(d.values())) <= now:
                    expired = [rid for rid, dl in d.items() if dl <= now]
        except Exception:
            _fail("build_connector_meta")
        meta = super().build_connector_meta(scheduler_output)
        for rid in expired:
            try:
                self._kvl.point(P.KV_READY, rid, "timeout", {sc.ATTR_ERROR: "push registration timed out"})
            except Exception:
                _fail("build_connector_meta")
        return meta


class InstrumentedNixlPullConnectorScheduler(_SchedulerHooks, NixlPullConnectorScheduler):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        staged = self._kvl_staged(request, num_external_tokens)
        params = request.kv_transfer_params
        res = super().update_state_after_alloc(request, blocks, num_external_tokens)
        if staged:
            self._kvl_after_alloc(P.ALLOC, request, blocks, params)
        return res


# =================================================================== workers
class _NixlTap:
    """Transparent proxy over vLLM's NixlWrapper that remembers NIXL's own
    per-transfer telemetry (bytes, descriptors, duration) by handle, so the
    completion span can carry it. Everything else is forwarded untouched."""

    __slots__ = ("_inner", "_telemetry")

    def __init__(self, inner, telemetry: _Pending):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_telemetry", telemetry)

    def get_xfer_telemetry(self, handle):
        res = self._inner.get_xfer_telemetry(handle)
        try:
            if res is not None:
                self._telemetry.put(handle, (res.totalBytes, res.descCount, res.xferDuration))
        except Exception:
            _fail("get_xfer_telemetry")
        return res

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class _XferTimes(threading.local):
    """Per-thread timestamps of the transfer posts inside one request's call."""

    first: int | None = None
    last: int | None = None
    rank: int | None = None
    posted: int = 0
    failed: bool = False

    def reset(self) -> None:
        self.first = self.last = self.rank = None
        self.posted = 0
        self.failed = False


class _WorkerHooks:
    """Worker-side hooks common to push and pull."""

    _kvl: Any = _NullRecorder()
    _KVL_COMPLETE: P = P.WRITE_COMPLETE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # All hook state exists before vLLM can call a hook.
        self._kvl_tls = _XferTimes()
        self._kvl_post_end = _Pending()  # rid -> (post end ns, remote engine)
        self._kvl_hs_t0 = _Pending()  # rid -> handshake wait start ns
        self._kvl_failed: set[str] = set()
        self._kvl_xfer = _Pending()  # NIXL handle -> (bytes, descs, xfer us)

    def _kvl_setup(self, rec) -> None:
        """Connect the recorder and tap NIXL telemetry (called once, after __init__)."""
        self._kvl = rec
        try:
            self.nixl_wrapper = _NixlTap(self.nixl_wrapper, self._kvl_xfer)
        except Exception:
            _fail("nixl_wrapper")

    # -- engine thread -------------------------------------------------------
    def _pop_done_transfers(self, transfers):
        snap = None
        if transfers:
            try:
                snap = {rid: list(h) for rid, h in transfers.items()}
            except Exception:
                _fail("_pop_done_transfers")
        done, failed = super()._pop_done_transfers(transfers)
        if snap and (done or failed):
            try:
                self._kvl_done(transfers is self._recving_transfers, snap, done, failed)
            except Exception:
                _fail("_pop_done_transfers")
        return done, failed

    def _kvl_done(self, recv: bool, snap, done, failed) -> None:
        phase = P.READ_COMPLETE if recv else P.WRITE_COMPLETE
        self._kvl_failed.update(failed)
        t = _now()
        for rid in done:
            posted = self._kvl_post_end.pop(rid, None)
            if posted is None:
                continue  # nothing we posted (push D's notif-only entries)
            nbytes = ndesc = 0
            xfer_us = 0.0
            for h in snap.get(rid, ()):
                tel = self._kvl_xfer.pop(h, None)
                if tel is not None:
                    nbytes += tel[0]
                    ndesc += tel[1]
                    xfer_us += tel[2]
            outcome = "failed" if rid in self._kvl_failed else "ok"
            self._kvl_failed.discard(rid)
            self._kvl.record(
                phase,
                rid,
                posted[0],
                max(t, posted[0]),
                outcome,
                {
                    sc.ATTR_BYTES: nbytes,
                    sc.ATTR_DESCRIPTORS: ndesc,
                    sc.ATTR_NIXL_XFER_S: xfer_us / 1e6,
                    sc.ATTR_REMOTE_ENGINE_ID: posted[1],
                },
            )

    def _reap_expired_send_leases(self, done_sending):
        before = len(done_sending)
        snapshot = set(done_sending) if before else None
        res = super()._reap_expired_send_leases(done_sending)
        if len(done_sending) != before:
            try:
                for rid in set(done_sending) - (snapshot or set()):
                    self._kvl.point(self._KVL_COMPLETE, rid, "expired", {sc.ATTR_ERROR: "KV lease expired"})
            except Exception:
                _fail("_reap_expired_send_leases")
        return res

    def get_transfer_results(self):
        results = super().get_transfer_results()
        if results.finished_recving:
            try:
                failed = results.failed_recving or ()
                for rid in results.finished_recving:
                    self._kvl.point(P.KV_READY, rid, "failed" if rid in failed else "ok")
            except Exception:
                _fail("get_transfer_results")
        return results

    # -- posting (push: writer thread; pull: engine thread) ------------------
    def _kvl_post(self, *args, **kwargs):
        """Shared body of the per-rank post hooks (_xfer_blocks / _read_blocks)."""
        tls = self._kvl_tls
        t = _now()
        if tls.first is None:
            tls.first = t
            spec = kwargs.get("read_spec")
            tls.rank = getattr(spec, "remote_rank", None)
        ok = False
        try:
            res = self._kvl_super_post(*args, **kwargs)
            ok = res is not None and res is not False
            return res
        finally:
            tls.last = _now()
            if ok:
                tls.posted += 1
            else:
                tls.failed = True

    def _kvl_request_posted(self, phase_post: P, rid: str, t0: int, blocks: int, engine: str | None) -> None:
        """Record descriptor.prep and the post phase after a request's posts."""
        tls = self._kvl_tls
        first, last = tls.first, tls.last or _now()
        if first is None:
            return
        attrs = {sc.ATTR_BLOCKS: blocks, sc.ATTR_REMOTE_ENGINE_ID: engine, sc.ATTR_REMOTE_RANK: tls.rank}
        hs = self._kvl_hs_t0.pop(rid, None)
        if hs is not None:
            self._kvl.record(P.HANDSHAKE, rid, hs, max(t0, hs), "ok", {sc.ATTR_REMOTE_ENGINE_ID: engine})
        self._kvl.record(P.DESCRIPTOR_PREP, rid, t0, first, "ok", attrs)
        outcome = "ok" if tls.posted and not tls.failed else "failed"
        self._kvl.record(phase_post, rid, first, last, outcome, attrs)
        if tls.posted:
            self._kvl_post_end.put(rid, (last, engine))


class InstrumentedNixlPushConnectorWorker(_WorkerHooks, NixlPushConnectorWorker):
    _KVL_COMPLETE = P.WRITE_COMPLETE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kvl_reg_t0 = _Pending()  # D: rid -> (registration dequeued ns, handshake waited)
        self._kvl_reg_seen = _Pending()  # P: base id -> PUSH_REG received ns
        self._kvl_fin_seen = _Pending()  # P: base id -> finished blocks seen ns

    # -- D side, writer thread -----------------------------------------------
    def _send_registration_to_p(self, req_id, reg_data):
        try:
            # vLLM calls this again once a handshake it had to start is done:
            # keep the first dequeue time and mark the send deferred.
            first = self._kvl_reg_t0.get(req_id)
            if first is None:
                self._kvl_reg_t0.put(req_id, (_now(), False))
            else:
                self._kvl_reg_t0[req_id] = (first[0], True)
        except Exception:
            _fail("_send_registration_to_p")
        return super()._send_registration_to_p(req_id, reg_data)

    def _do_send_reg_notif(self, req_id, reg_data):
        t = _now()
        res = super()._do_send_reg_notif(req_id, reg_data)
        try:
            t0, deferred = self._kvl_reg_t0.pop(req_id, (t, False))
            self._kvl.record(
                P.REGISTRATION_SEND,
                req_id,
                t0,
                _now(),
                "ok",
                {
                    sc.ATTR_REMOTE_ENGINE_ID: reg_data.get("remote_engine_id"),
                    sc.ATTR_BLOCKS: _nblocks(reg_data.get("local_block_ids")),
                    sc.ATTR_DEFERRED: deferred,
                },
            )
        except Exception:
            _fail("_do_send_reg_notif")
        return res

    # -- P side, writer thread -----------------------------------------------
    def _pop_matching_finished_blocks(self, request_id):
        """PUSH_REG from D just decoded: registration.receive, maybe match."""
        t = _now()
        res = super()._pop_matching_finished_blocks(request_id)
        try:
            self._kvl.record(P.REGISTRATION_RECEIVE, request_id, t, t)
            if res is not None:
                t_fin = self._kvl_fin_seen.pop(base_request_id(res[0]), t)
                self._kvl.record(P.MATCH, res[0], t_fin, _now(), "ok", {sc.ATTR_MATCH_FIRST: "prefill"})
            else:
                self._kvl_reg_seen.put(base_request_id(request_id), t)
        except Exception:
            _fail("_pop_matching_finished_blocks")
        return res

    def _pop_matching_registration(self, request_id):
        """P's finished blocks reached the writer: match if D registered first."""
        t = _now()
        res = super()._pop_matching_registration(request_id)
        try:
            if res is not None:
                t_reg = self._kvl_reg_seen.pop(base_request_id(request_id), t)
                self._kvl.record(P.MATCH, request_id, t_reg, _now(), "ok", {sc.ATTR_MATCH_FIRST: "registration"})
            else:
                self._kvl_fin_seen.put(base_request_id(request_id), t)
        except Exception:
            _fail("_pop_matching_registration")
        return res

    def _do_start_push_kv(self, request_id, local_block_ids, registration_data):
        t = _now()
        tls = self._kvl_tls
        tls.reset()
        res = super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        try:
            # No post happened and blocks exist: the WRITE was deferred until
            # the P->D handshake completes; the writer calls us again then.
            if tls.first is None and local_block_ids:
                self._kvl_hs_t0.put_first(request_id, t)
        except Exception:
            _fail("_do_start_push_kv")
        return res

    def _xfer_blocks_for_req(self, req_id, meta):
        t0 = _now()
        self._kvl_tls.reset()
        try:
            return super()._xfer_blocks_for_req(req_id, meta)
        finally:
            try:
                if self._kvl_tls.first is None:  # raised before any post
                    self._kvl_tls.first = self._kvl_tls.last = _now()
                    self._kvl_tls.failed = True
                engine = meta.remote.engine_id if meta.remote is not None else None
                self._kvl_request_posted(P.WRITE_POST, req_id, t0, _nblocks(meta.local_block_ids), engine)
            except Exception:
                _fail("_xfer_blocks_for_req")

    def _xfer_blocks(self, *args, **kwargs):
        return self._kvl_post(*args, **kwargs)

    def _kvl_super_post(self, *args, **kwargs):
        return NixlPushConnectorWorker._xfer_blocks(self, *args, **kwargs)


class InstrumentedNixlPullConnectorWorker(_WorkerHooks, NixlPullConnectorWorker):
    _KVL_COMPLETE = P.READ_COMPLETE

    def _background_nixl_handshake(self, req_id, remote_engine_id, meta):
        try:
            self._kvl_hs_t0.put_first(req_id, _now())
        except Exception:
            _fail("_background_nixl_handshake")
        return super()._background_nixl_handshake(req_id, remote_engine_id, meta)

    def _read_blocks_for_req(self, req_id, meta):
        t0 = _now()
        tls = self._kvl_tls
        tls.reset()
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            try:
                # No post: deferred to a handshake (called again later) or
                # a notify-only / failed request; nothing to record yet.
                if tls.first is not None:
                    engine = meta.remote.engine_id if meta.remote is not None else None
                    self._kvl_request_posted(P.READ_POST, req_id, t0, _nblocks(meta.local_block_ids), engine)
            except Exception:
                _fail("_read_blocks_for_req")

    def _read_blocks(self, *args, **kwargs):
        return self._kvl_post(*args, **kwargs)

    def _kvl_super_post(self, *args, **kwargs):
        return NixlPullConnectorWorker._read_blocks(self, *args, **kwargs)


# ================================================================ contract
DISABLED: set[sc.Phase] = set()
for _cls, _base, _table in (
    (InstrumentedNixlPushConnectorScheduler, NixlPushConnectorScheduler, hooks.SCHEDULER_HOOKS["NixlPushConnectorScheduler"]),
    (InstrumentedNixlPullConnectorScheduler, NixlPullConnectorScheduler, hooks.SCHEDULER_HOOKS["NixlPullConnectorScheduler"]),
    (InstrumentedNixlPushConnectorWorker, NixlPushConnectorWorker, hooks.WORKER_HOOKS["NixlPushConnectorWorker"]),
    (InstrumentedNixlPullConnectorWorker, NixlPullConnectorWorker, hooks.WORKER_HOOKS["NixlPullConnectorWorker"]),
):
    DISABLED |= hooks.prune(_cls, _base, _table)


def _warn_disabled() -> None:
    if DISABLED:
        log_once(
            "disabled-phases",
            "this vLLM lacks hook points for phases %s; they are not recorded (supported vLLM: %s)",
            sorted(p.value for p in DISABLED),
            ", ".join(hooks.SUPPORTED_VLLM),
        )


# ================================================================= facades
def _attach(connector: NixlBaseConnector, vllm_config, role, mode: str, sched_cls, worker_cls) -> None:
    """Build the instrumented scheduler / worker for ``role`` (as vLLM's own
    facade does) and connect them to this process's recorder."""
    _warn_disabled()
    rec = _make_recorder(vllm_config, mode, connector.engine_id)
    if role == KVConnectorRole.SCHEDULER:
        connector.connector_scheduler = sched_cls(vllm_config, connector.engine_id, connector.kv_cache_config)
        connector.connector_worker = None
        connector.connector_scheduler._kvl_setup(rec)
    elif role == KVConnectorRole.WORKER:
        connector.connector_scheduler = None
        connector.connector_worker = worker_cls(vllm_config, connector.engine_id, connector.kv_cache_config)
        connector.connector_worker._kvl_setup(rec)
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
        _attach(self, vllm_config, role, sc.Mode.PUSH.value,
                InstrumentedNixlPushConnectorScheduler, InstrumentedNixlPushConnectorWorker)


class InstrumentedNixlPullConnector(NixlPullConnector):
    """``NixlPullConnector`` (= ``NixlConnector``) with kvlens phase recording (pull: D READs)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        _attach(self, vllm_config, role, sc.Mode.PULL.value,
                InstrumentedNixlPullConnectorScheduler, InstrumentedNixlPullConnectorWorker)


InstrumentedNixlConnector = InstrumentedNixlPullConnector
