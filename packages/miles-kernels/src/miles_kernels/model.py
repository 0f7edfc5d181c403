"""The Qwen3 / Qwen2.5 / Llama 3.x dense and Qwen3-MoE / GLM-4.5 / DeepSeek-V3 MoE causal LM that both the rollout
engine and the trainer run (its basic modules in layers.py, the MoE block in sparse_moe.py, DeepSeek-V3's multi-head
latent attention in latent_attention.py).

One plain, single-device definition (parallelism, checkpointing and compilation are applied from outside).
Parameter names are the Hugging Face checkpoint names, so `state_dict()` *is* the checkpoint (minus the tied
`lm_head.weight`). Every op goes through miles_kernels.ops with the model's `KernelConfig`.

Callers:
- engine: `forward_hidden(ids, batch, kv_store)` with a persistent paged `KVStore` (prefill, chunked prefill
  after a cached prefix, decode), then `logits(hidden of the rows it samples from)`;
- trainer: `forward_hidden(ids, build_packed_batch(...))` with no store (a temporary one is made, so the
  trainer runs the engine's exact attention code), then `logits` / `token_logprobs` of every row; with routing
  replay it passes the engine's recorded experts (`routing_NLK`, see ops/moe.py).
After a forward, `last_routing()` is every MoE layer's choice in SGLang's routed-experts layout.
Shapes: N tokens, H hidden, V vocab, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.fused_layer import attention_half
from miles_kernels.kv_cache import KVStore
from miles_kernels.latent_attention import LatentAttention
from miles_kernels.layers import MLP, Linear, RMSNorm
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.activation import swiglu
from miles_kernels.ops.attention import attention, packed_attention
from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.ops.kv_pages import write_kv
from miles_kernels.ops.linear import linear
from miles_kernels.ops.rope import (
    apply_rope,
    inv_frequencies,
    llama3_inv_frequencies,
    rope_cos_sin,
    yarn_inv_frequencies,
)
from miles_kernels.ops.sampling import token_logprobs
from miles_kernels.sparse_moe import SparseMoE

if TYPE_CHECKING:
    from miles_kernels.eagle3 import Eagle3Draft

DRAFT_PREFIX = "eagle3."  # an attached EAGLE-3 draft's tensors (`CausalLM.attach_eagle3`; eagle3.py)


def _embedding(config: ModelConfig) -> nn.Embedding:
    """An embedding whose weight is left uninitialized, as every other weight here (a checkpoint or
    `miles_kernels.testing.random_model` fills it): `nn.Embedding`'s own normal init would draw from the global RNG,
    and on the meta device (`load_model`) it runs through torch's reference kernels, whose first use imports
    torch._dynamo (6.5 s of an engine's start-up on the reference CPU)."""
    weight = torch.empty(config.vocab_size, config.hidden_size)
    return nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)


# RoPE's cos / sin of positions 0 .. L - 1 per (config, dtype), on the CPU (`rotary_cos_sin`), by the config's id:
# an entry holds its config (so the id is not reused while it is here); the most recently built few are kept
_ROPE_TABLES: OrderedDict[tuple[int, torch.dtype], tuple[ModelConfig, torch.Tensor, torch.Tensor]] = OrderedDict()
_ROPE_TABLES_KEPT = 8
ROPE_TABLE_MAX_POSITIONS = 1 << 16  # positions past this are computed per call


