"""kvlens instrumented NIXL connectors for vLLM.

Load with ``"kv_connector_module_path": "instrumented_connector"`` and
``"kv_connector": "InstrumentedNixlPushConnector"`` (or
``InstrumentedNixlPullConnector`` / ``InstrumentedNixlConnector``).

This package is only the plug-in: vLLM loads it by name, nothing of kvlens
imports it. What it records with lives below it (:mod:`kvrecord`: the
vocabulary, ids, options, the recorder; :mod:`exporters`: the pipeline). The
connector classes import vLLM; they are loaded lazily (on first attribute
access, from :mod:`instrumented_connector.connector`), so that the contract
tests can read :mod:`instrumented_connector.hooks` without building vLLM's
connector.
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
        # Deferred for start-up cost: importing vLLM takes seconds, and the
        # router and the CLI use this package without it.
        from instrumented_connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'instrumented_connector' has no attribute {name!r}")
