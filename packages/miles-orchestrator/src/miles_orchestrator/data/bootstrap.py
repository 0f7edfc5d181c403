"""The default example's policy: a tiny Qwen3 (the README's benchmark shape; or an MoE of the same trunk,
`model.bootstrap_architecture`) with one MTP module (the speculative draft) and a tokenizer trained on the built-in
task, bootstrapped by a short SFT on the task's train split so RL starts from an imperfect policy. The SFT trains
the MTP module beside the trunk (`miles_spec.MTPLoss`, gradients isolated, its own optimizer), so `spec.mode=frozen`
or `online` has a useful draft from the first step; the MTP weights are drawn after the trunk's and never touch its
update, so the trunk's bits are those of a bootstrap without MTP.

The result is cached in the user cache dir (`$MILES_CACHE_DIR`, else `$XDG_CACHE_HOME/miles`, else
`~/.cache/miles`) under a key hashed from the bootstrap config, the task and the source code of the modules that
produce it, so a second run reuses it and any change to them makes a new one. Building happens in a temporary
directory renamed into place: an interrupted bootstrap is never reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles_contracts import ToolCall
from miles_kernels import KernelConfig, ModelConfig
from miles_kernels.testing import build_tokenizer, greedy_generate, save_random_model, tiny_config
from miles_orchestrator.config import RunConfig
from miles_orchestrator.data import task as task_module
from miles_orchestrator.rollout import tool_calls
from miles_spec import MTPLoss
from miles_trainer import SFTConfig, load_sft_samples, pack_samples, run_sft

# The bootstrap needs no batch invariance (RL starts from whatever weights it writes), so it runs the plain torch
# ops; 16-token KV pages fit the task's ~15-token rows (64-token pages would mostly be padding).
BOOTSTRAP_KERNEL = KernelConfig(mode="fast", page_size=16)
PROBE_SIZE, PROBE_FROM, PROBE_EVERY = 128, 100, 10  # early-stop probe: prompts, first check, check interval
# The tokenizer's chat template and special tokens per family (miles_kernels.testing.chat_templates); others: ChatML
CHAT_FORMAT = {"qwen2": "qwen2.5", "llama": "llama3"}


@contextlib.contextmanager
def _threads(num_threads: int) -> Iterator[None]:
    """Run torch on `num_threads` intra-op threads. On a small, shared CPU two spinning OpenMP threads of tiny
    ops slow the bootstrap SFT down by an order of magnitude as soon as another process competes for a core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(min(num_threads, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sft_rows(cfg: RunConfig, num_rows: int, seed: int) -> list[dict[str, Any]]:
    """The bootstrap's SFT rows from the task's train split: `{"prompt", "response"}` rows answering directly, or,
    with `model.bootstrap_tool_use`, chat `messages` rows of which that share (drawn per row) first call the
    calculator with the question's expression, read its result, then answer (`rollout.agent.env=calculator`)."""
    task = cfg.data.task.to_task()
    share = cfg.model.bootstrap_tool_use
    if not share:
        return task.sft_rows(num_rows, seed=seed)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for problem in task.problems(num_rows, seed=seed):
        answer = task_module.response_format(problem)
        messages = [{"role": "user", "content": problem.question}]
        if rng.random() < share:
            expression = problem.question.removeprefix("What is ").removesuffix("?")
            call = tool_calls.format_tool_call(ToolCall(name="calculator", arguments={"expression": expression}))
            messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": str(problem.answer)}]
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    return rows


def _corpus_line(row: dict[str, Any]) -> str:
    if "messages" in row:
        return " ".join(m["content"] for m in row["messages"])
    return f"{row['prompt']} {row['response']}"


def policy_config(vocab_size: int, architecture: str = "qwen3", num_layers: int = 4) -> ModelConfig:
    """Qwen3: hidden 256, intermediate 768, `num_layers` layers (4 by default), 8 heads / 4 KV heads, head dim 32,
    tied embeddings; one MTP module (DeepSeek-V3's layout, `model.layers.{num_layers}`). Qwen2.5 (`qwen2`: q/k/v
    biases, no QK-norm) and Llama 3.x (`llama`: no QK-norm, Llama 3.1's RoPE scaling, factor 8 over an original
    context of 256 with the trunk's RoPE base 10,000: at head dim 32 Llama's base 500,000 leaves a 4-layer model too
    few position-sensitive dimensions to learn the task) keep that shape. The MoE families keep that trunk and swap
    the MLPs:
    - qwen3_moe: 8 experts of intermediate 384, top-2 (renormalized): the dense MLP's active size;
    - glm4_moe: the first layer dense (768), then 8 routed experts of 256, top-2 of one group, one shared expert
      of 256, routed scaling 2.5, partial rotary 0.5, q/k/v biases, QK-norm (GLM-4.5's settings, scaled down);
    - deepseek_v3: glm4_moe's MLPs with DeepSeek-V3's grouped routing (4 groups of 2, the best 2 kept) and
      multi-head latent attention: q through a rank-128 q-LoRA, a KV latent of 64 plus a 16-wide rotary key shared
      by the 8 heads, query / key heads of 32 + 16, value heads of 32; interleaved rotary pairs and YaRN (factor 4
      over 128 original positions, DeepSeek-V3's mscales) (DeepSeek-V3's settings, scaled down)."""
    shape: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": num_layers,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 512,
        "num_nextn_predict_layers": 1,
    }  # fmt: skip
    if architecture == "qwen3":
        return tiny_config("dense", **shape)
    if architecture == "qwen2":  # Qwen2.5: q/k/v biases, no QK-norm
        return tiny_config("qwen2", **shape)
    if architecture == "llama":  # Llama 3.x: no QK-norm, Llama 3 RoPE scaling (scaled down: see the docstring)
        return tiny_config("llama", **shape, rope_theta=10_000.0, rope_original_max_position_embeddings=256)
    if architecture == "qwen3_moe":
        return tiny_config("moe", **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384)
    if architecture == "glm4_moe":
        return tiny_config(
            "glm", **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, partial_rotary_factor=0.5,
        )  # fmt: skip
    if architecture == "deepseek_v3":
        return tiny_config(
            "deepseek", **shape | {"num_key_value_heads": 8, "head_dim": 16}, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=256, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, rope_original_max_position_embeddings=128,
        )  # fmt: skip
    raise ValueError(
        f"model.bootstrap_architecture={architecture!r}: use qwen3, qwen2, llama, qwen3_moe, glm4_moe or deepseek_v3"
    )


class ProbeStop:
    """The bootstrap's early stop: every `PROBE_EVERY` steps, greedy pass@1 (exact answer + EOS) on probe prompts
    from the train split; stop once it reaches the target. Landing on a pass rate, not a step count, keeps the
    starting policy comparable wherever the SFT's floating-point trajectory differs (another CPU, BLAS or torch)."""

    def __init__(self, base: Path, probe: Path, cfg: RunConfig, log: Any) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base))
        self.samples = load_sft_samples(probe, tokenizer, cfg.data.apply_chat_template)
        self.eos_ids = {int(tokenizer.eos_token_id)}
        self.target = cfg.model.bootstrap_target_pass_rate or 1.0
        self.log = log

    def pass_rate(self, model: Any) -> float:
        import torch

        longest = max(len(s.response_tokens) for s in self.samples)
        with torch.no_grad():
            outputs = greedy_generate(model, [s.prompt_tokens for s in self.samples], longest, self.eos_ids)
        hits = sum(out == s.response_tokens for out, s in zip(outputs, self.samples, strict=True))
        return hits / len(self.samples)

    def __call__(self, step: int, model: Any) -> bool:
        if step < PROBE_FROM or step % PROBE_EVERY:
            return False
        rate = self.pass_rate(model)
        self.log(f"bootstrap step {step}: probe pass@1 {rate:.1%} (target {self.target:.0%})")
        return rate >= self.target


