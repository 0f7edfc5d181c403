"""Pure-logic tier (no torch): dynamic sampling drops zero-std groups, custom filters load by path and are checked,
and a broken filter raises instead of silently keeping or dropping data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_contracts import Sample
from miles_orchestrator.config import FilterSection
from miles_orchestrator.rollout.filters import (
    apply_filters,
    build_filters,
    group_samples,
    load_filter,
    nonzero_reward_std,
)


def group(group_index: int, rewards: list[float | None], prompt: str = "short") -> list[Sample]:
    return [
        Sample(index=group_index * 10 + i, group_index=group_index, prompt=prompt, reward=r)
        for i, r in enumerate(rewards)
    ]


@pytest.fixture
def plugins_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    yield


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [([1.0, 0.0], True), ([0.5, 0.5, 0.5], False), ([0.0, 0.0], False), ([1.0], False), ([None, 1.0], True)],
)
def test_nonzero_reward_std(rewards: list[float | None], keep: bool) -> None:
    assert nonzero_reward_std(group(0, rewards)) is keep


def test_group_samples_keeps_order() -> None:
    a, b = group(3, [1.0, 0.0]), group(1, [0.0, 0.0])
    mixed = [a[0], b[0], a[1], b[1]]
    assert group_samples(mixed) == [a, b]


def test_dynamic_sampling_then_custom_filter(plugins_on_path: None) -> None:
    filters = build_filters(FilterSection(dynamic_sampling=True, custom="orchestrator_plugins:short_prompt"))
    assert len(filters) == 2
    groups = [
        group(0, [1.0, 0.0]),
        group(1, [1.0, 1.0]),
        group(2, [0.0, 1.0], prompt="a prompt that is far too long"),
        group(3, [0.0, 1.0, 1.0]),
    ]
    result = apply_filters(groups, filters)
    assert [g[0].group_index for g in result.kept] == [0, 3]
    assert result.num_dropped == 2
    assert [g[0].group_index for g in result.dropped] == [1, 2]
    assert result.dropped_by == {
        "miles_orchestrator.rollout.filters:nonzero_reward_std": 1,
        "orchestrator_plugins:short_prompt": 1,
    }
    assert [s.index for s in result.kept_samples] == [0, 1, 30, 31, 32]


def test_no_filters_keeps_everything() -> None:
    groups = [group(0, [1.0, 1.0])]
    assert build_filters(FilterSection(dynamic_sampling=False)) == []
    assert apply_filters(groups, []).kept == groups


def test_load_filter_checks_the_path(plugins_on_path: None) -> None:
    with pytest.raises(ValueError, match=r"must look like 'package\.module:function'"):
        load_filter("orchestrator_plugins.short_prompt")
    with pytest.raises(ValueError, match="no attribute"):
        load_filter("orchestrator_plugins:nope")
    with pytest.raises(TypeError, match="positional"):
        load_filter("orchestrator_plugins:two_arguments")


def test_broken_filters_raise_with_their_name(plugins_on_path: None) -> None:
    with pytest.raises(RuntimeError, match=r"filter orchestrator_plugins:filter_raises raised on group 5: KeyError"):
        apply_filters([group(5, [1.0, 0.0])], [load_filter("orchestrator_plugins:filter_raises")])
    with pytest.raises(TypeError, match="returned float; a SampleFilter returns True or False"):
        apply_filters([group(5, [1.0, 0.0])], [load_filter("orchestrator_plugins:filter_returns_number")])
