"""`miles-spec` command line.

Miles spec: train a speculative-decoding draft.

    miles-spec train --model DIR --data rows.jsonl --out DIR [--num-mtp-layers 1] [--epochs N] [--lr LR]
    miles-spec train --model DIR --data rows.jsonl --out DIR --draft eagle3 [--draft-vocab-size N] [--ttt-length 7]

trains (or refreshes) the MTP modules of a Hugging Face checkpoint, or an EAGLE-3 draft for it (SpecForge's
layout), on a JSONL of rows, the policy's own weights frozen (`miles_spec.train.train_draft`). The flags are generated
(tyro) from `TrainCommand` and the `DraftTrainConfig` it nests, as the other Miles CLIs are from their config models.
Bad input (a bad flag or value, no such model, a model of another family, a malformed row, a full --out) is an error
that says what is wrong, with exit status 2; nothing is written then.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import tyro
from pydantic import BaseModel, ConfigDict, Field

from miles_spec.config import DraftTrainConfig

PROG = "miles-spec"


class TrainCommand(BaseModel):
    """Train a draft for a Hugging Face checkpoint on JSONL rows: token ids (prompt_tokens / response_tokens, or
    slime's tokens / response_length; optional loss_mask) or text (prompt / response, messages). --draft mtp (the
    default): its MTP modules, the trunk written back unchanged; --draft eagle3: an EAGLE-3 draft, written alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face checkpoint directory (a family miles-kernels runs).")
    data: str = Field(description="JSONL file, one row per line.")
    out: str = Field(description="Where to write the checkpoint with the trained MTP draft, or the EAGLE-3 draft (a "
                     "new or empty directory).")  # fmt: skip
    train: DraftTrainConfig = Field(default_factory=DraftTrainConfig, description="The draft's training.")


COMMANDS: dict[str, Any] = {"train": Annotated[TrainCommand, tyro.conf.OmitArgPrefixes]}


def parse(argv: list[str]) -> TrainCommand:
    """The command from command-line arguments (exits with status 2 and a message on a bad one)."""
    command: TrainCommand = tyro.extras.subcommand_cli_from_dict(
        COMMANDS, args=argv, prog=PROG, description="Miles spec: train a speculative-decoding draft (MTP or EAGLE-3)."
    )
    return command


def _train(command: TrainCommand) -> int:
    from miles_spec.train import train_draft
    from miles_trainer import SFTDataError

    out = Path(command.out)
    if out.exists() and any(out.iterdir()):
        print(f"{PROG} train: error: --out {out} is not empty; choose a new directory", file=sys.stderr)
        return 2
    try:
        history = train_draft(command.model, command.data, out, command.train,
                              log=lambda message: print(message, flush=True))  # fmt: skip
    except (SFTDataError, ValueError, FileNotFoundError) as error:
        print(f"{PROG} train: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(history[-1]))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        command = parse(args)
    except SystemExit as exit_:  # tyro printed the problem, or the help
        return int(exit_.code or 0) if args else 2
    return _train(command)


if __name__ == "__main__":
    sys.exit(main())
