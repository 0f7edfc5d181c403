"""A model's shape as the memory planner sees it: the config.json fields that decide memory, every weight tensor's
shape, parameter counts, and KV-cache width. Torch-free.

Four families: `qwen3` / `qwen3_moe` (the miles-kernels model, miles_kernels/model.py: q/k norms, the MoE router
`gate`, optional tied embeddings, DeepSeek-style MTP modules whose embedding and LM head are the trunk's) with the
dense `qwen2` (Qwen2.5: q/k/v biases, no q/k norms) and `llama` (Llama 3.x: no q/k norms), `glm4_moe`
(GLM-4.5: qkv bias, optional q/k norms, dense first layers, one shared expert, router with a score-correction bias)
and `deepseek_v3` / `kimi_k2` (MLA attention: low-rank q and a compressed KV latent; Hugging Face's
modeling_deepseek_v3.py names). Profiles of public models live in `profiles/models.yaml`.

A local checkpoint is planned as Miles loads it: MTP modules that its config.json declares
(`num_nextn_predict_layers`) but its safetensors hold no tensor of, as transformers' `save_pretrained` writes GLM-4.5,
are left out (miles_kernels.hf_io reads it the same way; a spec.mode=online run plans the fresh ones it adds, since
it plans the checkpoint that holds them).

LoRA (`LoraSettings`, a run's trainer.lora): `ModelShape.lora_targets` lists the weights of the linear layers that get
adapters, by the rules of miles_kernels.lora.target_names (PEFT's matching over the module names of the decoder's
trunk layers; routers, the LM head, embeddings and MTP layers take none), and `lora_tensors` their adapters: lora_A
(r x in) and lora_B (out x r) for each adapted (out x in) weight. `trunk_linears` lists those linear layers' weights
as a whole: the ones 'all-linear' adapts and a low-precision engine stores quantized (plan_formulas.py).
"""

from __future__ import annotations

import functools
import json
import re
import struct
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict

__all__ = ["MODELS", "LoraSettings", "ModelShape", "Tensor", "load_model_profile", "model_profiles", "resolve_model"]

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3", "kimi_k2")


class Tensor(NamedTuple):
    """`copies` tensors of `shape`; `layer` None for the embedding, final norm and LM head; MTP module i is layer
    num_hidden_layers + i."""

    name: str
    shape: tuple[int, ...]
    copies: int
    layer: int | None
    is_expert: bool

    @property
    def numel(self) -> int:
        n = self.copies
        for d in self.shape:
            n *= d
        return n


class LoraSettings(NamedTuple):
    """A run's LoRA adapters as the planner needs them (trainer.lora, miles_trainer.config.LoraTrainConfig, with
    rank > 0): the rank r, PEFT's `target_modules` (names matching a module name or its last dotted parts,
    'all-linear', or one regex over the full module name) and the dtype the trainer holds the frozen base in."""

    rank: int
    target_modules: str | tuple[str, ...] = "all-linear"
    base_dtype: str = "float32"


