"""The Triton kernels (miles_kernels.triton_ops): each equals its torch reference within tolerance, and a row's
result is bitwise the same alone or inside batches of many sizes, at many offsets.

On this CPU they run in Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets before anything imports
Triton where there is no CUDA device): that proves the schedule (a row's arithmetic and its order do not depend on
the batch), not a GPU's bits. Where CUDA is present the same tests run the compiled kernels on it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton comes with torch's Linux wheels")

from miles_kernels.ops.norm import rms_norm as torch_rms_norm
from miles_kernels.ops.sampling import full_logprobs, token_logprobs
from miles_kernels.triton_ops import logsoftmax, matmul, norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the result's scale


def _rows_stay_the_same(op, x: torch.Tensor, rows: tuple[int, ...] = (0, 16, 36)) -> None:
    """`op` of each of `rows` alone equals it inside the whole batch and inside batches of other sizes at other
    offsets (random neighbours), bit for bit."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    whole = op(x)
    for r in rows:
        assert torch.equal(op(x[r : r + 1])[0], whole[r]), f"row {r}: alone differs from the whole batch"
        for before, after in ((1, 2), (17, 0), (9, 30)):
            noise = torch.randn(before + after, *x.shape[1:], generator=generator, device=DEVICE).to(x.dtype)
            batch = torch.cat((noise[:before], x[r : r + 1], noise[before:]))
            assert torch.equal(op(batch)[before], whole[r]), f"row {r} at offset {before} of {len(batch)} differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_matmul_is_x_times_w_transposed_and_batch_invariant(dtype: torch.dtype) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(37, 100, generator=generator, device=DEVICE).to(dtype)  # K, N not multiples of the blocks
    weight = torch.randn(70, 100, generator=generator, device=DEVICE).to(dtype) / 10
    got = matmul.matmul(x, weight, tile=16)
    want = (x.float() @ weight.float().t()).to(dtype)
    assert got.dtype == dtype and got.shape == (37, 70)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 3)
    _rows_stay_the_same(lambda rows: matmul.matmul(rows, weight, tile=16), x)
    strided = torch.randn(100, 37, generator=generator, device=DEVICE).to(dtype).t()  # a transposed view
    assert torch.equal(matmul.matmul(strided, weight), matmul.matmul(strided.contiguous(), weight))


def test_the_matmul_backward_runs_the_kernel_and_repeats_its_bits() -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(9, 48, generator=generator, device=DEVICE, requires_grad=True)
    weight = torch.randn(20, 48, generator=generator, device=DEVICE, requires_grad=True)
    grad = torch.randn(9, 20, generator=generator, device=DEVICE)
    grads = []
    for _ in range(2):
        x.grad = weight.grad = None
        matmul.matmul(x, weight).backward(grad)
        grads.append((x.grad, weight.grad))
    torch.testing.assert_close(grads[0][0], grad @ weight.detach())
    torch.testing.assert_close(grads[0][1], grad.t() @ x.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True)), "not the same bits run to run"


def test_the_matmul_refuses_mixed_dtypes_and_handles_empty_batches() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="give both the kernel dtype"):
        matmul.matmul(torch.randn(2, 16, device=DEVICE, dtype=torch.bfloat16), weight)
    assert matmul.matmul(torch.randn(0, 16, device=DEVICE), weight).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1100])  # one chunk; two chunks, the last partial
