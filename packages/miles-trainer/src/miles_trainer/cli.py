"""`miles-trainer` command line: supervised fine-tuning and checkpoint conversion.

    miles-trainer sft --model-path DIR --data FILE.jsonl --out DIR   # one process, or under torchrun for several
    miles-trainer convert --src CHECKPOINT_DIR --dst HF_DIR          # trainer checkpoint (DCP) → Hugging Face
    miles-trainer convert --src HF_DIR --dst CHECKPOINT_DIR          # Hugging Face → trainer checkpoint

The flags are generated (tyro) from the config models: `sft` takes `SFTConfig` (with its `OptimizerConfig` and
`BackendConfig`) and `KernelConfig`, the models a run config nests, so every setting is defined once. A user's
mistake (bad flag or value, missing file, bad row) prints what is wrong and exits with 2.
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
    """Convert between a trainer checkpoint (DCP) and a Hugging Face directory. The direction follows --src: a
    trainer checkpoint (has trainer_state.json) becomes a Hugging Face directory; a Hugging Face directory
    (config.json + safetensors) becomes a trainer checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    src: str = Field(description="Trainer checkpoint or Hugging Face directory.")
    dst: str = Field(description="Output directory.")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Dtype of Hugging Face weights.")
    tokenizer: str | None = Field(default=None, description="Directory whose tokenizer the Hugging Face output gets.")


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

    src = Path(command.src)
    if (src / TRAINER_STATE).is_file() or (src.with_name(src.name + ".old") / TRAINER_STATE).is_file():
        tokenizer = None
        if command.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(command.tokenizer)
        dcp_to_hf(src, command.dst, dtype=command.dtype, tokenizer=tokenizer)
    elif (src / "config.json").is_file():
        hf_to_dcp(src, command.dst)
    else:
        raise ValueError(
            f"--src {src}: neither a trainer checkpoint ({TRAINER_STATE}) nor a Hugging Face directory (config.json)"
        )
    print(f"wrote {command.dst}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        command = parse(args)
    except SystemExit as exit_:  # tyro printed the problem, or the help
        return int(exit_.code or 0) if args else 2
    name = "sft" if isinstance(command, SFTCommand) else "convert"
    try:
        _sft(command) if isinstance(command, SFTCommand) else _convert(command)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG} {name}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
