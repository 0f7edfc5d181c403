"""The policy's MTP modules on the Megatron backend, and their online training (docs/megatron.md, "Online MTP draft";
docs/speculative-training.md).

The MTP modules of a DeepSeek-V3 / GLM-4.5 checkpoint (`model.layers.{L + i}`, L trunk layers) are megatron-core's
`MultiTokenPredictionBlock` on the last pipeline stage: `mtp.layers.{i}` with `enorm`, `hnorm`, `eh_proj`,
`transformer_layer` (a dense or MoE decoder layer, as layer L + i of the trunk would be) and `final_layernorm`, the
names and sharded-checkpoint layout of a GPTModel built with an MTP block. The block sits beside the GPTModel rather
than in it: GPTModel's own MTP path adds the MTP loss into the trunk's gradients, and here the trunk must not see it.

For module i at row t of the micro-batch's right-padded (B, S) layout (`MegatronCausalLM.padded_batch`), with h_t the
previous depth's output (the trunk's final-norm hidden state for module 0) and x_{t+1} the next token
(miles-kernels' `CausalLM.mtp_hidden`, the same formula):

    e_t = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]),    out_t = final_layernorm(transformer_layer(e_t))

with the trunk's causal mask (attention over the sequence's rows <= t) and RoPE positions; `logits(out_t)` scores
token t + 2 + i. h_t, the embedding and the output layer enter detached (gradient isolation: the trunk's gradients
are bitwise those of a step without the MTP loss). The last stage reads the embedding from its own chunk with one
stage, from a tied model's last-stage copy (its output layer) with several, else from the first stage, which sends
it over the embedding group at the start of each step.

An auxiliary loss (`miles_trainer.auxiliary.AuxLoss`, miles-spec's `MTPLoss`) sees `MegatronMTP` as the model
outside the micro-batches (`mtp_layers`, `mtp_parameters`) and `LastStageOutput` inside them. The trained modules
have their own megatron-core DDP (their gradients summed over the data-parallel ranks, experts over the
expert-data-parallel ranks, in buffers of their own), float32 masters, AdamW (`aux_optimizer`) with its schedule,
global gradient norm and clipping (`aux_grad_norm`, `aux_lr`), outside the policy's. Checkpoints hold the modules'
weights (`mtp`) and their AdamW state (`mtp_optimizer`) as sharded tensors; weight syncs and HF exports hold the
modules under their HF names. Modules no auxiliary loss trains stay as loaded (frozen), and are exported all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_contracts import Sample
from miles_kernels import KernelConfig, ModelConfig
from miles_trainer.auxiliary import AuxLoss
from miles_trainer.config import MegatronConfig, OptimizerConfig
from miles_trainer.megatron_convert import MTP_PREFIX
from miles_trainer.megatron_kernels import building_miles_layers, miles_mtp_spec
from miles_trainer.megatron_model import MegatronCausalLM, PaddedBatch, layer_spec, rope_table, transformer_config
from miles_trainer.megatron_optimizer import adamw, adamw_step, state_tensors
from miles_trainer.megatron_state import adamw_sharded_state, load_adamw_state


def build_mtp_block(
    model: ModelConfig, config: MegatronConfig, dtype: torch.dtype, vp_stage: int | None,
    kernel: KernelConfig | None = None,
) -> Any:  # fmt: skip
    """megatron-core's `MultiTokenPredictionBlock` of `model`'s MTP modules for the last stage (its model chunk
    `vp_stage`), parameters on the CPU; the caller loads the weights (`hf_to_megatron`'s `mtp.` tensors). With
    `kernel` where the trunk runs the Miles layers, so do the modules' norms, `eh_proj` and decoder layers."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec,
    )

    use_te = config.transformer_impl == "transformer_engine"
    specs = [
        get_mtp_layer_spec(layer_spec(model, config, model.is_moe_layer(model.num_hidden_layers + i)), use_te)
        for i in range(model.num_nextn_predict_layers)
    ]
    if kernel is not None and config.uses_miles_layers(kernel.is_deterministic):
        specs = [miles_mtp_spec(spec, kernel, model, config) for spec in specs]
    with building_miles_layers():
        return MultiTokenPredictionBlock(
            config=transformer_config(model, config, dtype),
            spec=MultiTokenPredictionBlockSubmodules(layer_specs=specs), vp_stage=vp_stage,
        )  # fmt: skip


