#!/usr/bin/env bash
# Run the test suite (installs into .venv, and SGLang into .venv-sglang, first when needed; the real-engine
# tests in tests/sglang run SGLang on this machine). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh" --sglang
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
