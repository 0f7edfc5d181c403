"""What the memory planner assumes about a run (torch-free): `PlanConfig`, a run config's `memory.plan`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PlanConfig"]


class PlanConfig(BaseModel):
    """The hardware and parallel layout a run is planned for (docs/memory.md, "The planner")."""

    model_config = ConfigDict(extra="forbid")

    hardware: str | None = Field(default=None, description="Hardware profile to plan for (null: the run's device).")
