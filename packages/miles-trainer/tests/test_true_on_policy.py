"""CPU numerics: the trainer's log-probs of sampled tokens equal, bit for bit, the log-probs recorded when the
miles-kernels paged-KV decode path sampled them (varied batch compositions, chunked prompts, T = 1 and greedy,
groups packed with one shared prompt), for dense and MoE; and packing is order-preserving with masks that train
only the model's own tokens."""

from __future__ import annotations

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, RowSampling, logprob_temperatures, sample, token_logprobs
from miles_kernels.testing import PagedRunner, random_model, tiny_config
from miles_trainer.logprobs import micro_batch_logprobs, response_logprobs
from miles_trainer.packing import pack_samples, plan_micro_batches, plan_samples

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def rollout(model, prompts: list[list[int]], num_new: int, temperature: float) -> list[Sample]:
    """Sample continuations with the paged decode path; sequences join at different steps and prompts are
    prefilled in chunks, so every step has a different batch composition."""
    runner = PagedRunner(model)
    pending = {i: torch.tensor(p) for i, p in enumerate(prompts)}
    responses: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    step = 0
    while any(len(r) < num_new for r in responses.values()):
        chunks = {}
        for i, prompt in pending.items():
            if i > step:  # sequence i joins at step i
                continue
            if runner.cached.get(i, 0) < len(prompt):
                done = runner.cached.get(i, 0)
                chunks[i] = prompt[done : done + 5]  # chunked prefill, 5 tokens a step
            elif len(responses[i]) < num_new:
                chunks[i] = torch.tensor(responses[i][-1:])
        step += 1
        if not chunks:
            continue
        out = runner.step(chunks)
        ready = [i for i in chunks if runner.cached[i] >= len(prompts[i])]
        if not ready:
            continue
        rows = torch.stack([out[i][-1] for i in ready])
        settings = [RowSampling(temperature=temperature, seed=100 + i, position=runner.cached[i]) for i in ready]
        tokens = sample(rows, settings)
        lps = token_logprobs(rows, tokens, logprob_temperatures(settings, rows.device))
        for j, i in enumerate(ready):
            responses[i].append(int(tokens[j]))
            logprobs[i].append(float(lps[j]))
    return [
        Sample(
            index=i,
            group_index=i,
            prompt="",
            prompt_tokens=prompts[i],
            response_tokens=responses[i],
            rollout_logprobs=logprobs[i],
        )
        for i in range(len(prompts))
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "deepseek"])
def test_trainer_logprobs_equal_rollout_logprobs_bitwise(kind: str, temperature: float) -> None:
    model = random_model(tiny_config(kind), KERNEL, seed=3)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 17, 9, 30, 1, 12, 16)]
    # Groups of samples of one prompt (the trainer packs each prompt once): partial and whole last pages.
    prompts = [prompts[i] for i in (0, 0, 1, 1, 1, 2, 3, 4, 4, 5, 6, 6)]
    samples = rollout(model, prompts, num_new=7, temperature=temperature)
    for max_tokens in (40, 1000):  # different micro-batch compositions on the trainer side too
        for micro in pack_samples(samples, KERNEL, max_tokens=max_tokens):
            with torch.no_grad():
                got = response_logprobs(model, micro, temperature)
            for local, i in enumerate(micro.sample_indices):
                expected = torch.tensor(samples[i].rollout_logprobs, dtype=torch.float32)
                assert torch.equal(got[local], expected), f"sample {i}, budget {max_tokens}"


def test_packing_plan_and_masks() -> None:
    assert plan_micro_batches([5, 5, 5, 20, 1], max_tokens=10) == [[0, 1], [2], [3], [4]]
    assert plan_micro_batches([5, 5, 5], max_tokens=10, shared=[0, 4, 4]) == [[0, 1, 2]]  # 5 + 1 + 1
    with pytest.raises(ValueError, match="positive token budget"):
        plan_micro_batches([1], 0)
    tool_turn = Sample(index=0, group_index=0, prompt="", prompt_tokens=[1, 2], response_tokens=[3, 4, 5, 6],
                       loss_mask=[1, 0, 0, 1])  # fmt: skip
    (micro,) = pack_samples([tool_turn], KERNEL, max_tokens=100)
    # Rows 1..4 predict the response tokens 3, 4, 5, 6 (the last token predicts nothing: not packed); only the
    # model's own tokens (3 and 6) train.
    assert micro.input_ids_N.tolist() == [1, 2, 3, 4, 5]
    assert micro.score_rows_K.tolist() == [1, 2, 3, 4]
    assert micro.target_ids_K.tolist() == [3, 4, 5, 6]
    assert micro.loss_mask_K.tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="needs prompt_tokens and response_tokens"):
        pack_samples([Sample(index=1, group_index=0, prompt="p")], KERNEL, max_tokens=10)


def test_a_group_packs_its_prompt_once_with_the_same_bits() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=4)
    prompt = list(range(1, 12))  # 11 tokens: a full page of 8 and a partial page (copied per response)
    responses = [[20, 21, 22], [23], [24, 25]]
    samples = [
        *(Sample(index=i, group_index=0, prompt="", prompt_tokens=prompt, response_tokens=r)
          for i, r in enumerate(responses)),
        Sample(index=3, group_index=1, prompt="", prompt_tokens=[5, 6], response_tokens=[7, 8]),
    ]  # fmt: skip
    (shared,) = pack_samples(samples, KERNEL, max_tokens=100)
    (whole,) = pack_samples(samples, KERNEL, max_tokens=100, share_prompts=False)
    # The prompt once, then each response minus its last token (the one-token response adds no row).
    assert shared.num_tokens == 11 + 2 + 0 + 1 + 3 and whole.num_tokens == 13 + 11 + 12 + 3
    assert shared.score_rows_K.tolist() == [10, 11, 12, 10, 10, 13, 15, 16]
    assert shared.target_ids_K.tolist() == whole.target_ids_K.tolist() == [20, 21, 22, 23, 24, 25, 7, 8]
    with torch.no_grad():
        assert torch.equal(micro_batch_logprobs(model, shared), micro_batch_logprobs(model, whole))
    # A group cut by the token budget repeats its prompt in the next micro-batch.
    assert plan_samples(samples, max_tokens=13) == [[0, 1], [2], [3]]
    assert [m.num_tokens for m in pack_samples(samples, KERNEL, max_tokens=13)] == [11 + 2, 11 + 1, 3]
