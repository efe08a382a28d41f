"""``kvlens bench``: a push-vs-pull benchmark grid on a real P/D stack.

For each stack variant (pull; push with each dispatch) and each grid cell
(input length x QPS) it sends ``num_prompts`` random prompts of exactly that
many tokens as an open-loop Poisson process, streaming, ``ignore_eos`` so
every request yields ``output_len`` tokens, and records client-side TTFT,
TPOT and end-to-end latency. TPOT is reported only where it was measured:
a request whose tokens all reached the client in one read has none, and
the row counts such requests (``tpot_untimed``); the client's TPOT is
cross-checked against D's own per-request TPOT histogram on its
``/metrics``, as its TTFT is against the router's span. Every request carries its own 32-hex
``X-Request-Id``; the router keeps it as the trace id, so after a cell the
span-derived handoff (``prefill.finished`` -> ``kv.ready``) of exactly those
requests is read back from the trace store and joined to the client figures.

Rows (schema: :mod:`kvtrace.benchrows`) go to the store (``bench_rows``,
for the dashboard) and, with ``--json``, to a JSON-lines file as each cell
completes, so Ctrl-C keeps what finished. Pull runs first so that each push
row can carry its push/pull ratios when it is written. Each ratio of p50s
comes with a bootstrap 95 % interval, and a side is called lower only where
the interval excludes 1. ``repeat`` K > 1 runs the grid K times with push
and pull in ABBA order (:mod:`.rounds`); its rows pool each cell's rounds
and are written when the run ends (or is interrupted).

The load generator is small and self-contained (asyncio + httpx, prompts
from the model's own ``tokenizers`` file, built the way vLLM's
``RandomDataset`` builds them). vLLM's ``vllm.benchmarks`` was the first
choice, but importing it pulls in most of vLLM (over a minute of wall time
on a loaded 2-core host, competing with the servers under test), and its
request function starts the TTFT clock on the first chunk even when the
chunk has no text, while the router's span TTFT starts on the first chunk
with text: the cross-check would compare two definitions.

Modules, bottom up: :mod:`.grid` (options, validation, run order),
:mod:`.prompts` (statistics: :mod:`kvtrace.stats`), :mod:`.results` (per-request results, the
store join, the row), :mod:`.probe` (what a router says about itself),
:mod:`.load` (the HTTP load loop), :mod:`.report` (table, findings,
cross-checks), :mod:`.rounds` (ABBA order, pooled rows, intervals),
:mod:`.runner` (routers or started stacks), :mod:`.cli`.
:mod:`.cli` is the command (``add_arguments``, ``run``: what
:mod:`kvlens.cli` loads by name); every name is imported from the module
that defines it (this package re-exports none).
"""
