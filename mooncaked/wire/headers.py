"""Response headers of the public API that name where a request ran and what
was forecast of it; clients (``mooncakectl``, the load generator) read them."""

from __future__ import annotations

# The nodes that ran each phase of a request.
PREFILL_NODE_HEADER = "x-mooncaked-prefill-node"
DECODE_NODE_HEADER = "x-mooncaked-decode-node"
# The Conductor's forecasts for the request, milliseconds (absent: none made).
PREDICTED_TTFT_HEADER = "x-mooncaked-predicted-ttft-ms"
PREDICTED_TBT_HEADER = "x-mooncaked-predicted-tbt-ms"
# The same before the entry node's calibration: the cost model's own figures.
MODEL_TTFT_HEADER = "x-mooncaked-model-ttft-ms"
MODEL_TBT_HEADER = "x-mooncaked-model-tbt-ms"
