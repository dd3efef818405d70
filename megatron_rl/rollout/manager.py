"""The rollout manager: prompts in, a step's worth of scored groups out.

It runs three parts: the engine pool (:mod:`engine_pool`: round-robin requests, aborts, recovery),
the step selection (:mod:`step_selection`: which groups the step keeps, and the counts) and the
group assembler (:mod:`group_assembler`: scores, overlong shaping, masks, dynamic sampling's signal);
:mod:`submissions` makes each group's requests (ids, seeds, windows).

Per step (:meth:`RolloutManager.generate_step`):

1. take a generation batch of prompt indices from the sampler (its batch size
   is the generation batch, ``algorithm.dynamic_sampling.gen_batch_prompts`` in
   a recipe; larger than ``prompts_per_step`` over-samples);
2. send one ``/generate`` request per prompt with ``n`` samples, spread
   round-robin over the engines, at most ``max_concurrent_requests`` per
   engine in flight;
3. as each group comes back, score it, shape it and, with dynamic sampling, drop it when it has no
   signal (the group assembler);
4. groups are kept in submission order, whatever order they come back in (the step selection); once
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
process is gone is held until every other request of the batch has answered; then the engine pool's
``recover`` hook restarts the crashed engines and the held requests go again unchanged, seeds
included, to the engines it says are ready (until :meth:`RolloutManager.use_engines` says
otherwise, later requests too), so the step's groups are those of a run without the crash
(``rollout/engine_restarts`` counts the restarts). Without ``recover`` the error is raised.
Request ids and seeds are resume-safe (:mod:`submissions`). SGLang 0.5.23 uses the seeds only
under deterministic inference (``rollout.deterministic_inference``); without it its samples are
not reproducible. The reference engine gets one seed per request and is reproducible either way.
Metrics: ``rollout/groups_kept``, ``groups_dropped``, ``groups_aborted``,
``gen_batches``, ``samples``, ``reward_errors``, ``reward_timeouts``, ``tool_calls``, ``tool_errors``,
``tool_timeouts``, ``tool_limit_stops``, ``engine_restarts``, ``seconds``. Rewards,
accuracy and lengths of the kept samples are the trainer's ``train/...`` metrics (computed
once, by the driver).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.engines.engine import EngineUnavailableError, RolloutEngine
from megatron_rl.engines.protocol import GenerateResult
from megatron_rl.rollout.engine_pool import EnginePool
from megatron_rl.rollout.episodes import EnvironmentReply, Episode, SingleTurn
from megatron_rl.rollout.group_assembler import GroupAssembler
from megatron_rl.rollout.groups import RolloutStep
from megatron_rl.rollout.partial import PartialGroup
from megatron_rl.rollout.scoring import ScoredResponse
from megatron_rl.rollout.step_selection import StepSelection
from megatron_rl.rollout.submissions import Request, Submission, SubmissionPlanner, WindowProgress

if TYPE_CHECKING:
    from megatron_rl.config.schema import DynamicSamplingConfig
    from megatron_rl.data import PromptSampler

_Crashes = dict[int, tuple[RolloutEngine, EngineUnavailableError]]
"""Positions whose window had a request fail because its engine was gone, with that engine and error."""


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


class _GenerationBatches:
    """A step's generation batches from the sampler: at most ``limit``; ``taken`` counts them."""

    def __init__(self, sampler: PromptSampler, limit: int) -> None:
        self._sampler, self._limit = sampler, limit
        self.taken = 0

    def take(self) -> list[int]:
        """The sampler's next generation batch (never empty), or [] once ``limit`` were taken."""
        if self.taken >= self._limit:
            return []
        self.taken += 1
        return self._sampler.next_batch()


@dataclass(frozen=True)
class StepPolicy:
    """How a step fills: ``prompts_per_step`` kept groups, with ``dynamic_sampling`` (its batch limit and what an
    exhausted step does); ``max_token_lag``: carried groups older than this many weight versions are dropped
    (None: never); ``early_batches``: send the next generation batch as soon as it is certain to be needed
    (without partial rollouts only; False: after the one before has ended: the same groups, later)."""

    prompts_per_step: int
    dynamic_sampling: DynamicSamplingConfig
    max_token_lag: int | None = None
    early_batches: bool = True


