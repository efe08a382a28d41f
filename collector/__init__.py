"""kvlens collect: an OTLP/HTTP trace receiver that writes the kvlens trace store."""
