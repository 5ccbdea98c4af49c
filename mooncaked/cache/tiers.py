"""The cache tiers, fastest first: one type for the store, gossip and the Conductor."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    DEVICE = 0
    DRAM = 1
    SSD = 2

    @property
    def label(self) -> str:
        """The tier's name in configs, JSON and metrics: "device", "dram", "ssd"."""
        return self.name.lower()
