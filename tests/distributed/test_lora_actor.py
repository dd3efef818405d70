"""The LoRA trainer: ``PolicyActor(..., lora=...)`` at TP2 x EP2 (sequence parallel, 4 gloo ranks, bf16 as on GPU).

One training run answers most tests (``lora_run``): it builds the actor on the tiny 2-layer Qwen3-MoE, takes two
steps with the KL loss on (so the reference pass runs inside the step), compares the reference log-probs with a
plain actor built from the same weights without LoRA, round-trips offload/reload, saves a run checkpoint and
takes one more step. Two more runs load that checkpoint: one at the same layout into an actor whose base is
Megatron's random init (the checkpoint carries the base), which must continue bitwise; one at PP2 x EP1, which
must hold the same weights, adapter and optimizer state (its re-save equals the original tensor for tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.transformer.module import MegatronModule
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_rl.actor.policy_actor import PolicyActor
from megatron_rl.actor.train_step import train_step
from megatron_rl.checkpoint.layout import MEGATRON_DIR
from megatron_rl.checkpoint.megatron_state import load_megatron_state, save_megatron_state
from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.lora import lora_modules
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.plan.lora_count import stage_adapter
from megatron_rl.plan.param_count import ParamCount, stage_params
from tests.actor_setup import (
    algorithm_config,
    fixed_batch,
    parallel_config,
    rank_shard,
    save_tiny_moe_2layer,
    train_config,
)
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import VOCAB

pytestmark = pytest.mark.distributed

LORA = LoRAConfig(rank=2, alpha=4.0)
SIZES = ParallelSizes(tp=2, ep=2, etp=1)
OTHER_LAYOUT = ParallelSizes(pp=2)
_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")  # torch Adam's per-parameter state ("step": a scalar)


def _actor(hf_dir: Path, sizes: ParallelSizes, *, lora: LoRAConfig | None, load_weights: bool = True) -> PolicyActor:
    train = train_config(steps=4, lr=0.05, adam_eps=1e-8, precision="bf16", weight_decay=0.1)
    return PolicyActor(
        load_hf_config(hf_dir),
        parallel_config(sizes),
        train,
        algorithm_config(use_kl_loss=True, kl_coef=0.5, entropy_coef=0.01),
        norm_constant=16,
        temperature=1.0,
        hf_weights=hf_dir if load_weights else None,
        lora=lora,
        lora_seed=7,
    )


def _adapter_ids(actor: PolicyActor) -> set[int]:
    return {id(p) for m in lora_modules(actor.chunks) for p in (*m.lora_A.values(), *m.lora_B.values())}


def _count(params: list[torch.nn.Parameter]) -> ParamCount:
    """Elements of ``params``, expert-parallel ones (Megatron's ``allreduce=False``) apart."""
    expert = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    return ParamCount(dense=sum(p.numel() for p in params) - expert, expert=expert)


def _memory_model_facts(actor: PolicyActor) -> dict[str, Any]:
    """What Megatron built, counted as the planner counts it: frozen base, adapters, buffers, optimizer state.

    The optimizer's per-rank shards are summed over the data-parallel group that shards them (dense: DP x CP;
    experts: expert DP), so the sums are whole adapter counts.
    """
    from megatron.core import parallel_state

    adapters = _adapter_ids(actor)
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    buffered = {
        kind: [p for model in actor.models for buffer in getattr(model, kind) for p in buffer.params]
        for kind in ("buffers", "expert_parallel_buffers")
    }
    sharded: dict[str, dict[str, int]] = {}
    for part in actor.optimizer.optimizer.chained_optimizers:
        kind = "expert" if part.optimizer.param_groups[0]["is_expert_parallel"] else "dense"
        states = list(part.optimizer.state.values())
        main = [p for group in part.shard_fp32_from_float16_groups for p in group]
        numel = torch.tensor(
            [
                sum(s["exp_avg"].numel() for s in states),
                sum(s["exp_avg_sq"].numel() for s in states),
                sum(p.numel() for p in main),
                sum(v.numel() for s in states for k, v in s.items() if k not in _ADAM_STATE and torch.is_tensor(v)),
            ]
        )
        group = (
            parallel_state.get_expert_data_parallel_group()
            if kind == "expert"
            else parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        dist.all_reduce(numel, group=group)
        sharded[kind] = dict(zip(("exp_avg", "exp_avg_sq", "main_params", "other_state"), numel.tolist(), strict=True))
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "frozen": _count([p for p in params if not p.requires_grad]),
        "frozen_are_base": {id(p) for p in params if not p.requires_grad} == {id(p) for p in params} - adapters,
        "adapters": _count([p for p in params if id(p) in adapters]),
        "buffered_are_adapters": {id(p) for kind in buffered.values() for p in kind} == adapters,
        "buffered": ParamCount(
            dense=sum(p.numel() for p in buffered["buffers"]),
            expert=sum(p.numel() for p in buffered["expert_parallel_buffers"]),
        ),
        "frozen_without_main_grad": all(not hasattr(p, "main_grad") for p in params if not p.requires_grad),
        "optimizer": sharded,
        "no_reference_copy": actor._reference is None,
    }


def _named(actor: PolicyActor) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for chunk in actor.chunks for name, p in chunk.named_parameters()}


