"""A Qwen3 / Qwen3-MoE forward over a slot KV cache, batch-invariant by construction.

It reads the parameters of a transformers ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
(so weight updates written into that model are what it computes with) and runs any set of
tokens from any sequences in one call: token t is fed at ``positions[t]`` of cache slot
``slots[t]`` (a slot holds one sequence). Prefill and decode are the same call. Each token's
result depends only on its own slot's cached keys and values and on the weights, never on
the other tokens of the call (:mod:`invariant_ops`), so a request's response does not depend
on which requests share its forward passes.

Cache: keys and values ``[layers, slots, kv_heads, context_length, head_dim]`` in the model's
dtype, allocated as slots are first used (doubling up to ``slots``; the engine hands out the
lowest free slots, so an engine serving few samples holds a small cache). Routed experts (MoE): the top-k expert ids of every token
fed, int32 ``[tokens, layers, top_k]``, -1 in dense layers (SGLang's layout).

Supported: the default RoPE (no scaling), no sliding window; anything else is refused at
construction.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.engines.reference.invariant_ops import rms_norm, rotary, row_invariant_linear, slot_attention

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    from megatron_rl.engines.reference.lora_adapters import LoRAAdapter


LoRARows = tuple["LoRAAdapter", torch.Tensor]
"""An adapter and the indices of the tokens of a forward call that run with it."""
Linear = Callable[[torch.Tensor, torch.nn.Linear, str], torch.Tensor]
"""A layer's projection: (input, linear module, its name) -> output, LoRA added where the call asks for it."""


def _adapted_linear(
    x_TK: torch.Tensor, module: torch.nn.Linear, name: str, *, layer: int, lora: Sequence[LoRARows]
) -> torch.Tensor:
    """``module(x)``, each adapter's tokens plus its ``scaling * B(A(x))`` where it adapts ``(layer, name)``."""
    out = row_invariant_linear(x_TK, module.weight, module.bias)
    for adapter, rows in lora:
        pair = adapter.weights.get((layer, name))
        if pair is not None:
            _add_lora(out, x_TK, rows, pair, adapter.scaling)
    return out


