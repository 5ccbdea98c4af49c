"""``mooncakectl bench``: a load generator for OpenAI-compatible servers.

Modules, imports running one way (top never imports from below):

- ``trace``     Mooncake trace records: reading, validating, slicing (no I/O beyond the file)
- ``workloads`` requests to send: random, prefix families, trace replay (token ids)
- ``metrics``   per-request records -> the summary, as ``vllm bench serve`` defines it
- ``client``    one streamed request over aiohttp; probing the server
- ``load``      when to send: trace timestamps, Poisson with burstiness, concurrency cap;
                where: each request's entry (``--entries``), drawn from the seed
- ``report``    summary table, progress bar, the result JSON
- ``plot``      PNGs from a result (matplotlib, the ``plot`` extra)
- ``compare``   several result JSONs side by side
- ``replay``    one replay of a trace slice on a fresh loopback cluster of daemons
- ``policies_report``, ``policies``  ``bench policies``: the Conductor's policies, entries,
                overload, each on fresh loopback clusters; their figures and tables
- ``disagg_report``, ``disagg``  ``bench disagg``: the KV handoff and decode interference,
                disaggregated vs colocated daemons on loopback; the figures and report
- ``engine_bench``  ``tools/bench_engine.py``'s inputs: the trace-shaped workload,
                precisions, the llama.cpp anchor's files
- ``command``   the ``bench`` subcommand wiring it together
"""
