#!/usr/bin/env bash
# Set up Mooncake's own Transfer Engine as a comparison anchor for our
# benchmarks, in a venv of its own, never in the project's environment.
#
#   tools/mooncake_anchor.sh            install (idempotent), then print where things are
#   tools/mooncake_anchor.sh --print    only print where things are (exit 1 if not installed)
#
# It installs:
#   - Debian packages the wheel's binaries load: libibverbs1 (libibverbs.so.1),
#     ibverbs-providers (libmlx5.so.1),
#     libnuma1, and libcuda1 (libcuda.so.1, from Debian's non-free component,
#     with contrib for its nvidia-support dependency, both enabled in a
#     sources file of its own when missing);
#   - into ${MOONCAKE_ANCHOR_VENV:-$HOME/.cache/mooncaked-bench/mooncake-venv}:
#     mooncake-transfer-engine and nvidia-cuda-runtime-cu12 (libcudart.so.12).
#
# Last, it writes "$VENV/anchor.env", a shell file other tools source:
#   MOONCAKE_ANCHOR_VENV, MOONCAKE_TE_BENCH (transfer_engine_bench binary, empty
#   when the wheel ships none), MOONCAKE_LD_LIBRARY_PATH (prepend to
#   LD_LIBRARY_PATH when running the anchor's binaries or its Python module).
set -euo pipefail

VENV="${MOONCAKE_ANCHOR_VENV:-$HOME/.cache/mooncaked-bench/mooncake-venv}"
PYTHON="${MOONCAKE_ANCHOR_PYTHON:-python3}"
ENV_FILE="$VENV/anchor.env"

log() { printf '[mooncake-anchor] %s\n' "$*" >&2; }

print_env() {
    if [[ ! -f "$ENV_FILE" ]]; then
        log "not installed: $ENV_FILE is missing; run $0"
        return 1
    fi
    cat "$ENV_FILE"
}

if [[ "${1:-}" == "--print" ]]; then
    print_env
    exit $?
fi

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
    log "apt-get install ${missing[*]}"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends "${missing[@]}" >&2
}

enable_non_free() {
    # libcuda1 lives in Debian's non-free component and needs nvidia-support
    # from contrib; add both in a file of our own rather than editing the
    # system's sources.
    if grep -rqsE '^(Components:.*|deb .*)\bnon-free\b' /etc/apt/sources.list /etc/apt/sources.list.d/ \
        && grep -rqsE '^(Components:.*|deb .*)\bcontrib\b' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        return 0
    fi
    local codename
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    if [[ -z "$codename" ]]; then
        log "cannot tell the Debian release; enable the non-free component by hand"
        return 1
    fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
    log "enabling Debian contrib and non-free for $codename in /etc/apt/sources.list.d/mooncake-anchor-non-free.sources"
    "${sudo[@]}" tee /etc/apt/sources.list.d/mooncake-anchor-non-free.sources >/dev/null <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $codename
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    APT_UPDATED=0
}

APT_UPDATED=0
apt_update_once() {
    if [[ "$APT_UPDATED" -eq 0 ]]; then
        local sudo=()
        if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
        log "apt-get update"
        "${sudo[@]}" apt-get update -q >&2
        APT_UPDATED=1
    fi
}

if command -v apt-get >/dev/null; then
    enable_non_free || true
    need_update=0
    for pkg in libibverbs1 ibverbs-providers libnuma1 libcuda1; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_update=1
    done
    if [[ "$need_update" -eq 1 ]]; then
        apt_update_once
        apt_install libibverbs1 ibverbs-providers libnuma1
        apt_install libcuda1 || log "libcuda1 did not install; the anchor may not load"
    fi
else
    log "no apt-get: install libibverbs.so.1, libnuma.so.1 and libcuda.so.1 yourself"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('mooncake-transfer-engine'); m.version('nvidia-cuda-runtime-cu12')" 2>/dev/null; then
    log "pip install mooncake-transfer-engine nvidia-cuda-runtime-cu12 into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q mooncake-transfer-engine 'nvidia-cuda-runtime-cu12' >&2
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BENCH="$(find "$SITE" "$VENV/bin" -name transfer_engine_bench -type f 2>/dev/null | head -n1 || true)"
if [[ -n "$BENCH" && ! -x "$BENCH" ]]; then chmod +x "$BENCH"; fi
# Directories holding the shared objects that the wheels ship (libcudart.so.12
# among them), so the loader finds them without touching the system.
LIBDIRS="$(find "$SITE" \( -name 'libcudart.so*' -o -name 'libtransfer_engine*.so*' -o -name 'libetcd*.so*' \) \
    -printf '%h\n' 2>/dev/null | sort -u | paste -sd: -)"
VERSION="$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('mooncake-transfer-engine'))")"

cat >"$ENV_FILE" <<EOF
MOONCAKE_ANCHOR_VENV='$VENV'
MOONCAKE_TE_VERSION='$VERSION'
MOONCAKE_TE_BENCH='$BENCH'
MOONCAKE_LD_LIBRARY_PATH='$LIBDIRS'
EOF

log "mooncake-transfer-engine $VERSION in $VENV"
if [[ -n "$BENCH" ]]; then
    log "transfer_engine_bench: $BENCH"
    if ! LD_LIBRARY_PATH="$LIBDIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$BENCH" | grep 'not found' >&2; then
        log "all shared libraries of transfer_engine_bench resolve"
    else
        log "transfer_engine_bench has unresolved libraries (listed above)"
    fi
else
    log "the wheel ships no transfer_engine_bench binary"
fi
log "environment written to $ENV_FILE:"
cat "$ENV_FILE"
