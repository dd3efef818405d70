#!/usr/bin/env bash
# Create .venv with Python 3.12 and install megatron-rl with its pinned dependency set.
# With --sglang, also .venv-sglang: SGLang 0.5.23 for engines on CPU (launch/requirements-sglang.lock says
# why it is an environment of its own), and the libcuda.so.1 stand-in its CPU engines load
# (megatron_rl/engines/sglang_cpu.py). With --gpu, .venv gets the GPU set instead (launch/requirements-gpu.lock:
# the CPU set plus Transformer Engine 2.20.2 and SGLang 0.5.23, with the transformers SGLang pins), TE's PyTorch
# extension built against .venv's torch; a .venv that has the GPU set keeps it on later runs without --gpu.
# Idempotent: does nothing when the installed sets match their lock files.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
lock="$root/launch/requirements.lock"
gpu_lock="$root/launch/requirements-gpu.lock"

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
with_gpu=0
for arg in "$@"; do
    case "$arg" in
        --sglang) with_sglang=1 ;;
        --gpu) with_gpu=1 ;;
        *) echo "usage: $0 [--sglang] [--gpu]" >&2; exit 2 ;;
    esac
done
# A .venv given the GPU set keeps it: reinstalling the CPU lock over it would move transformers past SGLang's pin.
[ -f "$venv/.gpu-set" ] && with_gpu=1
[ "$with_gpu" = 1 ] && lock="$gpu_lock"

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
    "$venv/bin/python" -c 'from megatron_rl.engines.sglang_cpu import driver_standin_dir; driver_standin_dir()'
}

stamp_of() { cat "$root/pyproject.toml" "$lock" | sha256sum | cut -c1-16; }
# Refuse before installing anything when the disk cannot hold it: a pip that runs out of space midway leaves a
# half-installed venv and only "No space left on device".
check_free_space() {
    local need_gb=0 free_gb
    [ -f "$venv/.installed-$(stamp_of)" ] || need_gb=$((need_gb + ${1}))
    if [ "$with_sglang" = 1 ] && ! ls "$root/.venv-sglang"/.installed-* >/dev/null 2>&1; then need_gb=$((need_gb + 12)); fi
    free_gb=$(($(df -Pk "$root" | awk 'NR == 2 {print $4}') / 1024 / 1024))
    if [ "$free_gb" -lt "$need_gb" ]; then
        echo "error: the install needs about $need_gb GB free in $root, and its disk has $free_gb GB: free space (old clones' .venv folders, ~/.cache/pip) and rerun" >&2
        exit 1
    fi
}

check_free_space "$([ "$with_gpu" = 1 ] && echo 20 || echo 7)"

sglang_install=""
if [ "$with_sglang" = 1 ]; then
    # Beside the project's own install: each pip keeps one core busy, and this machine may have two.
    install_sglang &
    sglang_install=$!
    trap 'kill "$sglang_install" 2>/dev/null || true' EXIT
fi

stamp="$venv/.installed-$(stamp_of)"
if [ ! -f "$stamp" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        py="$(find_python312)"
        echo "[setup] creating $venv with $py"
        "$py" -m venv "$venv"
    fi
    quiet_pip "$venv/bin/python" install --quiet --upgrade pip
    if [ "$with_gpu" = 1 ]; then
        echo "[setup] installing megatron-rl with the GPU set (launch/requirements-gpu.lock; first time: SGLang's wheels, about 11 GB, and a build of TE's extension)"
        # 1. Everything but TE's PyTorch extension (an sdist): torch, SGLang with the CUDA compiler and headers its
        #    set brings (nvidia-cuda-nvcc, -cccl), and TE's CUDA 13 core.
        quiet_pip "$venv/bin/python" install --quiet -c "$lock" -e "$root[test,plots]" sglang transformer-engine-cu13
        # 2. The extension, built against this venv's torch 2.14.1 (with build isolation pip would build it against
        #    whatever torch it downloads, and TE's setup picks the CUDA 12/13 core from that torch).
        #    Its headers (CUDA, cuDNN, NCCL) come from the NVIDIA wheels in this venv, the ones torch runs with.
        #    NVTE_PYTORCH_FORCE_BUILD=TRUE: otherwise TE's setup.py first downloads a prebuilt wheel from GitHub, with
        #    no timeout, so on a cluster that drops outside traffic the setup would hang there.
        NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_PYTORCH_FORCE_BUILD=TRUE quiet_pip "$venv/bin/python" install --quiet \
            --no-build-isolation -c "$lock" -e "$root[test,plots,gpu]"
        "$venv/bin/python" -m pip check
        touch "$venv/.gpu-set"
    else
        echo "[setup] installing megatron-rl and its pinned dependencies (first time: a few minutes, about 6 GB)"
        quiet_pip "$venv/bin/python" install --quiet -c "$lock" -e "$root[test,plots]"
    fi
    rm -f "$venv"/.installed-*
    touch "$stamp"
    echo "[setup] megatron-rl installed"
fi
if [ -n "$sglang_install" ]; then
    wait "$sglang_install"
    build_driver_standin
fi
