"""CPU numerics: `add_mtp_modules` gives a checkpoint saved by transformers (config.json declares GLM-4.5's MTP layer,
no tensor of it is written) fresh MTP modules. The trunk is the source's, bit for bit (linked, not copied), and
transformers' own forward of the new directory still equals its forward of the source; the new modules are
initialized as documented, from the seed; a checkpoint that already holds MTP modules is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_kernels import KernelConfig, checkpoint_tensors, load_model, num_absent_mtp_layers, read_model_config
from miles_kernels.testing import save_random_model, save_transformers_model, tiny_config
from miles_spec import add_mtp_modules

GLM = tiny_config("glm", num_nextn_predict_layers=1, tie_word_embeddings=False)


def test_a_checkpoint_saved_by_transformers_gets_fresh_mtp_modules(tmp_path) -> None:
    source = save_transformers_model(tmp_path / "hf", GLM, seed=5)
    assert read_model_config(source).num_nextn_predict_layers == 0 and num_absent_mtp_layers(source) == 1
    out = add_mtp_modules(source, tmp_path / "with_mtp", num_layers=1, seed=7)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert (out / "model-trunk.safetensors").resolve() == (source / "model.safetensors").resolve()  # not copied
    model = load_model(out, KernelConfig())
    assert len(model.mtp_layers) == 1 and num_absent_mtp_layers(out) == 0
    trunk = checkpoint_tensors(load_model(source, KernelConfig()))
    for name, tensor in trunk.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    new = load_file(out / "model-mtp.safetensors")
    assert set(new) == {n for n in checkpoint_tensors(model, mtp_copies=False) if n.startswith("model.layers.3.")}
    for name, tensor in new.items():
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and not tensor.any(), name
        elif name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif name.endswith(".bias"):
            assert not tensor.any(), name
        else:
            assert 0.01 < tensor.std() < 0.03, name  # normal(0, initializer_range = 0.02)
    again = add_mtp_modules(source, tmp_path / "again", num_layers=1, seed=7)
    assert all(torch.equal(t, load_file(again / "model-mtp.safetensors")[n]) for n, t in new.items())
    # transformers (which reads the index) sees the same trunk in the new directory
    seq = torch.arange(3, 20)[None]
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()(seq).logits
        after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(seq).logits
    assert torch.equal(before, after)


def test_a_checkpoint_with_mtp_modules_is_refused(tmp_path) -> None:
    source = save_random_model(tmp_path / "src", GLM, seed=1)
    with pytest.raises(ValueError, match="already holds MTP modules"):
        add_mtp_modules(source, tmp_path / "out", num_layers=1)
    assert not (tmp_path / "out").exists()
