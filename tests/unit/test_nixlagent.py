"""NIXL's agent without its progress thread (issue 41 item 9): the connector
option ``kvlens_nixl_progress_thread``, ``kvlens up --nixl-progress off``, and
the swap of vLLM's ``nixl_agent_config`` while the worker's __init__ runs
(:mod:`instrumented_connector.nixlagent`). The hook point itself is pinned in
test_hooks_contract.py."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from types import ModuleType, SimpleNamespace

import pytest

from instrumented_connector import nixlagent
from kvrecord import logutil
from kvrecord.config import KNOWN_KEYS, Options


class _Config:
    """A stand-in for nixl's ``nixl_agent_config`` (same parameters)."""

    def __init__(self, enable_prog_thread=True, enable_listen_thread=False, num_threads=0, capture_telemetry=False):
        self.enable_pthread = enable_prog_thread
        self.num_threads = num_threads
        self.capture_telemetry = capture_telemetry


def _module(factory=_Config) -> ModuleType:
    m = ModuleType("fake_base_worker")
    if factory is not None:
        m.nixl_agent_config = factory
    return m


@pytest.fixture(autouse=True)
def _warn_again():
    """log_once remembers its keys per process: each test sees its own warning."""
    logutil._logged.discard("nixl-prog-thread")
    yield
    logutil._logged.discard("nixl-prog-thread")


# ------------------------------------------------------------- the option
def test_the_option_is_on_unless_turned_off(tmp_path):
    assert "kvlens_nixl_progress_thread" in KNOWN_KEYS
    assert Options.from_config({}).nixl_progress_thread is True
    for off in ("off", "OFF", "false", False):
        assert Options.from_config({"kvlens_nixl_progress_thread": off}).nixl_progress_thread is False
    for on in ("on", "true", True):
        assert Options.from_config({"kvlens_nixl_progress_thread": on}).nixl_progress_thread is True
    with pytest.raises(ValueError, match="kvlens_nixl_progress_thread must be 'on' or 'off'"):
        Options.from_config({"kvlens_nixl_progress_thread": "sometimes"})
    o = Options.from_config({"kvlens_home": str(tmp_path), "kvlens_nixl_progress_thread": "off"})
    sent = json.loads(json.dumps(o.to_config()))
    assert sent["kvlens_nixl_progress_thread"] == "off" and Options.from_config(sent) == o
    assert "kvlens_nixl_progress_thread" not in Options.from_config({"kvlens_home": str(tmp_path)}).to_config()


# --------------------------------------------------------------- the swap
def test_off_builds_the_config_without_the_thread_and_puts_vllms_back():
    m = _module()
    with nixlagent.agent_config(False, m) as out:
        assert m.nixl_agent_config is not _Config
        kw = m.nixl_agent_config(num_threads=4, capture_telemetry=True)  # vLLM's own call
        pos = m.nixl_agent_config(True)  # a positional flag is overridden too
    assert m.nixl_agent_config is _Config
    assert (kw.enable_pthread, kw.num_threads, kw.capture_telemetry) == (False, 4, True)
    assert pos.enable_pthread is False and out.applied == 2 and out.reason is None


def test_on_touches_nothing():
    m = _module()
    with nixlagent.agent_config(True, m) as out:
        assert m.nixl_agent_config is _Config
        assert m.nixl_agent_config().enable_pthread is True
    assert out.applied == 0 and out.reason is None


def test_vllms_exception_passes_through_and_the_name_is_restored():
    m = _module()
    with pytest.raises(RuntimeError, match="vllm's own"):
        with nixlagent.agent_config(False, m):
            raise RuntimeError("vllm's own")
    assert m.nixl_agent_config is _Config


@pytest.mark.parametrize(
    "factory, why",
    [(None, "is missing"), (lambda num_threads=0, capture_telemetry=False: None, "takes no enable_prog_thread")],
)
def test_a_missing_hook_point_is_one_warning_and_vllms_behaviour(factory, why, caplog):
    m = _module(factory)
    with caplog.at_level(logging.WARNING, logger="kvlens"):
        for _ in range(2):
            with nixlagent.agent_config(False, m) as out:
                assert getattr(m, "nixl_agent_config", None) is factory
    assert why in out.reason and out.applied == 0
    warned = [r for r in caplog.records if "kvlens_nixl_progress_thread off ignored" in r.getMessage()]
    assert len(warned) == 1 and why in warned[0].getMessage()