class ModelShape(BaseModel):
    """The config.json fields the planner reads (Hugging Face names)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str = "qwen3"
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int = 0
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool | None = None
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0
    torch_dtype: str = "bfloat16"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelShape:
        """From a config.json dict; ValueError naming an unsupported model_type."""
        hf = dict(hf.get("text_config") or hf)
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"the planner does not know model_type {model_type!r}; it plans {', '.join(FAMILIES)}")
        values = dict(hf)
        values["num_experts"] = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
        values["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        values["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        values["n_shared_experts"] = hf.get("n_shared_experts") or 0
        values["num_nextn_predict_layers"] = hf.get("num_nextn_predict_layers") or 0
        values["mlp_only_layers"] = tuple(hf.get("mlp_only_layers") or ())
        values["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        if model_type == "qwen2":
            values["attention_bias"] = True  # Qwen2.5 biases q / k / v always (no config field)
        return cls(**values)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe") or bool(self.use_qk_norm)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Which decoder layers (MTP modules' included) have a sparse MLP."""
        if not self.is_moe:
            return False
        if self.model_type == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return layer >= self.first_k_dense_replace

    def _attention(self, layer: int) -> list[Tensor]:
        h, heads, kv, d = self.hidden_size, self.num_attention_heads, self.kv_heads, self.dim
        out: list[Tensor] = []

        def add(name: str, *shape: int) -> None:
            out.append(Tensor(f"self_attn.{name}", shape, 1, layer, False))

        if self.is_mla:
            assert self.kv_lora_rank is not None
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                add("q_a_proj.weight", self.q_lora_rank, h)
                add("q_a_layernorm.weight", self.q_lora_rank)
                add("q_b_proj.weight", heads * qk, self.q_lora_rank)
            else:
                add("q_proj.weight", heads * qk, h)
            add("kv_a_proj_with_mqa.weight", self.kv_lora_rank + self.qk_rope_head_dim, h)
            add("kv_a_layernorm.weight", self.kv_lora_rank)
            add("kv_b_proj.weight", heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
            add("o_proj.weight", h, heads * self.v_head_dim)
            return out
        add("q_proj.weight", heads * d, h)
        add("k_proj.weight", kv * d, h)
        add("v_proj.weight", kv * d, h)
        add("o_proj.weight", h, heads * d)
        if self.attention_bias:
            add("q_proj.bias", heads * d)
            add("k_proj.bias", kv * d)
            add("v_proj.bias", kv * d)
            if self.model_type in (
                "qwen3",
                "qwen3_moe",
                "llama",
            ):  # miles' Linear (and HF Qwen3, Llama) bias o_proj too
                add("o_proj.bias", h)
        if self.has_qk_norm:
            add("q_norm.weight", d)
            add("k_norm.weight", d)
        return out

    def _mlp(self, layer: int) -> list[Tensor]:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            i = self.intermediate_size
            return [Tensor(f"mlp.{p}.weight", s, 1, layer, False) for p, s in _swiglu(h, i)]
        e, i = self.num_experts, self.moe_intermediate_size
        out = [Tensor("mlp.gate.weight", (e, h), 1, layer, False)]
        if self.model_type != "qwen3_moe":  # DeepSeek-V3 / GLM-4.5 aux-loss-free routing bias
            out.append(Tensor("mlp.gate.e_score_correction_bias", (e,), 1, layer, False))
        if self.n_shared_experts:
            shared = i * self.n_shared_experts
            out += [Tensor(f"mlp.shared_experts.{p}.weight", s, 1, layer, False) for p, s in _swiglu(h, shared)]
        out += [Tensor(f"mlp.experts.{p}.weight", s, e, layer, True) for p, s in _swiglu(h, i)]
        return out

    def _layer(self, layer: int) -> list[Tensor]:
        h = self.hidden_size
        norms = [Tensor(f"{n}.weight", (h,), 1, layer, False) for n in ("input_layernorm", "post_attention_layernorm")]
        return self._attention(layer) + self._mlp(layer) + norms

    def _mtp_own(self, layer: int) -> list[Tensor]:
        """An MTP module's weights besides its decoder layer; its embedding and LM head are the trunk's."""
        h = self.hidden_size
        own = [Tensor(f"{n}.weight", (h,), 1, layer, False) for n in ("enorm", "hnorm", "shared_head.norm")]
        return [*own, Tensor("eh_proj.weight", (h, 2 * h), 1, layer, False)]

    def tensors(self) -> list[Tensor]:
        """Every weight tensor of the model, each tied tensor once (the MTP modules' embedding / head copies are the
        trunk's, as miles_kernels.CausalLM.tie_weights makes them)."""
        return _tensors(self)

    def mtp_layers(self) -> range:
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    def params(self, *, mtp: bool | None = None, expert: bool | None = None) -> int:
        """Parameters; `mtp`: only (True) / without (False) the MTP modules; `expert`: only / without the experts."""
        out = 0
        for t in self.tensors():
            is_mtp = t.layer is not None and t.layer >= self.num_hidden_layers
            if (mtp is None or is_mtp == mtp) and (expert is None or t.is_expert == expert):
                out += t.numel
        return out

    def active_params(self) -> int:
        """Parameters one token uses (trunk only): every non-expert weight + top-k of the routed experts."""
        experts = self.params(mtp=False, expert=True)
        active = experts * self.num_experts_per_tok // self.num_experts if self.is_moe else 0
        return self.params(mtp=False, expert=False) + active

    def trunk_linears(self) -> list[Tensor]:
        """The weights of the decoder trunk's linear layers (miles_kernels' `CausalLM.trunk_linears`): attention or MLA
        projections, dense MLP and shared-expert gate/up/down, the routed experts (one Tensor a layer and projection,
        `copies` of them): what LoRA may adapt and a low-precision engine stores quantized. Routers (Qwen3-MoE's is a
        linear layer; GLM-4.5 / DeepSeek-V3's is not), the LM head, embeddings and MTP layers are left out."""
        return [
            t for layer in range(self.num_hidden_layers) for t in self._layer(layer)
            if len(t.shape) == 2 and t.name != "mlp.gate.weight"  # norms and biases are 1-D; the router stays out
        ]  # fmt: skip

    def lora_targets(self, target_modules: str | tuple[str, ...] | list[str]) -> list[Tensor]:
        """The weights of the linear layers that `target_modules` gives LoRA adapters, chosen as
        miles_kernels.lora.target_names chooses them: among the decoder's trunk layers (attention, MLA projections,
        dense MLP, each routed expert, shared experts; never a router `mlp.gate`, the LM head, embeddings or MTP
        layers), a list entry equal to a module's name or to its last dotted parts (`q_proj`, `self_attn.o_proj`,
        `experts.0.up_proj`), 'all-linear', or one regex fully matching the name (`model.layers.0.self_attn.q_proj`).
        A layer's routed experts are one Tensor whose `copies` is how many of them match. ValueError when the targets
        select nothing or name a layer that takes no adapter (the trainer refuses both)."""
        targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
        return _lora_targets(self, targets)

    def lora_tensors(self, rank: int, target_modules: str | tuple[str, ...] | list[str]) -> list[Tensor]:
        """The LoRA adapters of `lora_targets`: for each adapted (out x in) weight, lora_A (rank x in) and lora_B
        (out x rank) (miles_kernels.lora.add_lora)."""
        out: list[Tensor] = []
        for t in self.lora_targets(target_modules):
            out_features, in_features = t.shape
            module = t.name.removesuffix(".weight")
            out.append(Tensor(f"{module}.lora_A", (rank, in_features), t.copies, t.layer, t.is_expert))
            out.append(Tensor(f"{module}.lora_B", (out_features, rank), t.copies, t.layer, t.is_expert))
        return out

    def kv_elements_per_token_layer(self) -> int:
        """KV-cache elements one token holds in one layer: K and V of every KV head, or MLA's compressed latent
        (kv_lora_rank + qk_rope_head_dim; DeepSeek-V2 paper, arXiv 2405.04434, section 2.1; SGLang's MLA pool)."""
        if self.is_mla:
            assert self.kv_lora_rank is not None
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads * self.dim


def _swiglu(h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))]


