"""A Megatron-core `GPTModel` for a Qwen3 / Qwen3-MoE / GLM-4.5 / DeepSeek-V3 HF config, and `MegatronCausalLM`,
which lets the trainer's step code (`miles_trainer.policy_step`) drive it like a miles-kernels `CausalLM`
(docs/megatron.md).

The model is built from miles-kernels' `ModelConfig` (the HF config.json as the engine reads it) and the layout of
`MegatronConfig`; `transformer_impl="local"` uses Megatron-core's own PyTorch modules (no Transformer Engine needed).
DeepSeek-V3's multi-head latent attention is megatron-core's `MLASelfAttention` (`MLATransformerConfig`,
`mla_fields`), which computes its own RoPE (YaRN): its layers take no RoPE table (`rope_table`).
megatron-core is imported inside functions only, so miles-trainer imports (and its FSDP2 backend runs) without the
`megatron` extra.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from miles_kernels import KernelConfig, ModelConfig, linear
from miles_trainer.config import MegatronConfig
from miles_trainer.megatron_convert import RankLayout, check_convertible, padded_vocab_size
from miles_trainer.megatron_kernels import (
    MilesRMSNorm,
    PackedRows,
    building_miles_layers,
    check_miles_layout,
    miles_block_spec,
    swap_modules,
)
from miles_trainer.megatron_moe import MoEPass, RouterRecord, routed, router_index, router_records

INSTALL_HINT = "uv sync --package miles-trainer --extra megatron (pip install 'miles-trainer[megatron]')"


def require_megatron() -> None:
    """A clear ImportError when megatron-core is not installed."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ImportError(f"trainer.backend.name=megatron needs megatron-core: {INSTALL_HINT}")


def virtual_stages(config: MegatronConfig) -> int | None:
    """Megatron-core's virtual pipeline size: the model chunks of a PP rank (None: one chunk, no interleaving)."""
    return config.vpp if config.pp > 1 and (config.vpp or 1) > 1 else None


def init_parallel(config: MegatronConfig) -> None:
    """Megatron-core's process groups over the initialized default group (world = tp * pp * cp * dp)."""
    require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = dist.get_world_size()
    model_parallel = config.tp * config.pp * config.cp
    if world % model_parallel:
        raise ValueError(f"{world} trainer ranks are not a multiple of tp * pp * cp = {model_parallel}")
    if (world // (config.pp)) % (config.ep * (config.etp or 1)):
        raise ValueError(f"ep * etp = {config.ep * (config.etp or 1)} must divide the {world // config.pp} ranks of a "
                         "pipeline stage")  # fmt: skip
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=virtual_stages(config), context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep, expert_tensor_parallel_size=config.etp or 1,
    )  # fmt: skip
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16 defines te_general_gemm only where Transformer Engine imports, but its MoE router reads it
        # either way (a NameError on a GPU without TE): None takes the router's torch.mm path, as TE's absence means.
        moe_utils.te_general_gemm = None
    if importlib.util.find_spec("transformer_engine") is None:
        import megatron.core.transformer.multi_latent_attention as mla

        # megatron-core 0.16's MLA takes Transformer Engine as present when megatron's TE extension module imports,
        # which it does without TE (its TE classes are then mocks), and its isinstance test on them fails: say absent
        mla.HAVE_TE = False
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        # Megatron's layers fork this tracker's model-parallel CUDA generator (dropout, initialization) on a GPU; its
        # states exist only once seeded (Megatron's own default seed). On the CPU `megatron_on_cpu` stands in for it.
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def stage_layers(num_layers: int, config: MegatronConfig) -> list[int]:
    """The decoder layers of each pipeline stage: `decoder_first_pipeline_num_layers` / `..._last_...` where set,
    the rest split evenly over the other stages (megatron-core's uneven split); ValueError naming what does not
    divide (each stage's layers must also split into `vpp` equal model chunks)."""
    first, last = config.decoder_first_pipeline_num_layers, config.decoder_last_pipeline_num_layers
    chunks = virtual_stages(config) or 1
    middle_stages = config.pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if middle < 0 or (middle_stages == 0 and middle) or (middle_stages and (middle % middle_stages or not middle)):
        raise ValueError(
            f"megatron pp={config.pp} with decoder_first_pipeline_num_layers={first}, "
            f"decoder_last_pipeline_num_layers={last}: the other {middle_stages} stage(s) cannot split the remaining "
            f"{middle} of {num_layers} decoder layers evenly (each needs at least one)"
        )
    per_stage = middle // middle_stages if middle_stages else 0
    layers = [per_stage] * config.pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    if any(count % chunks for count in layers):
        raise ValueError(
            f"megatron pp * vpp = {config.pp} * {chunks}: the stages' decoder layers {layers} do not each split into "
            f"{chunks} model chunks of equal size; change vpp, the stage sizes, or pp"
        )
    return layers


