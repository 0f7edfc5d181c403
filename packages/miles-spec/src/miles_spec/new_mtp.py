"""New MTP modules for a checkpoint that has none: `add_mtp_modules` writes a checkpoint directory that is the source's
trunk plus freshly initialized MTP modules (DeepSeek-V3 / GLM-4.5 layout, `model.layers.{L + i}`), for the draft to
be trained from scratch: offline by `miles-spec train --num-mtp-layers N`, or online in a run (`spec.mode=online`
on a checkpoint whose config.json declares MTP layers that transformers' `save_pretrained` did not write).

The trunk is not copied: the new directory links every file of the source (absolute symlinks; a single
`model.safetensors` as `model-trunk.safetensors`) and adds the new modules' tensors in `model-mtp.safetensors`, with
a `model.safetensors.index.json` naming both and a config.json that declares the new modules. Initialization
follows transformers' `_init_weights` for these families: norm weights 1, biases (GLM-4.5's router
`e_score_correction_bias` included) 0, every other weight normal(0, initializer_range), drawn in name order from one
seed, so the same call writes the same bits. The embedding and LM head the modules
share with the trunk are the trunk's (not written: `CausalLM.mtp_copy_names`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Literal, cast

__all__ = ["add_mtp_modules", "checkpoint_dtype"]

MTP_FILE = "model-mtp.safetensors"
SINGLE_FILE = "model.safetensors"
TRUNK_FILE = "model-trunk.safetensors"  # a single-file source, linked
INDEX_FILE = "model.safetensors.index.json"
DType = Literal["float32", "bfloat16", "float16"]


def checkpoint_dtype(source: Path) -> DType:
    """The dtype config.json names (`torch_dtype`, or transformers 5's `dtype`; float32 when it names none)."""
    hf = json.loads((source / "config.json").read_text())
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{source}/config.json: dtype {dtype!r} is not one of float32, bfloat16, float16")
    return cast(DType, dtype)


def add_mtp_modules(
    source: str | os.PathLike[str], out: str | os.PathLike[str], num_layers: int, seed: int = 0
) -> Path:
    """Write at `out` (which must not exist; built beside it and renamed into place) the checkpoint `source` with
    `num_layers` new MTP modules in its dtype; returns `out`. `source` must hold no MTP tensor."""
    import torch
    from safetensors.torch import save_file

    from miles_kernels import CausalLM, ModelConfig, num_absent_mtp_layers

    source, out = Path(source).resolve(), Path(out)
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: must be >= 1")
    if out.exists():
        raise ValueError(f"{out} exists: add_mtp_modules writes a new directory")
    hf = json.loads((source / "config.json").read_text())
    declared = ModelConfig.from_hf(hf)
    if declared.num_nextn_predict_layers and not num_absent_mtp_layers(source):
        raise ValueError(f"{source} already holds MTP modules: train them, or start from a checkpoint without any")
    config = dataclasses.replace(declared, num_nextn_predict_layers=num_layers)
    with torch.device("meta"):
        model = CausalLM(config)
    dtype = getattr(torch, checkpoint_dtype(source))
    std = float(hf.get("initializer_range", 0.02))
    shared = model.mtp_copy_names()
    trunk = config.num_hidden_layers
    mtp_prefixes = tuple(f"model.layers.{trunk + i}." for i in range(num_layers))
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in sorted(model.state_dict().items()):
        if not name.startswith(mtp_prefixes) or name in shared:
            continue
        if name.endswith("e_score_correction_bias"):  # a float32 buffer whatever the model dtype (hf_io.save_model)
            tensors[name] = torch.zeros(meta.shape, dtype=torch.float32)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(meta.shape, dtype=dtype)
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(meta.shape, dtype=dtype)
        else:
            tensors[name] = (std * torch.randn(meta.shape, generator=generator)).to(dtype)
    staging = out.with_name(out.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    weight_map = _weight_map(source)
    for entry in source.iterdir():
        if entry.name not in ("config.json", INDEX_FILE, SINGLE_FILE):
            (staging / entry.name).symlink_to(entry.resolve())
    if SINGLE_FILE in weight_map.values():  # renamed: transformers reads a model.safetensors beside an index alone
        (staging / TRUNK_FILE).symlink_to((source / SINGLE_FILE).resolve())
        weight_map = dict.fromkeys(weight_map, TRUNK_FILE)
    save_file(tensors, str(staging / MTP_FILE), metadata={"format": "pt"})
    weight_map |= dict.fromkeys(tensors, MTP_FILE)
    (staging / "config.json").write_text(json.dumps(hf | {"num_nextn_predict_layers": num_layers}, indent=2))
    total = sum(os.path.getsize(staging / file) for file in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
    staging.rename(out)
    return out


def _weight_map(source: Path) -> dict[str, str]:
    """Each tensor of the source checkpoint -> the file that holds it."""
    if (source / INDEX_FILE).is_file():
        weight_map: dict[str, str] = json.loads((source / INDEX_FILE).read_text())["weight_map"]
        return weight_map
    from safetensors import safe_open

    with safe_open(str(source / SINGLE_FILE), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)
