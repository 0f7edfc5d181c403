"""Benchmark: miles-kernels deterministic vs fast mode vs Hugging Face `transformers`, side by side in one run.

Model (fixed for these benchmarks): Qwen3, hidden 512, intermediate 1536, 8 layers, 8 heads / 4 KV heads
(head dim 64), vocab 8192, float32, random weights. Measured on the CPU with the threads torch has:
- prefill: one forward over a 512-token prompt (miles: packed trainer path = engine prefill path);
- decode: one forward step of 1 token for each of B sequences with 128 cached tokens, B in 1/8/32/64
  (miles: paged KV via `PagedRunner`; HF: `past_key_values` cache).
The weights are held packed, as the rollout engine holds them (`hold_packed_weights`: the native linear's packed
copies). Each number is the median of `--repeats` timed runs after warm-up. Ratios: deterministic / fast (the cost
of batch invariance) and fast / HF and deterministic / HF.
Per op (`per_op`): each op the two modes' backends run, alone at the model's shapes, deterministic vs fast backend
(the `auto` choice of each mode, named in the JSON): one decoder layer's seven linear layers, the attention over the
paged store, one RMSNorm, at the prefill's tokens (the attention: one prompt of them) and at a decode step of the
largest batch (one query per sequence over its `--context` cached keys).
On a GPU (`--device cuda`, each timed run ends with a device synchronize) the model can be sized with `--model
key=value` (Hugging Face config names) and run in bf16 (`--dtype bfloat16`); the fixed model above is for the CPU.

    uv run python benchmarks/kernels.py --out benchmarks/results/kernels.json
    uv run python benchmarks/kernels.py --fast-linear-backend torch --out /tmp/k.json   # fast mode on MKL's GEMM
    python benchmarks/kernels.py --device cuda --dtype bfloat16 --model hidden_size=2048 --model num_hidden_layers=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from host import host_info
from transformers import AutoModelForCausalLM

from miles_kernels import KernelConfig, hold_packed_weights, linear, load_model, resolved_backends, rms_norm
from miles_kernels.ops.attention import attention
from miles_kernels.ops.attention_batch import build_attention_batch
from miles_kernels.testing import BENCHMARK_MODEL, PagedRunner, packed_logits, save_random_model, tiny_config


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    def synchronize() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def miles_prefill(model, prompt: torch.Tensor) -> Callable[[], object]:
    return lambda: packed_logits(model, [prompt])


def miles_decode(model, prompts: torch.Tensor) -> Callable[[], object]:
    """A decode step for every sequence; each call starts from the same 128-token context."""
    runner = PagedRunner(model, num_pages=prompts.shape[0] * (prompts.shape[1] // model.kernel.page_size + 2) + 1)
    runner.step({i: p for i, p in enumerate(prompts)})
    context = dict(runner.cached)
    next_tokens = {i: prompts[i, -1:] for i in range(prompts.shape[0])}

    def step() -> None:
        runner.cached.update(context)  # rewrite the same slot each time: a steady-state decode step
        runner.step(next_tokens)

    return step


def hf_prefill(hf, prompt: torch.Tensor) -> Callable[[], object]:
    return lambda: hf(prompt[None], use_cache=False)


def hf_decode(hf, prompts: torch.Tensor) -> Callable[[], object]:
    from transformers import DynamicCache

    with torch.no_grad():
        cache = hf(prompts, use_cache=True).past_key_values
    next_tokens = prompts[:, -1:]

    def step() -> None:
        cache.crop(-1)  # drop the token the previous call appended: the same context every call
        hf(next_tokens, past_key_values=cache, use_cache=True)

    assert isinstance(cache, DynamicCache)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kernels.json", help="JSON output path")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median reported)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--context", type=int, default=128, help="cached tokens per sequence before decode")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    defaults = KernelConfig()
    for name in ("page_size", "attention_query_tile", "linear_tile"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    parser.add_argument("--fast-linear-backend", default="auto",
                        help="fast mode's linear backend (auto: this CPU's; torch: one MKL GEMM; native)")  # fmt: skip
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the benchmark model (HF config name, integer value)")  # fmt: skip
    args = parser.parse_args()
    tiles = {name: getattr(args, name) for name in ("page_size", "attention_query_tile", "linear_tile")}
    model_fields = dict(BENCHMARK_MODEL)
    for item in args.model:
        key, _, value = item.partition("=")
        if key not in model_fields or not value.isdigit():
            parser.error(f"--model {item!r}: give KEY=INTEGER with KEY one of {sorted(model_fields)}")
        model_fields[key] = int(value)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    torch.manual_seed(0)
    results: dict[str, object] = {
        "model": model_fields,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host_info(),
        "repeats": args.repeats,
        "kernel_config": tiles,
        "unit": "seconds (median)",
    }
    with tempfile.TemporaryDirectory() as model_dir, torch.no_grad():
        save_random_model(model_dir, tiny_config("dense", **model_fields), seed=0)
        det = load_model(model_dir, KernelConfig(mode="deterministic", dtype=args.dtype, **tiles), device)
        fast_kernel = KernelConfig(mode="fast", dtype=args.dtype, linear_backend=args.fast_linear_backend, **tiles)
        fast = load_model(model_dir, fast_kernel, device)
        for model in (det, fast):  # as the rollout engine holds its weights (packed once where the linear is native)
            hold_packed_weights(model.parameters())
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        generator = torch.Generator().manual_seed(0)
        vocab = model_fields["vocab_size"]
        prompt = torch.randint(0, vocab, (args.prefill_tokens,), generator=generator).to(device)
        prefill = {
            "deterministic": median_seconds(miles_prefill(det, prompt), args.repeats),
            "fast": median_seconds(miles_prefill(fast, prompt), args.repeats),
            "hf": median_seconds(hf_prefill(hf, prompt), args.repeats),
        }
        results["prefill"] = {"tokens": args.prefill_tokens, **prefill, **ratios(prefill)}
        print(f"prefill {args.prefill_tokens}: {fmt(prefill)}")
        decode = {}
        for batch in args.batches:
            prompts = torch.randint(0, vocab, (batch, args.context), generator=generator).to(device)
            times = {
                "deterministic": median_seconds(miles_decode(det, prompts), args.repeats),
                "fast": median_seconds(miles_decode(fast, prompts), args.repeats),
                "hf": median_seconds(hf_decode(hf, prompts), args.repeats),
            }
            decode[str(batch)] = {**times, **ratios(times)}
            print(f"decode batch {batch}: {fmt(times)}")
        results["decode"] = {"context": args.context, "per_batch": decode}
        results["per_op"] = per_op(det.kernel, fast.kernel, model_fields, args, device, dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def per_op(
    det: KernelConfig, fast: KernelConfig, model: dict[str, int], args: argparse.Namespace, device: torch.device,
    dtype: torch.dtype,
) -> dict[str, object]:  # fmt: skip
    """Each op alone, the deterministic backend vs the fast one (module docstring)."""
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    hidden, inter, heads, kv_heads = (model[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                         "num_key_value_heads"))  # fmt: skip
    head_dim = model.get("head_dim", hidden // heads)
    shapes = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
              (hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]  # fmt: skip
    weights = [randn(n, k) for n, k in shapes]
    hold_packed_weights(weights)  # an engine's weights
    norm_weight = randn(hidden)
    out: dict[str, object] = {"backends": {"deterministic": resolved_backends(det), "fast": resolved_backends(fast)}}
    out["prefill"] = _time_ops(det, fast, [args.prefill_tokens], 0, weights, norm_weight, model, randn, args.repeats)
    out["decode"] = _time_ops(det, fast, [1] * max(args.batches), args.context, weights, norm_weight, model, randn,
                              args.repeats)  # fmt: skip
    return out


def _time_ops(
    det: KernelConfig, fast: KernelConfig, query_lens: list[int], prefix: int, weights: list[torch.Tensor],
    norm_weight: torch.Tensor, model: dict[str, int], randn: Callable[..., torch.Tensor], repeats: int,
) -> dict[str, object]:  # fmt: skip
    """The three ops for sequences bringing `query_lens` new tokens after `prefix` cached ones."""
    hidden, heads, kv_heads = model["hidden_size"], model["num_attention_heads"], model["num_key_value_heads"]
    head_dim, page, rows = model.get("head_dim", hidden // heads), det.page_size, sum(query_lens)
    x = randn(rows, hidden)
    inputs = {k: x if k == hidden else randn(rows, k) for k in {w.shape[1] for w in weights}}
    pages = -(-(prefix + max(query_lens)) // page)
    tables = [list(range(1 + s * pages, 1 + (s + 1) * pages)) for s in range(len(query_lens))]
    k_pages = randn(1 + len(query_lens) * pages, kv_heads, page, head_dim)
    v_pages = randn(*k_pages.shape)
    batch = build_attention_batch(query_lens, [prefix] * len(query_lens), tables, page, det.attention_query_tile,
                                  x.device)  # fmt: skip
    q = randn(rows, heads, head_dim)
    ops: dict[str, Callable[[KernelConfig], object]] = {
        "linear (one layer's seven)": lambda c: [linear(inputs[w.shape[1]], w, c) for w in weights],
        "attention": lambda c: attention(q, k_pages, v_pages, batch, head_dim**-0.5, c),
        "rms_norm": lambda c: rms_norm(x, norm_weight, 1e-6, c),
    }
    times = {}
    for name, op in ops.items():
        det_s = median_seconds(lambda op=op: op(det), repeats)
        fast_s = median_seconds(lambda op=op: op(fast), repeats)
        times[name] = {"deterministic": det_s, "fast": fast_s, "deterministic_over_fast": det_s / fast_s}
        print(f"{rows} rows, {name}: det {det_s * 1e3:.2f} ms, fast {fast_s * 1e3:.2f} ms ({det_s / fast_s:.2f}x)")
    return {"rows": rows, "query_lens": len(query_lens), "cached_tokens": prefix, "ops": times}


def ratios(times: dict[str, float]) -> dict[str, float]:
    return {
        "deterministic_over_fast": times["deterministic"] / times["fast"],
        "fast_over_hf": times["fast"] / times["hf"],
        "deterministic_over_hf": times["deterministic"] / times["hf"],
    }


def fmt(times: dict[str, float]) -> str:
    r = ratios(times)
    return (
        f"det {times['deterministic'] * 1e3:.1f} ms, fast {times['fast'] * 1e3:.1f} ms, hf {times['hf'] * 1e3:.1f} ms"
        f" | det/fast {r['deterministic_over_fast']:.2f}x, det/hf {r['deterministic_over_hf']:.2f}x"
    )


if __name__ == "__main__":
    main()
