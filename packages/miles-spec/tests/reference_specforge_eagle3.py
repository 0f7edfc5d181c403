"""A transcription of SpecForge's EAGLE-3 training forward (sgl-project/SpecForge, specforge/modeling/draft/
llama3_eagle.py: `LlamaForCausalLMEagle3`, `LlamaDecoderLayer`, `LlamaAttention` with `cache_hidden`; specforge/
algorithms/eagle3/model.py: the TTT loop), batch 1, plain torch in float32, reading the weights by SpecForge's names.
The independent reference for `Eagle3Draft.forward` (miles_kernels/eagle3.py)."""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """LlamaRotaryEmbedding + apply_rotary_pos_emb: x (heads, T, D) at `positions` (T,)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def ttt_logits(
    w: dict[str, torch.Tensor], config: dict, features: torch.Tensor, embeds: list[torch.Tensor]
) -> list[torch.Tensor]:
    """SpecForge's TTT over len(embeds) steps for one sequence: features (T, 3H); embeds[k] (T, H), the embedding
    of the step's input ids (shifted left by k). The draft logits (T, D) of each step."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, eps, theta = config["head_dim"], config["rms_norm_eps"], config["rope_theta"]
    length = features.shape[0]
    hidden = features @ w["fc.weight"].T  # project_hidden_states
    mask = torch.full((length, length), float("-inf")).triu(1)  # _make_causal_mask
    cache_k: list[torch.Tensor] = []
    cache_v: list[torch.Tensor] = []
    out = []
    for _ in range(len(embeds)):
        embed = embeds[len(out)]
        residual = hidden
        h = rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)
        e = rms_norm(embed, w["midlayer.input_layernorm.weight"], eps)
        x = torch.cat((e, h), dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(length, heads, head_dim).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
        lck = len(cache_k)
        positions = torch.arange(length) + lck  # position_ids + lck
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        k = k.repeat_interleave(heads // kv_heads, 0)  # repeat_kv
        v = v.repeat_interleave(heads // kv_heads, 0)
        cache_k.append(k)
        cache_v.append(v)
        weights = q @ cache_k[0].transpose(1, 2) / math.sqrt(head_dim) + mask
        for i in range(1, len(cache_k)):
            weights = torch.cat((weights, ((q * cache_k[i]).sum(-1) / math.sqrt(head_dim))[..., None]), dim=-1)
        weights = torch.softmax(weights, dim=-1)
        attn = weights[..., :length] @ cache_v[0]
        for i in range(1, len(cache_k)):
            attn = attn + weights[..., length + i - 1][..., None] * cache_v[i]
        attn = attn.transpose(0, 1).reshape(length, heads * head_dim) @ w["midlayer.self_attn.o_proj.weight"].T
        hidden = residual + attn
        residual = hidden
        h = rms_norm(hidden, w["midlayer.post_attention_layernorm.weight"], eps)
        gate = h @ w["midlayer.mlp.gate_proj.weight"].T
        up = h @ w["midlayer.mlp.up_proj.weight"].T
        hidden = residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        out.append(rms_norm(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T)  # compute_logits
    return out
