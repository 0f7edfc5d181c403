"""What the engine says about itself: SGLang's `/model_info`, `/server_info` and `/get_load` bodies, read from a
running `Engine` (its config, model, scheduler counters, memory and served adapters)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from miles_contracts import version_string
from miles_kernels import describe_kernel
from miles_rollout import __version__

if TYPE_CHECKING:
    from miles_rollout.engine import Engine


def model_info(engine: Engine) -> dict[str, Any]:
    """SGLang's `/model_info` fields (plus the architecture's vocabulary size)."""
    hf = engine.model_config.to_hf()
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": version_string(engine.weight_version),
        "load_format": "safetensors",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "architecture": engine.model_config.architecture,
        "vocab_size": engine.model_config.vocab_size,
    }


def server_info(engine: Engine) -> dict[str, Any]:
    """SGLang's `/server_info`: the server's arguments as SGLang names them (one device: tp/dp/pp/ep size 1),
    then the engine's own settings and live counters."""
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "version": __version__,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "page_size": engine.page_size,
        "max_running_requests": engine.config.max_running_requests,
        "max_prefill_tokens": engine.config.max_prefill_tokens,
        "context_length": engine.context_length,
        "random_seed": engine.config.seed,
        "device": engine.config.device,
        "enable_deterministic_inference": engine.kernel.is_deterministic,
        "speculative_algorithm": engine.config.speculative_algorithm,
        "speculative_draft_model_path": engine.config.speculative_draft_model_path,
        "speculative_num_steps": engine.config.num_draft_steps or None,
        "speculative_eagle_topk": engine.config.speculative_eagle_topk or 1 if engine.config.num_draft_steps else None,
        "speculative_num_draft_tokens": engine.config.num_draft_tokens if engine.config.num_draft_steps else None,
        "enable_return_routed_experts": engine.config.enable_return_routed_experts,
        "weight_dtype": engine.config.weight_dtype,
        **(engine.loras.server_info() if engine.loras is not None else {"enable_lora": False}),
        "kernel_config": describe_kernel(
            engine.kernel, torch.device(engine.config.device).type, engine.config.weight_quant()
        ),
        "num_kv_pages": engine.config.num_kv_pages,
        "kv_bytes_per_token": engine.runner.store.bytes_per_token,
        "weight_version": version_string(engine.weight_version),
        "released_memory": sorted(engine.released),
        "memory_bytes": engine.memory_bytes(),
        "paused": engine.paused,
        "updating_weights": engine.updating_weights,
        **engine.scheduler.stats(),
        **(engine.scheduler.drafter.rates() if engine.scheduler.drafter is not None else {}),
        "pid": os.getpid(),
        "time": time.time(),
    }


def load(engine: Engine) -> dict[str, Any]:
    """What a router balances on (SGLang's `/get_load`): requests running and waiting, KV pages in use."""
    stats = engine.scheduler.stats()
    return {
        "dp_rank": 0,
        "num_reqs": stats["num_running"] + stats["num_prefilling"] + stats["num_retracted"],
        "num_waiting_reqs": stats["num_waiting"],
        "num_tokens": stats["num_used_pages"] * engine.page_size,
    }
