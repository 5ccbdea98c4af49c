"""Fixtures shared by the integration tests."""

from tests.integration.clusters import cluster_factory

__all__ = ["cluster_factory"]
