"""The EAGLE-3 draft model, in SpecForge's layout (`LlamaForCausalLMEagle3`, what SGLang's `--speculative-algorithm
EAGLE3` loads with `--speculative-draft-model-path`).

One Llama decoder layer over the target's own features (docs/speculative-training.md, "EAGLE-3"):

    f_t = fc([a_t ; b_t ; c_t])                  the target's residual stream after three of its layers (low, mid,
                                                 high: `aux_layers`, SpecForge's [1, L/2 - 1, L - 4]), 3H -> H
    h_t = midlayer(embed(x_{t+1}), f_t)          attention over the sequence's draft rows <= t
    logits_t = lm_head(norm(h_t))                over the draft's own vocabulary (`draft_vocab_size`)

`midlayer` is a decoder layer whose attention reads 2H: [input_layernorm(embedding) ; hidden_norm(f_t)], with f_t
the residual. Row t predicts token t + 2. Drafting further, the layer runs on its own output h_t in place of f_t
(no `fc`): the engine's chain, and the training-time test (TTT) that trains for it (`ttt_attention`). The draft
embeds with the target's embedding (SpecForge trains it frozen and leaves it out of the checkpoint; SGLang shares
the target's). Draft token i is target token `i + d2t[i]`; `t2d[j]` says whether target token j is in the draft
vocabulary (SpecForge's buffers, checkpointed beside the weights).

Checkpoint: `config.json` (a LlamaConfig with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, and
`eagle_config.eagle_aux_hidden_state_layer_ids` when not the default) and safetensors with `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. `load_eagle3` / `save_eagle3` read and write it;
`CausalLM.attach_eagle3` makes it the model's draft (its tensors then ride along under `eagle3.*`: the trainer's
sharding, checkpoint and weight sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.kv_cache import KVStore
from miles_kernels.layers import MLP, Linear, RMSNorm
from miles_kernels.model import DRAFT_PREFIX, Attention, CausalLM, rotary_cos_sin
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.ops.rope import apply_rope

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SpecForge's and SGLang's default: the outputs of layers 1, L/2 - 1 and L - 4, clamped into the model."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))  # type: ignore[return-value]


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft's shape: its decoder layer (`layer`, a one-layer Llama), its vocabulary, and the target's."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)  # config.json fields kept as read (written back as they were)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], target: ModelConfig | None = None) -> Eagle3Config:
        """Parse a SpecForge draft's config.json; with `target`, check that the draft fits it (ValueError naming
        the mismatch)."""
        architectures = hf.get("architectures") or []
        if EAGLE3_ARCHITECTURE not in architectures:
            raise ValueError(
                f"not an EAGLE-3 draft: config.json has architectures={architectures}, expected "
                f"[{EAGLE3_ARCHITECTURE!r}] (SpecForge's layout)"
            )
        eagle = hf.get("eagle_config") or {}
        variants = [key for key in ("fc_norm", "norm_before_fc", "use_aux_norm") if hf.get(key) or eagle.get(key)]
        if hf.get("norm_output") is False:
            variants.append("norm_output=false")
        if variants:
            raise ValueError(
                f"unsupported EAGLE-3 variant: {', '.join(variants)} (Miles runs SpecForge's default "
                "LlamaForCausalLMEagle3: fc straight on the three feature rows, the output normed before lm_head)"
            )
        layer_hf = {**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
        layer = ModelConfig.from_hf(layer_hf)
        vocab = int(hf["vocab_size"])
        draft_vocab = int(hf.get("draft_vocab_size") or vocab)
        if not 1 <= draft_vocab <= vocab:
            raise ValueError(f"draft_vocab_size={draft_vocab} must be between 1 and vocab_size={vocab}")
        target_hidden = int(hf.get("target_hidden_size") or layer.hidden_size)
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        if target is not None:
            layers = layers if layers is not None else default_aux_layers(target.num_hidden_layers)
            _check_fits(vocab, target_hidden, layers, target)
        aux = tuple(int(i) for i in layers) if layers is not None else ()
        known = {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config"}
        extra = {k: v for k, v in hf.items() if k not in known}
        return cls(layer, draft_vocab, target_hidden, aux, extra)

    @classmethod
    def for_target(
        cls, target: ModelConfig, draft_vocab_size: int | None = None, aux_layers: Sequence[int] | None = None
    ) -> Eagle3Config:
        """A new draft for `target`: its hidden size, heads and RoPE (Llama 3 scaling kept; another scaling becomes
        plain RoPE at the same base), SpecForge's default feature layers."""
        layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(target.num_hidden_layers)
        _check_fits(target.vocab_size, target.hidden_size, layers, target)
        rope = {"rope_type": target.rope_type} if target.rope_type == "llama3" else {}
        heads = target.num_attention_heads  # an MLA target: plain multi-head attention of the same width
        kv_heads, head_dim = (heads, target.hidden_size // heads) if target.is_mla else (
            target.num_key_value_heads, target.head_dim)  # fmt: skip
        layer = ModelConfig(
            model_type="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size or 4 * target.hidden_size, num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False, use_qk_norm=False,
            bos_token_id=target.bos_token_id, eos_token_id=target.eos_token_id, pad_token_id=target.pad_token_id,
            **({k: getattr(target, k) for k in ("rope_type", "rope_factor", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_max_position_embeddings")} if rope else {}),
        )  # fmt: skip
        draft_vocab = draft_vocab_size or target.vocab_size
        if not 1 <= draft_vocab <= target.vocab_size:
            raise ValueError(
                f"draft_vocab_size={draft_vocab} must be between 1 and the vocabulary's {target.vocab_size}"
            )
        return cls(layer, draft_vocab, target.hidden_size, layers)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """The draft's config.json (SpecForge's / SGLang's fields)."""
        hf = self.layer.to_hf(dtype)
        hf.pop("dtype", None)
        hf |= self.extra
        hf |= {
            "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "draft_vocab_size": self.draft_vocab_size, "torch_dtype": dtype, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
        }  # fmt: skip
        if self.target_hidden_size != self.layer.hidden_size:
            hf["target_hidden_size"] = self.target_hidden_size
        return hf


def _check_fits(vocab: int, target_hidden: int, layers: Sequence[int], target: ModelConfig) -> None:
    if vocab != target.vocab_size:
        raise ValueError(f"the EAGLE-3 draft's vocab_size {vocab} differs from the target's {target.vocab_size}")
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"the EAGLE-3 draft reads hidden states of size {target_hidden} (target_hidden_size); the target's "
            f"are {target.hidden_size}"
        )
    if len(layers) != 3 or not all(0 <= int(i) < target.num_hidden_layers for i in layers):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids={list(layers)}: an EAGLE-3 draft reads three of the target's "
            f"{target.num_hidden_layers} layers (0 .. {target.num_hidden_layers - 1})"
        )


class Eagle3Layer(nn.Module):
    """SpecForge's `midlayer`: a Llama decoder layer whose attention reads [input_layernorm(embedding) ;
    hidden_norm(hidden)] (2H), the hidden state its residual."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config, kernel, 0)
        heads, kv_heads, dim = self.self_attn.shape
        wide = 2 * config.hidden_size
        self.self_attn.q_proj = Linear(wide, heads * dim, False, kernel)
        self.self_attn.k_proj = Linear(wide, kv_heads * dim, False, kernel)
        self.self_attn.v_proj = Linear(wide, kv_heads * dim, False, kernel)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, kernel)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)

    def attention_input(self, embedded_NH: torch.Tensor, hidden_NH: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embedded_NH), self.hidden_norm(hidden_NH)), dim=-1)

    def finish(self, hidden_NH: torch.Tensor, attended_NH: torch.Tensor) -> torch.Tensor:
        """The residual add after attention, then the MLP block."""
        x = hidden_NH + attended_NH
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft (SpecForge's tensor names: `fc`, `midlayer`, `norm`, `lm_head`, buffers `d2t`, `t2d`)."""

    def __init__(self, config: Eagle3Config, kernel: KernelConfig | None = None) -> None:
        super().__init__()
        kernel = kernel or KernelConfig()
        self.config = config
        self.kernel = kernel
        hidden = config.layer.hidden_size
        self.fc = Linear(3 * config.target_hidden_size, hidden, False, kernel)
        self.midlayer = Eagle3Layer(config.layer, kernel)
        self.norm = RMSNorm(hidden, config.layer.rms_norm_eps, kernel)
        self.lm_head = Linear(hidden, config.draft_vocab_size, False, kernel)
        self.d2t = nn.Buffer(torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.t2d = nn.Buffer(torch.ones(config.layer.vocab_size, dtype=torch.bool))

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(KV heads, head dim) of the draft layer's cache."""
        return self.config.layer.num_key_value_heads, self.config.layer.head_dim

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming what does not fit when `target` is not a model this draft reads."""
        _check_fits(self.config.layer.vocab_size, self.config.target_hidden_size, self.config.aux_layers, target)

    @property
    def target_ids(self) -> torch.Tensor:
        """The target token id of each draft token (D,)."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def project(self, features_N3H: torch.Tensor) -> torch.Tensor:
        """fc: the target's three feature rows -> the draft's hidden size."""
        out: torch.Tensor = self.fc(features_N3H)
        return out

    def draft_logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (N, D), float32."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden_NH))
        return logits.to(torch.float32)

    def logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (N, V), float32: each draft token's at its target id, -inf at every
        token outside the draft vocabulary (so a sampler over the target's vocabulary never proposes one)."""
        draft = self.draft_logits(hidden_NH)
        out = draft.new_full((draft.shape[0], self.config.layer.vocab_size), float("-inf"))
        return out.index_copy_(1, self.target_ids, draft)

    def forward(
        self, features_N3H: torch.Tensor, embedded_KNH: torch.Tensor, seq_lens: Sequence[int]
    ) -> list[torch.Tensor]:
        """The training-time test (TTT) unrolled over K = embedded_KNH.shape[0] steps, with autograd: the draft
        logits (N, D) of each step. Step 0 runs on the projected features, step k on step k - 1's outputs, each
        sequence's row t at position t + k with the token embedded at `embedded_KNH[k]` (its token t + 1 + k),
        attending as `ttt_attention` says: what the engine's draft computes k drafts past the target's row t."""
        offsets = torch.cat([torch.arange(n, device=features_N3H.device) for n in seq_lens])
        hidden = self.project(features_N3H.to(embedded_KNH.dtype))
        cache: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        out = []
        for step in range(embedded_KNH.shape[0]):
            hidden = ttt_layer(self, embedded_KNH[step], hidden, offsets + step, seq_lens, cache)
            out.append(self.draft_logits(hidden))
        return out


def eagle3_hidden(
    model: CausalLM,
    hidden_NH: torch.Tensor,
    next_ids_N: torch.Tensor,
    batch: AttentionBatch,
    project: bool,
    kv_store: KVStore,
) -> torch.Tensor:
    """Output hidden states (N, H, pre-norm) of `model`'s attached EAGLE-3 draft over the batch's rows, whose
    `Eagle3Draft.logits` predict token t + 2 at row t. `hidden_NH`: the trunk's features (N, 3H; `project`: through
    `fc`) or the draft's own earlier outputs (N, H); the embedding is the trunk's. The rows' K/V go to `kv_store`'s
    draft layer L (`KVStore.allocate(num_draft_layers=1)`): the engine's drafting. No autograd path is meant here
    (the trainer's TTT is `Eagle3Draft.forward`)."""
    draft = model.eagle3
    if draft is None:
        raise ValueError("the model has no EAGLE-3 draft: attach one (attach_eagle3)")
    layer_index = model.config.num_hidden_layers
    if len(kv_store.k) <= layer_index:
        raise ValueError("the EAGLE-3 draft runs in the KV store's draft layer: allocate the store with "
                         "num_draft_layers=1")  # fmt: skip
    embedded = model.token_embeddings(next_ids_N)
    hidden = draft.project(hidden_NH.to(embedded.dtype)) if project else hidden_NH
    batch = batch.to(embedded.device)
    cos, sin = rotary_cos_sin(draft.config.layer, batch.positions_N, embedded)
    layer = draft.midlayer
    attended = layer.self_attn(layer.attention_input(embedded, hidden), cos, sin, batch, kv_store.k[layer_index],
                               kv_store.v[layer_index])  # fmt: skip
    return layer.finish(hidden, attended)


def ttt_attention(
    q_NHD: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Attention of TTT step k = len(keys) - 1 (SpecForge's `cache_hidden`), with autograd, float32.

    Row t of a sequence stands for the draft row at position t + k (k drafts past the target's features at t): it
    attends to step 0's keys at positions <= t (the rows computed from the target's features) and, for each
    step s = 1 .. k, to step s's key at its own row t (the draft rows it ran on its own outputs), exactly the keys
    the engine's draft row at position t + k sees. `keys[s]` / `values[s]`: (N, Hkv, D) per packed row; sequences
    are packed back to back (`seq_lens`)."""
    num_heads = q_NHD.shape[1]
    group = num_heads // keys[0].shape[1]
    q = q_NHD.to(torch.float32)
    expand = [(k.to(torch.float32).repeat_interleave(group, 1), v.to(torch.float32).repeat_interleave(group, 1))
              for k, v in zip(keys, values, strict=True)]  # fmt: skip
    outs = []
    start = 0
    for length in seq_lens:
        rows = slice(start, start + length)
        q_s = q[rows].transpose(0, 1)  # (H, T, D)
        k0, v0 = (t[rows].transpose(0, 1) for t in expand[0])
        scores = torch.matmul(q_s, k0.transpose(1, 2)) * scale  # (H, T, T)
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = [(q_s * k[rows].transpose(0, 1)).sum(-1, keepdim=True) * scale for k, _ in expand[1:]]
        probs = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1)
        out = torch.matmul(probs[..., :length], v0)
        for s, (_, v) in enumerate(expand[1:]):
            out = out + probs[..., length + s : length + s + 1] * v[rows].transpose(0, 1)
        outs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outs).to(q_NHD.dtype)


def ttt_layer(
    draft: Eagle3Draft,
    embedded_NH: torch.Tensor,
    hidden_NH: torch.Tensor,
    positions_N: torch.Tensor,
    seq_lens: Sequence[int],
    cache: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> torch.Tensor:
    """One TTT step of the draft's layer (training): `hidden_NH` the projected features (step 0) or the previous
    step's outputs; `positions_N` the rows' positions (each sequence's row t at t + step, for RoPE); `cache` the
    earlier steps' keys and values, which this step's join. The layer's output (N, H), pre-norm."""
    layer = draft.midlayer
    attn = layer.self_attn
    heads, kv_heads, dim = attn.shape
    x = layer.attention_input(embedded_NH, hidden_NH)
    n = x.shape[0]
    cos, sin = rotary_cos_sin(draft.config.layer, positions_N, x)
    q = apply_rope(attn.q_proj(x).view(n, heads, dim), cos, sin)
    k = apply_rope(attn.k_proj(x).view(n, kv_heads, dim), cos, sin)
    v = attn.v_proj(x).view(n, kv_heads, dim)
    cache[0].append(k)
    cache[1].append(v)
    out = ttt_attention(q, cache[0], cache[1], seq_lens, attn.scale)
    return layer.finish(hidden_NH, attn.o_proj(out.reshape(n, heads * dim)))


__all__ = [
    "DRAFT_PREFIX",
    "EAGLE3_ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Draft",
    "default_aux_layers",
    "eagle3_hidden",
    "ttt_attention",
    "ttt_layer",
]
