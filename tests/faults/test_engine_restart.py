"""A rollout engine that crashes mid-generation is restarted, and the run's results do not change.

The crash is injected (``engines/reference/fault_injection.py``): the engine process exits with
code 17 on its N-th ``/generate`` request, holding the requests it had. First the rollout manager
alone against two real reference engines (a restart hook that starts a new process); then the tiny
DAPO run end to end, colocated and disaggregated: the final weights equal an uninterrupted run's, the
restart is counted, and past ``rollout.max_engine_restarts`` the run stops naming the engine, its
exit code and its log tail. Last, the async recipe (``train.max_staleness: 1``), whose engines
generate the next step beside training: with two engines, one crashing there is restarted and left
out until the next sync while the other takes its requests, and the run ends with the uninterrupted
run's weights; with one engine the run stops with an error that says why and how it resumes.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines import EngineUnavailableError, ReferenceEngine
from megatron_rl.engines.reference.fault_injection import ENGINE_EXIT_ENV, EXIT_CODE, engine_exit_fault
from megatron_rl.rollout.manager import RolloutManager
from tests.distributed_utils import free_port
from tests.e2e.tiny_runs import ROOT, RUN, read_metrics, run_env, train_command
from tests.rollout_managers import build_manager
from tests.tiny_checkpoints import save_tiny_moe

REWARD = "tests.rollout_rewards:first_token_parity"
PROMPTS = 12
STEPS = 4
CRASH_AT_REQUEST = 40
"""16 requests per generation batch: the 40th /generate is in step 3, after two weight syncs."""


def _engine(name: str, model: Path, log_dir: Path, env: dict[str, str] | None = None) -> ReferenceEngine:
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        engine = ReferenceEngine(name, model, free_port(), log_dir=log_dir, routed_experts_shape=(4, 2))
        engine.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    engine.wait_healthy(120)
    return engine


def _manager(engines, recover=None) -> RolloutManager:
    rollout = RolloutConfig(engine="reference", n_samples_per_prompt=4, max_response_length=8)
    rollout = rollout.model_copy(update={"max_concurrent_requests": 2})
    truths = ["mixed"] * PROMPTS
    dataset = PromptDataset([PromptItem(i, [i % 50 + 1, 3], t, "test") for i, t in enumerate(truths)], 0)
    return build_manager(
        engines,
        dataset,
        PromptSampler(PROMPTS, PROMPTS, seed=0),
        rollout,
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        prompts_per_step=PROMPTS,
        reward=REWARD,
        reward_num_workers=1,
        reward_timeout_s=30.0,
        decode=lambda ids: " ".join(map(str, ids)),
        routing_replay=True,
        seed=7,
        recover=recover,
    )


def _generate(engines, recover=None):
    manager = _manager(engines, recover)
    try:
        return manager.generate_step()
    finally:
        manager.close()


def _outputs(step) -> list:
    return [
        (group.uid, s.response_ids, s.rollout_logprobs, s.score, s.routed_experts.tolist())
        for group in step.groups
        for s in group.samples
    ]


@pytest.mark.distributed
def test_the_manager_resubmits_a_crashed_engines_requests_to_its_restart(tmp_path: Path) -> None:
    model = save_tiny_moe(tmp_path / "moe")
    healthy = [_engine(f"ok{i}", model, tmp_path) for i in range(2)]
    try:
        expected = _generate(healthy)
    finally:
        for engine in healthy:
            engine.shutdown()

    fault = {ENGINE_EXIT_ENV: engine_exit_fault(3, 1, tmp_path / "crashes")}
    crashing, steady = _engine("crashing", model, tmp_path, fault), _engine("steady", model, tmp_path)
    replacements: list[ReferenceEngine] = []
    seen: list[tuple[str, str]] = []

    def restart(crashed) -> list[ReferenceEngine]:
        for engine, error in crashed:
            seen.append((engine.name, str(error)))
            replacement = _engine("replacement", model, tmp_path)
            replacements.append(replacement)
            engine.rebind("127.0.0.1", int(replacement.base_url.rsplit(":", 1)[1]))
        return [crashing, steady]

    try:
        step = _generate([crashing, steady], restart)
        one_more = {ENGINE_EXIT_ENV: engine_exit_fault(1, 2, tmp_path / "crashes")}
        replacements.append(_engine("unrecovered", model, tmp_path, one_more))
        with pytest.raises(EngineUnavailableError, match=f"exited with code {EXIT_CODE}"):
            _generate([replacements[-1], steady])  # no restart hook: the crash is the manager's error
    finally:
        for engine in [crashing, steady, *replacements]:
            engine.shutdown()
    assert [name for name, _ in seen] == ["crashing"]
    assert f"exited with code {EXIT_CODE}" in seen[0][1] and "log tail" in seen[0][1]
    assert step.metrics["rollout/engine_restarts"] == 1 and expected.metrics["rollout/engine_restarts"] == 0
    assert step.metrics["rollout/groups_kept"] == PROMPTS
    assert _outputs(step) == _outputs(expected)


OVERRIDES = [
    f"train.steps={STEPS}",
    "train.prompts_per_step=4",
    "rollout.n_samples_per_prompt=8",
    "algorithm.dynamic_sampling.gen_batch_prompts=16",
    "validation.interval=0",
    "checkpoint.export_hf=true",
    "logging.sinks=[jsonl]",
]


ASYNC_RECIPE = ROOT / "recipes" / "tiny_moe_cpu_dapo_async.yaml"
ASYNC_RUN = Path("runs") / "tiny-moe-cpu-dapo-async"
ASYNC_CRASH_AT_REQUEST = 30
"""Per engine, with 2 engines: step 1's 2 batches are its requests 1-16 (generated before training);
step 2's 4 batches, generated while step 1 trains, are 17-48."""


