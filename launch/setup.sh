#!/usr/bin/env bash
# Create .venv with Python 3.12 and install megatron-rl with its pinned dependency set.
# With --sglang, also .venv-sglang: SGLang 0.5.23 for engines on CPU (launch/requirements-sglang.lock says
# why it is an environment of its own), and the libcuda.so.1 stand-in its CPU engines load
# (megatron_rl/rollout/sglang_cpu.py). Idempotent: does nothing when the installed sets match their lock files.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
lock="$root/launch/requirements.lock"

find_python312() {
    if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        command -v python3.12; return
    fi
    local candidate
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
        if [ -x "$candidate" ]; then echo "$candidate"; return; fi
    done
    echo "error: Python 3.12 not found (megatron-core 0.17+ needs it). Install it (e.g. 'pyenv install 3.12') or put python3.12 on PATH." >&2
    exit 1
}

with_sglang=0
for arg in "$@"; do
    case "$arg" in
        --sglang) with_sglang=1 ;;
        *) echo "usage: $0 [--sglang]" >&2; exit 2 ;;
    esac
done

# This machine's pip configuration may name local package folders that do not exist; drop that noise.
quiet_pip() { local python="$1"; shift; "$python" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }

install_sglang() {
    local sglang_venv="$root/.venv-sglang" sglang_lock="$root/launch/requirements-sglang.lock"
    local sglang_stamp="$sglang_venv/.installed-$(sha256sum "$sglang_lock" | cut -c1-16)"
    [ -f "$sglang_stamp" ] && return
    [ -x "$sglang_venv/bin/python" ] || "$(find_python312)" -m venv "$sglang_venv"
    echo "[setup] installing SGLang 0.5.23 into $sglang_venv (first time: a few minutes, about 11 GB)"
    quiet_pip "$sglang_venv/bin/python" install --quiet --upgrade pip
    quiet_pip "$sglang_venv/bin/python" install --quiet -c "$sglang_lock" sglang==0.5.23
    rm -f "$sglang_venv"/.installed-*
    touch "$sglang_stamp"
}

build_driver_standin() {
    if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.cuda.is_available())'; then
        return  # a GPU machine: engines load the real driver, never the stand-in
    fi
    "$venv/bin/python" -c 'from megatron_rl.rollout.sglang_cpu import driver_standin_dir; driver_standin_dir()'
}

sglang_install=""
if [ "$with_sglang" = 1 ]; then
    # Beside the project's own install: each pip keeps one core busy, and this machine may have two.
    install_sglang &
    sglang_install=$!
    trap 'kill "$sglang_install" 2>/dev/null || true' EXIT
fi

stamp_of() { cat "$root/pyproject.toml" "$lock" | sha256sum | cut -c1-16; }
stamp="$venv/.installed-$(stamp_of)"
if [ ! -f "$stamp" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        py="$(find_python312)"
        echo "[setup] creating $venv with $py"
        "$py" -m venv "$venv"
    fi
    echo "[setup] installing megatron-rl and its pinned dependencies (first time: a few minutes, about 6 GB)"
    quiet_pip "$venv/bin/python" install --quiet --upgrade pip
    quiet_pip "$venv/bin/python" install --quiet -c "$lock" -e "$root[test,plots]"
    rm -f "$venv"/.installed-*
    touch "$stamp"
    echo "[setup] megatron-rl installed"
fi
if [ -n "$sglang_install" ]; then
    wait "$sglang_install"
    build_driver_standin
fi
