"""Every command README.md and docs/ quote in a ``bash`` block is proven: run here as written, or by the test named.

A command that needs no download and little time runs as quoted, in a fresh folder holding a copy of
``recipes/`` (and, for the checkpoint commands, a tiny Qwen3-MoE where the README's user keeps theirs):
its exit status is the one its comment states (``# exit 1: ...``, else 0), and the output block the
README shows after it matches what it prints, line by line (numbers masked where they measure this
machine). A command that needs a GPU cluster, minutes of training or Slurm names the test that runs
it (or its scaled form); that test must exist. A quoted command in neither table fails here, so a
command added to the docs, or one that rots, fails CI.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_checkpoints import save_tiny_moe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUMBER = re.compile(r"\d+\.\d+e[-+]\d+|\d+(?:\.\d+)?")

RUN_HERE = [
    ".venv/bin/megatron-rl validate recipes/tiny_moe_cpu_dapo.yaml train.lr=1e-3 parallel.ep=3",
    ".venv/bin/megatron-rl plan recipes/qwen3_30b_a3b_dapo.yaml",
    ".venv/bin/megatron-rl plan recipes/qwen3_30b_a3b_dapo.yaml parallel.ep=2",
    ".venv/bin/megatron-rl plan recipes/qwen3_235b_a22b_dapo.yaml",
    ".venv/bin/megatron-rl preflight recipes/qwen3_30b_a3b_dapo.yaml --dry-run",
    ".venv/bin/megatron-rl check-parity --hf checkpoints/my-qwen3-moe --tp 2 --ep 2 --etp 1",
    ".venv/bin/megatron-rl convert hf-to-mcore --hf checkpoints/my-qwen3-moe --out checkpoints/my-qwen3-moe-mcore "
    "--tp 2 --ep 2",
    ".venv/bin/megatron-rl convert mcore-to-hf --ckpt checkpoints/my-qwen3-moe-mcore --out checkpoints/my-qwen3-moe-hf "
    "--pp 2",
    ".venv/bin/megatron-rl convert hf-to-fp8 --hf checkpoints/my-qwen3-moe --out checkpoints/my-qwen3-moe-fp8 "
    "--block 16 16",
]
"""Run here, in this order (the second conversion reads the first one's output)."""

MASKED = {".venv/bin/megatron-rl check-parity --hf checkpoints/my-qwen3-moe --tp 2 --ep 2 --etp 1"}
"""Commands whose quoted output holds measured differences: compared with every number masked."""

PROVEN_ELSEWHERE = {
    "./launch/run.sh": "tests/e2e/test_default_job.py::test_default_job_command_trains_and_says_what_it_ran",
    "./launch/test.sh": ".ci/run",
    "./launch/test.sh --full": "tests/unit/test_test_tiers.py::test_ci_keeps_a_real_run_of_every_path_and_full_adds_the_rest",
    ".venv/bin/megatron-rl smoke recipes/qwen3_30b_a3b_dapo.yaml": (
        "tests/e2e/test_smoke_recipes.py::test_smoke_runs_the_recipe_for_two_steps_with_a_resume"
    ),
    # 4 nodes x 8 GPUs; the same batch script trains the tiny recipe on a one-node Slurm.
    "sbatch --nodes=4 --gpus-per-node=8 slurm/train.sbatch recipes/qwen3_30b_a3b_dapo.yaml": (
        "tests/slurm/test_ray_on_slurm.py::test_train_sbatch_runs_the_rl_job_on_the_allocation"
    ),
    # 4 nodes x 8 GPUs; the same batch script runs the tiny recipe's preflight on a one-node Slurm.
    "sbatch --nodes=4 --gpus-per-node=8 slurm/preflight.sbatch recipes/qwen3_30b_a3b_dapo.yaml": (
        "tests/slurm/test_ray_on_slurm.py::test_preflight_sbatch_passes_every_step_on_the_allocation"
    ),
    # Needs the report of a preflight run: the preflight test writes one and runs plan --rates on it.
    ".venv/bin/megatron-rl plan recipes/qwen3_30b_a3b_dapo.yaml --rates runs/qwen3-30b-a3b-dapo/preflight/report.json": (
        "tests/sglang/test_preflight.py::test_preflight_of_the_sglang_recipe_passes_every_step_and_plan_takes_its_rates"
    ),
    # Needs a trained checkpoint: the eval test trains the default recipe and evaluates its last checkpoint.
    ".venv/bin/megatron-rl eval recipes/qwen3_30b_a3b_dapo.yaml --checkpoint runs/qwen3-30b-a3b-dapo/checkpoints": (
        "tests/e2e/test_eval.py::test_eval_of_the_last_checkpoint_reproduces_the_runs_last_validation"
    ),
    # Nine runs of 150 steps (about 20 minutes): its flags are checked here with --help.
    ".venv/bin/python scripts/compare_algorithms.py --seeds 1234 1 2": "--help",
}


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """The fenced blocks of a Markdown text: (language, lines), in order."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    language = ""
    for line in text.splitlines():
        fence = re.fullmatch(r"```(\w*)\s*", line)
        if fence and current is None:
            current, language = [], fence.group(1)
        elif fence:
            assert current is not None  # a fence that does not open a block closes the open one
            blocks.append((language, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _quoted() -> list[tuple[str, list[str]]]:
    """Each quoted command (comment dropped), with the output the docs show for it: the untyped block that
    follows its bash block, for the block's first command."""
    commands = []
    for doc in DOCS:
        blocks = _blocks(doc.read_text())
        for index, (language, lines) in enumerate(blocks):
            if language != "bash":
                continue
            following = blocks[index + 1] if index + 1 < len(blocks) else ("bash", [])
            output = following[1] if following[0] == "" else []
            quoted = [line for line in (raw.split("  #")[0].strip() for raw in lines) if line]
            commands += [(line, output if i == 0 else []) for i, line in enumerate(quoted)]
    return commands


def _expected_status(command: str) -> int:
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            if line.split("  #")[0].strip() == command and (status := re.search(r"#\s*exit (\d+)", line)):
                return int(status.group(1))
    return 0


def _masked(line: str) -> str:
    return NUMBER.sub("N", line.rstrip())


def test_every_quoted_command_is_run_here_or_by_a_named_test() -> None:
    unproven = [c for c, _ in _quoted() if c not in RUN_HERE and c not in PROVEN_ELSEWHERE]
    assert not unproven, f"add these to RUN_HERE or PROVEN_ELSEWHERE: {unproven}"
    for command, proof in PROVEN_ELSEWHERE.items():
        if proof == "--help":
            continue
        if proof == ".ci/run":
            assert command in (ROOT / ".ci" / "run").read_text()
            continue
        path, name = proof.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, proof


def test_a_long_command_accepts_its_quoted_flags() -> None:
    for command, proof in PROVEN_ELSEWHERE.items():
        if proof != "--help":
            continue
        script, *args = shlex.split(command)[1:]
        shown = subprocess.run(
            [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120, check=True
        )
        for flag in (arg for arg in args if arg.startswith("--")):
            assert flag in shown.stdout, f"{script} has no {flag}"


@pytest.mark.slow
def test_quoted_commands_run_as_written_and_print_what_the_docs_show(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    save_tiny_moe(tmp_path / "checkpoints" / "my-qwen3-moe")
    shown = dict(_quoted())
    for command in RUN_HERE:
        argv = [sys.executable, "-m", "megatron_rl.cli", *shlex.split(command)[1:]]
        result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
        printed = result.stdout + result.stderr
        assert result.returncode == _expected_status(command), f"{command}\n{printed[-3000:]}"
        expected = shown[command]
        compare = _masked if command in MASKED else str.rstrip
        actual = {compare(line) for line in printed.splitlines()}
        missing = [line for line in expected if line.strip() and compare(line) not in actual]
        assert not missing, f"{command}: the docs show lines it did not print: {missing[:5]}\n{printed[-3000:]}"
