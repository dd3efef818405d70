#!/usr/bin/env bash
# Run the test suite (installs into .venv first when needed). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
