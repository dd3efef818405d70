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
   partial step when ``on_exhausted: train_partial``). Without partial rollouts
   the next batch is sent as soon as it is certain to be needed (the groups kept
   plus those not yet known to be dropped cannot fill the step), while the
   current one's last groups still generate; the batches and kept groups are
   those of sending it after the current one ends.

With partial rollouts (``rollout.partial_rollout_tokens``, :mod:`partial`), each request generates
at most a window of tokens; a group with a response cut at the window is carried to the next step,
whose first generation batch continues the carried groups (in their order) before its new prompts.
A carried group is decided (kept or dropped) once all its responses have ended; carried groups past
the step's cutoff stay carried, unchanged (``rollout/groups_carried`` counts those left after the step).

Prompts of aborted groups are not re-queued (the sampler has moved on). A request whose engine
process is gone (:class:`~megatron_rl.rollout.engine.EngineUnavailableError`) is held until every
other request of the batch has answered; then ``recover`` restarts the crashed engines (see
``orchestration/engine_recovery``) and the held requests go again unchanged, seeds included, to
the engines it says are ready (round-robin; until :meth:`RolloutManager.use_engines` says
otherwise, later requests too), so the step's groups are those of a run without the crash
(``rollout/engine_restarts`` counts the restarts). Without ``recover`` the error is raised.
Request ids are ``<uid_prefix><serial>``, the serial counting the sampler's
prompts over epochs, so they (and, with ``seed``, each request's sampling seed
``seed * 2**32 + serial``) are the same after a resume from the sampler's state.
On SGLang (``rollout.engine: sglang``) the request carries one seed per sample instead, derived
from that one (:func:`~megatron_rl.rollout.partial.sample_seeds`): SGLang seeds each sample on its
own, and a request's one seed would make its ``n`` samples alike. SGLang 0.5.23 uses the seeds only
under deterministic inference (``rollout.deterministic_inference``); without it its samples are
not reproducible. The reference engine gets the one seed and is reproducible either way.
Metrics: ``rollout/groups_kept``, ``groups_dropped``, ``groups_aborted``,
``gen_batches``, ``samples``, ``reward_errors``, ``reward_timeouts``, ``engine_restarts``, ``seconds``. Rewards,
accuracy and lengths of the kept samples are the trainer's ``train/...`` metrics (computed
once, by the driver).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.algorithms import groups_with_signal, overlong_penalty
from megatron_rl.rollout.engine import EngineUnavailableError, RolloutEngine
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample, RolloutStep
from megatron_rl.rollout.partial import (
    PartialGroup,
    PartialSample,
    WindowPlan,
    continuation_requests,
    sample_seeds,
)
from megatron_rl.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.rollout.scoring import RewardPool, ScoredResponse

if TYPE_CHECKING:
    from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
    from megatron_rl.data import PromptDataset, PromptItem, PromptSampler


Recovery = Callable[[Sequence[tuple[RolloutEngine, EngineUnavailableError]]], Sequence[RolloutEngine]]
"""Restarts the crashed engines given (each with one of its errors); returns the engines ready to take
requests now (all of them, or those without a restart still waiting for its weights)."""


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
class _Request:
    """One ``/generate`` request of a group's window: the engine it goes to (again, after a crash), the
    group's samples it fills, in order, and whether the window (not the response budget) caps it."""

    engine: RolloutEngine
    request: GenerateRequest
    samples: list[int]
    capped: bool


@dataclass(frozen=True)
class _Submission:
    """One group's window: its requests (one ``n``-sample request for a new group, one per unfinished
    response for a continued one); ``continued`` is True for a group carried from an earlier step."""

    group: PartialGroup
    requests: list[_Request]
    continued: bool


