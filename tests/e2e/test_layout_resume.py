"""Resume at another layout: a run saved at TP2 continues at TP1 x PP2 with the same weights and optimizer state.

The straight run trains 3 steps at TP2 (checkpoint every step). The moved run resumes from the
straight run's step-2 checkpoint at TP1 x PP2 and trains step 3. Step 3's rollouts depend only
on the restored weights (synced to the engine) and the sampler, so they are identical; the
update of step 3 depends on the restored Adam moments and schedule, so the moved run's
step-3 weights and moments match the straight run's up to summation order. A restart with
fresh moments would make a first-step Adam update instead, off by about its own size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.tiny_runs import RUN, full_tensors, read_metrics, run_train

COMMON = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=0",
    "logging.sinks=[jsonl]",
]
COMMON += ["checkpoint.interval=1", "checkpoint.keep_last=3"]
TP2 = ["parallel.tp=2", "parallel.ep=1", "parallel.sequence_parallel=true"]
PP2 = ["parallel.pp=2", "parallel.ep=1"]
EXACT_PREFIXES = ("train/", "rollout/groups", "rollout/samples")
VOCAB_SIZE = 32  # the tiny recipe's; embedding rows beyond it are padding (128 x tp of them)


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _unpadded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    vocab_keys = ("embedding.word_embeddings.weight", "output_layer.weight")
    return {key: value[:VOCAB_SIZE] if key.endswith(vocab_keys) else value for key, value in tensors.items()}


@pytest.mark.slow
def test_run_saved_at_tp2_continues_at_tp1_pp2_with_the_same_state(tmp_path: Path) -> None:
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    straight.mkdir()
    moved.mkdir()
    run_train(straight, [*COMMON, *TP2])
    saved = straight / RUN / "checkpoints" / "step_000002"
    output = run_train(moved, [*COMMON, *PP2, f"checkpoint.resume={saved}"])

    assert "step_000002 was saved at tp2 pp1 vpp1 cp1 ep1 etp2 (2 ranks)" in output
    assert "continuing at tp1 pp2 vpp1 cp1 ep1 etp1 (2 ranks)" in output
    expected, actual = read_metrics(straight / RUN)[-1], read_metrics(moved / RUN)[-1]
    assert actual["step"] == expected["step"] == 3
    exact = {key: value for key, value in expected.items() if key.startswith(EXACT_PREFIXES)}
    assert exact and {key: actual[key] for key in exact} == exact  # rollouts from bit-identical synced weights
    assert actual["actor/policy_loss"] == pytest.approx(expected["actor/policy_loss"], rel=1e-4, abs=1e-6)
    assert actual["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)

    before = _unpadded(full_tensors(saved, tmp_path))
    after_straight = _unpadded(full_tensors(straight / RUN / "checkpoints" / "step_000003", tmp_path))
    after_moved = _unpadded(full_tensors(moved / RUN / "checkpoints" / "step_000003", tmp_path))
    assert after_moved.keys() == after_straight.keys()
    for key, value in after_straight.items():
        assert _relative_difference(after_moved[key], value) < 1e-4, key
        if not key.startswith("optimizer."):
            step_update = value - before[key]
            assert _relative_difference(after_moved[key] - before[key], step_update) < 1e-3, key
    scheduler = [torch.load(run / RUN / "checkpoints" / "step_000003" / "scheduler.pt") for run in (straight, moved)]
    assert scheduler[0] == scheduler[1]