def rank_layout(model: ModelConfig, config: MegatronConfig, vp_stage: int | None = None) -> RankLayout:
    """This rank's place in the layout, for its model chunk `vp_stage` (0 .. vpp - 1 with virtual pipeline stages;
    Megatron's process groups must be initialized: `init_parallel`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    transformer = transformer_config(model, config)
    chunks = virtual_stages(config) or 1
    per_chunk = get_num_layers_to_build(transformer, vp_stage=vp_stage) if config.pp > 1 else model.num_hidden_layers
    first = get_transformer_layer_offset(transformer, vp_stage=vp_stage) if config.pp > 1 else 0
    virtual = {"ignore_virtual": chunks == 1, "vp_stage": vp_stage}
    return RankLayout(
        tp_size=config.tp, tp_rank=ps.get_tensor_model_parallel_rank(), ep_size=config.ep,
        ep_rank=ps.get_expert_model_parallel_rank(), etp_size=config.etp or 1,
        etp_rank=ps.get_expert_tensor_parallel_rank(), first_layer=first, num_layers=per_chunk,
        is_first_stage=ps.is_pipeline_first_stage(**virtual), is_last_stage=ps.is_pipeline_last_stage(**virtual),
        transformer_impl=config.transformer_impl,
    )  # fmt: skip


def _moe_layer_freq(model: ModelConfig) -> list[int]:
    return [int(model.is_moe_layer(layer)) for layer in range(model.num_hidden_layers)]


def transformer_config(model: ModelConfig, config: MegatronConfig, dtype: torch.dtype = torch.float32) -> Any:
    """Megatron-core's `TransformerConfig` for `model` (the HF architecture) with `config`'s layout."""
    require_megatron()
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    check_convertible(model, RankLayout(tp_size=config.tp, ep_size=config.ep, etp_size=config.etp or 1))
    if config.sequence_parallel and config.transformer_impl == "local":
        raise ValueError(
            "megatron.sequence_parallel needs transformer_impl=transformer_engine (megatron-core's local norms "
            "refuse it)"
        )
    if model.is_moe and config.tp > 1 and not config.sequence_parallel:
        raise ValueError(
            "an MoE model with megatron.tp > 1 needs sequence_parallel=true (megatron-core requires it), hence "
            "transformer_impl=transformer_engine; with the local implementation split the experts with ep / etp"
        )
    if model.is_moe and config.pp > 1 and config.moe_token_dispatcher == "allgather":
        raise ValueError(
            "an MoE model with megatron.pp > 1 needs moe_token_dispatcher=alltoall: the pipeline sends packed "
            "micro-batches of varying shapes, which megatron-core's allgather dispatcher does not take"
        )
    stage_layers(model.num_hidden_layers, config)  # a clear error for a split megatron-core would refuse
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_hidden_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim, ffn_hidden_size=model.intermediate_size or model.moe_intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=model.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=model.attention_bias,
        qk_layernorm=model.use_qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=virtual_stages(config), context_parallel_size=config.cp,
        num_layers_in_first_pipeline_stage=config.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=config.decoder_last_pipeline_num_layers,
        expert_model_parallel_size=config.ep, expert_tensor_parallel_size=config.etp or 1,
        sequence_parallel=config.sequence_parallel, use_cpu_initialization=True,
        variable_seq_lengths=config.pp > 1,  # packed micro-batches differ in shape: stages send theirs first
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",  # unused by dense layers; megatron-core's default refuses pp > 1
    )  # fmt: skip
    if config.recompute != "none":
        kwargs |= {"recompute_granularity": config.recompute}
        if config.recompute == "full":
            kwargs |= {"recompute_method": "uniform", "recompute_num_layers": 1}
    if model.is_moe:
        kwargs |= dict(
            num_moe_experts=model.num_experts, moe_router_topk=model.num_experts_per_tok,
            moe_ffn_hidden_size=model.moe_intermediate_size, moe_layer_freq=_moe_layer_freq(model),
            moe_token_dispatcher_type=config.moe_token_dispatcher, moe_grouped_gemm=False,
            moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        )  # fmt: skip
        if model.router == "sigmoid":  # GLM-4.5: sigmoid scores, a fixed bias for the choice, grouped top-k
            kwargs |= dict(
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0, moe_router_num_groups=model.n_group if model.n_group > 1 else None,
                moe_router_group_topk=model.topk_group if model.n_group > 1 else None,
                moe_router_topk_scaling_factor=model.routed_scaling_factor,
                moe_shared_expert_intermediate_size=(model.moe_intermediate_size * model.n_shared_experts) or None,
            )  # fmt: skip
        else:  # Qwen3-MoE: softmax over the top-k logits = the renormalized top-k probabilities
            kwargs |= dict(moe_router_score_function="softmax", moe_router_pre_softmax=not model.norm_topk_prob)
    if model.is_mla:
        return MLATransformerConfig(**kwargs | mla_fields(model))
    return TransformerConfig(**kwargs)


def mla_fields(model: ModelConfig) -> dict[str, Any]:
    """`MLATransformerConfig`'s fields for DeepSeek-V3's multi-head latent attention, each computing what
    transformers' `DeepseekV3Attention` (and the miles model's `LatentAttention`) computes:

    - widths: megatron-core's `qk_head_dim` is the non-rotary part (`qk_nope_head_dim`), `qk_pos_emb_head_dim` the
      rotary one; `kv_channels` is the value head (the width the attention's output is reshaped by);
    - `qk_layernorm`: the latent norms (q_a_layernorm, kv_a_layernorm; MLA's spec builds them only with it), eps
      `rms_norm_eps`, which `check_convertible` holds to transformers' 1e-6;
    - RoPE: `rope_type` yarn (or plain rope), base `rope_theta`, YaRN's factor, original context and betas as given
      (megatron-core's YaRN truncates the ramp's ends to integers, as transformers does for DeepSeek-V3). cos / sin
      are scaled by yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) when both are given, else by
      yarn_mscale(factor) (transformers' `attention_factor`; megatron-core's `mscale=None` means the latter), and the
      softmax scale is (qk_nope + qk_rope)^-0.5 * yarn_mscale(factor, mscale_all_dim)^2 (1 without `mscale_all_dim`);
    - interleaving: megatron-core's MLA always de-interleaves the rotary dims before rotating halves (DeepSeek's
      `rope_interleave`); `rotary_interleaved` stays off (it would rotate adjacent pairs instead), and a checkpoint
      with `rope_interleave=false` has its rotary rows permuted by the conversion (`megatron_convert._rope_pairs`)."""
    is_yarn = model.rope_type == "yarn"
    has_both_mscales = bool(model.rope_mscale and model.rope_mscale_all_dim)
    return dict(
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim, kv_channels=model.v_head_dim,
        num_query_groups=model.num_attention_heads, qk_layernorm=True, rotary_interleaved=False,
        rope_type="yarn" if is_yarn else "rope", rotary_base=model.rope_theta, rotary_percent=1.0,
        rotary_scaling_factor=model.rope_factor if is_yarn else 1.0,
        original_max_position_embeddings=model.rope_original_max_position_embeddings,
        beta_fast=model.rope_beta_fast, beta_slow=model.rope_beta_slow,
        mscale=model.rope_mscale if has_both_mscales else None,
        mscale_all_dim=model.rope_mscale_all_dim if is_yarn else 0.0,
    )  # fmt: skip


def layer_spec(model: ModelConfig, config: MegatronConfig, is_moe: bool | None = None) -> Any:
    """The decoder layer spec: Megatron-core's local modules, or Transformer Engine's (`is_moe`: of a sparse or a
    dense layer; default: sparse in an MoE model); `megatron_kernels.miles_spec` turns the local one into the Miles
    layers."""
    num_experts = (model.num_experts or None) if is_moe is None or is_moe else None
    # MLA's latent norms are megatron-core's "qk_layernorm" (transformer_config's `mla_fields`)
    qk_layernorm, mla = model.use_qk_norm or model.is_mla, model.is_mla
    if config.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, multi_latent_attention=mla
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    return local_mla(spec, model, config)


@functools.cache
def _mla_core_attention() -> type:
    """megatron-core's local `DotProductAttention`, taking the arguments its MLA builds the attention with."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):  # type: ignore[misc]
        """megatron-core 0.16's MLA passes the query / key and the value head widths (`k_channels`, `v_channels`),
        which only Transformer Engine's attention takes; the local one computes with the widths q, k and v have
        (the softmax scale is given, the output is reshaped by kv_channels = v_head_dim), so it drops them."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:  # fmt: skip
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def local_mla(spec: Any, model: ModelConfig, config: MegatronConfig) -> Any:
    """`spec` (a layer's, or a block's) with the local attention that runs megatron-core's MLA, for an MLA model with
    megatron-core's local modules; else `spec` itself."""
    if not model.is_mla or config.transformer_impl != "local":
        return spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return swap_modules(spec, {DotProductAttention: (_mla_core_attention(), {})})


