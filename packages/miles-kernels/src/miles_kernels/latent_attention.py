"""DeepSeek-V3's multi-head latent attention (`LatentAttention`), the attention of the `deepseek_v3` family in
model.py's `DecoderLayer` (docs/architecture.md, "Multi-head latent attention")."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.layers import Linear, RMSNorm
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.attention import attention, packed_attention
from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.ops.kv_pages import write_kv
from miles_kernels.ops.linear import head_linear
from miles_kernels.ops.rope import apply_rope, deinterleave


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (MLA), under transformers' `DeepseekV3Attention` names.

    Per token: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)), split per head into q_nope (qk_nope_head_dim)
    and q_rot (qk_rope_head_dim); the latent [c ; k_rot] = kv_a_proj_with_mqa(x) with c = kv_a_layernorm(c)
    (kv_lora_rank) and k_rot one rotary key shared by all heads; kv_b_proj maps c to each head's k_nope and v.
    Both rotary parts are de-interleaved first under `rope_interleave` (exact, ops/rope.py `deinterleave`).

    The attention runs in the absorbed form (DeepSeek-V2, section 2.1.3; SGLang's and FlashMLA's decode): kv_b_proj's
    key rows fold into the query, q_lat = q_nope W_UK (per head, nope -> kv_lora_rank), so that
        score = q_nope . k_nope + q_rot . k_rot = [q_lat ; q_rot] . [c ; k_rot],
    i.e. multi-query attention (one KV head) whose keys and values are the latent itself (the engine's cache holds
    just the latent: kv_lora_rank + qk_rope_head_dim values per token and layer, `KVStore`); the output's first
    kv_lora_rank columns map through kv_b_proj's value rows per head (W_UV). The engine's paged attention and the
    trainer's packed one run this same code, so their rows agree bit for bit in deterministic mode.

    The expanded form (c expanded to each head's k_nope / v by kv_b_proj, standard attention over qk_head_dim keys)
    sums in other orders: close, never bit-equal, so it runs in fast mode only, where it is cheaper: the trainer's
    packed forward always, and an engine forward whose new rows are many against the cached keys they read (a long
    prefill; `expands`: per head, the absorbed form costs 2W per (query, key) pair plus (nope + v) * kv_lora_rank per
    query, the expanded one (qk + v) per pair plus (nope + v) * kv_lora_rank per key read, W = kv_lora_rank +
    qk_rope_head_dim). The engine expands only the pages the batch reads (`_expanded_cached`).
    """

    def __init__(self, config: ModelConfig, kernel: KernelConfig, layer: int) -> None:
        super().__init__()
        heads, hidden, eps = config.num_attention_heads, config.hidden_size, 1e-6  # q / kv norms: transformers' eps
        qk, latent = config.qk_head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, heads * qk, False, kernel)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, config.attention_bias, kernel)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps, kernel)
            self.q_b_proj = Linear(config.q_lora_rank, heads * qk, False, kernel)
            self.q_proj = None
        self.kv_a_proj_with_mqa = Linear(hidden, latent + config.qk_rope_head_dim, config.attention_bias, kernel)
        self.kv_a_layernorm = RMSNorm(latent, eps, kernel)
        self.kv_b_proj = Linear(latent, heads * (config.qk_nope_head_dim + config.v_head_dim), False, kernel)
        self.o_proj = Linear(heads * config.v_head_dim, hidden, config.attention_bias, kernel)
        self.dims = (heads, config.qk_nope_head_dim, config.v_head_dim, latent)
        self.q_rot_dim = config.qk_rope_head_dim
        self.interleave = config.rope_interleave
        self.scale = config.softmax_scale
        self.kernel = kernel

    def forward(
        self,
        x_NH: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_pages: torch.Tensor | None,
        v_pages: torch.Tensor | None,
    ) -> torch.Tensor:
        heads, nope, v_dim, latent_dim = self.dims
        num_tokens = x_NH.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x_NH).view(num_tokens, heads, -1)
        else:  # the q-LoRA
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_NH))).view(num_tokens, heads, -1)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        latent = self.kv_a_proj_with_mqa(x_NH)
        c_N1C = self.kv_a_layernorm(latent[:, :latent_dim]).unsqueeze(1)
        k_rot = latent[:, None, latent_dim:]
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        w_kv = self.kv_b_proj.effective_weight().view(heads, nope + v_dim, latent_dim)
        if self.kernel.is_deterministic or (k_pages is not None and not self.expands(batch)):
            out = self._absorbed(q_nope, q_rot, c_N1C, k_rot, w_kv, batch, k_pages, v_pages)
        elif k_pages is None:
            out = self._expanded(q_nope, q_rot, c_N1C, k_rot, batch)
        else:
            kv = torch.cat((c_N1C, k_rot), dim=-1)
            write_kv(k_pages, k_pages, kv, kv, batch)
            out = self._expanded_cached(q_nope, q_rot, k_pages, batch)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, heads * v_dim))
        return projected

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, c_N1C: torch.Tensor, k_rot: torch.Tensor,
        w_kv: torch.Tensor, batch: AttentionBatch, k_pages: torch.Tensor | None, v_pages: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        _, nope, _, latent_dim = self.dims
        q_latent = head_linear(q_nope, w_kv[:, :nope].transpose(1, 2).contiguous(), self.kernel)
        q_abs = torch.cat((q_latent, q_rot), dim=-1)
        kv = torch.cat((c_N1C, k_rot), dim=-1)  # the latent: keys and values of one KV head
        if k_pages is None:  # the trainer: the batch's own latents
            out = packed_attention(q_abs, kv, kv, batch, self.scale, self.kernel)
        else:  # the engine's latent cache (`v_pages is k_pages`)
            write_kv(k_pages, cast(torch.Tensor, v_pages), kv, kv, batch)
            out = attention(q_abs, k_pages, cast(torch.Tensor, v_pages), batch, self.scale, self.kernel)
        return head_linear(out[..., :latent_dim], w_kv[:, nope:], self.kernel)

    def expands(self, batch: AttentionBatch) -> bool:
        """Whether the expanded form costs fewer flops than the absorbed one for this engine batch (see the class
        docstring): sum_s Q_s K_s (2W - qk - v) > (sum_s K_s - N) (nope + v) kv_lora_rank."""
        _, nope, v_dim, latent_dim = self.dims
        qk = self.q_rot_dim + nope
        pairs = (batch.query_lens_S * batch.kv_lens_S).sum()
        keys_only = batch.kv_lens_S.sum() - batch.num_tokens
        width = latent_dim + self.q_rot_dim
        return bool(pairs * (2 * width - qk - v_dim) > keys_only * (nope + v_dim) * latent_dim)

    def _heads(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, k_nope: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expanded form's q, k, v of one width (the attention takes one): zero columns pad the narrower."""
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(*k_nope.shape[:-1], -1)), dim=-1)
        width = max(q.shape[-1], v.shape[-1])
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return q, k, v

    def _expanded(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, c_N1C: torch.Tensor, k_rot: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:  # fmt: skip
        heads, nope, v_dim, _ = self.dims
        kv = self.kv_b_proj(c_N1C[:, 0]).view(-1, heads, nope + v_dim)
        q, k, v = self._heads(q_nope, q_rot, kv[..., :nope], k_rot, kv[..., nope:])
        return packed_attention(q, k, v, batch, self.scale, self.kernel)[..., :v_dim]

    def _expanded_cached(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, pages: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """The expanded form over the engine's latent cache: the pages the batch reads, expanded into a temporary
        K / V store, with the batch's page ids renumbered to it (`AttentionBatch.compacted`)."""
        heads, nope, v_dim, latent_dim = self.dims
        used, compact = batch.compacted(pages.shape[0])
        latent = pages.index_select(0, used)  # (U, 1, P, W)
        kv = self.kv_b_proj(latent[:, 0, :, :latent_dim]).view(len(used), -1, heads, nope + v_dim).transpose(1, 2)
        k_rot = latent[..., latent_dim:]  # (U, 1, P, rope): broadcast over the heads
        q, k, v = self._heads(q_nope, q_rot, kv[..., :nope], k_rot, kv[..., nope:])
        return attention(q, k.contiguous(), v.contiguous(), compact, self.scale, self.kernel)[..., :v_dim]
