"""The checks every decoder runs on a JSON value, each a ``ValueError`` naming the field.

A field's name is its path in the message (``'grant.ttl_s'``,
``'prefill[1].offer'``), so a refusal says which value of which call is wrong.
Values are quoted through ``reprlib``: bounded, whatever a peer sent.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

import orjson

_repr = reprlib.Repr()
_repr.maxlevel = 2
_repr.maxlist = 6
_repr.maxdict = 4
_repr.maxstring = 60
_repr.maxother = 40


def refuse(name: str, want: str, raw: Any) -> ValueError:
    """The error for field ``name`` holding ``raw`` where ``want`` belongs."""
    return ValueError(f"{name!r} must be {want}, got {_repr.repr(raw)}")


def loads(payload: bytes, what: str) -> dict[str, Any]:
    """``payload`` as a JSON object; ValueError saying what it was meant to be."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise ValueError(f"{what} is not JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} is a JSON {type(data).__name__}, not an object")
    return data


def obj(raw: Any, name: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise refuse(name, "an object", raw)
    return raw


def integer(raw: Any, name: str, lo: int | None = 0, hi: int | None = None) -> int:
    """An integer in ``lo..hi`` (None: unbounded on that side); never a bool."""
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int)
        or (lo is not None and raw < lo)
        or (hi is not None and raw > hi)
    ):
        if lo is not None and hi is not None:
            want = f"an integer in {lo}..{hi}"
        elif lo is not None:
            want = f"an integer >= {lo}"
        else:
            want = "an integer"
        raise refuse(name, want, raw)
    return raw


def number(
    raw: Any,
    name: str,
    lo: float = 0.0,
    hi: float = math.inf,
    *,
    above: bool = False,
    unit: str = "",
) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` when ``above``); never a bool.
    ``unit`` names what it counts in the message ("seconds")."""
    ok = (
        not isinstance(raw, bool)
        and isinstance(raw, int | float)
        and math.isfinite(raw)
        and (raw > lo if above else raw >= lo)
        and raw <= hi
    )
    if not ok:
        if math.isfinite(hi):
            bounds = f" in {'(' if above else '['}{lo:g}, {hi:g}]"
        elif math.isfinite(lo):
            bounds = f" {'>' if above else '>='} {lo:g}"
        else:
            bounds = ""
        raise refuse(name, f"a number{' of ' + unit if unit else ''}{bounds}", raw)
    return float(raw)


def text(raw: Any, name: str, max_len: int = 256, *, empty: bool = False) -> str:
    """A string of at most ``max_len`` characters, non-empty unless ``empty``."""
    if not isinstance(raw, str) or len(raw) > max_len or (not raw and not empty):
        least = 0 if empty else 1
        raise refuse(name, f"a string of {least}..{max_len} characters", raw)
    return raw


def optional_text(raw: Any, name: str, max_len: int = 256) -> str | None:
    """``text`` or null."""
    return None if raw is None else text(raw, name, max_len, empty=True)


def flag(raw: Any, name: str) -> bool:
    if not isinstance(raw, bool):
        raise refuse(name, "a boolean", raw)
    return raw


def integers(
    raw: Any, name: str, *, lo: int | None = 0, min_len: int = 0, max_len: int | None = None
) -> list[int]:
    """A list of ``min_len..max_len`` integers, each >= ``lo`` (None: any); the list itself."""
    if (
        not isinstance(raw, list)
        or len(raw) < min_len
        or (max_len is not None and len(raw) > max_len)
    ):
        count = f"{min_len}..{max_len} " if max_len is not None else ""
        raise refuse(name, f"a list of {count}integers", raw)
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo) for v in raw
    ):
        raise refuse(name, "a list of integers" + (f" >= {lo}" if lo is not None else ""), raw)
    return raw
