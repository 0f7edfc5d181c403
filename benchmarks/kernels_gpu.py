"""GPU benchmark of the batch-invariant Triton kernels (miles_kernels/triton_ops), side by side in one run.

One prepared script for a GPU machine (about 5 minutes on an H200); writes one JSON. Parts:
- `ops`: per-op median time of each Triton kernel against the torch deterministic form it replaces (the backend
  `auto` picks today) and the fast path (cuBLAS / SDPA / plain torch), bf16, at shapes of a ~1B model: the matmul at
  M = 1, 64, 512, 4096 rows (K = N = 4096); RMSNorm (4096 rows of 4096); the token log-probs (256 rows of a
  151,936-token vocabulary); attention decode (64 sequences of 2,048 cached tokens) and prefill (2,048 tokens), 32
  query / 8 KV heads of 128. With each, `invariance`: the largest difference between a row computed alone and the
  same row inside batches of other sizes (0 means batch-invariant on this GPU).
- `model`: one prefill and decode steps (64 sequences, 128 cached tokens) of the kernels benchmark model and a
  ~0.9B Qwen3 (hidden 2048, 16 layers, vocab 32,000), bf16, random weights: deterministic on the Triton kernels
  (`linear_backend` / `attention_backend` = triton), deterministic on the torch ops, fast mode, and Hugging Face's
  forward; and greedy generation throughput (64 prompts of 128 tokens, 32 new tokens each) through the model's
  paged-cache driver (`PagedRunner`: the model's arithmetic, not the rollout engine's scheduler) against Hugging
  Face `generate`.
- `on_policy`: the trainer's packed forward against the engine's schedule (prefill, then decode steps over the paged
  cache) on the GPU, float32 and bf16, on the Triton kernels and on the torch deterministic ops (what `auto` picks
  today): rows that differ (0 is true on-policy).

Each measurement that raises records its traceback instead of a number, and the others still run.

    python benchmarks/kernels_gpu.py --out $OUT/kernels_gpu.json            # on the GPU machine
    uv run python benchmarks/kernels_gpu.py --quick --out /tmp/kernels_gpu_dry.json   # CPU dry run (interpreter)

The CPU dry run (`--quick`) runs every part at tiny shapes in Triton's interpreter: it proves the script, not any
speed. On the GPU machine, which has torch, Triton and transformers but not pydantic, carry the wheels named in
benchmarks/README.md ("kernels_gpu.py") and put packages/miles-kernels/src on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

QUICK = "--quick" in sys.argv
if QUICK and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch.nn.functional as F  # noqa: E402

from miles_kernels import KernelConfig, load_model  # noqa: E402
from miles_kernels.ops.attention import attention  # noqa: E402
from miles_kernels.ops.attention_batch import build_attention_batch  # noqa: E402
from miles_kernels.ops.kv_pages import write_kv  # noqa: E402
from miles_kernels.ops.linear import linear  # noqa: E402
from miles_kernels.ops.norm import rms_norm  # noqa: E402
from miles_kernels.ops.sampling import token_logprobs  # noqa: E402
from miles_kernels.testing import BENCHMARK_MODEL, PagedRunner, packed_logits, save_random_model, tiny_config  # noqa: E402
from miles_kernels.triton_ops import logsoftmax, norm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from host import host_info  # noqa: E402
from kernels import median_seconds, miles_decode  # noqa: E402  (the kernels benchmark's timing and decode step)

TRITON = {"linear_backend": "triton", "attention_backend": "triton"}
ONE_B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """`kernels.median_seconds` in ms (each run ended by a device synchronize)."""
    return 1e3 * median_seconds(fn, repeats, warmup)


def invariance(op: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, sizes: list[int]) -> float:
    """Largest |difference| between rows 0..2 computed alone and inside the first `size` rows, over `sizes`."""
    worst = 0.0
    for r in range(3):
        alone = op(rows[r : r + 1])[0].float()
        for size in sizes:
            worst = max(worst, (op(rows[:size])[r].float() - alone).abs().max().item())
    return worst


def guarded(fn: Callable[[], Any]) -> Any:
    """fn(), or its traceback: a kernel that fails on this GPU leaves the others their measurements."""
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc(limit=6)}


def ops_part(device: torch.device, quick: bool, repeats: int) -> dict[str, Any]:
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, vocab, heads, kv_heads, head_dim = (64, 1000, 4, 2, 16) if quick else (4096, 151936, 32, 8, 128)
    results: dict[str, Any] = {}
    configs = {
        "triton": KernelConfig(dtype="bfloat16", **TRITON),
        "torch_deterministic": KernelConfig(dtype="bfloat16"),
        "fast": KernelConfig(dtype="bfloat16", mode="fast"),
    }
    weight = torch.randn(hidden, hidden, device=device, dtype=dtype, generator=gen) / hidden**0.5
    for m in [1, 64] if quick else [1, 64, 512, 4096]:
        x = torch.randn(m, hidden, device=device, dtype=dtype, generator=gen)
        results[f"matmul_m{m}"] = {
            name: guarded(lambda c=c, x=x: median_ms(lambda: linear(x, weight, c), repeats))
            for name, c in configs.items()
        }
    big = torch.randn(300 if not quick else 40, hidden, device=device, dtype=dtype, generator=gen)
    sizes = [3, 17, 20, len(big)]
    results["matmul_invariance"] = {
        name: guarded(lambda c=c: invariance(lambda rows: linear(rows, weight, c), big, sizes))
        for name, c in configs.items()
    }
    rows = torch.randn(64 if quick else 4096, hidden, device=device, dtype=dtype, generator=gen)
    norm_weight = torch.randn(hidden, device=device, dtype=dtype, generator=gen)
    sizes = [3, 17, len(rows)]
    results["rms_norm"] = guarded(
        lambda: {
            "triton": median_ms(lambda: norm.rms_norm(rows, norm_weight, 1e-6), repeats),
            "torch_deterministic": median_ms(lambda: rms_norm(rows, norm_weight, 1e-6), repeats),
            "fast": median_ms(lambda: F.rms_norm(rows, (hidden,), norm_weight, 1e-6), repeats),
            "invariance_triton": invariance(lambda r: norm.rms_norm(r, norm_weight, 1e-6), rows, sizes),
            "invariance_torch_deterministic": invariance(lambda r: rms_norm(r, norm_weight, 1e-6), rows, sizes),
        }
    )
    logits = torch.randn(16 if quick else 256, vocab, device=device, dtype=dtype, generator=gen) * 3
    tokens = torch.randint(0, vocab, (len(logits),), device=device, generator=gen)
    temperatures = torch.ones(len(logits), 1, device=device)

    def row_logsumexp(r: torch.Tensor) -> torch.Tensor:  # a row's whole log-softmax is its logits minus this
        return logsoftmax.logsumexp(r, temperatures[: len(r)])[:, None]

    results["token_logprobs"] = guarded(
        lambda: {
            "triton": median_ms(lambda: logsoftmax.token_logprobs(logits, tokens, temperatures), repeats),
            "torch": median_ms(lambda: token_logprobs(logits, tokens, temperatures), repeats),
            "invariance_triton": invariance(row_logsumexp, logits, [3, 9, len(logits)]),
        }
    )
    results["attention"] = guarded(lambda: attention_ops(device, quick, repeats, heads, kv_heads, head_dim))
    return results


def attention_ops(
    device: torch.device, quick: bool, repeats: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, Any]:
    """Decode (one new token for each of `seqs` sequences of `context` cached keys) and prefill over a paged store."""
    gen = torch.Generator(device=device).manual_seed(1)
    page, (seqs, context, prefill) = 16, ((4, 64, 48) if quick else (64, 2048, 2048))
    pages_per_seq = context // page + 1
    num_pages = seqs * pages_per_seq + 1
    k_pages = torch.randn(num_pages, kv_heads, page, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    v_pages = torch.randn_like(k_pages)
    tables = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(seqs)]
    configs = {"triton": KernelConfig(dtype="bfloat16", page_size=page, **TRITON),
               "torch_deterministic": KernelConfig(dtype="bfloat16", page_size=page),
               "fast": KernelConfig(dtype="bfloat16", page_size=page, mode="fast")}  # fmt: skip
    scale = head_dim**-0.5
    out: dict[str, Any] = {}
    decode = build_attention_batch([1] * seqs, [context] * seqs, tables, page, 4, device)
    q = torch.randn(seqs, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    out["attention_decode"] = {
        name: median_ms(lambda c=c: attention(q, k_pages, v_pages, decode, scale, c), repeats)
        for name, c in configs.items()
    }
    chunk = build_attention_batch([prefill], [0], [tables[0]], page, 4, device)
    qp = torch.randn(prefill, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    kp, vp = k_pages.clone(), v_pages.clone()
    new_k, new_v = (
        torch.randn(prefill, kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )
    write_kv(kp, vp, new_k, new_v, chunk)
    out["attention_prefill"] = {
        name: median_ms(lambda c=c: attention(qp, kp, vp, chunk, scale, c), max(1, repeats // 2))
        for name, c in configs.items()
    }
    # invariance: the same decode rows alone and with the others
    alone_batch = build_attention_batch([1], [context], [tables[0]], page, 4, device)
    alone = attention(q[:1], k_pages, v_pages, alone_batch, scale, configs["triton"])
    together = attention(q, k_pages, v_pages, decode, scale, configs["triton"])
    out["attention_invariance_triton"] = (alone[0].float() - together[0].float()).abs().max().item()
    return out


def model_part(
    device: torch.device, quick: bool, repeats: int, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    shapes = {"benchmark": dict(BENCHMARK_MODEL), "qwen3_0.9b": ONE_B}
    if quick:
        shapes = {"tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}}
    batch, context, new_tokens, prefill = (4, 16, 4, 32) if quick else (64, 128, 32, 2048)
    results: dict[str, Any] = {}
    for name, fields in shapes.items():
        results[name] = guarded(
            lambda f=fields: measure_model(f, device, repeats, (batch, context, new_tokens, prefill))
        )
        save(results)  # after each model: a run cut short keeps the models it measured
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def measure_model(
    fields: dict[str, Any], device: torch.device, repeats: int, sizes: tuple[int, ...]
) -> dict[str, Any]:
    """One random model of `fields`: prefill, decode step and greedy generation, each way (module docstring)."""
    from transformers import AutoModelForCausalLM

    batch, context, new_tokens, prefill = sizes
    with tempfile.TemporaryDirectory() as model_dir, torch.no_grad():
        save_random_model(model_dir, tiny_config("dense", **fields), seed=0)
        models = {
            "triton": load_model(model_dir, KernelConfig(dtype="bfloat16", **TRITON), device),
            "torch_deterministic": load_model(model_dir, KernelConfig(dtype="bfloat16"), device),
            "fast": load_model(model_dir, KernelConfig(dtype="bfloat16", mode="fast"), device),
        }
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, fields["vocab_size"], (prefill,), generator=gen).to(device)
        prompts = torch.randint(0, fields["vocab_size"], (batch, context), generator=gen).to(device)
        entry: dict[str, Any] = {"fields": fields}
        entry["prefill_ms"] = {
            k: median_ms(lambda m=m: packed_logits(m, [prompt]), repeats) for k, m in models.items()
        }
        entry["prefill_ms"]["hf"] = median_ms(lambda: hf(prompt[None], use_cache=False), repeats)
        entry["decode_step_ms"] = {k: median_ms(miles_decode(m, prompts), repeats) for k, m in models.items()}
        entry["generate_tokens_per_s"] = {k: generate_rate(m, prompts, new_tokens) for k, m in models.items()}
        entry["generate_tokens_per_s"]["hf_generate"] = hf_generate_rate(hf, prompts, new_tokens)
    return entry


def generate_rate(model: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    """Greedy tokens per second through the paged-cache driver: prefill, then `new_tokens` decode steps."""
    page = model.kernel.page_size
    runner = PagedRunner(model, num_pages=prompts.shape[0] * ((prompts.shape[1] + new_tokens) // page + 2) + 1)
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    logits = runner.step({i: p for i, p in enumerate(prompts)})
    for _ in range(new_tokens):
        logits = runner.step({i: rows[-1:].argmax(-1) for i, rows in logits.items()})
    sync()
    return prompts.shape[0] * new_tokens / (time.perf_counter() - start)


def hf_generate_rate(hf: Any, prompts: torch.Tensor, new_tokens: int) -> float:
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    hf.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                attention_mask=torch.ones_like(prompts), pad_token_id=0)  # fmt: skip
    sync()
    return prompts.shape[0] * new_tokens / (time.perf_counter() - start)


def on_policy(device: torch.device, quick: bool, dtype: str, backend: str) -> dict[str, Any]:
    """Trainer (packed forward) vs engine (prefill + decode steps over the paged cache), one dtype, on the Triton
    kernels (`backend` triton) or on the torch deterministic ops (`backend` torch: what `auto` picks today)."""
    from miles_kernels.testing import random_model

    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128} if quick else dict(BENCHMARK_MODEL)
    kernel = KernelConfig(dtype=dtype, **(TRITON if backend == "triton" else {}))  # type: ignore[arg-type]
    model = random_model(tiny_config("dense", **fields), kernel, seed=0).to(device)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, fields["vocab_size"], (n,), generator=gen).to(device) for n in (37, 5, 80, 16)]
    with torch.no_grad():
        reference = packed_logits(model, seqs)
        runner = PagedRunner(model)
        outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
        for seq, logits in runner.step({i: s[: len(s) // 2] for i, s in enumerate(seqs)}).items():
            outputs[seq].append(logits)
        for t in range(max(len(s) - len(s) // 2 for s in seqs)):
            step = {i: s[len(s) // 2 + t :][:1] for i, s in enumerate(seqs) if len(s) // 2 + t < len(s)}
            for seq, logits in runner.step(step).items():
                outputs[seq].append(logits)
    rows = [(torch.cat(outputs[i]) != reference[i]).any(-1).sum().item() for i in range(len(seqs))]
    diff = max((torch.cat(outputs[i]) - reference[i]).abs().max().item() for i in range(len(seqs)))
    return {"rows": sum(len(s) for s in seqs), "rows_differing": int(sum(rows)), "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run in Triton's interpreter)")
    parser.add_argument("--parts", nargs="+", default=["ops", "on_policy", "model"],
                        choices=["ops", "on_policy", "model"])  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        parser.error("no CUDA device here: use --quick for a CPU dry run (Triton's interpreter)")
    import triton

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "host": host_info(),
        "quick": args.quick, "repeats": args.repeats, "unit": "ms (median) unless named otherwise",
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part in args.parts:  # written after each part: a run cut short keeps what it measured
        began = time.perf_counter()
        if part == "ops":
            results["ops"] = ops_part(device, args.quick, args.repeats)
        elif part == "on_policy":
            results["on_policy"] = {
                f"{backend}_{dtype}": guarded(lambda b=backend, d=dtype: on_policy(device, args.quick, d, b))
                for backend in ("triton", "torch") for dtype in ("float32", "bfloat16")
            }  # fmt: skip
        else:
            results["model"] = model_part(
                device,
                args.quick,
                args.repeats,
                lambda so_far: out.write_text(json.dumps(results | {"model": so_far})),
            )
        results[f"{part}_seconds"] = time.perf_counter() - began
        out.write_text(json.dumps(results, indent=2))
        print(f"{part}: {json.dumps(results[part])[:2000]}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
