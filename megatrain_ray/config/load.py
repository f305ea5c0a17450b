"""Loading a config: YAML (or a mapping), `--set a.b=c` overrides, strict coercion into the dataclasses.

Unknown keys, wrong types and impossible values raise `ConfigError` naming the dotted key, the
value received and what to do; all of it happens before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.config.generic_shape import model_config_for_template
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.sections import Config, _to_plain
from megatrain_ray.exceptions import ConfigError, excerpt
from megatrain_ray.system.files import read_text_file
from megatrain_ray.system.model_sources import resolve_model_dir


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check `value` against the annotation `tp`, converting only where it is lossless."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, option, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[-1] if len(errors) == 1 else
                          f"config key '{key}' = {excerpt(value)}: expected " +
                          " or ".join(_type_name(o) for o in options if o is not type(None)))
    if origin is Literal:
        if value not in get_args(tp):
            _fail(key, value, f"expected {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            _fail(key, value, "expected a list, e.g. [a, b] (--set key=[a,b])")
        (item,) = get_args(tp)
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(key, value, f"expected a mapping of {tp.__name__} fields")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool):
            _fail(key, value, "expected a number")
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                _fail(key, value, "expected a number")
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(key, value, "expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(key, value, "expected a string")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"unknown config key '{(prefix + '.') if prefix else ''}{unknown[0]}' in {where}; "
                          f"known keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(key, hints[name], value)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        key = f"{prefix}.{missing[0]}" if prefix else missing[0]
        raise ConfigError(f"config key '{key}' is required")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a programming error in a section class, not user input
        raise ConfigError(f"cannot build section '{prefix or 'root'}': {exc}") from exc


# A config has a few hundred values; YAML aliases can make a few lines expand to billions ("billion laughs").
_MAX_VALUES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"key {excerpt(key)} appears twice in one mapping "
                                  f"(lines {seen[key]} and {line}); keep one")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _count_values(value: Any, budget: int) -> int:
    """Values in `value` once aliases are expanded, counting stops past `budget` (bounded time)."""
    todo, count = [value], 0
    while todo and count <= budget:
        item = todo.pop()
        count += 1
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return count


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """PyYAML's problem with its line and column, and the context it was in with its own (the context's line is
    often the one to fix: a key without its colon is reported where the scanner gave up, a line or more below)."""
    lines = text.splitlines()

    def at(mark: Any) -> str:
        source = lines[mark.line].strip() if 0 <= mark.line < len(lines) else ""
        return f" at line {mark.line + 1}, column {mark.column + 1}" + (f" ({excerpt(source)})" if source else "")

    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if not problem:
        return excerpt(str(exc), 300)
    said = problem + (at(mark) if mark is not None else "")
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        said = f"{context}{at(context_mark) if context_mark is not None else ''}: {said}"
    return said


def read_yaml(text: str, where: str) -> Any:
    """YAML with duplicate keys refused and aliases bounded; errors name `where`."""
    try:
        value = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {_yaml_problem(exc, text)}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply to be a config") from None
    if _count_values(value, _MAX_VALUES) > _MAX_VALUES:
        raise ConfigError(f"{where} expands to more than {_MAX_VALUES:,} values once its YAML aliases (*name) are "
                          "expanded; a config has a few hundred: write the values out")
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], value), the value read as YAML (`1`, `true`, `[0.9, 0.95]`, `null`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key component")
    value = read_yaml(raw, f"override {excerpt(text)}") if raw.strip() else ""
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[:i + 1])}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                raw: dict[str, Any] | None = None) -> Config:
    """Load a YAML config file (or a raw mapping), apply `--set` overrides, validate everything."""
    if raw is None:
        if path is None:
            raise ConfigError("no config given: pass a YAML file")
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist" if not path.exists() else
                              f"config file {str(path)!r} is not a regular file")
        what = f"config file {str(path)!r}"
        raw = read_yaml(read_text_file(path, what, ConfigError), what) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    raw = apply_overrides(raw, list(overrides or []))
    config_dir = Path(path).parent if path is not None else Path.cwd()
    _shape_from_checkpoint(raw, config_dir)
    config = _build(Config, raw, "")
    if path is not None:
        config.data.path = resolve_data_path(config.data.path, config_dir)
        if config.data.eval_path:
            config.data.eval_path = resolve_data_path(config.data.eval_path, config_dir)
    if config.engine.update_trace:  # the GPU workers write it from Ray's working directories
        config.engine.update_trace = str(Path(config.engine.update_trace).expanduser().resolve())
    return config


def _shape_from_checkpoint(raw: dict[str, Any], config_dir: Path) -> None:
    """With model.path set, the model section becomes the checkpoint's config.json (plus the path);
    shape keys the YAML also states must agree with it."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("path"):
        return
    if not isinstance(model["path"], str):
        _fail("model.path", model["path"], "expected a string (a model directory, hub name or .gguf file)")
    revision = model.get("revision") or None
    if revision is not None and not isinstance(revision, str):
        _fail("model.revision", revision, "expected a string (a branch, tag or commit of the hub repository)")
    model_dir = resolve_model_dir(model["path"], "model.path", config_dir, revision, ConfigError)
    template = model.get("template", "auto")
    if template not in ("auto", "native", "generic"):
        _fail("model.template", template, "expected one of 'auto', 'native', 'generic'")
    from_checkpoint = model_config_for_template(model_dir, template)
    # model.template is resolved (auto becomes native or generic), not compared.
    stated = {k: v for k, v in model.items() if k not in ("path", "revision", "template")}
    base = _to_plain(from_checkpoint)
    merged = _build(ModelConfig, {**base, **stated}, "model")
    for key, value in stated.items():
        if getattr(merged, key) != getattr(from_checkpoint, key):
            _fail(f"model.{key}", value, f"disagrees with {model_dir}/config.json, which says "
                  f"{getattr(from_checkpoint, key)!r}; with model.path set the shape comes from config.json: "
                  "remove the key")
    raw["model"] = {**base, "path": model_dir, "revision": revision or ""}


def resolve_data_path(data_path: str, config_dir: Path) -> str:
    """Relative data paths are tried against the config's directory, then the working directory."""
    if data_path == "synthetic" or Path(data_path).is_absolute():
        return data_path
    beside_config = (config_dir / data_path)
    if beside_config.exists():
        return str(beside_config.resolve())
    return str(Path(data_path).resolve())


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str) -> int:
    """'512GB' -> 512e9, '80GiB' -> 80 * 2**30, '1.5T' -> 1.5e12."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{what}={text!r}: expected a size such as 512GB, 80GiB or 1.5TB")
    number, unit, binary = match.groups()
    power = "kmgtp".find(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)
