"""A group's ``/generate`` requests for one window: request ids, sampling seeds, window budgets, engines.

A new prompt's first window is one ``n``-sample request; a carried group's next window is one ``n=1``
request per unfinished response (:func:`~megatron_rl.rollout.partial.continuation_requests`).
Request ids are ``<uid_prefix><serial>``, the serial counting the sampler's prompts over epochs, so
they (and, with ``seed``, each request's sampling seed ``seed * 2**32 + serial``) are the same after
a resume from the sampler's state. On SGLang the request carries one seed per sample instead,
derived from that one (:func:`~megatron_rl.rollout.partial.sample_seeds`): SGLang seeds each sample
on its own, and a request's one seed would make its ``n`` samples alike. In a LoRA run every request
names the policy's adapter the engines hold when it is built
(:class:`~megatron_rl.rollout.policy_adapter.PolicyAdapter`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.engines.engine import RolloutEngine
from megatron_rl.engines.protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.rollout.partial import (
    PartialGroup,
    PartialSample,
    WindowPlan,
    continuation_requests,
    continuation_seed,
    sample_seeds,
)

if TYPE_CHECKING:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
    from megatron_rl.rollout.episodes import EnvironmentReply
    from megatron_rl.rollout.policy_adapter import PolicyAdapter

SEED_STRIDE = 1 << 32
"""Request seeds are ``seed * SEED_STRIDE + serial``: distinct per prompt for any run of fewer than 2**32 prompts."""


@dataclass(frozen=True)
class Request:
    """One ``/generate`` request of a group's window: the engine it goes to (again, after a crash), the
    group's samples it fills, in order, and whether the window (not the response budget) caps it."""

    engine: RolloutEngine
    request: GenerateRequest
    samples: list[int]
    capped: bool


@dataclass(frozen=True)
class Submission:
    """One group's window: its requests (one ``n``-sample request for a new group, one per unfinished
    response for a continued one); ``continued`` is True for a group carried from an earlier step."""

    group: PartialGroup
    requests: list[Request]
    continued: bool

    def moved(self, next_engine: Callable[[], RolloutEngine]) -> Submission:
        """This window with each request moved to ``next_engine()`` (held requests after a recovery)."""
        return dataclasses.replace(self, requests=[dataclasses.replace(r, engine=next_engine()) for r in self.requests])

    def start(self) -> WindowProgress:
        """This window's progress before any answer: copies of the group's samples, so ``group`` stays as it
        was, which is what a continued group that ends up past the cutoff is carried as, whether or not its
        window had come back (so the carried state does not depend on timing)."""
        samples = [sample.copy() for sample in self.group.samples]
        return WindowProgress(self, samples, [0] * len(samples), [0] * len(samples), len(self.requests))


@dataclass
class WindowProgress:
    """A window while it runs: the group's samples with the answers so far (copies), the model tokens each
    sampled in this window (``used``), the later turns each started in it (``follow_ups``), the requests and
    replies still ``outstanding``, and whether an engine aborted one of its requests. Only its methods change
    it, each for one event of the window."""

    submission: Submission
    samples: list[PartialSample]
    used: list[int]
    follow_ups: list[int]
    outstanding: int
    aborted: bool = False

    @property
    def done(self) -> bool:
        """No request or reply of the window is outstanding."""
        return self.outstanding == 0

    def answered(
        self, request: Request, results: list[GenerateResult], max_response_length: int, *, kept: bool
    ) -> list[int]:
        """``request`` came back with ``results`` (empty: its engine was gone). An aborted answer marks the window
        aborted; otherwise, when the window is ``kept`` (it will be used), each answer is appended to its sample.
        Returns the samples of ``request`` whose turn ended at a stop token: the episode's reply is asked for them."""
        self.outstanding -= 1
        if any(result.aborted for result in results):
            self.aborted = True
            return []
        if not results or not kept:
            return []
        for sample, result in zip(request.samples, results, strict=True):
            self.samples[sample].extend(result, capped=request.capped, max_response_length=max_response_length)
            self.used[sample] += len(result.output_ids)
        return [sample for sample in request.samples if self._ended_at_stop(sample)]

    def reply_asked(self) -> None:
        """The episode's reply to one of the window's samples is on its way."""
        self.outstanding += 1

    def replied(self, sample: int, reply: EnvironmentReply, max_response_length: int, *, kept: bool) -> bool:
        """The episode's ``reply`` to ``sample`` came back: its tool calls are counted and its ids appended, or,
        when they leave no room for the model's next turn, the response ends at its budget with the reply left out
        (so every token trained on was fed to the engine and has its routing). Nothing changes when the window is
        not ``kept`` or was aborted. Returns whether the model's next turn is to be asked for."""
        self.outstanding -= 1
        if not kept or self.aborted:
            return False
        state = self.samples[sample]
        for tool, failure in reply.calls():
            state.tools = state.tools.after(tool, failure)
        if len(state.output_ids) + len(reply.ids) >= max_response_length:
            state.finish_reason = FinishReason("length")
            return False
        state.append_reply(reply.ids)
        return True

    def follow_up_sent(self, sample: int) -> int:
        """The model's next turn of ``sample`` is sent in this window; returns its number k (the k-th later turn)."""
        self.follow_ups[sample] += 1
        self.outstanding += 1
        return self.follow_ups[sample]

    def group(self) -> PartialGroup:
        """The group after this window (a new :class:`PartialGroup`; the submission's is unchanged)."""
        old = self.submission.group
        return PartialGroup(old.item, old.uid, old.first_seed, self.samples, old.windows + 1)

    def _ended_at_stop(self, sample: int) -> bool:
        state = self.samples[sample]
        return state.finished and state.finish_reason is not None and state.finish_reason.type == "stop"


