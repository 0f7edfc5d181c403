"""The EAGLE-3 draft (miles_kernels/eagle3.py) and its loss (miles_spec/eagle3_loss.py): SpecForge's checkpoint
layout round trip, the TTT forward against a transcription of SpecForge's and against the engine's own recursive
drafting, the target and mask rule, and gradient isolation in a real FSDP2 step (the policy's update bitwise the same
with and without training the draft)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference_specforge_eagle3 import ttt_logits
from safetensors.torch import load_file, save_file
from test_mtp_loss import make_samples

from miles_contracts import Sample
from miles_kernels import (
    KernelConfig,
    KVStore,
    build_attention_batch,
    build_packed_batch,
    draft_vocab_from_counts,
    eagle3_hidden,
    load_eagle3,
    new_eagle3,
    save_eagle3,
    save_model,
)
from miles_kernels.testing import random_model, tiny_config
from miles_spec.eagle3_loss import Eagle3Loss, eagle3_targets
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig, accumulate_policy_gradients

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def target_config(kind: str = "dense"):  # type: ignore[no-untyped-def]
    return tiny_config(kind, num_hidden_layers=4)


def test_a_specforge_checkpoint_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    config = target_config()
    counts = torch.zeros(config.vocab_size)
    counts[[5, 9, 200, 3]] = torch.tensor([4.0, 7.0, 1.0, 7.0])
    draft = new_eagle3(config, draft_vocab_size=6, token_counts_V=counts, seed=3)
    # SpecForge's rule: the most frequent tokens (ties by id), then unseen ones by id, kept in id order
    assert draft.target_ids.tolist() == [0, 1, 3, 5, 9, 200] and int(draft.t2d.sum()) == 6
    save_eagle3(draft, tmp_path / "draft")
    hf = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == 6
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # [1, L/2 - 1, L - 4], L = 4
    names = set(load_file(tmp_path / "draft" / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight"} <= names and not any("embed" in n for n in names)  # fmt: skip
    loaded = load_eagle3(tmp_path / "draft", config, dtype=torch.float32)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype, name
    # SpecForge checkpoints written with the target's embedding, or another layout's flags
    tensors = load_file(tmp_path / "draft" / "model.safetensors")
    embed = torch.zeros(config.vocab_size, config.hidden_size)
    save_file({**tensors, "embed_tokens.weight": embed}, tmp_path / "draft" / "model.safetensors")
    load_eagle3(tmp_path / "draft", config)  # ignored: the draft embeds with the target's embedding
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**hf, "fc_norm": True}))
    with pytest.raises(ValueError, match="unsupported EAGLE-3 variant: fc_norm"):
        load_eagle3(tmp_path / "draft", config)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(hf))
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, tmp_path / "draft" / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_eagle3(tmp_path / "draft", config)
    save_file({**tensors, "d2t": torch.zeros(6, dtype=torch.int64)}, tmp_path / "draft" / "model.safetensors")
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        load_eagle3(tmp_path / "draft", config)
    with pytest.raises(ValueError, match="vocab_size 256 differs from the target's 512"):
        load_eagle3(tmp_path / "draft", tiny_config("dense", num_hidden_layers=4, vocab_size=512))
    assert draft_vocab_from_counts(torch.tensor([0.0, 2.0, 1.0]), 2)[0].tolist() == [1, 1]  # ids 1, 2


def test_ttt_forward_matches_specforges_transcription() -> None:
    config = target_config()
    draft = new_eagle3(config, draft_vocab_size=100, token_counts_V=torch.arange(config.vocab_size).float(), seed=1)
    generator = torch.Generator().manual_seed(0)
    lengths = [9, 5]
    features = torch.randn(sum(lengths), 3 * config.hidden_size, generator=generator)
    embedded = torch.randn(3, sum(lengths), config.hidden_size, generator=generator)
    with torch.no_grad():
        ours = draft(features, embedded, lengths)
    weights = {n: t.float() for n, t in draft.state_dict().items()}
    hf = draft.config.to_hf()
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        reference = ttt_logits(weights, hf, features[rows], [embedded[k, rows] for k in range(3)])
        for step, expected in enumerate(reference):
            torch.testing.assert_close(ours[step][rows], expected, rtol=1e-4, atol=1e-5, msg=f"step {step}")
        start += length


def test_ttt_step_k_is_what_the_engine_drafts_k_tokens_ahead() -> None:
    """Teacher-forced: the engine's draft rows (KV store, its recursion on its own outputs) at position t + k are the
    TTT's step-k rows at t, when the engine's drafts are the sequence's own tokens."""
    model = random_model(target_config(), KERNEL, seed=2)
    model.attach_eagle3(new_eagle3(model.config, KERNEL, seed=5))
    tokens = torch.randint(0, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    n, steps = 10, 3  # the TTT over rows 0 .. n - 1
    with torch.no_grad():
        batch = build_packed_batch([n], KERNEL.page_size, KERNEL.attention_query_tile)
        model.forward_hidden(tokens[:n], batch)
        features = model.last_draft_features
        embedded = torch.stack([model.token_embeddings(tokens[1 + k : n + 1 + k]) for k in range(steps)])
        assert model.eagle3 is not None and features is not None
        ttt = model.eagle3(features, embedded, [n])
        for t in (0, 4, 9 - steps):
            store = KVStore.allocate(model.config, 6, KERNEL.page_size, torch.float32, "cpu", num_draft_layers=1)
            pages = [1, 2, 3, 4, 5]
            rows = build_attention_batch([t + 1], [0], [pages], KERNEL.page_size, KERNEL.attention_query_tile)
            out = eagle3_hidden(model, features[: t + 1], tokens[1 : t + 2], rows, True, store)
            last = out[-1:]
            torch.testing.assert_close(model.eagle3.draft_logits(last), ttt[0][t : t + 1], rtol=1e-4, atol=1e-5)
            for k in range(1, steps):
                step = build_attention_batch([1], [t + k], [pages], KERNEL.page_size, KERNEL.attention_query_tile)
                last = eagle3_hidden(model, last, tokens[t + 1 + k : t + 2 + k], step, False, store)
                torch.testing.assert_close(model.eagle3.draft_logits(last), ttt[k][t : t + 1], rtol=1e-4, atol=1e-5)


def test_targets_shift_by_step_and_skip_the_prompt_and_masked_tokens() -> None:
    sample = Sample(index=0, group_index=0, prompt="", prompt_tokens=[10, 11, 12], response_tokens=[13, 14, 15],
                    loss_mask=[1, 0, 1])  # fmt: skip
    inputs, rows, trains = eagle3_targets(sample, 0)  # row p reads T[p+1]; the policy's row p + 1 predicts T[p+2]
    assert inputs == [11, 12, 13, 14, 15] and rows == [1, 2, 3, 4, 0]
    assert trains == [False, True, False, True, False]
    inputs, rows, trains = eagle3_targets(sample, 1)
    assert inputs == [12, 13, 14, 15, 0] and rows == [2, 3, 4, 0, 0]
    assert trains == [True, False, True, False, False]


def expected_loss(model, samples: list[Sample], coef: float, steps: int) -> float:  # type: ignore[no-untyped-def]
    """The formula, each sample alone: its sequence through the trunk, the TTT, the policy's soft labels."""
    draft = model.eagle3
    sums, counts = [0.0] * steps, [0] * steps
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor(s.prompt_tokens + s.response_tokens)
            n = len(tokens) - 1
            batch = build_packed_batch([n], KERNEL.page_size, KERNEL.attention_query_tile)
            hidden = model.forward_hidden(tokens[:n], batch)
            policy = model.logits(hidden)
            per_step = [eagle3_targets(s, k) for k in range(steps)]
            embedded = torch.stack([model.token_embeddings(torch.tensor(x)) for x, _, _ in per_step])
            logits = draft(model.last_draft_features, embedded, [n])
            for k, (_, rows, trains) in enumerate(per_step):
                logq = torch.log_softmax(logits[k], -1)
                for p, (row, train) in enumerate(zip(rows, trains, strict=True)):
                    if not train:
                        continue
                    counts[k] += 1
                    if bool(draft.t2d[policy[row].argmax()]):
                        target = torch.softmax(policy[row][draft.target_ids], -1)
                        sums[k] -= float((target * logq[p]).sum())
    return coef * sum(0.8**k * total / count for k, (total, count) in enumerate(zip(sums, counts, strict=True)))


@pytest.mark.parametrize("budget", [10_000, 20])  # one micro-batch (the group's prompt shared), or several
def test_the_loss_is_the_formula_whatever_the_packing(budget: int) -> None:
    model = random_model(target_config(), KERNEL, seed=3).train()
    counts = torch.zeros(model.config.vocab_size)
    counts[:180] = 1.0  # a reduced vocabulary: rows whose policy argmax is outside it train nothing
    model.attach_eagle3(new_eagle3(model.config, KERNEL, draft_vocab_size=180, token_counts_V=counts, seed=4))
    samples = make_samples(model.config.vocab_size)
    loss = Eagle3Loss(coef=0.3, ttt_length=3)
    stats = accumulate_policy_gradients(model, samples, [0.0] * 3, KERNEL, PolicyLossConfig(), budget,
                                        aux_losses=[loss]).summary()  # fmt: skip
    assert stats["eagle3_loss"] == pytest.approx(expected_loss(model, samples, 0.3, 3), rel=1e-5)
    assert all(0.0 <= stats[f"eagle3_accuracy_{k}"] <= 1.0 for k in range(3))
    trained = loss.parameters(model)
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
    for name, param in model.named_parameters():  # the advantages are 0: only the draft's loss had gradients
        if not name.startswith("eagle3."):
            assert param.grad is None or not param.grad.any(), name


def test_a_model_without_an_eagle3_draft_is_refused() -> None:
    with pytest.raises(ValueError, match="no EAGLE-3 draft attached"):
        Eagle3Loss().parameters(random_model(target_config(), KERNEL))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_policy_update_is_bitwise_the_same_with_and_without_eagle3_training(tmp_path: Path, kind: str) -> None:
    """Gradient isolation in a real FSDP2 step: the policy's weights, grad norm and loss after two steps are the
    same bits with and without the EAGLE-3 loss; the draft moves only when trained, with its own AdamW."""
    from miles_trainer import ensure_process_group

    ensure_process_group()
    model_dir, draft_dir = tmp_path / "model", tmp_path / "draft"
    save_model(random_model(target_config(kind), seed=9), model_dir)
    save_eagle3(new_eagle3(target_config(kind), seed=10), draft_dir)
    samples = make_samples(target_config(kind).vocab_size)
    advantages = [1.0, -1.0, 0.5]

    def two_steps(aux: list[Eagle3Loss], draft: Path | None) -> tuple[dict[str, torch.Tensor], list[dict]]:
        backend = FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-2), PolicyLossConfig(),
                               BackendConfig(max_tokens_per_micro_batch=24), aux_losses=aux,
                               aux_optimizer=OptimizerConfig(lr=5e-2), eagle3_draft=draft)  # fmt: skip
        metrics = [backend.train_step(samples, advantages) for _ in range(2)]
        return {n: p.detach().clone() for n, p in backend.model.named_parameters()}, metrics

    plain, plain_metrics = two_steps([], None)
    frozen, _ = two_steps([], draft_dir)  # attached, not trained (spec.mode=frozen): it stays as loaded
    trained, trained_metrics = two_steps([Eagle3Loss(ttt_length=2)], draft_dir)
    for name, tensor in plain.items():
        assert torch.equal(trained[name], tensor) and torch.equal(frozen[name], tensor), name
    for before, after in zip(plain_metrics, trained_metrics, strict=True):
        assert after["grad_norm"] == before["grad_norm"] and after["loss"] == before["loss"]
        assert after["eagle3_loss"] > 0 and after["aux_grad_norm"] > 0
    initial = load_eagle3(draft_dir, target_config(kind), dtype=torch.float32).state_dict()
    draft_names = [n for n in trained if n.startswith("eagle3.")]
    assert draft_names and all(torch.equal(frozen[n], initial[n.removeprefix("eagle3.")]) for n in draft_names)
    assert any(not torch.equal(trained[n], initial[n.removeprefix("eagle3.")]) for n in draft_names)
