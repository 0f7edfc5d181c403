"""Hugging Face directories <-> megatron-core `dist_checkpointing` directories, for `miles-trainer convert`
(docs/megatron.md, "HF <-> Megatron conversion").

`dist_checkpointing` stores every tensor of a GPTModel as a global tensor under megatron-core's key for it (layers
by their global number, experts by their global index) with the offsets of each rank's shard, so a checkpoint that
one TP / PP / VPP / EP / ETP layout wrote loads into any other. Two kinds of directory are read:

- the Megatron backend's trainer checkpoint (a step directory with trainer_state.json, "backend": "megatron"; the
  model chunks under "model", "model1", ..., the MTP modules under "mtp", AdamW's states beside them), written by
  any layout;
- what `write_megatron_checkpoint` writes: the model under "model" (as Megatron-LM and
  `megatron_state.model_sharded_state` lay it out), the MTP modules under "mtp" (as the backend's checkpoints:
  `MegatronMTP.sharded_state`), the HF config.json, `megatron_convert.json` (the source, the dtype, the layout it was
  written from, the MTP layers' copies of trunk tensors the source held) and the source's tokenizer files.

A model's MTP modules (`num_nextn_predict_layers`) are megatron-core's `MultiTokenPredictionBlock` beside the last
stage's GPTModel (megatron_mtp.py's `build_mtp_block`), keyed `mtp.layers.{i}.*` as in a GPTModel built with the
block. Writing runs the layout's ranks as gloo processes on this machine (a one-rank layout runs in this process):
each builds its GPTModel chunks (`build_gpt_model`; the last stage the MTP block too), fills them from the HF tensors
(`hf_to_megatron`), and `dist_checkpointing.save` writes their shards. Reading builds a one-rank GPTModel (TP = PP =
EP = 1) and MTP block in the saved dtype as the template, lets `dist_checkpointing.load` reshard the saved tensors
into it, and splits each into its HF tensors (`megatron_to_hf`). Both directions copy bits: HF -> Megatron -> HF
returns the same tensors. The MTP layers' HF copies of the trunk's embedding and LM head (`CausalLM.mtp_copy_names`)
have no Megatron tensor: they are written back from the trunk's where the source held them (the record says), and
for a checkpoint without a record (the backend's) as `export_hf` writes them, all of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_kernels import CausalLM, KernelConfig, ModelConfig, load_state, save_model, tensor_files
from miles_trainer.checkpoint import MODEL_CONFIG, TRAINER_STATE, resolve_checkpoint
from miles_trainer.config import MegatronConfig
from miles_trainer.megatron_convert import (
    MTP_PREFIX,
    RankLayout,
    check_convertible,
    hf_to_megatron,
    megatron_to_hf,
    rank_entries,
)
from miles_trainer.megatron_cpu import device_mode

CONVERT_RECORD = "megatron_convert.json"
HF_MTP_COPIES = "hf_mtp_copies"  # the record's list of the MTP layers' copies of trunk tensors the HF source held
MTP_KEY = "mtp"  # the MTP modules' sharded tensors, as the backend's checkpoints hold them (MegatronMTP.sharded_state)
DIST_METADATA = "metadata.json"  # dist_checkpointing's own: {"sharded_backend": "torch_dist", ...}
EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_KEYS = (EMBEDDING, "output_layer.weight")  # rows padded to a multiple of the writer's TP size
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json",
)  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_megatron() -> None:
    """`megatron_model.require_megatron`, as the ValueError the CLI prints (exit 2)."""
    from miles_trainer.megatron_model import require_megatron as require

    try:
        require()
    except ImportError as error:
        raise ValueError(f"Megatron checkpoints need megatron-core: {str(error).split(': ', 1)[-1]}") from error


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- what a directory holds --------------------------------------------------------------------------------------


def trainer_checkpoint(path: Path) -> Path | None:
    """The trainer checkpoint at `path` (or its `.old` twin, left by a crash mid-rename); None if neither is one."""
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError:
        return None


def is_megatron_checkpoint(path: Path) -> bool:
    """Whether `path` is a Megatron backend trainer checkpoint or a plain `dist_checkpointing` directory."""
    checkpoint = trainer_checkpoint(path)
    if checkpoint is not None:
        return bool(json.loads((checkpoint / TRAINER_STATE).read_text()).get("backend") == "megatron")
    metadata = path / DIST_METADATA
    return metadata.is_file() and "sharded_backend" in metadata.read_text()


def checkpoint_dir(path: Path) -> Path:
    """The directory that holds the Megatron checkpoint's tensors."""
    return trainer_checkpoint(path) or path


