"""`miles-spec` command line.

Miles spec: train the MTP draft head for speculative decoding.

    miles-spec train --model DIR --data rows.jsonl --out DIR [--num-mtp-layers 1] [--epochs N] [--lr LR]

trains (or refreshes) the MTP modules of a Hugging Face checkpoint on a JSONL of rows, the policy's own weights
frozen (`miles_spec.train.train_draft`). Bad input (no such model, a model of another family, a malformed row) is
an error that says what is wrong, with exit status 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-spec", description="Miles spec: train the MTP draft head for speculative decoding."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = subcommands.add_parser(
        "train",
        help="Train or refresh a checkpoint's MTP draft on a JSONL of rows (the policy's weights stay frozen)",
        description="Train the MTP modules of a Hugging Face checkpoint on JSONL rows: token ids (prompt_tokens / "
        "response_tokens, or slime's tokens / response_length; optional loss_mask) or text (prompt / response, "
        "messages). The trunk is written back unchanged; only the MTP modules move.",
    )
    train.add_argument("--model", required=True,
                       help="Hugging Face checkpoint directory (a family miles-kernels runs)")  # fmt: skip
    train.add_argument("--data", required=True, help="JSONL file, one row per line")
    train.add_argument("--out", required=True, help="where to write the checkpoint with the trained draft")
    train.add_argument("--num-mtp-layers", type=int, default=None,
                       help="add this many new MTP modules to a checkpoint that has none (default for one whose "
                       "config.json declares MTP layers it holds no tensor of, as transformers saves GLM-4.5: "
                       "that many)")  # fmt: skip
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, default=32, help="rows per optimizer step")
    train.add_argument("--lr", type=float, default=1e-4, help="peak AdamW learning rate (10 warm-up steps, cosine)")
    train.add_argument("--max-grad-norm", type=float, default=1.0)
    train.add_argument("--mtp-loss-coef", type=float, default=1.0)
    train.add_argument("--chat-template", action="store_true", help="text prompts go through the chat template")
    train.add_argument("--seed", type=int, default=0, help="row order, and the init of new MTP modules")
    return parser


def _train(args: argparse.Namespace) -> int:
    from miles_spec.train import DraftTrainConfig, train_draft
    from miles_trainer import SFTDataError

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"miles-spec train: error: --out {out} is not empty; choose a new directory", file=sys.stderr)
        return 2
    try:
        config = DraftTrainConfig(
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_grad_norm=args.max_grad_norm,
            mtp_loss_coef=args.mtp_loss_coef, num_mtp_layers=args.num_mtp_layers, seed=args.seed,
            chat_template=args.chat_template,
        )  # fmt: skip
        history = train_draft(args.model, args.data, out, config, log=lambda message: print(message, flush=True))
    except (SFTDataError, ValueError, FileNotFoundError) as error:
        print(f"miles-spec train: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(history[-1]))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _train(args)


if __name__ == "__main__":
    sys.exit(main())
