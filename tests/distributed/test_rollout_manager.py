"""The rollout manager against a real reference engine and reward worker processes.

Prompts alternate between ``constant`` (every sample scores 1: no signal, so
dynamic sampling drops the group) and ``mixed`` (the score is the parity of
the first sampled token, so most groups of 4 vary); see ``tests/rollout_rewards.py``.
"""

from __future__ import annotations

import threading

import pytest

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.rollout.manager import RolloutExhaustedError, RolloutManager
from tests.reference_servers import reference_process
from tests.rollout_managers import build_manager
from tests.tiny_checkpoints import save_tiny_moe

REWARD = "tests.rollout_rewards:first_token_parity"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    with reference_process(save_tiny_moe(root / "moe"), root, routed_experts_shape=(4, 2)) as engine:
        yield engine


def _dataset(truths: list[str]) -> PromptDataset:
    return PromptDataset([PromptItem(i, [i % 50 + 1, 3], truth, "test") for i, truth in enumerate(truths)], 0)


def _manager(
    engine, truths, *, gen_batch, prompts_per_step, max_new, max_gen_batches=4, shuffle=True, **kwargs
) -> RolloutManager:
    rollout = RolloutConfig(engine="reference", n_samples_per_prompt=4, max_response_length=max_new)
    rollout = rollout.model_copy(update={"max_concurrent_requests": 4})
    return build_manager(
        [engine],
        _dataset(truths),
        PromptSampler(len(truths), gen_batch, seed=0, shuffle=shuffle),
        rollout,
        OverlongConfig(enable=True, buffer_length=4, penalty_factor=0.5, filter_truncated=True),
        DynamicSamplingConfig(enable=True, max_gen_batches=max_gen_batches),
        prompts_per_step=prompts_per_step,
        reward=REWARD,
        reward_num_workers=2,
        reward_timeout_s=30.0,
        decode=lambda ids: " ".join(map(str, ids)),
        routing_replay=True,
        **kwargs,
    )


@pytest.mark.distributed
def test_dynamic_sampling_fills_the_step_and_aborts_the_surplus(engine):
    manager = _manager(engine, ["constant", "mixed"] * 12, gen_batch=12, prompts_per_step=2, max_new=16)
    try:
        batch = manager.generate_step()
    finally:
        manager.close()
    metrics = batch.metrics
    assert len(batch.groups) == 2 and metrics["rollout/groups_kept"] == 2
    assert metrics["rollout/groups_aborted"] >= 1, metrics
    assert metrics["rollout/groups_kept"] + metrics["rollout/groups_dropped"] + metrics["rollout/groups_aborted"] == 12
    assert len({g.uid for g in batch.groups}) == 2
    for group in batch.groups:
        assert len(set(group.scores)) > 1
        for sample in group.samples:
            assert sample.truncated and sample.overlong_penalty == -0.5 and set(sample.loss_mask) == {0}
            assert len(sample.rollout_logprobs) == len(sample.response_ids) == 16
            assert sample.routed_experts is not None and sample.routed_experts.shape == (2 + 16 - 1, 4, 2)
    assert [len(group.samples) for group in batch.groups] == [4, 4]


@pytest.mark.distributed
def test_dynamic_sampling_without_signal_raises_after_max_gen_batches(engine):
    manager = _manager(engine, ["constant"] * 4, gen_batch=2, prompts_per_step=2, max_new=4, max_gen_batches=2)
    try:
        with pytest.raises(RolloutExhaustedError, match="kept 0 of 2 groups after 2 generation batches"):
            manager.generate_step()
    finally:
        manager.close()


class _HoldingEngine:
    """The engine, except that the request for the prompt starting with ``held`` answers only once a
    request for a prompt starting with one of ``awaited`` has been sent (``overlapped``), or after 30 s."""

    def __init__(self, engine, held: int, awaited: set[int]) -> None:
        self.engine, self.held, self.awaited = engine, held, awaited
        self.awaited_sent = threading.Event()
        self.overlapped = False

    def generate(self, request, **kwargs):
        if request.input_ids[0] in self.awaited:
            self.awaited_sent.set()
        results = self.engine.generate(request, **kwargs)
        if request.input_ids[0] == self.held:
            self.overlapped = self.awaited_sent.wait(30)
        return results

    def abort(self, rid=None):
        self.engine.abort(rid)


def _step(manager: RolloutManager):
    try:
        return manager.generate_step()
    finally:
        manager.close()


@pytest.mark.distributed
def test_the_next_batch_goes_out_while_the_last_group_generates_and_keeps_the_same_groups(engine):
    # Unshuffled, the first batch is prompts 0-3 (ids [1, 3] .. [4, 3]): three without signal, so once they are
    # dropped the step (2 groups) cannot be filled by prompt 3 alone and the second batch (4-7) is certain
    # to be needed. Prompt 3's answer is held until a request of the second batch has been sent.
    truths = ["constant"] * 3 + ["mixed"] * 5
    settings = {"gen_batch": 4, "prompts_per_step": 2, "max_new": 6, "max_gen_batches": 2, "shuffle": False}
    holding = _HoldingEngine(engine, held=4, awaited={5, 6, 7, 8})
    early = _step(_manager(holding, truths, seed=11, uid_prefix="early", **settings))
    assert holding.overlapped
    sequential = _step(_manager(engine, truths, seed=11, uid_prefix="sequential", early_batches=False, **settings))

    def outcome(step, prefix):
        groups = [
            (g.uid.removeprefix(prefix), [(s.response_ids, s.rollout_logprobs, s.score) for s in g.samples])
            for g in step.groups
        ]
        return groups, {name: value for name, value in step.metrics.items() if name != "rollout/seconds"}

    assert outcome(early, "early") == outcome(sequential, "sequential")
    assert early.metrics["rollout/gen_batches"] == 2 and early.metrics["rollout/groups_dropped"] >= 3
