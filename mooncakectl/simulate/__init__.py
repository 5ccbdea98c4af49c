"""``mooncakectl simulate``: a discrete-event cluster simulator on the daemon's own Conductor.

Placement and admission are ``mooncaked.cluster.admission.Admission``
around ``conductor.decide``, a node's gossiped load is
``mooncaked.cluster.work.gossiped_load`` and the cost models are
``mooncaked.cluster.costs``'s, all called with simulated gossip views: a
change to any of them changes the simulation.

Modules, imports running one way (top never imports from below):

- ``costs``    node cost models: the analytic model with named presets, or a measured profile
- ``cache``    a node's KV block cache: DRAM with LRU and a capacity, an optional SSD tier
- ``network``  NICs and flows: a transfer shares its NICs' bandwidth with the others on them
- ``node``     one node's engine: prefill queue with chunked prefill, continuous-batching decode
- ``pipeline`` pipelined prefill groups (``--cpp``): stages, each a range of the layers, chunks
               flowing through them
- ``cluster``  the event loop: arrivals, gossip snapshots, entry nodes deciding on stale views
- ``results``  per-request outcomes -> the summary (TTFT, TBT, SLO attainment, goodput...)
- ``plot``     PNGs from a result
- ``against``  ``--against-cluster``: the simulation beside a real loopback cluster on one slice
- ``command``  the ``simulate`` subcommand, policy tables and the ``--sweep`` capacity plan
"""