def test_the_rms_norm_matches_the_torch_op_and_is_batch_invariant(dtype: torch.dtype, hidden: int) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(37, hidden, generator=generator, device=DEVICE).to(dtype) * 3
    weight = torch.randn(hidden, generator=generator, device=DEVICE).to(dtype)
    got = norm.rms_norm(x, weight, 1e-6)
    want = torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    _rows_stay_the_same(lambda rows: norm.rms_norm(rows, weight, 1e-6), x)
    mixed = norm.rms_norm(x, weight.float(), 1e-6)  # a float32 weight on 16-bit activations, as torch promotes
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, torch_rms_norm(x, weight.float(), 1e-6), rtol=TOLERANCE[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_log_softmax_keeps_the_log_prob_contract_and_is_batch_invariant(dtype: torch.dtype) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    vocab = 3000  # three chunks, the last partial
    logits = (torch.randn(37, vocab, generator=generator, device=DEVICE) * 4).to(dtype)
    logits[3, :] = -torch.inf  # a row masked to one token (grammar)
    logits[3, 7] = 2.0
    temperatures = torch.rand(37, 1, generator=generator, device=DEVICE) + 0.5
    tokens = torch.randint(0, vocab, (37,), generator=generator, device=DEVICE)
    tokens[3] = 7
    got = logsoftmax.token_logprobs(logits, tokens, temperatures)
    torch.testing.assert_close(got, token_logprobs(logits, tokens, temperatures), rtol=1e-5, atol=1e-5)
    assert got[3].item() == 0.0
    full = logsoftmax.full_logprobs(logits[:5], temperatures[:5])
    torch.testing.assert_close(full, full_logprobs(logits[:5], temperatures[:5]), rtol=1e-5, atol=1e-5)
    rows = torch.cat((logits.float(), temperatures, tokens[:, None].float()), dim=1)  # one tensor per row

    def per_row(batch: torch.Tensor) -> torch.Tensor:
        return logsoftmax.token_logprobs(batch[:, :vocab].to(dtype), batch[:, -1].long().clamp(0, vocab - 1),
                                         batch[:, vocab : vocab + 1].abs() + 0.5)  # fmt: skip

    _rows_stay_the_same(per_row, rows, rows=(0, 3, 16, 36))


def test_the_kernels_say_where_they_run() -> None:
    from miles_kernels.triton_ops import triton_available

    assert triton_available() is True  # here: CUDA, or the interpreter this module asked for
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            assert "TRITON_INTERPRET=1" in str(triton_available())
            with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
                matmul.matmul(torch.randn(2, 16), torch.randn(8, 16))
        finally:
            os.environ["TRITON_INTERPRET"] = "1"


def test_a_deterministic_linear_layer_can_run_the_triton_matmul() -> None:
    """`kernel.linear_backend=triton` runs this kernel behind the linear op (and names it in the fingerprint);
    `auto` does not pick it until the kernel's GPU speed is measured."""
    from miles_kernels import KernelConfig, kernel_fingerprint, resolved_backends
    from miles_kernels.ops.linear import linear

    config = KernelConfig(linear_backend="triton", linear_tile=16)
    assert resolved_backends(config)["linear"] == "triton"
    assert resolved_backends(KernelConfig())["linear"] != "triton"
    assert kernel_fingerprint(config) != kernel_fingerprint(KernelConfig(linear_tile=16))
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(2, 5, 48, generator=generator, device=DEVICE)
    weight, bias = torch.randn(24, 48, generator=generator, device=DEVICE), torch.randn(24, device=DEVICE)
    got = linear(x, weight, config, bias)
    assert torch.equal(got, (matmul.matmul(x.reshape(10, 48), weight, 16) + bias).reshape(2, 5, 24))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def _attention_inputs(config, lengths: list[int], seed: int = 0):
    """A random paged K/V store holding sequences of `lengths` keys (heads 4 query / 2 KV, head dim 16), and the
    queries of every position."""
    from miles_kernels.ops.attention_batch import build_packed_batch

    generator = torch.Generator().manual_seed(seed)
    batch = build_packed_batch(lengths, config.page_size, config.attention_query_tile)
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=generator)
    k, v = torch.randn(total, 2, 16, generator=generator), torch.randn(total, 2, 16, generator=generator)
    return batch, q, k, v


