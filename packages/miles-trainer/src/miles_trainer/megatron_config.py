"""`MegatronConfig`: the Megatron-core backend's parallel layout and kernels (`trainer.backend.megatron`), torch-free
like the rest of the trainer's config (config.py, which nests it in `BackendConfig` and exports it too)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MegatronConfig(BaseModel):
    """The Megatron-core backend's parallel layout (docs/megatron.md). The data-parallel size is what remains of the
    world: world = tp * pp * cp * dp, and for the experts tp * pp * cp * dp = etp * ep * edp."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every trainer config (config.py)

    tp: int = Field(default=1, ge=1, description="Tensor-parallel size (divides the KV heads and the MLP widths).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel stages.")
    vpp: int | None = Field(
        default=None,
        ge=1,
        description="Virtual pipeline stages (model chunks) per PP rank, for the interleaved "
        "schedule (needs pp >= 3); null: one.",
    )
    decoder_first_pipeline_num_layers: int | None = Field(
        default=None,
        ge=1,
        description="Decoder layers of the first pipeline stage (it also holds the embedding), for uneven stages "
        "(Megatron-LM's --decoder-first-pipeline-num-layers); null: the even share. The other stages split the "
        "rest evenly.",
    )
    decoder_last_pipeline_num_layers: int | None = Field(
        default=None,
        ge=1,
        description="Decoder layers of the last pipeline stage (it also holds the output layer, the loss and the "
        "MTP modules), for uneven stages (Megatron-LM's --decoder-last-pipeline-num-layers); null: the even share.",
    )
    ep: int = Field(default=1, ge=1, description="Expert-parallel size (divides the number of experts).")
    etp: int | None = Field(
        default=None, ge=1, description="Expert tensor-parallel size; null: 1 (experts whole on each EP rank)."
    )
    cp: int = Field(default=1, ge=1, description="Context-parallel size (splits each sequence over ranks).")
    sequence_parallel: bool = Field(
        default=False, description="Split the norms' and dropouts' activations over the TP ranks (needs tp > 1)."
    )
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        default="local",
        description="Megatron-core's own PyTorch modules (local), or Transformer Engine's (the transformer-engine "
        "package must be installed; its fused layer norms change the weight names, docs/megatron.md).",
    )
    layer_spec: Literal["auto", "miles", "megatron"] = Field(
        default="auto",
        description="The modules the GPTModel's layers are built from: miles (megatron-core's layers computing "
        "with the engine's miles-kernels ops: with kernel.mode=deterministic the log-probs equal the rollout's bit "
        "for bit; etp, cp = 1, no sequence_parallel, transformer_impl=local), megatron (megatron-core's own, "
        "transformer_impl's), or auto (miles with kernel.mode=deterministic, megatron otherwise).",
    )
    tp_reduce: Literal["exact", "all_reduce"] = Field(
        default="exact",
        description="With the Miles layers and tp > 1, how the row-parallel linears (attention output, MLP down) "
        "combine the TP ranks: exact (gather their inputs and weight shards, run the engine's unsplit GEMM: the "
        "engine's bits, for an all-gather of those weights per forward) or all_reduce (sum the ranks' partial "
        "products, megatron-core's way: another summation order, a measured log-prob mismatch).",
    )
    moe_token_dispatcher: Literal["allgather", "alltoall"] = Field(
        default="alltoall", description="How tokens reach their experts' EP ranks."
    )
    recompute: Literal["none", "selective", "full"] = Field(
        default="none", description="Activation recompute: selective (core attention) or full (each layer)."
    )

    def uses_miles_layers(self, deterministic: bool) -> bool:
        """Whether the GPTModel's layers are the Miles ones (`layer_spec`; `deterministic`: kernel.mode is)."""
        return self.layer_spec == "miles" or (self.layer_spec == "auto" and deterministic)

    def model_problem(self, model_type: str, is_mla: bool, deterministic: bool) -> str | None:
        """Why this layout cannot build a `model_type` model (None: it can): the Miles layers have no multi-head
        latent attention yet. Checked where config.json is read (the run's start-up, the backend's build)."""
        if not (is_mla and self.uses_miles_layers(deterministic)):
            return None
        return (
            f"the Miles layers have no MLA yet ({model_type}: multi-head latent attention), and "
            "kernel.mode=deterministic (or megatron.layer_spec=miles) builds them; use trainer.backend.name=fsdp2 "
            f"for true on-policy with {model_type}, or kernel.mode=fast with megatron.layer_spec auto or "
            "megatron (megatron-core's MLA; trainer.loss.is_mode=truncate (TIS) or mask (MIS) corrects the mismatch)"
        )

    def miles_layer_problems(self) -> list[str]:
        """What in this layout the Miles layers do not run (each with why); empty: they run it."""
        problems = []
        if self.transformer_impl != "local":
            problems.append(
                "transformer_impl=transformer_engine (the Miles layers replace megatron-core's local ones)"
            )
        if self.sequence_parallel:
            problems.append("sequence_parallel (the Miles layers keep every TP rank's activations whole)")
        if (self.etp or 1) > 1:
            problems.append(f"etp={self.etp} (each expert's rows would sum partial products across ranks)")
        if self.cp > 1:
            problems.append(f"cp={self.cp} (context parallelism splits a sequence's attention)")
        return problems

    def exactness_problems(self) -> list[str]:
        """Why this layout's log-probs would not equal the engine's bit for bit in kernel.mode=deterministic (empty:
        they do; docs/true-on-policy.md has the table)."""
        if self.layer_spec == "megatron":
            return ["layer_spec=megatron (megatron-core's kernels are not the engine's)"]
        problems = self.miles_layer_problems()
        if self.tp > 1 and self.tp_reduce == "all_reduce":
            problems.append(
                f"tp={self.tp} with tp_reduce=all_reduce (the row-parallel layers sum the ranks' partial products "
                "in another order than the engine's unsplit GEMM; tp_reduce=exact gathers them)"
            )
        return problems