def _state_tensors(actor: PolicyActor) -> list[torch.Tensor]:
    """Every parameter (frozen ones too), DDP gradient buffer and optimizer tensor, cloned."""
    tensors = [p.detach().clone() for model in actor.models for p in model.parameters()]
    tensors += [b.grad_data.clone() for m in actor.models for b in [*m.buffers, *m.expert_parallel_buffers]]
    for part in actor.optimizer.optimizer.chained_optimizers:
        tensors += [p.detach().clone() for group in part.optimizer.param_groups for p in group["params"]]
        tensors += [v.clone() for s in part.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return tensors


def _checkpoint_keys(actor: PolicyActor, plain_chunks: Sequence[MegatronModule]) -> dict[str, set[str]]:
    """Keys of the model's ``torch_dist`` tensors on every rank: the LoRA model's and the plain model's."""

    def keys(chunks: Sequence[MegatronModule]) -> set[str]:
        return {item.key for chunk in chunks for item in nested_values(chunk.sharded_state_dict())}

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (keys(actor.chunks), keys(plain_chunks)))
    return {
        "lora": set().union(*(lora for lora, _ in everyone)),
        "plain": set().union(*(plain for _, plain in everyone)),
    }


def _lora_rank(rank: int, world_size: int, hf_dir: Path, ckpt_dir: Path, batch) -> dict[str, Any]:
    initialize_parallel(SIZES)
    actor = _actor(hf_dir, SIZES, lora=LORA)
    shard = rank_shard(batch)
    adapters = _adapter_ids(actor)
    names = {name for chunk in actor.chunks for name, p in chunk.named_parameters() if id(p) in adapters}
    result: dict[str, Any] = {"sample_ids": shard.sample_ids}
    before = _named(actor)
    result["steps"] = [train_step(actor, shard), train_step(actor, shard)]
    after = _named(actor)
    result["changed"] = {name for name in after if not torch.equal(after[name], before[name])}
    result["adapter_names"] = names
    result["facts"] = _memory_model_facts(actor)

    result["policy"] = actor.log_probs(shard).log_probs
    result["reference"] = actor.log_probs(shard, reference=True).log_probs
    result["policy_again"] = actor.log_probs(shard).log_probs
    plain = _actor(hf_dir, SIZES, lora=None)
    result["plain"] = plain.log_probs(shard).log_probs
    result["keys"] = _checkpoint_keys(actor, plain.chunks)
    del plain

    saved = _state_tensors(actor)
    actor.offload(keep_params=True)
    actor.offload()
    result["bytes_left_after_offload"] = sum(
        p.untyped_storage().nbytes() for model in actor.models for p in model.parameters()
    )
    actor.reload()
    result["identical_after_reload"] = all(torch.equal(a, b) for a, b in zip(saved, _state_tensors(actor), strict=True))

    save_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    result["at_checkpoint"] = _weights_and_adapter(actor)
    result["next"] = train_step(actor, shard)
    result["after_next"] = _weights_and_adapter(actor)
    destroy_parallel()
    return result


def _weights_and_adapter(actor: PolicyActor) -> dict[str, torch.Tensor]:
    """The base's Hugging Face tensors this rank exports and the whole adapter (PEFT names)."""
    return {name: tensor.clone() for name, tensor in actor.export_weights()} | actor.export_adapter()


def _resumed_rank(
    rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path, ckpt_dir: Path, batch, resave_dir: Path | None
) -> dict[str, Any]:
    initialize_parallel(sizes)
    actor = _actor(hf_dir, sizes, lora=LORA, load_weights=False)  # the base comes from the checkpoint
    load_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    result: dict[str, Any] = {"at_checkpoint": _weights_and_adapter(actor)}
    if resave_dir is not None:
        save_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, resave_dir)
    else:
        result["next"] = train_step(actor, rank_shard(batch))
        result["after_next"] = _weights_and_adapter(actor)
    destroy_parallel()
    return result


