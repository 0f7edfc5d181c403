"""PPO's critic on the Megatron backend (docs/megatron.md, "PPO's critic"; docs/architecture.md, "PPO with a critic"):
the FSDP2 backend's critic (`critic.py`: the value head, the clipped value loss, its metrics) on megatron-core's model
chunks and schedule.

- kind="separate": the critic's own copy of the policy's checkpoint, model chunks of the policy's layout (TP, PP,
  VPP, EP; built as the policy's), with their own megatron-core DDP and float32 masters, and a zero `ValueHead` on the
  last pipeline stage. Its values and its value loss come from its own pass through megatron-core's schedule
  (`run_schedule`), beside the policy's; the value loss alone trains it.
- kind="value_head": the head on the policy's last stage reads the policy's final-norm hidden states
  (`LastStageOutput`); its loss, times `vf_coef`, joins the policy loss in the policy's pass
  (`PolicyStep(joint_value=...)`), so it trains the shared trunk too. Values: a forward-only pass of the policy.

The head is float32 and replicated over the TP ranks (each computes the same values from the same hidden states, and
the full gradient of those hidden states: nothing to reduce over TP), outside megatron's DDP: its gradient is summed
over the data-parallel ranks by hand (the losses are normalized by the global batch's counts, as the policy's). One
AdamW (`CriticConfig.optimizer`, its schedule set by hand: the head's stage alone holds it for a value head) steps the
critic's masters and the head, clipped by their global gradient norm (`megatron_optimizer.adamw_step`: the head
counted once, on TP rank 0). Values are sent from the last stage to the others (`from_last_stage`). The metrics are
FSDP2's: vf_loss, vf_clip_fraction, value_mean, critic_grad_norm, critic_lr.

Checkpoints hold the critic's chunks (keys under "critic."), the head and AdamW's state as sharded tensors, and
trainer_state.json's "critic" record (its kind and steps); weight syncs and HF exports never hold the critic.
Shapes: K response tokens of a micro-batch, H hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_trainer.config import CriticConfig
from miles_trainer.critic import JointValueLoss, ValueHead, _check_rows, value_loss_part
from miles_trainer.megatron_convert import RankLayout
from miles_trainer.megatron_model import MegatronCausalLM
from miles_trainer.megatron_moe import StagePasses
from miles_trainer.megatron_optimizer import adamw, adamw_step, state_tensors, trained_params
from miles_trainer.megatron_schedule import LastStageOutput, from_last_stage, run_schedule
from miles_trainer.megatron_state import adamw_sharded_state, full_hf_state, load_adamw_state
from miles_trainer.packing import MicroBatch, pack_samples, padded_passes
from miles_trainer.step import StepStats, count_trained

CRITIC_PREFIX = "critic."  # the separate critic's checkpoint keys (the policy's chunks hold the same names)
HEAD_PREFIX = "critic.value_head."

Build = Callable[[int], tuple[MegatronCausalLM, dict[str, torch.Tensor]]]  # model chunk -> (chunk, its tensors)


class _ScaleGrad(torch.autograd.Function):
    """`x` unchanged; its gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class MegatronValueHead(ValueHead):
    """`critic.ValueHead` on the last stage. With sequence parallelism the hidden states come from a gather whose
    backward sums the TP ranks' gradients (the output layer's are partial, one vocabulary shard each); the head's are
    whole on every TP rank, so they enter that sum divided by the TP size (not run on a CPU: it needs Transformer
    Engine)."""

    def __init__(self, hidden_size: int, device: torch.device, num_tp_replicas: int) -> None:
        super().__init__(hidden_size, device)
        self.num_tp_replicas = num_tp_replicas

    def forward(self, hidden_KH: torch.Tensor) -> torch.Tensor:
        if self.num_tp_replicas > 1 and hidden_KH.requires_grad:
            hidden_KH = _ScaleGrad.apply(hidden_KH, 1.0 / self.num_tp_replicas)
        return super().forward(hidden_KH)


