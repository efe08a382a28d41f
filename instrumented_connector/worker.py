"""Worker-side hooks: vLLM's push / pull NIXL connector workers with timestamps.

Threads (written next to each hook): the engine thread (completions,
results), the push writer thread (registrations, matching, WRITE posts) and
the pull engine thread (READ posts). Each override calls vLLM's method
unchanged and records around it; a failure inside kvlens is logged once and
skipped (:func:`hooks.fail`), while vLLM's own exceptions pass through
untouched. Recording is a timestamp and an append to the process's recorder;
per-request state between hooks lives in size-capped :class:`hooks.Pending`
dicts.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker, NixlPushConnectorWorker

from instrumented_connector import hooks
from kvrecord import semconv as sc
from instrumented_connector.hooks import NullRecorder, Pending, fail, nblocks, now, sample, timeout_attrs
from kvrecord.ids import base_request_id
from instrumented_connector.cputap import lookback_attrs
from instrumented_connector.taps import NixlTap as _NixlTap
from instrumented_connector.handoffhealthhooks import PullWorkerHealth, PushWorkerHealth, WorkerHealth
from instrumented_connector.taps import RankedRecorder
from instrumented_connector.taps import XferTimes as _XferTimes

P = sc.Phase
_PREFILL = sc.Role.PREFILL.value


class _WorkerHooks(WorkerHealth):
    """Worker-side hooks common to push and pull."""

    _kvl: Any = NullRecorder()
    _KVL_COMPLETE: P = P.WRITE_COMPLETE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # All hook state exists before vLLM can call a hook.
        self._kvl_tls = _XferTimes()
        self._kvl_post_end = Pending()  # rid -> (post end ns, remote engine)
        self._kvl_hs_t0 = Pending()  # rid -> handshake wait start ns
        self._kvl_failed: set[str] = set()
        self._kvl_xfer = Pending()  # NIXL handle -> (bytes, descs, xfer us)

    def _kvl_setup(self, rec) -> None:
        """Connect the recorder (every event tagged with this worker's TP
        rank where the engine has several) and tap NIXL telemetry (called
        once, after __init__)."""
        # Tag events with the rank only where there are several: a single-
        # rank engine's hot path stays one call (a span without kvlens.rank
        # is the only rank; the wrapper costs ~1.5x per event).
        self._kvl = rec
        rank = 0
        try:
            rank, size = int(getattr(self, "tp_rank", 0) or 0), int(getattr(self, "world_size", 1) or 1)
            if size > 1:
                self._kvl = RankedRecorder(rec, rank, size)
        except Exception:
            fail("tp_rank")
        self._kvl_health_setup(rec, rank)
        try:
            self.nixl_wrapper = _NixlTap(self.nixl_wrapper, self._kvl_xfer, self._kvl_notifs_cb())
        except Exception:
            fail("nixl_wrapper")

    # -- engine thread -------------------------------------------------------
    def _pop_done_transfers(self, transfers):
        snap = None
        if transfers:
            try:
                snap = {rid: list(h) for rid, h in transfers.items()}
            except Exception:
                fail("_pop_done_transfers")
        done, failed = super()._pop_done_transfers(transfers)
        if snap and (done or failed):
            try:
                self._kvl_done(transfers is self._recving_transfers, snap, done, failed)
            except Exception:
                fail("_pop_done_transfers")
        return done, failed

    def _kvl_done(self, recv: bool, snap, done, failed) -> None:
        phase = P.READ_COMPLETE if recv else P.WRITE_COMPLETE
        self._kvl_failed.update(failed)
        t = now()
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
            attrs = {
                sc.ATTR_BYTES: nbytes,
                sc.ATTR_DESCRIPTORS: ndesc,
                sc.ATTR_NIXL_XFER_S: xfer_us / 1e6,
                sc.ATTR_REMOTE_ENGINE_ID: posted[1],
            }
            if not recv and self._kvl_table is not None:
                outcome = self._kvl_write_done(rid, outcome, attrs)
            self._kvl.record(phase, rid, posted[0], max(t, posted[0]), outcome, attrs)

    def _reap_expired_send_leases(self, done_sending):
        before = len(done_sending)
        snapshot = set(done_sending) if before else None
        res = super()._reap_expired_send_leases(done_sending)
        if len(done_sending) != before:
            try:
                t = self._kvl_table
                for rid in set(done_sending) - (snapshot or set()):
                    if t is not None:
                        t.close(rid, sc.Outcome.EXPIRED.value, count_anyway=True)
                    self._kvl.point(self._KVL_COMPLETE, rid, "expired", {sc.ATTR_ERROR: "KV lease expired"})
            except Exception:
                fail("_reap_expired_send_leases")
        return res

    def get_transfer_results(self):
        sample()  # once per engine step: this thread's CPU readings stay dense (kvrecord.cpuclock)
        results = super().get_transfer_results()
        if results.finished_recving:
            try:
                failed = results.failed_recving or ()
                t = self._kvl_table
                for rid in results.finished_recving:
                    # D: the watchdog's flag, and how long D waited after it
                    flags = t.flags(rid) if t is not None and t.is_flagged(rid) else None
                    attrs = timeout_attrs(flags, now()) if flags else None
                    self._kvl.point(P.KV_READY, rid, "failed" if rid in failed else "ok", attrs or None)
            except Exception:
                fail("get_transfer_results")
        return results

    # -- posting (push: writer thread; pull: engine thread) ------------------
    def _kvl_post(self, *args, **kwargs):
        """Shared body of the per-rank post hooks (_xfer_blocks / _read_blocks)."""
        tls = self._kvl_tls
        t = now()
        if tls.first is None:
            tls.first = t
        tls.target(getattr(kwargs.get("read_spec"), "remote_rank", None))
        ok = False
        try:
            res = self._kvl_super_post(*args, **kwargs)
            ok = res is not None and res is not False
            return res
        finally:
            tls.last = now()
            if ok:
                tls.posted += 1
            else:
                tls.failed = True

    def _kvl_request_posted(
        self, phase_post: P, rid: str, t0: int, blocks: int, engine: str | None, join: str | None = None
    ) -> None:
        """Record descriptor.prep and the post phase after a request's posts.
        ``join``: P's request id where D's trace derives from it (pull)."""
        tls = self._kvl_tls
        first, last = tls.first, tls.last or now()
        if first is None:
            return
        attrs = {
            sc.ATTR_BLOCKS: blocks,
            sc.ATTR_REMOTE_ENGINE_ID: engine,
            sc.ATTR_REMOTE_RANK: tls.rank,
            sc.ATTR_REMOTE_RANKS: list(tls.ranks) or None,
            sc.ATTR_JOIN_REQUEST_ID: join,
        }
        hs = self._kvl_hs_t0.pop(rid, None)
        if hs is not None:
            self._kvl.record(
                P.HANDSHAKE,
                rid,
                hs,
                max(t0, hs),
                "ok",
                {sc.ATTR_REMOTE_ENGINE_ID: engine, sc.ATTR_JOIN_REQUEST_ID: join},
            )
        self._kvl.record(P.DESCRIPTOR_PREP, rid, t0, first, "ok", attrs)
        outcome = "ok" if tls.posted and not tls.failed else "failed"
        self._kvl.record(phase_post, rid, first, last, outcome, attrs)
        if tls.posted:
            self._kvl_post_end.put(rid, (last, engine))


class InstrumentedNixlPushConnectorWorker(PushWorkerHealth, _WorkerHooks, NixlPushConnectorWorker):
    _KVL_COMPLETE = P.WRITE_COMPLETE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kvl_reg_t0 = Pending()  # D: rid -> (registration dequeued ns, handshake waited)
        self._kvl_reg_seen = Pending()  # P: base id -> PUSH_REG received ns
        self._kvl_fin_seen = Pending()  # P: base id -> finished blocks seen ns
        # P: rid -> finished blocks queued for the writer ns. Written by the
        # engine thread (start_load_kv), popped by the writer thread: locked.
        self._kvl_enq = Pending()
        self._kvl_enq_lock = threading.Lock()

    # -- P side, engine thread -----------------------------------------------
    def start_load_kv(self, metadata):
        """P: stamp the finished blocks this step queues for the writer thread
        (the start of ``writer.wake``), before vLLM queues them and wakes it."""
        try:
            fin = getattr(metadata, "push_finished_blocks", None)
            if fin:
                t = now()
                lb = lookback_attrs(t)  # this thread's CPU before t: prefill.dispatch ends here (kvtrace.cpusplit)
                with self._kvl_enq_lock:
                    for rid in fin:
                        self._kvl_enq.put(rid, (t, lb))
                self._kvl_finished_open(fin, t)
        except Exception:
            fail("start_load_kv")
        return super().start_load_kv(metadata)

    # -- D side, writer thread -----------------------------------------------
    def _send_registration_to_p(self, req_id, reg_data):
        try:
            # vLLM calls this again once a handshake it had to start is done:
            # keep the first dequeue time and mark the send deferred.
            first = self._kvl_reg_t0.get(req_id)
            if first is None:
                self._kvl_reg_t0.put(req_id, (now(), False))
            else:
                self._kvl_reg_t0[req_id] = (first[0], True)
        except Exception:
            fail("_send_registration_to_p")
        return super()._send_registration_to_p(req_id, reg_data)

    def _do_send_reg_notif(self, req_id, reg_data):
        t = now()
        res = super()._do_send_reg_notif(req_id, reg_data)
        try:
            t0, deferred = self._kvl_reg_t0.pop(req_id, (t, False))
            self._kvl.record(
                P.REGISTRATION_SEND,
                req_id,
                t0,
                now(),
                "ok",
                {
                    sc.ATTR_REMOTE_ENGINE_ID: reg_data.get("remote_engine_id"),
                    sc.ATTR_BLOCKS: nblocks(reg_data.get("local_block_ids")),
                    sc.ATTR_DEFERRED: deferred,
                },
            )
        except Exception:
            fail("_do_send_reg_notif")
        return res

    # -- P side, writer thread -----------------------------------------------
    def _pop_matching_finished_blocks(self, request_id):
        """PUSH_REG from D just decoded: registration.receive, maybe match."""
        t = now()
        res = super()._pop_matching_finished_blocks(request_id)
        try:
            self._kvl.record(P.REGISTRATION_RECEIVE, request_id, t, t)
            if res is not None:
                t_fin = self._kvl_fin_seen.pop(base_request_id(res[0]), t)
                self._kvl.record(P.MATCH, res[0], t_fin, now(), "ok", {sc.ATTR_MATCH_FIRST: "prefill"})
            else:
                self._kvl_reg_seen.put(base_request_id(request_id), t)
            self._kvl_registration_open(request_id, res, t)
        except Exception:
            fail("_pop_matching_finished_blocks")
        return res

    def _pop_matching_registration(self, request_id):
        """The writer thread took P's finished blocks from its inbox:
        ``writer.wake`` (queued by the engine thread -> taken now), and
        ``match`` if D registered first (registration decoded -> blocks queued)."""
        t = now()
        res = super()._pop_matching_registration(request_id)
        try:
            with self._kvl_enq_lock:
                t_enq, lb = self._kvl_enq.pop(request_id, None) or (None, None)
            if t_enq is not None:
                self._kvl.record(P.WRITER_WAKE, request_id, min(t_enq, t), t, "ok", dict(lb) if lb else None)
            arrived = t if t_enq is None else min(t_enq, t)  # the blocks reached P's worker
            if res is not None:
                t_reg = self._kvl_reg_seen.pop(base_request_id(request_id), arrived)
                self._kvl.record(
                    P.MATCH, request_id, min(t_reg, arrived), arrived, "ok", {sc.ATTR_MATCH_FIRST: "registration"}
                )
                self._kvl_blocks_matched(request_id, res, t)
            else:
                self._kvl_fin_seen.put(base_request_id(request_id), arrived)
        except Exception:
            fail("_pop_matching_registration")
        return res

    def _do_start_push_kv(self, request_id, local_block_ids, registration_data):
        t = now()
        tls = self._kvl_tls
        tls.reset()
        res = super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        try:
            # No post happened and blocks exist: the WRITE was deferred until
            # the P->D handshake completes; the writer calls us again then.
            if tls.first is None and local_block_ids:
                self._kvl_hs_t0.put_first(request_id, t)
        except Exception:
            fail("_do_start_push_kv")
        return res

    def _xfer_blocks_for_req(self, req_id, meta):
        t0 = now()
        self._kvl_tls.reset()
        try:
            return super()._xfer_blocks_for_req(req_id, meta)
        finally:
            try:
                if self._kvl_tls.first is None:  # raised before any post
                    self._kvl_tls.first = self._kvl_tls.last = now()
                    self._kvl_tls.failed = True
                engine = meta.remote.engine_id if meta.remote is not None else None
                self._kvl_request_posted(P.WRITE_POST, req_id, t0, nblocks(meta.local_block_ids), engine)
            except Exception:
                fail("_xfer_blocks_for_req")

    def _xfer_blocks(self, *args, **kwargs):
        return self._kvl_post(*args, **kwargs)

    def _kvl_super_post(self, *args, **kwargs):
        return NixlPushConnectorWorker._xfer_blocks(self, *args, **kwargs)


class InstrumentedNixlPullConnectorWorker(PullWorkerHealth, _WorkerHooks, NixlPullConnectorWorker):
    _KVL_COMPLETE = P.READ_COMPLETE

    def _background_nixl_handshake(self, req_id, remote_engine_id, meta):
        try:
            self._kvl_hs_t0.put_first(req_id, now())
        except Exception:
            fail("_background_nixl_handshake")
        return super()._background_nixl_handshake(req_id, remote_engine_id, meta)

    def _read_blocks_for_req(self, req_id, meta):
        t0 = now()
        tls = self._kvl_tls
        tls.reset()
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            try:
                # No post: deferred to a handshake (called again later) or
                # a notify-only / failed request; nothing to record yet.
                if tls.first is not None:
                    remote = meta.remote
                    engine, join = (remote.engine_id, remote.request_id) if remote is not None else (None, None)
                    self._kvl_request_posted(P.READ_POST, req_id, t0, nblocks(meta.local_block_ids), engine, join)
            except Exception:
                fail("_read_blocks_for_req")

    def _read_blocks(self, *args, **kwargs):
        return self._kvl_post(*args, **kwargs)

    # -- P side, engine thread -------------------------------------------------
    def _get_new_notifs(self):
        """D's read-done notifications reached P: ``kv.released`` (the D->P
        message that bounds the clock offset in pull)."""
        done = super()._get_new_notifs()
        if done:
            try:
                t = now()
                table = self._kvl_table
                for rid in done:
                    self._kvl.record(P.KV_RELEASED, rid, t, t)
                    if table is not None:  # pull P's handoff is open in the scheduler's process
                        table.close(rid, sc.Outcome.OK.value, count_anyway=True)
            except Exception:
                fail("_get_new_notifs")
        return done

    def _kvl_super_post(self, *args, **kwargs):
        return NixlPullConnectorWorker._read_blocks(self, *args, **kwargs)


#: Phases this vLLM cannot record: their hook points are missing (pruned at import).
DISABLED: set[sc.Phase] = hooks.prune(
    InstrumentedNixlPushConnectorWorker, NixlPushConnectorWorker, hooks.WORKER_HOOKS["NixlPushConnectorWorker"]
) | hooks.prune(
    InstrumentedNixlPullConnectorWorker, NixlPullConnectorWorker, hooks.WORKER_HOOKS["NixlPullConnectorWorker"]
)