def rotary_cos_sin(
    config: ModelConfig, positions_N: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos / sin (N, rotary_dim) of `positions_N` for `config`, in `like`'s dtype on its device; the frequencies
    are float32, whatever the model dtype. Every model running the engine's arithmetic takes its tables here (the
    trainer's Megatron layers too). On the CPU the rows are gathered from tables of positions 0 .. L - 1 computed
    once per config and dtype (L a power of two past the largest position asked for, up to
    `ROPE_TABLE_MAX_POSITIONS`): a position's angles are elementwise, so its row has the bits of computing it in any
    batch (tested), and a forward skips cos and sin, which MKL's vector math spreads over the threads at every call
    (0.1-0.3 ms a forward on a 2-core VM, most of it waking the other thread)."""
    if not like.is_cpu or not positions_N.numel():
        return _rotary_cos_sin(config, positions_N, like)
    top = int(positions_N.max()) + 1
    if top > ROPE_TABLE_MAX_POSITIONS:
        return _rotary_cos_sin(config, positions_N, like)
    key = (id(config), like.dtype)
    entry = _ROPE_TABLES.get(key)
    if entry is None or entry[1].shape[0] < top:
        positions = torch.arange(max(64, 1 << (top - 1).bit_length()))
        entry = _ROPE_TABLES[key] = (config, *_rotary_cos_sin(config, positions, like))
        while len(_ROPE_TABLES) > _ROPE_TABLES_KEPT:
            _ROPE_TABLES.popitem(last=False)
    return entry[1].index_select(0, positions_N), entry[2].index_select(0, positions_N)


def _rotary_cos_sin(
    config: ModelConfig, positions_N: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_cos_sin` computed for these positions (the frequencies recomputed: rotary_dim / 2 values)."""
    if config.rope_type == "yarn":
        inv_freq = yarn_inv_frequencies(
            config.rotary_dim, config.rope_theta, config.rope_factor, config.rope_original_max_position_embeddings,
            config.rope_beta_fast, config.rope_beta_slow, device=like.device,
        )  # fmt: skip
        return rope_cos_sin(positions_N, inv_freq, like.dtype, config.rope_attention_factor)
    inv_freq = inv_frequencies(config.rotary_dim, config.rope_theta, like.device)
    if config.rope_scaling is not None:
        inv_freq = llama3_inv_frequencies(inv_freq, **config.rope_scaling)
    return rope_cos_sin(positions_N, inv_freq, like.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kernel: KernelConfig, layer: int) -> None:
        super().__init__()
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, heads * dim, bias, kernel)
        self.k_proj = Linear(config.hidden_size, kv_heads * dim, bias, kernel)
        self.v_proj = Linear(config.hidden_size, kv_heads * dim, bias, kernel)
        self.o_proj = Linear(heads * dim, config.hidden_size, config.o_proj_bias, kernel)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps, kernel) if config.use_qk_norm else None
        self.k_norm = RMSNorm(dim, config.rms_norm_eps, kernel) if config.use_qk_norm else None
        self.shape = (heads, kv_heads, dim)
        self.scale = dim**-0.5
        self.window = config.attention_window(layer)
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
        heads, kv_heads, dim = self.shape
        num_tokens = x_NH.shape[0]
        q = self.q_proj(x_NH).view(num_tokens, heads, dim)
        k = self.k_proj(x_NH).view(num_tokens, kv_heads, dim)
        if self.q_norm is not None and self.k_norm is not None:  # QK-norm (per head, before RoPE)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x_NH).view(num_tokens, kv_heads, dim)
        if k_pages is None or v_pages is None:  # no cache (the trainer): the batch's own keys, in a temporary store
            out = packed_attention(q, k, v, batch, self.scale, self.kernel, self.window)
        else:  # the engine's cache: write in place, then attend over everything the sequences hold
            write_kv(k_pages, v_pages, k, v, batch)
            out = attention(q, k_pages, v_pages, batch, self.scale, self.kernel, self.window)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, heads * dim))
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernel: KernelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn: nn.Module = (
            LatentAttention(config, kernel, layer) if config.is_mla else Attention(config, kernel, layer)
        )
        self.mlp: nn.Module = (
            SparseMoE(config, kernel)
            if config.is_moe_layer(layer)
            else MLP(config.hidden_size, config.intermediate_size, kernel)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)

    def forward(
        self,
        x_NH: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_pages: torch.Tensor | None,
        v_pages: torch.Tensor | None,
        replay_NK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            k_pages is not None
            and v_pages is not None
            and isinstance(self.self_attn, Attention)
            and type(self.mlp) is MLP
        ):
            norms = (self.input_layernorm, self.post_attention_layernorm)
            fused = attention_half(self.self_attn, self.mlp, norms, x_NH, cos, sin, batch, k_pages, v_pages)
            if fused is not None:  # the engine's dense layer, its attention half in one native call (fused_layer.py)
                x_NH, gate, up = fused
                fused_out: torch.Tensor = x_NH + self.mlp.down_proj(swiglu(gate, up))
                return fused_out
        x_NH = x_NH + self.self_attn(self.input_layernorm(x_NH), cos, sin, batch, k_pages, v_pages)
        normed = self.post_attention_layernorm(x_NH)
        mlp_out = self.mlp(normed, replay_NK) if isinstance(self.mlp, SparseMoE) else self.mlp(normed)
        out: torch.Tensor = x_NH + mlp_out
        return out