@pytest.mark.parametrize("split_keys", [1024, 8], ids=["one-split", "splits-of-8-keys"])
@pytest.mark.parametrize("window", [None, 7])
def test_the_attention_matches_the_blocked_attention_and_is_the_same_however_computed(
    window, split_keys, monkeypatch
) -> None:
    """The Triton attention equals the torch blocked attention within float32 rounding, and a token's output is the
    same bits in a packed forward of its sequence alone, in a batch with others, and in prefill / chunk / decode
    steps over a paged cache (the engine's way); also where a token's keys are walked in splits merged after
    (splits of 8 keys here, so up to two splits; with the window, splits wholly before it)."""
    from miles_kernels import KernelConfig
    from miles_kernels.ops.attention import packed_attention
    from miles_kernels.triton_ops import attention as triton_attention

    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", split_keys)

    config = KernelConfig(attention_backend="triton", page_size=4)
    lengths = [9, 1, 14]
    batch, q, k, v = _attention_inputs(config, lengths)
    got = packed_attention(q, k, v, batch, 0.25, config, window)
    blocked = packed_attention(q, k, v, batch, 0.25, KernelConfig(page_size=4), window)
    torch.testing.assert_close(got, blocked, rtol=1e-5, atol=1e-5)
    starts = [0, 9, 10]
    for seq, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        alone_batch, _, _, _ = _attention_inputs(config, [length])
        rows = slice(start, start + length)
        alone = packed_attention(q[rows], k[rows], v[rows], alone_batch, 0.25, config, window)
        assert torch.equal(alone, got[rows]), f"sequence {seq}: alone differs from the batch"
    # the engine's way for the last sequence: a paged cache (pages out of order) filled by a prefill of 5, a chunk
    # of 6, then three decode steps
    from miles_kernels.ops.attention import attention
    from miles_kernels.ops.attention_batch import build_attention_batch
    from miles_kernels.ops.kv_pages import write_kv

    seq_rows = slice(10, 24)
    k_pages, v_pages = torch.zeros(8, 2, 4, 16), torch.zeros(8, 2, 4, 16)
    pages, done = [3, 1, 6, 2], 0
    for step in (5, 6, 1, 1, 1):
        chunk = slice(done, done + step)
        engine = build_attention_batch([step], [done], [pages], 4, config.attention_query_tile)
        write_kv(k_pages, v_pages, k[seq_rows][chunk], v[seq_rows][chunk], engine)
        step_out = attention(q[seq_rows][chunk], k_pages, v_pages, engine, 0.25, config, window)
        assert torch.equal(step_out, got[seq_rows][chunk]), f"tokens {done}..{done + step - 1} differ from prefill"
        done += step


def test_the_trainers_triton_attention_has_the_blocked_attentions_gradient() -> None:
    from miles_kernels import KernelConfig
    from miles_kernels.ops.attention import packed_attention

    config = KernelConfig(attention_backend="triton", page_size=4)
    batch, q, k, v = _attention_inputs(config, [6, 11])
    grad = torch.randn(17, 4, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for backend in ("triton", "torch-blocked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = packed_attention(*leaves, batch, 0.25, KernelConfig(attention_backend=backend, page_size=4))
        out.backward(grad)
        results.append((out.detach(), [t.grad for t in leaves]))
    (triton_out, triton_grads), (blocked_out, blocked_grads) = results
    torch.testing.assert_close(triton_out, blocked_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(triton_grads, blocked_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["dense", "moe"])  # sliding windows: the attention tests
def test_a_model_on_the_triton_kernels_gives_the_trainer_the_engines_bits(kind: str) -> None:
    """The model on the Triton matmul, attention and RMSNorm (`linear_backend` / `attention_backend` /
    `norm_backend` = triton): the engine's schedule (prefill, chunks, decode steps with sequences joining and
    leaving) gives every row the bits of the trainer's packed forward, and a sequence's rows do not depend on the
    others packed with it."""
    from miles_kernels import KernelConfig
    from miles_kernels.testing import PagedRunner, packed_logits, random_model, tiny_config

    kernel = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=16, moe_tile=4,
                          linear_backend="triton", attention_backend="triton", norm_backend="triton")  # fmt: skip
    config = tiny_config(kind)
    model = random_model(config, kernel, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (13, 3, 21)]
    continuations = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (3, 4, 2)]
    full = [torch.cat([p, c]) for p, c in zip(prompts, continuations, strict=True)]
    reference = packed_logits(model, full)
    assert torch.equal(packed_logits(model, [full[2]])[0], reference[2]), "a sequence alone differs"
    runner = PagedRunner(model)
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    for step in ({0: prompts[0], 1: prompts[1], 2: prompts[2][:9]}, {2: prompts[2][9:]}):
        for seq, logits in runner.step(step).items():
            outputs[seq].append(logits)
    for t in range(4):
        step = {s: continuations[s][t : t + 1] for s in range(3) if t < len(continuations[s])}
        for seq, logits in runner.step(step).items():
            outputs[seq].append(logits)
    for seq in range(3):
        got = torch.cat(outputs[seq])
        assert torch.equal(got, reference[seq]), f"seq {seq}: the engine's rows differ from the trainer's"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_grouped_expert_gemm_is_each_experts_product_and_batch_invariant(dtype: torch.dtype) -> None:
    """Rows grouped by expert times their own expert's weight, in one launch: equal to each group's product, and a
    row's result the same bits whichever rows and how many share its expert, and wherever its group starts."""
    from miles_kernels.triton_ops.grouped import grouped_matmul

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [(torch.randn(40, 48, generator=generator, device=DEVICE) / 7).to(dtype) for _ in range(4)]
    counts = [5, 0, 21, 3]
    x = torch.randn(sum(counts), 48, generator=generator, device=DEVICE).to(dtype)
    got = grouped_matmul(x, counts, weights, tile=16)
    starts = [0, 5, 5, 26]
    for expert, (start, count) in enumerate(zip(starts, counts, strict=True)):
        rows = slice(start, start + count)
        want = (x[rows].float() @ weights[expert].float().t()).to(dtype)
        torch.testing.assert_close(got[rows].float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 3)
    row = x[7:8]  # expert 2's third row
    assert torch.equal(grouped_matmul(row, [0, 0, 1, 0], weights, 16)[0], got[7]), "alone differs"
    noise = torch.randn(30, 48, generator=generator, device=DEVICE).to(dtype)
    regrouped = torch.cat((noise[:9], noise[9:12], row, noise[12:30]))  # expert 2 now has 19 rows, the row 4th
    assert torch.equal(grouped_matmul(regrouped, [9, 0, 19, 3], weights, 16)[12], got[7]), "among others differs"


def test_the_grouped_expert_gemm_has_each_experts_gradient() -> None:
    from miles_kernels.triton_ops.grouped import grouped_matmul

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(8, 16, generator=generator, requires_grad=True) for _ in range(3)]
    x = torch.randn(7, 16, generator=generator, requires_grad=True)
    counts, grad = [3, 0, 4], torch.randn(7, 8, generator=generator)
    grouped_matmul(x, counts, weights, 16).backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = [w.detach().clone().requires_grad_() for w in weights]
    torch.cat((x_ref[:3] @ w_ref[0].t(), x_ref[3:] @ w_ref[2].t())).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for got, want in zip(weights, w_ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad if want.grad is not None else torch.zeros_like(got))


