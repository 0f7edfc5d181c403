"""`miles-trainer` command line: supervised fine-tuning and checkpoint conversion.

    miles-trainer sft --model DIR --data FILE.jsonl --out DIR     # one process, or under torchrun for several
    miles-trainer convert --src CHECKPOINT_DIR --dst HF_DIR      # trainer checkpoint (DCP) → Hugging Face
    miles-trainer convert --src HF_DIR --dst CHECKPOINT_DIR      # Hugging Face → trainer checkpoint

A user's mistake (missing file, bad row, bad value) prints one line saying what is wrong and exits with 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles_trainer.sft import SFTConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-trainer", description="Miles trainer: SFT and checkpoint conversion.")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    defaults = SFTConfig()
    sft = subcommands.add_parser(
        "sft", help="Supervised fine-tuning of a Hugging Face model on a JSONL file",
        description='Rows: {"prompt": str, "response": str} or {"messages": [...]} (chat template). Loss only on '
        "response / assistant tokens. Writes a Hugging Face directory (weights, config, tokenizer) to --out.",
    )  # fmt: skip
    sft.add_argument("--model", required=True, help="Hugging Face model directory (with its tokenizer)")
    sft.add_argument("--data", required=True, help="JSONL file, one row per line")
    sft.add_argument("--out", required=True, help="output Hugging Face directory")
    sft.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the data (default: %(default)s)")
    sft.add_argument("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate (default: %(default)s)")
    sft.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="rows per step (default: %(default)s)"
    )
    sft.add_argument("--max-tokens-per-micro-batch", type=int, default=defaults.max_tokens_per_micro_batch,
                     help="token budget of one packed forward pass (default: %(default)s)")  # fmt: skip
    sft.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="(default: %(default)s)")
    sft.add_argument("--seed", type=int, default=defaults.seed, help="shuffle seed (default: %(default)s)")
    sft.add_argument("--chat-template", action="store_true",
                     help="chat-template prompt/response rows (messages rows always are)")  # fmt: skip
    sft.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="compute dtype; weights train in float32 (default: %(default)s)")  # fmt: skip
    convert = subcommands.add_parser(
        "convert", help="Convert between a trainer checkpoint (DCP) and a Hugging Face directory",
        description="The direction follows --src: a trainer checkpoint (has trainer_state.json) becomes a Hugging "
        "Face directory; a Hugging Face directory (config.json + safetensors) becomes a trainer checkpoint.",
    )  # fmt: skip
    convert.add_argument("--src", required=True, help="trainer checkpoint or Hugging Face directory")
    convert.add_argument("--dst", required=True, help="output directory")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                         help="dtype of the Hugging Face weights written (default: %(default)s)")  # fmt: skip
    convert.add_argument("--tokenizer", help="directory whose tokenizer to copy into the Hugging Face output")
    return parser


def _sft(args: argparse.Namespace) -> None:
    from miles_kernels import KernelConfig
    from miles_trainer.sft import run_sft

    config = SFTConfig(
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, warmup_steps=args.warmup_steps,
        chat_template=args.chat_template,
    )  # fmt: skip
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there; give a Hugging Face model directory")
    run_sft(args.model, args.data, args.out, config, KernelConfig(dtype=args.dtype))
    print(f"wrote {args.out}")


def _convert(args: argparse.Namespace) -> None:
    from miles_trainer.checkpoint import TRAINER_STATE, dcp_to_hf, hf_to_dcp

    src = Path(args.src)
    if (src / TRAINER_STATE).is_file() or (src.with_name(src.name + ".old") / TRAINER_STATE).is_file():
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        dcp_to_hf(src, args.dst, dtype=args.dtype, tokenizer=tokenizer)
    elif (src / "config.json").is_file():
        hf_to_dcp(src, args.dst)
    else:
        raise ValueError(
            f"--src {src}: neither a trainer checkpoint ({TRAINER_STATE}) nor a Hugging Face directory (config.json)"
        )
    print(f"wrote {args.dst}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        _sft(args) if args.command == "sft" else _convert(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"miles-trainer {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
