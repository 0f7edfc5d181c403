"""miles-spec's config models, torch-free: `SpecConfig`, the `spec` section of a run config (docs/architecture.md,
"Config"), and `DraftTrainConfig`, the settings of offline draft training (`miles-spec train`'s flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_trainer.config import OptimizerConfig

__all__ = ["DraftTrainConfig", "SpecConfig"]


def _draft_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-4)


EAGLE3_DRAFT_DIR = "eagle3_draft"  # a fresh EAGLE-3 draft of spec.draft=eagle3, in the run directory


class SpecConfig(BaseModel):
    """Speculative decoding with the policy's MTP draft or an EAGLE-3 draft, and whether the draft trains online on
    the rollout data (`MTPLoss` / `Eagle3Loss` in the policy's train step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "frozen", "online"] = Field(
        default="off",
        description="'off': no speculative decoding, the drafts are left as they are; 'frozen': the engine drafts "
        "with spec.draft as loaded, never trained; 'online': it drafts with it and the draft trains on every rollout "
        "batch, in the policy's train step. With spec.draft=mtp, frozen and online need a model with MTP layers "
        "(num_nextn_predict_layers >= 1); online starts fresh ones when config.json declares MTP layers the "
        "checkpoint holds no tensor of (saved by transformers), frozen refuses it. off is the default because the "
        "built-in example (64 sequences of ~4-token answers) rolls out fastest without a draft (benchmarks/spec.py); "
        "few sequences with long outputs are where online pays.",
    )
    draft: Literal["mtp", "eagle3"] = Field(
        default="mtp",
        description="mtp: the policy's own MTP modules (SGLang's NEXTN); eagle3: an EAGLE-3 draft (SGLang's EAGLE3, "
        "SpecForge's layout) fed the policy's own features: spec.draft_path, or for mode=online without one a fresh "
        "draft in RUN_DIR/eagle3_draft over the whole vocabulary, trained from scratch on the rollouts.",
    )
    draft_path: str | None = Field(
        default=None,
        description="eagle3: the EAGLE-3 draft to start from (miles-spec train --draft eagle3 writes one; SpecForge "
        "checkpoints load as they are); needed by mode=frozen.",
    )
    ttt_length: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="eagle3, mode=online: training-time test steps of the draft's loss; null: num_steps (the "
        "drafts the engine runs per step).",
    )
    num_steps: int = Field(
        default=3,
        ge=1,
        le=16,
        description="Draft tokens per decoding step (the engine's speculative_num_steps) when mode is not off.",
    )
    eagle_topk: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Draft branches per level (the engine's speculative_eagle_topk): 1, a chain of num_steps drafts; "
        "k > 1, a draft tree (each level the k best paths propose their k likeliest tokens), verified with tree "
        "attention; MTP and EAGLE-3 alike.",
    )
    num_draft_tokens: int | None = Field(
        default=None,
        ge=2,
        description="Tokens one verify step checks, the last sampled one included (the engine's "
        "speculative_num_draft_tokens): with eagle_topk 1, num_steps + 1; with k > 1 the tree's size, at most "
        "1 + k + (num_steps - 1) k^2; null: 1 + num_steps x eagle_topk.",
    )
    mtp_loss_coef: float = Field(
        default=1.0, gt=0, description="Weight of the draft's loss, MTP or EAGLE-3 (its own backward)."
    )
    optimizer: OptimizerConfig = Field(
        default_factory=_draft_optimizer,
        description="The draft's own AdamW and clipping (here lr defaults to 1e-4).",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads a bare `off` as false (`spec.mode=off` on the command line, `mode: off` in a file)."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _eagle3_draft(self) -> SpecConfig:
        if self.draft != "eagle3" and (self.draft_path is not None or self.ttt_length is not None):
            given = "draft_path" if self.draft_path is not None else "ttt_length"
            raise ValueError(f"spec.{given} is the EAGLE-3 draft's: set spec.draft=eagle3, or drop it")
        most = 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if self.num_draft_tokens is not None and self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"spec.num_draft_tokens={self.num_draft_tokens} with spec.eagle_topk=1: a chain verifies num_steps "
                f"+ 1 = {self.num_steps + 1} tokens; set that, leave it unset, or draw a tree (spec.eagle_topk > 1)"
            )
        if self.num_draft_tokens is not None and self.num_draft_tokens > most:
            raise ValueError(
                f"spec.num_draft_tokens={self.num_draft_tokens}: a tree of {self.num_steps} levels with "
                f"spec.eagle_topk={self.eagle_topk} has at most {most} tokens"
            )
        if self.draft == "eagle3" and self.mode == "frozen" and self.draft_path is None:
            raise ValueError(
                "spec.mode=frozen drafts with the EAGLE-3 draft as loaded: set spec.draft_path (miles-spec train "
                "--draft eagle3 writes one), or use spec.mode=online (a fresh draft, trained on the rollouts)"
            )
        return self

    @property
    def drafts(self) -> bool:
        """The engine decodes speculatively (frozen or online)."""
        return self.mode != "off"

    @property
    def eagle3_steps(self) -> int:
        """TTT steps of the EAGLE-3 draft's online loss."""
        return self.ttt_length or self.num_steps


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
