"""A step's throughput and MFU: tokens per second, model TFLOP/s per device and model FLOPs utilization of the rollout
and the training phase, from their token lengths and seconds. Pure arithmetic over miles_memory's FLOPs model
(miles_memory/flops.py: model FLOPs, a training pass = 3 x forward, recompute not counted), made once per run from
the model directory's config.json; the loop adds the entries to each step's metrics.

Only the policy is counted: a critic, a reference model or a teacher adds FLOPs of its own (the loop may pass a
reference model's forward as one of `num_forwards`, since it is the same model shape).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_memory import HardwareProfile, ModelFlops, ModelShape, load_hardware, mfu, model_flops

__all__ = ["ThroughputMeter"]


@dataclass(frozen=True)
class ThroughputMeter:
    """The FLOPs model of the run's policy and the devices each phase runs on; `hardware` None: MFU not reported."""

    flops: ModelFlops
    num_devices: int
    num_rollout_devices: int
    hardware: HardwareProfile | None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        hardware: str | None,
        num_devices: int,
        *,
        num_rollout_devices: int | None = None,
        include_mtp: bool = False,
    ) -> ThroughputMeter:
        """From a local Hugging Face directory; `hardware` a profile name (memory.plan.hardware, or the device the run
        uses: memory_check.run_hardware) or None; `num_devices` the training devices, `num_rollout_devices` the
        rollout's (default: the same, as colocated runs share them); `include_mtp` counts the MTP modules (an MTP
        draft that trains and drafts). ValueError for a directory without config.json or an unknown profile."""
        config = Path(model_dir) / "config.json"
        if not config.is_file():
            raise ValueError(f"no config.json in {model_dir}: throughput needs the model's local directory")
        if num_devices < 1 or (num_rollout_devices is not None and num_rollout_devices < 1):
            raise ValueError(f"device counts must be >= 1, got {num_devices} and {num_rollout_devices}")
        shape = ModelShape.from_hf(json.loads(config.read_text()))
        return cls(
            flops=model_flops(shape, include_mtp=include_mtp),
            num_devices=num_devices,
            num_rollout_devices=num_rollout_devices or num_devices,
            hardware=None if hardware is None else load_hardware(hardware),
        )

    def rollout(
        self, prompt_lengths: Sequence[int], response_lengths: Sequence[int], seconds: float
    ) -> dict[str, float]:
        """Generation of these samples in `seconds`: generated tokens per second, and the model FLOPs of each prompt's
        prefill and each generated token (`ModelFlops.generate`); {} without a positive duration."""
        if seconds <= 0:
            return {}
        flops = self.flops.generate(prompt_lengths, response_lengths)
        return {"rollout_tokens_per_s": sum(response_lengths) / seconds} | self._rates(
            "rollout", flops, seconds, self.num_rollout_devices
        )

    def train(
        self, sequence_lengths: Sequence[int], seconds: float, *, num_passes: int = 1, num_forwards: int = 0
    ) -> dict[str, float]:
        """Training on packed sequences of these lengths (prompt + response) in `seconds`: `num_passes` forward and
        backward passes over all of them (the loop's `trainer.steps_per_rollout` optimizer steps split one pass) and
        `num_forwards` forward-only passes (π_old's log-probs where the trainer recomputed them). Trained tokens per
        second counts each pass's tokens; {} without a positive duration."""
        if seconds <= 0:
            return {}
        flops = num_passes * self.flops.train(sequence_lengths) + num_forwards * self.flops.forward(sequence_lengths)
        return {"train_tokens_per_s": num_passes * sum(sequence_lengths) / seconds} | self._rates(
            "train", flops, seconds, self.num_devices
        )

    def _rates(self, phase: str, flops: int, seconds: float, num_devices: int) -> dict[str, float]:
        """Model TFLOP/s per device (Megatron's 'TFLOP/s/GPU'), and the MFU where the peak is known."""
        out = {f"{phase}_tflops_per_s": flops / seconds / num_devices / 1e12}
        utilization = None if self.hardware is None else mfu(flops, seconds, num_devices, self.hardware)
        if utilization is not None:
            out[f"{phase}_mfu"] = utilization
        return out
