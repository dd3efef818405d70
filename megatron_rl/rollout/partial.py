"""Partial rollouts: responses generated in token windows, continued under newer weights.

With ``rollout.partial_rollout_tokens`` W, a training step's generation gives every response at most
W new tokens. A group whose responses have all ended (a stop token, or ``max_response_length`` in
all) is scored as usual. A group with a response cut at the window is *unfinished*: it is carried to
the next step's generation, where each unfinished response continues alone (``n=1``) from where it
stopped: the request's ``input_ids`` are the prompt plus the response so far, under the weights the
engines hold then (SGLang prefills them again, as it would after an abort). Its last window,
``rollout.partial_rollout_max_windows``, has no cap, so a response spans at most that many windows
and its oldest token is at most ``max_windows - 1`` weight versions older than its newest.

A carried group goes on in the next step's generation; one that waited (past a full step's cutoff)
can fall behind: :meth:`PartialGroup.oldest_version` against the policy that would train on it
decides whether it may still continue (the rollout manager drops it when its oldest token would lag
more than ``train.max_staleness + partial_rollout_max_windows - 1`` versions).

The windows stand in for SGLang's abort-on-weight-update (slime's and verl's partial rollouts):
a response is cut at a fixed token count instead of at whatever token it reached when the
weights arrived, so where a response is cut, and with it the whole run, is deterministic.

Each window of a response records the ``weight_version`` its engine reported, so the response's
tokens carry the version they were sampled under (:attr:`PartialSample.version_segments`); the
trainer's importance correction uses each token's own rollout log-prob, which is that version's.
A continuation's sampling seed is derived from its response's first seed, its index in the group
and its window (:func:`continuation_seed`), so a resumed run draws the same tokens. On SGLang the first
window has per-sample seeds too (window 0 of the same derivation, :func:`sample_seeds`): SGLang seeds
each sample on its own, so one seed for a request's ``n`` samples would give them all the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from megatron_rl.engines.protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.rollout.groups import ToolCounts, weight_version_number

if TYPE_CHECKING:
    from megatron_rl.data import PromptItem

_SEED_MASK = (1 << 63) - 1


def continuation_seed(first_seed: int, sample: int, window: int, turn: int = 0) -> int:
    """Sampling seed of window ``window`` of sample ``sample`` of a group whose first request had
    ``first_seed``: a 63-bit hash, so it fits SGLang's int64 and differs across samples and windows.
    ``turn`` > 0: the ``turn``-th model turn the window starts after an environment reply (multi-turn
    episodes, :mod:`~megatron_rl.rollout.episodes`), distinct from the window's first request.

    Window 0 is a sample's first window where the engine seeds samples one by one (SGLang,
    :func:`sample_seeds`); the reference engine draws a first window's ``n`` samples from one generator
    seeded with ``first_seed`` itself."""
    key = f"{first_seed}:{sample}:{window}" + (f":{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def sample_seeds(first_seed: int, n: int) -> list[int]:
    """The first window's per-sample seeds of a group seeded ``first_seed`` (``continuation_seed(first_seed,
    i, 0)`` for sample i): what an SGLang request carries, one ``sampling_params`` per sample, since SGLang
    0.5.23 seeds each sample with its own ``sampling_seed`` (under deterministic inference; without it, it
    ignores seeds) and copies one seed to all ``n`` samples of a request."""
    return [continuation_seed(first_seed, sample, 0) for sample in range(n)]


@dataclass
class PartialSample:
    """One response so far: its tokens, their rollout log-probs and the weight version of each window.

    ``version_segments`` is ``[(weight_version, tokens), ...]`` in order, the counts summing to
    ``len(output_ids)``; ``routed_experts`` and ``finish_reason`` are the last request's (its routing
    covers the prompt and every response token, prefilled again under the last request's weights).

    Multi-turn episodes (:mod:`~megatron_rl.rollout.episodes`) interleave the model's turns with what the
    environment appends: ``policy_mask`` is 1 for each token the engine sampled and 0 for an appended one
    (whose log-prob entry is 0.0), None while every token is sampled (fields added since keep their class
    defaults, so groups carried in older checkpoints load); ``turns`` counts the model's turns, ``turn_start`` is where the current
    one began in ``output_ids``; ``tools`` counts the replies' tool calls.
    """

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    version_segments: list[tuple[str | None, int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    routed_experts: np.ndarray | None = None
    finished: bool = False
    policy_mask: list[int] | None = None
    turns: int = 1
    turn_start: int = 0
    tools: ToolCounts = ToolCounts()

    def extend(self, result: GenerateResult, *, capped: bool, max_response_length: int) -> None:
        """Append one request's answer; the response stays unfinished only when the window's cap
        (``capped``: the request's max_new_tokens was the window, not the response's remaining budget)
        ended it before a stop token and before ``max_response_length`` tokens."""
        self.output_ids += result.output_ids
        self.output_logprobs += result.output_logprobs
        if self.policy_mask is not None:
            self.policy_mask += [1] * len(result.output_ids)
        if result.output_ids:
            self.version_segments.append((result.weight_version, len(result.output_ids)))
        self.finish_reason, self.routed_experts = result.finish_reason, result.routed_experts
        cut_by_window = capped and result.finish_reason.type == "length"
        self.finished = not (cut_by_window and len(self.output_ids) < max_response_length)

    def append_reply(self, ids: list[int]) -> None:
        """Append an environment reply (never trained on) after a finished model turn and start the next turn.

        The reply's tokens count under the weight version of the turn before; the response is unfinished
        until the model's next turn ends."""
        assert self.version_segments, "a reply follows a model turn"
        version, count = self.version_segments[-1]
        self.version_segments[-1] = (version, count + len(ids))
        if self.policy_mask is None:
            self.policy_mask = [1] * len(self.output_ids)
        self.output_ids += ids
        self.output_logprobs += [0.0] * len(ids)
        self.policy_mask += [0] * len(ids)
        self.turns += 1
        self.turn_start = len(self.output_ids)
        self.finished = False

    def copy(self) -> PartialSample:
        """A copy whose token lists can grow without changing this sample."""
        return dataclasses.replace(
            self,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            version_segments=list(self.version_segments),
            policy_mask=None if self.policy_mask is None else list(self.policy_mask),
        )

    @property
    def weight_version(self) -> str | None:
        """The weight version of the response's last window (None before any token)."""
        return self.version_segments[-1][0] if self.version_segments else None


