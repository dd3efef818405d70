"""The rollout manager's ``/generate`` requests: one per prompt, its sampling seed(s) by engine.

A stand-in engine records each request and answers every sample with one stop token; the manager
runs one step (no dynamic sampling) with a reward worker of its own.
"""

from __future__ import annotations

import threading
from typing import Literal
from unittest import mock

import pytest

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines.engine import RolloutEngine
from megatron_rl.engines.protocol import FinishReason, GenerateRequest, GenerateResult
from megatron_rl.rollout.partial import continuation_seed, sample_seeds
from tests.rollout_managers import build_manager

N = 4
SEED = 1234


def _sent_requests(engine_kind: Literal["sglang", "reference"], seed: int | None) -> list[GenerateRequest]:
    sent: list[GenerateRequest] = []
    lock = threading.Lock()

    def generate(request: GenerateRequest, **_: object) -> list[GenerateResult]:
        with lock:
            sent.append(request)
        stop = FinishReason("stop", matched=2)
        return [
            GenerateResult([2], [-0.5], stop, len(request.input_ids), "0") for _ in range(request.sampling_params.n)
        ]

    engine = mock.Mock(spec=RolloutEngine)
    engine.name = "stand-in"
    engine.generate.side_effect = generate
    dataset = PromptDataset([PromptItem(i, [i + 1, 3], "mixed", "test") for i in range(3)], 0)
    manager = build_manager(
        [engine],
        dataset,
        PromptSampler(3, 3, seed=0, shuffle=False),
        RolloutConfig(engine=engine_kind, n_samples_per_prompt=N, max_response_length=4),
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        prompts_per_step=3,
        reward="tests.rollout_rewards:first_token_parity",
        reward_num_workers=1,
        reward_timeout_s=30.0,
        decode=lambda ids: " ".join(map(str, ids)),
        seed=seed,
    )
    try:
        manager.generate_step()
    finally:
        manager.close()
    return sorted(sent, key=lambda request: str(request.rid))


@pytest.fixture(scope="module")
def sent() -> dict[tuple[str, int | None], list[GenerateRequest]]:
    return {(kind, seed): _sent_requests(kind, seed) for kind in ("sglang", "reference") for seed in (SEED, None)}


def test_sglang_requests_carry_a_seed_per_sample_derived_from_the_groups_seed(sent):
    """SGLang seeds each sample on its own (under deterministic inference), so a group's one seed would make its
    samples alike: sample i carries window 0 of the seeds its continuations use (``continuation_seed``)."""
    requests = sent["sglang", SEED]
    assert [r.rid for r in requests] == ["g3", "g4", "g5"]  # serials count from the sampler's position after
    for request in requests:
        group_seed = SEED * 2**32 + int(str(request.rid)[1:])
        assert request.sampling_params.sampling_seed is None and request.sampling_params.n == N
        assert request.sample_seeds == sample_seeds(group_seed, N)
        assert request.sample_seeds == [continuation_seed(group_seed, i, 0) for i in range(N)]
        body = request.to_json()
        assert [params["sampling_seed"] for params in body["sampling_params"]] == request.sample_seeds
    assert len({seed for r in requests for seed in r.sample_seeds or ()}) == 3 * N


def test_reference_requests_are_unchanged_one_seed_per_request(sent):
    """The reference engine draws a request's samples from one generator seeded with the group's seed: its
    requests, and with them the tiny recipes' runs, stay as they were."""
    for request in sent["reference", SEED]:
        group_seed = SEED * 2**32 + int(str(request.rid)[1:])
        assert request.sample_seeds is None and request.sampling_params.sampling_seed == group_seed
        assert isinstance(request.to_json()["sampling_params"], dict)


@pytest.mark.parametrize("kind", ["sglang", "reference"])
def test_an_unseeded_manager_sends_no_seed(sent, kind):
    for request in sent[kind, None]:
        assert request.sample_seeds is None and request.sampling_params.sampling_seed is None
