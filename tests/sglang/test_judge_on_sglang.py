"""The judge reward asking the real SGLang 0.5.23 engine: the same verdict, or the same lack of one, as asking the
reference engine serving the same checkpoint (greedy answers, requested without log-probs)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config.schema import JudgeConfig
from megatron_rl.data.synthetic_tokenizer import SYNTHETIC_VOCAB_SIZE, build_synthetic_tokenizer
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.sglang_engine import SGLangEngine
from megatron_rl.rollout.judge_reward import JudgeReward, JudgeRewardError
from tests.api_key_cases import API_KEY
from tests.judge_model import MAX_NEW_TOKENS, TEMPLATE

PROMPT = "<bos> <user> succ 3 <assistant>"
VOCAB = 100
"""The session checkpoint's vocabulary: the synthetic tokenizer's 18 words, then ``t18`` .. ``t99``."""


def _verdict(reward: JudgeReward, response: str, truth: str) -> tuple[float, bool] | str:
    try:
        output = reward(response, truth, {}, PROMPT)
    except JudgeRewardError as error:
        return "no verdict" if "gave no verdict" in str(error) else str(error)
    return output.score, output.correct


def test_the_judge_on_sglang_gives_the_reference_engine_s_verdicts(
    sglang: SGLangEngine, reference: HttpEngine, tmp_path: Path
) -> None:
    tokenizer = build_synthetic_tokenizer()
    tokenizer.add_tokens([f"t{index}" for index in range(SYNTHETIC_VOCAB_SIZE, VOCAB)])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    judge = JudgeConfig(
        model=str(tmp_path / "tokenizer"),
        prompt_template=TEMPLATE,
        correct_pattern=r"\bt[2-4]\d\b",
        wrong_pattern=r"\bt[6-8]\d\b",
        max_new_tokens=MAX_NEW_TOKENS,
        correct_score=1.0,
        wrong_score=-1.0,
    )
    on_sglang = JudgeReward(judge, [(sglang.name, sglang.host, sglang.port)], API_KEY)
    on_reference = JudgeReward(judge, [(reference.name, reference.host, reference.port)], API_KEY)
    cases = [(f"{a} {b}", str(c)) for a in range(10) for b in (4, 7) for c in (2, 8)]
    verdicts = [_verdict(on_sglang, response, truth) for response, truth in cases]
    assert verdicts == [_verdict(on_reference, response, truth) for response, truth in cases]
    kinds = {verdict if isinstance(verdict, str) else verdict[1] for verdict in verdicts}
    assert {True, False} <= kinds, f"SGLang judged no case correct, or none wrong: {kinds}"