def _run(
    run_dir: Path, *overrides: str, fault: str | None = None, recipe: Path | None = None
) -> subprocess.CompletedProcess:
    """The tiny DAPO run in ``run_dir`` (its records under ``run_dir / RUN``), the fault in its environment."""
    env = run_env() | ({ENGINE_EXIT_ENV: fault} if fault else {})
    command = train_command([*OVERRIDES, *overrides], *([recipe] if recipe else []))
    return subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=900)


def _records(run_dir: Path, run: Path = RUN) -> list[dict]:
    return read_metrics(run_dir / run)


def _final_weights(run_dir: Path, run: Path = RUN) -> dict:
    checkpoints = run_dir / run / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    return {k: v for file in sorted((latest / "hf").glob("*.safetensors")) for k, v in load_file(file).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = _run(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement",
    [
        pytest.param([], id="colocated"),
        pytest.param(
            ["rollout.placement=disaggregated", "cluster.cpu_engines=2"],
            id="disaggregated-2-engines",
            marks=pytest.mark.full,
        ),
    ],
)
def test_a_crashed_engine_is_restarted_and_the_run_ends_with_the_uninterrupted_weights(
    uninterrupted: Path, tmp_path: Path, placement: list[str]
) -> None:
    done = _run(tmp_path, *placement, fault=engine_exit_fault(CRASH_AT_REQUEST, 1, tmp_path / "crashes"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "crashes").iterdir())) == 1  # the fault did fire
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert sum(r.get("rollout/engine_restarts", 0) for r in records) == 1
    final, expected = _final_weights(tmp_path), _final_weights(uninterrupted)
    assert final.keys() == expected.keys()
    assert [name for name in expected if not final[name].equal(expected[name])] == []
    keys = ("train/reward_mean", "rollout/samples", "rollout/groups_kept", "actor/loss")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in _records(uninterrupted)]


# Full tier: CI restarts a crashed engine (colocated) and stops on the only engine crashing beside training.
@pytest.mark.full
@pytest.mark.slow
def test_past_max_engine_restarts_the_run_stops_naming_the_engine_its_exit_code_and_log(tmp_path: Path) -> None:
    done = _run(tmp_path, "rollout.max_engine_restarts=1", fault=engine_exit_fault(20, 2, tmp_path / "crashes"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(
        r"error: engine reference0 crashed after 1 engine restarts in this run \(rollout.max_engine_restarts=1\)",
        done.stderr,
    ), done.stderr[-3000:]
    assert f"exited with code {EXIT_CODE}" in done.stderr and "log tail" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.full
def test_an_engine_crashing_beside_training_is_left_out_until_the_next_sync(tmp_path: Path) -> None:
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    straight.mkdir()
    crashed.mkdir()
    done = _run(straight, "cluster.cpu_engines=2", recipe=ASYNC_RECIPE)
    assert done.returncode == 0, done.stderr[-3000:]
    fault = engine_exit_fault(ASYNC_CRASH_AT_REQUEST, 1, tmp_path / "crashes")
    done = _run(crashed, "cluster.cpu_engines=2", fault=fault, recipe=ASYNC_RECIPE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "crashes").iterdir())) == 1  # the fault did fire
    records = _records(crashed, ASYNC_RUN)
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 1.0, 0.0, 0.0]  # in step 2's generation
    final, expected = _final_weights(crashed, ASYNC_RUN), _final_weights(straight, ASYNC_RUN)
    assert final.keys() == expected.keys()
    assert [name for name in expected if not final[name].equal(expected[name])] == []
    keys = ("train/reward_mean", "rollout/samples", "rollout/groups_kept", "actor/loss", "async/staleness_max")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in _records(straight, ASYNC_RUN)]


@pytest.mark.slow
def test_the_only_engine_crashing_beside_training_stops_the_run_saying_how_it_resumes(tmp_path: Path) -> None:
    done = _run(tmp_path, fault=engine_exit_fault(40, 1, tmp_path / "crashes"), recipe=ASYNC_RECIPE)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: engine(s) reference0 crashed while the next step was generated beside training" in done.stderr
    assert (
        "resumes from the latest when started again" in done.stderr and f"exited with code {EXIT_CODE}" in done.stderr
    )
    assert "Traceback" not in done.stderr
