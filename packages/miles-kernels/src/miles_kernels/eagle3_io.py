"""EAGLE-3 drafts on disk, in SpecForge's layout (`LlamaForCausalLMEagle3`; eagle3.py has the model): reading and
writing a checkpoint (`load_eagle3`, `save_eagle3`; no embedding, the target's is used), its vocabulary maps
(`d2t`, `t2d`: SpecForge's `generate_vocab_mapping_file` rule in `draft_vocab_from_counts`), and a new draft for a
target (`new_eagle3`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_kernels.config import KernelConfig
from miles_kernels.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Draft
from miles_kernels.model_config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# tensors of a SpecForge checkpoint that Miles reads no value from: the draft embeds with the target's embedding
_IGNORED = ("embed_tokens.weight",)


def init_eagle3(draft: Eagle3Draft, seed: int = 0, std: float = 0.02) -> Eagle3Draft:
    """Fill a new draft's weights reproducibly (Hugging Face's Llama init: normal(0, std) matrices, unit norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
    return draft


def draft_vocab_from_counts(counts_V: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the `draft_vocab_size` most frequent tokens (SpecForge's `generate_vocab_mapping_file`: ties
    and unseen tokens by id), kept in id order."""
    vocab = counts_V.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be between 1 and the vocabulary's {vocab}")
    order = sorted(range(vocab), key=lambda i: (-int(counts_V[i]), i))
    kept = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def set_draft_vocab(draft: Eagle3Draft, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    ids = d2t.to(torch.int64) + torch.arange(d2t.shape[0])
    vocab = draft.config.layer.vocab_size
    if d2t.shape != draft.d2t.shape or t2d.shape != draft.t2d.shape:
        raise ValueError(
            f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit a draft vocabulary of "
            f"{draft.config.draft_vocab_size} over {vocab} tokens"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
        raise ValueError("d2t and t2d disagree: draft token i must be target token i + d2t[i], and t2d marks those")
    with torch.no_grad():
        draft.d2t.copy_(d2t.to(draft.d2t.device))
        draft.t2d.copy_(t2d.to(draft.t2d.device))


def new_eagle3(
    target: ModelConfig,
    kernel: KernelConfig | None = None,
    draft_vocab_size: int | None = None,
    token_counts_V: torch.Tensor | None = None,
    seed: int = 0,
    aux_layers: Sequence[int] | None = None,
) -> Eagle3Draft:
    """A new, randomly initialized draft for `target` (float32): the full vocabulary, or the `draft_vocab_size`
    most frequent tokens of `token_counts_V` (by id without counts)."""
    config = Eagle3Config.for_target(target, draft_vocab_size, aux_layers)
    draft = init_eagle3(Eagle3Draft(config, kernel).to(torch.float32), seed)
    counts = token_counts_V if token_counts_V is not None else torch.zeros(target.vocab_size)
    set_draft_vocab(draft, *draft_vocab_from_counts(counts, config.draft_vocab_size))
    return draft


def is_eagle3_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds an EAGLE-3 draft's config.json."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    return EAGLE3_ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])


def read_eagle3_config(path: str | os.PathLike[str], target: ModelConfig) -> Eagle3Config:
    """A SpecForge-format draft's config, checked against `target` (ValueError naming what does not fit;
    FileNotFoundError without one); no tensor is read."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"no EAGLE-3 draft at {Path(path)}: {CONFIG_FILE} is missing")
    return Eagle3Config.from_hf(json.loads(config.read_text()), target)


def load_eagle3(
    path: str | os.PathLike[str],
    target: ModelConfig,
    kernel: KernelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Draft:
    """Read a SpecForge-format draft for `target` (ValueError naming what does not fit; FileNotFoundError without
    one). Parameters in `dtype` (default: the kernel's), the vocabulary maps as stored."""
    directory = Path(path)
    kernel = kernel or KernelConfig()
    config = read_eagle3_config(directory, target)
    with torch.device("meta"):
        draft = Eagle3Draft(config, kernel)
    draft = draft.to_empty(device=device).to(dtype or kernel.torch_dtype)
    load_eagle3_state(draft, dict(_read_tensors(directory)), complete=True)
    return draft.eval()


def load_eagle3_state(draft: Eagle3Draft, tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Copy SpecForge-named tensors into the draft (cast to its dtype); `complete`: every tensor must be there."""
    own = dict(draft.named_parameters()) | dict(draft.named_buffers())
    seen = set()
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in _IGNORED:
                continue
            if name not in own:
                raise ValueError(
                    f"unexpected tensor {name!r}: an EAGLE-3 draft ({EAGLE3_ARCHITECTURE}) has no such weight"
                )
            target = own[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the draft expects {tuple(target.shape)}"
                )
            if name in ("d2t", "t2d"):
                continue  # checked together below
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
            seen.add(name)
        if "d2t" in tensors or "t2d" in tensors:
            d2t = tensors["d2t"] if "d2t" in tensors else draft.d2t.cpu()
            t2d = tensors["t2d"] if "t2d" in tensors else draft.t2d.cpu()
            set_draft_vocab(draft, d2t.to(torch.int64).cpu(), t2d.to(torch.bool).cpu())
            seen |= {"d2t", "t2d"} & set(tensors)
    missing = sorted(set(own) - seen)
    if complete and missing:
        raise ValueError(f"the EAGLE-3 draft checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in the EAGLE-3 draft directory {directory}")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[name] = f.get_tensor(name)
    return out


def eagle3_tensors(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under SpecForge's names (what `save_eagle3` writes)."""
    return {name: t.detach() for name, t in draft.state_dict().items()}


def save_eagle3(draft: Eagle3Draft, path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """Write the draft as SpecForge does (config.json + model.safetensors, no embedding), loadable by SGLang's
    EAGLE3 and by `load_eagle3`; weights in `dtype` (default: as held)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in eagle3_tensors(draft).items():
        cast = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        tensors[name] = cast.contiguous().cpu()
    weight_dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    (out / CONFIG_FILE).write_text(json.dumps(draft.config.to_hf(str(weight_dtype).removeprefix("torch.")),
                                              indent=2, sort_keys=True))  # fmt: skip
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


__all__ = [
    "draft_vocab_from_counts",
    "eagle3_tensors",
    "init_eagle3",
    "is_eagle3_dir",
    "load_eagle3",
    "load_eagle3_state",
    "new_eagle3",
    "read_eagle3_config",
    "save_eagle3",
    "set_draft_vocab",
]
