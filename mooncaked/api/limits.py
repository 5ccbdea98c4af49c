"""Bounds on what a client of the API may send: prompt size, body and queries.

The prompt bounds are the API's own; the body and query bounds are
``mooncaked/bounds.py``'s (the cluster's routes read bodies through them
too), re-exported here for the API's routes.
"""

from __future__ import annotations

from mooncaked.bounds import (
    BODY_READ_TIMEOUT_S,
    BODY_TIMEOUT_S,
    MAX_JSON_DEPTH,
    BadBody,
    BadQuery,
    brief,
    query_flag,
    query_int,
    read_body,
    read_json_object,
    too_deep,
    type_name,
)

__all__ = [
    "BODY_READ_TIMEOUT_S",
    "BODY_TIMEOUT_S",
    "MAX_CHARS_PER_TOKEN",
    "MAX_JSON_DEPTH",
    "OFFLOOP_TOKENIZE_CHARS",
    "BadBody",
    "BadQuery",
    "brief",
    "query_flag",
    "query_int",
    "read_body",
    "read_json_object",
    "too_deep",
    "type_name",
]

# No tokenizer yields a token per more characters than this (the longest
# entries of common vocabularies are runs of whitespace, under 100 bytes
# of which few reach 64), so a text longer than ``MAX_CHARS_PER_TOKEN *
# max_model_len`` cannot fit the context and is refused before tokenizing.
MAX_CHARS_PER_TOKEN = 64
# Texts longer than this are tokenized on a worker thread, so one long
# prompt does not stall every other stream on the event loop.
OFFLOOP_TOKENIZE_CHARS = 64 * 1024