def build_gpt_model(
    model: ModelConfig, config: MegatronConfig, dtype: torch.dtype = torch.float32, vp_stage: int | None = None,
    kernel: KernelConfig | None = None,
) -> Any:  # fmt: skip
    """This rank's `GPTModel` (its PP stage, or with virtual stages its model chunk `vp_stage`; its TP / EP
    shards), parameters on the CPU (`use_cpu_initialization`); the caller loads the weights (`hf_to_megatron`) and
    moves it to its device. With `kernel` where `uses_miles_layers`, its layers run the engine's kernels
    (`megatron_kernels`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    transformer = transformer_config(model, config, dtype)
    spec = layer_spec(model, config)
    if kernel is not None and config.uses_miles_layers(kernel.is_deterministic):
        check_miles_layout(config, model)
        spec = miles_block_spec(model, transformer, kernel, config, vp_stage)
    elif model.is_moe:  # a spec per layer: the dense ones (GLM-4.5's first layers) get a dense MLP
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = local_mla(get_gpt_decoder_block_spec(
            transformer, use_transformer_engine=config.transformer_impl != "local", normalization="RMSNorm",
            vp_stage=vp_stage,
        ), model, config)  # fmt: skip
    virtual = {"ignore_virtual": virtual_stages(config) is None, "vp_stage": vp_stage}
    with building_miles_layers():
        return GPTModel(
            config=transformer, transformer_layer_spec=spec, vocab_size=padded_vocab_size(model, config.tp),
            max_sequence_length=model.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(**virtual),
            post_process=ps.is_pipeline_last_stage(**virtual),
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope", rotary_percent=model.partial_rotary_factor,
            rotary_base=int(model.rope_theta), parallel_output=False, vp_stage=vp_stage,
        )  # fmt: skip


def rope_table(gpt: Any, width: int) -> torch.Tensor | None:
    """The RoPE table megatron-core's layers take for positions 0 .. width - 1 of a (B, S) batch; None under MLA,
    whose attention computes its own (YaRN) from the sequence length."""
    return None if gpt.config.multi_latent_attention else gpt.rotary_pos_emb(width)


class PaddedBatch(NamedTuple):
    """A packed micro-batch as the model's layers take it: token ids (B, S); each packed row's index in the
    flattened (B, S) batch; for megatron-core's local attention the rows right-padded, one sequence per row, with
    the causal mask (1, 1, S, S), True where attention is masked; for the Miles layers the packed rows themselves
    (B = 1, S = N) with their packing (`packed`, no mask)."""

    ids_BS: torch.Tensor
    mask: torch.Tensor | None
    flat_N: torch.Tensor
    packed: PackedRows | None = None


class MegatronCausalLM(torch.nn.Module):
    """A GPTModel (optionally wrapped in Megatron's DDP) seen as the step code's model: `forward_hidden` over a
    packed micro-batch's rows, `logits` of chosen rows over the full vocabulary."""

    def __init__(self, module: torch.nn.Module, config: ModelConfig, kernel: KernelConfig) -> None:
        super().__init__()
        self.module = module
        self.gpt_ddp: Any = module  # Megatron's DDP wrapper (the GPTModel itself when frozen)
        self.config = config
        self.kernel = kernel
        self.gpt: Any = getattr(module, "module", module)
        # MoE experts split over ranks (EP x ETP): every forward pads its (B, S) batch to the largest over them
        # (the token dispatch gathers equal shapes; padding rows are sequences of their own, invisible to the real
        # ones)
        self.pad_group: Any = None
        self.mtp: Any = None  # on the last stage's last chunk: the MTP modules beside it (megatron_mtp.MegatronMTP)
        # layers built from the Miles spec (megatron_kernels): the engine's packed layout and arithmetic
        self.is_miles = any(isinstance(module, MilesRMSNorm) for module in self.gpt.modules())
        meg = self.gpt.config
        # (the Miles MoE layers exchange tokens of any count: no shape to agree on)
        if (
            not self.is_miles
            and config.is_moe
            and meg.expert_model_parallel_size * meg.expert_tensor_parallel_size > 1
        ):
            from megatron.core import parallel_state

            self.pad_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        # this chunk's routers, instrumented (megatron_moe.py): replay, their last routing, the MoE losses
        self.routers: dict[int, RouterRecord] = router_records(self.gpt) if config.is_moe else {}

    def moe_layers(self) -> dict[int, RouterRecord]:
        """This chunk's MoE layers by global index, each with its `last_routing` (miles_trainer.moe reads them)."""
        return self.routers

    def forward_hidden(
        self, input_ids_N: torch.Tensor, batch: Any, routing_NLK: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states (N, H) of a micro-batch packed one sequence per sample (no shared prompts), for a
        model in one piece (no pipeline stages: the Megatron backend's schedule drives those); `routing_NLK`: the
        experts to replay (miles_trainer.moe)."""
        padded = self.padded_batch(input_ids_N, batch)
        with routed(self.routers, MoEPass(router_index(padded), routing_NLK)):
            hidden_SBH = self.stage_forward(padded)
        return self.hidden_rows(hidden_SBH, padded)

    def padded_batch(self, input_ids_N: torch.Tensor, batch: Any) -> PaddedBatch:
        """The micro-batch's rows laid out as a right-padded (B, S) batch (one sequence per row), or for the Miles
        layers packed as they are (B = 1)."""
        lens = batch.query_lens_S.tolist()
        if batch.kv_lens_S.tolist() != lens:
            raise ValueError("the Megatron backend takes micro-batches packed without shared prompts")
        device = input_ids_N.device
        if self.is_miles:
            packed = PackedRows.of(self.config, batch, self.gpt.config.params_dtype, device)
            return PaddedBatch(
                input_ids_N.view(1, -1), None, torch.arange(input_ids_N.shape[0], device=device), packed
            )
        tp = self.gpt.config.tensor_model_parallel_size if self.gpt.config.sequence_parallel else 1
        shape = torch.tensor([len(lens), -(-max(lens) // tp) * tp])
        if self.pad_group is not None:  # the EP ranks' token all-gather wants one shape on all of them
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.pad_group)
        rows, width = (int(v) for v in shape.tolist())
        starts = torch.arange(len(lens), device=device).repeat_interleave(torch.tensor(lens, device=device)) * width
        offsets = torch.cat([torch.arange(n, device=device) for n in lens])
        flat_N = starts + offsets  # row n's place in the flattened (B, S) batch; extra rows and columns are padding
        ids_BS = input_ids_N.new_zeros(rows * width)
        ids_BS[flat_N] = input_ids_N
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]
        return PaddedBatch(ids_BS.view(rows, width), mask, flat_N)

    def stage_forward(self, padded: PaddedBatch) -> torch.Tensor:
        """This model chunk's decoder layers over the padded batch: from the embedding on the first pipeline stage,
        else from the previous stage's hidden states (the schedule's `set_input_tensor`); (S, B, H), after the final
        norm on the last stage (S split over the TP ranks with sequence parallelism)."""
        gpt = self.gpt
        rows, width = padded.ids_BS.shape
        hidden_SBH = None
        if gpt.pre_process:
            positions_BS = torch.arange(width, device=padded.ids_BS.device).expand(rows, width)
            hidden_SBH = gpt.embedding(input_ids=padded.ids_BS, position_ids=positions_BS)
        if padded.packed is not None:  # the Miles layers: RoPE and the packing are in PackedRows
            miles_out: torch.Tensor = gpt.decoder(hidden_states=hidden_SBH, attention_mask=None,
                                                  packed_seq_params=padded.packed)  # fmt: skip
            return miles_out
        out: torch.Tensor = gpt.decoder(hidden_states=hidden_SBH, attention_mask=padded.mask,
                                        rotary_pos_emb=rope_table(gpt, width))  # fmt: skip
        return out

    def hidden_rows(self, hidden_SBH: torch.Tensor, padded: PaddedBatch) -> torch.Tensor:
        """The last stage's (S, B, H) output as float32 hidden states (N, H) of the micro-batch's packed rows."""
        from megatron.core import tensor_parallel

        if self.gpt.config.sequence_parallel:
            hidden_SBH = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=True
            )
        hidden_NH: torch.Tensor = hidden_SBH.transpose(0, 1).reshape(-1, hidden_SBH.shape[-1])[padded.flat_N]
        return hidden_NH.float()

    def logits(self, hidden_KH: torch.Tensor, detach_weight: bool = False) -> torch.Tensor:
        """float32 logits (K, V) over the unpadded vocabulary, gathered over the TP ranks (`detach_weight`: the output
        layer enters detached, as the MTP loss reads it)."""
        from megatron.core import tensor_parallel

        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        weight = gpt.output_layer.weight if weight is None else weight
        weight = weight.detach() if detach_weight else weight
        if gpt.config.tensor_model_parallel_size > 1 and not gpt.config.sequence_parallel:
            hidden_KH = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_KH)
        hidden_KH = hidden_KH.to(weight.dtype)  # in the model's dtype, as the engine's LM head
        local = linear(hidden_KH, weight, self.kernel) if self.is_miles else hidden_KH @ weight.t()
        full: torch.Tensor = tensor_parallel.gather_from_tensor_model_parallel_region(local.float())
        return full[:, : self.config.vocab_size]
