"""``kvlens proxy``: an OpenAI-compatible prefill/decode router that emits the
root ``request`` span (and ``relay`` for pull / sequential push) per request.

Per request:

* trace id (:func:`instrumented_connector.ids.incoming_trace`): a W3C
  ``traceparent`` from the client wins (its span id becomes the root span's
  parent); else a client ``X-Request-Id`` that already is 32 lowercase hex;
  else a fresh one. The id goes to P and D as ``X-Request-Id``: vLLM makes it
  ``cmpl-<id>-0-<8 hex>`` on each side, and the instrumented connector reads
  the trace id back out of that.
* P gets the body with ``max_tokens=1``, ``stream=false`` and
  ``kv_transfer_params={"do_remote_decode": true, ...}``.
* pull and sequential push: D gets P's returned ``kv_transfer_params``
  verbatim, after P answered. Overlapped push: D gets its request at once,
  concurrently with P, with P's identity (engine id, side-channel host/port)
  known in advance; if P fails first, D's request is cancelled.
* D's answer is streamed back; client-visible TTFT is measured here.

Modules: ``config`` (ProxyConfig), ``bodies`` (what P and D get),
``exchange`` (one request: calls to P and D), ``dispatch`` (one function per
mode/dispatch), ``relay`` (D's answer to the client, TTFT), ``errors``,
``telemetry``, ``app`` (create_app, routes), ``cli``.
"""

from kvlens.proxy.bodies import P_KV_PARAMS, overlapped_d_params, prefill_body
from kvlens.proxy.cli import add_arguments, run
from kvlens.proxy.config import ProxyConfig

__all__ = ["P_KV_PARAMS", "ProxyConfig", "add_arguments", "create_app", "overlapped_d_params", "prefill_body", "run"]


def __getattr__(name: str):
    if name == "create_app":
        # start-up cost: the app pulls in fastapi, httpx and the telemetry
        # pipeline (~0.5 s); ``kvlens --help`` imports this package for its flags
        from kvlens.proxy.app import create_app

        return create_app
    raise AttributeError(f"module 'kvlens.proxy' has no attribute {name!r}")
