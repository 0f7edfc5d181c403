"""Docs tier: the Python examples of docs/plugins.md, run as written — loaded by path through the same checks
as a run, and called (the rollout function against an in-process embedded engine, the reward server's app under
uvicorn on 127.0.0.1 through the http reward, the data source through a resume)."""

from __future__ import annotations

import asyncio
import importlib
import re
from pathlib import Path

import pytest

from miles_contracts import RolloutFn, Sample, SampleFilter, SampleStatus, SamplingParams, load_plugin
from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_orchestrator.config import DataSection, RewardSection
from miles_orchestrator.data.sources import build_data_source
from miles_orchestrator.reward.pool import RewardPool, resolve_reward
from miles_orchestrator.rollout.batch import PromptEncoder, expand_groups, run_groups
from miles_rollout import Engine, EngineConfig, InProcessClient

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "plugins.md"


@pytest.fixture(scope="module")
def my_plugins(tmp_path_factory):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 5, "the guide lost its examples"
    directory = tmp_path_factory.mktemp("plugins")
    (directory / "my_plugins.py").write_text("\n\n".join(blocks))
    import sys

    sys.path.insert(0, str(directory))
    try:
        yield importlib.import_module("my_plugins")
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("my_plugins", None)


def sample(index: int, response: str, tokens: int, status=SampleStatus.COMPLETED) -> Sample:
    return Sample(index=index, group_index=0, prompt="What is 2 + 3?", label="5", response=response,
                  response_tokens=list(range(tokens)), status=status)  # fmt: skip


def test_reward_and_filter_examples(my_plugins) -> None:
    reward = resolve_reward("my_plugins:length_penalized")
    assert reward(sample(0, "5", 2)) == pytest.approx(0.98)
    group = resolve_reward("my_plugins:best_of_group", is_group=True)
    assert group([sample(0, "5", 4), sample(1, "the answer is 5", 2), sample(2, "6", 1)]) == [0.0, 1.0, 0.0]
    keep = load_plugin("my_plugins:not_all_truncated", SampleFilter)
    assert keep([sample(0, "5", 1), sample(1, "", 9, SampleStatus.TRUNCATED)]) is True
    assert keep([sample(0, "", 9, SampleStatus.TRUNCATED)]) is False


def test_rollout_function_example(my_plugins, tmp_path) -> None:
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(tmp_path, tiny_config("dense", vocab_size=len(tokenizer)), seed=3, tokenizer=tokenizer)
    engine = Engine(str(tmp_path), KernelConfig(page_size=16), EngineConfig(num_kv_pages=128))
    try:
        rollout = load_plugin("my_plugins:stop_at_newline", RolloutFn)
        prompts = [Sample(index=0, group_index=0, prompt="What is 2 + 3?", label="5")]
        groups = expand_groups(prompts, 4, PromptEncoder(str(tmp_path)))
        params = SamplingParams(max_new_tokens=12, temperature=1.0)
        (done,) = asyncio.run(run_groups(InProcessClient(engine), groups, params, 0, rollout))
    finally:
        engine.shutdown()
    assert [s.status for s in done if s.status == SampleStatus.FAILED] == []
    for s in done:
        assert len(s.rollout_logprobs or []) == len(s.response_tokens) > 0
        assert "\n" not in s.response


async def test_reward_server_example(my_plugins) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(my_plugins.app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        samples = [sample(0, "5", 1), sample(1, "7", 1)]
        section = RewardSection(name="http", url=f"http://127.0.0.1:{port}/reward", max_retries=0)
        pool = await asyncio.to_thread(RewardPool.from_config, section)  # its start-up check blocks: off the loop
        with pool:
            stats = await pool.score(samples)
    finally:
        server.should_exit = True
        await serving
    assert [s.reward for s in samples] == [1.0, 0.0] and stats.num_failed == 0


def test_data_source_example(my_plugins) -> None:
    cfg = DataSection(source="my_plugins:Multiplications", source_args={"max_factor": 20}, seed=1)
    expected = build_data_source(cfg).get_samples(6)
    for s in expected:
        a, b = (int(x) for x in str(s.prompt).removeprefix("What is ").removesuffix("?").split(" * "))
        assert s.label == str(a * b) and 2 <= a <= 20 and 2 <= b <= 20
    first = build_data_source(cfg)
    first.get_samples(4)
    resumed = build_data_source(cfg)
    resumed.load_state_dict(first.state_dict())
    assert resumed.get_samples(2) == expected[4:]


def test_environment_examples(my_plugins) -> None:
    from miles_contracts import AgentMessage, Environment, ToolCall
    from miles_orchestrator.rollout.env_pool import EnvPool

    game = load_plugin("my_plugins:GuessTheNumber", Environment)()
    assert "Guess it" in game.reset(Sample(index=0, group_index=0, prompt="", label="42"))
    assert game.step(AgentMessage(content="50", turn=0)).observation == "Lower."
    assert game.step(AgentMessage(content="I say", turn=1)).observation == "Answer with a number."
    won = game.step(AgentMessage(content="It is 42", turn=2))
    assert won.is_done and won.reward == pytest.approx(0.8)
    tools = load_plugin("my_plugins:WordTools", Environment)()
    tools.reset(Sample(index=0, group_index=0, prompt="How many words?", label="3"))
    call = ToolCall(name="count_words", arguments={"text": "a b c"})
    counted = tools.step(AgentMessage(content="", tool_calls=[call], turn=0))
    assert counted.observation[0].content == "3" and not counted.is_done
    assert tools.step(AgentMessage(content="3", turn=1)).reward == 1.0
    # in a sandboxed worker, as a run loads it
    with EnvPool("my_plugins:GuessTheNumber", {}, timeout_s=30, num_workers=1) as pool:

        async def episode():
            opened = await pool.open(Sample(index=0, group_index=0, prompt="", label="7"))
            assert opened.messages[0].role == "user" and opened.tools is None
            return await pool.step(opened.episode, AgentMessage(content="7", turn=0))

        assert asyncio.run(episode()).is_done
