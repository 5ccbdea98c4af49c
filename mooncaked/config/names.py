"""Object names, and ``model.path`` naming an object (``object:NAME``).

Here, at the bottom, because the config checks them; ``objects/`` and the
CLI use the same rules.
"""

from __future__ import annotations

import re

# model.path of a model fetched from peers as a named object.
OBJECT_PREFIX = "object:"
MAX_OBJECT_NAME = 200

# Words of letters, digits, '.', '_' and '-', each starting with a letter or
# digit, joined by '/': a name is safe in a URL, a log line and a TOML string,
# and no part of it can be '..'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")


def object_name_error(name: str) -> str | None:
    """Why ``name`` is not a valid object name, or None."""
    if not name or len(name) > MAX_OBJECT_NAME:
        return f"an object name has 1..{MAX_OBJECT_NAME} characters, got {name!r}"
    if not _NAME.fullmatch(name):
        return (
            f"an object name is words of letters, digits, '.', '_' and '-' (each starting "
            f"with a letter or digit) joined by '/', got {name!r}"
        )
    return None


def check_object_name(name: str) -> str:
    """``name`` if valid; ValueError saying why not."""
    reason = object_name_error(name)
    if reason is not None:
        raise ValueError(reason)
    return name


def object_of_path(path: str) -> str | None:
    """The object a ``model.path`` names (``object:NAME``), or None for a local path."""
    return path[len(OBJECT_PREFIX) :] if path.startswith(OBJECT_PREFIX) else None
