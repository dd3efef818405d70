"""The judge reward (``data.reward: judge``): a model on the judge's own engines judges each response.

Guarantees of :class:`JudgeReward`, a served reward (:class:`~megatron_rl.data.rewards.ServedReward`):

- the judge is asked :func:`judge_question` (``judge.prompt_template`` filled in), rendered as one user message
  of the judge tokenizer's chat template when it has one (else tokenised as it is, with its special tokens),
  and answers greedily, at most ``judge.max_new_tokens`` tokens; the answer is decoded without special tokens;
- the verdict is :func:`parse_verdict`: the last match of ``judge.correct_pattern`` or ``judge.wrong_pattern``;
  correct scores ``judge.correct_score``, wrong ``judge.wrong_score``; an answer with neither raises
  :class:`JudgeRewardError` quoting it (the pool then scores the response as failed and counts it);
- the empty (or blank) response is wrong without asking: there is nothing to judge, and failed responses
  take its score, which so never depends on the judge;
- requests go to the judge engines in turn, starting at a random one per worker; an engine that is gone, times
  out or fails a request is skipped for the next; when every engine failed, :class:`JudgeRewardError` names
  each engine's error. The answer carries no extracted final answer (``RewardOutput.answer`` is None).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from megatron_rl.data.prompts import encode_prompts
from megatron_rl.data.rewards import RewardOutput
from megatron_rl.engines.engine import EngineError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.config.schema import JudgeConfig

JudgeAddress = tuple[str, str, int]
"""(name, host, port) of a running judge engine."""
_QUOTED = 300
"""Characters of a judge's answer quoted in an error."""


class JudgeRewardError(RuntimeError):
    """The judge gave no verdict: every engine failed, or its answer matched neither verdict pattern."""


def judge_question(template: str, *, prompt: str, response: str, ground_truth: str) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{ground_truth}`` filled in (the schema allows no other)."""
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth)


def parse_verdict(answer: str, correct_pattern: str, wrong_pattern: str) -> bool | None:
    """True (correct) or False (wrong) by whichever pattern's last match in ``answer`` starts later; a tie goes to
    the longer match. None when neither matches."""
    last: tuple[int, int, bool] | None = None
    for pattern, verdict in ((correct_pattern, True), (wrong_pattern, False)):
        for match in re.finditer(pattern, answer):
            candidate = (match.start(), match.end(), verdict)
            if last is None or candidate[:2] > last[:2]:
                last = candidate
    return None if last is None else last[2]


def judge_input_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The ids the judge reads for ``question``: a user message of its chat template, or the text as it is."""
    (ids,) = encode_prompts(tokenizer, [question], wrap_text_in_chat=bool(getattr(tokenizer, "chat_template", None)))
    return ids


class JudgeReward:
    """The reward function of ``data.reward: judge`` (see the module docstring), asking the engines at ``engines``.

    Picklable by its config, addresses and key (connections and the tokenizer are made in the process that calls
    it); the key stays out of its repr. Not thread-safe: one instance per thread (the reward workers are processes).
    """

    def __init__(self, config: JudgeConfig, engines: Sequence[JudgeAddress], api_key: str | None) -> None:
        if not engines:
            raise ValueError("JudgeReward needs at least one judge engine address")
        self.config, self.engines, self._api_key = config, tuple(engines), api_key
        self._clients: list[HttpEngine] | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._next = random.randrange(len(self.engines))  # workers start on different engines

    def __reduce__(self) -> tuple[type[JudgeReward], tuple[JudgeConfig, tuple[JudgeAddress, ...], str | None]]:
        return JudgeReward, (self.config, self.engines, self._api_key)

    def __repr__(self) -> str:
        return f"JudgeReward(model={self.config.model!r}, engines={[name for name, _, _ in self.engines]})"

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The judge model's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    def __call__(
        self, response: str, ground_truth: str, extra_info: Mapping[str, Any], prompt: str = ""
    ) -> RewardOutput:
        """The judge's verdict on ``response`` as a score; JudgeRewardError when it gives none (module doc)."""
        if not response.strip():
            return RewardOutput(self.config.wrong_score, False)
        question = judge_question(
            self.config.prompt_template, prompt=prompt, response=response, ground_truth=ground_truth
        )
        answer = self.ask(question)
        verdict = parse_verdict(answer, self.config.correct_pattern, self.config.wrong_pattern)
        if verdict is None:
            quoted = answer[:_QUOTED] + ("..." if len(answer) > _QUOTED else "")
            raise JudgeRewardError(
                f"judge {self.config.model!r} gave no verdict: its answer {quoted!r} matches neither "
                f"judge.correct_pattern {self.config.correct_pattern!r} nor judge.wrong_pattern "
                f"{self.config.wrong_pattern!r}"
            )
        return RewardOutput(self.config.correct_score if verdict else self.config.wrong_score, verdict)

    def ask(self, question: str) -> str:
        """The judge's greedy answer to ``question`` (special tokens dropped), from the first engine that answers."""
        request = GenerateRequest(
            input_ids=judge_input_ids(self.tokenizer, question),
            sampling_params=SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=0.0),
            return_logprob=False,
        )
        clients = self._connect()
        failures = []
        for _ in range(len(clients)):
            client = clients[self._next]
            self._next = (self._next + 1) % len(clients)
            try:
                (result,) = client.generate(request)
            except EngineError as error:
                failures.append(f"{client.name}: {error}")
                continue
            return str(self.tokenizer.decode(result.output_ids, skip_special_tokens=True))
        raise JudgeRewardError(f"no judge engine answered ({'; '.join(failures)})")

    def _connect(self) -> list[HttpEngine]:
        if self._clients is None:
            self._clients = [
                HttpEngine(name, host, port, request_timeout_s=self.config.request_timeout_s, api_key=self._api_key)
                for name, host, port in self.engines
            ]
        return self._clients

    def close(self) -> None:
        """Drop the engines' clients (their connections close with them); the next call makes new ones."""
        self._clients = None
