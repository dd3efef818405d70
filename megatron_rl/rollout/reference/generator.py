"""Token generation with a transformers Qwen3 / Qwen3-MoE model in plain PyTorch (the reference engine's core).

One request = one prompt, ``n`` samples decoded together as a batch of ``n``
(same prompt length, so no padding), with a KV cache. Per step:

- ``logprob`` of the sampled token = log_softmax(logits / T) at that token,
  where T is the temperature (T = 1 when greedy). top-k / top-p only restrict
  what may be sampled; they do not renormalise the reported log-prob. This is
  what the trainer recomputes (logits / T, full vocabulary);
- a sample stops at a stop token (``stop_token_ids``, and the model's EOS unless
  ``ignore_eos``; the stop token is kept in ``output_ids``) or after
  ``max_new_tokens`` (``length``); finished samples keep being fed (their
  outputs are discarded) until all are done.

Routed experts (MoE): forward hooks on every ``mlp.gate`` router record the
top-k expert ids of each token fed through the model; a sample's routing is
``[prompt_len + len(output) - 1 - start, num_hidden_layers, top_k]`` int32,
-1 for dense layers (SGLang's layout, ``routed_experts_start_len = start``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.rollout.protocol import FinishReason, GenerateRequest, SamplingParams


class GenerationAborted(Exception):
    """Raised by the ``checkpoint`` callback to stop a request (the samples then finish with ``abort``)."""


@dataclass
class SampleOutput:
    """Raw output of one sample (the server turns it into SGLang JSON)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None


def _eos_ids(model: torch.nn.Module) -> set[int]:
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _filter_logits(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.top_k > 0 and params.top_k < logits_NV.shape[-1]:
        kth = torch.topk(logits_NV, params.top_k, dim=-1).values[..., -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits_NV, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_NV = logits_NV.masked_fill(drop, float("-inf"))
    return logits_NV


class RouterRecorder:
    """Records each MoE router's top-k ids per forward call while a request asks for them.

    Routers are the ``mlp.gate`` modules whose output[2] is the ``[tokens, top_k]`` index tensor
    (transformers' Qwen3-MoE top-k router).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = model.model.layers
        self.num_layers = len(layers)
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        self._calls: list[dict[int, torch.Tensor]] = []
        self._rows = 1
        self._active = False
        for index, layer in enumerate(layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                gate.register_forward_hook(self._hook(index))

    def _hook(self, layer: int) -> Callable:
        def record(module, inputs, output) -> None:
            if self._active:
                self._calls[-1][layer] = output[2].detach().to(torch.int32)

        return record

    def start(self, num_rows: int) -> None:
        """Begin recording a request decoded as ``num_rows`` sequences."""
        self._calls, self._rows, self._active = [], num_rows, True

    def begin_forward(self) -> None:
        """Mark the start of one forward call (prefill or one decode step)."""
        self._calls.append({})

    def stop(self) -> None:
        """Stop recording (hooks become no-ops)."""
        self._active = False

    def routing(self, row: int) -> np.ndarray:
        """int32 ``[tokens fed for row, num_layers, top_k]`` over the recorded calls (-1: dense layer)."""
        pieces = []
        for call in self._calls:
            if not call:
                continue
            tokens = next(iter(call.values())).shape[0] // self._rows
            block = torch.full((tokens, self.num_layers, self.top_k), -1, dtype=torch.int32)
            for layer, ids in call.items():
                block[:, layer] = ids.view(self._rows, tokens, self.top_k)[row]
            pieces.append(block)
        empty = np.zeros((0, self.num_layers, self.top_k), dtype=np.int32)
        return torch.cat(pieces).numpy() if pieces else empty


@torch.no_grad()
def generate_samples(
    model: torch.nn.Module,
    request: GenerateRequest,
    recorder: RouterRecorder | None,
    checkpoint: Callable[[], bool],
    generator: torch.Generator,
) -> list[SampleOutput]:
    """Decode ``request.sampling_params.n`` samples of ``request.input_ids``.

    ``generator`` draws the samples unless the request sets ``sampling_seed``.
    ``checkpoint()`` runs before every forward step: it may block (pause) or
    raise :class:`GenerationAborted`, after which every sample ends with an
    ``abort`` finish reason and the tokens decoded so far. It returns True when
    the request's KV cache was flushed while it was held (SGLang's ``retract``):
    the next step then prefills every token fed so far again, with the weights
    the model holds now (routing, when recorded, restarts with that prefill).
    """
    params = request.sampling_params
    n = params.n
    device = next(model.parameters()).device
    if params.sampling_seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.sampling_seed)
    stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else _eos_ids(model))
    track_routing = recorder is not None and request.return_routed_experts and recorder.top_k > 0
    if track_routing:
        recorder.start(n)
    tokens_N1 = torch.tensor([request.input_ids] * n, device=device)
    fed_NL = tokens_N1
    outputs: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    reasons: list[FinishReason | None] = [None] * n
    cache = None
    try:
        for _ in range(params.max_new_tokens):
            if checkpoint() and cache is not None:
                cache, tokens_N1 = None, fed_NL
                if track_routing:
                    recorder.start(n)
            if track_routing:
                recorder.begin_forward()
            out = model(input_ids=tokens_N1, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            logits_NV = out.logits[:, -1].float()
            temperature = params.temperature if params.temperature > 0 else 1.0
            logp_NV = torch.log_softmax(logits_NV / temperature, dim=-1)
            if params.temperature > 0:
                probs = _filter_logits(logits_NV / temperature, params).softmax(-1)
                next_N = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                next_N = logits_NV.argmax(-1)
            chosen_logp = logp_NV.gather(-1, next_N.unsqueeze(-1)).squeeze(-1)
            for i in range(n):
                if reasons[i] is not None:
                    continue
                token = int(next_N[i])
                outputs[i].append(token)
                logprobs[i].append(float(chosen_logp[i]))
                if token in stop_ids:
                    reasons[i] = FinishReason("stop", matched=token)
            if all(r is not None for r in reasons):
                break
            tokens_N1 = next_N.unsqueeze(-1)
            fed_NL = torch.cat([fed_NL, tokens_N1], dim=1)
    except GenerationAborted as error:
        reasons = [r or FinishReason("abort", message=str(error) or "aborted") for r in reasons]
    finally:
        if track_routing:
            recorder.stop()
    reasons = [r or FinishReason("length") for r in reasons]
    return [
        SampleOutput(
            outputs[i],
            logprobs[i],
            reasons[i],
            _sample_routing(recorder, i, len(request.input_ids), len(outputs[i]), request.routed_experts_start_len)
            if track_routing
            else None,
        )
        for i in range(n)
    ]


def _sample_routing(recorder: RouterRecorder, row: int, prompt_len: int, num_out: int, start: int) -> np.ndarray:
    fed = recorder.routing(row)[: prompt_len + num_out - 1]
    return fed[start:]
