"""MoE in the trainer: the engine's recorded routing laid out on packed rows (shared prompts included), routing
replay (replaying the recorded choice of the same weights changes no bit; another choice changes the log-probs and
shows as routing flips), the routing metrics, and the load-balancing losses against independent references
(transformers' Qwen3-MoE `load_balancing_loss_func`, and DeepSeek-V3's sequence-wise formula written out), and the
router z-loss against megatron-core's `z_loss_func`."""

from __future__ import annotations

import base64

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import PolicyLossConfig, accumulate_policy_gradients, pack_samples
from miles_trainer.logprobs import micro_batch_forward
from miles_trainer.moe import balance_loss, decode_routed_experts, moe_shape, z_loss

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def make_samples(vocab: int, seed: int) -> list[Sample]:
    """Two groups of two samples sharing a prompt, and one sample alone."""
    generator = torch.Generator().manual_seed(seed)
    samples: list[Sample] = []
    for i, (num_prompt, num_response) in enumerate([(5, 7), (5, 3), (9, 6), (9, 4), (12, 5)]):
        tokens = torch.randint(0, vocab, (num_prompt + num_response,), generator=generator).tolist()
        prompt = samples[-1].prompt_tokens if i in (1, 3) else tokens[:num_prompt]
        samples.append(Sample(index=i, group_index=i // 2, prompt="", prompt_tokens=prompt,
                              response_tokens=tokens[num_prompt:], rollout_logprobs=[0.0] * num_response))  # fmt: skip
    return samples


def with_engine_routing(model, samples: list[Sample], change=None) -> list[Sample]:
    """Each sample with the routing its own unpacked forward chose (what an engine records), as SGLang's base64;
    `change` edits the (rows, L, K) array first."""
    out = []
    for sample in samples:
        micro = pack_samples([sample], KERNEL, 10_000)[0]
        with torch.no_grad():
            micro_batch_forward(model, micro)
        routing = model.last_routing()[micro.sequence_rows[0]]
        if change is not None:
            routing = change(routing.clone())
        encoded = base64.b64encode(routing.numpy().tobytes()).decode()
        out.append(sample.model_copy(update={"routed_experts": encoded}))
    return out


@pytest.mark.parametrize("kind", ["moe", "glm", "deepseek"])
def test_recorded_routing_lands_on_the_packed_rows(kind: str) -> None:
    model = random_model(tiny_config(kind), KERNEL, seed=1)
    samples = with_engine_routing(model, make_samples(model.config.vocab_size, 1))
    layers = model.config.num_hidden_layers
    assert decode_routed_experts(samples[0], *moe_shape(model)).shape == (samples[0].num_tokens - 1, layers, 2)
    for micro in pack_samples(samples, KERNEL, 10_000, routing_shape=moe_shape(model)):
        with torch.no_grad():
            micro_batch_forward(model, micro)
        # packed with shared prompts, the batch's own routing equals what each sample recorded alone
        assert micro.routing_NLK is not None and torch.equal(micro.routing_NLK, model.last_routing())
    broken = samples[0].model_copy(update={"routed_experts": base64.b64encode(b"\0" * 8).decode()})
    with pytest.raises(ValueError, match=r"sample 0: routed_experts holds 2 int32 values"):
        pack_samples([broken], KERNEL, 10_000, routing_shape=moe_shape(model))
    with pytest.raises(ValueError, match="sample 0 carries no routed experts"):
        pack_samples(
            make_samples(model.config.vocab_size, 1)[:1], KERNEL, 100, routing_shape=(2, 2), require_routing=True
        )