@functools.cache
def _tensors(shape: ModelShape) -> list[Tensor]:
    h, v = shape.hidden_size, shape.vocab_size
    out = [Tensor("model.embed_tokens.weight", (v, h), 1, None, False)]
    for layer in range(shape.num_hidden_layers):
        out += shape._layer(layer)
    for layer in shape.mtp_layers():
        out += shape._layer(layer) + shape._mtp_own(layer)
    out.append(Tensor("model.norm.weight", (h,), 1, None, False))
    if not shape.tie_word_embeddings:
        out.append(Tensor("lm_head.weight", (v, h), 1, None, False))
    return out


@functools.cache
def _linear_modules(shape: ModelShape) -> list[tuple[str, Tensor]]:
    """Every linear layer of the decoder's trunk layers (`ModelShape.trunk_linears`), which may take an adapter, under
    its module name in the miles-kernels model (`model.layers.3.mlp.experts.17.up_proj`: each routed expert is its
    own), with its weight (one copy)."""
    out: list[tuple[str, Tensor]] = []
    for t in shape.trunk_linears():
        module, one = t.name.removesuffix(".weight"), t._replace(copies=1)
        if t.is_expert:
            group, projection = module.rsplit(".", 1)
            out += [(f"model.layers.{t.layer}.{group}.{e}.{projection}", one) for e in range(t.copies)]
        else:
            out.append((f"model.layers.{t.layer}.{module}", one))
    return out


