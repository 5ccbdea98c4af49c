"""KV events out: the engine's prefix cache told in vLLM's wire format over ZMQ,
for routers built for vLLM. ``service.publishing`` runs it; ``wire`` and
``publisher`` import the "events" extra and are imported only when it runs."""