def _add_lora(
    out_TN: torch.Tensor,
    x_TK: torch.Tensor,
    rows: torch.Tensor,
    pair: tuple[torch.Tensor, torch.Tensor],
    scaling: float,
) -> None:
    """Add ``scaling * B(A(x))`` (PEFT's order, row-invariant) to the rows ``rows`` (int64 indices) of ``out_TN``, in
    place; ``pair``: A [r, K], B [N, r]."""
    a, b = pair
    out_TN.index_add_(0, rows, row_invariant_linear(row_invariant_linear(x_TK[rows], a), b) * scaling)


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this forward does not implement (named in the message)."""


def _check_supported(config: PreTrainedConfig) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"the reference engine implements the default RoPE only, not {rope['rope_type']!r}")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError("the reference engine does not implement sliding-window attention")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"the reference engine implements SiLU MLPs only, not {config.hidden_act!r}")


def _is_sparse(config: PreTrainedConfig, layer: int) -> bool:
    experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return experts > 0 and layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


class SlotModel:
    """The forward of ``model`` (a transformers Qwen3 / Qwen3-MoE causal LM) over ``slots`` cache slots.

    ``context_length``: positions per slot (SGLang's ``--context-length``); every attention
    spans all of them, masked.
    """

    def __init__(self, model: PreTrainedModel, *, slots: int, context_length: int) -> None:
        config = model.config
        _check_supported(config)
        self.model = model
        self.slots, self.context_length = slots, context_length
        self.num_layers: int = config.num_hidden_layers
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps: float = config.rms_norm_eps
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.sparse = [_is_sparse(config, layer) for layer in range(self.num_layers)]
        self.routes_experts = self.top_k > 0 and any(self.sparse)
        rope: dict[str, Any] = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.scaling = self.head_dim**-0.5
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values
        self.forward_seconds = {"extend": 0.0, "decode": 0.0}
        self.forward_calls = 0

    @property
    def device(self) -> torch.device:
        """Where the model's weights (and so the cache) live."""
        device: torch.device = self.model.model.embed_tokens.weight.device
        return device

    def drop_cache(self) -> None:
        """Free the cache (memory release); the next forward allocates it again, zeroed."""
        self._kv = None

    def add_slots(self, count: int) -> list[int]:
        """``count`` more slots (the cache grows at the next forward, keeping what it holds); their ids."""
        first = self.slots
        self.slots += count
        return list(range(first, self.slots))

    def _cache(self, used_slots: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache, grown (doubling, up to :attr:`slots`, contents kept) to hold slots ``0..used_slots-1``."""
        held = 0 if self._kv is None else self._kv[0].shape[1]
        if self._kv is None or held < used_slots:
            capacity = min(self.slots, max(used_slots, 2 * held, 1))
            shape = (self.num_layers, capacity, self.kv_heads, self.context_length, self.head_dim)
            keys = torch.zeros(shape, dtype=dtype, device=device)
            values = torch.zeros(shape, dtype=dtype, device=device)
            if self._kv is not None:
                keys[:, :held], values[:, :held] = self._kv
            self._kv = keys, values
        return self._kv

    def copy_slot(self, source: int, targets: list[int], length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``source`` (fed already) into each slot of ``targets``."""
        if not targets:
            return
        assert self._kv is not None, f"slot {source} was fed, so the cache exists"
        held_keys = self._kv[0]
        keys, values = self._cache(max(targets) + 1, held_keys.device, held_keys.dtype)
        index = torch.tensor(targets, device=keys.device)
        for cache in (keys, values):
            cache[:, index, :, :length] = cache[:, source : source + 1, :, :length]

    def forward(
        self,
        tokens_T: torch.Tensor,
        slots_T: torch.Tensor,
        positions_T: torch.Tensor,
        logits_rows: torch.Tensor,
        lora: Sequence[LoRARows] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens; returns float32 logits [R, vocab] of the tokens ``logits_rows`` picks, and routing.

        ``tokens_T``, ``slots_T``, ``positions_T``: int64 [T]; each (slot, position) at most once per
        call, positions below ``context_length``. Writes the tokens' keys and values into the cache.
        ``lora``: (adapter, int64 token indices) pairs, disjoint: those tokens' projections add the
        adapter's ``scaling * B @ A @ x`` (PEFT's order: ``B(A(x)) * scaling``, row-invariant too).
        Routing: int32 [T, layers, top_k] (-1 in dense layers), or None for a model without experts.
        Counts itself in :attr:`forward_calls` and adds its wall time to :attr:`forward_seconds` under
        SGLang's forward-mode category: ``decode`` when every slot feeds one token after cached ones,
        else ``extend`` (a prefill is part of the call).
        """
        started = time.perf_counter()
        try:
            return self._forward(tokens_T, slots_T, positions_T, logits_rows, lora)
        finally:
            decode = bool((positions_T > 0).all()) and slots_T.unique().numel() == slots_T.numel()
            self.forward_seconds["decode" if decode else "extend"] += time.perf_counter() - started
            self.forward_calls += 1

    @torch.no_grad()
    def _forward(
        self,
        tokens_T: torch.Tensor,
        slots_T: torch.Tensor,
        positions_T: torch.Tensor,
        logits_rows: torch.Tensor,
        lora: Sequence[LoRARows],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inner = self.model.model
        hidden: torch.Tensor = inner.embed_tokens.weight[tokens_T]
        keys, values = self._cache(int(slots_T.max()) + 1, hidden.device, hidden.dtype)
        freqs = positions_T[:, None].float() * self.inv_freq.to(hidden.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        routing = None
        if self.routes_experts:
            routing = torch.full((tokens_T.shape[0], self.num_layers, self.top_k), -1, dtype=torch.int32)
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            linear = functools.partial(_adapted_linear, layer=index, lora=lora)
            normed = rms_norm(hidden, layer.input_layernorm.weight, self.eps)
            q = linear(normed, attn.q_proj, "q_proj").view(-1, self.heads, self.head_dim)
            k = linear(normed, attn.k_proj, "k_proj").view(-1, self.kv_heads, self.head_dim)
            v = linear(normed, attn.v_proj, "v_proj").view(-1, self.kv_heads, self.head_dim)
            q = rotary(rms_norm(q, attn.q_norm.weight, self.eps), cos, sin)
            k = rotary(rms_norm(k, attn.k_norm.weight, self.eps), cos, sin)
            keys[index, slots_T, :, positions_T] = k
            values[index, slots_T, :, positions_T] = v
            attended = slot_attention(q, keys[index], values[index], slots_T, positions_T, self.scaling)
            hidden = hidden + linear(attended, attn.o_proj, "o_proj")
            normed = rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
            if self.sparse[index]:
                mlp_out, experts = self._moe(layer.mlp, normed, index, lora)
                if routing is not None:
                    routing[:, index] = experts.to(torch.int32).cpu()
            else:
                mlp_out = self._dense_mlp(layer.mlp, normed, linear)
            hidden = hidden + mlp_out
        last = rms_norm(hidden[logits_rows], inner.norm.weight, self.eps)
        logits = row_invariant_linear(last, self.model.lm_head.weight)
        return logits.float(), routing

    @staticmethod
    def _dense_mlp(mlp: Qwen3MLP | Qwen3MoeMLP, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        gate = linear(x, mlp.gate_proj, "gate_proj")
        up = linear(x, mlp.up_proj, "up_proj")
        return linear(torch.nn.functional.silu(gate) * up, mlp.down_proj, "down_proj")

    def _moe(
        self, mlp: Qwen3MoeSparseMoeBlock, x: torch.Tensor, layer: int, lora: Sequence[LoRARows]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts (transformers' Qwen3-MoE maths); output [T, H] and expert ids [T, top_k].

        An adapter with weights for expert e of ``layer`` (``experts.{e}.{gate|up|down}_proj``) adds its
        ``scaling * B(A(x))`` to that expert's gate, up and down projections of its tokens routed to e, before the
        activation and before the routing weight, as SGLang's ``FusedMoEWithLoRA`` (and PEFT per expert) do.
        """
        router_logits = row_invariant_linear(x, mlp.gate.weight)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(x.dtype)
        experts = mlp.experts
        out = torch.zeros_like(x)
        for expert in torch.unique(top_ids).tolist():
            token_idx, k_idx = torch.nonzero(top_ids == expert, as_tuple=True)
            x_e = x[token_idx]
            adapted = [
                (adapter, torch.isin(token_idx, rows).nonzero().squeeze(1))  # the adapter's tokens among the expert's
                for adapter, rows in lora
            ]
            gate_up = row_invariant_linear(x_e, experts.gate_up_proj[expert])
            gate, up = gate_up.chunk(2, dim=-1)
            self._add_expert_lora(gate, x_e, adapted, layer, f"experts.{expert}.gate_proj")
            self._add_expert_lora(up, x_e, adapted, layer, f"experts.{expert}.up_proj")
            h = torch.nn.functional.silu(gate) * up
            y = row_invariant_linear(h, experts.down_proj[expert])
            self._add_expert_lora(y, h, adapted, layer, f"experts.{expert}.down_proj")
            out.index_add_(0, token_idx, y * top_weights[token_idx, k_idx, None])
        return out, top_ids

    @staticmethod
    def _add_expert_lora(
        out: torch.Tensor, x: torch.Tensor, adapted: Sequence[LoRARows], layer: int, name: str
    ) -> None:
        """Each adapter of ``adapted`` (with its rows of ``x``) that adapts ``(layer, name)`` adds its delta to
        ``out`` (a view of the projection's output is written through)."""
        for adapter, rows in adapted:
            pair = adapter.weights.get((layer, name))
            if pair is not None and rows.numel():
                _add_lora(out, x, rows, pair, adapter.scaling)
