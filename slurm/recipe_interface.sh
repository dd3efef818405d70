#!/usr/bin/env bash
# Prints the recipe's cluster.network_interface on a multi-node recipe, nothing on one node: what ray_cluster.sh
# reads as NETWORK_INTERFACE. Usage: slurm/recipe_interface.sh RECIPE [section.field=value ...]
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/python" -c 'import sys
from megatron_rl.config import load_recipe
cfg, _ = load_recipe(sys.argv[1], sys.argv[2:], require_files=False)
print(cfg.cluster.network_interface if cfg.cluster.nodes > 1 else "")' "$@"
