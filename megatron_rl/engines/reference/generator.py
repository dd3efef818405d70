"""Decoding of the requests in flight, batched: one forward pass per step for all of them.

A request (:class:`RequestState`) = one prompt and ``n`` samples; each sample holds a cache
slot of the :class:`~megatron_rl.engines.reference.slot_model.SlotModel`. Per step
(:func:`decode_step`), every running sample feeds the tokens its slot has not cached yet (the
prompt at its first step, shared by its ``n`` samples: fed once and copied; then the token
sampled last; after a cache flush, everything again), all requests in one forward call. Then
each request samples its own unfinished samples from their logits:

- ``logprob`` of the sampled token = log_softmax(logits / T) at that token, where T is the
  temperature (T = 1 when greedy). top-k / top-p only restrict what may be sampled; they do not
  renormalise the reported log-prob. This is what the trainer recomputes (logits / T, full
  vocabulary);
- draws come from the request's own generator (seeded by ``sampling_seed``, else the engine's,
  shared with the other unseeded requests, so their draws depend on what runs with them, as in
  SGLang), one multinomial over its unfinished samples per step, in sample order. The draw is
  torch's own one-sample multinomial, written out so that all rows share one division and one
  argmax: each request fills its rows' Exp(1) noise with its generator (``exponential_`` on a
  fresh tensor of its rows' shape, as ``torch.multinomial`` does), and a row takes
  argmax(probs / noise); the tokens are those ``torch.multinomial(probs, 1, generator)`` draws,
  bit for bit (``tests/unit/test_reference_engine_batching.py`` checks it against torch);
- a sample stops at a stop token (``stop_token_ids``, and the model's EOS unless ``ignore_eos``;
  the stop token is kept in ``output_ids``) or after ``max_new_tokens`` (``length``); a
  finished sample's slot is freed at once.

Since the forward is batch-invariant and each request's sampling uses only its own rows and
generator, a request's outputs, log-probs and routed experts do not depend on the requests
decoded with it (``tests/unit/test_reference_engine_batching.py``).

Routed experts (MoE): each sample's ``[prompt_len + len(output) - 1 - start, layers, top_k]``
int32 routing of the tokens it fed, -1 for dense layers (SGLang's layout,
``routed_experts_start_len = start``); a re-prefill after a flush records them again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_rl.engines.protocol import FinishReason, GenerateRequest, SamplingParams
from megatron_rl.engines.reference.lora_adapters import LoRAAdapter
from megatron_rl.engines.reference.slot_model import LoRARows, SlotModel


@dataclass
class SampleOutput:
    """Raw output of one sample (the server turns it into SGLang JSON)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None


def eos_ids(model: torch.nn.Module) -> set[int]:
    """The model config's EOS token ids (none when it has none)."""
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


