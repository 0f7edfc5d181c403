"""Hugging Face <-> Megatron-core weight conversion for the Megatron backend (docs/megatron.md), torch only.

A Megatron-core `GPTModel` stores a Qwen3 / Qwen3-MoE / GLM-4.5 / DeepSeek-V3 decoder under its own names and
layouts; every tensor of one rank's model is one `Entry`: its Megatron name, the HF tensors it is made of, how they are
fused, and how it is split over the ranks of its parallel group.

- Attention: `linear_qkv` fuses q / k / v per query group (for each of the `num_key_value_heads` groups: its query
  heads' rows, then its key head's, then its value head's), so a tensor-parallel (TP) rank's rows are whole groups;
  the q / k / v biases likewise. `linear_proj` (o_proj) is split over TP along its input dimension.
- Multi-head latent attention (DeepSeek-V3, megatron-core's `MLASelfAttention`): one Megatron tensor per HF tensor,
  `linear_q_down_proj` / `q_layernorm` / `linear_q_up_proj` (q_a_proj / q_a_layernorm / q_b_proj; `linear_q_proj`,
  q_proj, without a q-LoRA), `linear_kv_down_proj` / `kv_layernorm` / `linear_kv_up_proj` (kv_a_proj_with_mqa /
  kv_a_layernorm / kv_b_proj), `linear_proj` (o_proj). The up projections split over TP by heads (along their
  output), `linear_proj` along its input; the down projections are column-parallel in the local spec (split along
  their output, gathered before the norms) and replicated in Transformer Engine's, which fuses the latent norms into
  the up projections (`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`) and keeps
  `input_layernorm` apart. megatron-core's MLA always de-interleaves the rotary part of q and k before rotating
  (DeepSeek's adjacent rotary pairs, `rope_interleave`); for a checkpoint that rotates halves instead
  (`rope_interleave=false`), the rotary rows of `linear_q_*proj` and `linear_kv_down_proj` are interleaved
  (`_rope_pairs`), so the de-interleave gives back transformers' layout: a permutation, exact both ways.
- MLP: `linear_fc1` fuses gate and up; each TP rank holds [its gate rows; its up rows]. `linear_fc2` (down_proj) is
  split along its input dimension.
- MoE: the router (`mlp.router.weight`, GLM-4.5's float32 `expert_bias`) is replicated; expert parallelism (EP)
  gives each EP rank a contiguous block of E / EP experts (`mlp.experts.local_experts.{j}`, j local), each split
  over the expert tensor-parallel (ETP) ranks like a dense MLP; shared experts (GLM-4.5) are split over TP.
- Embedding and output layer: split over TP along the vocabulary, padded with zero rows to a multiple of TP
  (`padded_vocab_size`); the padding is dropped on the way back.
- Pipeline parallelism (PP): a stage holds the decoder layers [first_layer, first_layer + num_layers), numbered from
  0 locally; the first stage the embedding, the last the final norm and the output layer (a tied model's last stage
  keeps its own copy of the embedding as `output_layer.weight` when PP > 1, as Megatron does).
- Layer norms: `transformer_impl="local"` keeps `input_layernorm` / `pre_mlp_layernorm`; Transformer Engine fuses
  them into the next linear (`linear_qkv.layer_norm_weight`, a dense layer's `linear_fc1.layer_norm_weight`).
- MTP modules (DeepSeek-V3 / GLM-4.5's `model.layers.{L + i}`, L trunk layers) sit on the last stage as
  megatron-core's `MultiTokenPredictionLayer`s, `mtp.layers.{i}`: `enorm`, `hnorm`, `eh_proj` (split over TP along
  its output, as a column-parallel linear), `transformer_layer` (decoder layer L + i, split like one) and
  `final_layernorm` (`shared_head.norm`). Their embedding and LM head are the trunk's: the HF checkpoint's copies
  (`embed_tokens`, `shared_head.head` under the MTP layer) have no Megatron tensor and are not written back.

`hf_to_megatron` makes one rank's tensors from HF tensors; `merge_shards` puts a tensor's shards from the ranks of
its group back together and `megatron_to_hf` splits the full tensor into its HF tensors, so HF -> Megatron -> HF is
exact (bit for bit) for any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from miles_kernels import ModelConfig

Fusion = Literal["none", "qkv", "gate_up", "q_rope", "kv_rope"]
Group = Literal["tp", "etp", "none"]
IMPLS = ("local", "transformer_engine")
FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")  # the model types the Megatron backend builds
MLA_NORM_EPS = 1e-6  # transformers' eps of MLA's latent norms (q_a_layernorm, kv_a_layernorm), whatever rms_norm_eps


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in the parallel layout: its TP / EP / ETP ranks and the decoder layers of its PP stage
    (`num_layers` None: every layer from `first_layer` on)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    first_layer: int = 0
    num_layers: int | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True
    transformer_impl: str = "local"

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank={rank} must be in [0, {name}_size={size})")
        if self.transformer_impl not in IMPLS:
            raise ValueError(f"transformer_impl={self.transformer_impl!r}: use one of {list(IMPLS)}")

    def layers(self, config: ModelConfig) -> range:
        count = config.num_hidden_layers - self.first_layer if self.num_layers is None else self.num_layers
        return range(self.first_layer, self.first_layer + count)

    def rank_in(self, group: Group) -> tuple[int, int]:
        """(rank, size) of this rank in `group`."""
        if group == "tp":
            return self.tp_rank, self.tp_size
        if group == "etp":
            return self.etp_rank, self.etp_size
        return 0, 1


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor of a rank: `name` (the rank's local name), the HF tensors it fuses (`hf_names`, in
    fusion order), and the group it is split over along `dim` (None: replicated)."""

    name: str
    hf_names: tuple[str, ...]
    fusion: Fusion = "none"
    group: Group = "none"
    dim: int | None = None
    vocab: bool = False  # padded along dim 0 to a multiple of TP


