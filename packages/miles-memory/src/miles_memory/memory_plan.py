"""The memory planner's answer (torch-free): `MemoryPlan`, bytes per GPU by tag and phase, the verdict and the lever,
rendered as a rich table or JSON (docs/memory-planner.md, "Reading a plan")."""

from __future__ import annotations

import io
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Component", "Lever", "MemoryPlan"]

GIB = 2**30
PLAN_TAGS = ("weights", "grads", "optimizer", "activations", "kv_cache", "mtp", "comm", "runtime")


class Component(BaseModel):
    """One term of the plan: bytes per GPU (or per node, for phase 'host') held during a phase."""

    model_config = ConfigDict(extra="forbid")

    tag: str = Field(description="One of weights, grads, optimizer, activations, kv_cache, mtp, comm, runtime.")
    phase: str = Field(description="train, rollout, or host (host memory per node).")
    name: str = Field(description="What holds the bytes.")
    bytes: int = Field(description="Bytes per GPU (host: per node).")
    formula: str = Field(default="", description="How the bytes are computed (docs/memory-planner.md).")


class Lever(BaseModel):
    """A change of the config and the plan it gives."""

    model_config = ConfigDict(extra="forbid")

    change: str = Field(description="The change, e.g. 'ep 8 -> 16'.")
    peak_bytes: int = Field(description="Peak bytes per GPU with the change.")
    fits: bool = Field(description="Whether the changed config fits.")


class MemoryPlan(BaseModel):
    """Per-GPU memory of one run config on one hardware profile."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The model and where its shape came from.")
    hardware: str = Field(description="Hardware profile key.")
    nodes: int = Field(description="Nodes planned.")
    num_gpus: int = Field(description="Devices planned (cpu: 1, the host).")
    layout: dict[str, Any] = Field(description="The resolved parallel layout.")
    params: dict[str, int] = Field(description="Parameter counts: total, active, mtp.")
    components: list[Component] = Field(description="Every term, per phase.")
    phases: dict[str, int] = Field(description="Bytes per GPU of each phase (its peak).")
    peak_phase: str = Field(description="The phase with the peak.")
    peak_bytes: int = Field(description="max over phases.")
    capacity_bytes: int = Field(description="Memory of one device (or memory.limit_bytes when smaller).")
    host_bytes_per_node: int = Field(default=0, description="Host memory the plan needs per node.")
    host_capacity_bytes: int = Field(default=0, description="Host memory per node of the profile.")
    fits: bool = Field(description="peak <= capacity (and host memory fits).")
    margin_bytes: int = Field(description="capacity - peak (negative: short by that much).")
    kv_tokens: int | None = Field(default=None, description="KV-cache tokens that fit per engine (sglang pool).")
    lever: str | None = Field(default=None, description="The biggest lever: the change to make (or that frees most).")
    levers: list[Lever] = Field(default_factory=list, description="Every lever tried and its outcome.")
    supported_by: list[str] = Field(description="Trainer backends that support the layout.")
    notes: list[str] = Field(default_factory=list, description="Assumptions and warnings.")

    @property
    def margin_gib(self) -> float:
        return self.margin_bytes / GIB

    def by_tag(self, phase: str) -> dict[str, int]:
        """Bytes per tag of one phase."""
        out = dict.fromkeys(PLAN_TAGS, 0)
        for c in self.components:
            if c.phase == phase:
                out[c.tag] = out.get(c.tag, 0) + c.bytes
        return out

    def summary(self) -> str:
        """One line: the verdict, margin and lever."""
        verdict = "fits" if self.fits else "does NOT fit"
        gib = f"{abs(self.margin_gib):.1f} GiB"
        line = (
            f"{self.model} on {self.nodes} x {self.hardware} ({self.num_gpus} devices): {verdict}; peak "
            f"{self.peak_bytes / GIB:.1f} GiB ({self.peak_phase}) of {self.capacity_bytes / GIB:.1f} GiB per device, "
            f"{'margin' if self.fits else 'short by'} {gib}"
        )
        if self.host_capacity_bytes and self.host_bytes_per_node:
            line += f"; host {self.host_bytes_per_node / GIB:.0f} of {self.host_capacity_bytes / GIB:.0f} GiB per node"
        if self.lever:
            line += f"; lever: {self.lever}"
        return line

    def render(self, width: int = 120) -> str:
        """The plan as a rich table (text)."""
        from rich.console import Console
        from rich.table import Table

        phases = [p for p in ("train", "rollout", "host") if any(c.phase == p for c in self.components)]
        table = Table(title=f"Memory plan per device (GiB): {self.model}", title_justify="left")
        table.add_column("tag")
        table.add_column("component")
        for phase in phases:
            table.add_column(phase if phase != "host" else "host/node", justify="right")
        rows: dict[tuple[str, str], dict[str, int]] = {}
        for c in self.components:
            rows.setdefault((c.tag, c.name), {})[c.phase] = rows.get((c.tag, c.name), {}).get(c.phase, 0) + c.bytes
        for tag in PLAN_TAGS:
            for (row_tag, name), values in rows.items():
                if row_tag == tag and any(values.values()):
                    table.add_row(tag, name, *(_gib(values.get(p)) for p in phases))
        table.add_section()
        totals = [*(_gib(self.phases.get(p)) for p in phases if p != "host")]
        if "host" in phases:
            totals.append(_gib(self.host_bytes_per_node))
        table.add_row("total", "", *totals)
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, force_terminal=False, color_system=None)
        console.print(table)
        layout = ", ".join(f"{k}={v}" for k, v in self.layout.items())
        console.print(f"layout: {layout}", markup=False)
        console.print(f"supported by: {', '.join(self.supported_by) or 'no trainer backend'}", markup=False)
        for note in self.notes:
            console.print(f"note: {note}", markup=False)
        for lever in self.levers:
            verdict = "fits" if lever.fits else "does not fit"
            console.print(
                f"lever tried: {lever.change}: peak {lever.peak_bytes / GIB:.1f} GiB, {verdict}", markup=False
            )
        console.print(self.summary(), markup=False)
        return buffer.getvalue()


def _gib(value: int | None) -> str:
    return "" if not value else f"{value / GIB:.2f}"
