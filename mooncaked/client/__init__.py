"""A Python client of a mooncaked node's store, for programs that are not LLM
requests: ``StoreClient(url).kv.put(prompt=..., replicas=2)``."""

from mooncaked.client.http import StoreError, StoreUnreachable
from mooncaked.client.kv import Exists, HolderResult, Location, Pinned, PinSummary, Replicas
from mooncaked.client.store import AsyncStoreClient, StoreClient

__all__ = [
    "AsyncStoreClient",
    "Exists",
    "HolderResult",
    "Location",
    "PinSummary",
    "Pinned",
    "Replicas",
    "StoreClient",
    "StoreError",
    "StoreUnreachable",
]
