"""Hook-point contract for the installed vLLM, and the fail-safety of hooks."""

import inspect
import time
import types

import pytest
import vllm

from instrumented_connector import connector, hooks, scheduler
from kvrecord import semconv as sc
from vllm.distributed.kv_transfer.kv_connector.v1 import nixl

# Parameters our overrides read by name (positional order is forwarded as is).
EXPECTED_PARAMS = {
    ("NixlPushConnectorWorker", "start_load_kv"): ["metadata"],
    ("NixlPushConnectorWorker", "_pop_matching_registration"): ["request_id"],
    ("NixlPushConnectorScheduler", "request_finished"): ["request", "block_ids"],
    ("NixlPushConnectorScheduler", "update_state_after_alloc"): ["request", "blocks", "num_external_tokens"],
    ("NixlPullConnectorScheduler", "update_state_after_alloc"): ["request", "blocks", "num_external_tokens"],
    ("NixlPushConnectorWorker", "_xfer_blocks_for_req"): ["req_id", "meta"],
    ("NixlPushConnectorWorker", "_do_start_push_kv"): ["request_id", "local_block_ids", "registration_data"],
    ("NixlPushConnectorWorker", "_send_registration_to_p"): ["req_id", "reg_data"],
    ("NixlPushConnectorWorker", "_do_send_reg_notif"): ["req_id", "reg_data"],
    ("NixlPullConnectorWorker", "_read_blocks_for_req"): ["req_id", "meta"],
    ("NixlPullConnectorWorker", "_background_nixl_handshake"): ["req_id", "remote_engine_id", "meta"],
}


def test_installed_vllm_is_a_supported_version():
    assert vllm.__version__.rsplit(".", 1)[0] in hooks.SUPPORTED_VLLM, vllm.__version__


@pytest.mark.parametrize("cls_name,method", [(c, m) for c, t in hooks.all_hooks().items() for m in t])
def test_every_hook_point_exists(cls_name, method):
    assert callable(getattr(getattr(nixl, cls_name), method, None)), f"{cls_name}.{method} moved"


@pytest.mark.parametrize("key,params", EXPECTED_PARAMS.items())
def test_hook_signatures(key, params):
    cls_name, method = key
    sig = inspect.signature(getattr(getattr(nixl, cls_name), method))
    assert list(sig.parameters)[1:] == params


def test_per_rank_post_is_called_with_read_spec_keyword():
    for cls, meth, inner in (
        (nixl.NixlPushConnectorWorker, "_xfer_blocks_for_req", "self._xfer_blocks("),
        (nixl.NixlPullConnectorWorker, "_read_blocks_for_req", "self._read_blocks("),
    ):
        src = inspect.getsource(getattr(cls, meth))
        assert inner in src and "read_spec=spec" in src


def test_push_facade_init_does_only_what_we_replicate():
    # InstrumentedNixlPushConnector skips NixlPushConnector.__init__ (it would
    # build a throw-away stock worker); pin what that __init__ does.
    src = inspect.getsource(nixl.NixlPushConnector.__init__)
    assert "decode_context_parallel_size > 1" in src
    assert src.count("raise") == 2  # the DCP check and the unsupported role


def test_no_phase_disabled_on_this_vllm():
    assert connector.DISABLED == set()


def test_missing_hook_point_disables_its_phase_only():
    class Base:
        def kept(self):
            return "base"

    class Hooked(Base):
        def kept(self):
            return "hooked"

        def gone(self):  # would call super().gone() -> AttributeError
            return super().gone()

    table = {"kept": (sc.Phase.MATCH,), "gone": (sc.Phase.WRITE_POST, sc.Phase.DESCRIPTOR_PREP)}
    disabled = hooks.prune(Hooked, Base, table)
    assert disabled == {sc.Phase.WRITE_POST, sc.Phase.DESCRIPTOR_PREP}
    assert "gone" not in Hooked.__dict__ and Hooked().kept() == "hooked"
    assert hooks.prune(Hooked, Base, table) == disabled  # idempotent


class _ExplodingRecorder:
    dropped = 0

    def record(self, *a, **k):
        raise RuntimeError("telemetry bug")

    point = record