@functools.cache
def _lora_targets(shape: ModelShape, targets: str | tuple[str, ...]) -> list[Tensor]:
    candidates = _linear_modules(shape)
    if targets == "all-linear":
        chosen = candidates
    elif isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as error:
            raise ValueError(f"trainer.lora.target_modules {targets!r} is not a regular expression: {error}") from None
        chosen = [(name, t) for name, t in candidates if pattern.fullmatch(name)]
    else:
        if not targets:
            raise ValueError("trainer.lora.target_modules is empty: name the modules (e.g. [q_proj, v_proj]) or use "
                             "'all-linear'")  # fmt: skip

        def matches(name: str, target: str) -> bool:
            return name == target or name.endswith("." + target)

        chosen = [(name, t) for name, t in candidates if any(matches(name, target) for target in targets)]
        unknown = [target for target in targets if not any(matches(name, target) for name, _ in candidates)]
        if unknown:
            kinds = sorted({name.rsplit(".", 1)[-1] for name, _ in candidates})
            raise ValueError(
                f"trainer.lora.target_modules {list(unknown)} match no linear layer of the {shape.model_type} decoder "
                f"(its layers end in {kinds}; the LM head, embeddings, routers and MTP layers take no adapter)"
            )
    if not chosen:
        raise ValueError(f"trainer.lora.target_modules {targets!r} match no linear layer of the decoder")
    grouped: dict[tuple[int | None, str], Tensor] = {}  # a layer's matching experts: one Tensor, copies counted
    for _, t in chosen:
        key = (t.layer, t.name)
        grouped[key] = grouped[key]._replace(copies=grouped[key].copies + 1) if key in grouped else t
    return list(grouped.values())


@functools.cache
def model_profiles() -> dict[str, dict[str, Any]]:
    """The shipped model profiles by name (profiles/models.yaml)."""
    text = resources.files("miles_memory").joinpath("profiles/models.yaml").read_text()
    data: dict[str, dict[str, Any]] = yaml.safe_load(text)
    return data


MODELS: tuple[str, ...] = tuple(model_profiles())


def load_model_profile(name: str) -> ModelShape:
    """A shipped profile by its name or Hugging Face id (case-insensitive); ValueError listing the known ones."""
    for key, profile in model_profiles().items():
        if name.lower() in (key.lower(), str(profile.get("hf_id", "")).lower()):
            return ModelShape.from_hf(profile["config"])
    raise ValueError(
        f"unknown model {name!r}; known profiles: {', '.join(MODELS)} (or a local directory with config.json)"
    )


def resolve_model(path: str | None, profile: str | None) -> tuple[ModelShape, str]:
    """The model a run trains and where its shape came from: `profile` (memory.plan.model) wins; else `path`, a local
    directory with a config.json or a profile's name / Hugging Face id."""
    if profile:
        return load_model_profile(profile), f"profile {profile}"
    if path is None:
        raise ValueError(
            "model.path is null (the built-in bootstrap policy): set model.path to a model directory or Hugging Face "
            "id, or memory.plan.model to a profile"
        )
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        shape = ModelShape.from_hf(json.loads(config.read_text()))
        names = _tensor_names(config.parent)
        prefixes = tuple(f"model.layers.{layer}." for layer in shape.mtp_layers())
        if not prefixes or names is None or any(name.startswith(prefixes) for name in names):
            return shape, str(config)
        absent = f" (its {len(prefixes)} MTP layer(s) absent from the checkpoint: planned without)"
        return shape.model_copy(update={"num_nextn_predict_layers": 0}), str(config) + absent
    return load_model_profile(path), f"profile {path}"


def _tensor_names(directory: Path) -> list[str] | None:
    """The tensor names of a safetensors checkpoint (its index, or the single file's JSON header: 8 bytes of
    little-endian length, then the header); None without one."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    with single.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    return [name for name in header if name != "__metadata__"]
