"""Handoff-health part of the worker hooks (docs/handoff-health.md): the open-handoff
table of a worker, and the stale signal, which replays vLLM's own
"unrecognized request" test where vLLM makes it. Mixins of the instrumented
workers (:mod:`instrumented_connector.worker`); same contract: a failure is
logged once and skipped, vLLM's behaviour is unchanged."""

from __future__ import annotations

import queue
from typing import Any

from instrumented_connector import hooks
from instrumented_connector.hooks import fail, nblocks, now
from instrumented_connector.taps import NotifQueueTap
from kvrecord import semconv as sc
from kvrecord.openhandoffs import entry_fields, table_for

P = sc.Phase
OP = sc.OpenPhase
_PREFILL, _DECODE = sc.Role.PREFILL.value, sc.Role.DECODE.value
_STALE = sc.Outcome.STALE.value
# phase values, not members: the table's dict look-ups stay in C (an enum hashes in Python)
_AWAITING_REGISTRATION, _AWAITING_PREFILL, _WRITING = (
    OP.AWAITING_REGISTRATION.value,
    OP.AWAITING_PREFILL.value,
    OP.WRITING.value,
)


class WorkerHealth:
    """Open-handoff table and stale helpers common to push and pull workers."""

    _kvl: Any
    _kvl_table: Any = None  # this side's open-handoff table (rank 0 only), None: not tracked
    _kvl_stale_on = False  # the stale signal's vLLM attributes exist (hooks.HEALTH_ATTRS)
    _kvl_role = None
    _KVL_MODE = sc.Mode.PUSH.value
    _KVL_BASE = ""  # the vLLM class name in hooks.HEALTH_ATTRS
    _KVL_OWN: dict[str, tuple[sc.OpenPhase, ...]] = {}

    def _kvl_health_setup(self, rec, rank: int) -> None:
        """This side's open-handoff table, on TP rank 0 only (every rank sees
        the same requests: one counts them); the stale signal where this
        vLLM has what it reads (one warning otherwise)."""
        try:
            role = getattr(rec, "role", None)
            if rank != 0 or role not in (_PREFILL, _DECODE) or not hasattr(rec, "add_periodic"):
                return
            t = table_for(self._KVL_MODE, role)
            t.own(self._KVL_OWN.get(role, ()))
            self._kvl_table, self._kvl_role = t, role
            off = hooks.missing_attrs(self, hooks.HEALTH_ATTRS.get(self._KVL_BASE, {}))
            self._kvl_stale_on = "stale" not in off
            self._kvl_health_extra(t, role, off)
        except Exception:
            fail("open-handoff table")

    def _kvl_health_extra(self, table, role: str, off: set[str]) -> None:
        """Mode-specific health set-up (subclasses)."""

    def _kvl_notifs_cb(self):
        """The NIXL tap's look at notifications (pull P), or None."""
        return None

    def _kvl_released(self, rid: str) -> bool:
        """vLLM no longer tracks ``rid`` as a send: P released (or never
        held) its blocks. vLLM's own "unrecognized request" test."""
        return rid not in self._reqs_to_send and rid not in self._reqs_to_process

    def _kvl_stale(self, phase: P, rid: str, seen_by: str, error: str, attrs: dict | None = None) -> None:
        """Count a stale request and flag its trace (a point of ``phase``)."""
        t = self._kvl_table
        if t is not None:
            t.count_stale()
        a = {sc.ATTR_KV_STALE: True, sc.ATTR_KV_STALE_SEEN_BY: seen_by, sc.ATTR_ERROR: error}
        if attrs:
            a.update(attrs)
        self._kvl.point(phase, rid, _STALE, a)

    def _kvl_write_done(self, rid: str, outcome: str, attrs: dict) -> str:
        """Push P, engine thread: a WRITE seen done ends its handoff. vLLM
        reports one done after the lease as already expired: the WRITE read
        blocks P had released, stale. Returns the outcome to record."""
        table = self._kvl_table
        if self._kvl_stale_on and self._kvl_released(rid):
            outcome = _STALE
            table.count_stale()
            attrs[sc.ATTR_KV_STALE] = True
            attrs[sc.ATTR_KV_STALE_SEEN_BY] = _PREFILL
            attrs[sc.ATTR_ERROR] = "WRITE completed after P's lease released the blocks"
        table.close(rid, outcome)
        return outcome