@dataclass
class PartialGroup:
    """A group of responses generated window by window; ``windows`` is how many windows it has had.

    ``first_seed`` is the group's seed, None when unseeded: its first (``n``-sample) request's sampling
    seed on the reference engine; on SGLang that request's samples carry :func:`sample_seeds` of it.
    """

    item: PromptItem
    uid: str
    first_seed: int | None
    samples: list[PartialSample]
    windows: int = 0

    @property
    def finished(self) -> bool:
        """True once every response has ended."""
        return all(sample.finished for sample in self.samples)

    def oldest_version(self) -> int | None:
        """The step whose weights sampled the group's oldest token (None before any token)."""
        versions = [weight_version_number(v) for s in self.samples for v, count in s.version_segments if count]
        return min(versions, default=None)


@dataclass(frozen=True)
class WindowPlan:
    """A recipe's window settings: ``tokens`` per window (None: no windows), ``max_windows`` per response."""

    tokens: int | None
    max_windows: int
    max_response_length: int

    def budget(self, generated: int, window: int, used: int = 0) -> tuple[int, bool]:
        """max_new_tokens for the next request in window ``window`` (0-based) of a response with ``generated``
        tokens, ``used`` of them sampled earlier in this window (a multi-turn episode's later turns), and
        whether the window (not the response's remaining budget) is what caps it. 0 with True: the window
        is spent; the response goes on in the next one."""
        remaining = self.max_response_length - generated
        if self.tokens is None or window + 1 >= self.max_windows or self.tokens - used >= remaining:
            return remaining, False
        return self.tokens - used, True


def continuation_requests(
    group: PartialGroup,
    plan: WindowPlan,
    params: SamplingParams,
    *,
    routing_replay: bool,
    lora_path: str | None = None,
) -> list[tuple[int, GenerateRequest, bool]]:
    """The next window's requests of an unfinished group: one ``n=1`` request per unfinished response,
    as ``(sample index, request, capped)``; rids are ``<uid>.<window>.<sample>``. ``lora_path``: the LoRA
    adapter the requests name (None: the base model), the one the engines hold now."""
    requests = []
    for index, sample in enumerate(group.samples):
        if sample.finished:
            continue
        max_new, capped = plan.budget(len(sample.output_ids), group.windows)
        seed = None if group.first_seed is None else continuation_seed(group.first_seed, index, group.windows)
        sampling = dataclasses.replace(params, n=1, max_new_tokens=max_new, sampling_seed=seed)
        request = GenerateRequest(
            list(group.item.prompt_ids) + sample.output_ids,
            sampling,
            rid=f"{group.uid}.{group.windows}.{index}",
            return_routed_experts=routing_replay,
            lora_path=lora_path,
        )
        requests.append((index, request, capped))
    return requests