def megatron_model_config(path: Path, hf_config: str | None = None) -> ModelConfig:
    """The HF architecture of the Megatron checkpoint at `path`: its config.json, or `hf_config`'s (a directory
    with one) for a checkpoint that holds none. ValueError naming what is missing or unsupported."""
    source = Path(hf_config) if hf_config else checkpoint_dir(path)
    if not (source / MODEL_CONFIG).is_file():
        hint = "" if hf_config else "; give --hf-config DIR (a directory with the model's config.json)"
        raise ValueError(f"{source}: no {MODEL_CONFIG}, so the architecture is unknown{hint}")
    return convertible(ModelConfig.from_hf(json.loads((source / MODEL_CONFIG).read_text())))


def hf_model_config(path: Path) -> ModelConfig:
    """The architecture of the HF directory `path`, checked convertible (ValueError naming what is not)."""
    from miles_kernels import read_model_config

    if not (path / MODEL_CONFIG).is_file():
        raise ValueError(f"{path}: no {MODEL_CONFIG}; give a Hugging Face directory (config.json + safetensors)")
    return convertible(read_model_config(path))


def convertible(config: ModelConfig) -> ModelConfig:
    """`config`, if this command converts it (ValueError naming what it does not)."""
    check_convertible(config, RankLayout())
    return config


def mtp_copy_names(config: ModelConfig) -> dict[str, str]:
    """Each MTP layer's HF copy of a trunk tensor -> the trunk tensor's name (`CausalLM.mtp_copy_names`)."""
    if not config.num_nextn_predict_layers:
        return {}
    with torch.device("meta"):
        return CausalLM(config).mtp_copy_names()


def _weight_map(path: Path) -> dict[str, Path]:
    """Each tensor of the HF directory `path` -> the safetensors file that holds it (`miles_kernels.tensor_files`),
    a ValueError the CLI prints when there is none."""
    try:
        return tensor_files(path)
    except FileNotFoundError as error:
        raise ValueError(
            f"{path}: no model.safetensors or model.safetensors.index.json; give a Hugging Face directory (a DCP "
            "trainer checkpoint becomes one first: miles-trainer convert --src CHECKPOINT --dst HF_DIR)"
        ) from error


def _hf_files(path: Path, names: set[str]) -> dict[Path, list[str]]:
    """The safetensors files of the HF directory `path` that hold `names`, each with its names among them."""
    weight_map = _weight_map(path)
    missing = sorted(names - weight_map.keys())
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}")
    files: dict[Path, list[str]] = {}
    for name in sorted(names):
        files.setdefault(weight_map[name], []).append(name)
    return files


def read_hf_tensors(path: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the HF directory `path` (only those are read)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file, group in _hf_files(path, names).items():
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in group}
    return out


def hf_dtype(path: Path) -> torch.dtype:
    """The dtype of the HF directory's weights (its embedding's, as stored)."""
    from safetensors import safe_open

    ((file, _),) = _hf_files(path, {"model.embed_tokens.weight"}).items()
    with safe_open(str(file), framework="pt") as f:
        stored = f.get_slice("model.embed_tokens.weight").get_dtype()
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[stored]