def padded_vocab_size(config: ModelConfig, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of `tp_size` (the embedding's and output layer's rows)."""
    return -(-config.vocab_size // tp_size) * tp_size


def check_convertible(config: ModelConfig, layout: RankLayout) -> None:
    """Raise ValueError naming what Megatron-core (or this conversion) cannot express for `config` and `layout`."""
    if config.model_type not in FAMILIES:
        raise ValueError(f"the Megatron backend builds {', '.join(FAMILIES)}; {config.model_type} runs on fsdp2")
    if config.is_mla:
        _check_mla(config, layout)
    if config.o_proj_bias:
        raise ValueError(
            "attention_bias=true on o_proj: Megatron-core's add_bias_linear would add biases to the MLP too; "
            "use trainer.backend.name=fsdp2"
        )
    if config.sliding_window is not None:
        raise ValueError("sliding-window attention is not wired into the Megatron backend; use fsdp2")
    if config.num_key_value_heads % layout.tp_size:
        raise ValueError(
            f"tp={layout.tp_size} must divide num_key_value_heads={config.num_key_value_heads} (a TP rank holds "
            "whole query groups)"
        )
    if config.router == "sigmoid" and not config.norm_topk_prob and config.num_experts_per_tok > 1:
        raise ValueError(
            "norm_topk_prob=false with the sigmoid router: megatron-core's sigmoid router always renormalizes the "
            "chosen experts' scores; use trainer.backend.name=fsdp2"
        )
    for group, size, name, width in (
        ("tp", layout.tp_size, "intermediate_size", config.intermediate_size),
        ("etp", layout.etp_size, "moe_intermediate_size", config.moe_intermediate_size),
    ):
        if width and width % size:
            raise ValueError(f"{group}={size} must divide {name}={width}")
    if config.is_moe and config.num_experts % layout.ep_size:
        raise ValueError(f"ep={layout.ep_size} must divide the {config.num_experts} experts")
    if config.n_shared_experts and (config.moe_intermediate_size * config.n_shared_experts) % layout.tp_size:
        raise ValueError(f"tp={layout.tp_size} must divide the shared experts' intermediate size")
    stop = layout.layers(config).stop
    if layout.first_layer < 0 or stop > config.num_hidden_layers:
        raise ValueError(
            f"the stage's layers [{layout.first_layer}, {stop}) are outside the model's {config.num_hidden_layers}"
        )


def _check_mla(config: ModelConfig, layout: RankLayout) -> None:
    """What megatron-core's MLA computes differently from transformers' DeepSeek-V3 attention, by setting."""
    if config.attention_bias:
        raise ValueError(
            "deepseek_v3 with attention_bias=true: megatron-core's MLA has no biases on its down projections "
            "(q_a_proj, kv_a_proj_with_mqa); use trainer.backend.name=fsdp2"
        )
    if config.rms_norm_eps != MLA_NORM_EPS:
        raise ValueError(
            f"deepseek_v3 with rms_norm_eps={config.rms_norm_eps}: transformers normalizes MLA's latents "
            f"(q_a_layernorm, kv_a_layernorm) with eps {MLA_NORM_EPS}, megatron-core's MLA with rms_norm_eps; use "
            "trainer.backend.name=fsdp2"
        )
    if config.num_attention_heads % layout.tp_size:
        raise ValueError(
            f"tp={layout.tp_size} must divide num_attention_heads={config.num_attention_heads} (megatron-core's "
            "MLA splits the heads over the TP ranks)"
        )
    if layout.transformer_impl == "local":  # the down projections are column-parallel there
        for name, width in (
            ("q_lora_rank", config.q_lora_rank or 0),
            ("kv_lora_rank + qk_rope_head_dim", config.kv_lora_rank + config.qk_rope_head_dim),
        ):
            if width % layout.tp_size:
                raise ValueError(
                    f"tp={layout.tp_size} must divide {name}={width} (megatron-core's local MLA splits its down "
                    "projections' outputs over the TP ranks)"
                )


def _mlp_entries(prefix: str, hf: str, group: Group) -> list[Entry]:
    return [
        Entry(f"{prefix}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "gate_up", group, 0),
        Entry(f"{prefix}.linear_fc2.weight", (f"{hf}.down_proj.weight",), "none", group, 1),
    ]


def _mla_entries(config: ModelConfig, attn: str, hf: str, te: bool) -> list[Entry]:
    """MLA's tensors (megatron-core's `MLASelfAttention` at `attn`; the module docstring has the layout)."""
    down: tuple[Group, int | None] = ("none", None) if te else ("tp", 0)  # TE: replicated; local: column-parallel
    q_rope: Fusion = "none" if config.rope_interleave else "q_rope"
    kv_rope: Fusion = "none" if config.rope_interleave else "kv_rope"
    entries: list[Entry] = []
    if config.q_lora_rank is None:
        entries.append(Entry(f"{attn}.linear_q_proj.weight", (f"{hf}.q_proj.weight",), q_rope, "tp", 0))
    else:
        entries += [
            Entry(f"{attn}.linear_q_down_proj.weight", (f"{hf}.q_a_proj.weight",), "none", *down),
            Entry(f"{attn}.linear_q_up_proj.layer_norm_weight" if te else f"{attn}.q_layernorm.weight",
                  (f"{hf}.q_a_layernorm.weight",)),
            Entry(f"{attn}.linear_q_up_proj.weight", (f"{hf}.q_b_proj.weight",), q_rope, "tp", 0),
        ]  # fmt: skip
    return [
        *entries,
        Entry(f"{attn}.linear_kv_down_proj.weight", (f"{hf}.kv_a_proj_with_mqa.weight",), kv_rope, *down),
        Entry(f"{attn}.linear_kv_up_proj.layer_norm_weight" if te else f"{attn}.kv_layernorm.weight",
              (f"{hf}.kv_a_layernorm.weight",)),
        Entry(f"{attn}.linear_kv_up_proj.weight", (f"{hf}.kv_b_proj.weight",), "none", "tp", 0),
        Entry(f"{attn}.linear_proj.weight", (f"{hf}.o_proj.weight",), "none", "tp", 1),
    ]  # fmt: skip


def layer_entries(
    config: ModelConfig, layer: int, local: int, layout: RankLayout, prefix: str | None = None
) -> list[Entry]:
    """The Megatron tensors of decoder layer `layer` (global index), named with its index `local` on the stage
    (`prefix`: the layer's Megatron name instead, an MTP module's `mtp.layers.{i}.transformer_layer`)."""
    meg, hf = prefix or f"decoder.layers.{local}", f"model.layers.{layer}"
    te = layout.transformer_impl == "transformer_engine"
    attn = f"{meg}.self_attention"
    if config.is_mla:  # Transformer Engine's MLA spec keeps input_layernorm apart
        entries = [Entry(f"{meg}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)),
                   *_mla_entries(config, attn, f"{hf}.self_attn", te)]  # fmt: skip
    else:
        entries = _attention_entries(config, meg, attn, hf, te)
    norm = (f"{hf}.post_attention_layernorm.weight",)
    if not config.is_moe_layer(layer):
        entries.append(Entry(f"{meg}.mlp.linear_fc1.layer_norm_weight" if te else f"{meg}.pre_mlp_layernorm.weight",
                             norm))  # fmt: skip
        return entries + _mlp_entries(f"{meg}.mlp", f"{hf}.mlp", "tp")
    entries += [Entry(f"{meg}.pre_mlp_layernorm.weight", norm),
                Entry(f"{meg}.mlp.router.weight", (f"{hf}.mlp.gate.weight",))]  # fmt: skip
    if config.router == "sigmoid":
        entries.append(Entry(f"{meg}.mlp.router.expert_bias", (f"{hf}.mlp.gate.e_score_correction_bias",)))
    per_rank = config.num_experts // layout.ep_size
    for j in range(per_rank):
        expert = layout.ep_rank * per_rank + j
        entries += _mlp_entries(f"{meg}.mlp.experts.local_experts.{j}", f"{hf}.mlp.experts.{expert}", "etp")
    if config.n_shared_experts:
        entries += _mlp_entries(f"{meg}.mlp.shared_experts", f"{hf}.mlp.shared_experts", "tp")
    return entries


def _attention_entries(config: ModelConfig, meg: str, attn: str, hf: str, te: bool) -> list[Entry]:
    """Grouped-query attention's tensors (megatron-core's `SelfAttention` at `attn`) and the layer's input norm."""
    qkv_names = tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv")
    entries = [
        Entry(f"{attn}.linear_qkv.layer_norm_weight" if te else f"{meg}.input_layernorm.weight",
              (f"{hf}.input_layernorm.weight",)),
        Entry(f"{attn}.linear_qkv.weight", qkv_names, "qkv", "tp", 0),
        Entry(f"{attn}.linear_proj.weight", (f"{hf}.self_attn.o_proj.weight",), "none", "tp", 1),
    ]  # fmt: skip
    if config.attention_bias:
        entries.append(Entry(f"{attn}.linear_qkv.bias", tuple(f"{hf}.self_attn.{p}_proj.bias" for p in "qkv"),
                             "qkv", "tp", 0))  # fmt: skip
    if config.use_qk_norm:
        entries += [Entry(f"{attn}.q_layernorm.weight", (f"{hf}.self_attn.q_norm.weight",)),
                    Entry(f"{attn}.k_layernorm.weight", (f"{hf}.self_attn.k_norm.weight",))]  # fmt: skip
    return entries


