"""MoE on the Megatron backend (miles_trainer/megatron_moe.py): CPU numerics on one rank, and multi-process steps
(gloo rank processes) against the FSDP2 backend's.

- Replay (one rank, megatron-core's own GPTModel inside `megatron_on_cpu()`): told to replay a forced expert choice,
  the routers record it and the experts run it, and the hidden states are the miles model's under the same replay
  (the miles model's replay is checked in test_moe.py and miles-kernels' test_routing.py); a row without a record
  keeps the router's choice. The router weights' gradient, with a load-balancing and a z loss attached at the
  routers, is the miles model's (the replayed experts' scores carry it): also under megatron's full recompute, whose
  backward re-runs two queued micro-batches in the order they ran.
- A step (rank processes; fsdp_worker.py / megatron_worker.py with MILES_TEST_MOE): routing replay of recorded
  experts that are mostly not the router's own, a load-balancing loss (aux_loss for Qwen3-MoE on PP 2 x EP 2 with
  the alltoall dispatcher, seq_aux_loss for GLM-4.5 on EP 2) and the router z-loss, against the FSDP2 step on the
  same two data-parallel shares (the MoE terms and metrics are per micro-batch: both sides pack the same ones): the
  losses, the routing metrics and the gradient norm to 1e-6, the parameters after the step to 5e-5 (the MoE models'
  tolerance in test_megatron.py), the log-probs (replayed) to the miles model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer.config import MegatronConfig

megatron = pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_worker.py")


def forced_routing(num_rows: int, config, shift: int) -> torch.Tensor:
    """(N, L, K) experts e, e + 3 (e = row + shift, modulo E) in every layer; the last row records none (-1)."""
    experts = torch.arange(num_rows) + shift
    pair = torch.stack([experts, experts + 3], dim=-1) % config.num_experts
    out = pair[:, None].expand(num_rows, config.num_hidden_layers, 2).to(torch.int32).clone()
    out[-1] = -1
    return out


def sorted_ids(ids: torch.Tensor) -> torch.Tensor:
    return torch.sort(ids.to(torch.int64), dim=-1).values


@pytest.mark.parametrize(("kind", "recompute", "aux_loss"), [("moe", "none", "aux_loss"),
                                                             ("glm", "full", "seq_aux_loss")])  # fmt: skip
def test_megatron_routers_replay_forced_experts_and_train_as_the_miles_model(
    kind: str, recompute: str, aux_loss: str, tmp_path, monkeypatch
) -> None:
    import megatron.core.tensor_parallel.random as megatron_random
    from fsdp_worker import KERNEL
    from test_megatron import one_rank_group

    from miles_trainer import hf_to_megatron, megatron_on_cpu, pack_samples
    from miles_trainer.megatron_model import MegatronCausalLM, build_gpt_model, init_parallel, rank_layout
    from miles_trainer.megatron_moe import MoEPass, routed, router_index
    from miles_trainer.moe import balance_loss, z_loss

    # megatron's recompute saves and restores the CUDA RNG state, which a CPU does not have (nothing here draws)
    monkeypatch.setattr(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    monkeypatch.setattr(megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    config = tiny_config(kind)
    reference = random_model(config, KERNEL, seed=5).train()
    generator = torch.Generator().manual_seed(0)
    micros = []
    for lengths in ([5, 9], [7, 4, 6]):  # two micro-batches of right-padded rows
        samples = [Sample(index=i, group_index=0, prompt="", response_tokens=[1, 2, 3], rollout_logprobs=[0.0] * 3,
                          prompt_tokens=torch.randint(0, 256, (n,), generator=generator).tolist())
                   for i, n in enumerate(lengths)]  # fmt: skip
        micros.append(pack_samples(samples, KERNEL, 100, share_prompts=False)[0])
    forced = [forced_routing(len(micro.input_ids_N), config, shift) for shift, micro in enumerate(micros)]
    layout = MegatronConfig(moe_token_dispatcher="allgather", recompute=recompute)
    with one_rank_group(tmp_path / "pg"):
        init_parallel(layout)
        with megatron_on_cpu():
            gpt = build_gpt_model(config, layout)
            state = hf_to_megatron(reference.state_dict().__getitem__, config, rank_layout(config, layout))
            gpt.load_state_dict(state, strict=False)
            model = MegatronCausalLM(gpt.train(), config, KERNEL)
            routers = model.moe_layers()
            assert sorted(routers) == [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
            rows_in: dict[tuple[int, int], int] = {}  # (layer, expert) -> the token rows its MLP ran on
            for index in routers:
                for expert, mlp in enumerate(gpt.decoder.layers[index].mlp.experts.local_experts):
                    mlp.register_forward_hook(lambda m, args, out, key=(index, expert): rows_in.__setitem__(
                        key, rows_in.get(key, 0) + args[0].shape[0]))  # fmt: skip
            micro = micros[0]
            with torch.no_grad():
                hidden = model.forward_hidden(micro.input_ids_N, micro.batch, routing_NLK=forced[0])
                want = reference.forward_hidden(micro.input_ids_N, micro.batch, routing_NLK=forced[0])
                own = reference.forward_hidden(micro.input_ids_N, micro.batch)
            torch.testing.assert_close(hidden, want, rtol=0, atol=1e-5)
            assert float((hidden - own).abs().max()) > 0.1  # the replay changes the forward
            for index, record in routers.items():
                routing = record.last_routing
                assert torch.equal(sorted_ids(routing.expert_ids[:-1]), sorted_ids(forced[0][:-1, index]))
                assert torch.equal(routing.expert_ids[-1], routing.router_ids[-1])  # no record: the router's choice
                flips = (sorted_ids(routing.router_ids[:-1]) != sorted_ids(forced[0][:-1, index])).any(dim=-1)
                assert float(flips.float().mean()) > 0.5  # the forced experts are mostly not the router's
                for expert in range(config.num_experts):  # padding rows add the router's choices on top
                    assert rows_in[(index, expert)] >= int((forced[0][:-1, index] == expert).sum()), (index, expert)
            # two training passes, their backwards after both forwards (with recompute: re-run in that order)
            hidden_states = []
            for micro, routing_NLK in zip(micros, forced, strict=True):
                padded = model.padded_batch(micro.input_ids_N, micro.batch)
                moe_pass = MoEPass(router_index(padded), routing_NLK, micro.sequence_rows, aux_loss, 1.0, 0.5)
                with routed(routers, moe_pass):
                    hidden_states.append(model.hidden_rows(model.stage_forward(padded), padded))
            for hidden in hidden_states:
                hidden.square().sum().backward()
            assert all(not record.queued for record in routers.values())
    for micro, routing_NLK in zip(micros, forced, strict=True):
        hidden = reference.forward_hidden(micro.input_ids_N, micro.batch, routing_NLK=routing_NLK)
        loss = hidden.square().sum() + balance_loss(reference, aux_loss, micro.sequence_rows) + 0.5 * z_loss(reference)
        loss.backward()
    for index in routers:
        got = gpt.decoder.layers[index].mlp.router.weight.grad
        want = reference.model.layers[index].mlp.gate.weight.grad
        assert float(want.abs().max()) > 0.1
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=f"layer {index}")


@pytest.mark.parametrize(
    ("kind", "world", "layout", "aux_loss"),
    [("moe", 4, {"pp": 2, "ep": 2, "moe_token_dispatcher": "alltoall"}, "aux_loss"),
     ("glm", 2, {"ep": 2}, "seq_aux_loss"), ("glm", 2, {"ep": 2, "layer_spec": "miles"}, "seq_aux_loss")],
    ids=["moe-pp2-ep2", "glm-ep2", "glm-ep2-miles"],
)  # fmt: skip
def test_a_megatron_moe_step_matches_the_fsdp2_step(kind: str, world: int, layout: dict, aux_loss: str, tmp_path):
    from fsdp_worker import KERNEL, batch, recorded_experts
    from test_fsdp import run_ranks

    from miles_kernels import load_model
    from miles_trainer import pack_samples, response_logprobs
    from miles_trainer.moe import moe_shape

    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config(kind), seed=4), model_dir)
    moe = {"routing_replay": True, "moe_aux_loss": aux_loss, "moe_aux_loss_coef": 0.1, "moe_z_loss_coef": 0.01}
    env = {"MILES_TEST_MOE": json.dumps(moe)}
    fsdp_params, fsdp_metrics = run_ranks(model_dir, tmp_path / "fsdp", world=2, extra_env=env)
    params, metrics = run_ranks(model_dir, tmp_path / "megatron", world=world, worker=WORKER,
                                extra_env=env | {"MILES_TEST_MEGATRON": json.dumps(layout)})  # fmt: skip
    names = {name for name in fsdp_metrics if name.startswith("moe_")}
    assert {name for name in metrics if name.startswith("moe_")} == names
    assert {"moe_aux_loss", "moe_z_loss", "moe_routing_flip_frac", "moe_load_imbalance_l1"} <= names
    for name in ("loss", "pg_loss", "entropy", "num_tokens", *sorted(names)):
        assert metrics[name] == pytest.approx(fsdp_metrics[name], rel=1e-6, abs=1e-7), name
    assert metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=1e-6)
    assert metrics["moe_routing_flip_frac"] > 0.5  # the recorded experts are mostly not the router's: replay shows
    assert params.keys() == fsdp_params.keys()
    for name, tensor in fsdp_params.items():
        torch.testing.assert_close(params[name], tensor, rtol=0, atol=5e-5, msg=name)
    # the log-probs before the step (replayed): the miles model's on the same weights and recorded experts
    model = load_model(model_dir, KERNEL)
    samples = recorded_experts(batch()[0], model.config)
    micro_batches = pack_samples(samples, KERNEL, 24, routing_shape=moe_shape(model))
    expected = [row for micro in micro_batches for row in response_logprobs(model, micro, replay=True)]
    logprobs = json.loads((tmp_path / "megatron" / "logprobs.json").read_text())
    exact = layout.get("layer_spec") == "miles"  # the Miles layers run the miles model's bits, replay included
    for got, want in zip(logprobs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=0 if exact else 1e-5)
