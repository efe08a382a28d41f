"""The request bodies the router sends to P and D (pure functions)."""

from __future__ import annotations

from kvrecord.ids import vllm_request_id_base
from proxy.config import Prefill, ProxyConfig

#: What vLLM's own disaggregated proxy examples send to P.
P_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict) -> dict:
    """P's copy of the client body: one token, not streamed, asked to keep
    its KV for a remote decode. ``body`` is not changed."""
    b = dict(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b.pop("min_tokens", None)
    b["kv_transfer_params"] = dict(P_KV_PARAMS)
    return b


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """D's copy of the client body, carrying ``kv_transfer_params``."""
    b = dict(body)
    b["kv_transfer_params"] = kv_transfer_params
    return b


def overlapped_d_params(prefill: Prefill | ProxyConfig, endpoint: str, trace_id: str) -> dict:
    """D's ``kv_transfer_params`` for an overlapped push, from the chosen P's
    identity known in advance (instead of P's answer). ``prefill``: that P,
    or a config (its first P, for callers with one P)."""
    p = prefill.prefills[0] if isinstance(prefill, ProxyConfig) else prefill
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        # P's real id carries a random suffix we cannot know; push matching on
        # P strips suffixes (get_base_request_id), and D only uses this for
        # lease heartbeats, so the base id is what fits best.
        "remote_request_id": vllm_request_id_base(endpoint, trace_id),
        "remote_host": p.side_host,
        "remote_port": p.side_port,
        "tp_size": p.tp_size,
    }
