"""The Megatron backend's checkpoints and weights (a mixin of `MegatronBackend`, megatron_backend.py): the model, the
optimizer, the MTP modules and the critic written and read with megatron-core's `dist_checkpointing` (any layout on
resume: it reshards), and the full HF tensors an engine gets (a LoRA run's sync: the adapters, and the MTP layers an
auxiliary loss trains). The tensors' gathering and naming are megatron_state.py's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles_trainer.megatron_cpu import in_device_mode
from miles_trainer.megatron_lora import adapter_hf_tensors, adapter_sharded_state
from miles_trainer.megatron_state import (
    ExportedWeights,
    full_hf_state,
    gather_stages,
    load_sharded_state,
    sharded_state,
)

if TYPE_CHECKING:
    from miles_kernels import KernelConfig, ModelConfig
    from miles_trainer.config import BackendConfig, LoraTrainConfig
    from miles_trainer.megatron_convert import RankLayout
    from miles_trainer.megatron_critic import MegatronCritic
    from miles_trainer.megatron_model import MegatronCausalLM
    from miles_trainer.megatron_mtp import MegatronMTP


class MegatronStateIO:
    """`MegatronBackend`'s checkpoint and weight-export methods (a mixin: they work on the backend's chunks,
    parameters, float32 masters, optimizer, MTP modules and critic)."""

    config: BackendConfig
    kernel: KernelConfig
    model_config: ModelConfig
    device: torch.device
    lora: LoraTrainConfig | None
    chunks: list[MegatronCausalLM]
    layouts: list[RankLayout]
    params: list[torch.nn.Parameter]
    masters: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    mtp: MegatronMTP
    critic: MegatronCritic

    if TYPE_CHECKING:

        def _check_onloaded(self) -> None: ...

    # -- checkpoints ---------------------------------------------------------------------------------------------

    @in_device_mode
    def write_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Model and optimizer with megatron-core's `dist_checkpointing` into `directory` (every rank calls it);
        returns what `trainer_state.json` records of them (`checkpoint.save_checkpoint` does the rest)."""
        from megatron.core import dist_checkpointing

        state = sharded_state(self.chunks, self.params, self.masters, self.optimizer, self._adapter_state())
        step = state.pop("adam_step")
        state |= self.mtp.sharded_state() | self.critic.sharded_state()
        directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, str(directory))
        layout = self.config.megatron.model_dump()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        record = {"backend": "megatron", "megatron": layout, "adam_step": step, "adam_lrs": lrs}
        if self.lora is not None:  # the checkpoint holds the adapters only: the base is the model directory
            record["lora"] = self.lora.adapters().model_dump()
        return record | self.mtp.checkpoint_record() | self.critic.checkpoint_record()

    @in_device_mode
    def read_checkpoint(self, path: Path, saved: dict[str, Any]) -> None:
        """Load what `write_checkpoint` wrote (any TP / PP / EP / ETP / DP layout: dist_checkpointing reshards)."""
        if saved.get("backend") != "megatron":
            raise ValueError(
                f"{path} was written by the fsdp2 backend: resume it with trainer.backend.name=fsdp2, or convert its "
                "weights (miles-trainer convert) and start a Megatron run from them"
            )
        saved_lora, lora = saved.get("lora"), self.lora.adapters().model_dump() if self.lora is not None else None
        if saved_lora != lora:
            raise ValueError(
                f"{path} was written with trainer.lora={saved_lora}, the trainer has {lora}: resume with the LoRA "
                "settings the run started with"
            )
        extra = self.mtp.sharded_state(saved) | self.critic.sharded_state(saved)
        loaded = load_sharded_state(self.chunks, self.params, self.masters, self.optimizer, path, saved, extra,
                                    self._adapter_state())  # fmt: skip
        self.mtp.load_state(loaded, saved)
        self.critic.load_state(loaded, saved)

    # -- weights ---------------------------------------------------------------------------------------------------

    @in_device_mode
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full float32 tensors on the CPU under HF checkpoint names (tied embeddings once), identical on every rank:
        each tensor's shards gathered over its TP / ETP group, experts over the EP group, then the pipeline stages'
        tensors over the pipeline group."""
        state = full_hf_state(self.chunks, self.layouts, self.params, self.masters, self.device)
        return state | self._adapters()

    def _adapters(self) -> dict[str, torch.Tensor]:
        """A LoRA run's adapters under HF names (`...q_proj.lora_A`; a bf16 / fp16 model's float32 masters),
        identical on every rank; {} without LoRA."""
        if self.lora is None:
            return {}
        by_param = {id(param): master for param, master in zip(self.params, self.masters, strict=True)}
        return gather_stages(adapter_hf_tensors(self.chunks, self.layouts, by_param), self.device)

    def _adapter_state(self) -> dict[str, Any] | None:
        """With LoRA, the model state a checkpoint holds: the adapters (megatron_lora); None: the whole model."""
        return adapter_sharded_state(self.chunks) if self.lora is not None else None

    def _export_model(self) -> ExportedWeights:
        """The full HF tensors `self.weights` sends (gathered on every rank; the trainer must be onloaded)."""
        self._check_onloaded()
        return ExportedWeights(self.full_state_dict(), self.kernel)

    def _sync_model(self) -> ExportedWeights:
        """What a LoRA run's sync sends: the adapters, and the MTP layers where an auxiliary loss trains them."""
        self._check_onloaded()
        tensors = self._adapters()
        if self.mtp.masters:
            first_mtp = self.model_config.num_hidden_layers
            mtp = (f"model.layers.{first_mtp + i}." for i in range(self.model_config.num_nextn_predict_layers))
            prefixes = tuple(mtp)
            tensors |= {n: t for n, t in self.full_state_dict().items() if n.startswith(prefixes)}
        return ExportedWeights(tensors, self.kernel)
