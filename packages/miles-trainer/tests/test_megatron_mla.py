"""DeepSeek-V3's multi-head latent attention (MLA) on the Megatron backend: megatron-core's `MLASelfAttention`
(docs/megatron.md, "DeepSeek-V3: MLA").

- Conversion (torch only): HF -> Megatron shards of every rank -> HF is bit-exact for tiny DeepSeek-V3 models with a
  q-LoRA and with a plain q_proj (and rotary halves, `rope_interleave=false`, which the conversion permutes), on one
  rank and on TP 2 x EP 2 x 3 pipeline stages, with the MTP module, under both layer-norm namings; what megatron-core's
  MLA computes differently is refused by name. `miles-trainer convert` writes and reads megatron-core's
  dist_checkpointing of a bf16 model with an MTP layer bit for bit, and its `--check` passes.
- Against megatron-core (CPU numerics, one process inside `megatron_on_cpu()`): a GPTModel built from the HF config
  has exactly the conversion's names and shapes, and on converted weights gives the miles model's logits (float32,
  to 2e-6) past YaRN's original context, for each way the YaRN mscales combine (the miles model is checked against
  transformers in miles-kernels' test_deepseek.py). The MTP module: test_megatron_mtp.py.
- The Miles layers (kernel.mode=deterministic) have no MLA: the backend refuses to build them for deepseek_v3.
- A step in real rank processes (gloo, megatron_worker.py): 2 pipeline stages (1 + 2 layers) x EP 2 on four ranks,
  with selective recompute (MLA's core attention), against the FSDP2 backend's step (fsdp_worker.py): loss, entropy
  and gradient norm to 1e-6 relative, parameters after the step to 5e-5 (the MoE tolerance of test_megatron.py; here
  within 6e-6), the log-probs before it to the miles model's to 1e-5 (here within 1e-6).
- Not here: TP for deepseek_v3 in a run (an MoE model needs sequence parallelism, hence Transformer Engine, for
  tp > 1), and Transformer Engine's MLA names against a real TE model (no machine here has TE): the conversion only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import RankLayout, hf_from_megatron, hf_to_megatron, rank_entries
from miles_trainer.config import BackendConfig, MegatronConfig

megatron = pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_worker.py")
PLAIN_Q = {"q_lora_rank": None, "rope_interleave": False}  # q_proj, rotary halves (transformers' other layout)


@pytest.mark.parametrize("overrides", [{}, PLAIN_Q], ids=["q-lora", "plain-q"])
@pytest.mark.parametrize(
    "sizes", [{}, {"tp": 2, "ep": 2, "stages": 3}, {"tp": 2, "impl": "transformer_engine"}],
    ids=["one-rank", "tp2-ep2-pp3", "tp2-te"],
)  # fmt: skip
def test_deepseek_converts_bit_exact(overrides: dict, sizes: dict) -> None:
    from test_megatron import grid
    from test_megatron_mtp import mtp_state

    config = tiny_config("deepseek", num_nextn_predict_layers=1, **overrides)
    state = mtp_state(config)
    layouts = grid(**sizes, layers=config.num_hidden_layers)
    shards = {layout: hf_to_megatron(state.__getitem__, config, layout) for layout in layouts}
    back = dict(hf_from_megatron(config, layouts, lambda layout, name: shards[layout][name]))
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    tp = sizes.get("tp", 1)
    te = sizes.get("impl") == "transformer_engine"
    first = shards[layouts[0]]
    attn = "decoder.layers.0.self_attention"
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    # the kv down projection: column-parallel in the local spec, replicated in Transformer Engine's
    assert first[f"{attn}.linear_kv_down_proj.weight"].shape[0] == (latent if te else latent // tp)
    assert first[f"{attn}.linear_kv_up_proj.weight"].shape[0] == (
        config.num_attention_heads // tp * (config.qk_nope_head_dim + config.v_head_dim)
    )  # heads split over TP
    norm = f"{attn}.linear_kv_up_proj.layer_norm_weight" if te else f"{attn}.kv_layernorm.weight"
    assert norm in first and "decoder.layers.0.input_layernorm.weight" in first  # TE's MLA keeps it apart
    if not config.rope_interleave:  # the rotary rows are permuted: not the HF tensor's
        assert not torch.equal(first[f"{attn}.linear_q_proj.weight"],
                               state["model.layers.0.self_attn.q_proj.weight"].chunk(tp)[0])  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"attention_bias": True}, "no biases on its down projections"),
     ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
     ({"norm_topk_prob": False}, "norm_topk_prob=false"),
     ({"num_attention_heads": 6, "num_key_value_heads": 6}, "must divide num_attention_heads=6"),
     ({"q_lora_rank": 25}, "must divide q_lora_rank=25")],
)  # fmt: skip
def test_what_megatron_mla_computes_differently_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rank_entries(tiny_config("deepseek", **overrides), RankLayout(tp_size=4))


def test_miles_trainer_convert_round_trips_deepseek_and_its_check_passes(tmp_path) -> None:
    """`miles-trainer convert` (one rank, in this process): a bf16 DeepSeek-V3 with an MTP layer to megatron-core's
    dist_checkpointing and back returns its tensors bit for bit, and `--check` (tensors, trunk and MTP logits of
    megatron-core's MLA against the miles model's) passes both ways."""
    from test_megatron_convert_cli import assert_same_tensors, convert

    from miles_kernels.testing import save_random_model

    hf, converted, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    save_random_model(hf, tiny_config("deepseek", num_nextn_predict_layers=1), seed=3, dtype="bfloat16")
    assert convert("--src", hf, "--dst", converted, "--to", "megatron", "--check") == 0
    assert convert("--src", converted, "--dst", back, "--check") == 0
    assert_same_tensors(back, hf)
    saved = megatron.dist_checkpointing.load_tensors_metadata(str(converted))
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight" in saved


# the YaRN mscales (transformers: cos / sin times mscale / mscale_all_dim when both are given, else
# yarn_mscale(factor); the softmax scale times yarn_mscale(factor, mscale_all_dim)^2), and no scaling at all
ROPE_VARIANTS = {
    "both-mscales": {"rope_mscale": 1.0, "rope_mscale_all_dim": 0.707},
    "mscale-only": {"rope_mscale": 0.9, "rope_mscale_all_dim": 0.0},
    "plain-q-all-dim-only": PLAIN_Q | {"rope_mscale": 0.0, "rope_mscale_all_dim": 0.8},
    "no-scaling": {"rope_type": "default", "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0},
}


@pytest.mark.parametrize("overrides", [{}, *ROPE_VARIANTS.values()], ids=["deepseek", *ROPE_VARIANTS])
def test_megatron_mla_has_the_conversion_names_and_the_miles_logits(overrides: dict, tmp_path) -> None:
    """megatron-core's GPTModel with MLA, built on the CPU from the HF config, against the conversion and the miles
    model, on 40 positions (YaRN's original context is 32)."""
    from test_megatron import one_rank_group

    from miles_kernels.testing.paged_runner import packed_logits
    from miles_trainer import megatron_on_cpu
    from miles_trainer.megatron_model import build_gpt_model, init_parallel, rank_layout

    config = tiny_config("deepseek", **overrides)
    reference = random_model(config, seed=5)
    layout_config = MegatronConfig(moe_token_dispatcher="allgather")
    width = 40
    ids = torch.randint(0, config.vocab_size, (2, width), generator=torch.Generator().manual_seed(0))
    with one_rank_group(tmp_path / "pg"):
        init_parallel(layout_config)
        with megatron_on_cpu():
            gpt = build_gpt_model(config, layout_config)
            expected = {n: t.shape for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
            converted = hf_to_megatron(reference.state_dict().__getitem__, config, rank_layout(config, layout_config))
            assert {n: t.shape for n, t in converted.items()} == expected
            gpt.load_state_dict(converted, strict=False)
            mask = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                logits = gpt(ids, torch.arange(width).expand(2, width), attention_mask=mask)[..., : config.vocab_size]
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    for row, want in zip(logits, packed_logits(reference, list(ids)), strict=True):
        torch.testing.assert_close(row, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("mode", "layer_spec"), [("deterministic", "auto"), ("fast", "miles")])
def test_the_miles_layers_are_refused_for_mla(mode: str, layer_spec: str, tmp_path) -> None:
    """kernel.mode=deterministic builds the Miles layers, which have no MLA: the backend refuses at build time (the
    run config checks the layout before the model's config.json is read)."""
    from test_megatron import one_rank_group

    from miles_trainer import MegatronBackend

    save_model(random_model(tiny_config("deepseek")), tmp_path / "model")
    config = BackendConfig(name="megatron", megatron=MegatronConfig(layer_spec=layer_spec))
    refusal = r"the Miles layers have no MLA yet .* use trainer\.backend\.name=fsdp2"
    with one_rank_group(tmp_path / "pg"), pytest.raises(ValueError, match=refusal):
        MegatronBackend(tmp_path / "model", KernelConfig(mode=mode), config=config)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def test_a_megatron_mla_step_matches_the_fsdp2_step(tmp_path) -> None:
    """PP 2 (the dense first layer, then the two MoE layers) x EP 2 on four ranks (DP 2; the alltoall dispatcher;
    selective recompute) against FSDP2 on one rank: the same samples and step."""
    from fsdp_worker import KERNEL, batch
    from test_fsdp import run_ranks

    from miles_kernels import load_model
    from miles_trainer import pack_samples, response_logprobs

    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("deepseek"), seed=4), model_dir)
    fsdp_params, fsdp_metrics = run_ranks(model_dir, tmp_path / "fsdp", world=1)
    layout = {
        "pp": 2,
        "decoder_first_pipeline_num_layers": 1,
        "ep": 2,
        "moe_token_dispatcher": "alltoall",
        "recompute": "selective",
    }
    params, metrics = run_ranks(model_dir, tmp_path / "megatron", world=4, worker=WORKER,
                                extra_env={"MILES_TEST_MEGATRON": json.dumps(layout)})  # fmt: skip
    for key in ("loss", "pg_loss", "entropy", "ppo_kl", "clip_fraction", "num_tokens"):
        assert metrics[key] == pytest.approx(fsdp_metrics[key], rel=1e-6, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=1e-6)
    assert metrics["checksum_matches"] == 1.0
    assert metrics["rank_layers"] == [1, 1, 2, 2]  # ranks 0, 1: the first stage; 2, 3: the last
    assert params.keys() == fsdp_params.keys()
    for name, tensor in fsdp_params.items():
        torch.testing.assert_close(params[name], tensor, rtol=0, atol=5e-5, msg=name)
    samples, _ = batch()
    model = load_model(model_dir, KERNEL)
    expected = [row for micro in pack_samples(samples, KERNEL, 24) for row in response_logprobs(model, micro)]
    logprobs = json.loads((tmp_path / "megatron" / "logprobs.json").read_text())
    for got, want in zip(logprobs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-5)