class SubmissionPlanner:
    """Makes the windows a step sends: new prompts' first windows and carried groups' next ones.

    ``next_engine`` picks each request's engine (the engine pool's round-robin). ``adapter``: a LoRA run's
    :class:`~megatron_rl.rollout.policy_adapter.PolicyAdapter`, whose name every request carries as it is built
    (None: no LoRA, requests name no adapter).
    """

    def __init__(
        self,
        dataset: PromptDataset,
        sampler: PromptSampler,
        rollout: RolloutConfig,
        next_engine: Callable[[], RolloutEngine],
        *,
        uid_prefix: str,
        seed: int | None,
        routing_replay: bool,
        stop_token_ids: tuple[int, ...] = (),
        adapter: PolicyAdapter | None = None,
    ) -> None:
        self.dataset, self.sampler, self.rollout = dataset, sampler, rollout
        self.windows = WindowPlan(
            rollout.partial_rollout_tokens, rollout.partial_rollout_max_windows, rollout.max_response_length
        )
        self._next_engine = next_engine
        self._uid_prefix, self._seed, self._routing_replay = uid_prefix, seed, routing_replay
        self._stop_token_ids = list(stop_token_ids) or None
        self._adapter = adapter

    @property
    def lora_path(self) -> str | None:
        """The adapter a request built now names (None: the base model)."""
        return None if self._adapter is None else self._adapter.name

    def new(self, indices: list[int]) -> list[Submission]:
        """The first windows of the prompts ``indices``, just taken from the sampler: their serials (request
        ids and seeds) count from the sampler's position after the batch."""
        serial = self._next_serial()
        return [
            self._first_window(self.dataset[index], f"{self._uid_prefix}{serial + offset}", serial + offset)
            for offset, index in enumerate(indices)
        ]

    def continued(self, group: PartialGroup) -> Submission:
        """A carried group's next window: one request per unfinished response."""
        planned = continuation_requests(
            group, self.windows, self._sampling(0, None), routing_replay=self._routing_replay, lora_path=self.lora_path
        )
        requests = [Request(self._next_engine(), request, [index], capped) for index, request, capped in planned]
        return Submission(group, requests, True)

    def follow_up(self, progress: WindowProgress, sample: int) -> Request | None:
        """The request of the model's next turn of ``sample`` in this window, after an environment reply
        (token-in/token-out: the prompt ids and every response id so far), or None when the window's tokens
        are spent (the response goes on in the next window). Its rid is ``<uid>.<window>.<sample>.<k>`` and
        its seed :func:`continuation_seed` with turn k, the k-th later turn of the sample in this window."""
        group, state = progress.submission.group, progress.samples[sample]
        max_new, capped = self.windows.budget(len(state.output_ids), group.windows, progress.used[sample])
        if max_new <= 0:
            return None
        turn = progress.follow_up_sent(sample)
        seed = None if group.first_seed is None else continuation_seed(group.first_seed, sample, group.windows, turn)
        request = GenerateRequest(
            list(group.item.prompt_ids) + state.output_ids,
            dataclasses.replace(self._sampling(max_new, seed), n=1),
            rid=f"{group.uid}.{group.windows}.{sample}.{turn}",
            return_routed_experts=self._routing_replay,
            lora_path=self.lora_path,
        )
        return Request(self._next_engine(), request, [sample], capped)

    def _first_window(self, item: PromptItem, uid: str, serial: int) -> Submission:
        """A new prompt's first window: one request for all its samples (with a seed per sample on SGLang)."""
        seed = None if self._seed is None else self._seed * SEED_STRIDE + serial
        max_new, capped = self.windows.budget(0, 0)
        n = self.rollout.n_samples_per_prompt
        seeds = sample_seeds(seed, n) if seed is not None and self.rollout.engine == "sglang" else None
        request = GenerateRequest(
            list(item.prompt_ids),
            self._sampling(max_new, None if seeds else seed),
            rid=uid,
            return_routed_experts=self._routing_replay,
            sample_seeds=seeds,
            lora_path=self.lora_path,
        )
        group = PartialGroup(item, uid, seed, [PartialSample() for _ in range(n)])
        return Submission(group, [Request(self._next_engine(), request, list(range(n)), capped)], False)

    def _sampling(self, max_new_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.rollout.temperature,
            top_p=self.rollout.top_p,
            top_k=self.rollout.top_k,
            n=self.rollout.n_samples_per_prompt,
            stop_token_ids=self._stop_token_ids,
            sampling_seed=seed,
        )

    def _next_serial(self) -> int:
        """Serial number of the sampler's next prompt (epoch * dataset size + position): resume-safe request ids."""
        state = self.sampler.state_dict()
        return state["epoch"] * self.sampler.dataset_size + state["position"]
