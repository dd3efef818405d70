"""The dependency direction of docs/architecture.md, checked by parsing every module's imports.

Imports are read with ``ast`` (function-level and ``TYPE_CHECKING`` imports included), so a rule
holds for every line of the package, not only for what one test run happens to import. The
"never" rules are checked transitively: a package is free of Megatron only if nothing it imports
from megatron_rl imports Megatron either.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"

ALLOWED: dict[str, set[str]] = {
    "algorithms": {"algorithms"},
    "config": {"config"},
    "plan": {"plan", "config"},
    "data": {"data", "config", "named_functions"},
    "metrics": {"metrics", "config"},
    "parallel": {"parallel"},
    "models": {"models", "parallel", "config"},
    "engines": {"engines", "wire", "config", "parallel.device"},
    "wire": {"wire", "parallel.stores"},
    "rollout": {"rollout", "engines", "algorithms", "data", "config", "named_functions", "tools"},
    "weight_sync": {"weight_sync", "engines", "wire", "models", "parallel", "config"},
    "actor": {"actor", "models", "parallel", "algorithms", "data", "config"},
    "checkpoint": {"checkpoint", "models", "parallel", "config", "wire.fp8_blocks"},
    "tools": {"tools", "named_functions"},
    "named_functions": set(),
    "preflight": {
        "preflight",
        "actor",
        "algorithms",
        "checkpoint",
        "config",
        "data",
        "engines",
        "metrics",
        "models",
        "named_functions",
        "orchestration",
        "parallel",
        "plan",
        "rollout",
        "tools",
        "weight_sync",
        "wire",
    },
}
"""Per package, the megatron_rl packages (or single modules) its modules may import directly."""

NEVER: dict[str, set[str]] = {
    "algorithms": {"megatron", "ray", "transformers"},
    "config": {"megatron", "ray", "torch"},
    "plan": {"megatron", "ray", "torch"},
    "engines": {"megatron", "ray"},
    "wire": {"megatron", "ray", "transformers"},
    "rollout": {"megatron", "ray"},
    "data": {"megatron", "ray"},
    "metrics": {"megatron", "ray"},
    "tools": {"megatron", "ray", "torch", "transformers"},
    "named_functions": {"megatron", "ray", "torch", "transformers"},
}
"""Per package, third-party roots that neither it nor anything it imports from megatron_rl may import."""

COMPAT_MODULES = {"megatron_rl.parallel.cpu_compat", "megatron_rl.parallel.megatron_compat"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def _imports(module: str) -> tuple[str, ...]:
    """Every absolute module name ``module`` imports (relative imports resolved)."""
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    return tuple(names)


def _internal(name: str) -> list[str]:
    """The megatron_rl modules an import of ``name`` executes: the module and its parent packages."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


def _package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_it_may(package: str) -> None:
    allowed = ALLOWED[package]
    wrong = []
    for module in (m for m in MODULES if _package_of(m) == package):
        for name in _imports(module):
            if not name.startswith("megatron_rl."):
                continue
            target = name.removeprefix("megatron_rl.")
            if not any(target == rule or target.startswith(f"{rule}.") for rule in allowed):
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(NEVER))
def test_forbidden_libraries_stay_out_even_transitively(package: str) -> None:
    seen, stack, wrong = set(), [m for m in MODULES if _package_of(m) == package], []
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imports(module):
            if name.split(".")[0] in NEVER[package]:
                wrong.append(f"{module} imports {name}")
            stack += _internal(name)
    assert not wrong, f"{package} reaches:\n" + "\n".join(sorted(set(wrong)))


def test_ray_is_imported_only_by_orchestration() -> None:
    wrong = [
        f"{module} imports {name}"
        for module in MODULES
        for name in _imports(module)
        if name.split(".")[0] == "ray" and _package_of(module) != "orchestration"
    ]
    assert not wrong, "\n".join(wrong)


def _megatron_bindings(tree: ast.Module) -> set[str]:
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.startswith("megatron.")
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            bound |= {alias.asname or alias.name for alias in node.names}
    return bound


def _assigned_attribute_roots(tree: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            while isinstance(target, ast.Attribute):
                target = target.value
                if isinstance(target, ast.Name):
                    roots.add(target.id)
    return roots


def test_megatron_is_patched_only_in_the_compat_modules() -> None:
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        patched = _megatron_bindings(tree) & _assigned_attribute_roots(tree)
        if patched and module not in COMPAT_MODULES:
            wrong.append(f"{module} assigns attributes of {sorted(patched)}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_cover_every_package_and_see_the_one_patch() -> None:
    packages = {_package_of(m) for m in MODULES} - {""}  # "" is megatron_rl itself
    assert packages - set(ALLOWED) == {"orchestration", "cli"}  # the two that may import every package
    compat = ast.parse(MODULES["megatron_rl.parallel.megatron_compat"].read_text())
    assert _megatron_bindings(compat) & _assigned_attribute_roots(compat) == {"DistributedOptimizer"}


def test_the_driver_starts_without_megatron_core() -> None:
    """The driver (CLI, run loop, the classes it starts ranks from) loads no megatron-core: only ranks need it, and
    it costs every run's start 3 s. Checked by importing in a fresh interpreter, since a rank-side import inside a
    method is allowed."""
    probe = (
        "import sys, megatron_rl.cli, megatron_rl.orchestration.driver, megatron_rl.orchestration.resources;"
        "print(sorted(m for m in sys.modules if m == 'megatron.core' or m.startswith('megatron.core.')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
