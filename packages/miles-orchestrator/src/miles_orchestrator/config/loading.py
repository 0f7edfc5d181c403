"""Loading the run config (run.py's `RunConfig`): a YAML file plus dotted CLI overrides, validated, every mistake a
`ValueError` naming the dotted field and the fix (an unknown key with the closest known one); `config_help`, the text
of `miles-orchestrator run --help`, and `dump_config`, the resolved config a run writes next to its outputs."""

from __future__ import annotations

import difflib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from miles_orchestrator.config.run import RunConfig


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config from a YAML file (None: all defaults) and `section.field=value` overrides, validated.

    An override's value is parsed as YAML (`trainer.lr=1e-6` is a float, `model.path=null` is None, `x=[1, 2]` a
    list). Unknown keys, malformed overrides and invalid values raise ValueError naming the dotted field.
    """
    data = {} if path is None else read_config_file(path)
    for override in overrides:
        _apply_override(data, override)
    try:
        return RunConfig.model_validate(_with_section_defaults(data, RunConfig))
    except ValidationError as error:
        raise ValueError(_describe(error)) from error


def _with_section_defaults(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """`data` with each given section's run defaults under it: a section whose default is not its class's (e.g.
    `trainer.optimizer`, lr 2e-4 where OptimizerConfig says 1e-5; `rollout.engine`, 64 running requests) keeps the
    values its default sets for the keys `data` leaves out, so `trainer.optimizer.warmup_steps=10` changes the
    warm-up alone, not the learning rate too."""
    out = dict(data)
    for name, info in model.model_fields.items():
        section = section_model(info.annotation)
        given = out.get(name)
        if section is None or not isinstance(given, dict):
            continue
        default = info.get_default(call_default_factory=True)
        preset = default.model_dump(exclude_unset=True) if isinstance(default, BaseModel) else {}
        out[name] = _with_section_defaults(_merged(preset, given), section)
    return out


def _merged(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over `base`, nested mappings merged key by key."""
    out = dict(base)
    for key, value in given.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML run config file's settings as nested dicts, every key checked (ValueError naming a wrong one)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read config file {str(path)!r}: {error}") from error
    except yaml.YAMLError as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {error}") from error
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections (model:, data:, ...)")
    data: dict[str, Any] = loaded or {}
    _check_keys(data, RunConfig, "", source=f"config file {str(path)!r}")
    return data


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML that `load_config` reads back to an equal config: every setting but the derived ones,
    which the reading derives again from their sources (resolve.py)."""
    data = cfg.model_dump(mode="json")
    for dotted in cfg.derived:
        *path, name = dotted.split(".")
        node = data
        for part in path:
            node = node[part]
        del node[name]
    return str(yaml.safe_dump(data, sort_keys=False))


def config_help(model: type[BaseModel] = RunConfig) -> str:
    """Every field as `section.field (type, default X): description`, grouped by section. Defaults are the run's:
    a nested component model shows the values its section starts from (e.g. `trainer.optimizer.lr`'s 2e-4)."""
    lines: list[str] = []
    _help_lines(model, "", lines, model.model_construct())
    return "\n".join(lines).strip() + "\n"


def _help_lines(model: type[BaseModel], prefix: str, lines: list[str], defaults: BaseModel) -> None:
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        default = getattr(defaults, name)
        section = section_model(info.annotation)
        if section is not None:
            # an optional section says what it is for in its field's description (its class may serve elsewhere)
            about = (info.description if default is None else None) or section.__doc__ or ""
            optional = " (optional: null until one of its keys is set)" if default is None else ""
            lines += ["", f"{dotted}: {' '.join(about.split())}{optional}"]
            _help_lines(section, f"{dotted}.", lines, section.model_construct() if default is None else default)
            continue
        text = yaml.safe_dump(list(default) if isinstance(default, tuple) else default, default_flow_style=True)
        text = text.strip().removesuffix("...").strip()
        lines.append(f"  {dotted} ({type_text(info.annotation)}, default {text}): {info.description}")


def type_text(annotation: Any) -> str:
    """A field's type as help shows it: `float`, `str | None`, one of `{constant, cosine}`, `list[int]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return "{" + ", ".join(str(v) for v in args) + "}"
    if origin in (Union, UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds: its annotation, or X of an optional section `X | None` (e.g. opd.teacher,
    null until one of its keys is given)."""
    if get_origin(annotation) in (Union, UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        return section_model(models[0]) if len(models) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _check_keys(data: dict[str, Any], model: type[BaseModel], prefix: str, *, source: str) -> None:
    for key, value in data.items():
        _check_key(model, prefix, str(key), source=source)
        section = section_model(model.model_fields[str(key)].annotation)
        if section is not None and isinstance(value, dict):
            _check_keys(value, section, f"{prefix}{key}.", source=source)


def _check_key(model: type[BaseModel], prefix: str, key: str, *, source: str) -> None:
    if key in model.model_fields:
        return
    valid = list(model.model_fields)
    close = difflib.get_close_matches(key, valid, n=1)
    # namesakes in the same section first, then the shallowest: trainer.lr moved to trainer.optimizer.lr, not to
    # trainer.critic.optimizer.lr or spec.optimizer.lr
    named = [n for n in _fields_named(RunConfig, key) if n.startswith(prefix)] or _fields_named(RunConfig, key)
    nearest = [name for name in named if name.count(".") == min(n.count(".") for n in named)]
    elsewhere = MOVED.get(prefix + key) or ", ".join(nearest)
    # a field of that very name elsewhere says more than a near spelling here (trainer.lr: not trainer.lora)
    hint = f" (now {elsewhere})" if elsewhere else f" (did you mean {prefix}{close[0]}?)" if close else ""
    where = prefix.rstrip(".") or "the top level"
    raise ValueError(f"{source}: unknown key {prefix + key!r}{hint}; valid keys of {where}: {', '.join(valid)}")


# Keys of earlier run configs whose setting moved under another name (fields that only moved into a nested
# section, e.g. trainer.lr -> trainer.optimizer.lr, are found by name).
MOVED = {
    "rollout.deterministic": "kernel.mode (deterministic or fast)",
    "trainer.dtype": "kernel.dtype",
    "trainer.lr_schedule": "trainer.optimizer.schedule",
    # the memory planner reads the run's own layout
    "memory.plan.trainer_backend": "trainer.backend.name",
    **{f"memory.plan.{k}": f"trainer.backend.megatron.{k}" for k in ("tp", "pp", "ep", "etp", "cp", "recompute")},
    "memory.plan.rollout_engine": "rollout.backend",
    "memory.plan.rollout_tp": "rollout.sglang.tp_size",
    "memory.plan.rollout_ep": "rollout.sglang.ep_size",
    "memory.plan.mem_fraction_static": "rollout.sglang.mem_fraction_static",
}


def _fields_named(model: type[BaseModel], name: str, prefix: str = "") -> list[str]:
    """The dotted paths of every field called `name` in `model`'s sections."""
    found = []
    for field, info in model.model_fields.items():
        section = section_model(info.annotation)
        if section is not None:
            found += _fields_named(section, name, f"{prefix}{field}.")
        elif field == name:
            found.append(f"{prefix}{field}")
    return found


def _apply_override(data: dict[str, Any], override: str) -> None:
    dotted, sep, text = override.partition("=")
    dotted = dotted.strip()
    source = f"override {override!r}"
    if not sep or not dotted:
        raise ValueError(f"{source} must look like section.field=value, e.g. trainer.lr=1e-6")
    parts = dotted.split(".")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, key in enumerate(parts[:-1]):
        prefix = "".join(f"{p}." for p in parts[:depth])
        _check_key(model, prefix, key, source=source)
        section = section_model(model.model_fields[key].annotation)
        if section is None:
            raise ValueError(f"{source}: {prefix}{key} is a value, not a section; drop what follows it")
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"{source}: {prefix}{key} is not a mapping in the config file; fix the file first")
        node, model = child, section
    _check_key(model, "".join(f"{p}." for p in parts[:-1]), parts[-1], source=source)
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: the value {text!r} is not valid YAML; quote it ({error})") from error


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        dotted = ".".join(str(part) for part in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        given = "" if item["type"] in ("value_error", "missing") else f" (got {item['input']!r})"
        problems.append(f"{dotted}: {message}{given}")
    return "invalid run config: " + "; ".join(problems)  # one line, whatever the number of problems
