"""The package's shape, checked: layers import downward only, and no file or
function grows past what one reader holds in mind.

The layers, low to high. A module may import from its own layer and the ones
below it, never from one above: the block pool knows nothing of HTTP, the
engine nothing of gossip, and the HTTP handlers reach the transfer engine only
through the wire layer's adapters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mooncaked", "mooncakectl")

# Top-level modules and packages of mooncaked, lowest first. Those in one
# tuple are one layer: they may import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("log", "tasks", "process", "notify", "rpc", "secrets", "bounds", "identity"),
    ("handoff",),
    ("request",),
    ("cache",),
    ("engine",),
    # KV events out, read off the engine's block pool.
    ("kv_events",),
    ("transfer",),
    ("cluster",),
    ("wire",),
    ("objects",),
    ("router",),
    ("api",),
    ("daemon",),
    ("__main__",),
    # A client of a node's HTTP API, for other programs: nothing of the
    # daemon imports it.
    ("client",),
    # Adapters that let other engines use a node (a vLLM KV connector): the
    # daemon never imports them.
    ("integrations",),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80


def _product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _unit(module: str) -> str | None:
    """The top-level unit of mooncaked a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] != "mooncaked" or len(parts) < 2:
        return None
    return parts[1]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def _source_unit(path: Path) -> str:
    rel = path.relative_to(ROOT / "mooncaked")
    return rel.parts[0].removesuffix(".py")


def test_every_unit_of_the_package_has_a_layer() -> None:
    units = {_source_unit(p) for p in (ROOT / "mooncaked").rglob("*.py")} - {"__init__"}
    assert units - set(LAYER_OF) == set(), "give each new module or package a layer"


def test_no_module_imports_from_a_layer_above_it() -> None:
    upward: list[str] = []
    for path in (ROOT / "mooncaked").rglob("*.py"):
        source = _source_unit(path)
        if source == "__init__":
            continue
        for lineno, module in _imports(ast.parse(path.read_text())):
            target = _unit(module)
            if target is None or target not in LAYER_OF:
                continue
            if LAYER_OF[target] > LAYER_OF[source]:
                upward.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert upward == []


def test_api_reaches_the_transfer_engine_only_through_the_wire_layer() -> None:
    # The stricter rule the layers alone do not give: api sits above transfer.
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno}"
        for path in (ROOT / "mooncaked" / "api").rglob("*.py")
        for lineno, module in _imports(ast.parse(path.read_text()))
        if _unit(module) == "transfer"
    ]
    assert offenders == []


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_stay_readable(path: Path) -> None:
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_FILE_LINES, f"{lines} lines"
    long_ones = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_ones == []