def step(model, samples, config=None, **kwargs):
    model.zero_grad(set_to_none=True)
    stats = accumulate_policy_gradients(model, samples, [1.0, -1.0, 0.5, -0.5, 1.0], KERNEL,
                                        config or PolicyLossConfig(), 10_000, **kwargs).summary()  # fmt: skip
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["moe", "glm", "deepseek"])
def test_replaying_the_recorded_choice_changes_no_bit(kind: str) -> None:
    model = random_model(tiny_config(kind), KERNEL, seed=2).train()
    samples = with_engine_routing(model, make_samples(model.config.vocab_size, 2))
    plain, plain_grads = step(model, samples, measure_mismatch=True)
    replayed, replayed_grads = step(model, samples, measure_mismatch=True, routing_replay=True)
    assert plain["moe_routing_flip_frac"] == 0.0 == replayed["moe_routing_flip_frac"]
    assert plain["loss"] == replayed["loss"]
    assert plain_grads.keys() == replayed_grads.keys()
    assert all(torch.equal(plain_grads[n], replayed_grads[n]) for n in plain_grads)
    last = model.config.num_hidden_layers - 1
    for name in ("moe_load_imbalance", "moe_router_entropy", f"moe_load_imbalance_l{last}"):
        assert name in plain
    assert plain["moe_load_imbalance"] >= 1.0 and 0 < plain["moe_router_entropy"] <= torch.log(torch.tensor(8.0))


