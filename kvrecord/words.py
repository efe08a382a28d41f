"""Every phase in a few words, for sentences such as "pull: 71 % of the
handoff is D's scheduler queue" (:func:`kvtrace.tracemodel.dominant_words`)
and the dashboard's labels. Keyed by span name (``semconv.Phase`` values);
re-exported as ``semconv.PHASE_WORDS``. Plain strings here, so this module
imports nothing (``semconv`` imports it)."""

from __future__ import annotations

from typing import Final

PHASE_WORDS: Final[dict[str, str]] = {
    "request": "the whole request",
    "prefill": "P's queue and prefill",
    "prefill.finished": "P finishing the prefill",
    "prefill.respond": "P's response path to the router",
    "relay": "the router's relay",
    "decode.intake": "D's HTTP intake",
    "router.hop": "the hop from P's response through the router to D's intake",
    "decode.queue": "D's scheduler queue",
    "registration.stage": "D staging its blocks",
    "registration.dispatch": "D's engine step handing its registration to the writer thread",
    "registration.send": "D sending its registration",
    "registration.receive": "P receiving D's registration",
    "prefill.dispatch": "P's engine step handing the blocks to its worker",
    "writer.wake": "P's writer-thread wake-up",
    "match": "P waiting for the other side",
    "alloc": "D allocating blocks",
    "decode.dispatch": "D's engine step handing the request to its worker",
    "handshake": "the NIXL handshake",
    "descriptor.prep": "descriptor preparation",
    "write.post": "posting the WRITE",
    # post -> DONE seen by P's engine loop: the wire and the noticing together
    "write.complete": "the WRITE posted -> seen done",
    "write.wire": "the WRITE on the wire (NIXL's own time)",
    "write.noticed": "vLLM noticing the WRITE was done",
    "write.notify": "D learning the WRITE is done",
    "read.post": "posting the READ",
    "read.complete": "the READ posted -> seen done",
    "read.wire": "the READ on the wire (NIXL's own time)",
    "read.noticed": "vLLM noticing the READ was done",
    "kv.released": "P releasing the blocks",
    "kv.ready": "D reporting the KV ready",
    "kv.hold": "P holding the blocks after D had them",
    "decode.first_step": "D's first decode step",
}
