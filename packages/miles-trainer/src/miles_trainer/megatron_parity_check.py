"""`miles-trainer convert --check`: whether a Hugging Face directory and a Megatron checkpoint hold the same model
(docs/megatron.md, "HF <-> Megatron conversion").

Two comparisons, each side loaded by its own code:

1. Tensors. The Megatron checkpoint, resharded into one rank's GPTModel by megatron-core's `dist_checkpointing`
   and split into HF tensors (`megatron_checkpoint_io`), against the HF directory's safetensors, name by name, in
   the narrower of the two dtypes (a float32 side is rounded to nearest to compare with a bf16 one, as the
   conversion rounds): every bit must agree, and both sides must hold the same names (the MTP layers' HF copies of
   the trunk's embedding and LM head, where the HF side has them, against the trunk's tensors).
2. Logits. Megatron-core's `GPTModel` on the checkpoint (one rank, float32; CUDA when there is one, else the CPU
   inside `megatron_on_cpu()`) against the miles-kernels model on the HF directory (`load_model`, float32, fast
   kernels), on a few prompts: fixed sentences through the tokenizer where either side has one, else fixed token
   ids. With MTP modules, each module's logits too: megatron-core's `MultiTokenPredictionBlock` fed the GPTModel's
   final-norm hidden states and embedding as a GPTModel built with the block feeds it (each module reads the
   previous one's output and the input ids shifted once more, zero-filled at the end), against the miles model's
   `mtp_hidden` / `mtp_logits` on the same ids. The largest |logit difference| of each prompt (and module) is printed
   and must be at most `atol` (default 1e-4: tiny float32 models agree to ~2e-6; a bf16 checkpoint is compared in
   float32 too, so rounding is not counted).

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
    mtp_block,
    mtp_copy_names,
    one_rank,
    require_megatron,
)
from miles_trainer.megatron_convert import MTP_PREFIX

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return", "12 + 30 = 42, and 7 * 6 =")
PROMPT_LENGTHS = (5, 11, 17)  # fixed token ids where neither side has a tokenizer


class CheckFailed(Exception):
    """The two sides disagree (the message names the first tensor and the first prompt that do)."""


def _narrower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).bits < torch.finfo(b).bits else b


def compare_tensors(
    megatron: dict[str, torch.Tensor], hf_dir: Path, copies: dict[str, str] | None = None
) -> tuple[int, list[tuple[str, float]]]:
    """How many HF tensors were compared, and (name, max |difference|) of each that differs between the sides (inf:
    on one side only). `copies`: the MTP layers' copies of trunk tensors (`mtp_copy_names`), which the HF side may
    hold and the Megatron side holds as the trunk's."""
    copies = copies or {}
    seen: set[str] = set()
    bad: list[tuple[str, float]] = []
    for name, tensor in iter_checkpoint(hf_dir):
        seen.add(name)
        other = megatron.get(copies.get(name, name))
        if other is None or other.shape != tensor.shape:
            bad.append((name, float("inf")))
            continue
        dtype = _narrower(tensor.dtype, other.dtype)
        a, b = tensor.to(dtype), other.to(dtype)
        if not torch.equal(a, b):
            bad.append((name, float((a.float() - b.float()).abs().max())))
    bad += [(name, float("inf")) for name in sorted(megatron.keys() - seen)]
    return len(seen | megatron.keys()), bad


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
) -> list[list[torch.Tensor]]:
    """float32 logits (S, V) of each prompt under megatron-core's GPTModel on the checkpoint's tensors (one rank,
    float32), then under each of its MTP modules (see the module docstring). Inside `one_rank()`."""
    from miles_trainer.megatron_model import build_gpt_model, rope_table

    layout = MegatronConfig(moe_token_dispatcher="allgather")
    gpt = build_gpt_model(config, layout, torch.float32)
    rows = gpt.state_dict()[EMBEDDING].shape[0]  # the saved rows may be padded to the writer's TP
    state = {name: (t[:rows] if name in VOCAB_KEYS else t) for name, t in megatron.items()}
    gpt.load_state_dict({name: t for name, t in state.items() if not name.startswith(MTP_PREFIX)}, strict=False)
    gpt = gpt.to(device).eval()
    num_mtp = config.num_nextn_predict_layers
    block = mtp_block(config, layout, torch.float32, None, state).to(device).eval() if num_mtp else None
    hidden: list[torch.Tensor] = []  # the decoder's output (S, 1, H), final norm applied: what the block reads
    if block is not None:
        gpt.decoder.register_forward_hook(lambda _module, _args, output: hidden.append(output))
    head = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            width = ids.shape[1]
            mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]
            positions = torch.arange(width, device=device)[None]
            logits = [gpt(ids, positions, attention_mask=mask)[0]]
            if block is not None:  # as GPTModel._postprocess runs its own block: [trunk; module 0; ...] along S
                states = block(
                    input_ids=ids,
                    position_ids=positions,
                    hidden_states=hidden.pop(),
                    attention_mask=mask,
                    rotary_pos_emb=rope_table(gpt, width),
                    embedding=gpt.embedding,
                )
                logits += [gpt.output_layer(part, weight=head)[0][:, 0] for part in states.chunk(1 + num_mtp)[1:]]
            out.append([part[:, : config.vocab_size].float().cpu() for part in logits])
    return out