class RolloutManager:
    """Generates, scores, shapes and filters groups for training steps (see the module docstring), from its parts.

    ``pool``: the engines the requests go to; ``planner``: each group's requests (prompts from its sampler, whose
    batch is the generation batch); ``assembler``: scores, shaping and dynamic sampling's signal; ``policy``: how a
    step fills; ``episode``: how a response unfolds over turns (None: one turn), which must be the one whose stop
    tokens the planner was given. The manager owns the pool and the assembler (:meth:`close` closes them), not the
    episode. Group uids (also the engines' request ids) come from the planner's ``uid_prefix``; managers sharing
    engines need distinct prefixes, since an engine remembers an aborted id until a request of it ends.
    Raises ValueError when the sampler's batch is smaller than ``policy.prompts_per_step``.
    """

    def __init__(
        self,
        pool: EnginePool,
        planner: SubmissionPlanner,
        assembler: GroupAssembler,
        policy: StepPolicy,
        episode: Episode | None = None,
    ) -> None:
        if planner.sampler.batch_size < policy.prompts_per_step:
            raise ValueError(
                f"the sampler's generation batch ({planner.sampler.batch_size} prompts) is smaller than "
                f"prompts_per_step ({policy.prompts_per_step}); make it at least as large (larger to over-sample)"
            )
        self.pool, self.planner, self.assembler, self.policy = pool, planner, assembler, policy
        self.episode = episode or SingleTurn()
        self.early_batches = policy.early_batches and planner.windows.tokens is None
        self._unfinished: list[PartialGroup] = []

    @property
    def sampler(self) -> PromptSampler:
        """The prompt sampler the planner takes generation batches from (its state is the run's to save)."""
        return self.planner.sampler

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
        selection = StepSelection(self.policy.prompts_per_step)
        sampling = self.policy.dynamic_sampling
        batches = _GenerationBatches(self.planner.sampler, sampling.max_gen_batches if sampling.enable else 1)
        carried, self._unfinished = self._unfinished, []
        carried, stale = self._without_stale(carried, for_step)
        restarts = 0
        bar = _Progress(self.policy.prompts_per_step)
        try:
            while not selection.full:
                indices = batches.take() if len(selection.kept) + len(carried) < self.policy.prompts_per_step else []
                if not indices and not carried:
                    break
                round_ = _Round(self, selection, bar, batches.take if self.early_batches else None)
                carried = round_.run(indices, carried)
                restarts += round_.restarts
        finally:
            bar.close()
        self._unfinished = carried
        if not selection.full and sampling.on_exhausted == "error":
            raise RolloutExhaustedError(
                f"dynamic sampling kept {len(selection.kept)} of {self.policy.prompts_per_step} groups after "
                f"{batches.taken} "
                f"generation batches ({selection.counts.dropped} dropped without signal); raise "
                "algorithm.dynamic_sampling.max_gen_batches or set on_exhausted: train_partial"
            )
        metrics = _metrics(selection, batches.taken, restarts, time.perf_counter() - start)
        partial = {"rollout/groups_carried": float(len(carried)), "rollout/groups_stale": float(stale)}
        return RolloutStep(selection.kept, metrics | partial)

    def _without_stale(self, carried: list[PartialGroup], for_step: int | None) -> tuple[list[PartialGroup], int]:
        """The carried groups that may still continue for ``for_step`` (see :meth:`generate_step`), and how many may not."""
        lag = self.policy.max_token_lag
        if for_step is None or lag is None:
            return carried, 0
        fresh = [g for g in carried if for_step - 1 - (g.oldest_version() or 0) <= lag]
        return fresh, len(carried) - len(fresh)

    def use_engines(self, engines: Sequence[RolloutEngine]) -> None:
        """Send the next requests round-robin over ``engines`` (some of the manager's engines, or all)."""
        self.pool.use_engines(engines)

    def unfinished_groups(self) -> list[PartialGroup]:
        """The groups carried to the next step (partial rollouts), in order: what a checkpoint saves."""
        return list(self._unfinished)

    def restore_unfinished(self, groups: list[PartialGroup]) -> None:
        """Carry ``groups`` (from :meth:`unfinished_groups` of a checkpoint) into the next step."""
        self._unfinished = list(groups)

    def close(self) -> None:
        """Stop the reward workers and request threads (engines are not shut down)."""
        self.assembler.close()
        self.pool.close()


