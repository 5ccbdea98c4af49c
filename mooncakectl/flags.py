"""Values of command-line flags that argparse's ``type=`` cannot check alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def number_list(
    text: str,
    flag: str,
    kind: Callable[[str], N],
    what: str,
    allowed: Callable[[N], bool],
    bound: str,
) -> list[N]:
    """Comma-separated numbers of ``kind``; ValueError naming ``flag`` for a
    part that is not ``what`` (``"a number"``), or that ``allowed`` refuses
    (the message says the part and ``bound``, e.g. ``"must be > 0"``)."""
    out: list[N] = []
    for part in text.split(","):
        try:
            v = kind(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not {what}") from None
        if not allowed(v):
            raise ValueError(f"{flag}: {part!r} {bound}")
        out.append(v)
    return out
