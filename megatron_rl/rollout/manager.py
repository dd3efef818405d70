"""The rollout manager: prompts in, a step's worth of scored groups out.

Per step (:meth:`RolloutManager.generate_step`):

1. take a generation batch of prompt indices from the sampler (its batch size
   is the generation batch, ``algorithm.dynamic_sampling.gen_batch_prompts`` in
   a recipe; larger than ``prompts_per_step`` over-samples);
2. send one ``/generate`` request per prompt with ``n`` samples, spread
   round-robin over the engines, at most ``max_concurrent_requests`` per
   engine in flight;
3. as each group comes back, score it in the reward worker processes (a response whose
   reward raises or runs past ``data.reward_timeout_s`` scores as failed, see ``scoring``), add the
   DAPO overlong penalty (and zero the loss mask of truncated responses when
   overlong filtering is on), and, with dynamic sampling, drop it when its
   correctness (``metric: acc``, the default) or scores (``metric: score``) do not
   vary (:func:`group_has_signal`);
4. groups are kept in submission order, whatever order they come back in (so
   a step's groups depend only on the prompts and the engines' outputs); once
   ``prompts_per_step`` are kept, abort every later request still in flight
   and discard later scores (counted as aborted); otherwise take the
   next generation batch, up to ``max_gen_batches`` (then an error, or the
   partial step when ``on_exhausted: train_partial``).

Prompts of aborted groups are not re-queued (the sampler has moved on). A request whose engine
process is gone (:class:`~megatron_rl.rollout.engine.EngineUnavailableError`) is held until every
other request of the batch has answered; then ``recover`` restarts the crashed engines (see
``orchestration/engine_recovery``) and the held requests go to them again unchanged, seeds
included, so the step's groups are those of a run without the crash
(``rollout/engine_restarts`` counts the restarts). Without ``recover`` the error is raised.
Request ids are ``<uid_prefix><serial>``, the serial counting the sampler's
prompts over epochs, so they (and, with ``seed``, each request's sampling seed
``seed * 2**32 + serial``) are the same after a resume from the sampler's state.
Metrics: ``rollout/groups_kept``, ``groups_dropped``, ``groups_aborted``,
``gen_batches``, ``samples``, ``reward_errors``, ``reward_timeouts``, ``engine_restarts``, ``seconds``. Rewards,
accuracy and lengths of the kept samples are the trainer's ``train/...`` metrics (computed
once, by the driver).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.algorithms import groups_with_signal, overlong_penalty
from megatron_rl.rollout.engine import EngineUnavailableError, RolloutEngine
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample, RolloutStep
from megatron_rl.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.rollout.scoring import RewardPool, ScoredResponse

if TYPE_CHECKING:
    from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
    from megatron_rl.data import PromptDataset, PromptItem, PromptSampler


Recovery = Callable[[Sequence[tuple[RolloutEngine, EngineUnavailableError]]], None]
"""Restarts the crashed engines given (each with one of its errors); returns with all engines ready."""


class RolloutExhaustedError(RuntimeError):
    """Dynamic sampling hit ``max_gen_batches`` before the step was full."""


class _Progress:
    """A rich progress bar of kept groups when stderr is a terminal; silent otherwise."""

    def __init__(self, total: int) -> None:
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._task = self._bar.add_task("rollout", total=total)
            self._bar.start()

    def update(self, kept: int, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=kept, description=description)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


_SEED_STRIDE = 1 << 32
"""Request seeds are ``seed * _SEED_STRIDE + serial``: distinct per prompt for any run of fewer than 2**32 prompts."""


@dataclass(frozen=True)
class _Submission:
    """One prompt's ``/generate`` request, the engine it goes to (again, after a crash) and its group uid."""

    item: PromptItem
    uid: str
    engine: RolloutEngine
    request: GenerateRequest


