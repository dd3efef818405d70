"""LoRA adapters on this rank's Megatron GPTModel chunks (their PEFT files: :mod:`~megatron_rl.models.lora_peft`).

:func:`apply_lora` wraps the adapted linears of every decoder layer in :class:`LoRALinear` and freezes
everything else: attention ``linear_qkv`` (q_proj, k_proj, v_proj), ``linear_proj`` (o_proj), and the
``linear_fc1`` (gate_proj, up_proj) and ``linear_fc2`` (down_proj) of a dense MLP or of each local expert
of a ``SequentialMLP``: the local (CPU) spec. The Transformer Engine spec (norm-fused linears, grouped
experts) is refused for now.

Each Hugging Face projection has its own ``A [r, in]`` and ``B [out, r]``, as PEFT's; the update is
``(alpha / r) B A x``. Sharding follows :mod:`megatron_rl.plan.lora_count`: on a column-parallel linear ``A``
is whole and ``B`` holds this rank's output rows (for q/k/v: the rows of this rank's query groups, placed in
the fused q/k/v-per-group order of :class:`~megatron_rl.models.weight_layouts.FusedQKV`); on a row-parallel
linear ``A`` holds this rank's input columns and ``B`` is whole. The low-rank activation ``A x`` carries
the tensor-parallel communication (Megatron's mappings), so forward and backward are exact:

- dense column-parallel: gathered from the sequence-parallel region (SP) or copied to the TP region;
- dense row-parallel: reduce-scattered to the sequence-parallel region (SP) or all-reduced;
- experts: none on the activation: the token dispatcher gathers their tokens over expert TP and reduces
  their outputs, as for the base linear. The whole ``A`` (fc1) and ``B`` (fc2) pass through
  ``copy_to_tensor_model_parallel_region`` over expert TP instead (identity forward, all-reduce backward):
  each expert-TP rank's gradient of them covers only its share of the output (fc1) or of the input (fc2).

Parameter attributes follow Megatron's linears: the split factor carries ``tensor_model_parallel`` and its
``partition_dim``; expert factors copy the base weight's ``allreduce`` (False: reduced over expert DP). Under
sequence parallelism the whole ``A`` (column) and ``B`` (row) of dense linears see one sequence shard each
and carry ``sequence_parallel = True``, so Megatron's ``finalize_model_grads`` all-reduces their gradients
over TP as it does the norms'.

Run checkpoints (:meth:`LoRALinear.sharded_state_dict`): the base keeps the ``torch_dist`` keys it has without
LoRA (``...linear_qkv.weight``; fc1's gate/up split of Megatron's MLP applies as before), so a LoRA checkpoint holds a
complete base model under the usual names; each factor is one more tensor, ``<linear>.lora_A.<target>`` /
``<linear>.lora_B.<target>`` (``decoder.layers.3.self_attention.linear_qkv.lora_B.k_proj``,
``decoder.layers.0.mlp.experts.experts.linear_fc1.lora_A.gate_proj`` with the expert axis), the whole Hugging
Face-shaped factor sharded on the dimension this rank splits, so it loads at any layout.

Initialisation (PEFT's default): ``A`` kaiming-uniform with ``a = sqrt(5)``, ``B`` zero. ``A`` is drawn whole
from a generator seeded by ``(seed, Hugging Face name)`` and then sliced, so the adapter is the same under
every parallel layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint
from torch import nn

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import LoRAConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class Projection:
    """One adapted Hugging Face projection inside a Megatron linear.

    ``target``: its recipe name (``q_proj``); ``hf_name``: its module name (``model.layers.{i}.self_attn.q_proj``);
    ``fan_in``/``fan_out``: its whole shape.
    """

    target: str
    hf_name: str
    fan_in: int
    fan_out: int


class LoRALinear(nn.Module):
    """A Megatron column- or row-parallel linear plus the adapters of its projections (module docstring).

    Returns what the base returns, ``(output, bias)``, with ``(alpha / r) B A x`` added to the output.
    ``projections`` lists every projection the base fuses, in its fused order; only ``adapted`` ones have
    parameters (a missing one contributes zeros).
    """

    def __init__(
        self,
        base: nn.Module,
        projections: Sequence[Projection],
        adapted: Sequence[str],
        lora: LoRAConfig,
        *,
        row_parallel: bool,
        expert: bool,
        qkv_groups: int | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.projections = tuple(projections)
        self.row_parallel = row_parallel
        self.expert = expert
        self.qkv_groups = qkv_groups
        self.scaling = lora.alpha / lora.rank
        self.disabled = False
        if expert:
            self.group = parallel_state.get_expert_tensor_parallel_group()
            self.rank, self.size = (
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size(),
            )
        else:
            self.group = parallel_state.get_tensor_model_parallel_group()
            self.rank, self.size = (
                parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_world_size(),
            )
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not expert
        weight: torch.Tensor = base.weight  # type: ignore[assignment]  # a Megatron linear's
        dtype, device = weight.dtype, weight.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for proj in self.projections:
            if proj.target not in adapted:
                continue
            a_in = proj.fan_in // self.size if row_parallel else proj.fan_in
            b_out = proj.fan_out if row_parallel else proj.fan_out // self.size
            a = nn.Parameter(torch.zeros(lora.rank, a_in, dtype=dtype, device=device))
            b = nn.Parameter(torch.zeros(b_out, lora.rank, dtype=dtype, device=device))
            whole, split = (b, a) if row_parallel else (a, b)
            # Megatron's grad norm and finalize_model_grads read these, as on the base weights
            set_tensor_model_parallel_attributes(split, True, 1 if row_parallel else 0, 1)
            whole.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
            for factor in (a, b):
                factor.allreduce = getattr(weight, "allreduce", True)  # type: ignore[attr-defined]
            self.lora_A[proj.target], self.lora_B[proj.target] = a, b
        self.register_load_state_dict_pre_hook(_base_entries_to_base)

    def __getattr__(self, name: str) -> Any:
        """The base linear's attributes (``weight``, ``backward_dw``, ...), which Megatron's modules read."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base":
                raise
            return getattr(self.base, name)

    def shard_dims(self) -> tuple[int | None, int | None]:
        """Dimension of the whole tensor this rank's ``A`` and ``B`` are a block of (None: whole)."""
        if self.size == 1:
            return None, None
        return (1, None) if self.row_parallel else (None, 0)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The base's entries under its keys without LoRA (``<prefix>weight``, ...), and each factor under
        ``<prefix>lora_A.<target>`` / ``<prefix>lora_B.<target>`` (module docstring), its ``data`` the parameter itself
        (the distributed optimizer finds its state's keys by it). Loading puts the base's entries back under
        ``base.`` (a load_state_dict pre-hook)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state: dict[str, Any] = sharded_state_dict_default(self.base, prefix, sharded_offsets, metadata)
        groups = {"tp_group": self.group, "dp_cp_group": metadata["dp_cp_group"]}
        for factor, dim in zip(("lora_A", "lora_B"), self.shard_dims(), strict=True):
            for target, param in getattr(self, factor).items():
                key = f"{prefix}{factor}.{target}"
                state[key] = (
                    make_sharded_tensor_for_checkpoint(param, key, sharded_offsets, **groups)
                    if dim is None
                    else make_tp_sharded_tensor_for_checkpoint(
                        param, key, dim, prepend_offsets=sharded_offsets, **groups
                    )
                )
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, bias = self.base(*args, **kwargs)
        if self.disabled or not self.lora_A:
            return output, bias
        return output + self._delta(args[0]), bias

    def _whole(self, factor: torch.Tensor) -> torch.Tensor:
        """An expert's whole factor, its gradient summed over expert TP (module docstring)."""
        if not self.expert or self.size == 1:
            return factor
        summed: torch.Tensor = copy_to_tensor_model_parallel_region(factor, group=self.group)
        return summed

    def _low_rank(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = x @ (a if self.row_parallel else self._whole(a)).t()
        if self.expert or self.size == 1:
            return h
        if self.row_parallel:
            reduced: torch.Tensor = (
                reduce_scatter_to_sequence_parallel_region(h, group=self.group)
                if self.sequence_parallel
                else reduce_from_tensor_model_parallel_region(h, group=self.group)
            )
            return reduced
        gathered: torch.Tensor = (
            gather_from_sequence_parallel_region(h, group=self.group)
            if self.sequence_parallel
            else copy_to_tensor_model_parallel_region(h, group=self.group)
        )
        return gathered

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        parts: list[torch.Tensor | None] = []
        for proj in self.projections:
            if proj.target in self.lora_A:
                h = self._low_rank(x, self.lora_A[proj.target])
                b = self.lora_B[proj.target]
                parts.append((h @ (self._whole(b) if self.row_parallel else b).t()) * self.scaling)
            else:
                parts.append(None)
        shapes = [p.shape for p in parts if p is not None]
        lead = shapes[0][:-1]
        widths = [proj.fan_out if self.row_parallel else proj.fan_out // self.size for proj in self.projections]
        filled = [p if p is not None else x.new_zeros((*lead, w)) for p, w in zip(parts, widths, strict=True)]
        if self.row_parallel:
            return filled[0]
        if self.qkv_groups is None:
            return torch.cat(filled, dim=-1)
        groups = self.qkv_groups // self.size
        per_group = [p.reshape(*lead, groups, p.shape[-1] // groups) for p in filled]
        return torch.cat(per_group, dim=-1).reshape(*lead, -1)


def _base_entries_to_base(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state-dict pre-hook of :class:`LoRALinear`: entries under the base's keys without LoRA
    (``<prefix>weight``, as :meth:`LoRALinear.sharded_state_dict` saves them) belong to ``<prefix>base.``."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        local = key[len(prefix) :]
        if local.split(".", 1)[0] not in module._modules:  # base, lora_A, lora_B
            state_dict[f"{prefix}base.{local}"] = state_dict.pop(key)


def _attention_projections(arch: QwenArchitecture, prefix: str) -> list[Projection]:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    return [
        Projection("q_proj", f"{prefix}.self_attn.q_proj", h, q),
        Projection("k_proj", f"{prefix}.self_attn.k_proj", h, kv),
        Projection("v_proj", f"{prefix}.self_attn.v_proj", h, kv),
    ]


def _wrap_mlp(mlp: Any, prefix: str, hidden: int, ffn: int, lora: LoRAConfig, expert: bool) -> list[LoRALinear]:
    targets = set(lora.target_modules)
    wrapped = []
    fc1 = [Projection(t, f"{prefix}.{t}", hidden, ffn) for t in ("gate_proj", "up_proj")]
    if targets & {"gate_proj", "up_proj"}:
        mlp.linear_fc1 = LoRALinear(mlp.linear_fc1, fc1, sorted(targets), lora, row_parallel=False, expert=expert)
        wrapped.append(mlp.linear_fc1)
    if "down_proj" in targets:
        fc2 = [Projection("down_proj", f"{prefix}.down_proj", ffn, hidden)]
        mlp.linear_fc2 = LoRALinear(mlp.linear_fc2, fc2, ["down_proj"], lora, row_parallel=True, expert=expert)
        wrapped.append(mlp.linear_fc2)
    return wrapped


def _wrap_layer(layer: Any, arch: QwenArchitecture, lora: LoRAConfig) -> list[LoRALinear]:
    index = layer.layer_number - 1
    prefix = f"model.layers.{index}"
    targets = set(lora.target_modules)
    attention = layer.self_attention
    if hasattr(attention.linear_qkv, "layer_norm_weight"):
        # Transformer Engine's spec fuses the input norm into linear_qkv (and the pre-MLP norm into fc1): the
        # adapter would read the un-normalised input
        raise NotImplementedError("LoRA on the Transformer Engine spec (norm-fused linears) is not built yet")
    wrapped: list[LoRALinear] = []
    if targets & {"q_proj", "k_proj", "v_proj"}:
        attention.linear_qkv = LoRALinear(
            attention.linear_qkv,
            _attention_projections(arch, prefix),
            sorted(targets),
            lora,
            row_parallel=False,
            expert=False,
            qkv_groups=arch.num_query_groups,
        )
        wrapped.append(attention.linear_qkv)
    if "o_proj" in targets:
        o_proj = [
            Projection(
                "o_proj", f"{prefix}.self_attn.o_proj", arch.num_attention_heads * arch.head_dim, arch.hidden_size
            )
        ]
        attention.linear_proj = LoRALinear(
            attention.linear_proj, o_proj, ["o_proj"], lora, row_parallel=True, expert=False
        )
        wrapped.append(attention.linear_proj)
    mlp = layer.mlp
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return wrapped + _wrap_mlp(mlp, f"{prefix}.mlp", arch.hidden_size, arch.ffn_hidden_size, lora, expert=False)
    if not hasattr(experts, "local_experts"):
        raise NotImplementedError(
            f"LoRA on {type(experts).__name__} experts is not built yet: only SequentialMLP (the local spec)"
        )
    first = parallel_state.get_expert_model_parallel_rank() * len(experts.local_experts)
    for local, expert_mlp in enumerate(experts.local_experts):
        wrapped += _wrap_mlp(
            expert_mlp,
            f"{prefix}.mlp.experts.{first + local}",
            arch.hidden_size,
            arch.moe_ffn_hidden_size,
            lora,
            expert=True,
        )
    return wrapped


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _block(tensor: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return tensor if dim is None else tensor.chunk(size, dim=dim)[rank]


def _init_adapter(module: LoRALinear, seed: int) -> None:
    a_dim, _ = module.shard_dims()
    with torch.no_grad():
        for proj in module.projections:
            if proj.target not in module.lora_A:
                continue
            a = module.lora_A[proj.target]
            whole = torch.empty(a.shape[0], proj.fan_in, dtype=torch.float32)
            generator = torch.Generator().manual_seed(_seed(seed, f"{proj.hf_name}.lora_A"))
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            a.copy_(_block(whole, a_dim, module.rank, module.size))
            module.lora_B[proj.target].zero_()


def apply_lora(
    chunks: Sequence[GPTModel], arch: QwenArchitecture, lora: LoRAConfig, *, seed: int = 0
) -> list[LoRALinear]:
    """Wrap this rank's adapted linears in :class:`LoRALinear`, initialised as PEFT does, and freeze the rest.

    Afterwards only adapter parameters have ``requires_grad``. Refuses ``experts_shared_outer`` and dropout
    (not built; the recipe check keeps dropout 0).
    """
    if lora.experts_shared_outer or lora.dropout:
        raise NotImplementedError("LoRA with experts_shared_outer or dropout is not built yet")
    for chunk in chunks:
        chunk.requires_grad_(False)
    wrapped = [
        module for chunk in chunks for layer in chunk.decoder.layers for module in _wrap_layer(layer, arch, lora)
    ]
    for module in wrapped:
        _init_adapter(module, seed)
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    return wrapped


def lora_modules(chunks: Sequence[nn.Module]) -> Iterator[LoRALinear]:
    """The :class:`LoRALinear` modules of ``chunks``, in model order."""
    for chunk in chunks:
        yield from (m for m in chunk.modules() if isinstance(m, LoRALinear))


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[nn.Module]) -> Iterator[None]:
    """Run the base model: inside, every adapter of ``chunks`` adds nothing (the reference policy)."""
    modules = list(lora_modules(chunks))
    for module in modules:
        module.disabled = True
    try:
        yield
    finally:
        for module in modules:
            module.disabled = False
