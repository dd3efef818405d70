#!/usr/bin/env bash
# The default job (installs into .venv first when needed): the RL training run of a recipe.
# Usage: ./launch/run.sh [RECIPE] [section.field=value ...]   (RECIPE defaults to the tiny CPU DAPO recipe)
#
# Runs `megatron-rl train RECIPE [overrides]`: a local Ray (or the cluster at RAY_ADDRESS), the recipe's
# rollout engines and trainer ranks; metrics in runs/<name>/logs/metrics.jsonl, checkpoints in
# runs/<name>/checkpoints. Started again, it resumes from the latest checkpoint.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh"
cd "$root"
recipe="recipes/tiny_moe_cpu_dapo.yaml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then recipe="$1"; shift; fi
echo "[run] megatron-rl train $recipe $*"
exec "$root/.venv/bin/megatron-rl" train "$recipe" "$@"