class _OrderedSelection:
    """Keeps groups in submission order, as if they had come back one by one: the outcome does not depend on timing.

    A group at position p is kept when it has signal and fewer than ``needed`` groups were kept before it;
    once the step is full at position p, ``cutoff`` becomes p + 1 and later positions are surplus (aborted).
    The counts are of the settled positions too, so they do not depend on timing either: ``dropped``
    (settled groups without signal), ``samples`` (the responses of settled groups, kept or dropped),
    ``reward_errors`` and ``reward_timeouts`` (those of their responses whose reward failed) and, after
    :meth:`finish`, ``aborted`` (every position past the cutoff, and settled requests an engine aborted).
    """

    def __init__(self, size: int, kept: list[RolloutGroup], needed: int, counts: dict[str, int]) -> None:
        self.cutoff = size
        self._size = size
        self.kept, self._needed, self._counts = kept, needed, counts
        self._outcomes: dict[int, tuple[RolloutGroup | None, bool]] = {}
        self._settled = 0

    def discard(self, position: int) -> None:
        """The request at ``position`` was aborted or is surplus (past the cutoff: counted by :meth:`finish`)."""
        if position < self.cutoff:
            self._outcomes[position] = (None, False)
            self._settle()

    def decide(self, position: int, group: RolloutGroup, has_signal: bool) -> None:
        """The scored group at ``position``; dynamic sampling drops it when it has no signal."""
        self._outcomes[position] = (group, has_signal)
        self._settle()

    def finish(self) -> None:
        """The batch is over: positions past the cutoff count as aborted."""
        self._counts["aborted"] += self._size - self.cutoff

    def _settle(self) -> None:
        while self._settled < self.cutoff and self._settled in self._outcomes:
            group, has_signal = self._outcomes.pop(self._settled)
            self._settled += 1
            if group is None:
                self._counts["aborted"] += 1
                continue
            self._counts["samples"] += len(group.samples)
            for sample in group.samples:
                if sample.reward_failure is not None:
                    self._counts[f"reward_{sample.reward_failure}s"] += 1
            if not has_signal:
                self._counts["dropped"] += 1
                continue
            self.kept.append(group)
            if len(self.kept) >= self._needed:
                self.cutoff = self._settled


def group_has_signal(group: RolloutGroup, metric: str) -> bool:
    """Whether dynamic sampling keeps ``group``: its responses' ``metric`` values differ.

    ``acc``: correctness (the DAPO paper's 0 < #correct < G; shaped scores such as the overlong
    penalty are no signal); ``score``: the shaped scores.
    """
    values = [float(s.correct) for s in group.samples] if metric == "acc" else group.scores
    return bool(groups_with_signal(torch.tensor(values), [0] * len(values)).all())


