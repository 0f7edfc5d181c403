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


def test_the_matmul_backward_is_the_plain_gemms() -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(9, 48, generator=generator, device=DEVICE, requires_grad=True)
    weight = torch.randn(20, 48, generator=generator, device=DEVICE, requires_grad=True)
    grad = torch.randn(9, 20, generator=generator, device=DEVICE)
    matmul.matmul(x, weight).backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight.detach())
    torch.testing.assert_close(weight.grad, grad.t() @ x.detach())


def test_the_matmul_refuses_mixed_dtypes_and_handles_empty_batches() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="give both the kernel dtype"):
        matmul.matmul(torch.randn(2, 16, device=DEVICE, dtype=torch.bfloat16), weight)
    assert matmul.matmul(torch.randn(0, 16, device=DEVICE), weight).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 2500])  # one chunk; several chunks with a partial last one
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
    `auto` keeps torch-tiled until the kernel's GPU speed is measured."""
    from miles_kernels import KernelConfig
    from miles_kernels.ops.linear import linear

    config = KernelConfig(linear_backend="triton", linear_tile=16)
    assert config.resolved_backends()["linear"] == "triton"
    assert KernelConfig().resolved_backends()["linear"] == "torch-tiled"
    assert config.fingerprint() != KernelConfig(linear_tile=16).fingerprint()
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(2, 5, 48, generator=generator, device=DEVICE)
    weight, bias = torch.randn(24, 48, generator=generator, device=DEVICE), torch.randn(24, device=DEVICE)
    got = linear(x, weight, config, bias)
    assert torch.equal(got, (matmul.matmul(x.reshape(10, 48), weight, 16) + bias).reshape(2, 5, 24))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
