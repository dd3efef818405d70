#!/usr/bin/env bash
# The default job (installs into .venv first when needed).
# Usage: ./launch/run.sh [RECIPE] [section.field=value ...]   (RECIPE defaults to the tiny CPU DAPO recipe)
#
# The RL training job is not built yet (issues 3-6). Until it is, this runs the end-to-end part that
# exists: recipe validation, then data preparation (synthetic tokenizer and parquet files, tokenised
# dataset, the first step's prompts scored by the recipe's reward on their reference answers).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh"
cd "$root"
recipe="recipes/tiny_moe_cpu_dapo.yaml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then recipe="$1"; shift; fi
echo "[run] the RL job is not built yet: running recipe validation and data preparation for $recipe"
"$root/.venv/bin/megatron-rl" validate "$recipe" "$@" >/dev/null
exec "$root/.venv/bin/megatron-rl" prepare "$recipe" "$@"
