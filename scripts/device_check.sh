#!/usr/bin/env bash
# The GPU checks of issue 12 (scripts/device_check.py) on one lent H200, in one call of at most 8 minutes.
#
#   scripts/device_check.sh --fetch     here, with a package index: the wheels of scripts/device_wheels.txt
#                                       into .whl/ (gitignored; about 24 MB)
#   scripts/device_check.sh             there: install .whl/*.whl into /tmp/site (no index, no deps), run the
#                                       checks, write $OUT/gpu-checks.md, gpu-checks.json and device_check.log
#   scripts/device_check.sh --dry-run   the CPU rehearsal (no wheels, no CUDA), into $OUT or /tmp
#   scripts/device_check.sh --only C..  there: only checks C.. (parity, train, ipc_sync, colocated_contexts,
#                                       sync_bench, early_batches, engine_invariance, fp8_quantiser;
#                                       colocated_contexts needs 2 GPUs and passes as skipped on one)
#
# Device call (carry .whl):  scripts/device_check.sh      with timeout_s 540; the checks stop themselves at 450 s.
# Copy the report into docs/gpu-checks.md afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device_check_out}"
mkdir -p "$out"
case "${1:-}" in
--fetch)
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl -r scripts/device_wheels.txt
    ;;
--dry-run)
    python="${PYTHON:-.venv/bin/python}"
    exec "$python" scripts/device_check.py --dry-run --workdir "$out/work" --report "$out/gpu-checks.md" \
        --json "$out/gpu-checks.json"
    ;;
"" | --only) ;;
*)
    echo "usage: $0 [--fetch | --dry-run | --only CHECK...]" >&2
    exit 2
    ;;
esac
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run '$0 --fetch' first and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 450 python3 scripts/device_check.py --workdir /tmp/device_check --report "$out/gpu-checks.md" \
    --json "$out/gpu-checks.json" "$@" 2>&1 | tee "$out/device_check.log"
