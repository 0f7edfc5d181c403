"""The attention half of a decoder layer's engine forward in one native call (fused.cpp): input RMSNorm, the Q / K / V
projections from their packed panels, QK-norm, RoPE, the K / V writes into the page store, attention, the output
projection and residual, the post-attention RMSNorm and the gate / up projections; the library's own kernels in the
modules' order, so the bits of the module path. float32 only."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from miles_kernels.native.library import kernels, run

_POINTERS6 = ctypes.c_void_p * 6
_POINTERS4 = ctypes.c_void_p * 4


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decoder_attention(
    x_NH: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float],
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    panels: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    shape: tuple[int, int, int, int],
    cos_NR: torch.Tensor,
    sin_NR: torch.Tensor,
    pages: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    copy_tokens_C: torch.Tensor,
    attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x + attention(x)'s output projection, and the gate / up projections of its post-attention RMSNorm: (N, H),
    (N, I), (N, I) float32. `norms`: the input and post-attention RMSNorm weights and their eps; `head_norms`: QK-norm
    (q, k weights, eps) or None; `panels`: the packed Q, K, V, O, gate, up weights (`matmul.held_panels`); `biases`:
    Q, K, V, O's or None; `shape`: (heads, KV heads, head dim, intermediate size); cos / sin (N, R); `pages`: the
    layer's contiguous float32 K / V store (pages, Hkv, P, D); `slots`: `AttentionBatch.kv_write_slots`;
    `attention`: positions (N,), sequences (N,), block tables (S, B), scale, window. The caller has checked the
    operands (miles_kernels.fused_layer): float32, contiguous, on the CPU."""
    state = kernels()
    (n, hidden), (heads, kv_heads, head_dim, inter) = x_NH.shape, shape
    (k_pages, v_pages), (positions, seqs, tables, scale, window) = pages, attention
    head = (None, None, 0.0) if head_norms is None else head_norms
    x_out = torch.empty(n, hidden)
    gate, up = torch.empty(n, inter), torch.empty(n, inter)
    run("decoder_attention", state["decoder_attention"], x_NH.data_ptr(), n, hidden, heads, kv_heads, head_dim, inter,
        norms[0].data_ptr(), norms[1].data_ptr(), norms[2], _address(head[0]), _address(head[1]), head[2],
        _POINTERS6(*(p.data_ptr() for p in panels)), _POINTERS4(*(_address(b) for b in biases)), cos_NR.data_ptr(),
        sin_NR.data_ptr(), cos_NR.shape[1], k_pages.data_ptr(), v_pages.data_ptr(), k_pages.shape[2], slots.data_ptr(),
        copy_tokens_C.shape[0], copy_tokens_C.data_ptr(), positions.data_ptr(), seqs.data_ptr(), tables.data_ptr(),
        tables.shape[1], scale, window or 0, x_out.data_ptr(), gate.data_ptr(), up.data_ptr(),
        torch.get_num_threads())  # fmt: skip
    return x_out, gate, up