class MegatronMTP:
    """This rank's MTP modules and what trains them (see the module docstring): on the last pipeline stage the block
    (`mtp_layers`), with its DDP, masters and AdamW when an auxiliary loss trains it; elsewhere nothing but the step
    counters (those ranks take part in the gradient norm and the embedding's send). Every rank builds one."""

    def __init__(
        self,
        model: ModelConfig,
        config: MegatronConfig,
        kernel: KernelConfig,
        chunks: Sequence[MegatronCausalLM],
        loaded: dict[str, torch.Tensor],
        device: torch.device,
        aux_losses: Sequence[AuxLoss],
        aux_optimizer: OptimizerConfig,
    ) -> None:
        """`chunks`: this rank's trained model chunks; `loaded`: the last one's converted tensors (`mtp.` included)."""
        if aux_losses and not model.num_nextn_predict_layers:
            raise ValueError(
                "the auxiliary losses train the policy's MTP modules, and the model has none "
                "(num_nextn_predict_layers = 0 in its config.json, or a checkpoint saved by transformers without "
                "them): give it a draft with `miles-spec train`, or train without spec.mode=online"
            )
        if aux_optimizer.schedule == "cosine" and aux_optimizer.total_steps is None:
            raise ValueError("aux optimizer schedule='cosine' needs total_steps (the optimizer steps it spans)")
        self.model_config, self.kernel, self.chunks = model, kernel, list(chunks)
        self.aux_losses, self.optimizer_config = list(aux_losses), aux_optimizer
        self.block: Any = None
        self.ddp: Any = None
        self.params: list[Any] = []  # trained parameters (megatron-core's, with `main_grad`) and their masters
        self.masters: list[Any] = []
        self.optimizer: torch.optim.AdamW | None = None
        self.num_steps = 0  # the learning-rate schedule's steps (every train step)
        self.num_updates = 0  # AdamW's steps (those with trained rows)
        self.embedding: torch.Tensor | None = None  # this TP rank's rows of the trunk's embedding, during a step
        if model.num_nextn_predict_layers and chunks[-1].gpt.post_process:
            self._build(config, loaded, device)

    @property
    def is_trained(self) -> bool:
        return bool(self.aux_losses)

    def _build(self, config: MegatronConfig, loaded: dict[str, torch.Tensor], device: torch.device) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        vp_stage = len(self.chunks) - 1 if len(self.chunks) > 1 else None
        kernel = self.kernel if self.chunks[-1].is_miles else None  # the trunk's kind of layers
        block = build_mtp_block(self.model_config, config, self.kernel.torch_dtype, vp_stage, kernel)
        state = {name.removeprefix(MTP_PREFIX): t for name, t in loaded.items() if name.startswith(MTP_PREFIX)}
        missing, unexpected = block.load_state_dict(state, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"HF -> Megatron MTP conversion mismatch: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]}")  # fmt: skip
        self.block = block.to(device)
        self.chunks[-1].mtp = self
        if not self.is_trained:
            self.block.eval().requires_grad_(False)
            return
        self.ddp = DistributedDataParallel(
            config=block.config, module=block,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        )  # fmt: skip
        named = [(name, p) for name, p in block.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        trained = {id(p) for aux in self.aux_losses for p in aux.parameters(self)}  # type: ignore[arg-type]
        if not trained <= {id(p) for p in self.params}:
            raise ValueError("on the Megatron backend an auxiliary loss may train the policy's MTP modules only")
        # float32 masters, as the policy's (the checkpoint's float32 values of a bf16 / fp16 model's parameters)
        if self.kernel.torch_dtype == torch.float32:
            self.masters = self.params
        else:
            self.masters = [loaded[MTP_PREFIX + name].to(device, torch.float32) for name, _ in named]
        self.optimizer = adamw(self.masters, self.optimizer_config)[0]  # its rate: `step` sets the schedule's

    # -- what an auxiliary loss sees as the model -------------------------------------------------------------------

    @property
    def mtp_layers(self) -> list[Any]:
        """megatron-core's `MultiTokenPredictionLayer`s (on the last stage; empty elsewhere)."""
        return list(self.block.layers) if self.block is not None else []

    def mtp_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.block.parameters()) if self.block is not None else []

    def counts(self, samples: Sequence[Sample], sum_dp: Any) -> list[list[int]]:
        """Each auxiliary loss's normalizers over the global batch (`sum_dp`: a sum over the data-parallel ranks), on
        the last stage (the other stages compute no auxiliary loss: empty lists)."""
        if self.block is None:
            return [[] for _ in self.aux_losses]
        counts = [aux.counts(self, samples) for aux in self.aux_losses]  # type: ignore[arg-type]
        flat = torch.tensor([c for group in counts for c in group], dtype=torch.int64)
        if flat.numel():
            sum_dp(flat)
        values, out = flat.tolist(), []
        for group in counts:
            out.append([int(v) for v in values[: len(group)]])
            values = values[len(group) :]
        return out

    # -- the forward ----------------------------------------------------------------------------------------------

    def hidden(
        self,
        chunk: MegatronCausalLM,
        padded: PaddedBatch,
        hidden_NH: torch.Tensor,
        next_ids_N: torch.Tensor,
        batch: Any,
        module: int,
        detach_trunk: bool,
    ) -> torch.Tensor:
        """float32 output (N, H) of MTP module `module` over the micro-batch's packed rows (`CausalLM.mtp_hidden`'s
        contract; `batch`, the caller's packed layout of the same sequences, is checked against the padded one)."""
        from megatron.core import tensor_parallel

        if not detach_trunk:
            raise ValueError("the Megatron backend trains MTP modules on detached trunk inputs only (detach_trunk)")
        if self.embedding is None:
            raise RuntimeError("the MTP modules run inside a train step (`begin_step` fetches the trunk's embedding)")
        rows, width = padded.ids_BS.shape
        if padded.packed is not None:  # the Miles layers' packed layout: its packing is the batch's
            lens = padded.packed.batch.query_lens_S.cpu()
        else:
            lens = torch.bincount(padded.flat_N.cpu() // width, minlength=rows)[: len(batch.query_lens_S)]
        if not torch.equal(lens, batch.query_lens_S.cpu().to(lens.dtype)):
            raise ValueError("the MTP rows are not the micro-batch's sequences (pack one sequence per sample)")
        gpt = chunk.gpt

        def padded_SB(x_N: torch.Tensor) -> torch.Tensor:  # the packed rows' values in the (S, B, ...) layout
            out = x_N.new_zeros((rows * width, *x_N.shape[1:]))
            out[padded.flat_N] = x_N
            return out.view(rows, width, *x_N.shape[1:]).transpose(0, 1).contiguous()

        hidden_SBH = padded_SB(hidden_NH.detach().to(gpt.config.params_dtype))
        embedded_SBH = self._embed(padded_SB(next_ids_N.to(padded.ids_BS.device)))
        if gpt.config.sequence_parallel:  # the layer takes its sequence shard, as the trunk's layers do
            hidden_SBH = tensor_parallel.scatter_to_sequence_parallel_region(hidden_SBH)
            embedded_SBH = tensor_parallel.scatter_to_sequence_parallel_region(embedded_SBH)
        layout = {"packed_seq_params": padded.packed} if padded.packed is not None else {
            "attention_mask": padded.mask, "rotary_pos_emb": rope_table(gpt, width)}  # fmt: skip
        out_SBH = self.block.layers[module]._proj_and_transformer_layer(
            hidden_states=hidden_SBH, decoder_input=embedded_SBH, **layout
        )
        return chunk.hidden_rows(out_SBH, padded)

    def _embed(self, ids_SB: torch.Tensor) -> torch.Tensor:
        """The trunk's (detached) embedding of `ids_SB`, as megatron-core's vocabulary-parallel embedding computes it:
        each TP rank looks up its rows, the ranks' sums are added."""
        from megatron.core import parallel_state as ps

        assert self.embedding is not None
        weight = self.embedding
        local = ids_SB - ps.get_tensor_model_parallel_rank() * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(out, group=ps.get_tensor_model_parallel_group())
        return out

    def trunk_embedding(self) -> torch.Tensor | None:
        """This TP rank's rows of the trunk's embedding on the last stage (None elsewhere), detached: see the module
        docstring. Every rank calls it (the first and last stages of an untied pipeline send and receive)."""
        from megatron.core import parallel_state as ps

        first, last = self.chunks[0].gpt, self.chunks[-1].gpt
        if ps.get_pipeline_model_parallel_world_size() == 1:
            weight: torch.Tensor = first.embedding.word_embeddings.weight
            return weight.detach()
        if self.model_config.tie_word_embeddings:  # kept equal to the first stage's by finalize_model_grads
            return last.shared_embedding_or_output_weight().detach() if self.block is not None else None
        if not ps.is_rank_in_embedding_group():
            return None
        source, group = ps.get_pipeline_model_parallel_first_rank(), ps.get_embedding_group()
        if ps.is_pipeline_first_stage():
            dist.broadcast(first.embedding.word_embeddings.weight.detach(), src=source, group=group)
            return None
        received = torch.empty_like(last.output_layer.weight)  # the same rows: the vocabulary's TP shard
        dist.broadcast(received, src=source, group=group)
        return received

    # -- the step ---------------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Before the schedule of a train step: the trunk's current embedding for the MTP inputs."""
        if self.is_trained:
            self.embedding = self.trunk_embedding()

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def finalize_grads(self) -> None:
        """After the schedule: megatron-core's reduction of the modules' own gradient buffers (over the data-parallel
        ranks, experts over the expert-data-parallel ones; the TP ranks' parts of the QK and sequence-parallel norms'
        gradients summed), and the routers' token counters reset: `finalize_model_grads` without its embedding
        all-reduce over the first and last stages (these modules hold no embedding; the first stage does not call)."""
        if self.ddp is None:
            return
        from megatron.core import parallel_state as ps
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_non_tensor_model_parallel_grads,
            reset_model_temporary_tensors,
        )

        self.ddp.finish_grad_sync()
        _allreduce_non_tensor_model_parallel_grads([self.ddp], self.ddp.config, ps.get_tensor_model_parallel_group())
        reset_model_temporary_tensors(self.ddp.config, [self.ddp])

    def step(self, skip_update: bool = False) -> dict[str, float]:
        """The modules' AdamW step (every rank calls it; no update when `skip_update`: no row trained), clipped by
        their own global gradient norm; FSDP2's metrics `aux_grad_norm` and `aux_lr`."""
        self.embedding = None
        if not self.is_trained:
            return {}
        config = self.optimizer_config
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = config.lr * config.lr_factor(self.num_steps)  # LambdaLR's rate at this step
        norm = adamw_step(self.params, self.masters, self.optimizer, config.max_grad_norm, skip_update)
        self.num_steps += 1
        self.num_updates += not skip_update
        return {"aux_grad_norm": float(norm), "aux_lr": config.lr * config.lr_factor(self.num_steps)}

    # -- checkpoints, weights, memory -------------------------------------------------------------------------------

    def sharded_state(self, saved: dict[str, Any] | None = None) -> dict[str, Any]:
        """The modules' weights ("mtp") and AdamW state ("mtp_optimizer") as sharded tensors, on the last stage (empty
        elsewhere). To load (`saved`: the checkpoint's trainer_state.json), AdamW's only if the checkpoint has it
        (else it starts afresh, as on FSDP2)."""
        if self.block is None:
            return {}
        state: dict[str, Any] = {"mtp": self.block.sharded_state_dict(prefix=MTP_PREFIX)}
        if self.optimizer is not None and (saved is None or "aux" in saved):
            optimizer_state, _ = adamw_sharded_state(state["mtp"], self.params, self.masters, self.optimizer)
            # its sharded tensors only: dist_checkpointing keeps rank 0's plain values (the param groups), and rank 0
            # holds no MTP module with pp > 1 (the groups are the optimizer's own: `load_state`)
            state["mtp_optimizer"] = {"state": optimizer_state["state"]}
        return state

    def checkpoint_record(self) -> dict[str, Any]:
        """What trainer_state.json records of the training (the same on every rank)."""
        if not self.is_trained:
            return {}
        names = [aux.name for aux in self.aux_losses]
        return {"aux": {"losses": names, "num_steps": self.num_steps, "adam_step": self.num_updates}}

    def load_state(self, loaded: dict[str, Any], saved: dict[str, Any]) -> None:
        """Take what `sharded_state(saved)` loaded."""
        record = saved.get("aux") if self.is_trained else None
        if record is not None:
            self.num_steps, self.num_updates = int(record["num_steps"]), int(record["adam_step"])
        if self.block is None:
            return
        self.block.load_state_dict({k.removeprefix(MTP_PREFIX): v for k, v in loaded["mtp"].items()}, strict=False)
        if "mtp_optimizer" in loaded:
            assert self.optimizer is not None and record is not None
            lr = self.optimizer_config.lr * self.optimizer_config.lr_factor(self.num_steps)
            load_adamw_state(loaded["mtp_optimizer"], self.params, self.masters, self.optimizer, self.num_updates,
                             [lr] * len(self.optimizer.param_groups))  # fmt: skip

    def hf_source(self) -> dict[str, torch.Tensor]:
        """The modules' tensors under their Megatron names (`mtp.`; a bf16 / fp16 model's float32 masters), for
        `megatron_state.full_hf_state`'s conversion."""
        if self.block is None:
            return {}
        masters = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        state = {MTP_PREFIX + n: masters.get(id(p), p) for n, p in self.block.named_parameters()}
        return state | {MTP_PREFIX + n: b for n, b in self.block.named_buffers()}

    def resident(self) -> Iterator[tuple[dict[str, Any], str]]:
        """(owner, key) of the tensors the backend's memory holds: weights, masters, AdamW's state."""
        for param in self.mtp_parameters():
            yield {"param": param}, "param"
        if self.masters is not self.params:
            for master in self.masters:
                yield {"param": master}, "param"
        yield from state_tensors(self.optimizer)

    @property
    def ddp_modules(self) -> list[Any]:
        """The modules' DDP wrapper (its gradient buffers), where they train."""
        return [self.ddp] if self.ddp is not None else []
