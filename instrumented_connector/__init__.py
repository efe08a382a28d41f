"""kvlens instrumented NIXL connectors for vLLM.

Load with ``"kv_connector_module_path": "instrumented_connector"`` and
``"kv_connector": "InstrumentedNixlPushConnector"`` (or
``InstrumentedNixlPullConnector`` / ``InstrumentedNixlConnector``).

The connector classes import vLLM; they are loaded lazily so that the light
modules (``semconv``, ``recorder``) import without it.
"""

_CONNECTORS = {
    "InstrumentedNixlPushConnector",
    "InstrumentedNixlPullConnector",
    "InstrumentedNixlConnector",
    "InstrumentedNixlPushConnectorScheduler",
    "InstrumentedNixlPullConnectorScheduler",
    "InstrumentedNixlPushConnectorWorker",
    "InstrumentedNixlPullConnectorWorker",
}

__all__ = sorted(_CONNECTORS)


def __getattr__(name):
    if name in _CONNECTORS:
        from instrumented_connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'instrumented_connector' has no attribute {name!r}")
