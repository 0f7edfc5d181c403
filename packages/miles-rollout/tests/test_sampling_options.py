"""CPU tier, in-process engine: the SGLang sampling options slime sends (penalties, `min_new_tokens`,
`spaces_between_special_tokens`) and `return_text_in_logprobs`, checked against the model's own logits with the
formulas of SGLang 0.5.23 (`sglang/srt/sampling/penaltylib/`: repetition over the generated tokens, divide a
positive logit and multiply a negative one; frequency `count * f`; presence `p` once; no stop token before
`min_new_tokens`). Returned log-probs keep the log-prob contract: `log_softmax(logits / T)` of the unmodified
logits, whatever the penalties."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, load_model
from miles_kernels.testing import packed_logits
from miles_rollout import Engine, EngineConfig, InProcessClient

PROMPT = [(5 * i + 3) % 500 for i in range(12)]
KERNEL = KernelConfig(page_size=16)


@pytest.fixture(scope="module")
def engine(dense_dir):
    engine = Engine(str(dense_dir), KERNEL, EngineConfig(num_kv_pages=128))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def model(dense_dir):
    return load_model(dense_dir, KERNEL)


def generate(engine: Engine, **params) -> list:
    request = GenerateRequest(input_ids=PROMPT, sampling_params=SamplingParams(**params), return_logprob=True)
    return asyncio.run(InProcessClient(engine).generate(request))


def step_logits(model, output: list[int]) -> torch.Tensor:
    """Unmodified logits that chose each output token (row j chose output[j])."""
    (logits,) = packed_logits(model, [torch.tensor(PROMPT + output)])
    return logits[len(PROMPT) - 1 : len(PROMPT) - 1 + len(output)].to(torch.float32)


def sglang_penalized(row: torch.Tensor, before: list[int], rep: float, freq: float, pres: float) -> torch.Tensor:
    row = row.clone()
    for token in set(before):
        value = row[token]
        value = value / rep if value > 0 else value * rep
        row[token] = value - freq * before.count(token) - pres
    return row


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.8, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.3, 0.5, 0.5)])
def test_greedy_with_penalties_follows_sglangs_formulas(engine, model, rep, freq, pres) -> None:
    plain = generate(engine, max_new_tokens=24, temperature=0.0, ignore_eos=True)[0]
    (penalized,) = generate(engine, max_new_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres)  # fmt: skip
    output = penalized.output_ids
    logits = step_logits(model, output)
    for j, token in enumerate(output):
        assert int(torch.argmax(sglang_penalized(logits[j], output[:j], rep, freq, pres))) == token, j
    assert output != plain.output_ids, "the penalty changed nothing: pick a stronger one"
    # The log-prob contract: the unmodified distribution (T = 1 for greedy), bitwise in deterministic mode.
    contract = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
    assert [e[0] for e in penalized.meta_info.output_token_logprobs] == contract.tolist()


def test_no_stop_before_min_new_tokens(engine) -> None:
    plain = generate(engine, max_new_tokens=16, temperature=0.0, ignore_eos=True)[0].output_ids
    stop = plain[2]  # greedy decoding would stop on it at the third token
    (early,) = generate(engine, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop])
    assert early.output_ids[-1] == stop and len(early.output_ids) <= 3
    assert early.meta_info.finish_reason.type == "stop"
    (late,) = generate(engine, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop], min_new_tokens=8)
    assert len(late.output_ids) >= 8 and stop not in late.output_ids[:8]
    (capped,) = generate(engine, max_new_tokens=5, temperature=0.0, stop_token_ids=[stop], min_new_tokens=5)
    assert len(capped.output_ids) == 5 and capped.meta_info.finish_reason.type == "length"


def test_text_in_logprobs_and_special_token_spacing(engine) -> None:
    request = GenerateRequest(
        input_ids=PROMPT, return_logprob=True, return_text_in_logprobs=True,
        sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0, spaces_between_special_tokens=False),
    )  # fmt: skip
    (response,) = asyncio.run(InProcessClient(engine).generate(request))
    texts = [e[2] for e in response.meta_info.output_token_logprobs]
    assert texts == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in response.output_ids]
    (plain,) = generate(engine, max_new_tokens=6, temperature=0.0)
    assert all(e[2] is None for e in plain.meta_info.output_token_logprobs)  # SGLang's default: no text