def copy_tokenizer(source: Path, out: Path) -> None:
    """Copy the tokenizer files of `source` (those it has) into `out`."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


# -- process groups ----------------------------------------------------------------------------------------------


def cpu_context() -> contextlib.AbstractContextManager[None]:
    """The Megatron backend's device mode where there is no CUDA (megatron-core's CUDA lookups stubbed), else
    nothing."""
    return device_mode("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """Megatron-core's parallel state for one rank (TP = PP = EP = 1) over a one-process gloo group (made here
    unless this process has one of one rank already)."""
    from megatron.core import parallel_state

    from miles_trainer.megatron_model import init_parallel

    created = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if created:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise RuntimeError("the conversion runs in a process of its own: this one is a rank of a larger group")
        try:
            init_parallel(MegatronConfig(moe_token_dispatcher="allgather"))
            with cpu_context():
                yield
        finally:
            parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def world_size(layout: MegatronConfig) -> int:
    """The fewest ranks that hold `layout`: PP stages of lcm(TP, EP * ETP) ranks (DP replicas write nothing new)."""
    return layout.pp * math.lcm(layout.tp, layout.ep * (layout.etp or 1))


def check_layout(config: ModelConfig, layout: MegatronConfig) -> None:
    """ValueError naming what megatron-core (or the conversion) cannot build for `config` in `layout`, before any
    rank starts."""
    from miles_trainer.megatron_model import transformer_config

    if layout.cp > 1:
        raise ValueError("context parallelism splits activations, not weights: write with cp=1")
    # check_convertible at these sizes, pp * vpp dividing the layers, MoE with tp > 1, sequence parallelism
    transformer_config(config, layout)


# -- HF -> Megatron ----------------------------------------------------------------------------------------------


def write_megatron_checkpoint(
    hf_dir: Path, out: Path, layout: MegatronConfig, dtype: torch.dtype | None = None, tokenizer: Path | None = None
) -> Path:
    """Write the HF directory `hf_dir` as a `dist_checkpointing` directory `out` (staged in `<out>.tmp`, renamed
    when complete), from the ranks of `layout`, the weights in `dtype` (default: the source's)."""
    require_megatron()
    config = hf_model_config(hf_dir)
    check_layout(config, layout)
    dtype = dtype or hf_dtype(hf_dir)
    staging = out.with_name(out.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    job = {"hf_dir": str(hf_dir), "out": str(staging), "layout": layout.model_dump(), "dtype": dtype_name(dtype)}
    world = world_size(layout)
    if world == 1:
        with one_rank():
            _write_shards(job)
    else:
        _spawn_ranks(job, world)
    source = json.loads((hf_dir / MODEL_CONFIG).read_text())
    if config.num_nextn_predict_layers != source.get("num_nextn_predict_layers", 0):  # MTP declared, not stored
        source["num_nextn_predict_layers"] = config.num_nextn_predict_layers
    (staging / MODEL_CONFIG).write_text(json.dumps(source, indent=2, sort_keys=True))
    record = {
        "format": "megatron-core dist_checkpointing, the model under 'model', its MTP modules (if any) under 'mtp'",
        "source": str(hf_dir.resolve()), "dtype": dtype_name(dtype), "written_by_layout": layout.model_dump(),
        "num_ranks": world, "megatron_core": _megatron_version(),
        "note": "dist_checkpointing reshards on load: any tp / pp / vpp / ep / etp layout reads this checkpoint",
    }  # fmt: skip
    if config.num_nextn_predict_layers:  # the copies the source held are what Megatron -> HF writes back
        record[HF_MTP_COPIES] = sorted(mtp_copy_names(config).keys() & _weight_map(hf_dir).keys())
    (staging / CONVERT_RECORD).write_text(json.dumps(record, indent=2))
    copy_tokenizer(tokenizer or hf_dir, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def _spawn_ranks(job: dict[str, Any], world: int) -> None:
    """Run `_rank_main` in `world` spawned processes over a gloo group (its rendezvous a file store)."""
    from torch.multiprocessing.spawn import ProcessException, start_processes

    with tempfile.TemporaryDirectory() as tmp:
        try:
            start_processes(_rank_main, args=(world, f"{tmp}/store", job), nprocs=world,
                            start_method="spawn")  # type: ignore[no-untyped-call]  # fmt: skip
        except ProcessException as error:
            raise RuntimeError(f"a conversion rank failed:\n{error}") from error


def _rank_main(rank: int, world: int, store: str, job: dict[str, Any]) -> None:
    """One rank of a multi-rank write (a spawned process; it returns normally, so that multiprocessing's exit
    handler reaps megatron-core's checkpoint writer processes)."""
    from megatron.core import parallel_state

    from miles_trainer.megatron_model import init_parallel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        init_parallel(MegatronConfig(**job["layout"]))
        with cpu_context():
            _write_shards(job)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _write_shards(job: dict[str, Any]) -> None:
    """This rank's model chunks, filled from the HF tensors, saved with `dist_checkpointing` (every rank calls it;
    megatron-core's process groups made for `job["layout"]`)."""
    from megatron.core import dist_checkpointing

    from miles_trainer.megatron_model import MegatronCausalLM, build_gpt_model, rank_layout, virtual_stages
    from miles_trainer.megatron_state import model_sharded_state

    hf_dir, layout = Path(job["hf_dir"]), MegatronConfig(**job["layout"])
    config, dtype = hf_model_config(hf_dir), DTYPES[job["dtype"]]
    stages = virtual_stages(layout)
    chunks, mtp = [], {}
    for vp_stage in range(stages) if stages else [None]:
        gpt = build_gpt_model(config, layout, dtype, vp_stage)
        rank = rank_layout(config, layout, vp_stage)
        hf = read_hf_tensors(hf_dir, {name for entry in rank_entries(config, rank) for name in entry.hf_names})
        tensors = hf_to_megatron(hf.__getitem__, config, rank)
        trunk = {name: tensor for name, tensor in tensors.items() if not name.startswith(MTP_PREFIX)}
        missing_meg, unexpected = gpt.load_state_dict(trunk, strict=False)
        missing_meg = [name for name in missing_meg if not name.endswith("_extra_state")]
        assert not missing_meg and not unexpected, (missing_meg[:5], unexpected[:5])  # rank_entries names them all
        chunks.append(MegatronCausalLM(gpt, config, KernelConfig.model_validate({"dtype": job["dtype"]})))
        if len(trunk) < len(tensors):  # the last stage's MTP modules, as MegatronMTP builds and saves them
            block = mtp_block(config, layout, dtype, vp_stage, tensors)
            mtp = {MTP_KEY: block.sharded_state_dict(prefix=MTP_PREFIX)}
    dist.barrier()
    dist_checkpointing.save(model_sharded_state(chunks) | mtp, job["out"])


def mtp_block(
    config: ModelConfig, layout: MegatronConfig, dtype: torch.dtype, vp_stage: int | None, tensors: dict[str, Any]
) -> Any:
    """megatron-core's MTP block of the last stage (`build_mtp_block`, its model chunk `vp_stage`) holding the
    `mtp.` tensors of `tensors` (one rank's Megatron tensors, `hf_to_megatron`'s or a loaded checkpoint's)."""
    from miles_trainer.megatron_mtp import build_mtp_block

    block = build_mtp_block(config, layout, dtype, vp_stage)
    state = {name.removeprefix(MTP_PREFIX): t for name, t in tensors.items() if name.startswith(MTP_PREFIX)}
    missing, unexpected = block.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])  # mtp_entries names them all
    return block


# -- Megatron -> HF ----------------------------------------------------------------------------------------------


def load_megatron_model(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The Megatron checkpoint at `path` resharded into one rank's GPTModel (TP = PP = EP = 1) and MTP block: its
    tensors under their names (the block's `mtp.`-prefixed), in the saved dtype, vocabulary rows as saved (padded to
    the writer's TP). Inside `one_rank()`."""
    from megatron.core import dist_checkpointing

    from miles_trainer.megatron_model import build_gpt_model
    from miles_trainer.megatron_mtp import build_mtp_block

    directory = str(checkpoint_dir(path))
    saved = dist_checkpointing.load_tensors_metadata(directory)
    if EMBEDDING not in saved:
        raise ValueError(f"{path}: no {EMBEDDING} in this dist_checkpointing directory; is it a GPT model?")
    layout, dtype = MegatronConfig(moe_token_dispatcher="allgather"), saved[EMBEDDING].dtype
    models = {"model": build_gpt_model(config, layout, dtype).sharded_state_dict()}
    if config.num_nextn_predict_layers:
        models[MTP_KEY] = build_mtp_block(config, layout, dtype, None).sharded_state_dict(prefix=MTP_PREFIX)
    templates = {part: {n: v for n, v in m.items() if not n.endswith("_extra_state")} for part, m in models.items()}
    for part, template in templates.items():
        absent = sorted(key for key in (getattr(v, "key", n) for n, v in template.items()) if key not in saved)
        if absent:
            what = f"{config.num_nextn_predict_layers} MTP module(s) of the" if part == MTP_KEY else "the"
            shown = ", ".join(absent[:3]) + (" ..." if len(absent) > 3 else "")
            raise ValueError(
                f"{path} does not hold {what} {config.architecture} model its config.json describes: no {shown} "
                "(keys of megatron-core's local layer spec)"
            )
    template = templates["model"]
    for name in VOCAB_KEYS:  # a writer with TP > 1 padded the vocabulary: load its rows as they are
        if name in template and saved[name].global_shape != template[name].global_shape:
            template[name] = _resized(template[name], saved[name].global_shape)
    loaded = dist_checkpointing.load(templates, directory)
    return {name: tensor.detach().cpu() for part in templates for name, tensor in loaded[part].items()}


def _resized(sharded: Any, shape: tuple[int, ...]) -> Any:
    """A one-rank ShardedTensor like `sharded` for a global tensor of `shape`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.empty(shape, dtype=sharded.data.dtype)
    return ShardedTensor.from_rank_offsets(sharded.key, data, replica_id=sharded.replica_id)


def megatron_hf_tensors(megatron: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF tensors of one rank's GPTModel tensors (`load_megatron_model`), each once."""
    out: dict[str, torch.Tensor] = {}
    for entry in rank_entries(config, RankLayout()):
        out |= megatron_to_hf(entry, megatron[entry.name], config, 1)
    return out


def write_hf(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    out: Path,
    dtype: torch.dtype,
    source: Path | None,
    mtp_copies: list[str] | None = None,
) -> Path:
    """An HF directory of `tensors` in `dtype` (GLM-4.5's router bias stays float32), its config.json the one of
    `source` (a Megatron directory's copy of the original) with the dtype set to `dtype`; of the MTP layers' copies
    of trunk tensors, `mtp_copies` (default: all of them, as `export_hf` writes)."""
    with torch.device("meta"):
        model = CausalLM(config, KernelConfig.model_validate({"dtype": dtype_name(dtype)}))
    model = model.to_empty(device="cpu").to(dtype)
    model.tie_weights()
    load_state(model, tensors)
    save_model(model, out)
    if mtp_copies is not None and model.mtp_copy_names().keys() - set(mtp_copies):
        _drop_tensors(out, model.mtp_copy_names().keys() - set(mtp_copies))
    if source is not None and (source / MODEL_CONFIG).is_file():
        written = json.loads((out / MODEL_CONFIG).read_text())
        original = json.loads((source / MODEL_CONFIG).read_text())
        kept = {key: value for key, value in original.items() if key not in ("dtype", "torch_dtype")}
        merged = written | kept | ({"torch_dtype": dtype_name(dtype)} if "torch_dtype" in original else {})
        (out / MODEL_CONFIG).write_text(json.dumps(merged, indent=2, sort_keys=True))
    return out


def _drop_tensors(directory: Path, names: set[str]) -> None:
    """Rewrite the safetensors files of the HF directory that hold `names` without them (and its index)."""
    from safetensors.torch import load_file, save_file

    dropped = 0
    for file, group in _hf_files(directory, names).items():
        kept = load_file(file)
        dropped += sum(kept[name].numel() * kept[name].element_size() for name in group)
        staged = file.with_name(file.name + ".tmp")  # beside the file, whose tensors `kept` may map
        save_file({name: t for name, t in kept.items() if name not in group}, str(staged), metadata={"format": "pt"})
        staged.replace(file)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        content = json.loads(index.read_text())
        content["weight_map"] = {name: f for name, f in content["weight_map"].items() if name not in names}
        content["metadata"]["total_size"] -= dropped
        index.write_text(json.dumps(content, indent=2))


def megatron_checkpoint_to_hf(
    src: Path, out: Path, dtype: torch.dtype | None = None, tokenizer: Path | None = None, hf_config: str | None = None
) -> Path:
    """Write the Megatron checkpoint `src` (trainer checkpoint or `write_megatron_checkpoint`'s directory, any
    layout) as an HF directory `out`, in `dtype` (default: the saved model's), with the tokenizer of `tokenizer`
    (default: the one `src` holds, if any)."""
    require_megatron()
    config = megatron_model_config(src, hf_config)
    with one_rank():
        megatron = load_megatron_model(src, config)
    dtype = dtype or megatron[EMBEDDING].dtype
    record = checkpoint_dir(src) / CONVERT_RECORD
    copies = json.loads(record.read_text()).get(HF_MTP_COPIES) if record.is_file() else None
    source = Path(hf_config or checkpoint_dir(src))
    write_hf(megatron_hf_tensors(megatron, config), config, out, dtype, source, copies)
    copy_tokenizer(tokenizer or checkpoint_dir(src), out)
    return out