def _metrics(selection: StepSelection, gen_batches: int, engine_restarts: int, seconds: float) -> dict[str, float]:
    counts = selection.counts
    return {
        "rollout/groups_kept": float(len(selection.kept)),
        "rollout/groups_dropped": float(counts.dropped),
        "rollout/groups_aborted": float(counts.aborted),
        "rollout/gen_batches": float(gen_batches),
        "rollout/samples": float(counts.samples),
        "rollout/reward_errors": float(counts.reward_errors),
        "rollout/reward_timeouts": float(counts.reward_timeouts),
        "rollout/tool_calls": float(counts.tools.calls),
        "rollout/tool_errors": float(counts.tools.errors),
        "rollout/tool_timeouts": float(counts.tools.timeouts),
        "rollout/tool_limit_stops": float(counts.tools.limit_stops),
        "rollout/engine_restarts": float(engine_restarts),
        "rollout/seconds": seconds,
    }


class _Round:
    """One round of a step: the carried groups' next windows, then new prompts, generated, scored and decided.

    With ``take_batch`` (no partial rollouts), the round goes on with the next generation batch, taken
    from ``take_batch`` (empty: none may be taken), as soon as the groups so far are certain not to fill
    the step (:meth:`StepSelection.cannot_fill`), while the rest of this one still generates: the
    batches, seeds and kept groups are those of one round per batch, without the engines idling
    between batches. ``restarts`` counts the engines recovered during the round.

    In a multi-turn episode a sample's turn that ended at a stop token gets the episode's reply, then the
    model's next turn goes out as a request of its own within the window (:meth:`SubmissionPlanner.follow_up`);
    a window is over once none of its requests or replies is outstanding.
    """

    def __init__(
        self,
        manager: RolloutManager,
        selection: StepSelection,
        bar: _Progress,
        take_batch: Callable[[], list[int]] | None,
    ) -> None:
        self._pool, self._planner, self._assembler = manager.pool, manager.planner, manager.assembler
        self._episode = manager.episode
        self._max_response_length = manager.planner.rollout.max_response_length
        self._selection, self._bar, self._take_batch = selection, bar, take_batch
        self._all: list[Submission] = []
        self.restarts = 0
        # What one pass of :meth:`_generate` has in flight (reset by it).
        self._submissions: dict[int, Submission] = {}
        self._windows: dict[int, WindowProgress] = {}
        self._generating: dict[Future[list[GenerateResult]], tuple[int, Request]] = {}
        self._replying: dict[Future[EnvironmentReply], tuple[int, int]] = {}
        self._scoring: dict[Future[list[ScoredResponse]], tuple[int, PartialGroup]] = {}
        self._crashed: _Crashes = {}

    def run(self, indices: list[int], carried: list[PartialGroup]) -> list[PartialGroup]:
        """Generate the ``carried`` groups' next windows, then the prompts ``indices``; the groups still
        generating after the round, in order. Requests held for a crashed engine go again once it is
        recovered, until every position before the cutoff is decided."""
        self._all = [self._planner.continued(group) for group in carried] + self._planner.new(indices)
        self._selection.begin_round(len(self._all))
        pending = dict(enumerate(self._all))
        while pending:
            crashed = self._generate(pending)
            pending = {position: pending[position] for position in crashed if position < self._selection.cutoff}
            if pending:
                self.restarts += self._pool.recover([crashed[position] for position in pending])
                pending = {position: sub.moved(self._pool.next_engine) for position, sub in pending.items()}
        return self._selection.finish_round({p: sub.group for p, sub in enumerate(self._all) if sub.continued})

    def _generate(self, submissions: dict[int, Submission]) -> _Crashes:
        """Send ``submissions`` (by position), score the groups that ended, carry the others, and decide
        each group; after each answer, reply or score, send the next batch too if it is certain to be needed
        (added to ``submissions``). Returns once every request has answered or failed and every reply and
        score is in; the positions with a request whose engine was gone are returned undecided."""
        self._windows, self._generating, self._replying, self._scoring, self._crashed = {}, {}, {}, {}, {}
        self._submissions = submissions
        self._send(dict(submissions))
        while self._generating or self._replying or self._scoring:
            in_flight: list[Future[Any]] = [*self._generating, *self._replying, *self._scoring]
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                if future in self._generating:
                    self._answered(future)
                elif future in self._replying:
                    self._replied(future)
                else:
                    self._scored(future)
            self._send(self._next_batch())
            kept = len(self._selection.kept)
            self._bar.update(kept, f"rollout: {kept}/{self._selection.needed} groups")
            self._abort_surplus()
        return self._crashed

    def _send(self, batch: dict[int, Submission]) -> None:
        """Send ``batch``'s windows; they join the pass's submissions (what a crash sends again)."""
        self._submissions.update(batch)
        for position, sub in batch.items():
            self._windows[position] = sub.start()
            for request in sub.requests:
                self._request(position, request)

    def _request(self, position: int, request: Request) -> None:
        self._generating[self._pool.generate(request.engine, request.request)] = (position, request)

    def _next_batch(self) -> dict[int, Submission]:
        """The next generation batch's first windows (by position), when it is certain to be needed."""
        if self._take_batch is None or not self._selection.cannot_fill():
            return {}
        first = len(self._all)
        self._all.extend(self._planner.new(self._take_batch()))
        self._selection.extend(len(self._all) - first)
        return dict(enumerate(self._all[first:], start=first))

    def _answered(self, future: Future[list[GenerateResult]]) -> None:
        position, request = self._generating.pop(future)
        try:
            results = future.result()
        except EngineUnavailableError as error:
            self._crashed.setdefault(position, (request.engine, error))
            results = []
        window = self._windows[position]
        for sample in window.answered(request, results, self._max_response_length, kept=not self._abandoned(position)):
            self._ask_episode(position, sample)
        self._window_ended(position)

    def _ask_episode(self, position: int, sample: int) -> None:
        """After a model turn of ``sample`` that ended at a stop token, ask the episode for its reply."""
        window = self._windows[position]
        state = window.samples[sample]
        reply = self._episode.reply(window.submission.group.item, state.output_ids[state.turn_start :], state.turns)
        if reply is not None:
            window.reply_asked()
            self._replying[reply] = (position, sample)

    def _replied(self, future: Future[EnvironmentReply]) -> None:
        """Append the environment's reply and send the model's next turn (when the window has tokens left)."""
        position, sample = self._replying.pop(future)
        window = self._windows[position]
        kept = not self._abandoned(position)
        if window.replied(sample, future.result(), self._max_response_length, kept=kept):
            request = self._planner.follow_up(window, sample)
            if request is not None:
                self._request(position, request)
        self._window_ended(position)

    def _abandoned(self, position: int) -> bool:
        """Whether ``position``'s window will not be used: a request of it found its engine gone (the window
        goes again after the recovery), or it is past the cutoff (surplus)."""
        return position in self._crashed or position >= self._selection.cutoff

    def _window_ended(self, position: int) -> None:
        """Once nothing of ``position``'s window is outstanding: score its group if it ended, carry it if not
        (a continued group an engine aborted, or past the cutoff, stays as it was; a new one is discarded).
        A window with a crashed request stays undecided (:meth:`_generate` returns it)."""
        window = self._windows[position]
        if not window.done or position in self._crashed:
            return
        del self._windows[position]
        sub = window.submission
        if window.aborted or position >= self._selection.cutoff:
            if sub.continued:
                self._selection.carry(position, sub.group)
            else:
                self._selection.discard(position)
            return
        group = window.group()
        if not group.finished:
            self._selection.carry(position, group)
            return
        self._scoring[self._assembler.score(group)] = (position, group)

    def _scored(self, future: Future[list[ScoredResponse]]) -> None:
        position, partial = self._scoring.pop(future)
        scores = future.result()
        if position < self._selection.cutoff:  # past it, the group is surplus: its scores are discarded
            group = self._assembler.assemble(partial, scores)
            self._selection.decide(position, group, self._assembler.has_signal(group))

    def _abort_surplus(self) -> None:
        """Abort the requests in flight at or past the cutoff (an engine found gone has nothing to abort)."""
        gone = {id(engine) for engine, _ in self._crashed.values()}
        for position, request in self._generating.values():
            if position < self._selection.cutoff or id(request.engine) in gone:
                continue
            if isinstance(request.request.rid, str):  # ours are str (rid=uid)
                self._pool.abort(request.engine, request.request.rid)