def hf_logits(hf_dir: Path, prompts: list[list[int]], device: torch.device) -> list[list[torch.Tensor]]:
    """float32 logits (S, V) of each prompt under the miles-kernels model on the HF directory (float32), then under
    each of its MTP modules (module i reads the ids shifted i + 1 places, zero-filled, as megatron-core's block)."""
    kernel = KernelConfig(mode="fast")
    model = load_model(hf_dir, kernel, device=device, dtype=torch.float32)
    lens = [len(prompt) for prompt in prompts]
    batch = build_packed_batch(lens, kernel.page_size, kernel.attention_query_tile, device)
    ids = torch.tensor([t for prompt in prompts for t in prompt], device=device)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, batch)
        logits = [model.logits(hidden)]
        for module in range(len(model.mtp_layers)):
            shifted = [prompt[module + 1 :] + [0] * min(module + 1, len(prompt)) for prompt in prompts]
            next_ids = torch.tensor([t for prompt in shifted for t in prompt], device=device)
            hidden = model.mtp_hidden(hidden, next_ids, batch, module)
            logits.append(model.mtp_logits(hidden))
    return [[part.cpu() for part in parts] for parts in zip(*(torch.split(x, lens) for x in logits), strict=True)]


@dataclasses.dataclass
class CheckReport:
    """What `check_pair` measured: the tensors that differ, each prompt's largest |logit difference| (and each MTP
    module's on it: `mtp_logit_diffs[prompt][module]`)."""

    num_tensors: int
    bad_tensors: list[tuple[str, float]]
    logit_diffs: list[float]
    atol: float
    mtp_logit_diffs: list[list[float]] = dataclasses.field(default_factory=list)

    def failure(self) -> str | None:
        """The message naming the first tensor and the first prompt that disagree; None when both agree."""
        parts = []
        if self.bad_tensors:
            name, diff = self.bad_tensors[0]
            what = "is on one side only (or differs in shape)" if diff == float("inf") else f"max |diff| {diff:.3g}"
            more = f" (and {len(self.bad_tensors) - 1} more)" if len(self.bad_tensors) > 1 else ""
            parts.append(f"tensor {name} differs: {what}{more}")
        trunk = [(f"prompt {i}", diff) for i, diff in enumerate(self.logit_diffs)]
        mtp = [(f"prompt {i}, MTP module {m}", diff) for i, diffs in enumerate(self.mtp_logit_diffs)
               for m, diff in enumerate(diffs)]  # fmt: skip
        for rows in (trunk, mtp):  # the first of each that disagrees (a wrong trunk makes its MTP modules wrong)
            over = [(where, diff) for where, diff in rows if not diff <= self.atol]
            if over:
                parts.append(f"{over[0][0]}: max |logit diff| {over[0][1]:.3g} > --atol {self.atol:g}")
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
        num_tensors, bad = compare_tensors(converted, hf_dir, mtp_copy_names(config))
        report(f"check: {num_tensors - len(bad)} of {num_tensors} tensors equal bit for bit")
        meg_logits = megatron_logits(megatron, config, prompts, device)
    hf = hf_logits(hf_dir, prompts, device)
    diffs = [
        [float((a - b).abs().max()) for a, b in zip(m, h, strict=True)] for m, h in zip(meg_logits, hf, strict=True)
    ]
    for i, (prompt, (diff, *mtp)) in enumerate(zip(prompts, diffs, strict=True)):
        report(f"check: prompt {i} ({len(prompt)} tokens): max |logit diff| {diff:.3g} ({device.type}, float32)")
        for module, mtp_diff in enumerate(mtp):
            report(f"check: prompt {i}, MTP module {module}: max |logit diff| {mtp_diff:.3g}")
    result = CheckReport(num_tensors, bad, [d[0] for d in diffs], atol, [d[1:] for d in diffs])
    message = result.failure()
    if message is not None:
        raise CheckFailed(f"{hf_dir} and {megatron_dir} disagree: {message}")
    modules = " (the MTP modules' too)" if config.num_nextn_predict_layers else ""
    report(f"check passed: every tensor equal, logits{modules} within --atol {atol:g}")
    return result