class RolloutManager:
    """Generates, scores, shapes and filters groups for training steps (see the module docstring).

    Group uids (also the engines' request ids) are ``<uid_prefix><n>``; managers sharing engines
    need distinct prefixes, since an engine remembers an aborted id until a request of it ends.
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        dataset: PromptDataset,
        sampler: PromptSampler,
        rollout: RolloutConfig,
        overlong: OverlongConfig,
        dynamic_sampling: DynamicSamplingConfig,
        *,
        prompts_per_step: int,
        reward: str,
        reward_num_workers: int,
        reward_timeout_s: float,
        decode: Callable[[list[int]], str],
        routing_replay: bool = False,
        uid_prefix: str = "g",
        seed: int | None = None,
        recover: Recovery | None = None,
    ) -> None:
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        if sampler.batch_size < prompts_per_step:
            raise ValueError(
                f"the sampler's generation batch ({sampler.batch_size} prompts) is smaller than prompts_per_step "
                f"({prompts_per_step}); make it at least as large (larger to over-sample)"
            )
        self.engines, self.dataset, self.sampler = list(engines), dataset, sampler
        self.rollout, self.overlong, self.dynamic_sampling = rollout, overlong, dynamic_sampling
        self.prompts_per_step = prompts_per_step
        self.decode = decode
        self.routing_replay = routing_replay
        self.rewards = RewardPool(reward, reward_num_workers, timeout_s=reward_timeout_s)
        self._threads = ThreadPoolExecutor(max_workers=rollout.max_concurrent_requests * len(self.engines))
        self._uid_prefix = uid_prefix
        self.seed = seed
        self.recover = recover
        self._engine_cycle = itertools.cycle(self.engines)

    def _request(self, item: PromptItem, uid: str, serial: int) -> GenerateRequest:
        params = SamplingParams(
            max_new_tokens=self.rollout.max_response_length,
            temperature=self.rollout.temperature,
            top_p=self.rollout.top_p,
            top_k=self.rollout.top_k,
            n=self.rollout.n_samples_per_prompt,
            sampling_seed=None if self.seed is None else self.seed * _SEED_STRIDE + serial,
        )
        return GenerateRequest(list(item.prompt_ids), params, rid=uid, return_routed_experts=self.routing_replay)

    def _group(
        self, item: PromptItem, uid: str, results: list[GenerateResult], scored: list[ScoredResponse]
    ) -> RolloutGroup:
        lengths = torch.tensor([len(r.output_ids) for r in results])
        penalties = torch.zeros(len(results))
        if self.overlong.enable:
            penalties = overlong_penalty(
                lengths, self.rollout.max_response_length, self.overlong.buffer_length, self.overlong.penalty_factor
            )
        samples = []
        for result, reward, penalty in zip(results, scored, penalties.tolist(), strict=True):
            truncated = result.finish_reason.type == "length"
            keep_tokens = 0 if truncated and self.overlong.filter_truncated else 1
            samples.append(
                RolloutSample(
                    prompt_ids=list(item.prompt_ids),
                    response_ids=result.output_ids,
                    rollout_logprobs=result.output_logprobs,
                    finish_reason=result.finish_reason.type,
                    score=reward.score + penalty,
                    correct=reward.correct,
                    overlong_penalty=penalty,
                    loss_mask=[keep_tokens] * len(result.output_ids),
                    weight_version=result.weight_version,
                    routed_experts=result.routed_experts,
                    reward_failure=reward.failure,
                )
            )
        return RolloutGroup(uid=uid, prompt_index=item.index, samples=samples)

    def _has_signal(self, group: RolloutGroup) -> bool:
        return not self.dynamic_sampling.enable or group_has_signal(group, self.dynamic_sampling.metric)

    def _run_batch(self, indices: list[int], kept: list[RolloutGroup], counts: dict[str, int], bar: _Progress) -> None:
        serial = self._next_serial()
        requests: dict[int, _Submission] = {}
        for position, index in enumerate(indices):
            item, uid = self.dataset[index], f"{self._uid_prefix}{serial + position}"
            request = self._request(item, uid, serial + position)
            requests[position] = _Submission(item, uid, next(self._engine_cycle), request)
        selection = _OrderedSelection(len(indices), kept, self.prompts_per_step, counts)
        while requests:
            crashed = self._generate(requests, selection, bar)
            requests = {position: requests[position] for position in crashed if position < selection.cutoff}
            if requests:
                counts["engine_restarts"] += self._recover_engines([crashed[position] for position in requests])
        selection.finish()

    def _recover_engines(self, failures: list[tuple[RolloutEngine, EngineUnavailableError]]) -> int:
        """Hand each crashed engine (with one of its errors) to ``recover``; how many engines that was.

        Without ``recover``, the first error is raised."""
        if self.recover is None:
            raise failures[0][1]
        first_error: dict[int, tuple[RolloutEngine, EngineUnavailableError]] = {}
        for engine, error in failures:
            first_error.setdefault(id(engine), (engine, error))
        self.recover(list(first_error.values()))
        return len(first_error)

    def _generate(
        self, requests: dict[int, _Submission], selection: _OrderedSelection, bar: _Progress
    ) -> dict[int, tuple[RolloutEngine, EngineUnavailableError]]:
        """Send ``requests`` (by position), score what comes back, and decide each group in ``selection``.

        Returns once every request has answered or failed and every score is in; the positions whose
        engine was unreachable (its process gone), with the engine and the error, are returned undecided.
        """
        generating = {
            self._threads.submit(sub.engine.generate, sub.request): position for position, sub in requests.items()
        }
        scoring: dict[Future, tuple[int, list[GenerateResult]]] = {}
        crashed: dict[int, tuple[RolloutEngine, EngineUnavailableError]] = {}
        while generating or scoring:
            done, _ = wait([*generating, *scoring], return_when=FIRST_COMPLETED)
            for future in done:
                if future in generating:
                    position = generating.pop(future)
                    sub = requests[position]
                    try:
                        results = future.result()
                    except EngineUnavailableError as error:
                        crashed[position] = (sub.engine, error)
                        continue
                    if any(r.aborted for r in results) or position >= selection.cutoff:
                        selection.discard(position)
                        continue
                    texts = [self.decode(r.output_ids) for r in results]
                    scored = self.rewards.submit(texts, sub.item.ground_truth, sub.item.extra_info, label=sub.uid)
                    scoring[scored] = (position, results)
                else:
                    position, results = scoring.pop(future)
                    sub = requests[position]
                    group = self._group(sub.item, sub.uid, results, future.result())
                    if position < selection.cutoff:
                        selection.decide(position, group, self._has_signal(group))
            bar.update(len(selection.kept), f"rollout: {len(selection.kept)}/{self.prompts_per_step} groups")
            self._abort_surplus(requests, generating.values(), selection.cutoff, crashed)
        return crashed

    @staticmethod
    def _abort_surplus(
        requests: dict[int, _Submission], in_flight: Iterable[int], cutoff: int, crashed: dict[int, tuple]
    ) -> None:
        """Abort the requests in flight at or past ``cutoff`` (an engine found gone has nothing to abort)."""
        gone = {id(engine) for engine, _ in crashed.values()}
        for position in in_flight:
            sub = requests[position]
            if position >= cutoff and id(sub.engine) not in gone:
                with contextlib.suppress(EngineUnavailableError):  # its own request fails the same way
                    sub.engine.abort(sub.uid)

    def _next_serial(self) -> int:
        """Serial number of the sampler's next prompt (epoch * dataset size + position): resume-safe request ids."""
        state = self.sampler.state_dict()
        return state["epoch"] * self.sampler.dataset_size + state["position"]

    def generate_step(self) -> RolloutStep:
        """Kept groups for one training step and the step's rollout metrics."""
        start = time.perf_counter()
        kept: list[RolloutGroup] = []
        counts = {name: 0 for name in ("aborted", "dropped", "samples", "reward_errors", "reward_timeouts")}
        counts["engine_restarts"] = 0
        max_batches = self.dynamic_sampling.max_gen_batches if self.dynamic_sampling.enable else 1
        bar = _Progress(self.prompts_per_step)
        try:
            for gen_batches in range(1, max_batches + 1):  # noqa: B007 - read after the loop
                self._run_batch(self.sampler.next_batch(), kept, counts, bar)
                if len(kept) >= self.prompts_per_step:
                    break
        finally:
            bar.close()
        if len(kept) < self.prompts_per_step and self.dynamic_sampling.on_exhausted == "error":
            raise RolloutExhaustedError(
                f"dynamic sampling kept {len(kept)} of {self.prompts_per_step} groups after {gen_batches} generation "
                f"batches ({counts['dropped']} dropped without signal); raise "
                "algorithm.dynamic_sampling.max_gen_batches or set on_exhausted: train_partial"
            )
        return RolloutStep(kept, self._metrics(kept, counts, gen_batches, time.perf_counter() - start))

    @staticmethod
    def _metrics(kept: list[RolloutGroup], counts: dict[str, int], gen_batches: int, seconds: float) -> dict:
        return {
            "rollout/groups_kept": float(len(kept)),
            "rollout/groups_dropped": float(counts["dropped"]),
            "rollout/groups_aborted": float(counts["aborted"]),
            "rollout/gen_batches": float(gen_batches),
            "rollout/samples": float(counts["samples"]),
            "rollout/reward_errors": float(counts["reward_errors"]),
            "rollout/reward_timeouts": float(counts["reward_timeouts"]),
            "rollout/engine_restarts": float(counts["engine_restarts"]),
            "rollout/seconds": seconds,
        }

    def close(self) -> None:
        """Stop the reward workers and request threads (engines are not shut down)."""
        self.rewards.close()
        self._threads.shutdown(wait=True, cancel_futures=True)