def rank_entries(config: ModelConfig, layout: RankLayout) -> list[Entry]:
    """Every Megatron tensor of the rank at `layout`, in the model's order."""
    check_convertible(config, layout)
    entries: list[Entry] = []
    if layout.is_first_stage:
        entries.append(Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "none", "tp", 0,
                             vocab=True))  # fmt: skip
    for local, layer in enumerate(layout.layers(config)):
        entries += layer_entries(config, layer, local, layout)
    if layout.is_last_stage:
        entries.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",)))
        if not config.tie_word_embeddings or not layout.is_first_stage:
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            entries.append(Entry("output_layer.weight", (head,), "none", "tp", 0, vocab=True))
        entries += mtp_entries(config, layout)
    return entries


MTP_PREFIX = "mtp."  # the MTP modules' Megatron names (not the GPTModel's: megatron_mtp.py builds them beside it)


def mtp_entries(config: ModelConfig, layout: RankLayout) -> list[Entry]:
    """The MTP modules' tensors (`MTP_PREFIX`; on the last stage), in megatron-core's order."""
    entries: list[Entry] = []
    for i in range(config.num_nextn_predict_layers):
        layer = config.num_hidden_layers + i
        meg, hf = f"{MTP_PREFIX}layers.{i}", f"model.layers.{layer}"
        entries += [Entry(f"{meg}.enorm.weight", (f"{hf}.enorm.weight",)),
                    Entry(f"{meg}.hnorm.weight", (f"{hf}.hnorm.weight",)),
                    Entry(f"{meg}.eh_proj.weight", (f"{hf}.eh_proj.weight",), "none", "tp", 0)]  # fmt: skip
        entries += layer_entries(config, layer, i, layout, prefix=f"{meg}.transformer_layer")
        entries.append(Entry(f"{meg}.final_layernorm.weight", (f"{hf}.shared_head.norm.weight",)))
    return entries