def cache_dir() -> Path:
    if "MILES_CACHE_DIR" in os.environ:
        return Path(os.environ["MILES_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "miles"


def _modules_of(*functions: Any) -> list[Any]:
    """The modules that define `functions` (the SFT code whose source keys the cache)."""
    return [inspect.getmodule(fn) for fn in functions]


def bootstrap_key(cfg: RunConfig) -> str:
    parts: dict[str, Any] = {
        "model": cfg.model.model_dump(exclude={"path"}),
        "task": cfg.data.task.model_dump(),
        "seed": cfg.data.seed,
        "chat": cfg.data.apply_chat_template,
        "code": [
            inspect.getsource(m)
            for m in (task_module, tool_calls, *_modules_of(run_sft, pack_samples, MTPLoss), sys.modules[__name__])
        ],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def bootstrap_policy(cfg: RunConfig, log: Any = print) -> str:
    """The bootstrapped policy's directory (built on first use, then reused)."""
    final = cache_dir() / "bootstrap" / bootstrap_key(cfg)
    if (final / "policy" / "config.json").is_file():
        log(f"using the cached bootstrapped policy {final / 'policy'}")
        return str(final / "policy")
    target = cfg.model.bootstrap_target_pass_rate
    until = f", until probe pass@1 >= {target:.0%}" if target is not None else ""
    log(
        f"bootstrapping the built-in policy by SFT (at most {cfg.model.bootstrap_steps} steps{until}); cached in "
        f"{final}"
    )
    staging = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _build(cfg, staging, log)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed or interrupted bootstrap leaves nothing behind
        raise
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return str(final / "policy")


def _build(cfg: RunConfig, staging: Path, log: Any) -> None:
    """The base model, its tokenizer and the SFT rows in `staging`, then the SFT into `staging / "policy"`."""
    task = cfg.data.task.to_task()
    size = cfg.model.bootstrap_batch_size
    rows = sft_rows(cfg, max(1, cfg.model.bootstrap_steps) * size, seed=cfg.data.seed + 1)
    corpus = [_corpus_line(row) for row in rows[:2000]]
    chat_format = CHAT_FORMAT.get(cfg.model.bootstrap_architecture, "qwen")
    tokenizer = build_tokenizer(corpus, vocab_size=cfg.model.bootstrap_vocab_size, chat_format=chat_format)
    config = policy_config(len(tokenizer), cfg.model.bootstrap_architecture, cfg.model.bootstrap_num_layers)
    save_random_model(staging / "base", config, seed=cfg.data.seed, tokenizer=tokenizer)
    data = staging / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if cfg.model.bootstrap_steps:
        optimizer = SFTConfig().optimizer.model_copy(update={"lr": cfg.model.bootstrap_lr})  # 10 warm-up steps, cosine
        sft = SFTConfig(epochs=1, batch_size=size, seed=cfg.data.seed, chat_template=cfg.data.apply_chat_template,
                        optimizer=optimizer)  # fmt: skip
        stop_after = None
        if cfg.model.bootstrap_target_pass_rate is not None:
            probe = staging / "probe.jsonl"
            probe_rows = task.sft_rows(PROBE_SIZE, seed=cfg.data.seed + 2)
            probe.write_text("".join(json.dumps(row) + "\n" for row in probe_rows))
            stop_after = ProbeStop(staging / "base", probe, cfg, log)
        with _threads(1):
            run_sft(staging / "base", data, staging / "policy", sft, kernel=BOOTSTRAP_KERNEL, log=log,
                    stop_after=stop_after, aux_losses=[MTPLoss()])  # fmt: skip
    else:
        shutil.copytree(staging / "base", staging / "policy")
