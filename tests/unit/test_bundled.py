"""Finding the bundled model's GGUF file through an installed distribution's file list."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncaked.engine.bundled import default_model_path, smollm2_gguf_path


def _install(site: Path, name: str, files: list[str]) -> None:
    """A minimal installed distribution: METADATA plus a RECORD naming ``files``."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def test_the_gguf_file_of_an_installed_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, "fake-model", ["fake_model/__init__.py", "fake_model/m.Q4_1.gguf"])
    (tmp_path / "fake_model").mkdir()
    (tmp_path / "fake_model" / "m.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert smollm2_gguf_path("fake-model") == (tmp_path / "fake_model" / "m.Q4_1.gguf").resolve()


def test_a_listed_but_missing_file_or_no_distribution_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, "hollow-model", ["hollow_model/gone.gguf"])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert smollm2_gguf_path("hollow-model") is None
    assert smollm2_gguf_path("no-such-distribution-here") is None


def test_default_is_smollm2_when_installed_else_builtin() -> None:
    path = smollm2_gguf_path()
    if path is None:
        assert default_model_path() == "builtin:tiny"
    else:
        assert path.suffix == ".gguf" and path.is_file()
        assert default_model_path() == str(path)
