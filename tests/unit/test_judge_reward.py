"""The judge reward's parts: the verdict rule, the question, the recipe checks and layout, and JudgeReward against
real reference engines (one of them stopped: the other answers; both stopped: an error naming each)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_rl.config import RunConfig, judge_layout, load_recipe
from megatron_rl.config.loading import RecipeError
from megatron_rl.config.schema import JudgeConfig
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.engine import ReferenceEngine
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.plan.placement import plan_judge_placement
from megatron_rl.plan.report import judge_section
from megatron_rl.rollout.judge_reward import (
    JudgeReward,
    JudgeRewardError,
    judge_input_ids,
    judge_question,
    parse_verdict,
)
from tests.judge_model import CORRECT, MAX_NEW_TOKENS, TEMPLATE, WRONG, judge_overrides, save_tiny_judge

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "recipes" / "tiny_moe_cpu_grpo.yaml"
BIG = ROOT / "recipes" / "qwen3_30b_a3b_dapo.yaml"
VERDICT = (r"(?i)verdict:\s*correct", r"(?i)verdict:\s*wrong")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("The answer matches. Verdict: correct", True),
        ("verdict: WRONG", False),
        ("First I thought Verdict: wrong, but on reflection Verdict: correct", True),
        ("Verdict: correct? No. Verdict: wrong", False),
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_the_last_verdict_in_the_answer_decides(answer: str, expected: bool | None) -> None:
    assert parse_verdict(answer, *VERDICT) is expected


def test_a_tie_of_starts_goes_to_the_longer_match() -> None:
    assert parse_verdict("correctly wrong", "correct", "correctly") is False
    assert parse_verdict("7", "7", "[0-9]") is True  # same span: the correct pattern, tried first, holds


def test_the_question_fills_every_placeholder() -> None:
    assert judge_question("{prompt}|{response}|{ground_truth}", prompt="p", response="r", ground_truth="g") == "p|r|g"


def test_the_judge_reads_its_chat_template(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_judge(tmp_path / "judge"))
    ids = judge_input_ids(tokenizer, "succ 3")
    assert tokenizer.decode(ids) == "<bos> <user> succ 3 <assistant>"


def _recipe(*overrides: str, recipe: Path = GRPO) -> RunConfig:
    cfg, _ = load_recipe(recipe, list(overrides), require_files=False)
    return cfg


def test_recipe_checks_name_the_judge_field_and_its_fix(tmp_path: Path) -> None:
    model = tmp_path / "judge"
    with pytest.raises(RecipeError, match=r"judge\.model: required when data\.reward is 'judge'"):
        _recipe("data.reward=judge")
    with pytest.raises(RecipeError, match=r"judge: a judge .* is set but data\.reward is 'synthetic_successor'"):
        _recipe(f"judge.model={model}")
    with pytest.raises(RecipeError, match=r"unknown placeholders \['answer'\]"):
        _recipe(*judge_overrides(model), "judge.prompt_template='{answer}'")
    with pytest.raises(RecipeError, match=r"must contain \{response\}"):
        _recipe(*judge_overrides(model), "judge.prompt_template='{prompt}'")
    with pytest.raises(RecipeError, match=r"correct_pattern.*is not a regular expression"):
        _recipe(*judge_overrides(model), "judge.correct_pattern='('")
    with pytest.raises(RecipeError, match=r"judge\.request_timeout_s: 40 s exceeds data\.reward_timeout_s=30 s"):
        _recipe(*judge_overrides(model), "judge.request_timeout_s=40")


def test_a_gpu_judge_takes_whole_nodes_of_its_own_and_the_network_spans_them(tmp_path: Path) -> None:
    model = tmp_path / "judge"
    model.mkdir()
    judge = [*judge_overrides(model, num_engines=2), "judge.tp=4", "judge.engine=sglang"]
    cfg = _recipe(*judge, "cluster.network_interface=lo", recipe=BIG)
    nodes = cfg.cluster.nodes
    assert (cfg.judge_nodes, cfg.job_nodes) == (1, nodes + 1)
    assert judge_layout(cfg).gpus == 8
    plan = plan_judge_placement(cfg)
    assert plan is not None and plan.num_bundles == 8 and plan.trainer_positions == ()
    assert plan.engine_positions == ((0, 1, 2, 3), (4, 5, 6, 7))
    with pytest.raises(RecipeError, match=r"judge\.num_engines: 1 judge engines x judge\.tp 4 = 4 GPUs .* use "):
        _recipe(*judge_overrides(model), "judge.tp=4", "judge.engine=sglang", recipe=BIG)
    with pytest.raises(RecipeError, match=r"judge\.tp: 16 GPUs per judge engine exceed a node's 8"):
        _recipe(*judge_overrides(model), "judge.tp=16", "judge.engine=sglang", recipe=BIG)


def test_a_cpu_judge_shares_the_run_s_node(tmp_path: Path) -> None:
    cfg = _recipe(*judge_overrides(tmp_path, num_engines=2))
    assert (cfg.judge_nodes, cfg.job_nodes) == (0, 1)
    plan = plan_judge_placement(cfg)
    assert plan is not None and plan.engine_positions == ((0,), (1,)) and plan.bundle.num_gpus == 0


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[ReferenceEngine]]]:
    root = tmp_path_factory.mktemp("judges")
    model = save_tiny_judge(root / "judge")
    engines = [ReferenceEngine(f"judge{i}", model, free_port(), log_dir=root / "logs") for i in range(2)]
    for engine in engines:
        engine.start()
    try:
        for engine in engines:
            engine.wait_healthy(120)
        yield model, engines
    finally:
        for engine in engines:
            engine.shutdown()


def _config(model: Path) -> JudgeConfig:
    judge = _recipe(*judge_overrides(model)).judge
    assert judge is not None
    return judge


def test_judge_reward_scores_the_engines_greedy_verdict_and_fails_over(
    judges: tuple[Path, list[ReferenceEngine]],
) -> None:
    model, engines = judges
    config = _config(model)
    addresses = [(engine.name, engine.host, engine.port) for engine in engines]
    reward = pickle.loads(pickle.dumps(JudgeReward(config, addresses, None)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    cases = [(f"{a} {b} succ", str(c)) for a in range(4) for b in (5, 8) for c in (1, 6)]
    verdicts = []
    for response, truth in cases:
        question = TEMPLATE.format(prompt="<bos> <user> succ 3 <assistant>", response=response, ground_truth=truth)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes the special tokens
        (result,) = engines[0].generate(
            GenerateRequest(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0), return_logprob=False)
        )
        answer = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        assert isinstance(answer, str)
        verdict = parse_verdict(answer, CORRECT, WRONG)
        verdicts.append(verdict)
        if verdict is None:
            with pytest.raises(JudgeRewardError, match="gave no verdict"):
                reward(response, truth, {}, "<bos> <user> succ 3 <assistant>")
            continue
        output = reward(response, truth, {}, "<bos> <user> succ 3 <assistant>")
        assert (output.score, output.correct, output.answer) == (1.0 if verdict else -1.0, verdict, None)
    assert set(verdicts) == {True, False, None}, "the tiny judge gives verdicts of every kind on these cases"
    assert reward("  ", "1", {}).score == -1.0  # the empty response is wrong without asking

    engines[1].shutdown()  # half the requests went to it: now the other engine takes them all
    judged = [case for case, verdict in zip(cases, verdicts, strict=True) if verdict is not None]
    for response, truth in judged[:4]:
        reward(response, truth, {}, "<bos> <user> succ 3 <assistant>")
    engines[0].shutdown()
    with pytest.raises(JudgeRewardError, match=r"no judge engine answered \(judge\d: .*; judge\d: "):
        reward("1 2", "3", {}, "")
    assert "api" not in repr(reward).lower()


def test_readme_s_judge_fragment_validates_and_plan_counts_its_node(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    (fragment,) = [block for block in readme.split("```yaml\n")[1:] if block.startswith("data:\n  reward: judge")]
    fragment = fragment.split("```")[0].replace("/models/Qwen3-8B", str(tmp_path))
    recipe = tmp_path / "judged.yaml"
    recipe.write_text(f"base: {BIG}\n{fragment}")
    cfg = _recipe(recipe=recipe)
    judge = cfg.judge
    assert judge is not None
    assert judge.prompt_template.startswith("Question: {prompt}\nReference answer: {ground_truth}\n")
    assert parse_verdict("so... Verdict: Correct", judge.correct_pattern, judge.wrong_pattern) is True
    assert cfg.job_nodes == cfg.cluster.nodes + 1
    assert (judge.request_timeout_s, cfg.data.reward_timeout_s) == (100.0, 120.0)
    report = "\n".join(judge_section(cfg))
    assert f"sbatch --nodes={cfg.job_nodes}" in report
    assert f"node {cfg.cluster.nodes}: judge engines 0 (GPUs 0), 1 (GPUs 1)," in report
