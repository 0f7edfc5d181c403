"""User plug-in Protocols and the loader that checks a `module:function` path against them.

Plug-ins are named in the run config as `package.module:attribute`. The orchestrator loads each one at
start-up with `load_plugin`, so a typo or a wrong signature fails before any rollout, with a message that
names the path and the expected call shape.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Sequence
from typing import Annotated, Any, Protocol, TypeVar, runtime_checkable

from pydantic import AfterValidator

from miles_contracts.environment import Environment
from miles_contracts.generate import GenerateRequest, GenerateResponse, SamplingParams
from miles_contracts.sample import Sample


@runtime_checkable
class RewardFn(Protocol):
    """Scores one sample: `reward(sample) -> float` (sync or async)."""

    def __call__(self, sample: Sample, /) -> float | Awaitable[float]: ...


@runtime_checkable
class GroupRewardFn(Protocol):
    """Scores a prompt group together: `reward(samples) -> list[float]`, one per sample (sync or async)."""

    def __call__(self, samples: Sequence[Sample], /) -> list[float] | Awaitable[list[float]]: ...


@runtime_checkable
class SampleFilter(Protocol):
    """Keeps (True) or drops (False) a prompt group, e.g. dynamic sampling's non-zero reward std."""

    def __call__(self, samples: Sequence[Sample], /) -> bool: ...


@runtime_checkable
class DataSource(Protocol):
    """Yields prompt samples and can resume where it stopped."""

    def get_samples(self, num_prompts: int) -> list[Sample]:
        """The next `num_prompts` prompts as pending samples (one per prompt; the rollout expands groups)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position (epoch, offset, shuffle seed) for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by `state_dict`."""
        ...


@runtime_checkable
class GenerateClient(Protocol):
    """What a rollout function may call: an engine's `/generate` (HTTP or in-process)."""

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]: ...


@runtime_checkable
class RolloutFn(Protocol):
    """Turns one prompt group into finished samples: `await rollout(client, group, sampling_params)`.

    `group` holds the `n` pending samples of one prompt (same prompt, consecutive indices); the function
    returns them (or replacements) with tokens, log-probs, loss masks, status and weight versions filled.
    """

    def __call__(
        self, client: GenerateClient, group: list[Sample], sampling_params: SamplingParams, /
    ) -> Awaitable[list[Sample]]: ...


P = TypeVar("P")

_NUM_POSITIONAL = {RewardFn: 1, GroupRewardFn: 1, SampleFilter: 1, RolloutFn: 3}
# Protocols of classes (or objects) checked by their methods, not called: the data source, the environment
_METHODS: dict[Any, tuple[str, ...]] = {
    DataSource: ("get_samples", "state_dict", "load_state_dict"),
    Environment: ("reset", "step"),
}


def is_plugin_path(value: str) -> bool:
    """True for a `module:attribute` plug-in path (shape only; nothing is imported)."""
    module, sep, attribute = value.partition(":")
    return bool(sep and module and attribute)


def _check_plugin_path(value: str) -> str:
    if not is_plugin_path(value):
        raise ValueError(f"{value!r} must be a 'package.module:function' plug-in path")
    return value


# A config field holding a plug-in path: its shape is checked when the config loads; the plug-in itself is imported
# (`load_plugin`) when its component starts.
PluginPath = Annotated[str, AfterValidator(_check_plugin_path)]


def load_plugin(path: str, protocol: type[P]) -> P:
    """Import `module:attribute` and check it fits `protocol`; raise ValueError/TypeError naming the fix."""
    if not is_plugin_path(path):
        raise ValueError(f"plug-in path {path!r} must look like 'package.module:function'")
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"plug-in {path!r}: cannot import module {module_name!r} ({error})") from error
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"plug-in {path!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    methods = _METHODS.get(protocol)
    if methods is not None:
        missing = [m for m in methods if not callable(getattr(obj, m, None))]
        if missing:
            article = "an" if protocol.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"plug-in {path!r} is not {article} {protocol.__name__}: it lacks {', '.join(missing)}")
        if protocol is Environment and not isinstance(obj, type):
            raise TypeError(f"plug-in {path!r} is not a class; an Environment is a class, built once per episode")
        return obj  # type: ignore[no-any-return]
    if not callable(obj):
        raise TypeError(f"plug-in {path!r} is not callable; a {protocol.__name__} is a function")
    num_positional = _NUM_POSITIONAL.get(protocol)
    if num_positional is not None:
        _check_arity(path, obj, protocol.__name__, num_positional)
    return obj  # type: ignore[no-any-return]


def _check_arity(path: str, fn: Any, kind: str, num_positional: int) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust the call
    try:
        signature.bind(*([None] * num_positional))
    except TypeError as error:
        raise TypeError(
            f"plug-in {path!r} cannot be called as a {kind} with {num_positional} positional argument(s) "
            f"(its signature is {signature}): {error}"
        ) from error