def _request(params):
    return types.SimpleNamespace(
        kv_transfer_params=params, request_id="cmpl-x-0-12345678", num_prompt_tokens=7, arrival_time=1.0
    )


def test_failing_telemetry_leaves_vllm_result_untouched(caplog):
    class Host:
        def request_finished(self, request, block_ids):
            return True, {"remote_block_ids": block_ids}

    class T(scheduler._SchedulerHooks, Host):
        pass

    t = T()
    t._kvl_setup(_ExplodingRecorder())
    out = t.request_finished(_request({"do_remote_decode": True}), ([1, 2],))
    assert out == (True, {"remote_block_ids": ([1, 2],)})


def test_host_exceptions_pass_through_unchanged():
    class Boom(Exception):
        pass

    class Host:
        def request_finished(self, request, block_ids):
            raise Boom("vllm's own error")

    class T(scheduler._SchedulerHooks, Host):
        pass

    with pytest.raises(Boom, match="vllm's own error"):
        T().request_finished(_request({"do_remote_decode": True}), ([1],))


def test_pending_bookkeeping_is_bounded():
    p = hooks.Pending()
    for i in range(hooks.PENDING_CAP + 100):
        p.put(i, i)
    assert len(p) == hooks.PENDING_CAP and 0 not in p and hooks.PENDING_CAP + 99 in p


class _ListRecorder:
    dropped = 0

    def __init__(self):
        self.points = []  # zero-length phases: (phase, rid, outcome, attrs)
        self.spans = []  # every phase: (phase, rid, start_ns, end_ns, outcome, attrs)

    def record(self, phase, rid, start_ns, end_ns, outcome="ok", attrs=None):
        self.spans.append((phase, rid, start_ns, end_ns, outcome, attrs))
        if start_ns == end_ns:
            self.points.append((phase, rid, outcome, attrs))

    def point(self, phase, rid, outcome="ok", attrs=None):
        t = time.time_ns()
        self.record(phase, rid, t, t, outcome, attrs)


def test_alloc_hook_records_only_staged_remote_prefills():
    class Host:
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return "vllm"

    class T(scheduler._SchedulerHooks, Host):
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return self._kvl_alloc(
                sc.Phase.ALLOC, super().update_state_after_alloc, request, blocks, num_external_tokens
            )

    rec = _ListRecorder()
    t = T()
    t._kvl_setup(rec)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],))
    staged = _request({"do_remote_prefill": True, "remote_engine_id": "p0"})
    assert t.update_state_after_alloc(staged, blocks, 16) == "vllm"
    assert t.update_state_after_alloc(staged, blocks, 0) == "vllm"  # nothing external: no phase
    assert t.update_state_after_alloc(_request({}), blocks, 16) == "vllm"
    assert [(p, attrs[sc.ATTR_BLOCKS], attrs[sc.ATTR_REMOTE_ENGINE_ID]) for p, _, _, attrs in rec.points] == [
        (sc.Phase.ALLOC, 3, "p0")
    ]
    # decode.queue: D's arrival (Request.arrival_time, 1.0 s here) -> the alloc point, same instant
    (q, _, q0, q1, _, _), (a, _, a0, _, _, _) = rec.spans
    assert (q, a) == (sc.Phase.DECODE_QUEUE, sc.Phase.ALLOC)
    assert q0 == 1_000_000_000 and q1 == a0


def test_arrival_time_is_a_wall_clock_request_field():
    """decode.queue starts at vLLM's ``Request.arrival_time``: a field of the
    scheduler's Request, set from the frontend's ``time.time()``."""
    from vllm.v1 import request as vreq
    from vllm.renderers import base as renderers

    assert "self.arrival_time" in inspect.getsource(vreq.Request.__init__)
    assert "arrival_time = time.time()" in inspect.getsource(renderers)


def test_push_start_load_kv_reads_the_finished_blocks_field():
    """writer.wake starts where the engine thread queues P's finished blocks
    for the writer: ``start_load_kv`` reading ``metadata.push_finished_blocks``."""
    src = inspect.getsource(nixl.NixlPushConnectorWorker.start_load_kv)
    assert "metadata.push_finished_blocks" in src and "_finished_blocks_inbox.put" in src
    loop = inspect.getsource(nixl.NixlPushConnectorWorker._push_writer_loop)
    assert "_finished_blocks_inbox.get_nowait()" in loop and "self._pop_matching_registration(rid)" in loop


