"""kvlens: observability for vLLM's disaggregated P/D KV handoff (push vs pull)."""

__version__ = "0.1.0"
