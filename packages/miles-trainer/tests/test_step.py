"""CPU numerics: gradients of a policy-gradient pass do not depend on the micro-batch split (global
normalization; a group's shared prompt packed once or once per micro-batch), for every aggregation mode; the loss
equals the full-batch formula."""

from __future__ import annotations

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import (
    AGGREGATION_MODES,
    PolicyLossConfig,
    accumulate_policy_gradients,
    count_trained,
    mismatch_weights,
    resolve_loss_fn,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def make_samples(seed: int) -> tuple[list[Sample], list[float]]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    # Groups 0 and 1 have two samples each, with one prompt (5 tokens: a partial page; 8: one whole page).
    for i, (num_prompt, num_response) in enumerate([(5, 7), (5, 3), (8, 9), (8, 8), (20, 2)]):
        tokens = torch.randint(0, 256, (num_prompt + num_response,), generator=generator).tolist()
        if i % 2:
            tokens[:num_prompt] = samples[-1].prompt_tokens
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


@pytest.mark.parametrize("agg_mode", AGGREGATION_MODES)
def test_gradient_is_invariant_to_micro_batch_split(agg_mode: str) -> None:
    """Every aggregation mode through the train step's gradient accumulation (Dr.GRPO's included: L is the
    configured maximum response length, so each micro-batch divides by the same constant)."""
    model = random_model(tiny_config("moe"), KERNEL, seed=1).train()
    samples, advantages = make_samples(1)
    config = PolicyLossConfig(agg_mode=agg_mode, clip_low=0.2, clip_high=0.28, max_response_len=16)
    whole, whole_loss = gradients(model, samples, advantages, config, budget=10_000)
    # [0, 1], [2], [3], [4]: group 1 is cut, its prompt packed twice
    split, split_loss = gradients(model, samples, advantages, config, budget=20)
    assert abs(whole_loss - split_loss) < 1e-6
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-7, msg=name)


def test_dr_grpo_needs_its_constant_length() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=1).train()
    samples, advantages = make_samples(1)
    with pytest.raises(ValueError, match=r"set PolicyLossConfig\.max_response_len"):
        gradients(model, samples, advantages, PolicyLossConfig(agg_mode="seq-mean-token-sum-norm"), budget=10_000)


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


def _response_logprobs(model, samples) -> list[list[float]]:
    from miles_trainer import pack_samples, response_logprobs

    with torch.no_grad():
        rows = [r for micro in pack_samples(samples, KERNEL, 10_000) for r in response_logprobs(model, micro)]
    return [r.tolist() for r in rows]


def test_scalar_advantages_equal_their_per_token_broadcast() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=3).train()
    samples, advantages = make_samples(3)
    per_token = [[a] * len(s.response_tokens) for s, a in zip(samples, advantages, strict=True)]
    scalar, _ = gradients(model, samples, advantages, PolicyLossConfig(), 10_000)
    tokens, _ = gradients(model, samples, per_token, PolicyLossConfig(), 10_000)
    for name in scalar:
        assert torch.equal(scalar[name], tokens[name]), name
    with pytest.raises(ValueError, match="token advantages"):
        accumulate_policy_gradients(model, samples, [[1.0]] * len(samples), KERNEL, PolicyLossConfig(), 100)


