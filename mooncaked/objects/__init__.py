"""Named objects shared peer to peer (model weights, checkpoints), in the
spirit of Mooncake's P2P Store, on this project's transfer engine.

A node registers a file or a directory under a name (``put``: metadata only,
nothing is copied); the manifest (size, shards, a checksum per shard, the
object's digest, a version) and which shards each node holds spread by
gossip. Any node can fetch it (``get``): shards from any holder at once, each
checked as it lands and served on to others as soon as it is, a bad or lost
shard fetched again from another holder; the origin coordinates who reads
what from whom, so that nodes fetching together share the load.

Modules, lowest first: ``manifest`` (what an object is), ``files`` (a copy's
mapped files, the scan that hashes a path), ``disk`` (the data directory:
journal, registrations), ``plan`` (which shard from whom: one pure
function), ``messages`` (the swarm call, the gossip ad), ``catalog`` (the
cluster's objects from gossip), ``replica`` (a copy held), ``swarm`` (the
origin's side of fetches), ``peers`` (the fetcher's calls), ``fetch`` (one
fetch), ``service`` (``ObjectStore``: the node's objects), ``client`` (a
Python client of the admin API, for programs).
"""
