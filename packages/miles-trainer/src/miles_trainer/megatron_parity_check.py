"""`miles-trainer convert --check`: whether a Hugging Face directory and a Megatron checkpoint hold the same model
(docs/megatron.md, "HF <-> Megatron conversion").

Two comparisons, each side loaded by its own code:

1. Tensors. The Megatron checkpoint, resharded into one rank's GPTModel by megatron-core's `dist_checkpointing`
   and split into HF tensors (`megatron_checkpoint_io`), against the HF directory's safetensors, name by name, in
   the narrower of the two dtypes (a float32 side is rounded to nearest to compare with a bf16 one, as the
   conversion rounds): every bit must agree, and both sides must hold the same names.
2. Logits. Megatron-core's `GPTModel` on the checkpoint (one rank, float32; CUDA when there is one, else the CPU
   inside `megatron_on_cpu()`) against the miles-kernels model on the HF directory (`load_model`, float32, fast
   kernels), on a few prompts: fixed sentences through the tokenizer where either side has one, else fixed token
   ids. The largest |logit difference| of each prompt is printed and must be at most `atol` (default 1e-4: tiny
   float32 models agree to ~2e-6; a bf16 checkpoint is compared in float32 too, so rounding is not counted).

A disagreement raises `CheckFailed`, naming the first tensor and the first prompt that disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from miles_kernels import KernelConfig, ModelConfig, build_packed_batch, iter_checkpoint, load_model
from miles_trainer.config import MegatronConfig
from miles_trainer.megatron_checkpoint_io import (
    EMBEDDING,
    TOKENIZER_FILES,
    VOCAB_KEYS,
    checkpoint_dir,
    hf_model_config,
    load_megatron_model,
    megatron_hf_tensors,
    megatron_model_config,
    one_rank,
    require_megatron,
)

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return", "12 + 30 = 42, and 7 * 6 =")
PROMPT_LENGTHS = (5, 11, 17)  # fixed token ids where neither side has a tokenizer


class CheckFailed(Exception):
    """The two sides disagree (the message names the first tensor and the first prompt that do)."""


def _narrower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).bits < torch.finfo(b).bits else b


def compare_tensors(megatron: dict[str, torch.Tensor], hf_dir: Path) -> list[tuple[str, float]]:
    """(name, max |difference|) of every HF tensor that differs between the sides (inf: on one side only)."""
    seen: set[str] = set()
    bad: list[tuple[str, float]] = []
    for name, tensor in iter_checkpoint(hf_dir):
        seen.add(name)
        other = megatron.get(name)
        if other is None or other.shape != tensor.shape:
            bad.append((name, float("inf")))
            continue
        dtype = _narrower(tensor.dtype, other.dtype)
        a, b = tensor.to(dtype), other.to(dtype)
        if not torch.equal(a, b):
            bad.append((name, float((a.float() - b.float()).abs().max())))
    bad += [(name, float("inf")) for name in sorted(megatron.keys() - seen)]
    return bad


def prompt_ids(config: ModelConfig, tokenizer_dirs: list[Path]) -> list[list[int]]:
    """The prompts' token ids: `PROMPTS` through the first tokenizer found, else fixed random ids."""
    for directory in tokenizer_dirs:
        if any((directory / name).is_file() for name in TOKENIZER_FILES[:2]):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(directory)
            encoded = [[t for t in tokenizer(text)["input_ids"] if t < config.vocab_size] for text in PROMPTS]
            if all(encoded):
                return encoded
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def megatron_logits(
    megatron: dict[str, torch.Tensor], config: ModelConfig, prompts: list[list[int]], device: torch.device
) -> list[torch.Tensor]:
    """float32 logits (S, V) of each prompt under megatron-core's GPTModel on the checkpoint's tensors (one rank,
    float32). Inside `one_rank()`."""
    from miles_trainer.megatron_model import build_gpt_model

    gpt = build_gpt_model(config, MegatronConfig(moe_token_dispatcher="allgather"), torch.float32)
    rows = gpt.state_dict()[EMBEDDING].shape[0]  # the saved rows may be padded to the writer's TP
    state = {name: (t[:rows] if name in VOCAB_KEYS else t) for name, t in megatron.items()}
    gpt.load_state_dict(state, strict=False)
    gpt = gpt.to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            width = ids.shape[1]
            mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]
            positions = torch.arange(width, device=device)[None]
            logits = gpt(ids, positions, attention_mask=mask)[0, :, : config.vocab_size]
            out.append(logits.float().cpu())
    return out


