#!/usr/bin/env bash
# Create .venv with Python 3.12 and install megatron-rl with its pinned dependency set.
# Idempotent: does nothing when the installed set matches pyproject.toml and the lock file.
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

stamp_of() { cat "$root/pyproject.toml" "$lock" | sha256sum | cut -c1-16; }
stamp="$venv/.installed-$(stamp_of)"
[ -f "$stamp" ] && exit 0

if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python312)"
    echo "[setup] creating $venv with $py"
    "$py" -m venv "$venv"
fi
echo "[setup] installing megatron-rl and its pinned dependencies (first time: a few minutes, about 6 GB)"
# This machine's pip configuration may name local package folders that do not exist; drop that noise.
quiet_pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
quiet_pip install --quiet --upgrade pip
quiet_pip install --quiet -c "$lock" -e "$root[test,plots]"
rm -f "$venv"/.installed-*
touch "$stamp"
echo "[setup] done"
