"""Reward models in Hugging Face's sequence-classification format (`Qwen3ForSequenceClassification`,
`Qwen2ForSequenceClassification`, `LlamaForSequenceClassification`, ...; `AutoModelForSequenceClassification`).

Such a checkpoint is a decoder trunk (`model.*`, the layers a `CausalLM` of the same config has) and a `score` head
(`score.weight`, num_labels x hidden, no bias) in place of the LM head; a sequence's scores are the head applied to
the trunk's final-norm hidden state at its last token that is not the pad token (`pad_token_id` in config.json), as
transformers reads them. `RewardModel.scores` runs the trunk on the miles-kernels layers over packed sequences
(`build_packed_batch`, no padding), so a sequence's score does not depend on which others share its batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.hf_io import iter_checkpoint, load_state, read_model_config
from miles_kernels.model import CausalLM
from miles_kernels.ops.attention_batch import build_packed_batch
from miles_kernels.ops.linear import linear

SCORE_WEIGHT = "score.weight"


class RewardModel(nn.Module):
    """A sequence-classification reward model: `trunk` (a `CausalLM`, its LM head tied to the embedding and never
    used) and `score` (num_labels x hidden)."""

    def __init__(self, trunk: CausalLM, num_labels: int, pad_token_id: int | None) -> None:
        super().__init__()
        self.trunk, self.pad_token_id = trunk, pad_token_id
        hidden = trunk.config.hidden_size
        self.score = nn.Parameter(torch.empty(num_labels, hidden, dtype=trunk.model.embed_tokens.weight.dtype))

    @property
    def kernel(self) -> KernelConfig:
        return self.trunk.kernel

    @torch.no_grad()
    def scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """(len(sequences), num_labels) float32 scores, each read at its sequence's last non-pad token."""
        if not sequences or any(not s for s in sequences):
            raise ValueError("score at least one sequence, each of at least one token")
        reads = []
        for seq in sequences:  # transformers' rule: the rightmost token that is not the pad token (else the first)
            last = len(seq) - 1
            while last > 0 and seq[last] == self.pad_token_id:
                last -= 1
            reads.append(last)
        device = self.score.device
        lens = [len(s) for s in sequences]
        batch = build_packed_batch(lens, self.kernel.page_size, self.kernel.attention_query_tile, device=device)
        ids = torch.tensor([t for s in sequences for t in s], device=device)
        hidden = self.trunk.forward_hidden(ids, batch)
        starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)
        rows = starts + torch.tensor(reads, device=device)
        return linear(hidden[rows], self.score, self.kernel).to(torch.float32)


def read_reward_model_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json of a Hugging Face sequence-classification directory; ValueError naming what is wrong
    otherwise (no config.json, or another architecture: a causal LM is a policy)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: give a Hugging Face sequence-classification directory")
    hf: dict[str, Any] = json.loads(path.read_text())
    architectures = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{model_dir}: config.json architectures={architectures}, not a sequence-classification reward model "
            "(e.g. Qwen3ForSequenceClassification: a trunk and a `score` head); a causal LM is a policy, not a "
            "reward model"
        )
    return hf


def load_reward_model(
    model_dir: str | os.PathLike[str], kernel: KernelConfig | None = None, device: torch.device | str = "cpu"
) -> RewardModel:
    """A `RewardModel` from a Hugging Face sequence-classification directory, parameters in the kernel dtype."""
    kernel = kernel or KernelConfig()
    hf = read_reward_model_config(model_dir)
    config = dataclasses.replace(read_model_config(model_dir), tie_word_embeddings=True, num_nextn_predict_layers=0)
    tensors = dict(iter_checkpoint(model_dir))
    if SCORE_WEIGHT not in tensors:
        raise ValueError(f"{model_dir}: the checkpoint has no {SCORE_WEIGHT!r} (the reward head)")
    score = tensors.pop(SCORE_WEIGHT)
    tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = RewardModel(CausalLM(config, kernel), int(score.shape[0]), hf.get("pad_token_id"))
    model = model.to_empty(device=device).to(kernel.torch_dtype)
    model.trunk.tie_weights()
    load_state(model.trunk, tensors)
    with torch.no_grad():
        model.score.copy_(score.to(model.score.dtype))
    return model.eval()
