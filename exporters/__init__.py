"""kvlens' telemetry pipeline inside a process: the recorder's events into
spans (in vLLM's processes through a sidecar of kvlens' own), the bounded
batching span processor, Prometheus' metric families and the span-derived
metrics, the handoff resolver, handoff health, and Prometheus' HTTP API and
server. The trace store is :mod:`kvtrace.store`; the OTLP collector, where
several hosts' spans meet, is :mod:`collector`."""
