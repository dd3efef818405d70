"""The rank's training step runs through six files, from the driver to the loss, and no more.

``STEP_PATH`` is that path; each test holds one hop of it to the code, read with ``ast`` (no
module is imported, no model built): the driver calls ``TrainerGroup.train_step``, which runs
``TrainerWorker.train_step`` on every rank through ``RankWorkerGroup.call_per_rank``, which calls
the step function of ``actor/train_step.py`` directly (not through a ``PolicyActor`` method), and
that module calls Megatron's forward-backward schedule itself, with the loss of ``actor/loss.py``
as its loss function. A hop added back (a wrapper method, a schedule helper module between the
step and Megatron) fails one of them. docs/architecture.md's "The training step" lists the same
files in the same order.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_rl"
STEP_PATH = (
    "orchestration/driver.py",
    "orchestration/trainer_group.py",
    "orchestration/worker_group.py",
    "orchestration/trainer_worker.py",
    "actor/train_step.py",
    "actor/loss.py",
)
MAX_FILES = 6

FunctionDef = ast.FunctionDef | ast.AsyncFunctionDef


@cache
def module(path: str) -> ast.Module:
    return ast.parse((PACKAGE / path).read_text())


def top_level(path: str) -> dict[str, FunctionDef | ast.ClassDef]:
    """The module's top-level functions and classes by name."""
    return {
        node.name: node
        for node in module(path).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def method(path: str, cls: str, name: str) -> FunctionDef:
    (found,) = [
        node
        for node in ast.walk(top_level(path)[cls])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
    ]
    return found


def calls_reached(path: str, start: FunctionDef, cls: str | None = None) -> Iterator[ast.Call]:
    """Every call in ``start`` (nested functions included) and in the module's functions it calls by name
    (``name(...)`` a top-level function, ``self.name(...)`` a method of ``cls``), transitively."""
    functions = {name: node for name, node in top_level(path).items() if isinstance(node, FunctionDef)}
    methods = {n.name: n for n in top_level(path)[cls].body if isinstance(n, FunctionDef)} if cls else {}
    seen: set[str] = set()
    pending: list[FunctionDef] = [start]
    while pending:
        function = pending.pop()
        if function.name in seen:
            continue
        seen.add(function.name)
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            yield node
            callee = node.func
            if isinstance(callee, ast.Name) and callee.id in functions:
                pending.append(functions[callee.id])
            elif isinstance(callee, ast.Attribute) and dotted(callee.value) == "self" and callee.attr in methods:
                pending.append(methods[callee.attr])


def dotted(node: ast.expr) -> str:
    """``a.b.c`` of a name or attribute chain; ``?`` for any other part."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def imported_from(function: ast.AST, source: str) -> set[str]:
    """The names ``function`` (or its module) imports from the module ``source``."""
    return {
        alias.asname or alias.name
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and node.module == source
        for alias in node.names
    }


def schedule_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of the schedule Megatron's ``get_forward_backward_func()`` returns."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Call)
        and dotted(node.func.func).endswith("get_forward_backward_func")
    ]


def keyword(call: ast.Call, name: str) -> object:
    (value,) = [k.value for k in call.keywords if k.arg == name]
    return value.value if isinstance(value, ast.Constant) else None


def test_the_step_path_has_at_most_six_files_and_each_exists() -> None:
    assert len(STEP_PATH) <= MAX_FILES
    assert all((PACKAGE / path).is_file() for path in STEP_PATH)


def test_the_driver_calls_the_trainer_groups_step() -> None:
    start = top_level("orchestration/driver.py")["train_one_step"]
    assert isinstance(start, FunctionDef)
    called = {dotted(call.func) for call in calls_reached("orchestration/driver.py", start)}
    assert "run.trainers.train_step" in called
    trainers = method("orchestration/resources.py", "RunResources", "trainers")
    assert trainers.returns is not None and dotted(trainers.returns) == "TrainerGroup"


def test_the_trainer_group_runs_the_workers_step_on_every_rank() -> None:
    step = method("orchestration/trainer_group.py", "TrainerGroup", "train_step")
    dispatched = [
        dotted(call.args[0])
        for call in ast.walk(step)
        if isinstance(call, ast.Call) and dotted(call.func) == "self._ranks.call_per_rank"
    ]
    assert dispatched == ["TrainerWorker.train_step"]


def test_the_worker_group_calls_the_method_on_the_ranks_directly() -> None:
    dispatch = method("orchestration/worker_group.py", "RankWorkerGroup", "call_per_rank")
    called = {dotted(call.func) for call in calls_reached("orchestration/worker_group.py", dispatch, "RankWorkerGroup")}
    assert "host.call" in called  # ActorHandle.call: the Ray call of _RankHost.call on each rank


def test_the_trainer_worker_calls_the_step_module_not_the_actor() -> None:
    step = method("orchestration/trainer_worker.py", "TrainerWorker", "train_step")
    assert imported_from(step, "megatron_rl.actor.train_step") == {"train_step"}
    calls = [call for call in ast.walk(step) if isinstance(call, ast.Call)]
    steps = [call for call in calls if dotted(call.func) == "train_step"]
    assert len(steps) == 1 and dotted(steps[0].args[0]) == "self.actor"
    assert not [call for call in calls if dotted(call.func).startswith("self.actor.")], "a hop through PolicyActor"


def test_the_step_module_calls_megatrons_schedule_and_the_loss() -> None:
    path = "actor/train_step.py"
    start = top_level(path)["train_step"]
    assert isinstance(start, FunctionDef)
    reached = list(calls_reached(path, start))
    (schedule,) = [call for call in reached if call in schedule_calls(module(path))]
    assert keyword(schedule, "forward_only") is False
    called = {dotted(call.func) for call in reached}
    loss = imported_from(module(path), "megatron_rl.actor.loss")
    assert {"actor_loss", "megatron_loss"} <= called & loss


def test_no_other_module_runs_a_training_schedule() -> None:
    """Forward-backward runs only in the step's module; other schedule calls are forward-only."""
    training = []
    for file in sorted(PACKAGE.rglob("*.py")):
        path = str(file.relative_to(PACKAGE))
        for call in schedule_calls(module(path)):
            if keyword(call, "forward_only") is not True:
                training.append(path)
    assert training == ["actor/train_step.py"]


def test_the_architecture_doc_lists_the_step_path() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("\n## The training step")
    section = text[start : text.index("\n## ", start + 1)]
    listed = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)
    assert tuple(listed) == STEP_PATH
