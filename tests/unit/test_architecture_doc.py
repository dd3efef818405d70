"""Every name docs/architecture.md cites exists in the code, and the facts it states that a cheap test can check hold.

Each backticked span of the doc (fenced blocks left out, whitespace runs read as one space) is
classified and resolved with ``ast``, importing no module it names (the recipe schema is
imported: it loads no Megatron):

- path: a span like ``engines/sglang_cpu.py``, ``tests/e2e/``, ``recipes/x.yaml`` or ``.ci/run``
  whose first part is a top-level entry of the repo or a megatron_rl package; it exists under the
  repo root or megatron_rl/. ``path::test_name`` also names a test of that file, and
  ``package/module.symbol`` (``config/checks._check_sglang_on_cpu``) a symbol of that module.
  A bare ``name.py`` (or ``.sh``, ``.sbatch``, ``.c``) is some file of the repo's code folders.
- recipe field: a dotted name whose first part is a recipe section (``rollout.max_total_tokens``,
  also as ``field: value``, ``field=value`` or ``field > 1``) is a field of the schema; if it is
  none (``engines.protocol``, ``parallel.device``), it must resolve as a symbol.
- symbol: a dotted name whose first part is a megatron_rl module or package name
  (``weight_sync.syncer.WeightSyncer``, ``engine.RolloutEngine``) or a class
  (``HttpEngine.abort``): a module whose dotted path ends with the leading parts defines the rest
  at top level (def, class, assignment, import); ``Class.member`` is a def or an assignment in
  the class or one of its bases. A call (``StepData.shard(dp, mini_batches)``) cites its callee.
- class: a bare CamelCase name is defined at top level in megatron_rl or tests/, or is a Python
  builtin or one of EXTERNAL (other projects' names the doc cites).
- word: a bare name with an underscore (``count_tokens_and_seqs``, ``train_partial``,
  ``PATCHED_ATTRIBUTES``, ``CUDA_VISIBLE_DEVICES``, or called: ``parallel_sizes(cfg.parallel)``)
  occurs as a word in the project's code, recipes or scripts, or is one of EXTERNAL.
- test: ``test_...`` is a test function of tests/; a trailing ``...`` makes it a prefix.

Everything else (values, command lines, flags, endpoints, snippets, metric names such as
``rollout/groups_kept``, other projects' paths and dotted names such as ``torch.where``) is left
alone: ``python tests/unit/test_architecture_doc.py`` prints every span with its class, and the
test prints what it left alone.

Facts held to the code (the last section): the layout table is ``test_import_rules.ALLOWED`` and ``NEVER``
row by row, the command-line table has a row per command of ``cli.build_parser``, the refusal scan's
packages are ``test_start_refusals.SCANNED``, and the rollout's concurrency is as the doc states (one thread
pool over all engines; the per-engine bound in ``HttpEngine``).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import re
import threading
import time
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel
from pytest import MonkeyPatch

from megatron_rl.cli import build_parser
from megatron_rl.config.schema import RunConfig
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.engine_pool import EnginePool
from tests.unit.test_import_rules import ALLOWED, COMPAT_MODULES, NEVER
from tests.unit.test_start_refusals import SCANNED

THIS = Path(__file__).resolve()
REPO = THIS.parents[2]
PACKAGE = REPO / "megatron_rl"
DOC = REPO / "docs" / "architecture.md"
CODE_DIRS = ("megatron_rl", "tests", "scripts", "benchmarks", "recipes", "launch", "slurm", ".ci")

EXTERNAL = frozenset(
    {
        # torch, Python
        "TorchFunctionMode", "Fraction", "SimpleNamespace", "rebuild_cuda_tensor",
        # Megatron-core
        "TransformerConfig", "GPTModel", "DotProductAttention", "PackedSeqParams", "RouterReplay",
        "OptimizerParamScheduler", "CheckpointFunction", "allow_shape_mismatch",
        # transformers, torch.distributed
        "AutoTokenizer", "PrefixStore",
        # SGLang
        "ServerArgs", "GenerateReqInput", "GenerateResponse", "MultiprocessingSerializer", "ConfigArgumentMerger",
        "FlattenedTensorBucket", "decide_request_auth", "monkey_patch_torch_reductions", "regenerate_rid",
        "empty_cache", "flash_mla", "sgl_kernel", "http_server", "io_struct",
    }
)  # fmt: skip
"""Other projects' names that the doc cites bare; each is theirs, so nothing here can check it."""

SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PATH = re.compile(r"^(?P<path>[\w.-]*(?:/[\w.-]*)+|[\w-]+\.(?:py|sh|sbatch|c))(?:::(?P<test>.+))?$")
FILE_EXT = re.compile(r"\.(py|md|yaml|yml|sh|sbatch|json|txt|lock|c|toml)$")
DOTTED = re.compile(r"^(?P<name>_?[A-Za-z]\w*(?:\.\w+)+)(?:$|\(.*\)|(?=[\s:=<>*+]))", re.S)
CAMEL = re.compile(r"^(?P<name>_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:$|\(.*\)$)", re.S)
WORD = re.compile(r"^(?P<name>_?[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+)(?:$|\(.*\)(?: -> .*)?$)")
TEST = re.compile(r"^(?P<name>test_\w*?)(?P<prefix>_?\.\.\.)?$")
METRIC_PREFIXES = {"train", "val", "rollout", "actor", "data", "time", "async", "perf"}
DATA_EXT = re.compile(r"\.(json|jsonl|pt|safetensors|log|yaml|md|txt|lock|partial)$")


def spans(text: str) -> list[str]:
    """The doc's backticked spans in order, fenced code blocks left out, whitespace runs as one space."""
    return [" ".join(span.split()) for span in SPAN.findall(FENCE.sub("", text))]


# --- what the code defines -------------------------------------------------------------------


@cache
def modules() -> dict[tuple[str, ...], Path]:
    """megatron_rl's modules by dotted parts below the package (``("rollout", "engine")``; packages too)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[parts[:-1] if parts[-1] == "__init__" else parts] = path
    return found


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _bound(statements: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt]]:
    """Names a block binds (defs, classes, assignments, imports), looking into if/try/with bodies."""
    for node in statements:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                yield (alias.asname or alias.name).split(".")[0], node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(node, block, []):
                    yield from _bound(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])


def top_level(path: Path) -> dict[str, ast.stmt]:
    return dict(_bound(tree(path).body))


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of megatron_rl by name (top level or nested)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for path in modules().values():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
    return found


def has_member(cls: ast.ClassDef, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """``member`` is bound in ``cls``'s body, assigned to ``self.member`` in it, or so in a base class."""
    attributes = {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and getattr(node.value, "id", "") == "self"
    }
    if member in dict(_bound(cls.body)) or member in attributes:
        return True
    bases = {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in cls.bases}
    return any(has_member(base, member, seen | {cls.name}) for name in bases - seen for base in classes().get(name, []))


@cache
def defined_names() -> frozenset[str]:
    """Top-level names of every module of megatron_rl and tests/."""
    paths = [*modules().values(), *(REPO / "tests").rglob("*.py")]
    return frozenset(name for path in paths for name in top_level(path))


@cache
def code_words() -> frozenset[str]:
    """Every identifier-like word in the project's code, recipes and scripts (this file left out)."""
    words: set[str] = set()
    for folder in CODE_DIRS:
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".yaml", ".sh", ".sbatch", ".c", ""} and path != THIS:
                words |= set(re.findall(r"\w+", path.read_text(errors="replace")))
    return frozenset(words)


@cache
def defined_tests() -> dict[Path, frozenset[str]]:
    return {
        path: frozenset(
            node.name
            for node in ast.walk(tree(path))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
        )
        for path in (REPO / "tests").rglob("*.py")
    }


def has_test(name: str, prefix: bool, files: list[Path] | None = None) -> bool:
    """A test function of tests/ (of ``files`` if given) named ``name``, or starting with it if ``prefix``."""
    names = {n for path, found in defined_tests().items() if files is None or path in files for n in found}
    return any(n.startswith(name) if prefix else n == name for n in names)


# --- resolving each class ----------------------------------------------------------------------

ROOTS = {*CODE_DIRS, "docs"} | {p.name for p in PACKAGE.iterdir()} - {"__pycache__"}
"""First parts of the paths the test checks: the repo's tracked folders and megatron_rl's packages."""


def resolve_symbol(parts: list[str]) -> bool:
    """``parts`` = module parts (a suffix of a module's dotted path) + a symbol, ``Class.member``, or nothing."""
    for split in range(len(parts), 0, -1):
        head, rest = tuple(parts[:split]), parts[split:]
        for module, path in modules().items():
            if module[-len(head) :] == head and _defines(path, rest):
                return True
    return _class_member(parts)


def _defines(path: Path, rest: list[str]) -> bool:
    if not rest:
        return True
    node = top_level(path).get(rest[0])
    if node is None or len(rest) > 2:
        return False
    return len(rest) == 1 or (isinstance(node, ast.ClassDef) and has_member(node, rest[1]))


