"""Load and validate job configs: YAML file (or packaged preset) + `key.sub=value` overrides -> JobConfig.

Light by design: importing this module must not import torch (the planner and `mlite --help` stay instant).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from mlite.config.schema import JobConfig
from mlite.errors import MliteError

__all__ = ["JobConfig", "load_job", "job_from_dict", "apply_overrides", "parse_overrides", "list_presets",
           "preset_path"]


def list_presets() -> list[str]:
    """Names of the job presets shipped in the package (`mlite/config/presets/*.yaml`)."""
    folder = resources.files("mlite.config") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path:
    path = Path(str(resources.files("mlite.config") / "presets" / f"{name}.yaml"))
    if not path.is_file():
        raise MliteError(f"unknown job preset '{name}'; available: {', '.join(list_presets())}")
    return path


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1's float rule wants a dot (1.0e-4); users write 1e-4 and get a string. Numbers in exponent
    form without a dot are floats here, as in YAML 1.2 and Python."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader with one more float form)


def load_job(source: str | Path | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Read a job file (a path, or the name of a packaged preset), apply overrides, validate."""
    data: dict[str, Any] = {}
    if source is not None:
        path = Path(source)
        if not path.exists() and not str(source).endswith((".yaml", ".yml")):
            path = preset_path(str(source))
        if not path.is_file():
            raise MliteError(f"config file not found: {source}; pass an existing YAML file or a preset name "
                             f"({', '.join(list_presets())})")
        try:
            data = _load_yaml(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise MliteError(f"{path}:{where} is not valid YAML ({getattr(err, 'problem', err)})") from None
        if not isinstance(data, dict):
            raise MliteError(f"{path}: the top level must be a mapping of sections (model:, parallel:, ...)")
    return job_from_dict(apply_overrides(data, overrides))


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set each `key.sub=value` override in the job dict `data` (in place); returns it."""
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    return data


def job_from_dict(data: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise MliteError(describe_validation_error(err, JobConfig)) from None


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    """`parallel.tp=4` -> ("parallel.tp", 4). Values are parsed as YAML scalars/lists."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise MliteError(f"override '{item}' is not key.sub=value (e.g. parallel.tp=4)")
        try:
            value = _load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key, value))
    return parsed


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise MliteError(f"override '{dotted}': '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _field_owner(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """Walk the schema along an error location to the section model that holds the last key."""
    owner: Any = model
    for part in loc[:-1]:
        if not (isinstance(owner, type) and issubclass(owner, BaseModel)) or part not in owner.model_fields:
            return None
        annotation = owner.model_fields[part].annotation
        candidates = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type)]
        owner = next((a for a in candidates if issubclass(a, BaseModel)), None)
    return owner if isinstance(owner, type) and issubclass(owner, BaseModel) else None


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """One line for the first error: where it is, what is wrong, what is allowed."""
    first = err.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    where = ".".join(str(p) for p in loc) or "config"
    kind = first["type"]
    if kind == "extra_forbidden":
        owner = _field_owner(model, loc)
        allowed = ", ".join(owner.model_fields) if owner else "see docs/CONFIG.md"
        return f"config: unknown key '{where}'; allowed keys here: {allowed}"
    if kind == "missing":
        return f"config: '{where}' is required"
    msg = first["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"config: {msg}" if not loc else f"config: {where}: {msg}"
    got = first.get("input")
    got_txt = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"config: {where}: {msg}{got_txt}"
