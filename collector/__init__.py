"""The OTLP collector (a service: ``kvlens collect``, and ``kvlens proxy
--collect`` mounts it): OTLP/HTTP and OTLP/gRPC trace receivers that decode
onto one bounded write queue into the kvlens trace store."""
