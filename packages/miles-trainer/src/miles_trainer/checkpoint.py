"""Trainer checkpoints (step 8 of the RL data path, docs/architecture.md) and Hugging Face conversion.

A checkpoint directory holds the sharded model and optimizer (torch.distributed.checkpoint; PPO's critic and its
optimizer too, under their own keys; the Megatron backend writes megatron-core's dist_checkpointing format instead,
`MegatronBackend.write_checkpoint`), each rank's RNG
state (safetensors, never pickle), `config.json` of the model (so a checkpoint is self-describing for
`miles-trainer convert`) and `trainer_state.json` (step, scheduler, the caller's `extra`, e.g. the data position).

Atomicity: everything is written to `<dir>.tmp`; only when every rank has finished does rank 0 fsync every file and
directory of it, move the previous checkpoint aside (`<dir>.old`), rename the new one into place, fsync the parent
directory and delete the old one. A crash (or a power cut) at any point leaves a complete checkpoint: `<dir>`
itself, or `<dir>.old` during the two renames (`resolve_checkpoint` finds it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from miles_kernels import (
    DRAFT_PREFIX,
    CausalLM,
    Eagle3Draft,
    KernelConfig,
    adapted_layers,
    add_lora,
    fold_adapters,
    is_adapter_name,
    kernel_fingerprint,
    load_eagle3_state,
    load_model,
    load_state,
    quantize_model,
    read_model_config,
    save_eagle3,
    save_model,
    save_peft_adapter,
)
from miles_kernels.config import WeightQuantConfig
from miles_trainer.config import LoraTrainConfig
from miles_trainer.megatron_backend import MegatronBackend  # megatron-core itself is imported only when used

if TYPE_CHECKING:
    from miles_trainer.fsdp import FSDP2Backend

    Backend = FSDP2Backend | MegatronBackend

TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "config.json"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """The complete checkpoint at `directory` (or its `.old` twin left by a crash during the final renames)."""
    path = Path(directory)
    for candidate in (path, path.with_name(path.name + ".old")):
        if (candidate / TRAINER_STATE).is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} is not a complete miles-trainer checkpoint (no {TRAINER_STATE}); "
        f"a '{path.name}.tmp' next to it is an interrupted save and is ignored"
    )


def save_checkpoint(backend: Backend, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
    """Save model, optimizer, scheduler, step, RNG and `extra` atomically. Every rank calls it."""
    final = Path(directory)
    staging, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    rank = dist.get_rank()
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)
    dist.barrier()
    backend_state: dict[str, Any] = {}
    if isinstance(backend, MegatronBackend):  # megatron-core's dist_checkpointing
        backend_state = backend.write_checkpoint(staging)
    else:
        # An optimizer that never stepped (every update so far skipped: no advantage signal) has no state, which DCP
        # initializes with a zero step only when no parameter holds a gradient. Without this, a skipped step's
        # gradients made the save lack the state that the load (of a fresh backend, no gradients) expects.
        backend.optimizer.zero_grad(set_to_none=True)
        model_state, optim_state = _policy_state(backend)
        dcp.save(  # type: ignore[attr-defined]
            {"model": model_state, "optim": optim_state, **_critic_state(backend), **_aux_state(backend)},
            checkpoint_id=str(staging),
        )
    save_file(rng_state(), str(staging / _rng_file(rank)))
    if rank == 0:
        state = {
            "step": backend.step_count, "scheduler": backend.scheduler.state_dict(), "extra": extra or {},
            "world_size": dist.get_world_size(), "kernel": kernel_fingerprint(backend.kernel), **backend_state,
        }  # fmt: skip
        if not isinstance(backend, MegatronBackend) and backend.lora is not None:
            state["lora"] = backend.lora.adapters().model_dump()
        if not isinstance(backend, MegatronBackend) and backend.critic_config is not None:
            state["critic"] = {"kind": backend.critic_config.kind, "scheduler": backend.critic_scheduler.state_dict()}
        if not isinstance(backend, MegatronBackend) and backend.aux_params:
            state["aux"] = {
                "losses": [a.name for a in backend.aux_losses],
                "scheduler": backend.aux_scheduler.state_dict(),
            }
        (staging / MODEL_CONFIG).write_text(json.dumps(backend.model.config.to_hf(dtype="float32"), indent=2))
        (staging / TRAINER_STATE).write_text(json.dumps(state))
    dist.barrier()
    if rank == 0:
        _sync_tree(staging)  # every rank's files: the rename below must not outrun their data to the disk
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        staging.rename(final)
        _sync_directory(final.parent)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()
    return final


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (DCP syncs its own files; the rest are written plainly)."""
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _sync_directory(Path(directory))


