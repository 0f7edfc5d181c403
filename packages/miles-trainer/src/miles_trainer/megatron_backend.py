"""The Megatron-core training backend (`trainer.backend.name=megatron`, docs/megatron.md): a `GPTModel` with
tensor, pipeline (and virtual pipeline), expert and data parallelism from `MegatronConfig`, driven by the same step
code as the FSDP2 backend.

Megatron-core's schedule runs the micro-batches through this rank's model chunks (`megatron_schedule.py`); on the
last pipeline stage each micro-batch's loss is `policy_step.PolicyStep`'s, so the policy losses, the counts, the
TIS / MIS weights, the KL term and the metrics are the FSDP2 backend's, line for line. Each packed micro-batch
(packed without prompt sharing: one sequence per sample) is laid out as a right-padded (B, S) batch with a causal
mask, since Megatron-core's local attention takes no packed sequences (Transformer Engine's THD layout would; see
the guide). Logits are gathered over the TP ranks, so every TP rank computes the same loss; gradients are reduced
over the data-parallel ranks by Megatron-core's `DistributedDataParallel` (summed: the losses are normalized by the
global batch's token counts, as in FSDP2), then `finalize_model_grads` (sequence-parallel norms, a tied embedding's
two pipeline copies). The optimizer is torch's fused AdamW over float32 masters of each rank's shards, with the
global gradient norm computed over the model-parallel ranks (each TP-replicated tensor counted once;
`megatron_optimizer.py`). The policy's MTP modules sit beside the last stage with their own DDP and AdamW, trained
by the auxiliary losses (miles-spec's MTP loss) on detached trunk inputs (`megatron_mtp.py`). PPO's critic (its own
model chunks, or a value head on the policy's last stage) has its own pass, DDP and AdamW (`megatron_critic.py`).

Checkpoints and the full HF tensors engines get are `megatron_state.py`'s. On a CPU device (gloo groups) every call
runs in `megatron_cpu.device_mode`, which stands in for megatron-core's CUDA-only bookkeeping (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles_contracts import Sample
from miles_kernels import KernelConfig, iter_checkpoint, kernel_fingerprint, read_model_config
from miles_memory.config import MemoryConfig
from miles_trainer.auxiliary import AuxLoss
from miles_trainer.config import BackendConfig, CriticConfig, LoraTrainConfig, OptimizerConfig, PolicyLossConfig
from miles_trainer.logprobs import response_logprobs
from miles_trainer.lora import check_lora
from miles_trainer.megatron_backend_state import MegatronStateIO
from miles_trainer.megatron_convert import MTP_PREFIX, RankLayout, hf_to_megatron, rank_entries
from miles_trainer.megatron_cpu import device_mode, in_device_mode
from miles_trainer.megatron_critic import MegatronCritic
from miles_trainer.megatron_lora import (
    attach_megatron_adapters,
    check_megatron_lora,
    disabled_adapters,
)
from miles_trainer.megatron_memory import megatron_memory
from miles_trainer.megatron_model import (
    MegatronCausalLM,
    build_gpt_model,
    init_parallel,
    rank_layout,
    require_megatron,
    virtual_stages,
)
from miles_trainer.megatron_moe import StagePasses, check_moe_layout
from miles_trainer.megatron_mtp import MegatronMTP
from miles_trainer.megatron_optimizer import adamw, adamw_step, state_tensors, trained_params
from miles_trainer.megatron_schedule import LastStageOutput, from_last_stage, run_schedule
from miles_trainer.moe import moe_shape
from miles_trainer.packing import MicroBatch, pack_samples, padded_passes, plan_samples
from miles_trainer.policy_step import PolicyStep
from miles_trainer.step import (
    PerSample,
    StepStats,
    add_batch_stats,
    add_is_metrics,
    batch_normalizers,
    batch_summary,
    has_update_signal,
    resolve_loss_fn,
)
from miles_trainer.weight_sender import WeightSender


def _check_device(device: str) -> None:
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.backend.device=cuda but CUDA is not available on this machine")
    if kind not in ("cuda", "cpu"):
        raise RuntimeError(
            f"trainer.backend.device={device!r}: the Megatron backend runs on cuda, or on cpu (its CPU device mode, "
            "gloo groups: development and CI)"
        )


class MegatronBackend(MegatronStateIO):
    """A Megatron-core GPTModel over the default process group (on this rank: its model chunks, one per virtual
    pipeline stage), with its optimizer (and optionally a frozen reference copy), behind the FSDP2 backend's
    interface. Every rank makes the same calls in the same order."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kernel: KernelConfig,
        optimizer: OptimizerConfig | None = None,
        loss: PolicyLossConfig | None = None,
        config: BackendConfig | None = None,
        *,
        keep_reference: bool | None = None,
        critic: CriticConfig | None = None,
        aux_losses: Sequence[AuxLoss] = (),
        aux_optimizer: OptimizerConfig | None = None,
        memory: MemoryConfig | None = None,
        routing_replay: bool = False,
        offload_dir: str | os.PathLike[str] | None = None,
        lora: LoraTrainConfig | None = None,
    ) -> None:
        """As `FSDP2Backend`. `critic`: PPO's, with its own AdamW (megatron_critic). Routing replay and the MoE losses
        run in the routers (megatron_moe); `aux_losses` train the policy's MTP modules, with their own AdamW
        (`aux_optimizer`, default: the policy's settings; megatron_mtp). `memory`: offload target, budget, partial
        offload and OOM handling, FSDP2's (megatron_memory; `offload_dir`: where a CPU run offloads). `lora`: train
        per-HF-projection adapters on the frozen base (megatron_lora; tp = etp = 1): only they train, checkpoint
        and sync, and the KL reference is the base (the adapters switched off, no copy)."""
        require_megatron()
        if not dist.is_initialized():
            raise RuntimeError("MegatronBackend needs torch.distributed initialized (torchrun, or init_process_group)")
        self.kernel = kernel
        self.optimizer_config = optimizer or OptimizerConfig()
        self.loss_config = loss or PolicyLossConfig()
        self.config = config or BackendConfig(name="megatron")
        if self.config.activation_checkpointing and self.config.megatron.recompute == "none":
            full = self.config.megatron.model_copy(update={"recompute": "full"})  # the FSDP2 switch means the same
            self.config = self.config.model_copy(update={"megatron": full})
        layout = self.config.megatron
        check_moe_layout(layout, routing_replay, self.loss_config)
        self.routing_replay = routing_replay
        self.aux_losses, self.aux_optimizer_config = list(aux_losses), aux_optimizer or self.optimizer_config
        if layout.cp > 1:
            raise NotImplementedError(
                f"megatron cp={layout.cp}: context parallelism is not wired into the Megatron backend yet (it needs "
                "Transformer Engine's attention); tp, pp, vpp, ep, etp, sequence_parallel and data parallelism are"
            )
        if self.optimizer_config.schedule == "cosine" and self.optimizer_config.total_steps is None:
            raise ValueError("optimizer schedule='cosine' needs total_steps (the optimizer steps it spans)")
        if self.optimizer_config.algorithm == "muon":
            raise ValueError(
                "optimizer algorithm=muon runs on the FSDP2 backend only (the Megatron backend steps with "
                "megatron-core's AdamW); use algorithm=adamw or trainer.backend.name=fsdp2"
            )
        if self.optimizer_config.offload != "none":
            raise ValueError(
                f"optimizer offload={self.optimizer_config.offload} (AdamW's state in host memory) runs on the FSDP2 "
                "backend only; use offload=none or trainer.backend.name=fsdp2"
            )
        resolve_loss_fn(self.loss_config.loss_fn, self.loss_config.surrogate)
        _check_device(self.config.device)
        self.device = torch.device(self.config.device)
        self.max_tokens = self.config.max_tokens_per_micro_batch
        self.model_config = read_model_config(model_dir)
        self.model_dir = model_dir
        self.lora = lora if lora is not None and lora.is_enabled else None
        if self.lora is not None:
            check_lora(self.lora, kernel)
            check_megatron_lora(self.lora, layout, self.model_config)
        with device_mode(self.device):
            self._build_chunks(model_dir, layout, keep_reference)
            build = functools.partial(self._build, model_dir, train=True)  # the separate critic's chunks
            self.critic = MegatronCritic(critic, self.chunks, self.layouts, build, self.kernel, self.device)
        self.critic_config = critic  # checkpoint.py reads it of either backend
        # what weight sync sends: buckets, a file, tensors (with LoRA: the adapters and what else trains; the checksum
        # still covers every weight the engine holds, base included)
        self.weights = WeightSender(self._sync_model if self.lora is not None else self._export_model,
                                    checksum_model=self._export_model)  # fmt: skip
        trunk = [*self.chunks, *(self.reference_chunks or [])]
        self.memory = megatron_memory(
            memory or MemoryConfig(), self.device, offload_dir=offload_dir,
            weights=lambda: [*(p for chunk in trunk for p in chunk.gpt.parameters()), *self.critic.parameters()],
            mtp=self.mtp.mtp_parameters, resident=self._resident, ddp_modules=self._ddp_modules,
            trained=lambda: [*self.masters, *self.mtp.masters, *self.critic.masters],
        )  # fmt: skip
        self.memory.check_fits()

    def _build_chunks(self, model_dir: str | os.PathLike[str], layout: Any, keep_reference: bool | None) -> None:
        """Megatron's process groups, this rank's model chunks (and their frozen reference copies), the float32
        masters and AdamW."""
        init_parallel(layout)
        chunks = virtual_stages(layout)
        # this rank's layout of each of its model chunks (one per virtual pipeline stage; one without)
        self.layouts: list[RankLayout] = [
            rank_layout(self.model_config, layout, vp_stage) for vp_stage in (range(chunks) if chunks else [None])
        ]
        built = [self._build(model_dir, chunk, train=True, adapted=True) for chunk in range(len(self.layouts))]
        self.chunks = [chunk for chunk, _ in built]
        self.model = self.chunks[0]
        self.reference_chunks: list[MegatronCausalLM] | None = None
        self.has_reference = bool(keep_reference if keep_reference is not None else self.loss_config.kl_coef > 0)
        if self.has_reference and self.lora is None:  # with LoRA the reference is the base: adapters off
            self.reference_chunks = [self._build(model_dir, chunk, train=False)[0] for chunk in range(len(built))]
        self.params, self.masters = trained_params(built, self.kernel.torch_dtype, self.device)  # masters: float32
        self.optimizer, self.scheduler = adamw(self.masters, self.optimizer_config)
        self.mtp = MegatronMTP(self.model_config, layout, self.kernel, self.chunks, built[-1][1], self.device,
                               self.aux_losses, self.aux_optimizer_config)  # fmt: skip
        self.step_count = 0
        self.aux_params: list[torch.nn.Parameter] = []  # checkpoint.py reads it of either backend

    def _build(
        self, model_dir: str | os.PathLike[str], chunk: int, train: bool, adapted: bool = False
    ) -> tuple[MegatronCausalLM, dict[str, torch.Tensor]]:
        """This rank's model chunk `chunk` (a GPTModel) with the checkpoint's weights (wrapped in Megatron's DDP to
        train), and the converted float32 tensors it was loaded from. `adapted`: the policy's chunk of a LoRA run,
        its base frozen under adapters (a separate critic trains whole)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        vp_stage = chunk if len(self.layouts) > 1 else None
        layout = self.layouts[chunk]
        gpt = build_gpt_model(self.model_config, self.config.megatron, self.kernel.torch_dtype, vp_stage, self.kernel)
        wanted = {name for entry in rank_entries(self.model_config, layout) for name in entry.hf_names}
        hf = {name: tensor for name, tensor in iter_checkpoint(model_dir) if name in wanted}
        state = hf_to_megatron(hf.__getitem__, self.model_config, layout)
        trunk = {name: tensor for name, tensor in state.items() if not name.startswith(MTP_PREFIX)}  # MTP: beside
        missing, unexpected = gpt.load_state_dict(trunk, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(
                f"HF -> Megatron conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        gpt = gpt.to(self.device)
        if adapted and self.lora is not None:  # the adapters' float32 initial values: a bf16 / fp16 model's masters
            state |= attach_megatron_adapters(gpt, self.model_config, layout, self.lora, self.kernel, self.device)
        if not train:
            return MegatronCausalLM(gpt.eval().requires_grad_(False), self.model_config, self.kernel), state
        ddp = DistributedDataParallel(
            config=gpt.config, module=gpt,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        )  # fmt: skip
        return MegatronCausalLM(ddp, self.model_config, self.kernel), state

    def kernel_fingerprint(self, device_type: str) -> str:
        """The engine's kernel fingerprint (`miles_kernels.kernel_fingerprint`) when this model computes the engine's
        bits: the Miles layers on an exact layout (docs/true-on-policy.md); else what runs instead, which no engine
        reports (megatron-core's modules, or the Miles layers with megatron-core's TP partial sums)."""
        layout = self.config.megatron
        if not self.model.is_miles:
            return f"megatron-core:{device_type}"
        fingerprint = kernel_fingerprint(self.kernel, device_type)
        return fingerprint if not layout.exactness_problems() else f"{fingerprint}+tp{layout.tp}-{layout.tp_reduce}"

    # -- data parallelism ----------------------------------------------------------------------------------------

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank's data-parallel share: TP peers train the same samples."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _pp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    def _sum_dp(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self._dp_group())

    def _num_passes(self, samples: Sequence[Sample]) -> int:
        """The busiest rank's micro-batch count (every rank runs as many passes), with virtual pipeline stages
        rounded up to a multiple of pp (the interleaved schedule runs the micro-batches in groups of pp)."""
        passes = torch.tensor([len(plan_samples(samples, self.max_tokens, share_prompts=False))])
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        group = self.config.megatron.pp if len(self.chunks) > 1 else 1
        return -(-int(passes.item()) // group) * group

    @property
    def _last_stage(self) -> bool:
        """Whether this rank holds the output layer (the losses and log-probs are computed there)."""
        return self.layouts[-1].is_last_stage

    # -- the step --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    @in_device_mode
    def compute_logprobs(self, samples: Sequence[Sample], reference: bool = False) -> list[list[float]]:
        """Log-probs of each sample's response tokens under the current (or the reference) weights, on every rank
        (computed on the last pipeline stage, sent to the others)."""
        if reference and not self.has_reference:
            raise ValueError("this backend keeps no reference model: create it with keep_reference=True")
        chunks = self.reference_chunks if reference and self.lora is None else self.chunks
        assert chunks is not None
        self._check_onloaded()
        replay = self.routing_replay and not reference
        shape = moe_shape(self.model) if replay else None  # type: ignore[arg-type]
        micro_batches = pack_samples(samples, self.kernel, self.max_tokens, False, shape, require_routing=replay)
        passes = padded_passes(micro_batches, self._num_passes(samples))
        out: list[list[float]] = [[0.0] * len(sample.response_tokens) for sample in samples]
        temperature = self.loss_config.temperature

        def last_stage(output: LastStageOutput, micro: MicroBatch, weight: float) -> torch.Tensor:
            values = response_logprobs(output, micro, temperature)  # type: ignore[arg-type]
            if weight:
                for index, row in zip(micro.sample_indices, values, strict=True):
                    out[index] = row.tolist()
            return torch.zeros((), device=self.device)

        with disabled_adapters(chunks) if reference else contextlib.nullcontext():
            run_schedule(chunks, passes, last_stage, forward_only=True,
                         stage_pass=StagePasses(self.model_config, replay))  # fmt: skip
        return from_last_stage(out, self.device)

    @torch.no_grad()
    @in_device_mode
    def compute_values(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The critic's V(s_t) of each response token, on every rank (computed on the last pipeline stage, sent to
        the others); see `FSDP2Backend.compute_values`."""
        self._check_onloaded()
        return self.critic.values(samples, self.max_tokens, self._num_passes(samples))

    @in_device_mode
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: PerSample,
        *,
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
        returns: Sequence[Sequence[float]] | None = None,
        old_values: Sequence[Sequence[float]] | None = None,
        measure_mismatch: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's samples (TP peers pass the same ones); see `FSDP2Backend.train_step`."""
        from megatron.core.distributed import finalize_model_grads

        if not samples:
            raise ValueError("every rank needs at least one sample per step")
        self.critic.check_targets(returns, old_values)
        self._check_onloaded()
        is_warmup = self.critic.is_warmup(self.step_count)
        runs_policy = not (is_warmup and self.critic.is_separate)  # a separate critic warms up alone
        start = time.perf_counter()
        loss = self.loss_config
        if self.has_reference and ref_logprobs is None:
            ref_logprobs = self.compute_logprobs(samples, reference=True)
        is_weights, is_metrics, global_tokens, global_seqs = batch_normalizers(
            samples, old_logprobs, loss, self._sum_dp
        )
        aux_counts = self.mtp.counts(samples, self._sum_dp)
        joint_value = self.critic.joint_value(returns, old_values)  # a value head's loss joins the policy's

        def accumulate(max_tokens: int) -> tuple[StepStats, bool]:
            """The step's passes with `max_tokens` per micro-batch (an OOM retry halves it); (stats, whether the
            policy had tokens to train)."""
            self.max_tokens = max_tokens
            stats = StepStats()
            step = PolicyStep(
                self.model, samples, advantages, self.kernel, loss, max_tokens,  # type: ignore[arg-type]
                global_num_tokens=global_tokens, global_num_seqs=global_seqs, old_logprobs=old_logprobs,
                ref_logprobs=ref_logprobs, is_weights=is_weights, measure_mismatch=measure_mismatch,
                share_prompts=False, aux_losses=self.aux_losses, aux_counts=aux_counts, joint_value=joint_value,
                routing_replay=self.routing_replay, computes_moe_terms=False,  # the routers add them: megatron_moe
            )  # fmt: skip

            def last_stage(output: LastStageOutput, micro: MicroBatch, weight: float) -> torch.Tensor:
                total, finish = step.loss(output, micro, weight, stats)  # type: ignore[arg-type]
                finish(stats)
                return total * weight

            self.mtp.begin_step()
            passes = self._num_passes(samples)
            self.critic.accumulate(samples, returns, old_values, max_tokens, passes, self._sum_dp,
                                   loss.max_response_len, stats)  # fmt: skip
            if step.trains and runs_policy:
                dp = self.data_parallel[1]
                moe = StagePasses(self.model_config, self.routing_replay, loss, stats, step.total_rows, dp)
                run_schedule(self.chunks, step.passes(passes), last_stage, False, stage_pass=moe)
            return stats, step.trains

        (stats, trains), self.max_tokens = self.memory.with_oom_retry(self.max_tokens, accumulate, self._zero_grad)
        finalize_model_grads([chunk.gpt_ddp for chunk in self.chunks])
        self.mtp.finalize_grads()
        if self._last_stage:  # the other stages' stats are empty: the all-reduce over the pipeline takes these
            if runs_policy:
                add_is_metrics(stats, is_metrics, samples)
            add_batch_stats(stats, samples, advantages)
        critic_metrics = self.critic.step()  # the critic's own AdamW
        skip_update = is_warmup or not has_update_signal(advantages, loss)
        metrics = self._finish_step(stats, start, skip_update=skip_update)
        return metrics | self.mtp.step(skip_update=not (trains and runs_policy)) | critic_metrics

    def _zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.gpt_ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        self.mtp.zero_grad()
        self.critic.zero_grad()

    def _finish_step(self, stats: StepStats, start: float, skip_update: bool = False) -> dict[str, float]:
        clip = self.optimizer_config.max_grad_norm
        grad_norm = adamw_step(self.params, self.masters, self.optimizer, clip, skip_update)
        if not skip_update:
            self.scheduler.step()
        self.step_count += 1
        if self._last_stage:
            stats.add("skipped_update", float(skip_update) / self.data_parallel[1])
        for name, value in self.memory.step_metrics().items():  # the busiest rank's
            stats.add_max(name, value)
        stats.all_reduce(self._dp_group())
        stats.all_reduce(self._pp_group())  # from the last stage to the others
        metrics = stats.summary()
        metrics.update(batch_summary(metrics))
        elapsed = time.perf_counter() - start
        metrics.update({
            "grad_norm": float(grad_norm), "lr": float(self.scheduler.get_last_lr()[0]), "step_time_s": elapsed,
            "tokens_per_s": metrics.get("num_tokens", 0.0) / elapsed,
        })  # fmt: skip
        return metrics

    # -- memory --------------------------------------------------------------------------------------------------

    def _resident(self) -> Iterator[tuple[dict[str, Any], str]]:
        """(owner, key) of every tensor the memory holds: the policy's and the reference's parameters, the float32
        masters of a bf16 / fp16 model, AdamW's state; the MTP modules' and the critic's likewise."""
        for chunk in [*self.chunks, *(self.reference_chunks or [])]:
            for param in chunk.gpt.parameters():
                yield {"param": param}, "param"
        if self.masters is not self.params:
            for master in self.masters:
                yield {"param": master}, "param"
        yield from state_tensors(self.optimizer)
        yield from self.mtp.resident()
        yield from self.critic.resident()

    def _ddp_modules(self) -> list[Any]:
        """Megatron's DDP wrappers (their gradient buffers): the model chunks', the MTP modules' where they train, the
        separate critic's."""
        return [chunk.gpt_ddp for chunk in self.chunks] + self.mtp.ddp_modules + self.critic.ddp_modules

    @in_device_mode
    def offload(self, room_for: int | None = None) -> int:
        """Free the weights, the reference copy, the MTP modules, the critic, AdamW's state and the gradient buffers
        while the engine works (to host memory on CUDA, a file on a CPU: `memory.offload_to`); returns the bytes
        freed on this rank. `room_for`: the bytes the engine takes back beside this rank; with
        `memory.partial_offload` only what makes them fit within the budget moves, largest tensors first.
        `onload()` brings everything back bit for bit (the gradient buffers as zeros)."""
        self._zero_grad()
        return self.memory.offload(room_for).freed_bytes

    @in_device_mode
    def onload(self) -> int:
        """Bring back what `offload()` freed; returns the bytes restored on this rank. With `memory.limit_bytes`,
        a `torch.OutOfMemoryError` (with a report by tag) when it would not fit."""
        return self.memory.manager.onload()

    @property
    def is_offloaded(self) -> bool:
        return self.memory.manager.is_offloaded()

    def _check_onloaded(self) -> None:
        if self.memory.manager.is_offloaded():
            raise RuntimeError("the trainer is offloaded: call onload() before training or exporting weights")