def hf_logits(hf_dir: Path, prompts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """float32 logits (S, V) of each prompt under the miles-kernels model on the HF directory (float32)."""
    kernel = KernelConfig(mode="fast")
    model = load_model(hf_dir, kernel, device=device, dtype=torch.float32)
    lens = [len(prompt) for prompt in prompts]
    batch = build_packed_batch(lens, kernel.page_size, kernel.attention_query_tile, device)
    ids = torch.tensor([t for prompt in prompts for t in prompt], device=device)
    with torch.no_grad():
        logits = model.logits(model.forward_hidden(ids, batch))
    return [part.cpu() for part in torch.split(logits, lens)]


@dataclasses.dataclass
class CheckReport:
    """What `check_pair` measured: the tensors that differ, each prompt's largest |logit difference|."""

    num_tensors: int
    bad_tensors: list[tuple[str, float]]
    logit_diffs: list[float]
    atol: float

    def failure(self) -> str | None:
        """The message naming the first tensor and the first prompt that disagree; None when both agree."""
        parts = []
        if self.bad_tensors:
            name, diff = self.bad_tensors[0]
            what = "is on one side only (or differs in shape)" if diff == float("inf") else f"max |diff| {diff:.3g}"
            more = f" (and {len(self.bad_tensors) - 1} more)" if len(self.bad_tensors) > 1 else ""
            parts.append(f"tensor {name} differs: {what}{more}")
        over = [i for i, diff in enumerate(self.logit_diffs) if not diff <= self.atol]
        if over:
            diff = self.logit_diffs[over[0]]
            parts.append(f"prompt {over[0]}: max |logit diff| {diff:.3g} > --atol {self.atol:g}")
        return "; ".join(parts) or None


def check_pair(
    hf_dir: Path,
    megatron_dir: Path,
    atol: float = 1e-4,
    hf_config: str | None = None,
    tokenizer: Path | None = None,
    report: Callable[[str], None] = print,
) -> CheckReport:
    """Compare the HF directory `hf_dir` with the Megatron checkpoint `megatron_dir` (tensors, then logits),
    `report`ing each result; raises CheckFailed if they disagree, ValueError if they are not a pair."""
    require_megatron()
    config = hf_model_config(hf_dir)
    other = megatron_model_config(megatron_dir, hf_config)
    differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(other, f.name)]
    if differ:
        shown = ", ".join(f"{n}: {getattr(config, n)} vs {getattr(other, n)}" for n in differ[:4])
        raise ValueError(f"mismatched directories: {hf_dir} and {megatron_dir} describe different models ({shown})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts = prompt_ids(config, [d for d in (tokenizer, hf_dir, checkpoint_dir(megatron_dir)) if d is not None])
    with one_rank():
        megatron = load_megatron_model(megatron_dir, config)
        converted = megatron_hf_tensors(megatron, config)
        bad = compare_tensors(converted, hf_dir)
        report(f"check: {len(converted) - len(bad)} of {len(converted)} tensors equal bit for bit")
        meg_logits = megatron_logits(megatron, config, prompts, device)
    hf = hf_logits(hf_dir, prompts, device)
    diffs = [float((a - b).abs().max()) for a, b in zip(meg_logits, hf, strict=True)]
    for i, (prompt, diff) in enumerate(zip(prompts, diffs, strict=True)):
        report(f"check: prompt {i} ({len(prompt)} tokens): max |logit diff| {diff:.3g} ({device.type}, float32)")
    result = CheckReport(len(converted), bad, diffs, atol)
    message = result.failure()
    if message is not None:
        raise CheckFailed(f"{hf_dir} and {megatron_dir} disagree: {message}")
    report(f"check passed: every tensor equal, logits within --atol {atol:g}")
    return result