def _rope_pairs(entry: Entry, config: ModelConfig, device: torch.device) -> torch.Tensor:
    """For `rope_interleave=false`: the HF row of each Megatron row of an MLA q projection (`q_rope`: per head, its
    qk_nope_head_dim rows, then its rotary rows) or of the kv down projection (`kv_rope`: the kv_lora_rank rows,
    then the rotary key's). megatron-core de-interleaves a rotary part x into [x0, x2, ..., x1, x3, ...] before
    rotating halves; transformers rotates the halves of x as it is. So Megatron's rotary row 2i is HF's row i and
    row 2i + 1 is HF's row R/2 + i (R = qk_rope_head_dim): the de-interleave gives back HF's order."""
    rope = config.qk_rope_head_dim
    pairs = torch.arange(rope, device=device).view(2, rope // 2).t().reshape(-1)  # 0, R/2, 1, R/2 + 1, ...
    if entry.fusion == "q_rope":
        lead, blocks = config.qk_nope_head_dim, config.num_attention_heads
    else:
        lead, blocks = config.kv_lora_rank, 1
    block = torch.cat([torch.arange(lead, device=device), lead + pairs])
    return (torch.arange(blocks, device=device)[:, None] * (lead + rope) + block).reshape(-1)


def _fuse(entry: Entry, tensors: Sequence[torch.Tensor], config: ModelConfig, size: int) -> torch.Tensor:
    """The full Megatron tensor, laid out so that splitting it in `size` equal chunks along `entry.dim` gives each
    rank its shard."""
    if entry.fusion == "qkv":
        q, k, v = tensors
        groups, head = config.num_key_value_heads, config.head_dim
        per_group = config.num_attention_heads // groups
        rest = q.shape[1:]
        q = q.reshape(groups, per_group * head, *rest)
        k, v = k.reshape(groups, head, *rest), v.reshape(groups, head, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    if entry.fusion == "gate_up":
        gate, up = tensors
        chunks = [t.chunk(size, dim=0) for t in (gate, up)]
        return torch.cat([part for rank in range(size) for part in (chunks[0][rank], chunks[1][rank])], dim=0)
    (tensor,) = tensors
    if entry.fusion in ("q_rope", "kv_rope"):
        return tensor[_rope_pairs(entry, config, tensor.device)]
    if entry.vocab:
        rows = -(-tensor.shape[0] // size) * size
        if rows != tensor.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
    return tensor


def hf_to_megatron(
    get_hf: Callable[[str], torch.Tensor], config: ModelConfig, layout: RankLayout
) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors (contiguous copies), made from the HF tensors `get_hf(name)` returns."""
    out: dict[str, torch.Tensor] = {}
    for entry in rank_entries(config, layout):
        rank, size = layout.rank_in(entry.group)
        full = _fuse(entry, [get_hf(name) for name in entry.hf_names], config, size)
        shard = full if entry.dim is None else full.chunk(size, dim=entry.dim)[rank]
        out[entry.name] = shard.contiguous().clone()
    return out


def merge_shards(entry: Entry, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from its shards on the ranks of `entry.group` (in rank order)."""
    if entry.dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(list(shards), dim=entry.dim)


def megatron_to_hf(entry: Entry, full: torch.Tensor, config: ModelConfig, size: int) -> dict[str, torch.Tensor]:
    """The HF tensors of a full Megatron tensor (`merge_shards`' result; `size` ranks shared it)."""
    if entry.fusion == "qkv":
        groups, head = config.num_key_value_heads, config.head_dim
        per_group = config.num_attention_heads // groups
        rest = full.shape[1:]
        grouped = full.reshape(groups, (per_group + 2) * head, *rest)
        q, k, v = torch.split(grouped, [per_group * head, head, head], dim=1)
        parts = [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    elif entry.fusion == "gate_up":
        halves = [chunk.chunk(2, dim=0) for chunk in full.chunk(size, dim=0)]
        parts = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    elif entry.fusion in ("q_rope", "kv_rope"):
        hf = torch.empty_like(full)
        hf[_rope_pairs(entry, config, full.device)] = full
        parts = [hf]
    else:
        parts = [full[: config.vocab_size] if entry.vocab else full]
    return {name: part.contiguous() for name, part in zip(entry.hf_names, parts, strict=True)}


def peers(entry: Entry, layout: RankLayout) -> list[RankLayout]:
    """The ranks that hold a shard of `entry` with `layout` (itself included), in the order of their shards."""
    if entry.group == "none":
        return [layout]
    _, size = layout.rank_in(entry.group)
    if entry.group == "tp":
        return [replace(layout, tp_rank=rank) for rank in range(size)]
    return [replace(layout, etp_rank=rank) for rank in range(size)]


def hf_from_megatron(
    config: ModelConfig, layouts: Sequence[RankLayout], shard: Callable[[RankLayout, str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from the Megatron tensors of the ranks `layouts` (`shard(layout, name)`), each HF tensor once, in
    the order of the ranks' entries: the offline conversion and its tests, where one process holds every rank's
    tensors."""
    seen: set[str] = set()
    for layout in layouts:
        for entry in rank_entries(config, layout):
            if entry.hf_names[0] in seen:
                continue
            full = merge_shards(entry, [shard(peer, entry.name) for peer in peers(entry, layout)])
            for name, tensor in megatron_to_hf(entry, full, config, layout.rank_in(entry.group)[1]).items():
                seen.add(name)
                yield name, tensor