class SharedHead(nn.Module):
    """An MTP module's output head: its own final norm, and the trunk's LM head (`shared_head.head`, tied)."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.head = Linear(config.hidden_size, config.vocab_size, False, kernel)


class MTPLayer(DecoderLayer):
    """One MTP (multi-token prediction) module, DeepSeek-V3 / GLM-4.5 form, at `model.layers.{L + i}` (L trunk
    layers): its decoder layer's weights sit directly under it, next to `enorm`, `hnorm`, `eh_proj` and
    `shared_head.norm`. `embed_tokens` and `shared_head.head` are the trunk's embedding and LM head, tied (those
    families' checkpoints store copies under the MTP layer; `CausalLM.mtp_hidden` has the formula)."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig, layer: int) -> None:
        super().__init__(config, kernel, layer)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, False, kernel)
        self.embed_tokens = _embedding(config)
        self.shared_head = SharedHead(config, kernel)

    def forward(  # type: ignore[override]
        self,
        embedded_NH: torch.Tensor,
        hidden_NH: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_pages: torch.Tensor | None,
        v_pages: torch.Tensor | None,
    ) -> torch.Tensor:
        """shared_head.norm(decoder_layer(eh_proj([enorm(embedded) ; hnorm(hidden)]))): all of the module's own
        weights are used inside its forward (a sharded module gathers them there)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded_NH), self.hnorm(hidden_NH.to(embedded_NH.dtype))], dim=-1))
        out: torch.Tensor = self.shared_head.norm(super().forward(x, cos, sin, batch, k_pages, v_pages))
        return out


class Backbone(nn.Module):
    """`model.*` in the HF checkpoint: embeddings, decoder layers (then the MTP modules, if any), final norm."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig) -> None:
        super().__init__()
        trunk = config.num_hidden_layers
        self.embed_tokens = _embedding(config)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, kernel, i) for i in range(trunk)]
            + [MTPLayer(config, kernel, trunk + i) for i in range(config.num_nextn_predict_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernel)


class CausalLM(nn.Module):
    """Qwen3 / Qwen3-MoE / GLM-4.5 MoE for causal LM, on miles kernels."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernel = kernel or KernelConfig()
        self.model = Backbone(config, self.kernel)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, self.kernel)
        self.eagle3: Eagle3Draft | None = None  # an attached EAGLE-3 draft (`attach_eagle3`)
        self.last_draft_features: torch.Tensor | None = None  # its input from the last trunk forward (N, 3H)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the embeddings when the config ties them, and both with every MTP module's
        copies (again after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.model.embed_tokens.weight)
        for mtp in self.mtp_layers:
            mtp.embed_tokens.weight = self.model.embed_tokens.weight
            mtp.shared_head.head.weight = self.lm_head.weight

    def mtp_copy_names(self) -> dict[str, str]:
        """Each MTP module's checkpoint copy of a trunk tensor -> the trunk tensor's name (they are one tensor)."""
        trunk = self.config.num_hidden_layers
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        out = {}
        for i in range(self.config.num_nextn_predict_layers):
            out[f"model.layers.{trunk + i}.embed_tokens.weight"] = "model.embed_tokens.weight"
            out[f"model.layers.{trunk + i}.shared_head.head.weight"] = head
        return out

    @property
    def trunk_layers(self) -> list[DecoderLayer]:
        """The decoder layers of the trunk (the MTP modules excluded)."""
        return cast(list[DecoderLayer], list(self.model.layers)[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        """The MTP modules, in order (empty for a model without them)."""
        return cast(list[MTPLayer], list(self.model.layers)[self.config.num_hidden_layers :])

    def trunk_linears(self) -> dict[str, Linear]:
        """The decoder trunk's linear layers by name (attention, MLP, routed and shared experts, MLA projections):
        the ones LoRA adapts and low-precision weights quantize. The LM head, embeddings, routers (Qwen3-MoE's
        `mlp.gate` is a linear layer) and MTP layers are left out."""
        trunk = tuple(f"model.layers.{i}." for i in range(self.config.num_hidden_layers))
        return {
            name: module for name, module in self.named_modules()
            if isinstance(module, Linear) and name.startswith(trunk) and not name.endswith("mlp.gate")
        }  # fmt: skip

    def mtp_parameters(self) -> list[nn.Parameter]:
        """The MTP modules' own weights, in order: the embedding and LM head they share with the trunk excluded."""
        shared = {id(self.model.embed_tokens.weight), id(self.lm_head.weight)}
        return [p for layer in self.mtp_layers for p in layer.parameters() if id(p) not in shared]

    def draft_parameters(self) -> list[nn.Parameter]:
        """Every draft's own weights: the MTP modules', then an attached EAGLE-3 draft's."""
        return self.mtp_parameters() + (list(self.eagle3.parameters()) if self.eagle3 is not None else [])

    def attach_eagle3(self, draft: Eagle3Draft) -> None:
        """Make `draft` this model's EAGLE-3 draft (submodule `eagle3`: moved, sharded, checkpointed and weight-synced
        with the model, left out of Hugging Face saving); trunk forwards then keep its `last_draft_features`."""
        draft.check_target(self.config)
        self.eagle3 = draft

    def forward_hidden(
        self,
        input_ids_N: torch.Tensor,
        batch: AttentionBatch,
        kv_store: KVStore | None = None,
        routing_NLK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (N, H) of the batch's tokens; writes their K/V into `kv_store` if given.

        `routing_NLK` (routing replay): expert ids (N, num_hidden_layers, K) in `last_routing`'s layout that the MoE
        layers use instead of their router's choice; a row with a negative id routes normally in that layer (a
        token the engine recorded nothing for); dense layers' entries are ignored.
        """
        if input_ids_N.shape[0] != batch.num_tokens:
            raise ValueError(f"got {input_ids_N.shape[0]} input ids for a batch of {batch.num_tokens} tokens")
        if routing_NLK is not None:
            expected = (batch.num_tokens, self.config.num_hidden_layers, self.config.num_experts_per_tok)
            if not self.config.is_moe or tuple(routing_NLK.shape) != expected:
                raise ValueError(
                    f"replayed routing has shape {tuple(routing_NLK.shape)}; this {self.config.model_type} model "
                    + (f"routes (tokens, layers, top_k) = {expected}" if self.config.is_moe else "has no MoE layer")
                )
        x = self.model.embed_tokens(input_ids_N)
        batch = batch.to(x.device)  # a batch laid out on the host (the trainer's packing) runs on the model's device
        cos, sin = self._rope(batch, x)
        capture = self.eagle3.config.aux_layers if self.eagle3 is not None else ()
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.trunk_layers):
            k_pages, v_pages = (None, None) if kv_store is None else (kv_store.k[index], kv_store.v[index])
            replay = routing_NLK[:, index] if routing_NLK is not None and isinstance(layer.mlp, SparseMoE) else None
            x = layer(x, cos, sin, batch, k_pages, v_pages, replay)
            if index in capture:
                captured[index] = x
        if capture:
            self.last_draft_features = torch.cat([captured[i] for i in capture], dim=-1)
        normed: torch.Tensor = self.model.norm(x)
        return normed

    def mtp_hidden(
        self,
        hidden_NH: torch.Tensor,
        next_ids_N: torch.Tensor,
        batch: AttentionBatch,
        module: int = 0,
        detach_trunk: bool = False,
        kv_store: KVStore | None = None,
    ) -> torch.Tensor:
        """Output hidden states (N, H) of MTP module `module`, whose `logits` predict one token further.

        Row t of the batch, with h_t the previous depth's output at t (the trunk's final-norm hidden state for
        module 0, module i - 1's output for module i) and x_{t+1} the token after t (`next_ids_N`, the input of
        row t + 1; its last row of a sequence predicts nothing and may hold any id):

            e_t = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)])        (a concatenation, 2H -> H)
            out_t = shared_head.norm(decoder_layer(e_t))             (attention over the sequence's rows <= t)

        so `logits(out_t)` scores token t + 2 + module. Attention runs on the batch's positions, the same kernels as
        the trunk: with a temporary KV (the trainer's), or in `kv_store`'s layer L + module (the engine's draft,
        which writes the rows' K/V there; see `KVStore.allocate(num_draft_layers=)`). `detach_trunk`: the
        embedding (shared with the trunk) and `hidden_NH` enter detached, so a loss on the output trains the MTP
        module only.
        """
        layers = self.mtp_layers
        if not 0 <= module < len(layers):
            raise ValueError(
                f"MTP module {module} does not exist: the model has {len(layers)} (num_nextn_predict_layers)"
            )
        mtp = layers[module]
        if next_ids_N.shape[0] != batch.num_tokens or hidden_NH.shape[0] != batch.num_tokens:
            raise ValueError(
                f"got {hidden_NH.shape[0]} hidden states and {next_ids_N.shape[0]} next ids for a batch of "
                f"{batch.num_tokens} tokens"
            )
        weight = self.model.embed_tokens.weight
        embedded = F.embedding(next_ids_N, weight.detach() if detach_trunk else weight)
        if detach_trunk:
            hidden_NH = hidden_NH.detach()
        batch = batch.to(embedded.device)
        cos, sin = self._rope(batch, embedded)
        if kv_store is None:
            out: torch.Tensor = mtp(embedded, hidden_NH, cos, sin, batch, None, None)
            return out
        layer = self.config.num_hidden_layers + module
        if len(kv_store.k) <= layer:
            raise ValueError(f"the KV store has no layer for MTP module {module}: allocate it with num_draft_layers")
        out = mtp(embedded, hidden_NH, cos, sin, batch, kv_store.k[layer], kv_store.v[layer])
        return out

    def token_embeddings(self, ids_N: torch.Tensor) -> torch.Tensor:
        """The trunk's embedding of `ids_N` (N, H), detached: a draft's input that trains nothing of the trunk."""
        return F.embedding(ids_N, self.model.embed_tokens.weight.detach())

    def _rope(self, batch: AttentionBatch, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(self.config, batch.positions_N, like)

    def mtp_logits(self, hidden_NH: torch.Tensor, detach_trunk: bool = False) -> torch.Tensor:
        """LM-head logits (N, V, float32) of MTP outputs; `detach_trunk`: the shared LM head enters detached."""
        weight = self.lm_head.weight
        logits = linear(hidden_NH, weight.detach() if detach_trunk else weight, self.kernel)
        return logits.to(torch.float32)

    def logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """LM-head logits (N, V) in float32 (computed in the model dtype, then widened)."""
        logits: torch.Tensor = self.lm_head(hidden_NH)
        return logits.to(torch.float32)

    def token_logprobs(
        self, input_ids_N: torch.Tensor, batch: AttentionBatch, temperature: float = 1.0
    ) -> torch.Tensor:
        """Log-prob of each next token under the log-prob contract: row i scores token i + 1 of its sequence.

        Returns (N,) with the last position of each sequence set to 0 (it has no next token in the batch).
        """
        logits = self.logits(self.forward_hidden(input_ids_N, batch))
        next_ids = torch.roll(input_ids_N, -1)
        temps = logits.new_full((logits.shape[0], 1), temperature)
        logprobs = token_logprobs(logits, next_ids, temps)
        ends = torch.cumsum(batch.query_lens_S.to(logprobs.device), 0) - 1
        return logprobs.index_fill(0, ends, 0.0)

    def moe_layers(self) -> dict[int, SparseMoE]:
        """The trunk's MoE blocks by layer index (empty for a dense model)."""
        return {i: layer.mlp for i, layer in enumerate(self.trunk_layers) if isinstance(layer.mlp, SparseMoE)}

    def last_routing(self) -> torch.Tensor | None:
        """The experts of every token of the last trunk forward, in SGLang's routed-experts layout: int32
        (N, num_hidden_layers, num_experts_per_tok), each row in rank order, dense layers' rows 0 (SGLang leaves them
        unwritten in a zeroed buffer); None for a dense model or before a forward."""
        layers = self.moe_layers()
        if not layers or any(moe.last_routing is None for moe in layers.values()):
            return None
        first = next(iter(layers.values())).last_routing
        assert first is not None
        ids = first.expert_ids
        out = torch.zeros(
            ids.shape[0], self.config.num_hidden_layers, ids.shape[1], dtype=torch.int32, device=ids.device
        )
        for index, moe in layers.items():
            assert moe.last_routing is not None
            out[:, index] = moe.last_routing.expert_ids
        return out
