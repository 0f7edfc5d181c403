"""CPU numerics: the facts about torch that miles' deterministic mode is built on, re-checked under the locked
torch. If one of these starts failing after a torch upgrade, update docs/true-on-policy.md and the ops.

- plain `x @ W.T` is NOT batch-invariant (a row alone differs from the same row in a batch);
- SDPA with one query (decode) differs from the last row of a prefill over the same keys (fp32);
- the same reshape can give a strided view (one tile) or a copy (many); on some CPUs bmm's bits follow the layout,
  so the ops make operands contiguous, and contiguous operands give one tile and many the same bits;
- fixed-tile bmm, row-wise log_softmax / sum / rms-style mean are invariant;
- elementwise `torch.sigmoid` / `F.silu` of rows narrower than the SIMD loop are NOT (the scalar tail loop).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_kernels import tiled_matmul


def rows_alone_vs_batched(fn, x: torch.Tensor, num_rows: int) -> list[int]:
    full = fn(x[:num_rows])
    return [i for i in range(num_rows) if not torch.equal(fn(x[i : i + 1])[0], full[i])]


def test_plain_matmul_is_not_batch_invariant() -> None:
    # fp32 only: under torch 2.14.1 on this CPU the bf16 path happened to be invariant for M = 1..300, which is
    # a property of today's oneDNN dispatch, not a guarantee; miles tiles bf16 too.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 512, generator=generator)
    x = torch.randn(64, 512, generator=generator)
    variant = rows_alone_vs_batched(lambda rows: rows @ weight.T, x, 64)
    assert variant, "plain matmul became batch-invariant under this torch: revisit docs/true-on-policy.md"


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_bmm_is_batch_invariant(num_threads: int, dtype: torch.dtype) -> None:
    torch.set_num_threads(num_threads)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1536, 512, generator=generator).to(dtype)
    x = torch.randn(200, 512, generator=generator).to(dtype)
    reference = tiled_matmul(x, weight, 16)
    for num_rows in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64, 129):
        for offset in (0, 3, 50):
            got = tiled_matmul(x[offset : offset + num_rows], weight, 16)
            assert torch.equal(got, reference[offset : offset + num_rows]), (num_rows, offset)


def test_decode_sdpa_differs_from_prefill_last_row() -> None:
    generator = torch.Generator().manual_seed(2)
    differs = 0
    for trial in range(8):
        length = 37 + 11 * trial
        q, k, v = (torch.randn(1, 4, length, 64, generator=generator) for _ in range(3))
        prefill = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1]
        decode = F.scaled_dot_product_attention(q[:, :, -1:], k, v)[:, :, 0]
        differs += int(not torch.equal(prefill, decode))
    assert differs, "SDPA decode now equals the prefill row: revisit docs/true-on-policy.md"


def test_contiguous_operands_give_bmm_one_path_for_one_tile_or_many() -> None:
    """The same reshape gives a strided view for one tile and a copy for many. Whether bmm's bits follow that layout
    depends on the CPU (they differed on the machine this was first measured on, not on an AVX-512 one), so
    the attention makes its operands contiguous; with contiguous operands one tile and many agree everywhere."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(23, 2, 8, 16, generator=generator)
    k = torch.randn(23, 8, 2, 16, generator=generator).permute(0, 2, 3, 1)
    assert not k[0:1].reshape(-1, 16, 8).is_contiguous() and not k.is_contiguous()  # one tile: a strided view
    many = torch.bmm(q.reshape(-1, 8, 16), k.reshape(-1, 16, 8))  # reshape copies
    for a in range(23):
        one = torch.bmm(q[a : a + 1].reshape(-1, 8, 16).contiguous(), k[a : a + 1].reshape(-1, 16, 8).contiguous())
        assert torch.equal(one, many[2 * a : 2 * a + 2]), a


@pytest.mark.parametrize("num_threads", [1, 2])
def test_rowwise_reductions_are_invariant(num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64, 8192, generator=generator)
    for fn in (
        lambda r: torch.log_softmax(r, dim=-1),
        lambda r: r.sum(-1, keepdim=True),
        lambda r: r.pow(2).mean(-1, keepdim=True),
    ):
        assert rows_alone_vs_batched(fn, x, 64) == []


def test_elementwise_sigmoid_and_silu_of_narrow_rows_are_not_batch_invariant() -> None:
    """The last partial SIMD chunk of a tensor runs scalar code (std::exp) with other bits than the vector code
    (SLEEF): an (N, 8) tensor's rows change with N. miles pads rows to whole vectors (ops/activation.py)."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for fn in (torch.sigmoid, F.silu):
        full = fn(x)
        assert any(not torch.equal(fn(x[:rows]), full[:rows]) for rows in range(1, 64)), fn