def test_activation_checkpointing_keeps_gradients_bitwise() -> None:
    from miles_trainer import apply_activation_checkpointing

    samples, advantages = make_samples(4)
    plain = random_model(tiny_config("moe"), KERNEL, seed=4).train()
    checkpointed = random_model(tiny_config("moe"), KERNEL, seed=4).train()
    apply_activation_checkpointing(checkpointed)
    expected, _ = gradients(plain, samples, advantages, PolicyLossConfig(), 30)
    got, _ = gradients(checkpointed, samples, advantages, PolicyLossConfig(), 30)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_mismatch_is_zero_on_own_logprobs_and_measured_otherwise() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=5).train()
    samples, advantages = make_samples(5)
    samples = [s.model_copy(update={"loss_mask": None}) for s in samples]
    own = _response_logprobs(model, samples)
    on_policy = [s.model_copy(update={"rollout_logprobs": lp}) for s, lp in zip(samples, own, strict=True)]
    stats = accumulate_policy_gradients(
        model, on_policy, advantages, KERNEL, PolicyLossConfig(), 20, measure_mismatch=True
    ).summary()
    assert stats["train_rollout_logprob_abs_diff"] == 0.0 and stats["train_rollout_logprob_abs_diff_max"] == 0.0
    assert stats["ppo_kl"] == 0.0 and stats["clip_fraction"] == 0.0
    # Recomputed old log-probs (fast mode) that differ from the engine's by a known amount.
    shifted = [[v + 0.01 * (k % 3) for k, v in enumerate(lp)] for lp in own]
    stats = accumulate_policy_gradients(
        model, on_policy, advantages, KERNEL, PolicyLossConfig(is_mode="truncate", is_threshold=1.005), 20,
        old_logprobs=shifted, measure_mismatch=True,
    ).summary()  # fmt: skip
    diffs = [abs(a - b) for x, y in zip(shifted, own, strict=True) for a, b in zip(x, y, strict=True)]
    assert stats["train_rollout_logprob_abs_diff"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert stats["train_rollout_logprob_abs_diff_max"] == pytest.approx(max(diffs), rel=1e-4)
    assert 0.0 < stats["is_weight_fraction_modified"] < 1.0  # exp(0.02) > 1.005 is truncated, exp(0) is not


def test_kl_and_entropy_terms_follow_their_formulas() -> None:
    from miles_kernels.testing import packed_logits
    from miles_trainer import entropy_from_logits, kl_estimate

    model = random_model(tiny_config("dense"), KERNEL, seed=6).train()
    samples, advantages = make_samples(6)
    samples = [s.model_copy(update={"loss_mask": None}) for s in samples]
    own = _response_logprobs(model, samples)
    ref = [[v - 0.05 * ((k + i) % 4) for k, v in enumerate(lp)] for i, lp in enumerate(own)]
    config = PolicyLossConfig(kl_coef=0.3, kl_estimator="k3", entropy_coef=0.01)
    stats = accumulate_policy_gradients(model, samples, advantages, KERNEL, config, 20, ref_logprobs=ref).summary()
    logp = torch.tensor([v for lp in own for v in lp])
    ref_t = torch.tensor([v for lp in ref for v in lp])
    assert stats["kl_loss"] == pytest.approx(0.3 * float(kl_estimate(logp, ref_t, "k3").mean()), rel=1e-5)
    with torch.no_grad():  # entropy of the full next-token distribution at each response position
        entropies = []
        for sample in samples:
            (logits,) = packed_logits(model, [torch.tensor(sample.prompt_tokens + sample.response_tokens)])
            entropies.append(entropy_from_logits(logits[len(sample.prompt_tokens) - 1 : sample.num_tokens - 1]))
        entropy = float(torch.cat(entropies).mean())
    assert stats["entropy"] == pytest.approx(entropy, rel=1e-5)
    assert stats["entropy_loss"] == pytest.approx(-0.01 * entropy, rel=1e-5)
    assert stats["loss"] == pytest.approx(stats["pg_loss"] + stats["kl_loss"] + stats["entropy_loss"], rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        accumulate_policy_gradients(model, samples, advantages, KERNEL, config, 20)


def test_kl_ratio_correction_keeps_the_value_and_adds_k3_times_grad_logp() -> None:
    """TRL's use_bias_correction_kl on policy (old = the current log-probs): the ratio is 1, so the KL value is the
    same, but its gradient is d(k3) + k3 * d(logp): checked against the gradients of the two terms separately."""
    model = random_model(tiny_config("dense"), KERNEL, seed=10).train()
    samples, _ = make_samples(10)
    samples = [s.model_copy(update={"loss_mask": None}) for s in samples]
    own = _response_logprobs(model, samples)
    on_policy = [s.model_copy(update={"rollout_logprobs": lp}) for s, lp in zip(samples, own, strict=True)]
    ref = [[v - 0.1 * ((k + i) % 3) for k, v in enumerate(lp)] for i, lp in enumerate(own)]
    zero = [0.0] * len(samples)  # no policy-gradient term: only the KL moves the weights

    def run(config):
        model.zero_grad(set_to_none=True)
        stats = accumulate_policy_gradients(model, on_policy, zero, KERNEL, config, 10_000, ref_logprobs=ref)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats.summary()

    plain, plain_stats = run(PolicyLossConfig(kl_coef=1.0))
    corrected, corrected_stats = run(PolicyLossConfig(kl_coef=1.0, kl_ratio_correction=True))
    assert corrected_stats["kl_loss"] == pytest.approx(plain_stats["kl_loss"], rel=1e-6)
    # k3 * d(logp), token-mean: the gradient of a policy loss whose advantage is -k3 on each token, ratio 1
    k3 = [[float(torch.exp(torch.tensor(r - v)) - (r - v) - 1) for v, r in zip(lp, rf, strict=True)]
          for lp, rf in zip(own, ref, strict=True)]  # fmt: skip
    model.zero_grad(set_to_none=True)
    accumulate_policy_gradients(model, on_policy, [[-x for x in row] for row in k3], KERNEL, PolicyLossConfig(),
                                10_000)  # fmt: skip
    extra = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name in plain:
        torch.testing.assert_close(corrected[name], plain[name] + extra[name], rtol=1e-4, atol=1e-7, msg=name)


def test_custom_loss_plugin_is_loaded_and_checked(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_losses.py").write_text(
        "from miles_trainer import aggregate_loss\n"
        "def reinforce(logprobs, old, advantages, mask, **kw):\n"
        "    loss = aggregate_loss(-advantages * logprobs, mask, kw['agg_mode'],\n"
        "                          global_num_tokens=kw['global_num_tokens'], global_num_seqs=kw['global_num_seqs'])\n"
        "    return loss, {}\n"
        "def wrong(logprobs):\n"
        "    return logprobs\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = random_model(tiny_config("dense"), KERNEL, seed=7).train()
    samples, advantages = make_samples(7)
    custom = PolicyLossConfig(loss_fn="my_losses:reinforce")
    stats = accumulate_policy_gradients(model, samples, advantages, KERNEL, custom, 20).summary()
    expected = 0.0
    for sample, lp, adv in zip(samples, _response_logprobs(model, samples), advantages, strict=True):
        expected += sum(-adv * v * m for v, m in zip(lp, sample.effective_loss_mask(), strict=True))
    num_tokens = sum(sum(s.effective_loss_mask()) for s in samples)
    assert stats["loss"] == pytest.approx(expected / num_tokens, rel=1e-5)
    # The config checks the path's shape (torch-free); the plug-in itself is checked when it is resolved, which
    # the FSDP2 backend does at construction.
    with pytest.raises(TypeError, match="must accept"):
        resolve_loss_fn(PolicyLossConfig(loss_fn="my_losses:wrong").loss_fn)
    with pytest.raises(ValueError, match="no attribute"):
        resolve_loss_fn(PolicyLossConfig(loss_fn="my_losses:missing").loss_fn)
    with pytest.raises(ValueError, match=r"loss_fn\n.*must be a 'package.module:function' plug-in path"):
        PolicyLossConfig(loss_fn="my_losses")
    with pytest.raises(ValueError, match=r"agg_mode\n.*Input should be 'token-mean', 'seq-mean-token-mean'"):
        PolicyLossConfig(agg_mode="mean")


def _shifted_old_logprobs(samples: list[Sample], seed: int) -> list[list[float]]:
    """Recomputed old log-probs that differ from the rollout's by up to ±0.5 (weights in [0.6, 1.65])."""
    generator = torch.Generator().manual_seed(seed)
    return [[v + float(torch.rand(1, generator=generator)) - 0.5 for v in s.rollout_logprobs or []] for s in samples]


def test_mis_rejected_tokens_excluded_train_like_a_loss_mask() -> None:
    """is_rejected=excluded: a token MIS rejects leaves the counts, exactly as if its loss mask were 0 (verl's
    rejection sampling); counted (TRL) keeps it in the token-mean's denominator, so the loss is smaller."""
    model = random_model(tiny_config("dense"), KERNEL, seed=7).train()
    samples, advantages = make_samples(7)
    old = _shifted_old_logprobs(samples, seed=7)
    config = PolicyLossConfig(is_mode="mask", is_threshold=1.3, is_threshold_low=0.8, is_rejected="excluded")
    weights, _ = mismatch_weights(samples, old, config)
    rejected = [[m == 1 and w == 0.0 for m, w in zip(s.effective_loss_mask(), ws, strict=True)]
                for s, ws in zip(samples, weights, strict=True)]  # fmt: skip
    assert 0 < sum(map(sum, rejected)) < sum(len(r) for r in rejected)
    masked = [s.model_copy(update={"loss_mask": [int(m and not r) for m, r in zip(s.effective_loss_mask(), rs,
                                                                                   strict=True)]})
              for s, rs in zip(samples, rejected, strict=True)]  # fmt: skip
    assert count_trained(samples, weights) == count_trained(masked)

    def grads(batch, cfg):
        model.zero_grad(set_to_none=True)
        stats = accumulate_policy_gradients(model, batch, advantages, KERNEL, cfg, 20, old_logprobs=old).summary()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats["loss"]

    excluded, loss_excluded = grads(samples, config)
    as_mask, loss_as_mask = grads(masked, config)
    for name in excluded:
        torch.testing.assert_close(excluded[name], as_mask[name], rtol=1e-5, atol=1e-8, msg=name)
    _, loss_counted = grads(samples, config.model_copy(update={"is_rejected": "counted"}))
    assert loss_excluded == pytest.approx(loss_as_mask, rel=1e-6)
    assert abs(loss_counted) < abs(loss_excluded)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalized_weights_average_one(level: str) -> None:
    samples, _ = make_samples(8)
    old = _shifted_old_logprobs(samples, seed=8)
    config = PolicyLossConfig(is_mode="truncate", is_level=level, is_threshold=50.0, is_batch_normalize=True)
    weights, metrics = mismatch_weights(samples, old, config)
    plain, _ = mismatch_weights(samples, old, config.model_copy(update={"is_batch_normalize": False}))
    masks = [s.effective_loss_mask() for s in samples]
    if level == "token":
        kept = [w for ws, ms in zip(weights, masks, strict=True) for w, m in zip(ws, ms, strict=True) if m]
        assert sum(kept) / len(kept) == pytest.approx(1.0, rel=1e-6)
    else:  # one weight per sequence with a trained token
        per_seq = [next(w for w, m in zip(ws, ms, strict=True) if m) for ws, ms in zip(weights, masks, strict=True)]
        assert sum(per_seq) / len(per_seq) == pytest.approx(1.0, rel=1e-6)
    factor = float(metrics["batch_norm_factor"])
    assert factor != 1.0
    for ws, ps in zip(weights, plain, strict=True):
        assert ws == pytest.approx([p / factor for p in ps], rel=1e-6)


def test_truncation_lower_bound_and_config_checks() -> None:
    """TRL's clip_min: TIS with is_threshold_low raises weights below it to it; a lower bound above the upper
    one is refused by the config."""
    samples, _ = make_samples(9)
    old = _shifted_old_logprobs(samples, seed=9)
    weights, _ = mismatch_weights(samples, old, PolicyLossConfig(is_mode="truncate", is_threshold_low=0.9))
    trained = [w for ws, s in zip(weights, samples, strict=True) for w, m in zip(ws, s.effective_loss_mask(),
                                                                                  strict=True) if m]  # fmt: skip
    assert min(trained) == pytest.approx(0.9) and max(trained) <= 2.0
    with pytest.raises(ValueError, match=r"is_threshold_low=3\.0 is above is_threshold=2\.0"):
        PolicyLossConfig(is_mode="mask", is_threshold_low=3.0)
    with pytest.raises(ValueError, match=r"needs PolicyLossConfig\.is_mode"):
        mismatch_weights(samples, old, PolicyLossConfig())


REDUCE_ON_RANK = """
import json, sys
import torch.distributed as dist
from miles_trainer.step import StepStats

dist.init_process_group("gloo")
rank = dist.get_rank()
stats = StepStats()
stats.add("loss", 1.0 + rank)
if rank == 0:  # measured on rank 0's data only (e.g. routing flips of samples that carry the engine's routing)
    stats.add_mean("moe_routing_flip_frac", 0.25, 8.0)
    stats.add_max("only_here_max", 3.0)
stats.all_reduce()
print(json.dumps(stats.summary()))
dist.destroy_process_group()
"""


def test_step_stats_reduce_keys_that_only_some_ranks_hold(tmp_path) -> None:
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    command = [sys.executable, "-c", REDUCE_ON_RANK]
    ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**env, "RANK": str(r)}) for r in (0, 1)]
    summaries = [json.loads(process.communicate(timeout=120)[0].strip().splitlines()[-1]) for process in ranks]
    assert summaries[0] == summaries[1] == {"loss": 3.0, "moe_routing_flip_frac": 0.25, "only_here_max": 3.0}


