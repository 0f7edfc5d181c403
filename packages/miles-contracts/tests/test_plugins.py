"""Pure-logic tests (no torch): `load_plugin` accepts fitting plug-ins and names the problem otherwise."""

import sys
import types
from collections.abc import Sequence

import pytest

from miles_contracts import (
    DataSource,
    GenerateRequest,
    GenerateResponse,
    GroupRewardFn,
    RewardFn,
    RolloutFn,
    Sample,
    SampleFilter,
    SamplingParams,
    load_plugin,
)


def exact_match(sample: Sample) -> float:
    return float(sample.response.strip() == sample.label)


async def async_reward(sample: Sample) -> float:
    return 0.0


def group_reward(samples: Sequence[Sample]) -> list[float]:
    return [0.0 for _ in samples]


def nonzero_std(samples: Sequence[Sample]) -> bool:
    return len({s.reward for s in samples}) > 1


async def single_turn(client, group: list[Sample], sampling_params: SamplingParams) -> list[Sample]:
    return group


def two_args(a, b) -> float:
    return 0.0


class ListSource:
    def get_samples(self, num_prompts: int) -> list[Sample]:
        return [Sample(index=i, group_index=i, prompt="p") for i in range(num_prompts)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.fixture(autouse=True)
def plugin_module():
    module = types.ModuleType("user_plugins")
    for obj in (exact_match, async_reward, group_reward, nonzero_std, single_turn, two_args):
        setattr(module, obj.__name__, obj)
    module.source = ListSource()
    module.not_callable = 3
    sys.modules["user_plugins"] = module
    yield
    del sys.modules["user_plugins"]


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("user_plugins:exact_match", RewardFn),
        ("user_plugins:async_reward", RewardFn),
        ("user_plugins:group_reward", GroupRewardFn),
        ("user_plugins:nonzero_std", SampleFilter),
        ("user_plugins:single_turn", RolloutFn),
        ("user_plugins:source", DataSource),
    ],
)
def test_fitting_plugins_load(path: str, protocol: type) -> None:
    obj = load_plugin(path, protocol)
    assert isinstance(obj, protocol)


@pytest.mark.parametrize(
    ("path", "protocol", "message"),
    [
        ("user_plugins.exact_match", RewardFn, "must look like 'package.module:function'"),
        ("no_such_module_xyz:f", RewardFn, "cannot import module 'no_such_module_xyz'"),
        ("user_plugins:missing", RewardFn, "has no attribute 'missing'"),
        ("user_plugins:not_callable", RewardFn, "is not callable"),
        ("user_plugins:two_args", RewardFn, "cannot be called as a RewardFn with 1 positional"),
        ("user_plugins:exact_match", RolloutFn, "cannot be called as a RolloutFn with 3 positional"),
        ("user_plugins:exact_match", DataSource, "lacks get_samples, state_dict, load_state_dict"),
    ],
)
def test_bad_plugins_are_named(path: str, protocol: type, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        load_plugin(path, protocol)


def test_generate_client_protocol_is_structural() -> None:
    from miles_contracts import GenerateClient

    class Echo:
        async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
            return []

    assert isinstance(Echo(), GenerateClient)
