"""Typed node-to-node messages, their paths, headers and clients.

Every call one node makes to another has a frozen message here with one
encoder and one decoder; a decoder refuses a malformed field with a
``ValueError`` naming it. The router and the API's handlers both build on
this package and nothing here imports them: the entry's generate client
(``generate``), the decode node's prefill client (``prefill``), the cache's
lease client (``lease``), and the engine's and the cache's byte movers over
the transfer engine (``kv_io``).
"""