def test_padded_rows_equal_torchs_pad_sequence_forward_and_backward() -> None:
    """The loss's (B, T) rows come from one masked scatter (packing.pad_rows); torch's pad_sequence over the per-sample
    split is the reference: the same values, mask and gradient bits, empty rows included."""
    from miles_trainer.packing import pad_rows, padded_lists, padding_slots

    lengths = [3, 0, 5, 1]
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(sum(lengths), generator=generator, requires_grad=True)
    reference = values.detach().clone().requires_grad_()
    padded = pad_rows(values, padding_slots(lengths))
    expected = torch.nn.utils.rnn.pad_sequence(list(torch.split(reference, lengths)), batch_first=True)
    assert padded.shape == (4, 5) and torch.equal(padded, expected)
    grad = torch.randn(padded.shape, generator=generator)
    padded.backward(grad)
    expected.backward(grad)
    assert torch.equal(values.grad, reference.grad)

    mask = torch.tensor([True, False, True, True, True, False, False, True, False])
    expected_mask = torch.nn.utils.rnn.pad_sequence(list(torch.split(mask, lengths)), batch_first=True)
    assert torch.equal(pad_rows(mask, padding_slots(lengths), False), expected_mask)

    rows = [[0.1, -2.5], [], [1e-8, 3.0, 7.25]]  # python floats rounded to float32 as torch.tensor rounds them
    expected_rows = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)
    assert torch.equal(padded_lists(rows, torch.device("cpu")), expected_rows)