@dataclass(eq=False)
class RequestState:
    """One ``/generate`` request while the engine holds it: its samples' tokens, slots and results.

    ``slots``: one cache slot per sample, assigned at admission, None once the sample is done.
    ``cached[i]``: how many of sample i's tokens its slot holds (0: prefill at the next step).
    ``lora``: the adapter its tokens run with (the request's ``lora_path``), None for the base model.
    """

    request: GenerateRequest
    generator: torch.Generator
    stop_ids: set[int]
    routing_shape: tuple[int, int, int] | None
    lora: LoRAAdapter | None = None
    slots: list[int | None] = field(init=False)
    outputs: list[list[int]] = field(init=False)
    logprobs: list[list[float]] = field(init=False)
    reasons: list[FinishReason | None] = field(init=False)
    cached: list[int] = field(init=False)
    routing: list[torch.Tensor] | None = field(init=False)
    cache_epoch: int = 0
    weight_version: str = "default"
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        n = self.request.sampling_params.n
        self.outputs = [[] for _ in range(n)]
        self.logprobs = [[] for _ in range(n)]
        self.reasons = [None] * n
        self.cached = [0] * n
        self.slots = [None] * n
        self.routing = None
        if self.routing_shape is not None:
            self.routing = [torch.full(self.routing_shape, -1, dtype=torch.int32) for _ in range(n)]

    @property
    def n(self) -> int:
        """Samples of the request."""
        return self.request.sampling_params.n

    def running(self) -> list[int]:
        """The samples still decoding, in order."""
        return [i for i in range(self.n) if self.reasons[i] is None]

    def slot(self, sample: int) -> int:
        """The cache slot of ``sample``, which is running (so it holds one)."""
        slot = self.slots[sample]
        assert slot is not None, f"sample {sample} of request {self.request.rid!r} holds no slot"
        return slot

    def tokens(self, sample: int) -> list[int]:
        """Every token of ``sample`` so far: the prompt, then its outputs."""
        return self.request.input_ids + self.outputs[sample]

    def drop_cache(self) -> None:
        """The cache was flushed: every running sample prefills all its tokens again at its next step."""
        self.cached = [0] * self.n

    def finish(self, reason: FinishReason, samples: list[int] | None = None) -> list[int]:
        """End the running ones of ``samples`` (default every sample) with ``reason``; returns the slots they held."""
        freed = []
        for i in self.running() if samples is None else [i for i in self.running() if i in samples]:
            self.reasons[i] = reason
            freed.append(self.slots[i])
            self.slots[i] = None
        return [s for s in freed if s is not None]

    def results(self) -> list[SampleOutput]:
        """Each sample's output (every sample must be finished)."""
        prompt_len, start = len(self.request.input_ids), self.request.routed_experts_start_len
        samples = []
        for i in range(self.n):
            routed = None
            if self.routing is not None:
                fed = min(self.cached[i], prompt_len + len(self.outputs[i]) - 1)
                routed = self.routing[i][start : max(start, fed)].numpy()
            reason = self.reasons[i]
            assert reason is not None, f"sample {i} of request {self.request.rid!r} is still running"
            samples.append(SampleOutput(self.outputs[i], self.logprobs[i], reason, routed))
        return samples

    def advance(self, samples: list[int], tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append each of ``samples``' next token and its log-prob; returns the slots of samples that finished."""
        freed = []
        max_new = self.request.sampling_params.max_new_tokens
        for i, token, logprob in zip(samples, tokens, logprobs, strict=True):
            outputs = self.outputs[i]
            outputs.append(token)
            self.logprobs[i].append(logprob)
            if token in self.stop_ids:
                self.reasons[i] = FinishReason("stop", matched=token)
            elif len(outputs) >= max_new:
                self.reasons[i] = FinishReason("length")
            else:
                continue
            freed.append(self.slot(i))
            self.slots[i] = None
        return freed


INVALID_PROBABILITIES = "probability tensor contains either `inf`, `nan` or element < 0"
"""``torch.multinomial``'s refusal of such probabilities, raised as it raises it (a RuntimeError)."""


def sample_rows(
    logits_RV: torch.Tensor, owners: list[tuple[RequestState, list[int], int]]
) -> tuple[list[int], list[float]]:
    """Each row's next token and its log-prob; ``owners`` = (request, samples, rows) in row order.

    Row-wise maths runs once over all rows (temperature, log_softmax, softmax, the draw's division
    and argmax: no op mixes rows). Each sampling request fills its rows' Exp(1) noise from its own
    generator (its rows filtered first when it sets top-k / top-p); a greedy request takes the
    argmax of its logits. The tokens are those ``torch.multinomial(probs, 1, generator=g)`` per
    request draws (see the module docstring), and probabilities it refuses raise its RuntimeError.
    """
    temperatures = [s.request.sampling_params.temperature for s, _, rows in owners for _ in range(rows)]
    device = logits_RV.device
    scaled_RV = logits_RV / torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device)[:, None]
    logp_RV = torch.log_softmax(scaled_RV, dim=-1)
    next_R = logits_RV.argmax(-1)
    if not any(t > 0 for t in temperatures):
        return next_R.tolist(), logp_RV.gather(-1, next_R.unsqueeze(-1)).squeeze(-1).tolist()
    probs_RV = scaled_RV.softmax(-1)
    noises, drawn, offset = [], [], 0
    for state, _, rows in owners:
        params = state.request.sampling_params
        if params.temperature > 0:
            if params.top_k > 0 or params.top_p < 1.0:
                probs_RV[offset : offset + rows] = _filter_logits(scaled_RV[offset : offset + rows], params).softmax(-1)
            noise = torch.empty((rows, probs_RV.shape[-1]), dtype=probs_RV.dtype, device=device)
            noises.append(noise.exponential_(1, generator=state.generator))
            drawn.append((offset, offset + rows))
        else:
            noises.append(torch.ones((rows, probs_RV.shape[-1]), dtype=probs_RV.dtype, device=device))
        offset += rows
    checked = probs_RV if len(drawn) == len(owners) else torch.cat([probs_RV[a:b] for a, b in drawn])
    if not bool((checked.max() < float("inf")) & (checked.min() >= 0)):
        raise RuntimeError(INVALID_PROBABILITIES)
    drawn_R = (probs_RV / torch.cat(noises)).argmax(-1)
    if len(drawn) == len(owners):
        next_R = drawn_R
    else:
        for a, b in drawn:
            next_R[a:b] = drawn_R[a:b]
    return next_R.tolist(), logp_RV.gather(-1, next_R.unsqueeze(-1)).squeeze(-1).tolist()


