"""Agentic rollouts. Pure logic: the Hermes tool-call parser, the safe calculator, the calculator environment.
Multi-process: the environment sandbox (spawned workers; a raising, hanging or crashing environment fails its
sample, never the pool). CPU numerics (an in-process embedded engine): the multi-turn rollout keeps the engine's
tokens turn by turn, appends observations as the chat template's tokens with loss mask 0, and honours its turn and
token budgets; a scripted policy (a fake client) checks tool calls end to end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_contracts import (
    AgentMessage,
    FinishReason,
    GenerateResponse,
    MetaInfo,
    Sample,
    SampleStatus,
    SamplingParams,
    ToolCall,
)
from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_orchestrator.rollout.agent_metrics import agent_metrics
from miles_orchestrator.rollout.agentic import AgentRollout, ChatTemplate
from miles_orchestrator.rollout.batch import run_groups
from miles_orchestrator.rollout.env_pool import EnvPool
from miles_orchestrator.rollout.environments import CalculatorEnv, calculate
from miles_orchestrator.rollout.tool_calls import format_tool_call, parse_tool_calls
from miles_rollout import Engine, EngineConfig, InProcessClient

EOS_BIAS = {"2": 4.6}  # <|im_end|> (id 2) about a quarter of the draws: turns of a few tokens that end by themselves


# ---- the tool-call format and the calculator (pure logic) ----


def test_hermes_tool_calls_parse_and_malformed_ones_say_what_is_wrong() -> None:
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 48"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')  # fmt: skip
    parsed = parse_tool_calls(text)
    assert parsed.calls == [
        ToolCall(name="calculator", arguments={"expression": "37 * 48"}),
        ToolCall(name="search", arguments={"q": "x"}),  # arguments as a JSON string, as OpenAI writes them
    ]
    assert parsed.errors == [] and parse_tool_calls("85").num_attempts == 0
    bad = {
        "<tool_call>{name: calculator}</tool_call>": "is not JSON",
        "<tool_call>[1, 2]</tool_call>": "a JSON list, not an object",
        '<tool_call>{"arguments": {}}</tool_call>': 'no "name" string',
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>': '"arguments" must be a JSON object',
        '<tool_call>{"name": "calculator"': "never closed",
    }
    for text, reason in bad.items():
        parsed = parse_tool_calls(text)
        assert parsed.calls == [] and len(parsed.errors) == 1, text
        assert reason in parsed.errors[0] and "<tool_call>" in parsed.errors[0], parsed.errors[0]
    call = ToolCall(name="calculator", arguments={"expression": "1 + 2"})
    assert parse_tool_calls(format_tool_call(call)).calls == [call]


def test_the_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert calculate("37 * 48") == 1776 and calculate("(1 + 2) ** 3 - 7 // 2") == 24 and calculate("7 / 2") == 3.5
    assert calculate("-4 + +2") == -2 and isinstance(calculate("6 / 3"), int)
    refused = {
        "__import__('os').system('true')": "is not allowed",
        "2 ** 10 ** 9": "exponent",
        "1 / 0": "division by zero",
        "9" * 40: "beyond",
        "1 +": "not an arithmetic expression",
        "x + 1": "is not allowed",
    }
    for expression, reason in refused.items():
        with pytest.raises(ValueError, match=reason):
            calculate(expression)
    with pytest.raises(ValueError, match="must be a string"):
        calculate(12)  # type: ignore[arg-type]


def test_the_calculator_environment_runs_tools_then_scores_the_answer() -> None:
    env = CalculatorEnv()
    env.reset(Sample(index=0, group_index=0, prompt="What is 37 * 48?", label="1776"))
    calls = [ToolCall(name="calculator", arguments={"expression": "37 * 48"}),
             ToolCall(name="calculator", arguments={"expr": "1"}), ToolCall(name="wolfram", arguments={})]  # fmt: skip
    result = env.step(AgentMessage(content="...", tool_calls=calls, turn=0))
    assert not result.is_done and result.reward == 0.0 and result.num_tool_errors == 2
    outputs = [m.content for m in result.observation]  # type: ignore[union-attr]
    assert outputs[0] == "1776" and "TypeError" in outputs[1] and "no tool 'wolfram'" in outputs[2]
    assert all(m.role == "tool" for m in result.observation)  # type: ignore[union-attr]
    final = env.step(AgentMessage(content="The answer is 1776", turn=1))
    assert final.is_done and final.reward == 1.0
    assert env.step(AgentMessage(content="1777", turn=1)).reward == 0.0
    with pytest.raises(TypeError, match=r"takes no rollout\.agent\.env_args"):
        CalculatorEnv(x=1)


# ---- the multi-turn rollout (CPU numerics) and the sandbox (multi-process) ----


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[tuple[Engine, ChatTemplate]]:
    path = tmp_path_factory.mktemp("model")
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(path, tiny_config("dense", vocab_size=len(tokenizer)), seed=5, tokenizer=tokenizer)
    engine = Engine(str(path), KernelConfig(page_size=16), EngineConfig(num_kv_pages=512))
    yield engine, ChatTemplate(tokenizer)
    engine.shutdown()


class Recording:
    """A client that records every request and response (to check the rollout against what the engine did)."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []

    async def generate(self, request):
        responses = await self.client.generate(request)
        self.calls.append((request, responses))
        return responses


