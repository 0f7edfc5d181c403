"""miles-spec's config model, torch-free: `SpecConfig`, the `spec` section of a run config (docs/architecture.md,
"Config")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_trainer.config import OptimizerConfig

__all__ = ["SpecConfig"]


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
