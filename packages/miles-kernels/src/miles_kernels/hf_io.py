"""Hugging Face directory I/O: load a miles `CausalLM` from config.json + safetensors, and save one back.

Loading reads `model.safetensors` or a sharded `model.safetensors.index.json`; every tensor name must match the
model's, with the same shape, or the error names the tensor. Saving writes what `transformers` reloads
(per-expert MoE names as Qwen3-MoE and GLM-4.5 checkpoints store them; a tied `lm_head.weight` is not written;
GLM-4.5's `e_score_correction_bias` in float32 whatever the model dtype).

MTP modules that config.json declares (`num_nextn_predict_layers`) but the checkpoint holds no tensor of are left
out: `transformers` does not model them, so its `save_pretrained` keeps the count and writes none (any GLM-4.5
checkpoint fine-tuned with Hugging Face tooling). Such a directory is read as the trunk alone
(`num_nextn_predict_layers = 0`: no speculative-decoding draft), and the first read says so in the log. A
checkpoint that holds some of an MTP module's tensors and misses others is refused, naming the missing ones.

Quantized checkpoints (config.json's `quantization_config`: DeepSeek-V3's block FP8, compressed-tensors' per-channel
FP8 or group-wise INT4; quantization.py) load into any model: a layer the model stores in the checkpoint's format
takes its parts as they are, any other gets them dequantized (a full-precision trainer loads the dequantized
weights). `load_model(..., weights=...)` stores the trunk's linear layers quantized (the low-precision engine); a
full-precision checkpoint is then quantized as it loads. `save_model` of such a model writes its format's
`quantization_config`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_kernels.config import KernelConfig, WeightQuantConfig
from miles_kernels.lora import is_adapter_name
from miles_kernels.model import DRAFT_PREFIX, CausalLM
from miles_kernels.model_config import ModelConfig
from miles_kernels.quantization import normalized_items, quantize_model, quantized_layers

SINGLE_FILE = "model.safetensors"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_FILE = "model.safetensors.index.json"

logger = logging.getLogger("miles_kernels.hf_io")
_reported_without_mtp: set[Path] = set()  # checkpoints whose absent MTP modules this process has logged


def read_model_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Parse `config.json` of a Hugging Face model directory: the model Miles builds from it. MTP modules that
    config.json declares and the checkpoint holds none of (`num_absent_mtp_layers`) are left out, with one log
    warning per process and directory."""
    directory = Path(model_dir)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a Hugging Face model directory (config.json + safetensors)")
    config = ModelConfig.from_hf(json.loads(path.read_text()))
    absent = _num_absent_mtp_layers(directory, config)
    if not absent:
        return config
    if directory.resolve() not in _reported_without_mtp:
        _reported_without_mtp.add(directory.resolve())
        logger.warning(
            "%s: config.json declares %d MTP layer(s) (num_nextn_predict_layers) but the checkpoint holds none of "
            "their tensors (transformers' save_pretrained does not write them): loading the trunk only, without "
            "MTP modules, so this model has no speculative-decoding draft (to get one: `miles-spec train "
            "--num-mtp-layers %d`, or spec.mode=online in a miles-orchestrator run, which starts them fresh)",
            directory, absent, absent,
        )  # fmt: skip
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def read_quantization(model_dir: str | os.PathLike[str]) -> WeightQuantConfig:
    """The format of a model directory's weights: its config.json's `quantization_config` (none: `kernel`).
    ValueError for a quantization Miles does not read."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return WeightQuantConfig.from_hf(hf.get("quantization_config"))


def num_absent_mtp_layers(model_dir: str | os.PathLike[str]) -> int:
    """How many MTP modules config.json declares that the checkpoint holds no tensor of: all of them
    (`num_nextn_predict_layers`) when no tensor is named `model.layers.{i}.*` for i >= num_hidden_layers, as in a
    directory written by transformers; else 0 (a partly missing module is `load_state`'s error). 0 for a directory
    without safetensors (a trainer checkpoint's config.json)."""
    directory = Path(model_dir)
    return _num_absent_mtp_layers(directory, ModelConfig.from_hf(json.loads((directory / "config.json").read_text())))


def _num_absent_mtp_layers(directory: Path, config: ModelConfig) -> int:
    declared = config.num_nextn_predict_layers
    if not declared or not ((directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file()):
        return 0
    names = tensor_files(directory)
    if all(is_adapter_name(name) for name in names):
        return 0  # a LoRA run's weight update: its adapters, not a checkpoint that lost its MTP modules
    mtp_prefixes = tuple(f"model.layers.{config.num_hidden_layers + i}." for i in range(declared))
    holds_mtp = any(name.startswith(mtp_prefixes) for name in names)
    return 0 if holds_mtp else declared


def checkpoint_tensors(model: CausalLM, mtp_copies: bool = True) -> dict[str, torch.Tensor]:
    """The model's tensors under their HF checkpoint names (tied embeddings once, as HF stores them; each MTP
    module's copies of the embedding and LM head under its own names, as DeepSeek-V3 / GLM-4.5 store them), an
    attached EAGLE-3 draft left out (its own checkpoint: `eagle3_io.save_eagle3`); with `mtp_copies=False`, what weight
    sync sends: every tensor once, the attached draft's included (`eagle3.*`)."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if not mtp_copies:
        for name in model.mtp_copy_names():
            state.pop(name, None)
        return state
    return {name: tensor for name, tensor in state.items() if not name.startswith(DRAFT_PREFIX)}


def tensor_files(model_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Map each tensor name of a model directory to the safetensors file that holds it (FileNotFoundError when the
    directory has no safetensors)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def iter_checkpoint(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a model directory, one file open at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, file in tensor_files(model_dir).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def load_state(
    model: CausalLM, tensors: Mapping[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]],
    source: WeightQuantConfig | None = None,
) -> None:  # fmt: skip
    """Copy HF-named tensors into the model, bit for bit after the dtype cast; errors name bad tensors.

    Missing tensors are an error only when loading a complete checkpoint (a Mapping); an iterator of
    tensors (a bucket stream) may update any subset. `source`: the format of a quantized checkpoint's parts
    (`read_quantization`); a layer the model stores quantized takes a full-precision weight quantized, or stored
    parts of its own format as they are (quantization.normalized_items).
    """
    # GLM-4.5's float32 router bias is a buffer that the checkpoint stores like a weight (sparse_moe.TopkRouter).
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    if quantized_layers(model) or (source is not None and source.is_enabled):
        items = normalized_items(model, items, source)
    copies = model.mtp_copy_names()
    seen = set()
    copied: dict[str, torch.Tensor] = {}  # MTP copies of a trunk tensor, checked against it once all are loaded
    with torch.no_grad():
        for name, tensor in items:
            if name not in params:
                raise ValueError(
                    f"unexpected tensor {name!r}: the {model.config.architecture} model has no such weight"
                )
            target = params[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            # a float weight takes another float dtype's values (a cast); FP8 bytes mean nothing without their scale
            is_castable = all(t.is_floating_point() and t.dtype not in FP8_DTYPES for t in (tensor, target))
            if tensor.dtype != target.dtype and not is_castable:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, the model holds {target.dtype}")
            value = tensor.to(dtype=target.dtype, device=target.device)
            if name in copies and isinstance(tensors, Mapping) and copies[name] in tensors:
                copied[name] = value
                continue
            target.copy_(value)
            seen.add(name)
        for name, value in copied.items():
            if not torch.equal(value, params[name]):
                raise ValueError(
                    f"tensor {name!r} differs from {copies[name]!r}: an MTP module shares the trunk's embedding and "
                    "LM head (DeepSeek-V3 / GLM-4.5), so their checkpoint copies must be equal"
                )
            seen.add(name)
    if isinstance(tensors, Mapping):
        required = set(checkpoint_tensors(model)) - set(copies)  # a checkpoint may leave the MTP copies out
        # A model with LoRA adapters takes a complete base checkpoint or a complete set of adapters (what a LoRA
        # run's weight sync sends; lora.py), or both.
        adapters = {name for name in required if is_adapter_name(name)}
        if adapters:
            required = adapters if adapters & seen else required - adapters
        missing = sorted(required - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def load_model(
    model_dir: str | os.PathLike[str],
    kernel: KernelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    weights: WeightQuantConfig | None = None,
) -> CausalLM:
    """Build a `CausalLM` from a Hugging Face directory, parameters in `dtype` (default: the kernel config's).

    A trainer keeps float32 master weights (`dtype=torch.float32`) and computes in the kernel dtype. `weights`: the
    trunk's linear layers are stored in this low-precision format (quantization.py; the engine). A quantized
    checkpoint loads into either (see the module docstring).
    """
    kernel = kernel or KernelConfig()
    config = read_model_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, kernel)
        if weights is not None and weights.is_enabled:  # the parts replace the weights before any is allocated
            quantize_model(model, weights, from_weights=False)
    model = model.to_empty(device=device).to(dtype or kernel.torch_dtype)
    model.tie_weights()
    load_state(model, dict(iter_checkpoint(model_dir)), read_quantization(model_dir))
    model.eval()
    return model


def save_model(
    model: CausalLM,
    model_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes`) that HF reloads."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf(dtype=model.kernel.dtype)
    formats = [layer.weight_quant for layer in quantized_layers(model).values() if layer.weight_quant is not None]
    if formats:
        config["quantization_config"] = formats[0].to_hf()
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config.get(key) is None and getattr(tokenizer, key, None) is not None:
                config[key] = getattr(tokenizer, key)
        tokenizer.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tensors, written = {}, set()
    for name, t in checkpoint_tensors(model).items():
        tensor = t.contiguous().cpu()
        # safetensors refuses two names on one storage: an MTP module's copy of a trunk tensor is written as a copy
        tensors[name] = tensor.clone() if tensor.data_ptr() in written else tensor
        written.add(tensor.data_ptr())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in (out / SINGLE_FILE, out / INDEX_FILE):
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return out
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
