"""One trainer rank's share of the job: its backend (FSDP2 or Megatron, `trainer.backend.name`) and the calls the
loop makes on it.

The Ray cluster runs one per actor (ray/actors.py: `TrainerRankActor`, which adds the process group and this rank's
part in the weight transport, transport/); the local cluster runs one in the driver, on the engine's thread. Every
call is collective: each rank makes it with its own share of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_contracts import Sample
from miles_kernels import kernel_fingerprint
from miles_orchestrator.cluster.protocol import CriticTargets
from miles_orchestrator.cluster.settings import TrainerSettings
from miles_rollout import TraceRecorder
from miles_spec import Eagle3Loss, MTPLoss
from miles_spec.config import SpecConfig
from miles_trainer import FSDP2Backend, MegatronBackend, export_hf, load_checkpoint, save_checkpoint


def _draft_loss(spec: SpecConfig) -> MTPLoss | Eagle3Loss:
    """The online draft's loss: the MTP modules', or the attached EAGLE-3 draft's over spec's TTT steps."""
    if spec.draft == "eagle3":
        return Eagle3Loss(spec.mtp_loss_coef, spec.eagle3_steps)
    return MTPLoss(spec.mtp_loss_coef)


class TrainerRank:
    """A trainer rank built from `TrainerSettings` (torch.distributed must be initialized)."""

    def __init__(self, model_dir: str, settings: TrainerSettings) -> None:
        self.model_dir = model_dir
        self.kernel = settings.kernel
        self.backend: FSDP2Backend | MegatronBackend
        spec = settings.spec
        backend = MegatronBackend if settings.backend.name == "megatron" else FSDP2Backend
        # a low-precision engine: FSDP2 only (the run config refuses it with Megatron)
        quant: dict[str, Any] = {"weight_quant": settings.weight_quant, "qat": settings.qat}
        # an EAGLE-3 draft attached to the policy: FSDP2 only (the run config refuses it with Megatron)
        eagle3: dict[str, Any] = {"eagle3_draft": settings.eagle3_draft}
        self.backend = backend(
            model_dir, settings.kernel, settings.optimizer, settings.loss, settings.backend,
            offload_dir=settings.offload_dir, critic=settings.critic,
            aux_losses=[] if spec is None else [_draft_loss(spec)],
            aux_optimizer=None if spec is None else spec.optimizer, keep_reference=settings.keep_reference or None,
            memory=settings.memory, routing_replay=settings.routing_replay, lora=settings.lora,
            **(eagle3 if settings.eagle3_draft is not None else {}),
            **(quant if settings.weight_quant is not None else {}),
        )  # fmt: skip
        self.qat_format = settings.weight_quant if settings.qat else None
        self.profile = TraceRecorder()

    def fingerprint(self) -> str:
        """The kernel fingerprint on this rank's device (the on-policy guard compares it with the engine's): the
        engine's for the FSDP2 backend and for Megatron's Miles layers on an exact layout; otherwise one that says
        which kernels run (`MegatronBackend.kernel_fingerprint`). A QAT trainer's includes the format it
        fake-quantizes to, as the engine's includes the one it stores."""
        device = next(self.backend.model.parameters()).device.type
        if isinstance(self.backend, MegatronBackend):
            return self.backend.kernel_fingerprint(device)
        return kernel_fingerprint(self.kernel, device, self.qat_format)

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank's share of a batch: Megatron's TP / PP / CP peers train the same samples."""
        if isinstance(self.backend, MegatronBackend):
            return self.backend.data_parallel
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def train(
        self, samples: Sequence[Sample], advantages: list[list[float]], old_logprobs: Any, measure_mismatch: bool,
        critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        returns, old_values = (None, None) if critic is None else (critic.returns, critic.old_values)
        return self.backend.train_step(samples, advantages, old_logprobs=old_logprobs, returns=returns,
                                       old_values=old_values, measure_mismatch=measure_mismatch)  # fmt: skip

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.backend.compute_logprobs(samples)

    def compute_values(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.backend.compute_values(samples)

    def weights_checksum(self) -> str:
        return self.backend.weights.checksum()

    def weights_digests(self) -> dict[str, str]:
        return self.backend.weights.digests()

    def start_profile(self, directory: str) -> None:
        """A torch.profiler trace of this rank's thread until `stop_profile`: DIRECTORY/trainer_rank{r}.trace.json."""
        import torch.distributed as dist

        self.profile.start(Path(directory) / f"trainer_rank{dist.get_rank()}.trace.json")  # its node's directory

    def stop_profile(self) -> str:
        return str(self.profile.stop())

    def offload(self, room_for: int | None = None) -> int:
        return int(self.backend.offload(room_for=room_for))

    def memory_bytes(self) -> dict[str, int]:
        """What this rank holds now, by tag (either backend's memory manager)."""
        return self.backend.memory.manager.resident_bytes()

    def onload(self) -> int:
        return int(self.backend.onload())

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        save_checkpoint(self.backend, directory, extra)

    def load(self, directory: str) -> dict[str, Any]:
        extra: dict[str, Any] = load_checkpoint(self.backend, directory)
        return extra

    def export(self, directory: str, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        export_hf(self.backend, directory, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))
