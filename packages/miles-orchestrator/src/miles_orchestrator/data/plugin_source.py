"""A user's data source: step 1 of the RL data path when `data.source` is a 'module:Class' DataSource plug-in.

`PluginSource` builds the class as `Class(data_section, **data.source_args)` (the `DataSection` gives it the
run's seed, shuffle, epochs and keys; `source_args` its own settings), checks the object against the
`miles_contracts.DataSource` Protocol, and holds every batch it returns to the invariants the loop relies on
(sources.py's module docstring): one `Sample` per prompt, `group_index` counting up by one from 0 over the run. It
saves the user's `state_dict()` inside its own, so a resumed run continues with the same prompts and seeds.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from miles_contracts import DataSource, Sample, load_plugin
from miles_orchestrator.config import DataSection

__all__ = ["PluginSource", "load_source_class"]


class PluginSource:
    """A user's DataSource class (`data.source='module:Class'`), built as `Class(data_section, **data.source_args)`
    and held to the contract the loop relies on.

    Each `get_samples(n)` must return a list of at most n `Sample`s, one per prompt, whose `group_index` counts up
    by one from 0 over the whole run (a resumed run included); fewer than asked (then none) ends the run, as for a
    file. `state_dict()` must be JSON (checkpoints store it as JSON) and `load_state_dict` must continue exactly
    where it was saved: a resumed run then regenerates the same prompts and seeds. A break of the contract raises
    ValueError naming data.source rather than training on wrong groups.
    """

    def __init__(self, cfg: DataSection) -> None:
        self.path = cfg.source
        cls = load_source_class(cfg.source, cfg)
        self.source = cls(cfg, **cfg.source_args)
        missing = [m for m in _SOURCE_METHODS if not callable(getattr(self.source, m, None))]
        if missing:
            raise TypeError(f"data.source={self.path!r}: the object it built lacks {', '.join(missing)}")
        self.next_group_index = 0
        self.state_dict()  # a state that cannot become JSON fails now, not at the first checkpoint

    def get_samples(self, num_prompts: int) -> list[Sample]:
        samples = self.source.get_samples(num_prompts)
        if not isinstance(samples, list) or len(samples) > num_prompts:
            raise ValueError(
                f"data.source={self.path!r}: get_samples({num_prompts}) must return a list of at most {num_prompts} "
                f"Samples, got {type(samples).__name__}{f' of {len(samples)}' if isinstance(samples, list) else ''}"
            )
        for k, sample in enumerate(samples):
            expected = self.next_group_index + k
            if not isinstance(sample, Sample):
                raise ValueError(
                    f"data.source={self.path!r}: get_samples returned a {type(sample).__name__}; return "
                    "miles_contracts.Sample objects"
                )
            if sample.group_index != expected:
                raise ValueError(
                    f"data.source={self.path!r}: prompt {k} of get_samples({num_prompts}) has group_index "
                    f"{sample.group_index}, expected {expected}: group indices count up by one per prompt from 0 "
                    "over the whole run (sample seeds derive from them), and restart where state_dict saved them"
                )
        self.next_group_index += len(samples)
        return samples

    def state_dict(self) -> dict[str, Any]:
        state = {"kind": "plugin", "next_group_index": self.next_group_index, "source": self.source.state_dict()}
        try:
            return json.loads(json.dumps(state))  # type: ignore[no-any-return]
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"data.source={self.path!r}: state_dict() must return a JSON-serializable dict (checkpoints store it "
                f"as JSON): {error}"
            ) from error

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "plugin":
            raise ValueError(
                f"cannot resume data.source={self.path!r}: the checkpoint's data position was saved by a "
                f"{state.get('kind')!r} source; resume with the data.source the run started with"
            )
        self.source.load_state_dict(state["source"])
        self.next_group_index = int(state["next_group_index"])


_SOURCE_METHODS = ("get_samples", "state_dict", "load_state_dict")


def load_source_class(path: str, cfg: DataSection) -> type[Any]:
    """Import the 'module:Class' DataSource `path` names and check that it is a class with the DataSource methods
    that `Class(cfg, **cfg.source_args)` can call; ValueError / TypeError naming the fix."""
    cls: Any = load_plugin(path, DataSource)  # type: ignore[type-abstract]
    if not isinstance(cls, type):
        raise TypeError(
            f"plug-in {path!r} is a {type(cls).__name__}, not a class; data.source names a DataSource class, built "
            "as Class(data_section, **data.source_args)"
        )
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return cls  # no signature to check (a C extension): the call will tell
    try:
        signature.bind(cfg, **cfg.source_args)
    except TypeError as error:
        raise TypeError(
            f"plug-in {path!r} cannot be built as {cls.__name__}(data_section, **data.source_args) with "
            f"data.source_args={cfg.source_args!r} (its signature is {signature}): {error}"
        ) from error
    return cls