def _class_member(parts: list[str]) -> bool:
    """``Class.member`` with no module: some megatron_rl class of that name has that member."""
    return len(parts) == 2 and any(has_member(cls, parts[1]) for cls in classes().get(parts[0], []))


def _model_of(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in typing.get_args(annotation) if (m := _model_of(arg))), None)


def resolve_field(parts: list[str]) -> bool:
    """``parts`` walk the recipe schema from RunConfig; below a dict field anything goes."""
    model: type[BaseModel] | None = RunConfig
    for i, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        model = _model_of(annotation)
        if model is None and i < len(parts) - 1:
            return "dict" in str(annotation)
    return True


def resolve_path(path: str, test: str | None) -> bool:
    candidates = [REPO / path, PACKAGE / path] if "/" in path else _files_named(path)
    if "/" in path and not FILE_EXT.search(path) and "." in path.rsplit("/", 1)[1]:
        module, symbol = path.rsplit(".", 1)  # package/module.symbol
        files = [base / f"{module}.py" for base in (REPO, PACKAGE) if (base / f"{module}.py").is_file()]
        return any(symbol in top_level(file) for file in files)
    found = [c for c in candidates if (c.is_dir() if path.endswith("/") else c.exists())]
    if not found or test is None or test.startswith("..."):
        return bool(found)
    match = TEST.match(test.split("[")[0])
    return match is not None and has_test(match["name"], bool(match["prefix"]), found)


def _files_named(name: str) -> list[Path]:
    return [p for folder in CODE_DIRS for p in (REPO / folder).rglob(name)]


def classify(span: str) -> tuple[str, bool | None]:
    """(class, resolved); resolved is None for a span left alone."""
    if (m := PATH.match(span)) and not span.startswith("../"):
        path = m["path"]
        first = path.split("/")[0]
        if "/" not in path:
            return "path", resolve_path(path, m["test"])
        if first in ROOTS and "*" not in path and "..." not in path:
            resolved = resolve_path(path, m["test"])
            is_metric = first in METRIC_PREFIXES and path.count("/") == 1 and "." not in path and not resolved
            return ("other", None) if is_metric else ("path", resolved)
        return "other", None
    if m := TEST.match(span):
        return "test", has_test(m["name"], bool(m["prefix"]))
    if (m := DOTTED.match(span)) and not DATA_EXT.search(m["name"]):
        parts = m["name"].split(".")
        module_parts = {part for module in modules() for part in module}
        if parts[0] in RunConfig.model_fields and resolve_field(parts):
            return "field", True
        if CAMEL.match(parts[0]) and parts[0] not in classes() and parts[0] in EXTERNAL:
            return "other", None
        if parts[0] in RunConfig.model_fields or parts[0] in module_parts or CAMEL.match(parts[0]):
            resolved = resolve_symbol(parts)
            return ("field" if parts[0] in RunConfig.model_fields and not resolved else "symbol"), resolved
        return "other", None
    if m := CAMEL.match(span):
        name = m["name"]
        return "class", name in defined_names() or hasattr(builtins, name) or name in EXTERNAL
    if m := WORD.match(span):
        return "word", m["name"] in code_words() or m["name"] in EXTERNAL
    return "other", None


@pytest.mark.parametrize(
    ("span", "kind", "resolved"),
    [
        ("engines/sglang_cpu.py", "path", True),
        ("rollout/run_placement.py", "path", False),
        ("engines/sglang_cpu.cpu_engine_environment", "path", True),
        ("config/checks._no_such_check", "path", False),
        ("tests/e2e/test_exact_resume.py::test_no_such_test", "path", False),
        ("weight_sync.syncer.WeightSyncer", "symbol", True),
        ("models.export_hf_weights(designated_only=True)", "symbol", False),
        ("HttpEngine.abort", "symbol", True),
        ("TrainerGroup.compute_old_log_probs", "symbol", False),
        ("Tensor.cuda()", "symbol", False),
        ("rollout.max_total_tokens", "field", True),
        ("algorithm.dynamic_sampling.metric: acc", "field", True),
        ("rollout.no_such_field > 1", "field", False),
        ("parallel.device", "symbol", True),
        ("NoSuchClass", "class", False),
        ("compute_old_log_probs", "word", False),
        ("train_step(shard) -> metrics", "word", True),
        ("NO_SUCH_VARIABLE", "word", False),
        ("test_pause_with_abort_...", "test", True),
        ("test_no_such_test", "test", False),
        ("rollout/groups_kept", "other", None),
        ("torch.where", "other", None),
    ],
)
def test_the_classifier_catches_names_that_drifted(span: str, kind: str, resolved: bool | None) -> None:
    assert classify(span) == (kind, resolved)