def test_a_deterministic_rms_norm_can_run_the_triton_kernel_with_the_torch_ops_gradient() -> None:
    from miles_kernels import KernelConfig, resolved_backends
    from miles_kernels.ops.norm import rms_norm

    config = KernelConfig(norm_backend="triton")
    assert resolved_backends(config)["rms_norm"] == "triton"
    assert resolved_backends(KernelConfig())["rms_norm"] != "triton"
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 96, generator=generator), torch.randn(96, generator=generator)
    assert torch.equal(rms_norm(x, weight, 1e-6, config), norm.rms_norm(x, weight, 1e-6))
    grad = torch.randn(5, 96, generator=generator)
    results = []
    for kernel in (config, None):
        leaves = [t.clone().requires_grad_() for t in (x, weight)]
        rms_norm(*leaves, 1e-6, kernel).backward(grad)
        results.append([t.grad for t in leaves])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def test_the_sampler_kernel_draws_the_torch_samplers_tokens_batch_invariantly() -> None:
    """The fused Gumbel-max kernel: the torch sampler's noise (so its tokens), filtered tokens never drawn, and a
    row's token the same alone or in a batch."""
    from miles_kernels.ops.sampling import RowSampling, sample
    from miles_kernels.triton_ops.sampling import gumbel_argmax

    generator = torch.Generator().manual_seed(0)
    vocab = 2500  # three chunks, the last partial
    logits = torch.randn(24, vocab, generator=generator) * 2
    rows = [RowSampling(temperature=0.5 + 0.1 * i, seed=1000 + i, position=3 * i) for i in range(24)]
    got = gumbel_argmax(logits, rows)
    assert torch.equal(got, sample(logits, rows))
    masked = logits.clone()
    masked[:, : vocab - 3] = float("-inf")  # a filter that keeps the last three tokens
    assert bool((gumbel_argmax(masked, rows) >= vocab - 3).all())
    for r in (0, 11, 23):
        assert torch.equal(gumbel_argmax(logits[r : r + 1], rows[r : r + 1]), got[r : r + 1])
    assert torch.equal(gumbel_argmax(logits[5:20], rows[5:20]), got[5:20])


def test_every_kernel_compiles_for_a_hopper_gpu() -> None:
    """What the interpreter cannot check: each kernel compiled ahead of time for sm_90 (H100 / H200), float32 and
    bfloat16, by Triton's own compiler and ptxas (no GPU needed), in a process without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("sm_90 cubin") == 14, done.stdout