def test_a_worker_that_never_calls_the_factory_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="kvlens"):
        with nixlagent.agent_config(False, _module()) as out:
            pass
    assert out.applied == 0 and "did not call nixl_agent_config" in out.reason
    assert any("did not call" in r.getMessage() for r in caplog.records)


def test_the_real_hook_point_gets_nixls_config_without_the_thread():
    mod = importlib.import_module(nixlagent.HOOK_MODULE)
    real = mod.nixl_agent_config
    with nixlagent.agent_config(False) as out:
        cfg = mod.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert mod.nixl_agent_config is real and isinstance(cfg, real)
    assert (cfg.enable_pthread, cfg.num_threads, out.applied) == (False, 4, 1)
    # nothing else serializes the agent's UCX worker without the thread: nixl's strict lock
    assert cfg.sync_mode.name == "NIXL_THREAD_SYNC_STRICT" and real(num_threads=4).sync_mode is None
    assert real(num_threads=4).enable_pthread is True  # vLLM's default stays the thread


# ------------------------------------------------- the connector's worker
def test_the_connector_creates_its_worker_inside_the_swap(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from instrumented_connector import connector
    from instrumented_connector.hooks import NullRecorder

    mod = importlib.import_module(nixlagent.HOOK_MODULE)
    monkeypatch.setattr(connector, "_make_recorder", lambda *a, **k: NullRecorder())
    monkeypatch.setattr(connector, "watch_upstream", lambda *a, **k: None)
    monkeypatch.setattr(connector, "watch_new_threads", lambda *a, **k: None)

    class Worker:  # what vLLM's worker __init__ does with the name: calls it, by module lookup
        def __init__(self, vllm_config, engine_id, kv_cache_config):
            self.config = mod.nixl_agent_config(num_threads=4, capture_telemetry=True)

        def _kvl_setup(self, rec):
            pass

    def attach(extra):
        vcfg = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra)
        )
        c = SimpleNamespace(engine_id="p0", kv_cache_config=None)
        connector._attach(c, vcfg, KVConnectorRole.WORKER, "push", None, Worker)
        return c.connector_worker.config.enable_pthread

    assert attach({"kvlens_nixl_progress_thread": "off"}) is False
    assert attach({}) is True  # the default: vLLM's config, thread on
    assert mod.nixl_agent_config.__name__ == "nixl_agent_config"


# ------------------------------------------------------------ kvlens up
def _stack(tmp_path, **kw):
    from kvlens.stack.launch import Stack

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    base = dict(mode="push", model=model, kvlens_home=tmp_path / "home", log_dir=tmp_path / "run", port=18000,
                prefill_port=18001, decode_port=18002, prefill_side_port=18003, decode_side_port=18004)  # fmt: skip
    return Stack(**{**base, **kw})


def _extra(child) -> dict:
    argv = list(child.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def test_up_nixl_progress_off_sets_the_option_in_every_engine_and_skips_the_spinners(tmp_path):
    from kvlens import up, upargs
    from kvlens.stack import spinners
    from kvlens.stack.errors import StackError

    p = argparse.ArgumentParser()
    upargs.add_arguments(p)
    args = p.parse_args(["--mode", "pull", "--nixl-progress", "off", "--log-dir", str(tmp_path / "run")])
    assert up._stack(args).nixl_progress == "off"
    s = _stack(tmp_path, nixl_progress="off", connector_options={"kvlens_metrics": "off"})
    for child in (s.roles.server("prefill"), s.roles.server("decode")):
        extra = _extra(child)
        assert extra["kvlens_nixl_progress_thread"] == "off" and extra["kvlens_metrics"] == "off"
        assert Options.from_config(extra).nixl_progress_thread is False
    assert "kvlens_nixl_progress_thread" not in _extra(_stack(tmp_path).roles.server("prefill"))  # default: untouched
    assert spinners.resolve_mode("off", 5, 2) == "off"
    said: list[str] = []
    t = spinners.ProgressThreads("off", said.append)
    t.on_poll(SimpleNamespace(name="prefill", ready_at=1.0, proc=SimpleNamespace(pid=1)))
    t.restore()
    assert said == [] and t.to_json()["demoted"] == {}
    with pytest.raises(StackError, match="needs kvlens' connector"):
        _stack(tmp_path, nixl_progress="off", stock=True)