@dataclass
class _Feed:
    """The (slot, position, token) triples of one forward call, whose logits each row is, what to record."""

    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    owners: list[tuple[RequestState, list[int], int]] = field(default_factory=list)
    # (a sample's routing record, first fed row, first position, count): rows of the forward's routing to copy there
    routed: list[tuple[torch.Tensor, int, int, int]] = field(default_factory=list)
    lora_rows: dict[int, tuple[LoRAAdapter, list[int]]] = field(default_factory=dict)
    """By adapter object (a name reloaded while requests hold the old one gives two): the adapter and the
    indices of the tokens fed for requests running with it."""

    def lora(self, device: torch.device) -> list[LoRARows]:
        """The forward's ``lora`` argument: each adapter with its tokens' indices on ``device``."""
        return [(a, torch.tensor(rows, dtype=torch.long, device=device)) for a, rows in self.lora_rows.values()]

    def add(self, slot: int, tokens: list[int], start: int) -> int:
        """Feed ``tokens`` at positions ``start``.. of ``slot``; returns the index of the last one."""
        self.slots += [slot] * len(tokens)
        self.positions += range(start, start + len(tokens))
        self.tokens += tokens
        return len(self.tokens) - 1

    def add_request(self, state: RequestState) -> list[int] | None:
        """Feed every running sample of ``state``; returns its samples when they share one prompt prefill."""
        first = len(self.tokens)
        shared = self._add_request(state)
        if state.lora is not None:
            rows = self.lora_rows.setdefault(id(state.lora), (state.lora, []))[1]
            rows += range(first, len(self.tokens))
        return shared

    def _add_request(self, state: RequestState) -> list[int] | None:
        samples = state.running()
        prompt = state.request.input_ids
        routing = state.routing
        if not any(state.outputs[i] or state.cached[i] for i in samples):
            last = self.add(state.slot(samples[0]), prompt, 0)
            if routing is not None:
                self.routed.append((routing[samples[0]], last + 1 - len(prompt), 0, len(prompt)))
            self.logit_rows += [last] * len(samples)
            self.owners.append((state, samples, len(samples)))
            return samples
        for i in samples:
            outputs, start = state.outputs[i], state.cached[i]
            total = len(prompt) + len(outputs)
            if start == total - 1:  # the common decode step: the token sampled last
                self.slots.append(state.slot(i))
                self.positions.append(start)
                self.tokens.append(outputs[-1])
                fed_count = 1
            else:
                fed_count = total - start
                self.add(state.slot(i), state.tokens(i)[start:], start)
            last = len(self.tokens) - 1
            if routing is not None:
                self.routed.append((routing[i], last + 1 - fed_count, start, fed_count))
            self.logit_rows.append(last)
            state.cached[i] = total
        self.owners.append((state, samples, len(samples)))
        return None


def decode_step(slot_model: SlotModel, states: list[RequestState]) -> list[int]:
    """One forward pass for every running sample of ``states``, then one new token each; returns slots freed.

    A request whose samples all wait for their prefill (first step, or after a flush before any
    output) feeds its prompt once, in its first sample's slot, and copies that slot's cache to the
    others (each token's computation does not depend on the slot, so this equals n prefills).
    """
    feed = _Feed()
    shared = [(state, samples) for state in states if (samples := feed.add_request(state)) is not None]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=slot_model.device)  # noqa: E731
    logits, routing = slot_model.forward(
        as_tensor(feed.tokens),
        as_tensor(feed.slots),
        as_tensor(feed.positions),
        as_tensor(feed.logit_rows),
        feed.lora(slot_model.device),
    )
    if routing is not None:
        for record, first, start, length in feed.routed:
            record[start : start + length] = routing[first : first + length]
    for state, samples in shared:
        prompt_len = len(state.request.input_ids)
        slot_model.copy_slot(state.slot(samples[0]), [state.slot(i) for i in samples[1:]], prompt_len)
        for i in samples:
            state.cached[i] = prompt_len
            if state.routing is not None:
                state.routing[i][:prompt_len] = state.routing[samples[0]][:prompt_len]
    tokens, logprobs = sample_rows(logits, feed.owners)
    freed = []
    offset = 0
    for state, samples, rows in feed.owners:
        freed += state.advance(samples, tokens[offset : offset + rows], logprobs[offset : offset + rows])
        offset += rows
    return freed