def test_writer_wake_and_match_split_on_p():
    """vLLM's own start_load_kv queues P's finished blocks (t_enq) and its own
    _pop_matching_registration matches them later on the writer thread:
    writer.wake is t_enq -> taken; match (D registered first) ends at t_enq,
    when the second side reached P's worker."""
    import queue
    import threading

    from instrumented_connector import worker

    t = object.__new__(worker.InstrumentedNixlPushConnectorWorker)  # no NIXL agent: the state both methods use
    t.pcp_rank, t._reqs_to_process, t._reqs_to_send, t._recving_metadata = 0, set(), {}, {}
    t._finished_blocks_inbox, t._reg_send_inbox, t._push_writer_wake = queue.Queue(), queue.Queue(), threading.Event()
    p_rid, d_rid = "cmpl-" + "ab" * 16 + "-0-11111111", "cmpl-" + "ab" * 16 + "-0-22222222"
    t._pending_d_registrations = {d_rid: {"request_id": d_rid}}
    t._kvl_enq, t._kvl_enq_lock, t._kvl_reg_seen, t._kvl_fin_seen = (
        hooks.Pending(),
        threading.Lock(),
        hooks.Pending(),
        hooks.Pending(),
    )
    t._kvl = rec = _ListRecorder()
    t._kvl_reg_seen.put(worker.base_request_id(d_rid), 5)  # D's registration decoded long before
    meta = types.SimpleNamespace(
        reqs_to_recv={},
        push_registrations={},
        push_finished_blocks={p_rid: ([1, 2],)},
        reqs_in_batch=set(),
        reqs_not_processed=set(),
        reqs_to_send={},
        scheduler_clock=None,
        heartbeat_by_engine={},
    )
    t.start_load_kv(meta)
    rid, _ = t._finished_blocks_inbox.get_nowait()  # what the writer loop does
    assert t._push_writer_wake.is_set()
    assert t._pop_matching_registration(rid) == {"request_id": d_rid}
    got = {p: (s0, s1, attrs) for p, _, s0, s1, _, attrs in rec.spans}
    wake0, wake1, _ = got[sc.Phase.WRITER_WAKE]
    m0, m1, mattrs = got[sc.Phase.MATCH]
    assert wake0 <= wake1 and (m0, m1) == (5, wake0)
    assert mattrs[sc.ATTR_MATCH_FIRST] == "registration"
    assert not t._kvl_enq  # nothing left behind


