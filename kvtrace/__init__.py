"""kvlens' trace store and trace model, above :mod:`kvrecord`: the store
(``store/``: every SQL statement, SQLite or PostgreSQL), the P/D clock
arithmetic (``clockbounds``), one trace's model and its tiling of the
handoff (``tracemodel``, ``tiling``, ``ranks``, ``kvuse``), and its
exports (``perfetto``, ``benchrows``).

It imports only :mod:`kvrecord`; the telemetry pipeline (``exporters``), the
dashboard, the vLLM plug-in and the CLI sit above it.
"""
