"""CPU tier (one process, torch only): a GLM-4.5 checkpoint saved by transformers (its config.json declares an MTP
layer, no tensor of it is written) through the trainer's loaders. `miles-trainer convert`'s two directions keep its
trunk bit for bit and write no MTP module; the Megatron conversion, which refuses MTP modules, takes it as the trunk
it is, bit-exact both ways."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from miles_kernels import read_model_config
from miles_kernels.testing import save_transformers_model, tiny_config
from miles_trainer import RankLayout, dcp_to_hf, hf_from_megatron, hf_to_dcp, hf_to_megatron

GLM = tiny_config("glm", num_nextn_predict_layers=1, tie_word_embeddings=False)


def test_convert_keeps_the_trunk_of_a_checkpoint_saved_by_transformers(tmp_path) -> None:
    source = save_transformers_model(tmp_path / "hf", GLM, seed=2)
    saved = load_file(source / "model.safetensors")
    back = dcp_to_hf(hf_to_dcp(source, tmp_path / "ckpt"), tmp_path / "back")
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 0
    converted = load_file(back / "model.safetensors")
    assert converted.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(converted[name], tensor), name


def test_the_megatron_conversion_takes_a_checkpoint_saved_by_transformers(tmp_path) -> None:
    source = save_transformers_model(tmp_path / "hf", GLM, seed=2)
    saved = load_file(source / "model.safetensors")
    config = read_model_config(source)
    layouts = [RankLayout(tp_size=2, tp_rank=rank) for rank in range(2)]
    shards = {layout: hf_to_megatron(saved.__getitem__, config, layout) for layout in layouts}
    back = dict(hf_from_megatron(config, layouts, lambda layout, name: shards[layout][name]))
    assert back.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name
