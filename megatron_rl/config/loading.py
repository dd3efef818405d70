"""Recipe loading: YAML with `base:` inheritance, dotted overrides, validation.

A recipe file may name one or more base recipes (``base: other.yaml``, relative
to the file); mappings merge recursively, the file's own values win, lists are
replaced whole. Command-line overrides ``section.field=value`` are parsed as YAML
scalars (``train.lr=1e-6`` is a float, ``data.train_files=[a.parquet]`` a list).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from megatron_rl.config.checks import Finding, check_recipe
from megatron_rl.config.model_source import ModelSourceError, read_architecture
from megatron_rl.config.schema import RunConfig


class RecipeError(ValueError):
    """A recipe that cannot run; ``problems`` lists each as ``dotted.field: message``."""

    def __init__(self, problems: Sequence[str], source: str) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{lines}")


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` as a float (YAML 1.1 needs a dot)."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?\d+\.?\d*[eE][-+]?\d+$"), list("-+0123456789")
)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text with the recipe loader; errors name ``source``."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError([f"invalid YAML: {exc}"], source) from exc


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def read_recipe_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe file into a plain dict, resolving its ``base`` chain."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise RecipeError([f"base: recipes include each other in a cycle: {chain}"], str(path))
    if not path.is_file():
        raise RecipeError(["no such recipe file"], str(path))
    tree = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(tree, dict):
        raise RecipeError([f"a recipe is a mapping of sections, got {type(tree).__name__}"], str(path))
    bases = tree.pop("base", [])
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged = _deep_merge(merged, read_recipe_tree(path.parent / base, (*_seen, path)))
    return _deep_merge(merged, tree)


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return ``tree`` with each ``dotted.path=value`` override set (missing sections are created)."""
    result = _deep_merge({}, tree)
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError([f"override {override!r} is not of the form section.field=value"], "command line")
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise RecipeError([f"{key}: {prefix} is a value, not a section"], "command line")
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = parse_yaml(raw, f"override {override!r}") if raw else ""
    return result


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


MOVED_FIELDS: Mapping[str, str] = {
    "train.val_interval": "validation.interval",
    "train.val_samples_per_prompt": "validation.sets.<name>.n",
    "train.val_temperature": "validation.sets.<name>.temperature",
}
"""Fields of earlier recipes -> where they live now (every shipped recipe has moved)."""


def _format_validation_error(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        field = ".".join(str(part) for part in loc) or "recipe"
        if error["type"] == "extra_forbidden" and field in MOVED_FIELDS:
            problems.append(
                f'{field}: moved to {MOVED_FIELDS[field]} (named validation sets, README "Validation and '
                'evaluation"); e.g. validation: {interval: 10, sets: {greedy: {n: 1, temperature: 0.0}}}'
            )
        elif error["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{field}: unknown key{hint} (allowed: {', '.join(allowed)})")
        elif error["type"] == "missing":
            problems.append(f"{field}: required, not set")
        else:
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{field}: {message} (got {error['input']!r})")
    return problems


def validate_recipe_tree(
    tree: Mapping[str, Any], source: str, *, require_files: bool = True
) -> tuple[RunConfig, list[Finding]]:
    """Validate a recipe dict into a :class:`RunConfig` and run the cross-field checks.

    Returns the config and the warnings; raises :class:`RecipeError` listing every
    error (schema errors first; cross-field checks run only on a valid schema).
    ``require_files``: files the recipe reads that are absent here (weights, data) are
    errors (training, ``validate --strict``); otherwise they are returned as warnings
    ("needed before training") and the model's architecture may come from
    ``model.config_fallback`` (``validate``, ``plan``).
    """
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise RecipeError(_format_validation_error(exc), source) from None
    try:
        arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
    except ModelSourceError as exc:
        raise RecipeError([str(exc)], source) from None
    findings = check_recipe(cfg, arch)
    stopping = {"error", "needed"} if require_files else {"error"}
    errors = [str(f) for f in findings if f.level in stopping]
    if errors:
        raise RecipeError(errors, source)
    return cfg, [f for f in findings if f.level not in stopping]


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), *, require_files: bool = True
) -> tuple[RunConfig, list[Finding]]:
    """Load, override and validate a recipe file; see :func:`validate_recipe_tree`."""
    tree = apply_overrides(read_recipe_tree(path), overrides)
    return validate_recipe_tree(tree, str(path), require_files=require_files)


def recipe_to_yaml(cfg: RunConfig) -> str:
    """The fully resolved recipe as YAML (defaults filled in), loadable again by :func:`load_recipe`."""
    text: str = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    return text
