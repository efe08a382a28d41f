"""kvlens exporters: the SQLite trace store, the OTel pipeline and Prometheus metrics."""
