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
    """The MTP draft: whether it trains online on the rollout data (`MTPLoss` in the policy's train step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "online"] = Field(
        default="off",
        description="'online': train the policy's MTP modules on every rollout batch, in the policy's train step "
        "(the model needs num_nextn_predict_layers >= 1); 'off': leave them as they are. ('frozen' comes with "
        "speculative decoding in the engine.)",
    )
    mtp_loss_coef: float = Field(default=1.0, gt=0, description="Weight of the MTP loss (its own backward).")
    optimizer: OptimizerConfig = Field(
        default_factory=_draft_optimizer,
        description="The draft's own AdamW and clipping (here lr defaults to 1e-4).",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _frozen_not_yet(cls, value: object) -> object:
        if value == "frozen":
            raise ValueError(
                "spec.mode=frozen drafts with an untrained MTP head, which needs speculative decoding in the engine: "
                "not implemented yet; use off or online"
            )
        return value
