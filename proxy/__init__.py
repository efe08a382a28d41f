"""``kvlens proxy``: an OpenAI-compatible prefill/decode router that emits the
root ``request`` span (and ``relay`` for pull / sequential push) per request.

Several P and D: ``--prefill`` / ``--decode`` repeat, and each request
goes to the next (P, D) pair of a cycle over all pairs (``balancer``, round
robin); the root span names both (``kvlens.prefill.*``, ``kvlens.decode.*``).

Per request:

* checks before anything is spent (``intake``): the API key when the router
  has one, the body size (413), a JSON object, and the fields the router
  relies on (400 naming the field).
* trace id (:func:`kvrecord.ids.incoming_trace`): a W3C
  ``traceparent`` from the client wins (its span id becomes the root span's
  parent); else a client ``X-Request-Id`` that already is 32 lowercase hex;
  else a fresh one. An id this router has in flight or ended recently is
  replaced by a fresh one (``isolation``: P and D must never see two
  requests with one id); the answer's ``X-Request-Id`` is the id used. The id
  goes to P and D as ``X-Request-Id``: vLLM makes it ``cmpl-<id>-0-<8 hex>``
  on each side, and the instrumented connector reads the trace id back out
  of that; a ``traceparent`` naming the router's root span goes with it (for
  vLLM's own OpenTelemetry spans).
* P gets the body with ``max_tokens=1``, ``stream=false`` and
  ``kv_transfer_params={"do_remote_decode": true, ...}``.
* pull and sequential push: D gets P's returned ``kv_transfer_params``
  verbatim, after P answered. Overlapped push: D gets its request at once,
  concurrently with P, with P's identity (engine id, side-channel host/port)
  known in advance; if P fails first, D's request is cancelled.
* D's answer is streamed back; client-visible TTFT is measured here. A
  client that disconnects cancels its calls to P and D (root span: 499).
* a call to P or D that failed before the server could have read it (stale
  pooled connection, refused connection) is sent once more (``retry``).

Modules: ``config`` (ProxyConfig, Prefill, Decode), ``balancer``, ``intake`` (checks before spending),
``isolation`` (trace ids in use), ``bodies`` (what P and D get),
``exchange`` (one request: calls to P and D), ``retry``, ``dispatch`` (one
function per mode/dispatch), ``relay`` (D's answer to the client, TTFT),
``errors``, ``telemetry``, ``app`` (create_app, routes), ``cli`` (``kvlens
proxy``: add_arguments, run). Each name is imported from the module that
defines it; this package re-exports none (importing it pulls in nothing:
``proxy.app`` brings fastapi, httpx and the telemetry pipeline, ~0.5 s).
"""
