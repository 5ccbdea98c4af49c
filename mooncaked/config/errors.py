"""How configuration goes wrong: the errors a section raises and the loader reports."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot start the daemon; the message names key and file."""


class ConfigValueError(ValueError):
    """Raised by a section's validation; the loader turns it into a ConfigError."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def check(cond: bool, key: str, message: str) -> None:
    """ConfigValueError(key, message) unless ``cond``."""
    if not cond:
        raise ConfigValueError(key, message)
