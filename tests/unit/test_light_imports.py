"""What a spawned reward worker imports stays light: the CLI (its ``__main__``) and the reward registry, no torch.

``multiprocessing``'s spawn imports the parent's main module (``megatron-rl``, hence ``megatron_rl.cli``)
in every reward worker before it scores, and the driver waits for each worker at start-up: torch and
transformers there cost about 2 s of CPU per worker, two workers per run.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "megatron")


def test_the_cli_and_the_rewards_import_neither_torch_nor_transformers_nor_megatron() -> None:
    probe = (
        "import sys, megatron_rl.cli, megatron_rl.data.rewards, megatron_rl.rollout.scoring; "
        f"print(sorted({{name.split('.')[0] for name in sys.modules}} & {set(HEAVY)!r}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