def group(prompt: str, n: int, modes: list[str] | None = None) -> list[Sample]:
    modes = modes or ["ok"] * n
    return [Sample(index=i, group_index=0, prompt=prompt, label="2", metadata={"mode": modes[i]}) for i in range(n)]


def play(rollout: AgentRollout, client, samples: list[Sample], max_new_tokens: int = 16) -> list[Sample]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, logit_bias=EOS_BIAS, sampling_seed=11)
    return asyncio.run(rollout(client, samples, params))


def test_turns_keep_the_engines_tokens_and_observations_are_template_tokens(engine, plugins_on_path) -> None:
    eng, chat = engine
    client = Recording(InProcessClient(eng))
    tokenizer = chat.tokenizer
    with EnvPool("orchestrator_plugins:ScriptedEnv", {"done_after": 3}, timeout_s=30, num_workers=2) as pool:
        samples = play(AgentRollout(pool, chat, max_turns=4, max_response_tokens=400), client, group("1 + 1", 4))
    by_input = {(tuple(r.input_ids), r.sampling_params.sampling_seed): out[0] for r, out in client.calls}
    assert len(client.calls) == sum(s.metadata["agent"]["turns"] for s in samples)
    expected_prompt = tokenizer.encode("<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n")
    for sample in samples:
        agent = sample.metadata["agent"]
        spans = agent["turn_spans"]
        assert sample.prompt_tokens == expected_prompt
        trained = [0] * len(sample.response_tokens)
        for k, (start, end) in enumerate(spans):
            # the turn's request was the whole conversation so far, and its tokens are the engine's, untouched
            response = by_input[tuple(sample.prompt_tokens + sample.response_tokens[:start]), 11 + sample.index]
            assert sample.response_tokens[start:end] == list(response.output_ids)
            assert sample.rollout_logprobs[start:end] == [e[0] for e in response.meta_info.output_token_logprobs]
            trained[start:end] = [1] * (end - start)
            if k + 1 < len(spans):  # the observation between two turns: the test template's own tokens
                closing = [] if response.output_ids[-1] == 2 else [2]
                observed = tokenizer.encode(f"\n<|im_start|>user\nobs {k}<|im_end|>\n<|im_start|>assistant\n")
                assert sample.response_tokens[end : spans[k + 1][0]] == closing + observed
                assert set(sample.rollout_logprobs[end : spans[k + 1][0]]) == {0.0}
        assert sample.loss_mask == trained  # only the model's own tokens train
        assert spans[-1][1] == len(sample.response_tokens)  # the response ends with the model's last turn
        if agent["end"] == "done":
            assert agent["turns"] == 3 and sample.status == SampleStatus.COMPLETED and agent["reward"] == 3.0
            assert agent["info"] == {"last": 2}
        else:
            assert agent["end"] == "truncated" and sample.status == SampleStatus.TRUNCATED
    assert any(s.metadata["agent"]["end"] == "done" for s in samples)
    metrics = agent_metrics(samples)
    assert metrics["agent_turns_mean"] == sum(s.metadata["agent"]["turns"] for s in samples) / 4


def test_turn_and_token_budgets_end_an_episode(engine, plugins_on_path) -> None:
    eng, chat = engine
    client = InProcessClient(eng)
    with EnvPool("orchestrator_plugins:ScriptedEnv", {"done_after": 9}, timeout_s=30, num_workers=1) as pool:
        two_turns = play(AgentRollout(pool, chat, max_turns=2, max_response_tokens=400), client, group("2 + 2", 3))
        short = play(AgentRollout(pool, chat, max_turns=9, max_response_tokens=24), client, group("3 + 3", 3))
    for sample in two_turns:
        agent = sample.metadata["agent"]
        assert agent["turns"] <= 2 and sample.status == SampleStatus.TRUNCATED
        assert agent["end"] == ("max_turns" if agent["turns"] == 2 else "truncated")
    assert any(s.metadata["agent"]["end"] == "max_turns" for s in two_turns)
    for sample in short:
        assert len(sample.response_tokens) <= 24 and sample.metadata["agent"]["end"] in ("budget", "truncated")
        assert sample.metadata["agent"]["turn_spans"][-1][1] == len(sample.response_tokens)