def test_every_name_the_architecture_doc_cites_exists() -> None:
    classified = [(span, *classify(span)) for span in dict.fromkeys(spans(DOC.read_text()))]
    counts = {
        kind: sum(k == kind for _, k, _ in classified) for kind in ("path", "field", "symbol", "class", "word", "test")
    }
    left_alone = [span for span, kind, _ in classified if kind == "other"]
    print(f"checked {counts}; left alone {len(left_alone)}: " + " | ".join(left_alone))
    assert all(counts.values()), f"a class of names found none: the classifier no longer reads the doc ({counts})"
    missing = [f"{kind}: `{span}`" for span, kind, resolved in classified if resolved is False]
    assert not missing, "docs/architecture.md cites names the code lacks:\n" + "\n".join(missing)


# --- claims the doc states as facts, held to the code -----------------------------------------


def section(heading: str) -> str:
    """The doc's text from the level-2 heading starting with ``heading`` to the next one."""
    text = DOC.read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in ``text`` whose first cell is backticked (headers and rules left out)."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def layout_table() -> dict[str, tuple[set[str] | None, set[str]]]:
    """Per row of the layout table (``config`` for `config/`, ``cli`` for `cli.py`): the megatron_rl names of its
    "may import" cell (None for "everything") and the lower-cased libraries of its "never" cell."""
    table = {}
    for name, _, may, never in table_rows(section("Layout")):
        key = name.strip("`").removesuffix("/").removesuffix(".py")
        names = None if may == "everything" else set(re.findall(r"`([\w.]+)`", may))
        table[key] = (names, {word.strip().lower() for word in never.split(",") if word.strip()})
    return table


def _reachable(package: str) -> set[str]:
    """The packages ``package`` may reach through ALLOWED (a rule ``wire.fp8_blocks`` counts as its package)."""
    seen, stack = set(), [package]
    while stack:
        if (current := stack.pop()) not in seen:
            seen.add(current)
            stack += [rule.split(".")[0] for rule in ALLOWED.get(current, ())]
    return seen