def _merged(ranks: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """Every rank's exported tensors in one dict (ranks hold different experts and stages; copies agree)."""
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        for name, tensor in result[key].items():
            assert name not in merged or torch.equal(merged[name], tensor), name
            merged[name] = tensor
    return merged


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_actor")
    hf_dir, ckpt_dir = save_tiny_moe_2layer(root / "hf"), root / "ckpt"
    batch = fixed_batch()
    return {
        "hf_dir": hf_dir,
        "ckpt_dir": ckpt_dir,
        "batch": batch,
        "arch": parse_hf_config(load_hf_config(hf_dir)),
        "ranks": run_distributed(_lora_rank, 4, hf_dir, ckpt_dir, batch),
    }


def test_a_step_trains_only_the_adapters(lora_run: dict[str, Any]) -> None:
    for result in lora_run["ranks"]:
        assert all(step["update_skipped"] == 0.0 for step in result["steps"])
        assert result["changed"] == result["adapter_names"], "every adapter factor moved, no base weight did"


def test_megatron_holds_what_the_memory_model_counts(lora_run: dict[str, Any]) -> None:
    """The planner's trainer state for LoRA (``plan/memory.lora_state_amounts``): the frozen base is the whole
    model's ``stage_params`` with no gradient and no optimizer state; the adapters (``stage_adapter``) fill DDP's
    buffers and the distributed optimizer, which keeps an fp32 main copy and two moments of each, nothing else."""
    arch, parallel = lora_run["arch"], parallel_config(SIZES)
    for result in lora_run["ranks"]:
        facts = result["facts"]
        adapter = stage_adapter(arch, LORA, parallel, facts["pp_rank"])
        assert facts["frozen"] == stage_params(arch, parallel, facts["pp_rank"])
        assert facts["frozen_are_base"] and facts["frozen_without_main_grad"]
        assert facts["adapters"] == adapter
        assert facts["buffered_are_adapters"] and facts["buffered"] == adapter
        for kind, numel in (("dense", adapter.dense), ("expert", adapter.expert)):
            optimizer = facts["optimizer"][kind]
            assert optimizer == {"exp_avg": numel, "exp_avg_sq": numel, "main_params": numel, "other_state": 0}, kind
        assert facts["no_reference_copy"]


def test_the_reference_is_the_model_without_lora(lora_run: dict[str, Any]) -> None:
    """Adapters off, the model runs exactly the plain model's computation: bitwise the same log-probs."""
    for result in lora_run["ranks"]:
        assert torch.equal(result["reference"], result["plain"])
        assert (result["policy"] - result["plain"]).abs().max() > 0, "the trained adapter changes the policy"
        assert torch.equal(result["policy_again"], result["policy"]), "the adapters are back on after the reference"


def test_offload_reload_is_bit_identical_and_frees_the_frozen_base(lora_run: dict[str, Any]) -> None:
    for result in lora_run["ranks"]:
        assert result["bytes_left_after_offload"] == 0
        assert result["identical_after_reload"]


def test_checkpoint_keys_are_the_plain_models_plus_one_per_factor(lora_run: dict[str, Any]) -> None:
    keys = lora_run["ranks"][0]["keys"]
    adapter_keys = keys["lora"] - keys["plain"]
    assert keys["plain"] <= keys["lora"], "the base keeps its torch_dist keys"
    expected = set()
    for layer in range(lora_run["arch"].num_layers):
        attention = f"decoder.layers.{layer}.self_attention"
        experts = f"decoder.layers.{layer}.mlp.experts.experts"
        for factor in ("lora_A", "lora_B"):
            expected |= {f"{attention}.linear_qkv.{factor}.{t}" for t in ("q_proj", "k_proj", "v_proj")}
            expected |= {f"{attention}.linear_proj.{factor}.o_proj"}
            expected |= {f"{experts}.linear_fc1.{factor}.{t}" for t in ("gate_proj", "up_proj")}
            expected |= {f"{experts}.linear_fc2.{factor}.down_proj"}
    assert adapter_keys == expected


def test_resume_into_a_fresh_actor_continues_bitwise(lora_run: dict[str, Any]) -> None:
    """The checkpoint is self-contained: an actor built on Megatron's random init takes the base from it."""
    run = lora_run
    resumed = run_distributed(_resumed_rank, 4, SIZES, run["hf_dir"], run["ckpt_dir"], run["batch"], None)
    for straight, again in zip(run["ranks"], resumed, strict=True):
        for key in ("at_checkpoint", "after_next"):
            assert straight[key].keys() == again[key].keys()
            for name, tensor in straight[key].items():
                assert torch.equal(again[key][name], tensor), (key, name)
        assert again["next"]["loss"] == straight["next"]["loss"]
        assert again["next"]["lr"] == straight["next"]["lr"]


def _checkpoint_tensors(ckpt_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every full tensor of a run checkpoint's ``torch_dist`` part, by key."""
    dcp_to_torch_save(ckpt_dir / MEGATRON_DIR, scratch)
    return {key: value for key, value in torch.load(scratch, weights_only=False).items() if torch.is_tensor(value)}


def test_resume_at_another_layout_holds_the_same_state(lora_run: dict[str, Any], tmp_path: Path) -> None:
    """TP2 x EP2 -> PP2: the same base, adapter and optimizer state (re-saved, tensor for tensor; the padded
    vocabulary rows beyond the true vocabulary aside)."""
    run = lora_run
    resave = tmp_path / "resave"
    resumed = run_distributed(_resumed_rank, 2, OTHER_LAYOUT, run["hf_dir"], run["ckpt_dir"], run["batch"], resave)
    straight = _merged(run["ranks"], "at_checkpoint")
    again = _merged(resumed, "at_checkpoint")
    assert straight.keys() == again.keys()
    for name, tensor in straight.items():
        assert torch.equal(again[name], tensor), name
    original = _checkpoint_tensors(run["ckpt_dir"], tmp_path / "original.pt")
    resaved = _checkpoint_tensors(resave, tmp_path / "resaved.pt")
    assert original.keys() == resaved.keys()
    assert any(".exp_avg." in key and ".lora_B." in key for key in original)
    assert not any(".exp_avg." in key and ".lora_" not in key for key in original), "no state for the base"
    for key, tensor in original.items():
        rows = slice(0, VOCAB) if "word_embeddings" in key or "output_layer" in key else slice(None)
        assert torch.equal(resaved[key][rows], tensor[rows]), key


def test_a_plain_actor_exports_no_adapter(lora_run: dict[str, Any]) -> None:
    (result,) = run_distributed(_plain_export_rank, 1, lora_run["hf_dir"])
    assert result == "RuntimeError"


def _plain_export_rank(rank: int, world_size: int, hf_dir: Path) -> str:
    initialize_parallel(ParallelSizes())
    actor = _actor(hf_dir, ParallelSizes(), lora=None)
    try:
        actor.export_adapter()
    except RuntimeError:
        return "RuntimeError"
    finally:
        destroy_parallel()
    return "returned"


def _experts_only_rank(rank: int, world_size: int, hf_dir: Path, ckpt_dir: Path, batch) -> dict[str, Any]:
    """Adapters on the experts alone at EP2: megatron-core's dense optimizer part is a stub with no torch optimizer.
    Step, save, offload/reload, then a fresh actor loads the checkpoint and both take the same next step."""
    initialize_parallel(SIZES)
    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=["gate_proj", "up_proj", "down_proj"])
    actor = _actor(hf_dir, SIZES, lora=lora)
    shard = rank_shard(batch)
    stubs = [getattr(part, "is_stub_optimizer", False) for part in actor.optimizer.optimizer.chained_optimizers]
    train_step(actor, shard)
    save_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    actor.offload()
    actor.reload()
    resumed = _actor(hf_dir, SIZES, lora=lora, load_weights=False)
    load_megatron_state(resumed.chunks, resumed.optimizer.optimizer, resumed.optimizer.scheduler, ckpt_dir)
    losses = [train_step(actor, shard)["loss"], train_step(resumed, shard)["loss"]]
    weights = [_weights_and_adapter(actor), _weights_and_adapter(resumed)]
    destroy_parallel()
    return {"stubs": stubs, "losses": losses, "weights": weights}


def test_experts_only_adapters_train_offload_save_and_resume_bitwise(lora_run: dict[str, Any], tmp_path: Path) -> None:
    ranks = run_distributed(_experts_only_rank, 4, lora_run["hf_dir"], tmp_path / "ckpt", lora_run["batch"])
    for result in ranks:
        assert result["stubs"] == [True, False], "megatron-core builds a stub dense part"
        assert result["losses"][0] == result["losses"][1]
        straight, resumed = result["weights"]
        assert straight.keys() == resumed.keys()
        assert all(torch.equal(resumed[name], tensor) for name, tensor in straight.items())
