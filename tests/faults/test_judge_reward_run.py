"""A tiny run scored by a judge model (``data.reward: judge``) on a reference engine of its own, whose process is
killed mid-run: the run restarts it before a later step (``rollout/judge_restarts``), the reward workers ask the new
engine, and the last steps are judged again; the run completes. In the full tier, ``megatron-rl eval`` of a run's
checkpoint scores with a fresh judge engine, and every row's score is the verdict the judge gives when asked again
here, by a request built from the recipe's template and the judge's chat template without the project's judge code.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from megatron_rl.config import load_recipe
from megatron_rl.data.preparation import prepare_recipe_data
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.engine import ReferenceEngine
from megatron_rl.parallel.local_launch import free_port
from tests.e2e.tiny_runs import ROOT, read_metrics, run_env, train_command
from tests.judge_model import CORRECT, MAX_NEW_TOKENS, TEMPLATE, WRONG, judge_overrides, save_tiny_judge

GRPO = ROOT / "recipes" / "tiny_moe_cpu_grpo.yaml"
RUN = Path("runs") / "tiny-moe-cpu-grpo"
PROMPTS, SAMPLES, VAL_PROMPTS, VAL_SAMPLES = 2, 16, 16, 4
"""Groups per step (no dynamic sampling in the GRPO preset), their size, and the validation set's prompts and samples
(sampled at temperature 1: the tiny policy's greedy responses are mostly tokens the synthetic tokenizer does not
have, which decode to nothing, and the empty response is judged without asking)."""


def _judge_server(model: Path) -> psutil.Process | None:
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "megatron_rl.engines.reference.server" in cmdline and str(model) in cmdline:
            return process
    return None


def _verdict(answer: str) -> bool | None:
    """The last digit of the answer that either pattern matches: correct, wrong, or None (no verdict)."""
    matches = [(m.start(), True) for m in re.finditer(CORRECT, answer)]
    matches += [(m.start(), False) for m in re.finditer(WRONG, answer)]
    return max(matches)[1] if matches else None


def _overrides(model: Path, steps: int) -> list[str]:
    return [
        *judge_overrides(model),
        f"train.steps={steps}",
        f"train.prompts_per_step={PROMPTS}",
        f"rollout.n_samples_per_prompt={SAMPLES}",
        f"data.synthetic.num_val={VAL_PROMPTS}",
        "validation.interval=0",
        "validation.sets.greedy.temperature=1.0",
        f"validation.sets.greedy.n={VAL_SAMPLES}",
        "checkpoint.interval=0",
        "logging.sinks=[jsonl]",
    ]


@pytest.mark.slow
def test_a_judge_scored_run_restarts_its_killed_judge(tmp_path: Path) -> None:
    model = save_tiny_judge(tmp_path / "judge")
    overrides = _overrides(model, steps=4)
    run = subprocess.Popen(
        train_command(overrides, GRPO),
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / RUN / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert run.poll() is None, "the run ended before its first step"
        time.sleep(0.05)
    judge = _judge_server(model)
    assert judge is not None, "no judge engine process serves the judge model"
    judge.kill()
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0 and "# done: 4 steps" in out
    steps = read_metrics(tmp_path / RUN)
    responses = PROMPTS * SAMPLES
    assert sum(r["rollout/judge_restarts"] for r in steps) == 1.0 and steps[0]["rollout/judge_restarts"] == 0.0
    restarted = next(i for i, r in enumerate(steps) if r["rollout/judge_restarts"])
    for record in (steps[0], *steps[restarted:]):  # before the kill, and from the restart on: verdicts
        assert record["rollout/reward_errors"] < responses, record["step"]
    assert _judge_server(model) is None  # the run's judge engines ended with it


@pytest.mark.full  # CI's judge run is the test above; eval's judge is the same JudgeReward the run's workers use
def test_eval_of_a_judge_scored_run_scores_as_the_judge_answers(tmp_path: Path) -> None:
    model = save_tiny_judge(tmp_path / "judge")
    overrides = _overrides(model, steps=1)
    subprocess.run(
        train_command(overrides, GRPO), cwd=tmp_path, env=run_env(), capture_output=True, timeout=600, check=True
    )
    evaluated = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl.cli",
            "eval",
            str(GRPO),
            *overrides,
            "--checkpoint",
            str(RUN / "checkpoints"),
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / RUN / "eval" / "checkpoints" / "greedy.jsonl").open()]
    assert len(rows) == VAL_PROMPTS * VAL_SAMPLES

    cfg, _ = load_recipe(GRPO, overrides, require_files=False)
    data = prepare_recipe_data(cfg, model_vocab_size=32, work_dir=tmp_path / "prepared")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = ReferenceEngine("judge-again", model, free_port(), log_dir=tmp_path / "logs")
    engine.start()
    verdicts = []
    try:
        engine.wait_healthy(120)
        for row in rows:
            item = data.val_sets["greedy"][row["prompt_index"]]
            question = TEMPLATE.format(
                prompt=data.decode(list(item.prompt_ids)), response=row["response"], ground_truth=item.ground_truth
            )
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
            (result,) = engine.generate(GenerateRequest(ids, params, return_logprob=False))
            answer = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            assert isinstance(answer, str)
            verdict = None if not row["response"].strip() else _verdict(answer)
            verdicts.append(verdict)
            assert row["correct"] is (verdict is True), row
            assert row["score"] == (1.0 if verdict else -1.0), row
            assert row["reward_failure"] == ("error" if verdict is None and row["response"].strip() else None), row
    finally:
        engine.shutdown()
    assert {True, False, None} <= set(verdicts), "the judge's verdicts here are of every kind"