def test_replaying_another_choice_moves_the_logprobs_and_counts_flips() -> None:
    model = random_model(tiny_config("moe"), KERNEL, seed=3).train()

    def shift_first_layer(routing):
        routing[:, 0] = (routing[:, 0] + 1) % 8
        return routing

    samples = with_engine_routing(model, make_samples(model.config.vocab_size, 3), shift_first_layer)
    micro = pack_samples(samples, KERNEL, 10_000, routing_shape=moe_shape(model))[0]
    with torch.no_grad():
        own = micro_batch_forward(model, micro)[0]
        replayed = micro_batch_forward(model, micro, replay=True)[0]
    assert not torch.equal(own, replayed)
    stats, _ = step(model, samples)
    # every token's first-layer set differs (shifted by one: a set of 2 of 8 never maps onto itself); layer 1 agrees
    assert stats["moe_routing_flip_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="routing replay needs an MoE policy"):
        step(random_model(tiny_config("dense"), KERNEL, seed=3), samples, routing_replay=True)


def test_aux_loss_is_transformers_load_balancing_loss_over_top_k() -> None:
    """One MoE layer: transformers' Qwen3-MoE loss is K times Megatron's normalization (1.0 when uniform)."""
    config = tiny_config("moe", mlp_only_layers=[0])
    model = random_model(config, KERNEL, seed=4)
    micro = pack_samples(make_samples(config.vocab_size, 4), KERNEL, 10_000)[0]
    gate_logits = []
    hook = model.moe_layers()[1].gate.register_forward_hook(lambda m, i, out: gate_logits.append(out))
    with torch.no_grad():
        micro_batch_forward(model, micro)
    hook.remove()
    ours = balance_loss(model, "aux_loss", micro.sequence_rows)
    reference = load_balancing_loss_func(tuple(gate_logits), config.num_experts, config.num_experts_per_tok)
    torch.testing.assert_close(ours * config.num_experts_per_tok, reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["moe", "glm", "deepseek"])
def test_seq_aux_loss_is_deepseek_v3_formula(kind: str) -> None:
    model = random_model(tiny_config(kind), KERNEL, seed=5)
    micro = pack_samples(make_samples(model.config.vocab_size, 5), KERNEL, 10_000)[0]
    with torch.no_grad():
        micro_batch_forward(model, micro)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    want = 0.0
    for moe in model.moe_layers().values():
        scores, ids = moe.last_routing.scores, moe.last_routing.expert_ids
        per_sample = []
        for rows in micro.sequence_rows:  # DeepSeek-V3 eq. 17-20, one sample (its T tokens) at a time
            s = scores[rows] / scores[rows].sum(-1, keepdim=True)  # normalized affinities (softmax: unchanged)
            f = torch.zeros(experts)
            for token in ids[rows]:
                f[token] += experts / (top_k * len(rows))
            per_sample.append(float((f * s.mean(0)).sum()))
        want += sum(per_sample) / len(per_sample)
    got = balance_loss(model, "seq_aux_loss", micro.sequence_rows)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_aux_loss_trains_the_router_and_is_reported() -> None:
    model = random_model(tiny_config("glm"), KERNEL, seed=6).train()
    samples = make_samples(model.config.vocab_size, 6)
    _, base_grads = step(model, samples)
    config = PolicyLossConfig(moe_aux_loss="seq_aux_loss", moe_aux_loss_coef=0.1)
    stats, grads = step(model, samples, config)
    assert stats["moe_aux_loss"] > 0.5 and stats["moe_aux_loss_term"] == pytest.approx(0.1 * stats["moe_aux_loss"])
    gate = "model.layers.1.mlp.gate.weight"
    assert not torch.equal(grads[gate], base_grads[gate])
    # the loss reads the routers only: the final norm's gradient is the policy loss's alone
    assert torch.equal(grads["model.norm.weight"], base_grads["model.norm.weight"])
    with pytest.raises(ValueError, match="moe_aux_loss=aux_loss needs an MoE policy"):
        step(random_model(tiny_config("dense"), KERNEL, seed=6), samples, PolicyLossConfig(moe_aux_loss="aux_loss"))


def test_an_aborted_sample_without_routing_routes_by_itself() -> None:
    from miles_contracts import SampleStatus

    model = random_model(tiny_config("moe"), KERNEL, seed=7)
    samples = with_engine_routing(model, make_samples(model.config.vocab_size, 7))
    aborted = samples[4].model_copy(update={"routed_experts": None, "status": SampleStatus.ABORTED})
    micro = pack_samples([*samples[:4], aborted], KERNEL, 10_000, routing_shape=moe_shape(model), require_routing=True)
    rows = micro[0].sequence_rows[4]
    assert (micro[0].routing_NLK[rows] == -1).all() and (micro[0].routing_NLK[micro[0].sequence_rows[0]] >= 0).all()


@pytest.mark.parametrize("kind", ["moe", "glm", "deepseek"])
def test_z_loss_is_megatron_cores_z_loss_func_and_trains_the_router(kind: str) -> None:
    """The router z-loss (ST-MoE) against megatron-core's own `z_loss_func` on each MoE layer's router logits (from
    the layer's input and its gate weights); as a step's term it moves the gates and is reported."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils", reason="the megatron extra")
    model = random_model(tiny_config(kind), KERNEL, seed=8).train()
    samples = make_samples(model.config.vocab_size, 8)
    micro = pack_samples(samples, KERNEL, 10_000)[0]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, index=index: inputs.__setitem__(index, args[0]))
             for index, layer in model.moe_layers().items()]  # fmt: skip
    with torch.no_grad():
        micro_batch_forward(model, micro)
    for hook in hooks:
        hook.remove()
    want = sum(float(moe_utils.z_loss_func(inputs[index].float() @ layer.gate.weight.float().t(), 1.0))
               for index, layer in model.moe_layers().items())  # fmt: skip
    assert float(z_loss(model)) == pytest.approx(want, rel=1e-5)
    _, base_grads = step(model, samples)
    stats, grads = step(model, samples, PolicyLossConfig(moe_z_loss_coef=0.01))
    assert stats["moe_z_loss"] == pytest.approx(want, rel=1e-5)  # one micro-batch: the step's whole forward
    assert stats["moe_z_loss_term"] == pytest.approx(0.01 * want, rel=1e-5)
    gate = f"model.layers.{max(model.moe_layers())}.mlp.gate.weight"
    assert not torch.allclose(grads[gate], base_grads[gate], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="moe_z_loss_coef > 0 needs an MoE policy"):
        step(random_model(tiny_config("dense"), KERNEL, seed=8), samples, PolicyLossConfig(moe_z_loss_coef=0.01))