class _OrderedSelection:
    """Keeps groups in submission order, as if they had come back one by one: the outcome does not depend on timing.

    A group at position p is kept when it has signal and fewer than ``needed`` groups were kept before it;
    once the step is full at position p, ``cutoff`` becomes p + 1 and later positions are surplus (aborted).
    The counts are of the settled positions too, so they do not depend on timing either: ``dropped``
    (settled groups without signal), ``samples`` (the responses of settled groups, kept or dropped),
    ``reward_errors`` and ``reward_timeouts`` (those of their responses whose reward failed) and, after
    :meth:`finish`, ``aborted`` (every position past the cutoff, and settled requests an engine aborted).
    A group still generating (partial rollouts) settles as carried: it joins ``unfinished`` in position
    order, as do, at :meth:`finish`, the continued groups past the cutoff, unchanged.
    """

    def __init__(
        self, size: int, kept: list[RolloutGroup], unfinished: list[PartialGroup], needed: int, counts: dict[str, int]
    ) -> None:
        self.cutoff = size
        self._size = size
        self.kept, self.unfinished, self._needed, self._counts = kept, unfinished, needed, counts
        self._outcomes: dict[int, tuple[RolloutGroup | PartialGroup | None, bool]] = {}
        self._settled = 0
        self._waiting_unkept = 0  # outcomes waiting to settle that will not be kept

    def discard(self, position: int) -> None:
        """The request at ``position`` was aborted or is surplus (past the cutoff: counted by :meth:`finish`)."""
        if position < self.cutoff:
            self._record(position, None, False)

    def decide(self, position: int, group: RolloutGroup, has_signal: bool) -> None:
        """The scored group at ``position``; dynamic sampling drops it when it has no signal."""
        self._record(position, group, has_signal)

    def carry(self, position: int, group: PartialGroup) -> None:
        """The group at ``position`` has responses still generating: it goes on in the next step."""
        if position < self.cutoff:
            self._record(position, group, False)

    def cannot_fill(self) -> bool:
        """Whether the step stays short of ``needed`` even if every position not yet known to be dropped,
        discarded or carried is kept: the next generation batch is then certain to be needed. O(1)."""
        possible = self._size - self._settled - self._waiting_unkept
        return len(self.kept) + possible < self._needed

    def extend(self, count: int) -> None:
        """Append ``count`` positions (a generation batch taken while this one runs); only while
        :meth:`cannot_fill`, when no cutoff has been set (``cutoff`` is the size)."""
        self._size += count
        self.cutoff = self._size

    def finish(self, continued: dict[int, PartialGroup]) -> None:
        """The batch is over: positions past the cutoff count as aborted, except the ``continued`` groups
        (by position), which stay carried as they were."""
        for position in range(self.cutoff, self._size):
            if position in continued:
                self.unfinished.append(continued[position])
            else:
                self._counts["aborted"] += 1

    def _record(self, position: int, group: RolloutGroup | PartialGroup | None, has_signal: bool) -> None:
        self._outcomes[position] = (group, has_signal)
        self._waiting_unkept += not has_signal
        self._settle()

    def _settle(self) -> None:
        while self._settled < self.cutoff and self._settled in self._outcomes:
            group, has_signal = self._outcomes.pop(self._settled)
            self._settled += 1
            self._waiting_unkept -= not has_signal
            if group is None:
                self._counts["aborted"] += 1
                continue
            if isinstance(group, PartialGroup):
                self.unfinished.append(group)
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
    ``early_batches`` (without partial rollouts only) sends a generation batch as soon as it is certain
    to be needed; False sends it after the one before has ended (the same groups, later).
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
        max_token_lag: int | None = None,
        early_batches: bool = True,
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
        self.windows = WindowPlan(
            rollout.partial_rollout_tokens, rollout.partial_rollout_max_windows, rollout.max_response_length
        )
        self._unfinished: list[PartialGroup] = []
        self.max_token_lag = max_token_lag
        self.early_batches = early_batches and self.windows.tokens is None

    def _sampling(self, max_new_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.rollout.temperature,
            top_p=self.rollout.top_p,
            top_k=self.rollout.top_k,
            n=self.rollout.n_samples_per_prompt,
            sampling_seed=seed,
        )

    def _new_submission(self, item: PromptItem, uid: str, serial: int) -> _Submission:
        """A new prompt's first window: one request for all its samples (with a seed per sample on SGLang)."""
        seed = None if self.seed is None else self.seed * _SEED_STRIDE + serial
        max_new, capped = self.windows.budget(0, 0)
        n = self.rollout.n_samples_per_prompt
        seeds = sample_seeds(seed, n) if seed is not None and self.rollout.engine == "sglang" else None
        request = GenerateRequest(
            list(item.prompt_ids),
            self._sampling(max_new, None if seeds else seed),
            rid=uid,
            return_routed_experts=self.routing_replay,
            sample_seeds=seeds,
        )
        group = PartialGroup(item, uid, seed, [PartialSample() for _ in range(n)])
        return _Submission(group, [_Request(next(self._engine_cycle), request, list(range(n)), capped)], False)

    def _new_submissions(self, indices: list[int]) -> list[_Submission]:
        """The first windows of the prompts ``indices``, just taken from the sampler: their serials (request
        ids and seeds) count from the sampler's position after the batch."""
        serial = self._next_serial()
        return [
            self._new_submission(self.dataset[index], f"{self._uid_prefix}{serial + offset}", serial + offset)
            for offset, index in enumerate(indices)
        ]

    def _continued_submission(self, group: PartialGroup) -> _Submission:
        """A carried group's next window: one request per unfinished response."""
        planned = continuation_requests(
            group, self.windows, self._sampling(0, None), routing_replay=self.routing_replay
        )
        requests = [_Request(next(self._engine_cycle), request, [index], capped) for index, request, capped in planned]
        return _Submission(group, requests, True)

    def _advanced(self, sub: _Submission, answers: dict[int, list[GenerateResult]]) -> PartialGroup:
        """``sub``'s group with this window's answers (by request index) appended, as a copy: ``sub.group``
        stays as it was, which is what a continued group that ends up past the cutoff is carried as, whether
        or not its window had come back (so the carried state does not depend on timing)."""
        samples = [
            dataclasses.replace(
                s,
                output_ids=list(s.output_ids),
                output_logprobs=list(s.output_logprobs),
                version_segments=list(s.version_segments),
            )
            for s in sub.group.samples
        ]
        for index, request in enumerate(sub.requests):
            for sample, result in zip(request.samples, answers[index], strict=True):
                samples[sample].extend(
                    result, capped=request.capped, max_response_length=self.rollout.max_response_length
                )
        old = sub.group
        return PartialGroup(old.item, old.uid, old.first_seed, samples, old.windows + 1)

    def _group(self, partial: PartialGroup, scored: list[ScoredResponse]) -> RolloutGroup:
        item, uid = partial.item, partial.uid
        results = [sample.as_result(len(item.prompt_ids)) for sample in partial.samples]
        lengths = torch.tensor([len(r.output_ids) for r in results])
        penalties = torch.zeros(len(results))
        if self.overlong.enable:
            penalties = overlong_penalty(
                lengths, self.rollout.max_response_length, self.overlong.buffer_length, self.overlong.penalty_factor
            )
        samples = []
        for partial_sample, result, reward, penalty in zip(
            partial.samples, results, scored, penalties.tolist(), strict=True
        ):
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
                    version_segments=list(partial_sample.version_segments),
                )
            )
        return RolloutGroup(uid=uid, prompt_index=item.index, samples=samples)

    def _has_signal(self, group: RolloutGroup) -> bool:
        return not self.dynamic_sampling.enable or group_has_signal(group, self.dynamic_sampling.metric)

    def _run_batch(
        self,
        indices: list[int],
        continued: list[PartialGroup],
        kept: list[RolloutGroup],
        unfinished: list[PartialGroup],
        counts: dict[str, int],
        bar: _Progress,
        take_batch: Callable[[], list[int]] | None,
    ) -> None:
        """Generate one round: the ``continued`` groups' next windows, then the prompts ``indices``; the groups
        still generating after it are appended to ``unfinished``, in order.

        With ``take_batch`` (no partial rollouts), the round goes on with the next generation batch, taken
        from ``take_batch`` (empty: none may be taken), as soon as the groups so far are certain not to fill
        the step (:meth:`_OrderedSelection.cannot_fill`), while the rest of this one still generates: the
        batches, seeds and kept groups are those of one round per batch, without the engines idling
        between batches.
        """
        submissions = [self._continued_submission(group) for group in continued] + self._new_submissions(indices)
        selection = _OrderedSelection(len(submissions), kept, unfinished, self.prompts_per_step, counts)

        def next_batch() -> dict[int, _Submission]:
            if take_batch is None or not selection.cannot_fill():
                return {}
            first = len(submissions)
            submissions.extend(self._new_submissions(take_batch()))
            selection.extend(len(submissions) - first)
            return dict(enumerate(submissions[first:], start=first))

        pending = dict(enumerate(submissions))
        while pending:
            crashed = self._generate(pending, selection, bar, next_batch)
            pending = {position: pending[position] for position in crashed if position < selection.cutoff}
            if pending:
                counts["engine_restarts"] += self._recover_engines([crashed[position] for position in pending])
                pending = {position: self._on_ready_engines(sub) for position, sub in pending.items()}
        selection.finish({position: sub.group for position, sub in enumerate(submissions) if sub.continued})

    def _recover_engines(self, failures: list[tuple[RolloutEngine, EngineUnavailableError]]) -> int:
        """Hand each crashed engine (with one of its errors) to ``recover``; how many engines that was.

        Without ``recover``, the first error is raised."""
        if self.recover is None:
            raise failures[0][1]
        first_error: dict[int, tuple[RolloutEngine, EngineUnavailableError]] = {}
        for engine, error in failures:
            first_error.setdefault(id(engine), (engine, error))
        self.use_engines(self.recover(list(first_error.values())))
        return len(first_error)

    def use_engines(self, engines: Sequence[RolloutEngine]) -> None:
        """Send the next requests round-robin over ``engines`` (some of the manager's engines, or all)."""
        self._engine_cycle = itertools.cycle(list(engines))

    def _on_ready_engines(self, sub: _Submission) -> _Submission:
        """``sub`` with each request moved to the next ready engine (after a recovery)."""
        requests = [dataclasses.replace(req, engine=next(self._engine_cycle)) for req in sub.requests]
        return dataclasses.replace(sub, requests=requests)

    def _generate(
        self,
        submissions: dict[int, _Submission],
        selection: _OrderedSelection,
        bar: _Progress,
        next_batch: Callable[[], dict[int, _Submission]],
    ) -> dict[int, tuple[RolloutEngine, EngineUnavailableError]]:
        """Send ``submissions`` (by position), score the groups that ended, carry the others, and decide
        each group in ``selection``; after each answer or score, send what ``next_batch`` returns too
        (added to ``submissions``).

        Returns once every request has answered or failed and every score is in; the positions with a
        request whose engine was unreachable (its process gone), with the engine and the error, are
        returned undecided.
        """
        generating: dict[Future, tuple[int, int]] = {}
        answers: dict[int, dict[int, list[GenerateResult]]] = {}
        scoring: dict[Future, tuple[int, PartialGroup]] = {}
        crashed: dict[int, tuple[RolloutEngine, EngineUnavailableError]] = {}

        def send(batch: dict[int, _Submission]) -> None:
            submissions.update(batch)
            for position, sub in batch.items():
                answers[position] = {}
                for index, req in enumerate(sub.requests):
                    generating[self._threads.submit(req.engine.generate, req.request)] = (position, index)

        send(dict(submissions))
        while generating or scoring:
            done, _ = wait([*generating, *scoring], return_when=FIRST_COMPLETED)
            for future in done:
                if future in generating:
                    position, index = generating.pop(future)
                    sub = submissions[position]
                    try:
                        answers[position][index] = future.result()
                    except EngineUnavailableError as error:
                        crashed.setdefault(position, (sub.requests[index].engine, error))
                    if len(answers[position]) == len(sub.requests):
                        self._window_done(position, sub, answers.pop(position), selection, scoring)
                else:
                    position, group = scoring.pop(future)
                    scored = self._group(group, future.result())
                    if position < selection.cutoff:
                        selection.decide(position, scored, self._has_signal(scored))
            send(next_batch())
            bar.update(len(selection.kept), f"rollout: {len(selection.kept)}/{self.prompts_per_step} groups")
            self._abort_surplus(submissions, {position for position, _ in generating.values()}, selection, crashed)
        return crashed

    def _window_done(
        self,
        position: int,
        sub: _Submission,
        answers: dict[int, list[GenerateResult]],
        selection: _OrderedSelection,
        scoring: dict[Future, tuple[int, PartialGroup]],
    ) -> None:
        """Every request of ``sub`` answered: score its group if it ended, carry it if not (a continued
        group an engine aborted, or past the cutoff, stays as it was; a new one is discarded)."""
        if any(r.aborted for results in answers.values() for r in results) or position >= selection.cutoff:
            if sub.continued:
                selection.carry(position, sub.group)
            else:
                selection.discard(position)
            return
        group = self._advanced(sub, answers)
        if not group.finished:
            selection.carry(position, group)
            return
        texts = [self.decode(sample.output_ids) for sample in group.samples]
        item = group.item
        scoring[self.rewards.submit(texts, item.ground_truth, item.extra_info, label=group.uid)] = (position, group)

    @staticmethod
    def _abort_surplus(
        submissions: dict[int, _Submission], in_flight: set[int], selection: _OrderedSelection, crashed: dict
    ) -> None:
        """Abort the requests in flight at or past the cutoff (an engine found gone has nothing to abort)."""
        gone = {id(engine) for engine, _ in crashed.values()}
        for position in in_flight:
            if position < selection.cutoff:
                continue
            for req in submissions[position].requests:
                if id(req.engine) not in gone and isinstance(req.request.rid, str):  # ours are str (rid=uid)
                    with contextlib.suppress(EngineUnavailableError):  # its own request fails the same way
                        req.engine.abort(req.request.rid)

    def _next_serial(self) -> int:
        """Serial number of the sampler's next prompt (epoch * dataset size + position): resume-safe request ids."""
        state = self.sampler.state_dict()
        return state["epoch"] * self.sampler.dataset_size + state["position"]

    def generate_step(self, for_step: int | None = None) -> RolloutStep:
        """Kept groups for one training step (``for_step``, trained by the policy of step ``for_step - 1``)
        and the step's rollout metrics.

        With ``max_token_lag`` and ``for_step``, a carried group whose oldest token would lag more than
        ``max_token_lag`` weight versions behind that policy is dropped before it continues
        (``rollout/groups_stale``; its prompt is not taken again).

        The step runs in rounds until ``prompts_per_step`` groups are kept. A round gives every carried
        group (from the step before, then from the round before) its next window, and takes a new
        generation batch from the sampler when the carried groups alone cannot fill the step (at most
        ``max_gen_batches`` batches with dynamic sampling, else one). Without partial rollouts no group
        is carried, so each round is one generation batch. The step ends short (an error, or the partial
        step with ``on_exhausted: train_partial``) when no group is left generating and no batch may
        be taken.
        """
        start = time.perf_counter()
        kept: list[RolloutGroup] = []
        counts = {name: 0 for name in ("aborted", "dropped", "samples", "reward_errors", "reward_timeouts")}
        counts["engine_restarts"] = counts["stale"] = 0
        max_batches = self.dynamic_sampling.max_gen_batches if self.dynamic_sampling.enable else 1
        bar = _Progress(self.prompts_per_step)
        carried, self._unfinished = self._unfinished, []
        if for_step is not None and self.max_token_lag is not None:
            fresh = [g for g in carried if for_step - 1 - (g.oldest_version() or 0) <= self.max_token_lag]
            counts["stale"], carried = len(carried) - len(fresh), fresh
        gen_batches = 0

        def take_batch() -> list[int]:
            """The sampler's next generation batch (never empty), or [] once ``max_batches`` were taken."""
            nonlocal gen_batches
            if gen_batches >= max_batches:
                return []
            gen_batches += 1
            return self.sampler.next_batch()

        early = take_batch if self.early_batches else None
        try:
            while len(kept) < self.prompts_per_step:
                indices = take_batch() if len(kept) + len(carried) < self.prompts_per_step else []
                if not indices and not carried:
                    break
                unfinished: list[PartialGroup] = []
                self._run_batch(indices, carried, kept, unfinished, counts, bar, early)
                carried = unfinished
        finally:
            bar.close()
        self._unfinished = carried
        if len(kept) < self.prompts_per_step and self.dynamic_sampling.on_exhausted == "error":
            raise RolloutExhaustedError(
                f"dynamic sampling kept {len(kept)} of {self.prompts_per_step} groups after {gen_batches} generation "
                f"batches ({counts['dropped']} dropped without signal); raise "
                "algorithm.dynamic_sampling.max_gen_batches or set on_exhausted: train_partial"
            )
        metrics = self._metrics(kept, counts, gen_batches, time.perf_counter() - start)
        partial = {"rollout/groups_carried": float(len(carried)), "rollout/groups_stale": float(counts["stale"])}
        return RolloutStep(kept, metrics | partial)

    def unfinished_groups(self) -> list[PartialGroup]:
        """The groups carried to the next step (partial rollouts), in order: what a checkpoint saves."""
        return list(self._unfinished)

    def restore_unfinished(self, groups: list[PartialGroup]) -> None:
        """Carry ``groups`` (from :meth:`unfinished_groups` of a checkpoint) into the next step."""
        self._unfinished = list(groups)

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
