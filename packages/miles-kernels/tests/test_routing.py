"""MoE routing: GLM-4.5's grouped sigmoid router against transformers' `Glm4MoeTopkRouter`, the stated tie rule,
`last_routing` in SGLang's layout, and routing replay (replaying the router's own choice changes no bit; a
different choice changes the output; the gate still gets a gradient; rows without a record route normally)."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from miles_kernels import KernelConfig, build_packed_batch
from miles_kernels.ops.moe import route_grouped_sigmoid, route_softmax
from miles_kernels.testing import random_model, tiny_config

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


@pytest.mark.parametrize(("n_group", "topk_group", "top_k"), [(1, 1, 2), (4, 2, 3), (8, 3, 4)])
def test_grouped_sigmoid_router_matches_transformers(n_group: int, topk_group: int, top_k: int) -> None:
    config = Glm4MoeConfig(hidden_size=16, n_routed_experts=32, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
    router = Glm4MoeTopkRouter(config)
    generator = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(32, generator=generator))
    x = torch.randn(200, 16, generator=generator)
    logits, want_weights, want_ids = router(x)
    got = route_grouped_sigmoid(logits, router.e_score_correction_bias, top_k, n_group, topk_group, True, 2.5,
                                torch.float32)  # fmt: skip
    # transformers' top-k is unsorted: compare as sets, with the weights in the same expert order
    order = torch.argsort(want_ids, dim=-1)
    assert torch.equal(torch.sort(got.expert_ids, dim=-1).values, want_ids.gather(1, order))
    got_order = torch.argsort(got.expert_ids, dim=-1)
    torch.testing.assert_close(got.weights.gather(1, got_order), want_weights.gather(1, order), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.scores, logits.sigmoid(), rtol=0, atol=0)


def test_grouped_routing_breaks_ties_by_lower_expert_and_lower_group() -> None:
    zero_bias = torch.zeros(8)
    # equal scores: lower ids first
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert route_grouped_sigmoid(logits, zero_bias, 2, 1, 1, True, 1.0, torch.float32).expert_ids.tolist() == [[1, 2]]
    # two groups of 4 with equal group scores: the lower group is kept
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0]])
    assert route_grouped_sigmoid(logits, zero_bias, 2, 2, 1, True, 1.0, torch.float32).expert_ids.tolist() == [[0, 1]]
    # the bias steers the choice, never the weights
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0])
    routing = route_grouped_sigmoid(logits, bias, 2, 1, 1, False, 1.0, torch.float32)
    assert routing.expert_ids.tolist() == [[5, 0]]
    torch.testing.assert_close(routing.weights, torch.sigmoid(torch.tensor([[1.0, 2.0]])))


@pytest.mark.parametrize("route", ["softmax", "sigmoid"])
def test_replay_takes_recorded_rows_and_leaves_the_rest(route: str) -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def run(replay=None):
        if route == "softmax":
            return route_softmax(logits, 2, True, torch.float32, replay)
        return route_grouped_sigmoid(logits, torch.zeros(8), 2, 2, 1, True, 2.0, torch.float32, replay)

    own = run()
    same = run(own.expert_ids.clone())
    assert torch.equal(same.expert_ids, own.expert_ids) and torch.equal(same.weights, own.weights)
    replay = torch.tensor([[7, 6], [-1, -1], [0, 5], [3, -1]])
    replayed = run(replay)
    assert replayed.expert_ids[0].tolist() == [7, 6] and replayed.expert_ids[2].tolist() == [0, 5]
    for row in (1, 3):  # no complete record: the router's own choice, same bits
        assert torch.equal(replayed.expert_ids[row], own.expert_ids[row])
        assert torch.equal(replayed.weights[row], own.weights[row])
    assert torch.equal(replayed.router_ids, own.router_ids)  # the router's own choice is kept for metrics
    with pytest.raises(ValueError, match="expert id 8 is out of range"):
        run(torch.full((4, 2), 8))


@pytest.mark.parametrize("kind", ["moe", "glm"])
def test_model_replay_of_its_own_routing_is_bitwise_and_of_another_is_not(kind: str) -> None:
    config = tiny_config(kind)
    model = random_model(config, KERNEL, seed=3)
    generator = torch.Generator().manual_seed(3)
    lengths = [7, 12]
    ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=generator)
    batch = build_packed_batch(lengths, KERNEL.page_size, KERNEL.attention_query_tile)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, batch)
        routing = model.last_routing()
        assert routing is not None and routing.dtype == torch.int32
        assert routing.shape == (len(ids), config.num_hidden_layers, config.num_experts_per_tok)
        dense = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
        assert all(not routing[:, i].any() for i in dense)  # SGLang's layout: dense layers' rows are 0
        assert torch.equal(model.forward_hidden(ids, batch, routing_NLK=routing), hidden)
        shifted = routing.clone()
        moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        shifted[:, moe] = (shifted[:, moe] + 1) % config.num_experts
        other = model.forward_hidden(ids, batch, routing_NLK=shifted)
        assert not torch.equal(other, hidden)
        assert torch.equal(model.last_routing(), shifted)  # the experts that ran are the replayed ones
        with pytest.raises(ValueError, match="replayed routing has shape"):
            model.forward_hidden(ids, batch, routing_NLK=routing[:-1])
    # the router still learns under replay: its gate weights get a gradient through the replayed experts' scores
    model.zero_grad()
    model.logits(model.forward_hidden(ids, batch, routing_NLK=shifted)).logsumexp(-1).sum().backward()
    gate = model.moe_layers()[moe[0]].gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
