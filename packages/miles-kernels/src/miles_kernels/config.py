"""`KernelConfig`: everything that decides the bits of a forward pass, shared by rollout engine and trainer.

True on-policy needs the engine and the trainer to run the same ops with the same tile sizes and dtype. Both
take one `KernelConfig`; each reports its fingerprint (fingerprint.py: the fields, the op backends they resolve to
here, the torch version, the kind of device), and the orchestrator refuses true on-policy when the two differ.
This module is a leaf: it imports neither torch (only `torch_dtype` does, when called) nor the ops, so a run config
that nests a `KernelConfig` validates without importing torch (docs/architecture.md, "Config").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch


class KernelConfig(BaseModel):
    """Dtype, mode and every tile/page/split size of the model's ops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter and activation dtype (attention softmax and log-probs are fp32)."
    )
    mode: Literal["deterministic", "fast"] = Field(
        default="deterministic",
        description="deterministic: batch-invariant ops (true on-policy); fast: plain torch ops (mismatch measured).",
    )
    linear_tile: int = Field(
        default=16, ge=1, le=1024, description="Rows per fixed-shape matmul tile in deterministic linear layers."
    )
    attention_query_tile: int = Field(
        default=4, ge=1, le=1024, description="Query rows per fixed-shape attention tile (per KV head group)."
    )
    page_size: int = Field(
        default=16, ge=1, le=4096, description="Tokens per KV-cache page; also the attention key block size."
    )
    moe_tile: int = Field(default=16, ge=1, le=1024, description="Rows per fixed-shape matmul tile in MoE experts.")
    attention_backend: str = Field(
        default="auto", description="Attention backend for this mode (see miles_kernels.registry); auto: best usable."
    )
    linear_backend: str = Field(
        default="auto", description="Linear backend for this mode (see miles_kernels.registry); auto: best usable."
    )
    norm_backend: str = Field(
        default="auto", description="RMSNorm backend for this mode (see miles_kernels.registry); auto: best usable."
    )

    @model_validator(mode="after")
    def _powers_of_two(self) -> KernelConfig:
        for name in ("linear_tile", "attention_query_tile", "page_size", "moe_tile"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two (e.g. {1 << (value.bit_length() - 1)})")
        return self

    @property
    def is_deterministic(self) -> bool:
        """True in batch-invariant mode."""
        return self.mode == "deterministic"

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


class LoraConfig(BaseModel):
    """LoRA adapters on a frozen base (PEFT's `LoraConfig` names and semantics): `W + scaling * B @ A` on every
    targeted linear layer, `scaling = alpha / rank` (rsLoRA: `alpha / sqrt(rank)`); rank 0: no adapters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(default=0, ge=0, le=4096, description="Adapter rank r (0: no LoRA, every weight trains).")
    alpha: float = Field(default=32.0, gt=0, description="lora_alpha: the update is scaled by alpha / rank.")
    use_rslora: bool = Field(default=False, description="rsLoRA: scale by alpha / sqrt(rank) instead.")
    target_modules: list[str] | str = Field(
        default="all-linear",
        description="Linear layers that get adapters, as PEFT reads it: a list of names matching a module name or "
        "its last parts (q_proj, self_attn.o_proj, experts.0.up_proj), 'all-linear' (every linear layer of the "
        "decoder: attention, MLP, experts, MLA projections), or one regex matched against the full module name.",
    )

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules is empty: name the modules (e.g. [q_proj, v_proj]) or use 'all-linear'")
        return self

    @property
    def is_enabled(self) -> bool:
        """True when adapters are used (rank > 0)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """What `B @ A` is multiplied by (PEFT's `scaling`)."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


WeightFormat = Literal["kernel", "fp8_block", "fp8_channel", "int4_group"]


class WeightQuantConfig(BaseModel):
    """Low-precision linear weights (quantization.py): the format the engine stores the decoder's linear layers in
    (and that quantization-aware training fake-quantizes with), as Hugging Face checkpoints write them:

    - `fp8_block`: float8 e4m3 with one float32 scale per `block_size` block (DeepSeek-V3's `weight_scale_inv`);
    - `fp8_channel`: float8 e4m3 with one float32 scale per output channel (compressed-tensors' `weight_scale`);
    - `int4_group`: symmetric int4 with one bfloat16 scale per `group_size` inputs, eight values packed in an int32
      (compressed-tensors' `pack-quantized`, Kimi-K2-Thinking's layout);
    - `kernel`: the kernel dtype, no quantization."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: WeightFormat = Field(default="kernel", description="The stored format of the decoder's linear weights.")
    block_size: tuple[int, int] = Field(
        default=(128, 128), description="fp8_block: (output rows, input columns) sharing one scale."
    )
    group_size: int = Field(default=128, ge=8, le=4096, description="int4_group: input columns sharing one scale.")

    @model_validator(mode="after")
    def _sizes(self) -> WeightQuantConfig:
        if min(self.block_size) < 1:
            raise ValueError(f"block_size {list(self.block_size)} must be positive, e.g. [128, 128]")
        if self.group_size % 8:
            raise ValueError(f"group_size={self.group_size} must be a multiple of 8 (eight int4 values per int32)")
        return self

    @property
    def is_enabled(self) -> bool:
        """True when weights are stored quantized."""
        return self.format != "kernel"

    def to_hf(self) -> dict[str, object]:
        """The `quantization_config` of config.json for this format (DeepSeek-V3's for fp8_block, compressed-tensors'
        for fp8_channel and int4_group)."""
        if self.format == "fp8_block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block_size)}  # fmt: skip
        if self.format == "kernel":
            return {}
        is_int4 = self.format == "int4_group"
        weights = {
            "num_bits": 4 if is_int4 else 8, "type": "int" if is_int4 else "float", "symmetric": True,
            "strategy": "group" if is_int4 else "channel", "group_size": self.group_size if is_int4 else None,
            "dynamic": False, "observer": "minmax",
        }  # fmt: skip
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized" if is_int4 else "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"],
        }

    @classmethod
    def from_hf(cls, config: dict[str, object] | None) -> WeightQuantConfig:
        """The format a config.json `quantization_config` describes (None or {}: `kernel`); ValueError for one
        Miles does not read, naming what it reads."""
        if not config:
            return cls()
        method = config.get("quant_method")
        if method == "fp8" and config.get("fmt", "e4m3") == "e4m3" and config.get("weight_block_size"):
            block = config["weight_block_size"]
            assert isinstance(block, list)
            return cls(format="fp8_block", block_size=(int(block[0]), int(block[1])))
        if method == "compressed-tensors":
            groups = config.get("config_groups")
            weights = [g.get("weights") or {} for g in groups.values()] if isinstance(groups, dict) else []
            if len(weights) == 1:
                w = weights[0]
                if w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "channel":
                    return cls(format="fp8_channel")
                if (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") == "group"
                        and w.get("symmetric", True)):  # fmt: skip
                    return cls(format="int4_group", group_size=int(w["group_size"]))
        raise ValueError(
            f"quantization_config {config} is not a format Miles reads: DeepSeek-V3's block FP8 (quant_method fp8, "
            "weight_block_size), compressed-tensors' per-channel FP8 (float-quantized) or symmetric group-wise "
            "INT4 (pack-quantized)"
        )
