"""Supervised fine-tuning: JSONL rows → token samples with loss masks → FSDP2 steps of the SFT loss.

Used by `miles-trainer sft` and by the orchestrator's default example (a short SFT bootstraps the policy before
RL). Rows are `{"prompt": str, "response": str}` (plain text, or the chat template with `chat_template=True`) or
`{"messages": [{"role": ..., "content": ...}, ...]}` rendered with the tokenizer's chat template. Only response /
assistant tokens (and the EOS that ends them) carry loss; the prompt, system and user turns do not.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts import Sample
from miles_kernels import CausalLM
from miles_trainer.config import OptimizerConfig, SFTConfig

if TYPE_CHECKING:
    from miles_trainer.auxiliary import AuxLoss

ROLES = ("system", "user", "assistant", "tool")
Tokens = tuple[list[int], list[int], list[int]]  # prompt tokens, response tokens, response loss mask
KEPT = ("loss", "skipped_update")  # step metrics averaged per epoch (with the auxiliary losses' own)


class SFTDataError(ValueError):
    """A bad row: the message names the file, the line and what is wrong."""


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return _encode(tokenizer, text)


def _prompt_response(tokenizer: Any, row: dict[str, Any], chat_template: bool) -> Tokens:
    for key in ("prompt", "response"):
        if not isinstance(row.get(key), str):
            raise ValueError(f'"{key}" must be a string')
    if not row["response"]:
        raise ValueError('"response" is empty: there is nothing to learn from this row')
    if chat_template:
        prompt = _template(tokenizer, [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
    else:
        prompt = _encode(tokenizer, row["prompt"])
    response = [*_encode(tokenizer, row["response"]), tokenizer.eos_token_id]
    return prompt, response, [1] * len(response)


def _messages(tokenizer: Any, row: dict[str, Any]) -> Tokens:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    for k, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"messages[{k}] must be {{'role': one of {list(ROLES)}, 'content': str}}")
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("no assistant message: nothing would carry loss")
    tokens = _template(tokenizer, messages)
    mask = [0] * len(tokens)
    for k in assistant:
        # The turn starts where the conversation before it, with the generation prompt, ends in the whole row's
        # tokens, and runs through its end-of-turn token (EOS): what a rollout of that turn generates. The turn
        # itself may render differently once later messages follow it (Qwen3 drops an earlier turn's <think>).
        opening = _template(tokenizer, messages[:k], add_generation_prompt=True)
        start = len(opening)
        if tokens[:start] != opening:
            raise ValueError("the tokenizer's chat template is not prefix-stable; use prompt/response rows")
        ends = [i for i in range(start, len(tokens)) if tokens[i] == tokenizer.eos_token_id]
        if not ends:
            raise ValueError(f"assistant message {k} has no end-of-turn token {tokenizer.eos_token!r} after it")
        end = ends[0] + 1
        mask[start:end] = [1] * (end - start)
    first = assistant[0]
    num_prompt = len(_template(tokenizer, messages[:first], add_generation_prompt=True))
    return tokens[:num_prompt], tokens[num_prompt:], mask[num_prompt:]


def _token_list(row: dict[str, Any], key: str, vocab_size: int | None) -> list[int]:
    value = row[key]
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f'"{key}" must be a list of token ids (integers)')
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f'"{key}" holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})')
    return value


def _token_row(row: dict[str, Any], vocab_size: int | None) -> Tokens:
    """Token rows: Miles' Sample fields (prompt_tokens, response_tokens) or slime's (tokens, response_length), with
    an optional loss_mask over the response."""
    if "prompt_tokens" in row or "response_tokens" in row:
        prompt, response = (_token_list(row, key, vocab_size) for key in ("prompt_tokens", "response_tokens"))
    else:
        tokens = _token_list(row, "tokens", vocab_size)
        length = row.get("response_length")
        if not isinstance(length, int) or isinstance(length, bool) or not 0 < length < len(tokens):
            raise ValueError(f'"response_length" (tokens after the prompt) must be an int in [1, {len(tokens) - 1}]')
        prompt, response = tokens[:-length], tokens[-length:]
    if not response:
        raise ValueError('"response_tokens" is empty: there is nothing to learn from this row')
    mask = row.get("loss_mask", [1] * len(response))
    if not isinstance(mask, list) or len(mask) != len(response) or any(m not in (0, 1) for m in mask):
        raise ValueError(f'"loss_mask" must be a list of {len(response)} zeros and ones, one per response token')
    return prompt, response, mask


def load_sft_samples(
    path: str | os.PathLike[str], tokenizer: Any, chat_template: bool = False, vocab_size: int | None = None
) -> list[Sample]:
    """Read and tokenize every row; the first bad row raises `SFTDataError` naming its line.

    A row is text (`prompt` / `response`, or chat `messages`) or token ids (`prompt_tokens` / `response_tokens`,
    or slime's `tokens` / `response_length`; optional `loss_mask`), checked against `vocab_size` when given."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"SFT data {file} does not exist (expected a JSONL file, one row per line)")
    samples: list[Sample] = []
    with file.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{file}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SFTDataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
            try:
                if not isinstance(row, dict):
                    raise ValueError("a row must be a JSON object")
                if "messages" in row:
                    prompt, response, mask = _messages(tokenizer, row)
                elif {"prompt_tokens", "response_tokens", "tokens"} & row.keys():
                    prompt, response, mask = _token_row(row, vocab_size)
                elif "prompt" in row or "response" in row:
                    prompt, response, mask = _prompt_response(tokenizer, row, chat_template)
                else:
                    raise ValueError(
                        'a row needs "prompt" and "response", "messages", "prompt_tokens" and "response_tokens", or '
                        '"tokens" and "response_length"'
                    )
                if not prompt:
                    raise ValueError("the prompt is empty (the first response token needs a token before it)")
            except ValueError as error:
                raise SFTDataError(f"{where}: {error}") from error
            index = len(samples)
            samples.append(Sample(
                index=index, group_index=index, prompt="", prompt_tokens=prompt, response_tokens=response,
                loss_mask=mask,
            ))  # fmt: skip
    if not samples:
        raise SFTDataError(f"{file} has no rows")
    return samples


def epoch_batches(num_samples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled sample positions for one epoch, in batches (the last one may be smaller)."""
    order = list(range(num_samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def ensure_process_group() -> bool:
    """Use the launcher's process group (torchrun sets RANK / WORLD_SIZE), else a one-process group: gloo, with NCCL
    for CUDA tensors where CUDA is available. Returns True when this call created the group (the caller destroys
    it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return True


def run_sft(
    model_dir: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    config: SFTConfig | None = None,
    kernel: Any = None,
    log: Any = print,
    stop_after: Callable[[int, CausalLM], bool] | None = None,
    aux_losses: Sequence[AuxLoss] = (),
    aux_optimizer: OptimizerConfig | None = None,
    train_policy: bool = True,
    eagle3_draft: str | os.PathLike[str] | None = None,
) -> list[dict[str, float]]:
    """Fine-tune the Hugging Face model at `model_dir` on the JSONL `data` and write a Hugging Face directory
    (weights, config, tokenizer) to `out`. Returns one metrics dict per epoch (mean loss, tokens/s).

    `stop_after(step, model)`, if given, is called after every optimizer step (1-based) on every rank with the
    training model; when it returns True, training stops there and that model is exported (early stopping).
    `aux_losses` / `aux_optimizer`: auxiliary losses trained on the same forward (`FSDP2Backend`), e.g. the MTP
    draft's (`miles_spec.MTPLoss`), which leave the policy's update unchanged; their optimizer defaults to the
    SFT's, and either one's schedule spans the SFT's steps unless it sets `total_steps`. `train_policy=False`
    trains the auxiliary losses alone: the policy's weights are exported as loaded (e.g. `miles-spec train`).
    `eagle3_draft`: an EAGLE-3 draft attached to the policy (`FSDP2Backend(eagle3_draft=)`); with
    `train_policy=False` only the draft is written to `out` (SpecForge's layout), else `export_hf` writes it to
    `out/eagle3`."""
    import time

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from miles_kernels import KernelConfig, read_model_config
    from miles_trainer.checkpoint import export_eagle3, export_hf
    from miles_trainer.fsdp import FSDP2Backend

    config = config or SFTConfig()
    kernel = kernel or KernelConfig()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {model_dir} has no EOS token; responses could not end")
    samples = load_sft_samples(data, tokenizer, config.chat_template, read_model_config(model_dir).vocab_size)
    created = ensure_process_group()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = [
            b
            for epoch in range(config.epochs)
            for b in epoch_batches(len(samples), config.batch_size, config.seed, epoch)
            if len(b) >= world  # every rank needs a sample; a tail batch smaller than the world is dropped
        ]
        if not batches:
            raise ValueError(f"{len(samples)} rows cannot give each of {world} ranks a sample; add rows")

        def over_the_sft(opt: OptimizerConfig) -> OptimizerConfig:
            steps = len(batches)
            update = {"warmup_steps": min(opt.warmup_steps, steps), "total_steps": opt.total_steps or steps}
            return opt.model_copy(update=update)

        aux = aux_optimizer and over_the_sft(aux_optimizer)
        backend = FSDP2Backend(model_dir, kernel, over_the_sft(config.optimizer), config=config.backend,
                               aux_losses=aux_losses, aux_optimizer=aux, lora=config.lora,
                               eagle3_draft=eagle3_draft)  # fmt: skip
        per_epoch = max(1, len(batches) // config.epochs)
        history: list[dict[str, float]] = []
        aux_prefixes = tuple(f"{aux.name}_" for aux in aux_losses)
        kept: list[dict[str, float]] = []  # this epoch's steps: the loss, skipped_update and the aux metrics
        tokens, start = 0.0, time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            metrics = backend.sft_step([samples[i] for i in batch[rank::world]], train_policy=train_policy)
            kept.append({k: v for k, v in metrics.items() if k in KEPT or k.startswith(aux_prefixes)})
            tokens += metrics["num_tokens"]
            stop = stop_after is not None and stop_after(step, backend.model)
            if step % per_epoch == 0 or step == len(batches) or stop:
                means = {k: sum(m[k] for m in kept) / len(kept) for k in kept[0]}
                summary = {"epoch": float(len(history) + 1), **means, "steps": float(step),
                           "tokens_per_s": tokens / (time.perf_counter() - start)}  # fmt: skip
                history.append(summary)
                if rank == 0:
                    aux_text = "".join(f", {k} {v:.4f}" for k, v in means.items() if k.startswith(aux_prefixes))
                    speed = f"{summary['tokens_per_s']:.0f} tokens/s"
                    log(f"epoch {len(history)}: loss {means['loss']:.4f}{aux_text}, {speed}")
                kept, tokens, start = [], 0.0, time.perf_counter()
            if stop:
                break
        if eagle3_draft is not None and not train_policy:
            export_eagle3(backend, out)
        else:
            export_hf(backend, out, tokenizer=tokenizer)
        return history
    finally:
        if created:
            dist.destroy_process_group()