def test_per_rank_and_join_fields_the_hooks_read():
    """What the rank, join and first-token hooks read besides the hook
    points: each rank's post names its remote rank (``tp_mapping.ReadSpec``),
    the worker knows its TP rank and size, D's meta names P's request id,
    and a scheduler step says which requests it scheduled."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata, tp_mapping
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    assert "remote_rank" in {f.name for f in dataclasses.fields(tp_mapping.ReadSpec)}
    assert callable(tp_mapping.compute_tp_mapping)
    init = inspect.getsource(nixl.NixlPullConnectorWorker.__mro__[1].__init__)
    assert "self.tp_rank =" in init and "self.world_size =" in init
    assert "request_id" in {f.name for f in dataclasses.fields(metadata.RemoteMeta)}
    assert "num_scheduled_tokens" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    # KV used or recomputed: the first step's new requests with their prompt and the tokens in place
    from vllm.v1.core.sched.output import NewRequestData

    assert "scheduled_new_reqs" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"req_id", "prompt_token_ids", "num_computed_tokens"} <= {f.name for f in dataclasses.fields(NewRequestData)}
    assert "block_size =" in inspect.getsource(nixl.NixlPullConnectorScheduler.__mro__[1].__init__)
    assert "finished_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}
    for cls in (nixl.NixlPushConnectorScheduler, nixl.NixlPullConnectorScheduler):
        assert list(inspect.signature(cls.update_connector_output).parameters)[1:] == ["connector_output"]
        assert list(inspect.signature(cls.build_connector_meta).parameters)[1:] == ["scheduler_output"]
    src = inspect.getsource(nixl.NixlPullConnectorScheduler.request_finished)
    assert "remote_request_id=request.request_id" in src  # what D's params name: P's own request id


# -------------------------------------------- handoff health (docs/handoff-health.md)
def _init_sources(cls) -> str:
    return "".join(inspect.getsource(c.__init__) for c in cls.__mro__ if "__init__" in c.__dict__ and c is not object)


@pytest.mark.parametrize(
    "cls_name,signal,attr", [(c, s, a) for c, t in hooks.HEALTH_ATTRS.items() for s, attrs in t.items() for a in attrs]
)
def test_health_attributes_exist(cls_name, signal, attr):
    """Each health signal's vLLM attribute is set up by the worker's __init__."""
    assert f"self.{attr}" in _init_sources(getattr(nixl, cls_name)), f"{cls_name}.{attr} ({signal}) moved"


def test_stale_detection_replays_vllms_own_tests():
    """Stale is vLLM's own "unrecognized request" decision, taken where vLLM
    takes it: pull P on the notifications it fetches from NIXL, push D on the
    completion it takes off the writer's queue, push P on a WRITE done for a
    request no longer tracked as a send."""
    pull = inspect.getsource(nixl.NixlPullConnectorWorker._get_new_notifs)
    assert "self.nixl_wrapper.get_new_notifs()" in pull and "Potentially invalid KV blocks" in pull
    assert "req_id not in self._reqs_to_send" in pull and "req_id not in self._reqs_to_process" in pull
    push = inspect.getsource(nixl.NixlPushConnectorWorker._get_new_notifs)
    assert "self._pending_completion_notifs.get_nowait()" in push and "Unrecognized request" in push
    assert "req_id not in self._reqs_to_send and req_id not in self._reqs_to_process" in push
    assert "self._recving_metadata.get(req_id)" in push
    assert "_pending_completion_notifs: queue.Queue" in inspect.getsource(nixl.NixlPushConnectorWorker.__init__)
    results = inspect.getsource(nixl.NixlPushConnectorWorker.get_transfer_results)
    assert "if req_id in self._reqs_to_send or req_id in self._reqs_to_process" in results
    assert "self._pop_done_transfers(" in results


def test_push_registration_lands_where_the_reconciler_reads_it():
    src = inspect.getsource(nixl.NixlPushConnectorWorker._handle_push_reg_notif)
    assert "self._pop_matching_finished_blocks(rid)" in src and "self._pending_d_registrations[rid] = reg_data" in src


def test_scheduler_output_names_what_ends_a_handoff():
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    assert {"finished_recving", "finished_sending", "failed_recving"} <= fields
    # D's request_finished runs for aborted requests too (the end of an open handoff)
    from vllm.v1.core.sched import scheduler as vsched

    assert "_connector_finished(request)" in inspect.getsource(vsched.Scheduler._free_request)


def test_nixl_agent_config_hook_point():
    """``kvlens_nixl_progress_thread`` off (:mod:`instrumented_connector.nixlagent`)
    swaps the ``nixl_agent_config`` that vLLM's worker module imported, while
    the worker's __init__ runs: the name must be a module global there, take
    ``enable_prog_thread`` (default on), and be what __init__ calls before it
    creates the agent."""
    from instrumented_connector import nixlagent

    mod, factory = nixlagent.hook_point()
    assert mod.__name__ == nixlagent.HOOK_MODULE and mod.nixl_agent_config is factory
    assert inspect.signature(factory).parameters[nixlagent.FLAG].default is True
    init = inspect.getsource(mod.NixlBaseConnectorWorker.__init__)
    assert init.index("nixl_agent_config(") < init.index("self.nixl_wrapper = nixl_wrapper_cls(")
    for cls in (nixl.NixlPushConnectorWorker, nixl.NixlPullConnectorWorker):  # both build their agent there
        assert mod.NixlBaseConnectorWorker in cls.__mro__
        assert "nixl_agent_config(" not in "".join(
            inspect.getsource(c.__init__)
            for c in cls.__mro__[: cls.__mro__.index(mod.NixlBaseConnectorWorker)]
            if "__init__" in c.__dict__
        )
