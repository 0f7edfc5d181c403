"""The engine's decoder layer in fewer calls: where every op of a dense layer's forward would run the native kernels
anyway (float32, no autograd, the weights held packed, a page store), its attention half runs as one native call
(`native.decoder_attention`, fused.cpp: the same kernels in the same order, so the same bits) instead of ~20 Python
op calls, and its MLP continues from the gate and up projections (model.py's `DecoderLayer.forward`). Anything else
runs the modules: autograd (the trainer), bfloat16, LoRA adapters served per request or merged per call,
low-precision weights, module hooks, MoE and MLA layers, other backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from miles_kernels import native
from miles_kernels.layers import MLP, Linear, RMSNorm
from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.registry import get_backend

if TYPE_CHECKING:
    from miles_kernels.model import Attention

_FLOAT = torch.float32


def _plain(linear: Linear) -> bool:
    """A linear layer whose forward is `native_linear(x, weight) (+ bias)` on its own weight or merged adapter."""
    return (
        linear.weight_quant is None
        and linear.fake_quant is None
        and linear.served is None
        and (linear.lora_A is None or linear.lora_disabled or linear.folded is not None)
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
    )


def _native_backends(attention: Attention) -> bool:
    kernel = attention.kernel
    return all(
        get_backend(f"{op}:{kernel.mode}", name).name == "native"
        for op, name in (("linear", kernel.linear_backend), ("attention", kernel.attention_backend),
                         ("rms_norm", kernel.norm_backend))
    )  # fmt: skip


def _float_rows(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype is _FLOAT and t.is_cpu and t.is_contiguous())


def attention_half(
    attention: Attention,
    mlp: MLP,
    norms: tuple[RMSNorm, RMSNorm],
    x_NH: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: AttentionBatch,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x + self_attn(input_layernorm(x)), and the gate and up projections of its post-attention norm, in one native
    call (writing the batch's K / V into the pages as `write_kv` does); None where the modules must run."""
    if torch.is_grad_enabled() or not (_float_rows(x_NH) and x_NH.dim() == 2):
        return None
    heads, kv_heads, dim = attention.shape
    if not all(s.is_contiguous() and s.dtype is _FLOAT and s.dim() == 4 for s in (k_pages, v_pages)):
        return None
    if k_pages.shape[1:] != (kv_heads, batch.page_size, dim) or k_pages.shape != v_pages.shape:
        return None
    linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj)
    head_norms = (attention.q_norm, attention.k_norm) if attention.q_norm is not None else ()
    modules = (attention, mlp, *norms, *head_norms)
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules) or not all(_plain(lin) for lin in linears):
        return None
    if not _native_backends(attention) or not (_float_rows(cos) and _float_rows(sin) and cos.dim() == 2):
        return None
    if cos.shape != sin.shape or cos.shape[0] != x_NH.shape[0] or cos.shape[1] % 2 or cos.shape[1] > dim:
        return None
    weights = [lin.effective_weight() for lin in linears]
    biases = [lin.bias for lin in linears[:4]]
    norm_weights = [n.weight for n in (*norms, *head_norms)]
    if not all(w.dtype is _FLOAT and w.is_cpu for w in weights) or not all(map(_float_rows, [*biases, *norm_weights])):
        return None
    panels = [p for w in weights if (p := native.held_panels(w)) is not None]
    if len(panels) < len(weights):  # a weight the engine does not hold (an adapter merged per call)
        return None
    q_norm, k_norm = head_norms or (None, None)
    if norms[0].eps != norms[1].eps or (q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps):
        return None
    return native.decoder_attention(
        x_NH,
        (norms[0].weight, norms[1].weight, norms[0].eps),
        None if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps),
        panels,
        biases,
        (heads, kv_heads, dim, mlp.gate_proj.out_features),
        cos,
        sin,
        (k_pages, v_pages),
        batch.kv_write_slots(kv_heads).to(torch.int64).contiguous(),
        batch.copy_tokens_C.to(torch.int64).contiguous(),
        (
            batch.positions_N.to(torch.int64).contiguous(),
            batch.token_seqs().to(torch.int64).contiguous(),
            batch.block_tables_SB.to(torch.int64).contiguous(),
            attention.scale,
            attention.window,
        ),
    )