class PushWorkerHealth(WorkerHealth):
    """Push: P's three waiting phases, D's late completion notifications."""

    _KVL_MODE = sc.Mode.PUSH.value
    _KVL_BASE = "NixlPushConnectorWorker"
    _KVL_OWN = {_PREFILL: (OP.AWAITING_REGISTRATION, OP.AWAITING_PREFILL, OP.WRITING)}

    def _kvl_health_extra(self, table, role: str, off: set[str]) -> None:
        if role == _DECODE and "stale" not in off:
            q = self._pending_completion_notifs
            if type(q) is queue.Queue and q.empty():  # before the writer thread starts
                self._pending_completion_notifs = NotifQueueTap(self._kvl_d_notif)
            else:
                self._kvl_stale_on = False
        if role == _PREFILL and "unmatched_registration" not in off:
            table.reconcilers.append(self._kvl_reconcile_registrations)

    # P's three waiting phases (the hooks' calls; ``t``: the hook's timestamp)
    def _kvl_finished_open(self, finished: dict, t: int) -> None:
        """Engine thread: P's finished blocks reach the worker, unregistered."""
        table = self._kvl_table
        if table is not None:
            for rid, blocks in finished.items():
                table.open(rid, _AWAITING_REGISTRATION, t, nblocks(blocks))

    def _kvl_registration_open(self, d_rid: str, res, t: int) -> None:
        """Writer thread: D's registration reached P; ``res``: the finished
        blocks it matched (P's id, blocks), or None (it waits for them)."""
        table = self._kvl_table
        if table is None:
            return
        if res is not None:
            table.open(res[0], _WRITING, t)
        else:
            table.open(d_rid, _AWAITING_PREFILL, t, attempt=False)  # not a P handoff until blocks come

    def _kvl_blocks_matched(self, rid: str, reg, t: int) -> None:
        """Writer thread: P's blocks matched a waiting registration ``reg``:
        one handoff from here, started when the registration arrived."""
        table = self._kvl_table
        if table is None:
            return
        d_rid = reg.get("request_id") if isinstance(reg, dict) else None
        e = table.close(d_rid, None) if d_rid and d_rid != rid else None
        table.open(rid, _WRITING, t, start_ns=entry_fields(e)["start_ns"] if e else None)

    def _kvl_d_notif(self, notif: bytes) -> None:
        """D's engine thread took a completion notification off the writer's
        queue; vLLM's next test is whether it still knows the request. If not
        (its lease or its request ended first), P wrote into blocks D no
        longer holds for it: stale, seen by D."""
        msg = notif.decode("utf-8")
        if msg.startswith("HB:"):
            return
        rid = msg.rsplit(":", 1)[0]
        if self._kvl_released(rid) and rid not in self._recving_metadata:
            self._kvl_stale(
                P.KV_READY, rid, _DECODE, "P's completion notification reached D after D stopped tracking the request"
            )

    def _kvl_reconcile_registrations(self) -> None:
        """Background thread: registrations waiting on P that vLLM no longer
        holds leave the table; the blocks of those it holds are filled in."""
        t = self._kvl_table
        regs = self._pending_d_registrations
        for rid in t.open_ids(OP.AWAITING_PREFILL, now() - 1_000_000_000):
            reg = regs.get(rid)
            if reg is None:
                t.close(rid, None)
            elif isinstance(reg, dict):
                t.set_blocks(rid, nblocks(reg.get("local_block_ids")))


class PullWorkerHealth(WorkerHealth):
    """Pull: D's read-done notifications that reach P after its lease."""

    _KVL_MODE = sc.Mode.PULL.value
    _KVL_BASE = "NixlPullConnectorWorker"

    def _kvl_notifs_cb(self):
        return self._kvl_p_notifs if self._kvl_role == _PREFILL and self._kvl_stale_on else None

    def _kvl_p_notifs(self, notifs) -> None:
        """P's worker fetched D's notifications; vLLM tests each next: a
        read-done for a request it no longer tracks means D READ blocks P's
        lease had released ("Potentially invalid KV blocks"): stale, seen by P."""
        for msgs in notifs.values():
            for notif in msgs:
                msg = notif.decode("utf-8")
                if msg.startswith("HB:"):
                    continue
                rid = msg.rsplit(":", 1)[0]
                if self._kvl_released(rid):
                    self._kvl_stale(P.KV_RELEASED, rid, _PREFILL, "D read the KV after P's lease released the blocks")
