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
        start = len(_template(tokenizer, messages[:k], add_generation_prompt=True))
        end = len(_template(tokenizer, messages[: k + 1]))
        if tokens[:end] != _template(tokenizer, messages[: k + 1]):
            raise ValueError("the tokenizer's chat template is not prefix-stable; use prompt/response rows")
        span = tokens[start:end]
        # Train the assistant's content and its end-of-turn token, not the template's newline after it.
        if tokenizer.eos_token_id in span:
            end = start + span.index(tokenizer.eos_token_id) + 1
        mask[start:end] = [1] * (end - start)
    first = assistant[0]
    num_prompt = len(_template(tokenizer, messages[:first], add_generation_prompt=True))
    return tokens[:num_prompt], tokens[num_prompt:], mask[num_prompt:]


def load_sft_samples(path: str | os.PathLike[str], tokenizer: Any, chat_template: bool = False) -> list[Sample]:
    """Read and tokenize every row; the first bad row raises `SFTDataError` naming its line."""
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
                elif "prompt" in row or "response" in row:
                    prompt, response, mask = _prompt_response(tokenizer, row, chat_template)
                else:
                    raise ValueError('a row needs "prompt" and "response", or "messages"')
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
    """Use the launcher's process group (torchrun sets RANK / WORLD_SIZE), else a one-process gloo group.
    Returns True when this call created the group (the caller destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
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
) -> list[dict[str, float]]:
    """Fine-tune the Hugging Face model at `model_dir` on the JSONL `data` and write a Hugging Face directory
    (weights, config, tokenizer) to `out`. Returns one metrics dict per epoch (mean loss, tokens/s).

    `stop_after(step, model)`, if given, is called after every optimizer step (1-based) on every rank with the
    training model; when it returns True, training stops there and that model is exported (early stopping).
    `aux_losses` / `aux_optimizer`: auxiliary losses trained on the same forward (`FSDP2Backend`), e.g. the MTP
    draft's (`miles_spec.MTPLoss`), which leave the policy's update unchanged."""
    import time

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from miles_kernels import KernelConfig
    from miles_trainer.checkpoint import export_hf
    from miles_trainer.fsdp import FSDP2Backend

    config = config or SFTConfig()
    kernel = kernel or KernelConfig()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {model_dir} has no EOS token; responses could not end")
    samples = load_sft_samples(data, tokenizer, config.chat_template)
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
        optimizer = config.optimizer.model_copy(update={
            "warmup_steps": min(config.optimizer.warmup_steps, len(batches)),
            "total_steps": config.optimizer.total_steps or len(batches),
        })  # fmt: skip
        backend = FSDP2Backend(model_dir, kernel, optimizer, config=config.backend, aux_losses=aux_losses,
                               aux_optimizer=aux_optimizer)  # fmt: skip
        per_epoch = max(1, len(batches) // config.epochs)
        history: list[dict[str, float]] = []
        losses, tokens, start = [], 0.0, time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            metrics = backend.sft_step([samples[i] for i in batch[rank::world]])
            losses.append(metrics["loss"])
            tokens += metrics["num_tokens"]
            stop = stop_after is not None and stop_after(step, backend.model)
            if step % per_epoch == 0 or step == len(batches) or stop:
                elapsed = time.perf_counter() - start
                summary = {"epoch": float(len(history) + 1), "loss": sum(losses) / len(losses), "steps": float(step),
                           "tokens_per_s": tokens / elapsed}  # fmt: skip
                history.append(summary)
                if rank == 0:
                    log(f"epoch {len(history)}: loss {summary['loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s")
                losses, tokens, start = [], 0.0, time.perf_counter()
            if stop:
                break
        export_hf(backend, out, tokenizer=tokenizer)
        return history
    finally:
        if created:
            dist.destroy_process_group()
