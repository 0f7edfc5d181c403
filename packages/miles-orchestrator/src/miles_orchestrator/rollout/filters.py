"""Group filters: step 4 of the RL data path, between the reward and the advantages.

A filter sees one prompt group (the n scored samples of one prompt) and keeps it (True) or drops it (False).
Dynamic sampling (DAPO) drops groups whose rewards are all equal: under GRPO their advantages are all zero, so
they cost a training step and teach nothing; the loop over-samples to refill the batch. User filters are
`module:function` `SampleFilter`s, loaded and checked at start-up. Filters run in the orchestrator's process:
they are expected to be cheap and trusted, unlike rewards, which run in a worker pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_contracts import Sample, SampleFilter, load_plugin
from miles_orchestrator.config import FilterSection

__all__ = ["FilterResult", "apply_filters", "build_filters", "group_samples", "load_filter", "nonzero_reward_std"]


def nonzero_reward_std(samples: Sequence[Sample], /) -> bool:
    """Keep a group whose rewards are not all equal (reward None counts as 0.0); a group of one is dropped."""
    rewards = [s.reward or 0.0 for s in samples]
    return len(rewards) > 1 and max(rewards) > min(rewards)


def load_filter(path: str) -> SampleFilter:
    """A `module:function` SampleFilter, checked against the Protocol (ValueError/TypeError naming the fix)."""
    return load_plugin(path, SampleFilter)  # type: ignore[type-abstract]


def build_filters(cfg: FilterSection) -> list[SampleFilter]:
    """The filters `filter` asks for, in order: dynamic sampling, then the custom one."""
    filters: list[SampleFilter] = []
    if cfg.dynamic_sampling:
        filters.append(nonzero_reward_std)
    if cfg.custom is not None:
        filters.append(load_filter(cfg.custom))
    return filters


def group_samples(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples split into prompt groups by `group_index`, groups in first-seen order, samples in given order."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


@dataclass
class FilterResult:
    """Groups that passed every filter, those that did not, and how many each filter dropped (by its name)."""

    kept: list[list[Sample]]
    dropped: list[list[Sample]] = field(default_factory=list)
    dropped_by: dict[str, int] = field(default_factory=dict)

    @property
    def num_dropped(self) -> int:
        return len(self.dropped)

    @property
    def kept_samples(self) -> list[Sample]:
        return [s for group in self.kept for s in group]


def apply_filters(groups: Sequence[Sequence[Sample]], filters: Sequence[SampleFilter]) -> FilterResult:
    """Run `filters` over each group in turn; a group dropped by one filter is not shown to the next.

    A filter that raises, or returns something other than a bool, is a bug in that filter: it raises
    RuntimeError/TypeError naming the filter and the group, rather than silently keeping or dropping data.
    """
    result = FilterResult(kept=[])
    for group in groups:
        dropped_by = None
        for fn in filters:
            name = _name(fn)
            try:
                keep = fn(group)
            except Exception as error:
                gi = group[0].group_index if group else None
                raise RuntimeError(f"filter {name} raised on group {gi}: {type(error).__name__}: {error}") from error
            if not isinstance(keep, bool):
                raise TypeError(f"filter {name} returned {type(keep).__name__}; a SampleFilter returns True or False")
            if not keep:
                dropped_by = name
                break
        if dropped_by is None:
            result.kept.append(list(group))
        else:
            result.dropped.append(list(group))
            result.dropped_by[dropped_by] = result.dropped_by.get(dropped_by, 0) + 1
    return result


def _name(fn: SampleFilter) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