def test_an_environment_that_raises_hangs_or_crashes_fails_its_sample_not_the_pool(engine, plugins_on_path) -> None:
    eng, chat = engine
    client = InProcessClient(eng)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, logit_bias={"2": 8.0}, sampling_seed=3)
    with EnvPool("orchestrator_plugins:ScriptedEnv", {"done_after": 3}, timeout_s=3, num_workers=2) as pool:
        rollout = AgentRollout(pool, chat, max_turns=4, max_response_tokens=400)
        for mode, error in [("raise", "raised RuntimeError: the environment broke"), ("hang", "timed out after 3s"),
                            ("crash", "worker died (exit code 3)")]:  # fmt: skip
            samples = asyncio.run(rollout(client, group("1 + 2", 1, [mode]), params))
            assert samples[0].status == SampleStatus.FAILED and error in (samples[0].error or ""), samples[0].error
            healthy = asyncio.run(rollout(client, group("1 + 2", 2), params))  # the pool still plays episodes
            assert all(s.status == SampleStatus.COMPLETED for s in healthy)
        assert pool.num_restarts == 2  # the hung and the crashed workers were replaced
        # run_groups: the failed sample's group is reported failed, the other groups are fine
        groups = [group("1 + 3", 2, ["ok", "raise"]), [s.model_copy(update={"group_index": 1}) for s in group("4", 2)]]
        done = asyncio.run(run_groups(client, groups, params, 0, rollout))
        assert [s.status for s in done[0]][1] == SampleStatus.FAILED
        assert all(s.status == SampleStatus.COMPLETED for s in done[1])


def test_reset_may_open_the_conversation(engine, plugins_on_path) -> None:
    eng, chat = engine
    with EnvPool("orchestrator_plugins:OpeningEnv", {}, timeout_s=30, num_workers=1) as pool:
        (sample,) = play(AgentRollout(pool, chat, max_turns=3, max_response_tokens=64), InProcessClient(eng),
                         group("5 + 5", 1))  # fmt: skip
    text = "<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\n5 + 5!<|im_end|>\n<|im_start|>assistant\n"
    assert sample.prompt_tokens == chat.tokenizer.encode(text)
    assert sample.metadata["agent"]["reward"] == 0.5 or sample.metadata["agent"]["end"] == "truncated"


# ---- tool calls end to end, with a scripted policy ----


