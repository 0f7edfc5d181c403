"""`miles-trainer` command line: supervised fine-tuning and checkpoint conversion.

    miles-trainer sft --model-path DIR --data FILE.jsonl --out DIR   # one process, or under torchrun for several
    miles-trainer convert --src CHECKPOINT_DIR --dst HF_DIR          # trainer checkpoint (DCP or Megatron) → HF
    miles-trainer convert --src HF_DIR --dst CHECKPOINT_DIR          # Hugging Face → trainer checkpoint (DCP)
    miles-trainer convert --src HF_DIR --dst MEGATRON_DIR --to megatron [--tp 2 --pp 2 ...] [--check]
    miles-trainer convert --src MEGATRON_DIR --dst HF_DIR [--check]  # dist_checkpointing (any layout) → HF
    miles-trainer convert --src HF_DIR --dst MEGATRON_DIR --check-only   # compare an existing pair

The flags are generated (tyro) from the config models: `sft` takes `SFTConfig` (with its `OptimizerConfig` and
`BackendConfig`) and `KernelConfig`, the models a run config nests, so every setting is defined once. A user's
mistake (bad flag or value, missing file, unsupported architecture, missing megatron extra, mismatched directories)
prints what is wrong and exits with 2; a `--check` that finds the two sides disagreeing exits with 1. The Megatron
conversion and its check are `megatron_checkpoint_io.py` and `megatron_parity_check.py` (docs/megatron.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
from pydantic import BaseModel, ConfigDict, Field

from miles_kernels.config import KernelConfig
from miles_trainer.config import SFTConfig

PROG = "miles-trainer"


class SFTCommand(BaseModel):
    """Supervised fine-tuning of a Hugging Face model on a JSONL file. Rows: {"prompt": str, "response": str} or
    {"messages": [...]} (chat template); loss only on response / assistant tokens. Writes a Hugging Face directory
    (weights, config, tokenizer) to --out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `--model DIR` (the flag before the flags were generated) stays an alias.
    model_path: Annotated[str, tyro.conf.arg(aliases=("--model",))] = Field(
        description="Hugging Face model directory (with its tokenizer)."
    )
    data: str = Field(description="JSONL file, one row per line.")
    out: str = Field(description="Output Hugging Face directory.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The SFT run.")
    kernel: KernelConfig = Field(
        default_factory=KernelConfig, description="The model's kernels (dtype: compute dtype; weights train in fp32)."
    )