class MegatronCritic:
    """This rank's part of the critic (see the module docstring): the separate critic's model chunks, the head on the
    last stage, their masters and AdamW. Every rank builds one (without a critic: empty, every call a no-op)."""

    def __init__(
        self,
        config: CriticConfig | None,
        policy_chunks: Sequence[MegatronCausalLM],
        layouts: Sequence[RankLayout],
        build: Build,
        kernel: KernelConfig,
        device: torch.device,
    ) -> None:
        """`policy_chunks`: this rank's policy model chunks (a value head reads their hidden states); `build`: one of
        the critic's chunks with the checkpoint's weights, wrapped in megatron-core's DDP (as the policy's)."""
        self.config, self.kernel, self.device, self.layouts = config, kernel, device, list(layouts)
        self.policy_chunks = list(policy_chunks)
        self.chunks: list[MegatronCausalLM] = []  # kind="separate": the critic's own model chunks
        self.head: MegatronValueHead | None = None  # on the last stage
        # trained parameters (the chunks' with `main_grad`, then the head's) and their float32 masters (the same list
        # where every parameter is float32)
        self.params: list[Any] = []
        self.masters: list[torch.Tensor] = self.params
        self.optimizer: torch.optim.AdamW | None = None
        self.num_steps = 0  # AdamW's steps: every train step steps the critic (FSDP2's critic scheduler's count)
        if config is None:
            return
        if config.optimizer.schedule == "cosine" and config.optimizer.total_steps is None:
            raise ValueError("critic optimizer schedule='cosine' needs total_steps (the optimizer steps it spans)")
        if config.kind == "separate":
            built = [build(chunk) for chunk in range(len(policy_chunks))]
            self.chunks = [chunk for chunk, _ in built]
            self.params, self.masters = trained_params(built, kernel.torch_dtype, device)
        last = self.trunk[-1].gpt
        if last.post_process:
            meg = last.config
            num_replicas = meg.tensor_model_parallel_size if meg.sequence_parallel else 1
            self.head = MegatronValueHead(last.config.hidden_size, device, num_replicas)
            head: list[Any] = list(self.head.parameters())
            is_float32 = self.masters is self.params
            self.params = self.params + head
            self.masters = self.params if is_float32 else self.masters + head
        if self.params:
            self.optimizer = adamw(self.masters, config.optimizer)[0]  # its rate: `step` sets the schedule's

    @property
    def trunk(self) -> list[MegatronCausalLM]:
        """The model chunks whose hidden states the head reads: the critic's own, or the policy's."""
        return self.chunks or self.policy_chunks

    @property
    def is_separate(self) -> bool:
        return self.config is not None and self.config.kind == "separate"

    def _require(self) -> CriticConfig:
        if self.config is None:
            raise ValueError("this backend has no critic: create it with critic=CriticConfig(...)")
        return self.config

    def check_targets(self, returns: Any, old_values: Any) -> None:
        """`train_step`'s value targets: both with a critic, neither without one."""
        has_critic = self.config is not None
        if (returns is not None, old_values is not None) != (has_critic, has_critic):
            raise ValueError(
                "returns and old_values train the critic: pass both with a critic (PPO, advantage estimator gae), "
                "neither without one"
            )

    def is_warmup(self, step_count: int) -> bool:
        """Whether the step `step_count` (0-based) moves the critic alone (`CriticConfig.warmup_steps`)."""
        return self.config is not None and step_count < self.config.warmup_steps

    def _values_K(self, output: LastStageOutput, micro: MicroBatch) -> torch.Tensor:
        """The value of each response token of the micro-batch (K,), from the hidden state of the row predicting it."""
        assert self.head is not None
        values_K: torch.Tensor = self.head(output.hidden_NH[micro.score_rows_K.to(output.hidden_NH.device)])
        return values_K

    # -- values and the value loss --------------------------------------------------------------------------------

    @torch.no_grad()
    def values(self, samples: Sequence[Sample], max_tokens: int, num_passes: int) -> list[list[float]]:
        """V(s_t) of every response token of every sample (masked tokens included), on every rank: a forward-only pass
        of the trunk (`num_passes` passes; MoE routers without replay, as FSDP2's), computed on the last stage."""
        self._require()
        micro_batches = pack_samples(samples, self.kernel, max_tokens, share_prompts=False)
        out: list[list[float]] = [[0.0] * len(sample.response_tokens) for sample in samples]

        def last_stage(output: LastStageOutput, micro: MicroBatch, weight: float) -> torch.Tensor:
            rows = micro.per_sample(self._values_K(output, micro))
            if weight:
                for index, row in zip(micro.sample_indices, rows, strict=True):
                    out[index] = row.tolist()
            return torch.zeros((), device=self.device)

        routing = StagePasses(self.trunk[0].config, replay=False)
        run_schedule(self.trunk, padded_passes(micro_batches, num_passes), last_stage, True, stage_pass=routing)
        return from_last_stage(out, self.device)

    def joint_value(
        self, returns: Sequence[Sequence[float]] | None, old_values: Sequence[Sequence[float]] | None
    ) -> JointValueLoss | None:
        """A value head's part of the policy's pass, where the head is (the last stage); None elsewhere."""
        if self.config is None or self.is_separate or self.head is None:
            return None
        assert returns is not None and old_values is not None
        return JointValueLoss(self.head, returns, old_values, self.config)

    def accumulate(
        self,
        samples: Sequence[Sample],
        returns: Sequence[Sequence[float]] | None,
        old_values: Sequence[Sequence[float]] | None,
        max_tokens: int,
        num_passes: int,
        sum_dp: Callable[[torch.Tensor], None],
        max_response_len: int | None,
        stats: StepStats,
    ) -> None:
        """The separate critic's forward and backward of the clipped value loss over this rank's micro-batches (its own
        pass through the schedule; normalized by the global batch's counts, `sum_dp` summing over the data-parallel
        ranks), then megatron-core's gradient reduction; the loss and its metrics join `stats` on the last stage as
        FSDP2's `accumulate_value_gradients` reports them. Nothing for a value head (its loss joins the policy's)."""
        if not self.is_separate:
            return
        config = self._require()
        assert returns is not None and old_values is not None
        from megatron.core.distributed import finalize_model_grads

        _check_rows("returns", samples, returns)
        _check_rows("old_values", samples, old_values)
        local = torch.tensor(count_trained(samples), dtype=torch.int64)
        sum_dp(local)
        counts: dict[str, int | None] = {"global_num_tokens": int(local[0]), "global_num_seqs": int(local[1]),
                                         "max_response_len": max_response_len}  # fmt: skip
        totals = {"vf_loss": 0.0, "vf_clip_fraction": 0.0, "value_mean": 0.0, "num_tokens": 0.0}

        def last_stage(output: LastStageOutput, micro: MicroBatch, weight: float) -> torch.Tensor:
            loss, metrics, mask_BT = value_loss_part(
                self._values_K(output, micro), micro, returns, old_values, config, counts
            )
            if weight:
                num_valid = float(mask_BT.sum())
                totals["vf_loss"] += float(loss.detach())
                totals["num_tokens"] += num_valid
                for name in ("vf_clip_fraction", "value_mean"):
                    totals[name] += float(metrics[name]) * num_valid
            return loss * weight

        micro_batches = pack_samples(samples, self.kernel, max_tokens, share_prompts=False)
        routing = StagePasses(self.trunk[0].config, replay=False)  # the critic's routers: no replay, no MoE loss
        run_schedule(self.chunks, padded_passes(micro_batches, num_passes), last_stage, False, stage_pass=routing)
        finalize_model_grads([chunk.gpt_ddp for chunk in self.chunks])
        if self.head is not None:  # the other stages' stats are empty: the backend's all-reduces take these
            num_tokens = totals.pop("num_tokens")
            stats.add("vf_loss", totals.pop("vf_loss"))
            for name, total in totals.items():
                stats.add_mean(name, total / max(num_tokens, 1.0), num_tokens)

    # -- the optimizer step ---------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.gpt_ddp.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _lr(self, step: int) -> float:
        config = self._require().optimizer
        return config.lr * config.lr_factor(step)  # LambdaLR's rate at `step`

    def step(self) -> dict[str, float]:
        """The critic's AdamW step, every train step, warm-up included (every rank calls it): the head's gradient
        summed over the data-parallel ranks, every gradient clipped by the global norm; FSDP2's `critic_grad_norm` and
        `critic_lr`."""
        if self.config is None:
            return {}
        from megatron.core import parallel_state as ps

        if self.head is not None:
            param: Any
            for param in self.head.parameters():
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=ps.get_data_parallel_group())
                param.main_grad = grad  # what `adamw_step` reads, as of megatron-core's parameters
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(self.num_steps)
        norm = adamw_step(self.params, self.masters, self.optimizer, self.config.optimizer.max_grad_norm)
        self.num_steps += 1
        return {"critic_grad_norm": float(norm), "critic_lr": self._lr(self.num_steps)}

    # -- checkpoints, state, memory -------------------------------------------------------------------------------

    def sharded_state(self, saved: dict[str, Any] | None = None) -> dict[str, Any]:
        """The critic's chunks ("critic", "critic1", ...), its head ("critic_head") and AdamW's state
        ("critic_optimizer") as sharded tensors (empty without a critic, and on a value head's other stages). To load
        (`saved`: the checkpoint's trainer_state.json), a checkpoint without this kind of critic is refused."""
        if self.config is None:
            return {}
        record = None if saved is None else saved.get("critic")
        if saved is not None and (record is None or record["kind"] != self.config.kind):
            held = "no critic" if record is None else f"a {record['kind']!r} critic"
            raise ValueError(f"the checkpoint holds {held}, the trainer a {self.config.kind!r} one: resume with the "
                             "critic settings the run started with")  # fmt: skip
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        model: dict[str, Any] = {
            "critic" + (str(i) if i else ""): chunk.gpt.sharded_state_dict(prefix=CRITIC_PREFIX)
            for i, chunk in enumerate(self.chunks)
        }
        if self.head is not None:
            model["critic_head"] = make_sharded_tensors_for_checkpoint(self.head.state_dict(keep_vars=True),
                                                                       HEAD_PREFIX)  # fmt: skip
        if self.optimizer is None:
            return model
        return model | {"critic_optimizer": adamw_sharded_state(model, self.params, self.masters, self.optimizer)[0]}

    def checkpoint_record(self) -> dict[str, Any]:
        """What trainer_state.json records of the critic (the same on every rank)."""
        return {} if self.config is None else {"critic": {"kind": self.config.kind, "num_steps": self.num_steps}}

    def load_state(self, loaded: dict[str, Any], saved: dict[str, Any]) -> None:
        """Take what `sharded_state(saved)` loaded."""
        if self.config is None:
            return
        self.num_steps = int(saved["critic"]["num_steps"])
        for i, chunk in enumerate(self.chunks):
            state = loaded["critic" + (str(i) if i else "")]
            chunk.gpt.load_state_dict({k.removeprefix(CRITIC_PREFIX): v for k, v in state.items()}, strict=False)
        if self.head is not None:
            self.head.load_state_dict({k.removeprefix(HEAD_PREFIX): v for k, v in loaded["critic_head"].items()})
        if self.optimizer is not None:
            optimizer, lrs = self.optimizer, [self._lr(self.num_steps)] * len(self.optimizer.param_groups)
            load_adamw_state(loaded["critic_optimizer"], self.params, self.masters, optimizer, self.num_steps, lrs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's full float32 tensors on the CPU, identical on every rank: the separate critic's model under HF
        names (as the policy's `full_state_dict`), its head as "value_head.score.weight" / ".bias" (from the last
        stage). For inspection and tests: engines never get the critic."""
        from megatron.core import parallel_state as ps

        out: dict[str, torch.Tensor] = {}
        if self.config is None:
            return out
        if self.chunks:
            out = full_hf_state(self.chunks, self.layouts, self.params, self.masters, self.device)
        hidden = self.trunk[-1].config.hidden_size
        for name, shape in (("weight", (1, hidden)), ("bias", (1,))):
            tensor = getattr(self.head.score, name).detach() if self.head is not None else None
            tensor = torch.empty(shape, device=self.device) if tensor is None else tensor.clone()
            if ps.get_pipeline_model_parallel_world_size() > 1:
                last = ps.get_pipeline_model_parallel_last_rank()
                dist.broadcast(tensor, src=last, group=ps.get_pipeline_model_parallel_group())
            out[f"value_head.score.{name}"] = tensor.cpu()
        return out

    def parameters(self) -> list[torch.Tensor]:
        """The critic's weights: its model chunks' (a separate critic) and the value head's (on the last stage)."""
        head = list(self.head.parameters()) if self.head is not None else []
        return [*(p for chunk in self.chunks for p in chunk.gpt.parameters()), *head]

    def resident(self) -> Iterator[tuple[dict[str, Any], str]]:
        """(owner, key) of the tensors the backend's memory holds: the chunks' and the head's parameters, the
        float32 masters of a bf16 / fp16 model, AdamW's state."""
        seen: set[int] = set()
        for param in [*(p for chunk in self.chunks for p in chunk.gpt.parameters()), *self.params, *self.masters]:
            if id(param) not in seen:
                seen.add(id(param))
                yield {"param": param}, "param"
        yield from state_tensors(self.optimizer)

    @property
    def ddp_modules(self) -> list[Any]:
        """The separate critic's DDP wrappers (their gradient buffers)."""
        return [chunk.gpt_ddp for chunk in self.chunks]
