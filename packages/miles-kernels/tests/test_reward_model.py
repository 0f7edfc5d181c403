"""Sequence-classification reward models (miles_kernels.reward_model) against transformers' own forward: a random
`Qwen3ForSequenceClassification` / `LlamaForSequenceClassification` saved by transformers scores a batch of
sequences (of different lengths, one ending in the pad token) as transformers' model does, to float32 rounding;
a sequence's score does not depend on its batch; a causal LM is refused as a reward model."""

from __future__ import annotations

import pytest
import torch

from miles_kernels import KernelConfig, load_reward_model
from miles_kernels.testing import random_model, save_random_model, tiny_config

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4)


def save_reward_model(kind: str, path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForSequenceClassification

    hf = random_model(tiny_config(kind), seed=0).config.to_hf(dtype="float32")
    hf["architectures"] = [hf["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    hf |= {"num_labels": 1, "pad_token_id": 3}
    config = AutoConfig.for_model(**hf)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initializes norms to 1 and the head small: spread them out
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)


@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_reward_scores_equal_transformers(kind: str, tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    save_reward_model(kind, tmp_path)
    ours = load_reward_model(tmp_path, KERNEL)
    reference = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(4, 200, (n,), generator=generator).tolist() for n in (9, 5, 14)]
    sequences[1] += [3, 3]  # ends in the pad token: read at the token before it, as transformers does
    got = ours.scores(sequences)
    for seq, score in zip(sequences, got, strict=True):  # transformers one sequence at a time: no padding involved
        with torch.no_grad():
            want = reference(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(score, want, rtol=1e-5, atol=1e-5)
    alone = ours.scores([sequences[2]])
    assert torch.equal(alone[0], got[2])  # batch-invariant


def test_a_causal_lm_is_not_a_reward_model(tmp_path) -> None:
    save_random_model(tmp_path, tiny_config("dense"), seed=0)
    with pytest.raises(ValueError, match="not a sequence-classification reward model"):
        load_reward_model(tmp_path, KERNEL)
