"""Each node-to-node call's path, and the most its body may hold."""

from __future__ import annotations

# Entry node -> decode node: run a request, stream its outputs back.
GENERATE_PATH = "/internal/generate"
# Decode node -> prefill node: compute a prompt's KV into granted blocks.
PREFILL_PATH = "/internal/prefill"
# Stage -> next stage of a pipelined prefill group: take part in a request;
# a chunk's activations are in the granted rows.
PIPELINE_OPEN_PATH = "/internal/pipeline/open"
PIPELINE_CHUNK_PATH = "/internal/pipeline/chunk"
# Reader -> holder: lease the cached blocks of a prefix, give a lease back.
LOOKUP_PATH = "/internal/cache/lookup"
RELEASE_PATH = "/internal/cache/release"
# Writer -> holder of a replica put: reserve inbox rows (granted to the
# writer), commit what was written (checked), drop copies.
REPLICA_RESERVE_PATH = "/internal/store/reserve"
REPLICA_COMMIT_PATH = "/internal/store/commit"
REPLICA_DROP_PATH = "/internal/store/drop"
# Unsigned: what a call to a node known by URL only must be signed for.
IDENTITY_PATH = "/internal/identity"

# Largest prompt a node-to-node call carries (token ids).
MAX_PROMPT_TOKENS = 1 << 20
# Largest body of a generate or prefill call: the prompt's ids (at most 8
# bytes each as JSON), a grant of as many block ids, the sampling parameters.
MAX_CALL_BYTES = 16 * MAX_PROMPT_TOKENS + (1 << 20)
# Most hashes one lookup may name (a 1M-token prompt in 16-token blocks).
MAX_LOOKUP_HASHES = 65536
# Largest body of each lease call: a lookup of MAX_LOOKUP_HASHES hex hashes, a release.
MAX_LOOKUP_BYTES = MAX_LOOKUP_HASHES * 40 + 4096
MAX_RELEASE_BYTES = 4096
# Largest body of each replica call: MAX_LOOKUP_HASHES hex hashes, or as many
# checksums (at most 10 digits each as JSON).
MAX_REPLICA_BYTES = MAX_LOOKUP_HASHES * 40 + 4096

# Fetcher -> an object's origin: what the fetcher holds, what it should read
# next and from whom (objects/swarm.py).
OBJECTS_SWARM_PATH = "/internal/objects/swarm"
# Largest body of a swarm call: bitmaps and lists over at most 2^20 shards.
MAX_SWARM_BYTES = 4 << 20
