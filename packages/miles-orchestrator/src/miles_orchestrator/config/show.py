"""`miles-orchestrator config show [--config FILE] [overrides]`: the resolved run config as YAML, each value that is
not a default commented with where it came from: the config file, the command line, or the setting it was derived
from (resolve.py) and why. The output is a config file: `--config` reads it back to the same config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from miles_orchestrator.config.loading import load_config, read_config_file, section_model
from miles_orchestrator.config.resolve import value_at
from miles_orchestrator.config.run import RunConfig


def _leaves(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> set[str]:
    """The dotted settings a (partial) config dict gives: a section's keys recursively, any other value whole."""
    out = set()
    for key, value in data.items():
        section = section_model(model.model_fields[key].annotation)
        if section is not None and isinstance(value, dict):
            out |= _leaves(value, section, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def _scalar(value: Any) -> str:
    text = str(yaml.safe_dump(value, default_flow_style=True, width=10**9)).strip()
    return text.removesuffix("...").strip()


def show_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The resolved config of `path` plus `overrides`, with the origin of every value that is not a default."""
    cfg = load_config(path, overrides)
    from_file = set() if path is None else _leaves(read_config_file(path), RunConfig)
    from_command_line = {override.partition("=")[0].strip() for override in overrides}
    lines = [f"# the resolved run config ({'defaults' if path is None else path}"
             f"{', plus the command line' if overrides else ''}); `# from` names what is not a default"]  # fmt: skip

    def origin(dotted: str) -> str:
        if any(dotted == key or dotted.startswith(key + ".") for key in from_command_line):
            return "  # from the command line"
        if dotted in from_file:
            return f"  # from {path}"
        row = cfg.derived.get(dotted)
        if row is None or value_at(cfg, dotted) is None:  # a derived "off" (None) is the default
            return ""
        return f"  # from {row.source}: {row.why}"

    def emit(node: BaseModel, data: dict[str, Any], prefix: str, indent: str) -> None:
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            child = getattr(node, key)
            if isinstance(child, BaseModel) and isinstance(value, dict):
                lines.append(f"{indent}{key}:{origin(dotted)}")
                emit(child, value, f"{dotted}.", indent + "  ")
            else:
                lines.append(f"{indent}{key}: {_scalar(value)}{origin(dotted)}")

    emit(cfg, cfg.model_dump(mode="json"), "", "")
    return "\n".join(lines) + "\n"
