"""CPU numerics: gradients of a policy-gradient pass do not depend on the micro-batch split (global
normalization), for every aggregation mode; the loss equals the full-batch formula."""

from __future__ import annotations

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, random_model, tiny_config
from miles_trainer.step import PolicyLossConfig, accumulate_policy_gradients

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def make_samples(seed: int) -> tuple[list[Sample], list[float]]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, (num_prompt, num_response) in enumerate([(5, 7), (12, 3), (3, 9), (8, 8), (20, 2)]):
        tokens = torch.randint(0, 256, (num_prompt + num_response,), generator=generator).tolist()
        mask = [1] * num_response
        if i == 3:
            mask[2:5] = [0, 0, 0]  # a tool-output span that must not train
        samples.append(Sample(
            index=i, group_index=i // 2, prompt="", prompt_tokens=tokens[:num_prompt],
            response_tokens=tokens[num_prompt:], loss_mask=mask,
            rollout_logprobs=(-torch.rand(num_response, generator=generator)).tolist(),
        ))  # fmt: skip
    advantages = torch.randn(len(samples), generator=generator).tolist()
    return samples, advantages


def gradients(model, samples, advantages, config, budget) -> tuple[dict[str, torch.Tensor], float]:
    model.zero_grad(set_to_none=True)
    metrics = accumulate_policy_gradients(model, samples, advantages, KERNEL, config, budget)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, metrics.summary().get(
        "loss", 0.0
    )


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_is_invariant_to_micro_batch_split(agg_mode: str) -> None:
    model = random_model(tiny_config("moe"), KERNEL, seed=1).train()
    samples, advantages = make_samples(1)
    config = PolicyLossConfig(agg_mode=agg_mode, clip_low=0.2, clip_high=0.28)
    whole, whole_loss = gradients(model, samples, advantages, config, budget=10_000)
    split, split_loss = gradients(model, samples, advantages, config, budget=20)  # one sample per micro-batch
    assert abs(whole_loss - split_loss) < 1e-6
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-7, msg=name)


def test_masked_tokens_do_not_train_and_inputs_are_checked() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=2).train()
    samples, advantages = make_samples(2)
    only_tool = samples[3].model_copy(update={"loss_mask": [0] * 8, "index": 9})
    grads, loss = gradients(model, [only_tool], [1.0], PolicyLossConfig(), 1000)
    assert loss == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads.values())
    with pytest.raises(ValueError, match="one per sample"):
        accumulate_policy_gradients(model, samples, advantages[:2], KERNEL, PolicyLossConfig(), 100)
    no_logprobs = samples[0].model_copy(update={"rollout_logprobs": None})
    with pytest.raises(ValueError, match="no rollout_logprobs"):
        accumulate_policy_gradients(model, [no_logprobs], [1.0], KERNEL, PolicyLossConfig(), 100)