def test_the_layout_table_states_the_import_rules() -> None:
    """One row per package: the imports of ALLOWED exactly; "everything" for the packages ALLOWED leaves free;
    "never" names NEVER's libraries, plus Ray where the package cannot reach orchestration (the one Ray importer)."""
    table = layout_table()
    packages = {p.stem for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py"} - {"__init__"}
    wrong = [f"`{name}`: a row for no package of megatron_rl" for name in sorted(set(table) - packages)]
    wrong += [f"`{name}`: no row in the table" for name in sorted(packages - set(table))]
    for name in sorted(packages & set(table)):
        may, never = table[name]
        if name not in ALLOWED:
            if may is not None:
                wrong.append(
                    f"`{name}`: not in ALLOWED (it may import every package), but the table says {sorted(may)}"
                )
        elif may is None:
            wrong.append(f"`{name}`: the table says everything, ALLOWED says {sorted(ALLOWED[name])}")
        else:
            if ALLOWED[name] - may:
                wrong.append(f"`{name}`: the table omits allowed imports {sorted(ALLOWED[name] - may)}")
            if may - ALLOWED[name]:
                wrong.append(f"`{name}`: the table allows imports ALLOWED lacks {sorted(may - ALLOWED[name])}")
        reaches_ray = name not in ALLOWED or "orchestration" in _reachable(name)
        expected = NEVER.get(name, set()) | (set() if reaches_ray else {"ray"})
        if never != expected:
            wrong.append(f"`{name}`: its never cell says {sorted(never)}, the rules give {sorted(expected)}")
    patched = re.search(r"Megatron patched only in (.*?);", " ".join(section("Layout").split()))
    cited = {path.removesuffix(".py").replace("/", ".") for path in SPAN.findall(patched[1])} if patched else set()
    if cited != {module.removeprefix("megatron_rl.") for module in COMPAT_MODULES}:
        wrong.append(
            f"the modules that may patch Megatron: the doc says {sorted(cited)}, COMPAT_MODULES {COMPAT_MODULES}"
        )
    differences = "\n".join(wrong)
    assert not wrong, f"docs/architecture.md's layout table and tests/unit/test_import_rules.py differ:\n{differences}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return {name: sub for action in actions for name, sub in action.choices.items()}


def _cli_commands() -> set[str]:
    """Every ``megatron-rl`` command the parser takes: ``train``, ``convert hf-to-mcore``, ..."""
    commands = _subcommands(build_parser())
    return {f"{name} {sub}" for name, parser in commands.items() for sub in _subcommands(parser)} | {
        name for name, parser in commands.items() if not _subcommands(parser)
    }


def test_the_command_line_table_has_a_row_per_command() -> None:
    """The command-line table: one row per command of ``cli.build_parser`` (``convert`` per direction); the layout
    table's `cli.py` row lists every command."""
    commands = _cli_commands()
    cells = [row[0].strip("`").split() for row in table_rows(section("The command line"))]
    rows = {" ".join(words[1:3] if words[1] == "convert" else words[1:2]) for words in cells}
    assert rows == commands, f"commands without a row: {commands - rows}; rows for no command: {rows - commands}"
    cli_row = " ".join(row[1] for row in table_rows(section("Layout")) if row[0] == "`cli.py`")
    listed = re.search(r"`megatron-rl ([^`]+)`", cli_row)
    assert listed, "the layout table's `cli.py` row no longer lists the commands as `megatron-rl a / b / ...`"
    top_level = {command.split()[0] for command in commands}
    assert set(listed[1].split(" / ")) == top_level, f"the cli.py row lists {listed[1]!r}; the commands: {top_level}"


def test_the_refusal_scan_is_stated_with_the_packages_it_scans() -> None:
    """Configuration: the packages whose every ``raise`` test_start_refusals.py classifies are its SCANNED."""
    claim = re.search(
        r"finds every `raise` in the packages its `SCANNED` lists \(([^)]*)\)", " ".join(DOC.read_text().split())
    )
    assert claim, "the sentence on tests/unit/test_start_refusals.py's SCANNED changed: update this test"
    stated = SPAN.findall(claim[1])
    assert stated == list(SCANNED), f"the doc lists {stated}, test_start_refusals.SCANNED is {list(SCANNED)}"


class _Gate:
    """Counts the calls inside :meth:`enter` and holds them there until :meth:`release`."""

    def __init__(self) -> None:
        self.inside, self._lock, self._open = 0, threading.Lock(), threading.Event()

    def enter(self, *args: object, **kwargs: object) -> list[object]:
        with self._lock:
            self.inside += 1
        self._open.wait(30)
        return []

    def settled(self, expected: int) -> int:
        """How many calls are inside once ``expected`` are (or 10 s passed), and 0.3 s more for any extra."""
        deadline = time.monotonic() + 10
        while self.inside < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        return self.inside

    def release(self) -> None:
        self._open.set()


REQUEST = GenerateRequest(input_ids=[1], sampling_params=SamplingParams(), rid="r")


def test_the_engine_pool_sends_on_one_thread_pool_shared_by_its_engines() -> None:
    """Rollout engines: `rollout.max_concurrent_requests` x engines threads over all engines, not a pool per engine,
    so 3 engines at 2 each put 6 requests in flight on one engine."""
    gate = _Gate()
    engines = [SimpleNamespace(generate=gate.enter) for _ in range(3)]
    pool = EnginePool(engines, max_concurrent_requests=2)  # type: ignore[arg-type]
    try:
        futures = [pool.generate(engines[0], REQUEST) for _ in range(7)]  # type: ignore[arg-type]
        in_flight = gate.settled(6)
        gate.release()
        assert [future.result(timeout=30) for future in futures] == [[]] * 7
    finally:
        gate.release()
        pool.close()
    assert in_flight == 6


def test_an_http_engine_has_at_most_max_concurrent_requests_generates_in_flight(monkeypatch: MonkeyPatch) -> None:
    """Rollout engines: the per-engine bound is `HttpEngine`'s semaphore; a third request waits for a slot."""
    gate = _Gate()
    engine = HttpEngine("e", "127.0.0.1", 9, max_concurrent_requests=2)
    monkeypatch.setattr(engine, "request", gate.enter)
    with ThreadPoolExecutor(3) as threads:
        futures = [threads.submit(engine.generate, REQUEST) for _ in range(3)]
        try:
            in_flight = gate.settled(2)
        finally:
            gate.release()
    assert in_flight == 2
    assert [future.result() for future in futures] == [[]] * 3


if __name__ == "__main__":
    for span in dict.fromkeys(spans(DOC.read_text())):
        kind, resolved = classify(span)
        print(f"{kind:7} {'' if resolved is None else 'ok  ' if resolved else 'MISSING '}{span}")
