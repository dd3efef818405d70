"""The tiny DAPO recipe end to end for three steps: metrics per step, validation, committed checkpoints.

The run exports Hugging Face weights at each save (``checkpoint.export_hf``): the latest
checkpoint's ``hf/`` loads with transformers and equals what ``convert mcore-to-hf`` writes from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint

ROOT = Path(__file__).resolve().parents[2]
STEP_KEYS = {
    "train/reward_mean",
    "train/accuracy",
    "train/response_length_mean",
    "train/length_wrong_over_correct",
    "train/truncation_rate",
    "rollout/groups_dropped",
    "actor/policy_loss",
    "actor/grad_norm",
    "actor/mismatch_abs_max",
    "time/generate_s",
    "time/train_s",
    "time/weight_sync_s",
    "perf/tokens_per_s",
    "actor/time_old_log_probs_s",
    "data/step_bytes",
}


@pytest.mark.slow
def test_three_steps_log_every_metric_and_commit_checkpoints(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")]
    command += [
        "train.steps=3",
        "train.prompts_per_step=4",
        "algorithm.dynamic_sampling.gen_batch_prompts=16",
        "validation.interval=3",
        "checkpoint.interval=2",
    ]
    command += ["data.synthetic.num_val=16", "logging.sinks=[jsonl]", "checkpoint.export_hf=true"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]

    run_dir = tmp_path / "runs" / "tiny-moe-cpu-dapo"
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # Both of the default recipe's sets run before step 1 and after the last: greedy, and sampled with its ks.
    sampled = {
        f"val/sampled/{metric}" for metric in ("mean@8", "pass@1", "pass@4", "pass@8", "maj@1", "maj@4", "maj@8")
    }
    for record in (records[0], records[3]):
        assert {"val/greedy/mean@1", "val/greedy/reward_mean", "val/greedy/truncated_fraction", *sampled} <= set(record)
        assert record["val/sampled/pass@1"] == record["val/sampled/mean@8"]  # the unbiased estimator at k=1
        assert record["val/sampled/mean@8"] <= record["val/sampled/pass@4"] <= record["val/sampled/pass@8"]
    assert not any(key.startswith("val/") for record in records[1:3] for key in record)
    for record in records[1:]:
        # At random init few groups have 0 < #correct < G; over-sampling 16 prompts finds them, so every step trains.
        assert record["train/update_skipped"] == 0.0, record
        assert set(record) >= STEP_KEYS, f"step {record['step']} lacks {sorted(STEP_KEYS - set(record))}"
        assert record["actor/mismatch_abs_max"] < 1e-3  # trainer and engine hold the same weights
        # DP 2: each rank received exactly half of the step's samples (the trainer group checks the ids) and
        # about half of its bytes, not the whole step.
        half = record["data/step_samples"] / 2
        assert record["data/rank_samples_max"] == record["data/rank_samples_min"] == half
        assert record["data/rank_bytes_over_fair"] < 1.10

    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002", "step_000003"]
    state = json.loads((checkpoints / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 3
    assert sorted(p.name for p in (checkpoints / "step_000003" / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]

    exported = tmp_path / "hf"
    convert = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf", "--ckpt", str(checkpoints)]
    result = subprocess.run(
        [*convert, "--out", str(exported)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    trained, initial = (
        load_file(exported / "model.safetensors"),
        load_file(run_dir / "initial_hf" / "model.safetensors"),
    )
    assert trained.keys() == initial.keys()
    assert not torch.equal(trained["lm_head.weight"], initial["lm_head.weight"])  # three steps of training
    assert (exported / "tokenizer.json").is_file() and (exported / "config.json").is_file()
    _assert_hf_export_equals_conversion(checkpoints / "step_000003" / "hf", exported)
    assert (checkpoints / "step_000002" / "hf" / "config.json").is_file()


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = SafetensorsCheckpoint(hf_dir)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


def _assert_hf_export_equals_conversion(hf_dir: Path, converted_dir: Path) -> None:
    """``hf_dir`` (written at save by two ranks: sharded + index) loads and holds the converter's tensors bitwise."""
    assert (hf_dir / "model.safetensors.index.json").is_file()
    saved, converted = _tensors(hf_dir), _tensors(converted_dir)
    assert saved.keys() == converted.keys()
    for name, tensor in converted.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    assert (hf_dir / "config.json").read_text() == (converted_dir / "config.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert torch.equal(model.state_dict()["lm_head.weight"], converted["lm_head.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.eos_token_id == model.config.eos_token_id
