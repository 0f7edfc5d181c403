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

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.kv_cache import KVStore
from miles_kernels.layers import Linear, RMSNorm
from miles_kernels.model import DRAFT_PREFIX, MLP, Attention, CausalLM, rotary_cos_sin
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.ops.rope import apply_rope

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# tensors of a SpecForge checkpoint that Miles reads no value from: the draft embeds with the target's embedding
_IGNORED = ("embed_tokens.weight",)


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

    def _apply(self, fn: Any, recurse: bool = True) -> Eagle3Draft:
        """Device moves apply to the vocabulary maps, dtype casts do not (they are ids and flags)."""
        maps = (self.d2t, self.t2d)
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self.d2t.dtype != torch.int64 or self.t2d.dtype != torch.bool:
            self.d2t = nn.Buffer(maps[0].to(device=self.d2t.device))
            self.t2d = nn.Buffer(maps[1].to(device=self.t2d.device))
        return out  # type: ignore[no-any-return]

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


def init_eagle3(draft: Eagle3Draft, seed: int = 0, std: float = 0.02) -> Eagle3Draft:
    """Fill a new draft's weights reproducibly (Hugging Face's Llama init: normal(0, std) matrices, unit norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
    return draft


def draft_vocab_from_counts(counts_V: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the `draft_vocab_size` most frequent tokens (SpecForge's `generate_vocab_mapping_file`: ties
    and unseen tokens by id), kept in id order."""
    vocab = counts_V.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be between 1 and the vocabulary's {vocab}")
    order = sorted(range(vocab), key=lambda i: (-int(counts_V[i]), i))
    kept = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def set_draft_vocab(draft: Eagle3Draft, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    ids = d2t.to(torch.int64) + torch.arange(d2t.shape[0])
    vocab = draft.config.layer.vocab_size
    if d2t.shape != draft.d2t.shape or t2d.shape != draft.t2d.shape:
        raise ValueError(
            f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit a draft vocabulary of "
            f"{draft.config.draft_vocab_size} over {vocab} tokens"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
        raise ValueError("d2t and t2d disagree: draft token i must be target token i + d2t[i], and t2d marks those")
    with torch.no_grad():
        draft.d2t.copy_(d2t.to(draft.d2t.device))
        draft.t2d.copy_(t2d.to(draft.t2d.device))


def new_eagle3(
    target: ModelConfig,
    kernel: KernelConfig | None = None,
    draft_vocab_size: int | None = None,
    token_counts_V: torch.Tensor | None = None,
    seed: int = 0,
    aux_layers: Sequence[int] | None = None,
) -> Eagle3Draft:
    """A new, randomly initialized draft for `target` (float32): the full vocabulary, or the `draft_vocab_size`
    most frequent tokens of `token_counts_V` (by id without counts)."""
    config = Eagle3Config.for_target(target, draft_vocab_size, aux_layers)
    draft = init_eagle3(Eagle3Draft(config, kernel).to(torch.float32), seed)
    counts = token_counts_V if token_counts_V is not None else torch.zeros(target.vocab_size)
    set_draft_vocab(draft, *draft_vocab_from_counts(counts, config.draft_vocab_size))
    return draft


def is_eagle3_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds an EAGLE-3 draft's config.json."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    return EAGLE3_ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])


def load_eagle3(
    path: str | os.PathLike[str],
    target: ModelConfig,
    kernel: KernelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Draft:
    """Read a SpecForge-format draft for `target` (ValueError naming what does not fit; FileNotFoundError without
    one). Parameters in `dtype` (default: the kernel's), the vocabulary maps as stored."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no EAGLE-3 draft at {directory}: {CONFIG_FILE} is missing")
    kernel = kernel or KernelConfig()
    config = Eagle3Config.from_hf(json.loads((directory / CONFIG_FILE).read_text()), target)
    with torch.device("meta"):
        draft = Eagle3Draft(config, kernel)
    draft = draft.to_empty(device=device).to(dtype or kernel.torch_dtype)
    load_eagle3_state(draft, dict(_read_tensors(directory)), complete=True)
    return draft.eval()


def load_eagle3_state(draft: Eagle3Draft, tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Copy SpecForge-named tensors into the draft (cast to its dtype); `complete`: every tensor must be there."""
    own = dict(draft.named_parameters()) | dict(draft.named_buffers())
    seen = set()
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in _IGNORED:
                continue
            if name not in own:
                raise ValueError(
                    f"unexpected tensor {name!r}: an EAGLE-3 draft ({EAGLE3_ARCHITECTURE}) has no such weight"
                )
            target = own[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the draft expects {tuple(target.shape)}"
                )
            if name in ("d2t", "t2d"):
                continue  # checked together below
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
            seen.add(name)
        if "d2t" in tensors or "t2d" in tensors:
            d2t = tensors["d2t"] if "d2t" in tensors else draft.d2t.cpu()
            t2d = tensors["t2d"] if "t2d" in tensors else draft.t2d.cpu()
            set_draft_vocab(draft, d2t.to(torch.int64).cpu(), t2d.to(torch.bool).cpu())
            seen |= {"d2t", "t2d"} & set(tensors)
    missing = sorted(set(own) - seen)
    if complete and missing:
        raise ValueError(f"the EAGLE-3 draft checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in the EAGLE-3 draft directory {directory}")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[name] = f.get_tensor(name)
    return out


def eagle3_tensors(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under SpecForge's names (what `save_eagle3` writes)."""
    return {name: t.detach() for name, t in draft.state_dict().items()}


def save_eagle3(draft: Eagle3Draft, path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """Write the draft as SpecForge does (config.json + model.safetensors, no embedding), loadable by SGLang's
    EAGLE3 and by `load_eagle3`; weights in `dtype` (default: as held)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in eagle3_tensors(draft).items():
        cast = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        tensors[name] = cast.contiguous().cpu()
    weight_dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    (out / CONFIG_FILE).write_text(json.dumps(draft.config.to_hf(str(weight_dtype).removeprefix("torch.")),
                                              indent=2, sort_keys=True))  # fmt: skip
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


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
    "draft_vocab_from_counts",
    "eagle3_hidden",
    "eagle3_tensors",
    "is_eagle3_dir",
    "load_eagle3",
    "load_eagle3_state",
    "new_eagle3",
    "save_eagle3",
    "set_draft_vocab",
    "ttt_attention",
    "ttt_layer",
]