def _critic_module(backend: FSDP2Backend) -> torch.nn.Module:
    module = backend.critic_model if backend.critic_model is not None else backend.value_head
    assert module is not None
    return module


def _critic_state(backend: FSDP2Backend) -> dict[str, Any]:
    """The critic's model and optimizer state, under their own keys of the checkpoint (none without a critic)."""
    if backend.critic_config is None:
        return {}
    backend.critic_optimizer.zero_grad(set_to_none=True)
    model_state, optim_state = get_state_dict(_critic_module(backend), backend.critic_optimizer)
    return {"critic_model": model_state, "critic_optim": optim_state}


def _aux_state(backend: FSDP2Backend) -> dict[str, Any]:
    """The auxiliary losses' optimizer state (e.g. the MTP draft's AdamW), under its own key (none without)."""
    if not backend.aux_params:
        return {}
    backend.aux_optimizer.zero_grad(set_to_none=True)
    _, optim_state = get_state_dict(backend.model, backend.aux_optimizer)
    return {"aux_optim": optim_state}


def load_checkpoint(backend: Backend, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, step and RNG from `save_checkpoint`; returns the saved `extra`."""
    path = resolve_checkpoint(directory)
    state = json.loads((path / TRAINER_STATE).read_text())
    if isinstance(backend, MegatronBackend):
        backend.read_checkpoint(path, state)
    else:
        _load_fsdp(backend, path, state)
    if "scheduler" in state:
        backend.scheduler.load_state_dict(state["scheduler"])
    backend.step_count = int(state["step"])
    rng = path / _rng_file(dist.get_rank())
    if rng.is_file() and state.get("world_size") == dist.get_world_size():
        set_rng_state(load_file(str(rng)))
    extra: dict[str, Any] = state.get("extra", {})
    return extra


def _policy_state(backend: FSDP2Backend) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's model and optimizer state as a checkpoint holds them: with LoRA, only the parameters that train
    (the adapters, and MTP layers): the frozen base is the model directory the run started from."""
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    if backend.lora is not None:  # what an optimizer trains: the adapters, and MTP layers an auxiliary loss trains
        trained = {id(p) for p in backend._trainable_params()}
        trains = {name for name, p in backend.model.named_parameters() if id(p) in trained}
        model_state = {name: value for name, value in model_state.items() if name in trains}
    return model_state, optim_state


def _load_fsdp(backend: FSDP2Backend, path: Path, state: dict[str, Any]) -> None:
    saved_lora, lora = state.get("lora"), backend.lora.adapters().model_dump() if backend.lora is not None else None
    if saved_lora != lora:
        raise ValueError(
            f"{path} was written with trainer.lora={saved_lora}, the trainer has {lora}: resume with the LoRA "
            "settings the run started with"
        )
    model_state, optim_state = _policy_state(backend)
    state_dict: dict[str, Any] = {"model": model_state}
    if state.get("has_optimizer", True):
        state_dict["optim"] = optim_state
    critic = backend.critic_config
    saved_critic = state.get("critic")
    if critic is not None:
        if saved_critic is None or saved_critic["kind"] != critic.kind:
            saved = "no critic" if saved_critic is None else f"a {saved_critic['kind']!r} critic"
            raise ValueError(
                f"{path} holds {saved}, the trainer a {critic.kind!r} one: resume with the critic settings the run "
                "started with"
            )
        state_dict |= _critic_state(backend)
    saved_aux = state.get("aux") if backend.aux_params else None  # none saved: the auxiliary AdamW starts afresh
    if saved_aux is not None:
        state_dict |= _aux_state(backend)
    dcp.load(state_dict, checkpoint_id=str(path))  # type: ignore[attr-defined]
    set_state_dict(
        backend.model, backend.optimizer, model_state_dict=state_dict["model"],
        optim_state_dict=state_dict.get("optim", {}), options=StateDictOptions(strict=backend.lora is None),
    )  # fmt: skip
    if critic is not None:
        set_state_dict(
            _critic_module(backend), backend.critic_optimizer, model_state_dict=state_dict["critic_model"],
            optim_state_dict=state_dict["critic_optim"],
        )  # fmt: skip
        assert saved_critic is not None  # checked above
        backend.critic_scheduler.load_state_dict(saved_critic["scheduler"])
    if saved_aux is not None:
        set_state_dict(backend.model, backend.aux_optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["aux_optim"],
                       options=StateDictOptions(strict=backend.lora is None))  # fmt: skip
        backend.aux_scheduler.load_state_dict(saved_aux["scheduler"])


def export_hf(backend: Backend, directory: str | os.PathLike[str], tokenizer: Any = None) -> Path | None:
    """Gather the full weights and write a Hugging Face directory in the kernel dtype (rank 0 writes; every
    rank calls it). With a low-precision engine (`rollout.engine.weight_dtype`) also `quantized/`: the weights as
    the engine served them, in the format's Hugging Face layout and `quantization_config` (a QAT run's deployable
    model). An attached EAGLE-3 draft goes to `eagle3/` in SpecForge's layout (`export_eagle3`)."""
    state = backend.full_state_dict()
    draft = {name: state.pop(name) for name in list(state) if name.startswith(DRAFT_PREFIX)}
    out = None
    if dist.get_rank() == 0:
        if draft:
            _save_eagle3(backend, draft, Path(directory) / EAGLE3_EXPORT_DIR)
        lora = backend.lora
        if lora is None:
            out = _save_hf(backend.model.config, backend.kernel, state, directory, tokenizer)
            quant = backend.weights.quant
            if quant is not None:
                _save_hf(backend.model.config, backend.kernel, state, Path(directory) / "quantized", tokenizer,
                         quant.config)  # fmt: skip
        else:
            out = export_lora(backend.model.config, backend.kernel, lora, state, directory, tokenizer,
                              base_model=str(backend.model_dir))  # fmt: skip
    dist.barrier()
    return out


EAGLE3_EXPORT_DIR = "eagle3"  # where `export_hf` writes an attached EAGLE-3 draft


def export_eagle3(backend: Backend, directory: str | os.PathLike[str]) -> Path | None:
    """Gather the attached EAGLE-3 draft and write it in SpecForge's layout (rank 0 writes; every rank calls it):
    what `--speculative-algorithm EAGLE3 --speculative-draft-model-path` serves."""
    state = backend.full_state_dict()
    draft = {name: t for name, t in state.items() if name.startswith(DRAFT_PREFIX)}
    if not draft:
        raise ValueError("the trainer's model has no EAGLE-3 draft attached: there is nothing to export")
    out = _save_eagle3(backend, draft, directory) if dist.get_rank() == 0 else None
    dist.barrier()
    return out


def _save_eagle3(backend: Backend, state: dict[str, torch.Tensor], directory: str | os.PathLike[str]) -> Path:
    attached = backend.model.eagle3
    assert isinstance(attached, Eagle3Draft)
    with torch.device("meta"):
        draft = Eagle3Draft(attached.config, backend.kernel)
    draft = draft.to_empty(device="cpu").to(backend.kernel.torch_dtype)
    load_eagle3_state(draft, {name.removeprefix(DRAFT_PREFIX): t for name, t in state.items()}, complete=True)
    return save_eagle3(draft, directory)


def export_lora(
    config: Any, kernel: KernelConfig, lora: LoraTrainConfig, state: dict[str, torch.Tensor],
    directory: str | os.PathLike[str], tokenizer: Any = None, base_model: str = "",
) -> Path:  # fmt: skip
    """A LoRA run's export: its adapters as a PEFT adapter directory (float32, what `peft` loads onto the Hugging Face
    base model) with the tokenizer, and with `lora.export_merged` the merged model in `merged/` (each adapted weight
    merged in the kernel dtype exactly as the engine served it, a full Hugging Face checkpoint)."""
    out = save_peft_adapter(directory, lora.adapters(), {n: t for n, t in state.items() if is_adapter_name(n)},
                            base_model=base_model)  # fmt: skip
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if lora.export_merged:
        with torch.device("meta"):
            model = CausalLM(config, kernel)
        model = model.to_empty(device="cpu").to(kernel.torch_dtype)
        model.tie_weights()
        add_lora(model, lora.adapters())
        load_state(model, {n: t for n, t in state.items() if not is_adapter_name(n)})
        load_state(model, {n: t for n, t in state.items() if is_adapter_name(n)})
        fold_adapters(model)
        with torch.no_grad():
            for layer in adapted_layers(model).values():
                assert layer.folded is not None
                layer.weight.copy_(layer.folded)
                layer.lora_A = layer.lora_B = layer.folded = None
        save_model(model, out / "merged", tokenizer=tokenizer)
    return out


def _save_hf(
    config: Any,
    kernel: KernelConfig,
    state: dict[str, torch.Tensor],
    directory: str | os.PathLike[str],
    tokenizer: Any,
    weights: WeightQuantConfig | None = None,
) -> Path:
    with torch.device("meta"):
        model = CausalLM(config, kernel)
    model = model.to_empty(device="cpu").to(kernel.torch_dtype)
    model.tie_weights()
    load_state(model, state)  # HF names; a missing or mismatched tensor is an error
    if weights is not None:  # quantized from the kernel dtype's values, as weight sync quantizes them
        quantize_model(model, weights)
    return save_model(model, directory, tokenizer=tokenizer)


def dcp_to_hf(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "float32", tokenizer: Any = None
) -> Path:
    """Convert a trainer checkpoint to a Hugging Face directory in one process (no process group needed)."""
    path = resolve_checkpoint(checkpoint)
    if not (path / MODEL_CONFIG).is_file():
        raise FileNotFoundError(f"{path} has no {MODEL_CONFIG}; it was written by an older miles-trainer")
    config = read_model_config(path)
    kernel = KernelConfig.model_validate({"dtype": dtype})
    with torch.device("meta"):
        model = CausalLM(config, kernel)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.tie_weights()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))  # type: ignore[attr-defined]
    model.load_state_dict(state["model"])
    tensors = {
        name: t
        for name, t in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    return _save_hf(config, kernel, tensors, out, tokenizer)


def hf_to_dcp(model_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face directory as a trainer checkpoint (step 0, no optimizer state): a run can start
    from it with `load_checkpoint` (the optimizer then starts fresh)."""
    model = load_model(model_dir, KernelConfig(), dtype=torch.float32)
    final = Path(out)
    staging = final.with_name(final.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(staging))  # type: ignore[attr-defined]
    (staging / MODEL_CONFIG).write_text(json.dumps(model.config.to_hf(dtype="float32"), indent=2))
    (staging / TRAINER_STATE).write_text(json.dumps({"step": 0, "has_optimizer": False, "extra": {}}))
    _sync_tree(staging)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _sync_directory(final.parent)
    return final
