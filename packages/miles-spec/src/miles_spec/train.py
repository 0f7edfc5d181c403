"""Offline draft training (`miles-spec train`): train or refresh a checkpoint's MTP modules on a JSONL of rows, the
policy's own weights frozen (docs/architecture.md, "Speculative decoding").

The rows are what `miles_trainer.load_sft_samples` reads: token ids (Miles' `prompt_tokens` / `response_tokens`,
or slime's `tokens` / `response_length`, optional `loss_mask`), or text (`prompt` / `response`, chat `messages`).
The draft trains with `MTPLoss` through `run_sft(train_policy=False)`: the trunk runs without autograd, its weights
are written back as loaded (bit for bit), only the MTP modules move. A checkpoint without MTP modules gets
`num_mtp_layers` new ones, initialized from their own seed (DeepSeek-V3's layout: `model.layers.{L + i}`;
`add_mtp_modules`); one whose config.json declares MTP modules it holds no tensor of (written by transformers, whose
`save_pretrained` drops them) gets that many new ones unless `num_mtp_layers` says otherwise.

`draft="eagle3"` trains an EAGLE-3 draft instead (`Eagle3Loss`, SpecForge's TTT on the checkpoint's own features
and soft labels): a new one (its vocabulary the `draft_vocab_size` most frequent trained tokens of the rows, as
SpecForge's `generate_vocab_mapping_file` picks them) or `init_draft`, and only the draft is written to `out`, in
SpecForge's layout.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from miles_spec.config import DraftTrainConfig
from miles_spec.eagle3_loss import Eagle3Loss
from miles_spec.mtp_loss import MTPLoss
from miles_spec.new_mtp import add_mtp_modules, checkpoint_dtype

__all__ = ["DraftTrainConfig", "train_draft"]


def train_draft(
    model_dir: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    config: DraftTrainConfig | None = None,
    log: Any = print,
) -> list[dict[str, float]]:
    """Train the MTP modules of the Hugging Face checkpoint `model_dir` on `data` and write the checkpoint, trunk
    unchanged, to `out`. Returns one metrics dict per epoch (`mtp_loss`, `mtp_accuracy_{i}`, ...)."""
    from miles_kernels import KernelConfig, num_absent_mtp_layers, read_model_config
    from miles_trainer import run_sft

    config = config or DraftTrainConfig()
    source = Path(model_dir)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face checkpoint at {source} (no config.json): pass --model a directory with config.json, "
            "safetensors weights and a tokenizer"
        )
    model_config = read_model_config(source)  # a model of another family is refused here, by name
    if config.draft == "eagle3":
        return _train_eagle3(source, data, out, config, log)
    has_mtp = model_config.num_nextn_predict_layers > 0
    if has_mtp and config.num_mtp_layers not in (None, model_config.num_nextn_predict_layers):
        raise ValueError(
            f"{source} already has {model_config.num_nextn_predict_layers} MTP module(s); --num-mtp-layers="
            f"{config.num_mtp_layers} would change them: drop the flag to refresh the existing ones"
        )
    num_new = config.num_mtp_layers or num_absent_mtp_layers(source)  # declared in config.json, not in the weights
    if not has_mtp and not num_new:
        raise ValueError(
            f"{source} has no MTP modules (num_nextn_predict_layers = 0 in config.json): add --num-mtp-layers 1 to "
            "train a new one"
        )
    optimizer, sft = _training(config)
    kernel = KernelConfig(dtype=checkpoint_dtype(source))  # the checkpoint's own dtype: the trunk goes back as is
    with tempfile.TemporaryDirectory(prefix="miles-spec-") as staging:
        start = source if has_mtp else add_mtp_modules(source, Path(staging) / "model", num_new, config.seed)
        return run_sft(start, data, out, sft, kernel=kernel, log=log,
                       aux_losses=[MTPLoss(config.mtp_loss_coef)], aux_optimizer=optimizer,
                       train_policy=False)  # fmt: skip


def _training(config: DraftTrainConfig) -> tuple[Any, Any]:
    """The draft's AdamW (warm-up, then cosine) and the SFT loop's settings."""
    from miles_trainer import OptimizerConfig, SFTConfig

    optimizer = OptimizerConfig(lr=config.lr, warmup_steps=config.warmup_steps, schedule="cosine",
                                max_grad_norm=config.max_grad_norm)  # fmt: skip
    sft = SFTConfig(epochs=config.epochs, batch_size=config.batch_size, seed=config.seed,
                    chat_template=config.chat_template, optimizer=optimizer)  # fmt: skip
    return optimizer, sft


def _train_eagle3(
    source: Path, data: str | os.PathLike[str], out: str | os.PathLike[str], config: DraftTrainConfig, log: Any
) -> list[dict[str, float]]:
    import torch
    from transformers import AutoTokenizer

    from miles_kernels import KernelConfig, load_eagle3, new_eagle3, read_model_config, save_eagle3
    from miles_trainer import load_sft_samples, run_sft

    if config.num_mtp_layers is not None:
        raise ValueError("--num-mtp-layers adds MTP modules; an EAGLE-3 draft (--draft eagle3) has none: drop it")
    target = read_model_config(source)
    kernel = KernelConfig(dtype=checkpoint_dtype(source))
    if config.init_draft is not None:
        draft = load_eagle3(config.init_draft, target, kernel, dtype=torch.float32)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        samples = load_sft_samples(data, tokenizer, config.chat_template, target.vocab_size)
        counts = torch.zeros(target.vocab_size)
        for sample in samples:  # the tokens the draft learns to predict: response tokens with loss mask 1
            kept = [t for t, m in zip(sample.response_tokens, sample.effective_loss_mask(), strict=True) if m]
            counts += torch.bincount(torch.tensor(kept, dtype=torch.int64), minlength=target.vocab_size)
        draft = new_eagle3(target, kernel, config.draft_vocab_size, counts, config.seed)
    optimizer, sft = _training(config)
    with tempfile.TemporaryDirectory(prefix="miles-spec-") as staging:
        start = save_eagle3(draft, Path(staging) / "draft")
        return run_sft(source, data, out, sft, kernel=kernel, log=log,
                       aux_losses=[Eagle3Loss(config.mtp_loss_coef, config.ttt_length)], aux_optimizer=optimizer,
                       train_policy=False, eagle3_draft=start)  # fmt: skip