class ScriptedPolicy:
    """A `GenerateClient` whose turns are given texts (tokenized, then EOS), log-prob -1 per token."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.requests = tokenizer, turns, []

    async def generate(self, request):
        self.requests.append(request)
        ids = [*self.tokenizer.encode(self.turns[len(self.requests) - 1]), 2]
        meta = MetaInfo(id="x", prompt_tokens=len(request.input_ids), completion_tokens=len(ids),
                        finish_reason=FinishReason(type="stop"), weight_version="4",
                        output_token_logprobs=[[-1.0, t, None] for t in ids])  # fmt: skip
        return [GenerateResponse(text=self.tokenizer.decode(ids, skip_special_tokens=True), output_ids=ids,
                                 meta_info=meta)]  # fmt: skip


def test_tool_calls_reach_the_calculator_and_malformed_ones_come_back_as_observations(engine) -> None:
    _, chat = engine
    call = json.dumps({"name": "calculator", "arguments": {"expression": "37 * 48"}})
    turns = ["<tool_call>{oops}</tool_call>", f"<tool_call>{call}</tool_call>", "It is 1776"]
    policy = ScriptedPolicy(chat.tokenizer, turns)
    sample = Sample(index=0, group_index=0, prompt="What is 37 * 48?", label="1776")
    with EnvPool("calculator", {}, timeout_s=30, num_workers=1) as pool:
        rollout = AgentRollout(pool, chat, max_turns=4, max_response_tokens=400)
        (done,) = asyncio.run(rollout(policy, [sample], SamplingParams(max_new_tokens=64, sampling_seed=0)))
    agent = done.metadata["agent"]
    assert (agent["turns"], agent["tool_calls"], agent["tool_errors"], agent["reward"]) == (3, 2, 1, 1.0)
    assert done.status == SampleStatus.COMPLETED and done.weight_version == 4
    second, third = (chat.tokenizer.decode(r.input_ids) for r in policy.requests[1:])
    assert "<|im_start|>tool\ntool call 1 is malformed: its body is not JSON" in second
    assert third.endswith("<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n")
    metrics = agent_metrics([done.model_copy(update={"reward": 1.0})])
    assert metrics["agent_tool_calls_mean"] == 2 and metrics["agent_tool_error_frac"] == 0.5
    assert metrics["agent_reward_turns_3"] == 1.0 and metrics["agent_end_done_frac"] == 1.0


# ---- the example's bootstrap and reward (pure logic) ----


def test_the_bootstrap_teaches_the_calculator_on_a_share_of_its_rows() -> None:
    from miles_orchestrator.config import load_config
    from miles_orchestrator.data.bootstrap import sft_rows

    cfg = load_config(Path(__file__).parents[3] / "examples" / "agentic_calculator.yaml", [])
    rows = sft_rows(cfg, 400, seed=1)
    with_tool = [row["messages"] for row in rows if len(row["messages"]) == 4]
    assert 0.18 < len(with_tool) / len(rows) < 0.32  # model.bootstrap_tool_use = 0.25
    for user, call, tool, answer in with_tool:
        (parsed,) = parse_tool_calls(call["content"]).calls
        assert user["content"] == f"What is {parsed.arguments['expression']}?"
        assert calculate(parsed.arguments["expression"]) == int(tool["content"]) == int(answer["content"])
    default = load_config(None, [])
    assert sft_rows(default, 8, seed=1) == default.data.task.to_task().sft_rows(8, seed=1)  # unchanged without tools


def test_the_env_reward_reads_the_episodes_reward() -> None:
    from miles_orchestrator.reward.pool import env_reward

    sample = Sample(index=0, group_index=0, prompt="q", metadata={"agent": {"reward": 0.75}})
    assert env_reward(sample) == 0.75
    with pytest.raises(ValueError, match=r"set rollout\.agent\.env"):
        env_reward(Sample(index=0, group_index=0, prompt="q"))


def test_observation_deltas_under_qwen3s_own_chat_template() -> None:
    """Qwen3's published template wraps tool results in <tool_response> inside one user turn, renders the tools into
    a system prompt, and re-renders the last assistant turn without its <think> block once messages follow it: the
    delta is still exactly what follows the model's EOS."""
    tokenizer = build_tokenizer(vocab_size=300, chat_format="qwen3")
    chat = ChatTemplate(tokenizer)
    two_results = [{"role": "tool", "content": "1776"}, {"role": "tool", "content": "12"}]
    expected = "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response>\n<tool_response>\n12\n</tool_response>"
    assert chat.delta(two_results) == tokenizer.encode(expected + "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.delta([{"role": "user", "content": "higher"}]) == tokenizer.encode(
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    opening = tokenizer.decode(chat.opening([{"role": "user", "content": "What is 3 * 4?"}], CalculatorEnv.tools))
    assert opening.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in opening
    assert opening.endswith("<|im_start|>user\nWhat is 3 * 4?<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not end an assistant turn with the EOS token"):
        ChatTemplate(tokenizer)


def test_observation_deltas_under_llama31s_and_qwen25s_chat_templates() -> None:
    """Llama 3.1's template ends every turn with <|eot_id|> (its EOS) and sends tool results as ipython turns;
    Qwen2.5's opens with its default system prompt: the opening and the deltas are those templates' own tokens."""
    llama = build_tokenizer(vocab_size=300, chat_format="llama3")
    chat = ChatTemplate(llama)
    assert chat.eos_id == llama.convert_tokens_to_ids("<|eot_id|>")
    assert chat.delta([{"role": "tool", "content": "1776"}]) == llama.encode(
        '<|start_header_id|>ipython<|end_header_id|>\n\n"1776"<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
        "\n\n",
        add_special_tokens=False,
    )
    opening = llama.decode(chat.opening([{"role": "user", "content": "What is 3 * 4?"}], None))
    assert opening.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
    assert opening.endswith("What is 3 * 4?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    qwen25 = build_tokenizer(vocab_size=300, chat_format="qwen2.5")
    opening = qwen25.decode(ChatTemplate(qwen25).opening([{"role": "user", "content": "Hi"}], None))
    assert opening.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
