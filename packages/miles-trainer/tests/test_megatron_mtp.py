"""The online MTP draft on the Megatron backend (docs/megatron.md, "Online MTP draft").

- Conversion (torch only): a model's MTP modules (`model.layers.{L + i}`) to megatron-core's `mtp.layers.{i}` on the
  last stage and back is bit-exact over TP / EP / ETP / PP layouts; the HF checkpoint's copies of the embedding and
  the LM head under an MTP layer are the trunk's tensors, not converted.
- Against megatron-core (CPU numerics, one process): its `MultiTokenPredictionBlock`, built from the HF config, has
  the conversion's names and shapes, and on converted weights gives the miles model's `mtp_hidden` / `mtp_logits`
  (float32: within torch.testing's float32 tolerances with megatron-core's modules in the trunk's right-padded
  (B, S) layout, bit for bit with the Miles layers): two sequences of different lengths, chained modules, GLM-4.5's
  MoE MTP layer with partial RoPE, QK-norm and biases, DeepSeek-V3's MoE MTP layer with MLA.
- Training in real rank processes against FSDP2 (it needs miles-spec's `MTPLoss`): miles-spec's
  tests/test_megatron_mtp_step.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_kernels import KernelConfig, build_packed_batch
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import RankLayout, hf_from_megatron, hf_to_megatron, rank_entries
from miles_trainer.config import MegatronConfig, OptimizerConfig

megatron = pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def mtp_state(config) -> dict[str, torch.Tensor]:
    """A random model's HF tensors, each once: tied LM head and the MTP layers' copies of trunk tensors left out."""
    model = random_model(config, seed=3)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for name in ["lm_head.weight"] * config.tie_word_embeddings + list(model.mtp_copy_names()):
        state.pop(name)
    return state


@pytest.mark.parametrize(
    ("kind", "overrides", "sizes"),
    [("glm", {}, {"tp": 2, "ep": 2}), ("glm", {}, {"etp": 2, "ep": 8, "stages": 3, "impl": "transformer_engine"}),
     ("dense", {"num_nextn_predict_layers": 2, "tie_word_embeddings": False, "vocab_size": 255},
      {"tp": 2, "stages": 2}), ("deepseek", {}, {"tp": 2, "ep": 2, "stages": 3})],
)  # fmt: skip
def test_mtp_modules_convert_bit_exact(kind: str, overrides: dict, sizes: dict) -> None:
    from test_megatron import grid

    config = tiny_config(kind, **{"num_nextn_predict_layers": 1} | overrides)
    state = mtp_state(config)
    layouts = grid(**sizes, layers=config.num_hidden_layers)
    shards = {layout: hf_to_megatron(state.__getitem__, config, layout) for layout in layouts}
    for layout, tensors in shards.items():  # on the last stage only
        assert any(name.startswith("mtp.") for name in tensors) == layout.is_last_stage
    back = dict(hf_from_megatron(config, layouts, lambda layout, name: shards[layout][name]))
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    eh_proj = shards[layouts[-1]]["mtp.layers.0.eh_proj.weight"]  # column-parallel: its output rows split over TP
    assert eh_proj.shape == (config.hidden_size // sizes.get("tp", 1), 2 * config.hidden_size)


@contextlib.contextmanager
def one_rank(path: Path, layout: MegatronConfig) -> Iterator[None]:
    from test_megatron import one_rank_group

    from miles_trainer import megatron_on_cpu
    from miles_trainer.megatron_model import init_parallel

    with one_rank_group(path):
        init_parallel(layout)
        try:
            with megatron_on_cpu():
                yield
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    ("kind", "num_mtp", "layers"),
    [("glm", 1, "megatron"), ("glm", 1, "miles"), ("dense", 2, "megatron"), ("dense", 2, "miles"),
     ("deepseek", 1, "megatron")],
)  # fmt: skip
def test_megatron_mtp_modules_give_the_miles_mtp_outputs(kind: str, num_mtp: int, layers: str, tmp_path) -> None:
    """megatron-core's MTP block beside a GPTModel, both on converted weights, against `CausalLM.mtp_hidden` /
    `mtp_logits` of the miles model (chained modules read the previous output): within float32 rounding with
    megatron-core's modules (each sequence on its own rows), bit for bit with the Miles layers (the packed rows;
    DeepSeek-V3's MLA has no Miles layers)."""
    from miles_trainer.megatron_model import MegatronCausalLM, build_gpt_model, rank_layout
    from miles_trainer.megatron_mtp import MegatronMTP, build_mtp_block

    config = tiny_config(kind, num_nextn_predict_layers=num_mtp, tie_word_embeddings=kind == "glm")
    reference = random_model(config, KERNEL, seed=5)
    layout = MegatronConfig(moe_token_dispatcher="allgather")
    lens = [11, 6]
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, config.vocab_size, (n + num_mtp,), generator=generator) for n in lens]
    with one_rank(tmp_path / "pg", layout):
        state = hf_to_megatron(dict(reference.state_dict()).__getitem__, config, rank_layout(config, layout))
        block = build_mtp_block(config, layout, torch.float32, None)
        expected = {n: t.shape for n, t in block.state_dict().items() if not n.endswith("_extra_state")}
        assert {n.removeprefix("mtp."): t.shape for n, t in state.items() if n.startswith("mtp.")} == expected
        gpt = build_gpt_model(config, layout, kernel=KERNEL if layers == "miles" else None)
        gpt.load_state_dict({n: t for n, t in state.items() if not n.startswith("mtp.")}, strict=False)
        chunk = MegatronCausalLM(gpt, config, KERNEL)
        assert chunk.is_miles == (layers == "miles")
        mtp = MegatronMTP(config, layout, KERNEL, [chunk], state, torch.device("cpu"), (), OptimizerConfig())
        assert chunk.mtp is mtp and len(mtp.mtp_layers) == num_mtp
        batch = build_packed_batch(lens, KERNEL.page_size, KERNEL.attention_query_tile)
        inputs = torch.cat([seq[:n] for seq, n in zip(ids, lens, strict=True)])
        with torch.no_grad():
            padded = chunk.padded_batch(inputs, batch)
            hidden = chunk.hidden_rows(chunk.stage_forward(padded), padded)
            mtp.embedding = mtp.trunk_embedding()
            got = []
            for module in range(num_mtp):
                next_ids = torch.cat([seq[module + 1 : module + 1 + n] for seq, n in zip(ids, lens, strict=True)])
                hidden = mtp.hidden(chunk, padded, hidden, next_ids, batch, module, detach_trunk=True)
                got.append((hidden, chunk.logits(hidden, detach_weight=True)))
    with torch.no_grad():
        hidden = reference.forward_hidden(inputs, batch)
        for module in range(num_mtp):
            next_ids = torch.cat([seq[module + 1 : module + 1 + n] for seq, n in zip(ids, lens, strict=True)])
            hidden = reference.mtp_hidden(hidden, next_ids, batch, module)
            # megatron-core's modules: torch.testing's float32 tolerances (other GEMM kernels, whose rounding
            # differs by CPU); the Miles layers: the same bits
            tol = {"rtol": 0.0, "atol": 0.0} if layers == "miles" else {}
            torch.testing.assert_close(got[module][0], hidden, **tol)
            torch.testing.assert_close(got[module][1], reference.mtp_logits(hidden), **tol)


def test_the_conversion_takes_mtp_modules_on_the_last_stage_only() -> None:
    config = tiny_config("glm", num_nextn_predict_layers=1)
    last = {e.name: e.hf_names for e in rank_entries(config, RankLayout(first_layer=2, num_layers=1,
                                                                        is_first_stage=False))}  # fmt: skip
    first = rank_entries(config, RankLayout(first_layer=0, num_layers=2, is_last_stage=False))
    assert not any(e.name.startswith("mtp.") for e in first)
    assert last["mtp.layers.0.final_layernorm.weight"] == ("model.layers.3.shared_head.norm.weight",)
    assert last["mtp.layers.0.transformer_layer.mlp.router.expert_bias"] == (
        "model.layers.3.mlp.gate.e_score_correction_bias",
    )  # GLM-4.5's MTP layer is an MoE layer, as its layer index says
    hf = {name for names in last.values() for name in names}
    assert "model.layers.3.embed_tokens.weight" not in hf and "model.layers.3.shared_head.head.weight" not in hf
