"""Multi-process tier: the determinism harness over real HTTP against `miles-rollout serve --deterministic`
(dense and MoE, greedy and temperature 1 with a fixed seed), and in-process; outputs *and* log-probs must have
exactly one unique value in every mode."""

from __future__ import annotations

import asyncio

import pytest

from miles_kernels import KernelConfig
from miles_rollout import Client, Engine, EngineConfig, InProcessClient
from miles_rollout.determinism import run_harness


@pytest.fixture(scope="module")
def moe_server(moe_dir, start_server):
    with start_server(moe_dir, "--deterministic") as url:
        yield url


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_harness_over_http(kind: str, temperature: float, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{kind}_server")

    async def run() -> dict[str, int]:
        async with Client(url) as client:
            return await run_harness(client, vocab_size=512, temperature=temperature)

    assert set(asyncio.run(run()).values()) == {1}


def test_harness_in_process(moe_dir) -> None:
    kernel = KernelConfig(page_size=16)
    engine = Engine(str(moe_dir), kernel, EngineConfig(num_kv_pages=512))
    try:
        result = asyncio.run(run_harness(InProcessClient(engine), vocab_size=512, temperature=1.0, seed=7))
    finally:
        engine.shutdown()
    assert result == {"single": 1, "mixed": 1, "prefix": 1, "single_ids": 1, "mixed_ids": 1, "prefix_ids": 1}
