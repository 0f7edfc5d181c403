"""miles-spec's config models, torch-free: `SpecConfig`, the `spec` section of a run config (docs/architecture.md,
"Config"), and `DraftTrainConfig`, the settings of offline draft training (`miles-spec train`'s flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_trainer.config import OptimizerConfig

__all__ = ["DraftTrainConfig", "SpecConfig"]


def _draft_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-4)


class SpecConfig(BaseModel):
    """Speculative decoding with the policy's MTP draft, and whether the draft trains online on the rollout data
    (`MTPLoss` in the policy's train step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "frozen", "online"] = Field(
        default="off",
        description="'off': no speculative decoding, the MTP modules are left as they are; 'frozen': the engine "
        "drafts with the policy's MTP modules as loaded, never trained; 'online': it drafts with them and they "
        "train on every rollout batch, in the policy's train step. frozen and online need a model with MTP "
        "layers (num_nextn_predict_layers >= 1); online starts fresh ones when config.json declares MTP layers the "
        "checkpoint holds no tensor of (saved by transformers), frozen refuses it. off is the default because the "
        "built-in example (64 sequences of ~4-token answers) rolls out fastest without a draft (benchmarks/spec.py); "
        "few sequences with long outputs are where online pays.",
    )
    num_steps: int = Field(
        default=3,
        ge=1,
        le=16,
        description="Draft tokens per decoding step (the engine's speculative_num_steps) when mode is not off.",
    )
    mtp_loss_coef: float = Field(default=1.0, gt=0, description="Weight of the MTP loss (its own backward).")
    optimizer: OptimizerConfig = Field(
        default_factory=_draft_optimizer,
        description="The draft's own AdamW and clipping (here lr defaults to 1e-4).",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads a bare `off` as false (`spec.mode=off` on the command line, `mode: off` in a file)."""
        return "off" if value is False else value

    @property
    def drafts(self) -> bool:
        """The engine decodes speculatively (frozen or online)."""
        return self.mode != "off"


class DraftTrainConfig(BaseModel):
    """Settings of `train_draft` (`miles-spec train`'s flags, generated from this model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    draft: Literal["mtp", "eagle3"] = Field(
        default="mtp",
        description="mtp: the checkpoint's own MTP modules (written back with the trunk); eagle3: an EAGLE-3 draft "
        "(SpecForge's layout, written alone to --out: what --speculative-algorithm EAGLE3 serves).",
    )
    draft_vocab_size: int | None = Field(
        default=None,
        ge=1,
        description="eagle3: the draft's vocabulary, the most frequent trained tokens of the rows (SpecForge's "
        "d2t / t2d); default: the target's whole vocabulary. Ignored with --init-draft (its own).",
    )
    ttt_length: int = Field(
        default=7, ge=1, le=16, description="eagle3: training-time test steps (SpecForge's default 7)."
    )
    init_draft: str | None = Field(
        default=None, description="eagle3: start from this EAGLE-3 draft directory instead of a new one."
    )
    epochs: int = Field(default=1, ge=1, description="Passes over the rows.")
    batch_size: int = Field(default=32, ge=1, description="Rows per optimizer step.")
    lr: float = Field(default=1e-4, gt=0, description="Peak AdamW learning rate (linear warm-up, then cosine).")
    warmup_steps: int = Field(default=10, ge=0, description="Linear warm-up steps of the learning rate.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    mtp_loss_coef: float = Field(default=1.0, gt=0, description="Weight of the draft's loss (MTP or EAGLE-3).")
    num_mtp_layers: int | None = Field(
        default=None,
        ge=1,
        description="Add this many new MTP modules to a checkpoint that has none (default for one whose config.json "
        "declares MTP layers it holds no tensor of, as transformers saves GLM-4.5: that many).",
    )
    seed: int = Field(default=0, description="Row order, and the initialization of a new draft.")
    chat_template: bool = Field(default=False, description="Text prompts go through the chat template.")
