"""Local clusters of ``mooncaked`` daemons on this machine, for ``up``/``down``,
the cluster benchmarks and the tests.

Modules, imports running one way (top never imports from below):

- ``plan``      which nodes: roles, ids, ports (the one ``free_port``), the seed, cores to pin
- ``config``    each node's config: a base under the node's own settings, as TOML (the one renderer)
- ``process``   one daemon process: spawned with its config and log, its URL read back, stopped
- ``cluster``   ``LocalCluster``: every node started, ready and joined, then stopped, as an
                async context manager; the readiness checks callers share
- ``commands``  ``mooncakectl up`` / ``down``, thin callers of the above
"""
