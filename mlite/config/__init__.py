"""Load and validate job configs: YAML file (or packaged preset) + `key.sub=value` overrides -> JobConfig.

Light by design: importing this module must not import torch (the planner and `mlite --help` stay instant).
"""

from __future__ import annotations

import re
import reprlib
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


# A job file has a few hundred values. Aliases (*name) share one node, so a few hundred bytes can expand to
# billions of values ("billion laughs") that validation and error messages would then walk. Counting aliases
# is not enough (nine aliases of nine levels make 9^9), so the expanded size is what is capped.
MAX_YAML_VALUES = 10_000


class YamlTooLarge(yaml.YAMLError):
    """A document whose aliases expand it past MAX_YAML_VALUES, or make it contain itself."""


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1's float rule wants a dot (1.0e-4); users write 1e-4 and get a string. Numbers in exponent
    form without a dot are floats here, as in YAML 1.2 and Python. Documents are capped in expanded size."""

    def compose_document(self):
        node = super().compose_document()
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise YamlTooLarge(f"its aliases (*name) expand it to over {MAX_YAML_VALUES} values (an alias "
                               "bomb?); write the values out instead of aliasing aliases")
        return node


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values in `node` with every alias written out; linear in the composed nodes (aliases are memoised)."""
    key = id(node)
    if key in sizes:
        if sizes[key] < 0:
            raise YamlTooLarge("an alias (*name) refers to a collection that contains it; remove the alias")
        return sizes[key]
    sizes[key] = -1  # in progress: meeting it again below is a cycle
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
    sizes[key] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[key]


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise MliteError(f"{path}: cannot read it ({err.strerror}); check its permissions") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise MliteError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x}); "
                         "save the file as UTF-8") from None


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
            data = _load_yaml(_read_text(path)) or {}
        except YamlTooLarge as err:
            raise MliteError(f"{path}: {err}") from None
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


# An override value starting like a YAML list, mapping or quoted string is meant as one; when it does not
# parse, taking it as a plain string would only fail later, further from the typo.
_YAML_OPENERS = ("[", "{", '"', "'")


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    """`parallel.tp=4` -> ("parallel.tp", 4). Values are parsed as YAML scalars/lists; a value that is not
    valid YAML is a plain string (`model.path=/a/b: c`), unless it starts like a list, mapping or quote."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise MliteError(f"override '{item}' is not key.sub=value (e.g. parallel.tp=4)")
        try:
            value = _load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            if raw.lstrip().startswith(_YAML_OPENERS):
                problem = getattr(err, "problem", None) or err
                raise MliteError(f"override '{item}': the value is not valid YAML ({problem}); close its "
                                 "brackets or quotes (a string starting with one: quote it whole)") from None
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
    got_txt = "" if isinstance(got, dict) else f" (got {_excerpt(got)})"
    return f"config: {where}: {msg}{got_txt}"


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxtuple, _SHORT_REPR.maxstring = 2, 6, 6, 80


def _excerpt(value: Any, limit: int = 200) -> str:
    """A short repr: reprlib stops early in a huge value instead of rendering it all, then cut to `limit`."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