class ConvertCommand(BaseModel):
    """Convert between a Hugging Face directory and a trainer checkpoint: the FSDP2 backend's (DCP) or a Megatron
    one (megatron-core dist_checkpointing: the Megatron backend's step directory, or what --to megatron writes).
    The direction follows --src: a trainer or Megatron checkpoint becomes a Hugging Face directory; a Hugging Face
    directory becomes a DCP checkpoint, or with --to megatron a Megatron one. --check then loads both sides and
    compares their tensors and logits (docs/megatron.md, "HF <-> Megatron conversion")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    src: str = Field(description="Trainer checkpoint, Megatron checkpoint or Hugging Face directory.")
    dst: str = Field(description="Output directory (with --check-only: the other side of the pair).")
    to: Literal["auto", "hf", "dcp", "megatron"] = Field(
        default="auto",
        description="Output format. auto: a checkpoint becomes hf, a Hugging Face directory dcp (the FSDP2 "
        "backend's); megatron: a Hugging Face directory becomes a megatron-core dist_checkpointing directory.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Dtype of the output weights; default: the source's (a DCP checkpoint: float32)."
    )
    tokenizer: str | None = Field(
        default=None, description="Directory whose tokenizer the output gets (default: the source's, if any)."
    )
    hf_config: str | None = Field(
        default=None, description="Directory with the config.json of a Megatron --src that holds none."
    )
    tp: Annotated[int, tyro.conf.arg(aliases=("--tensor-model-parallel-size",))] = Field(
        default=1, ge=1, description="--to megatron: tensor-parallel size of the ranks that write (any layout "
        "loads the result: dist_checkpointing reshards)."
    )  # fmt: skip
    pp: Annotated[int, tyro.conf.arg(aliases=("--pipeline-model-parallel-size",))] = Field(
        default=1, ge=1, description="--to megatron: pipeline stages of the ranks that write."
    )
    vpp: Annotated[int | None, tyro.conf.arg(aliases=("--virtual-pipeline-model-parallel-size",))] = Field(
        default=None, ge=1, description="--to megatron: model chunks per pipeline stage (virtual stages)."
    )
    ep: Annotated[int, tyro.conf.arg(aliases=("--expert-model-parallel-size",))] = Field(
        default=1, ge=1, description="--to megatron: expert-parallel size of the ranks that write."
    )
    etp: Annotated[int | None, tyro.conf.arg(aliases=("--expert-tensor-parallel-size",))] = Field(
        default=None, ge=1, description="--to megatron: expert tensor-parallel size of the ranks that write."
    )
    check: bool = Field(
        default=False,
        description="Megatron <-> HF: after converting, compare the two sides' tensors (bit for bit) and "
        "logits on a few prompts (megatron-core's GPTModel against the miles-kernels model); exit 1 if they differ.",
    )
    check_only: bool = Field(
        default=False, description="Compare an existing pair (--src and --dst: a Hugging Face directory and a "
        "Megatron checkpoint, either way round) without converting."
    )  # fmt: skip
    atol: float = Field(
        default=1e-4, gt=0, description="--check: the largest |logit difference| allowed (computed in float32)."
    )


COMMANDS: dict[str, Any] = {
    "sft": Annotated[SFTCommand, tyro.conf.OmitArgPrefixes],
    "convert": ConvertCommand,
}


def parse(argv: list[str]) -> SFTCommand | ConvertCommand:
    """The command from command-line arguments (exits with status 2 and a message on a bad one)."""
    command: SFTCommand | ConvertCommand = tyro.extras.subcommand_cli_from_dict(
        COMMANDS, args=argv, prog=PROG, description="Miles trainer: SFT and checkpoint conversion."
    )
    return command


def _sft(command: SFTCommand) -> None:
    from miles_trainer.sft import run_sft

    if not (Path(command.model_path) / "config.json").is_file():
        raise ValueError(f"--model-path {command.model_path}: no config.json there; give a Hugging Face directory")
    run_sft(command.model_path, command.data, command.out, command.sft, command.kernel)
    print(f"wrote {command.out}")


def _convert(command: ConvertCommand) -> None:
    from miles_trainer.checkpoint import TRAINER_STATE, dcp_to_hf, hf_to_dcp
    from miles_trainer.megatron_checkpoint_io import is_megatron_checkpoint

    src, dst = Path(command.src), Path(command.dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"--src and --dst are the same directory ({src}): the output needs a directory of its own")
    is_checkpoint = (src / TRAINER_STATE).is_file() or (src.with_name(src.name + ".old") / TRAINER_STATE).is_file()
    if command.check_only or is_megatron_checkpoint(src) or command.to == "megatron":
        _convert_megatron(command, src, dst)
        return
    if command.check or _layout_flags(command):
        raise ValueError(
            "--check and --tp / --pp / --vpp / --ep / --etp apply to Megatron checkpoints: give --to megatron with "
            "a Hugging Face --src, or a Megatron checkpoint as --src"
        )
    if is_checkpoint:
        if command.to not in ("auto", "hf"):
            raise ValueError(f"--src {src} is a trainer checkpoint: it converts to hf, not --to {command.to}")
        tokenizer = None
        if command.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(command.tokenizer)
        dcp_to_hf(src, dst, dtype=command.dtype or "float32", tokenizer=tokenizer)
    elif (src / "config.json").is_file():
        if command.to == "hf":
            raise ValueError(f"--src {src} is a Hugging Face directory already: give --to dcp or --to megatron")
        hf_to_dcp(src, dst)
    else:
        raise ValueError(
            f"--src {src}: neither a trainer checkpoint ({TRAINER_STATE}), a Megatron checkpoint (dist_checkpointing "
            "metadata.json) nor a Hugging Face directory (config.json)"
        )
    print(f"wrote {dst}")


def _layout_flags(command: ConvertCommand) -> dict[str, int]:
    """The writer layout flags given (not at their defaults)."""
    given = {"tp": command.tp, "pp": command.pp, "vpp": command.vpp or 1, "ep": command.ep, "etp": command.etp or 1}
    return {name: value for name, value in given.items() if value != 1}


def _convert_megatron(command: ConvertCommand, src: Path, dst: Path) -> None:
    """HF -> Megatron (--to megatron), Megatron -> HF, or --check-only on a pair; then --check."""
    from miles_trainer import megatron_checkpoint_io as io
    from miles_trainer.config import MegatronConfig
    from miles_trainer.megatron_parity_check import check_pair

    dtype = io.DTYPES[command.dtype] if command.dtype else None
    tokenizer = Path(command.tokenizer) if command.tokenizer else None
    if command.check_only:
        if io.is_megatron_checkpoint(src) == io.is_megatron_checkpoint(dst):
            kind = "Megatron checkpoints" if io.is_megatron_checkpoint(src) else "not Megatron checkpoints"
            raise ValueError(f"mismatched directories: --src {src} and --dst {dst} are both {kind}; --check-only "
                             "compares a Hugging Face directory with a Megatron checkpoint")  # fmt: skip
        hf_dir, megatron_dir = (dst, src) if io.is_megatron_checkpoint(src) else (src, dst)
        check_pair(hf_dir, megatron_dir, command.atol, command.hf_config, tokenizer)
        return
    if io.is_megatron_checkpoint(src):
        if command.to not in ("auto", "hf"):
            raise ValueError(f"--src {src} is a Megatron checkpoint: it converts to hf, not --to {command.to}")
        if _layout_flags(command):
            raise ValueError("--tp / --pp / --vpp / --ep / --etp set the layout --to megatron writes from; reading "
                             "a Megatron checkpoint needs none (dist_checkpointing reshards it)")  # fmt: skip
        io.megatron_checkpoint_to_hf(src, dst, dtype, tokenizer, command.hf_config)
        hf_dir, megatron_dir = dst, src
    else:
        layout = MegatronConfig(tp=command.tp, pp=command.pp, vpp=command.vpp, ep=command.ep, etp=command.etp)
        io.write_megatron_checkpoint(src, dst, layout, dtype, tokenizer)
        hf_dir, megatron_dir = src, dst
    print(f"wrote {dst}")
    if command.check:
        check_pair(hf_dir, megatron_dir, command.atol, command.hf_config, tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        command = parse(args)
    except SystemExit as exit_:  # tyro printed the problem, or the help
        return int(exit_.code or 0) if args else 2
    name = "sft" if isinstance(command, SFTCommand) else "convert"
    from miles_trainer.megatron_parity_check import CheckFailed

    try:
        _sft(command) if isinstance(command, SFTCommand) else _convert(command)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG} {name}: {error}", file=sys.stderr)
        return 2
    except CheckFailed as error:
        print(f"{PROG} {name} --check failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
