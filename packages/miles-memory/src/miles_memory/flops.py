"""Model FLOPs of a forward, a training step and a rollout, and the MFU they give on a hardware profile. Torch-free.

The convention is "model FLOPs" (PaLM, arXiv 2204.02311, appendix B; Megatron-LM, arXiv 2104.04473, section 5.1):
the matmul FLOPs the model needs for its tokens, whatever an implementation adds (activation recompute, padding,
flash attention's recomputed scores in the backward) or saves (a prefix cache):

- matmul part, per token: 2 x every weight of a linear layer the token multiplies: attention projections (MLA's
  low-rank q / kv projections as they are: q_a, q_b, kv_a, kv_b, o), dense MLPs, the MoE router, shared experts and
  the `num_experts_per_tok` routed experts a token activates (of `num_experts`), and the LM head (tied or not: a
  tied head is still a matmul; the embedding lookup is not). Norms and biases are not matmuls.
- attention part, per token and attended key, per layer: QK^T and AV, 2 x heads x (qk_head_dim + v_head_dim); MLA's
  qk_head_dim is qk_nope + qk_rope (its expanded form, the one the trainer runs). Token t of a causal sequence
  attends t keys (positions 1..t).
- a training step is 3 x the forward (the backward computes the gradients of the inputs and of the weights, 2 x the
  forward each matmul); activation recompute is not counted (model FLOPs, not hardware FLOPs).
- MTP modules are counted only when asked (`include_mtp`): they run only where the draft trains or drafts. Each adds
  its decoder layer, `eh_proj` and a pass through the shared LM head.

`ModelFlops.forward`, `train` and `generate` turn token lengths into FLOPs; `mfu` divides achieved FLOP/s by the
devices' dense BF16 peak (`HardwareProfile.bf16_flops_per_s`; None where the profile does not know it, as on `cpu`).
The orchestrator reports both for each step's rollout and training (miles_orchestrator/throughput.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from miles_memory.hardware import HardwareProfile, load_hardware
from miles_memory.model_shape import ModelShape

__all__ = ["ModelFlops", "mfu", "model_flops"]

# The embedding is a lookup; the LM head's matmul is added once per pass through it (tied or not).
_NOT_MATMULS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of one token that attends `context` keys: `matmul + attention_per_key * context`.

    `matmul`: 2 x the weights the token multiplies (LM head included); `attention_per_key`: QK^T and AV of one
    attended key over every attention layer."""

    matmul: int
    attention_per_key: int

    def per_token(self, context: int) -> int:
        """Forward FLOPs of one token attending `context` keys (itself included)."""
        return self.matmul + self.attention_per_key * context

    def forward(self, lengths: Iterable[int]) -> int:
        """Forward FLOPs of a packed batch of causal sequences of these lengths (token t attends t keys)."""
        total = 0
        for n in _checked(lengths, "sequence length"):
            total += self.matmul * n + self.attention_per_key * (n * (n + 1) // 2)
        return total

    def train(self, lengths: Iterable[int]) -> int:
        """FLOPs of one forward and backward over the batch: 3 x `forward` (recompute not counted)."""
        return 3 * self.forward(lengths)

    def generate(self, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> int:
        """Forward FLOPs of generating each response after its prompt: the prompt's prefill, then each generated
        token but the last fed back at its position (the last is sampled, never fed), i.e. the causal forward of the
        first prompt + response - 1 tokens. Every sample's prompt is counted, also where a prefix cache prefilled a
        group's shared prompt once."""
        if len(prompt_lengths) != len(response_lengths):
            raise ValueError(f"got {len(prompt_lengths)} prompt lengths and {len(response_lengths)} response lengths")
        prompts = _checked(prompt_lengths, "prompt length")
        responses = _checked(response_lengths, "response length")
        return self.forward(p + max(r - 1, 0) for p, r in zip(prompts, responses, strict=True))


def model_flops(shape: ModelShape, *, include_mtp: bool = False) -> ModelFlops:
    """The FLOPs model of `shape` (the trunk; its MTP modules too with `include_mtp`)."""
    last_layer = shape.num_hidden_layers + (shape.num_nextn_predict_layers if include_mtp else 0)
    weights = 0
    for t in shape.tensors():
        if len(t.shape) != 2 or t.name in _NOT_MATMULS or (t.layer is not None and t.layer >= last_layer):
            continue
        # a layer's routed experts are one Tensor of `copies` = num_experts; a token runs num_experts_per_tok of them
        weights += t.numel // t.copies * shape.num_experts_per_tok if t.is_expert else t.numel
    num_head_passes = 1 + (shape.num_nextn_predict_layers if include_mtp else 0)
    weights += num_head_passes * shape.vocab_size * shape.hidden_size
    if shape.is_mla:
        qk_dim, v_dim = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim
    else:
        qk_dim = v_dim = shape.dim
    attention_per_key = 2 * shape.num_attention_heads * (qk_dim + v_dim) * last_layer
    return ModelFlops(matmul=2 * weights, attention_per_key=attention_per_key)


def mfu(flops: float, seconds: float, num_devices: int, hardware: HardwareProfile | str) -> float | None:
    """Model FLOPs utilization: achieved FLOP/s / (`num_devices` x the device's dense BF16 peak); None where the
    profile's peak is unknown (`cpu`)."""
    if seconds <= 0 or num_devices < 1:
        raise ValueError(f"MFU needs seconds > 0 and num_devices >= 1, got {seconds} s on {num_devices} devices")
    profile = load_hardware(hardware) if isinstance(hardware, str) else hardware
    if not profile.bf16_flops_per_s:
        return None
    return flops / seconds / (num_devices * profile.bf16_flops_per_s)


def _checked(values: Iterable[int], what: str) -> list[int]:
    out = [int(v) for v in values]
    negative = [v for v in out if v < 0]
    if negative:
        raise ValueError(f"a {what} is negative ({negative[0]}): token counts are >= 0")
    return out
