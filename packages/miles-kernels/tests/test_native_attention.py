"""The native CPU attention (miles_kernels/native, attention.cpp): numerics against float64, rows invariant alone, in
any batch and at any thread count, bfloat16 pages, its backward, the errors a caller gets, the model's gradients
through it, and the trainer's form that reads its tokens' K / V rows in place with the page store's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_kernels import KernelConfig, native
from miles_kernels.ops.attention import packed_attention
from miles_kernels.ops.attention_batch import build_packed_batch, num_pages_needed
from miles_kernels.ops.kv_pages import read_tokens, scratch_pages
from miles_kernels.testing import random_model, tiny_config

NATIVE_ALL = KernelConfig(linear_backend="native", attention_backend="native", norm_backend="native")
TORCH_BACKENDS = KernelConfig(linear_backend="torch-tiled", attention_backend="torch-blocked", norm_backend="torch")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert native.status() is True, f"the native kernels must build and load on this machine: {native.status()}"


class AttentionCase:
    """Sequences with cached prefixes in a shuffled page store (GQA, a page of 8 keys, a head dim that is no multiple
    of the 16 lanes), every query token of each sequence's new part, and the float64 reference."""

    def __init__(self, seed: int, window: int | None, page: int = 8, dtype: torch.dtype = torch.float32) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.page, self.window = 6, 2, 40, page, window
        prefixes, news = [0, 13, 30, 2], [21, 1, 9, 40]
        blocks = [-(-(p + n) // page) for p, n in zip(prefixes, news, strict=True)]
        order = (torch.randperm(sum(blocks), generator=generator) + 1).tolist()  # page 0 is the null page
        self.tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int64)
        for s, count in enumerate(blocks):
            self.tables[s, :count] = torch.tensor(order[:count])
            order = order[count:]
        shape = (sum(blocks) + 1, self.kv_heads, page, self.head_dim)
        self.k = torch.randn(shape, generator=generator).to(dtype)
        self.v = torch.randn(shape, generator=generator).to(dtype)
        self.positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, news, strict=True)])
        self.seqs = torch.cat([torch.full((n,), s) for s, n in enumerate(news)])
        self.query_starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
        self.q = torch.randn(len(self.positions), self.heads, self.head_dim, generator=generator)
        self.grad = torch.randn(self.q.shape, generator=generator)
        self.scale = self.head_dim**-0.5

    def forward(self, rows: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        return native.native_attention(self.q[rows], self.k, self.v, self.positions[rows], self.seqs[rows],
                                       self.tables, self.scale, self.window)  # fmt: skip

    def backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = self.forward()
        return native.native_attention_backward(
            self.q, self.k, self.v, self.positions, self.seqs, self.tables, self.query_starts, self.scale,
            self.window, out, lse, self.grad,
        )  # fmt: skip

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """float64 softmax attention, row by row, and its autograd gradients (dq, dK pages, dV pages)."""
        q, k, v = (t.double().requires_grad_() for t in (self.q, self.k, self.v))
        group = self.heads // self.kv_heads
        rows = []
        for t, (pos, seq) in enumerate(zip(self.positions.tolist(), self.seqs.tolist(), strict=True)):
            keys = torch.arange(pos + 1)
            if self.window is not None:
                keys = keys[keys > pos - self.window]
            pages, offsets = self.tables[seq, keys // self.page], keys % self.page
            k_rows = k[pages, :, offsets].repeat_interleave(group, dim=1)  # (keys, H, D)
            v_rows = v[pages, :, offsets].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("lhd,hd->hl", k_rows, q[t]) * self.scale, dim=-1)
            rows.append(torch.einsum("hl,lhd->hd", weights, v_rows))
        out = torch.stack(rows)
        out.backward(self.grad.double())
        return out.detach(), q.grad, k.grad, v.grad


def attention_case(seed: int, window: int | None, page: int = 8) -> AttentionCase:
    return AttentionCase(seed, window, page)


@pytest.mark.parametrize(("window", "page"), [(None, 8), (5, 8), (None, 32), (19, 32)])
def test_attention_matches_float64_and_rows_are_invariant(window: int | None, page: int) -> None:
    case = attention_case(seed=0, window=window, page=page)
    out, lse = case.forward()
    want, *_ = case.reference()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    for t in range(len(case.positions)):  # each row alone: the same bits
        alone, alone_lse = case.forward(slice(t, t + 1))
        assert torch.equal(alone[0], out[t]) and torch.equal(alone_lse[0], lse[t]), f"row {t}"
    shuffled = torch.randperm(len(case.positions), generator=torch.Generator().manual_seed(1))
    assert torch.equal(case.forward(shuffled)[0], out[shuffled])
    torch.set_num_threads(1)
    try:
        assert torch.equal(case.forward()[0], out)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_backward_matches_float64_and_repeats(window: int | None) -> None:
    case = attention_case(seed=2, window=window)
    dq, dk, dv = case.backward()
    _, want_dq, want_dk, want_dv = case.reference()
    for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(case.backward(), (dq, dk, dv), strict=True))  # run to run


def test_attention_reads_bfloat16_pages_exactly() -> None:
    case = AttentionCase(seed=3, window=None, dtype=torch.bfloat16)
    out, _ = case.forward()
    case.k, case.v = case.k.float(), case.v.float()  # the same values in float32
    assert torch.equal(out, case.forward()[0])


def test_attention_refuses_bad_operands_by_name() -> None:
    case = attention_case(seed=0, window=None)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        native.native_attention(case.q[:, :5], case.k, case.v, case.positions, case.seqs, case.tables, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        native.native_attention(case.q, case.k, case.v.double(), case.positions, case.seqs, case.tables, 1.0)


@pytest.mark.parametrize("kind", ["dense", "qwen2", "deepseek"])
def test_model_gradients_through_the_native_attention(kind: str) -> None:
    """The trainer's packed forward with a shared prompt (copy writes of its partial page) on the native backends:
    the same gradients as the torch backends, to float32 rounding; run to run the same bits."""
    window = {"sliding_window": 5, "layer_types": ("full_attention", "sliding_attention")}
    config = tiny_config(kind, **(window if kind == "qwen2" else {}))

    def grads(kernel: KernelConfig) -> list[torch.Tensor]:
        model = random_model(config, kernel, seed=0)
        tokens = torch.cat([torch.arange(13) % config.vocab_size, torch.arange(6) + 3, torch.arange(4) + 9])
        batch = build_packed_batch([13, 6, 4], kernel.page_size, kernel.attention_query_tile, parents=[None, 0, 0])
        model.logits(model.forward_hidden(tokens, batch)).float().square().mean().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    ours = grads(NATIVE_ALL)
    assert all(torch.equal(a, b) for a, b in zip(grads(NATIVE_ALL), ours, strict=True))
    for a, b in zip(grads(TORCH_BACKENDS), ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("page", "window"), [(4, None), (16, None), (16, 3), (32, 9)])
def test_packed_attention_reads_the_tokens_in_place_with_the_page_stores_bits(page: int, window: int | None) -> None:
    """The trainer's native attention reads K / V as its tokens' rows (`AttentionBatch.slot_rows`) instead of building
    a page store: the output, lse and gradients are, bit for bit, those of the page store the batch describes
    (shared prompts' copy writes included: a copy's slot sums its reader's chain, added to the token's in order)."""
    generator = torch.Generator().manual_seed(page + (window or 0))
    lens = [23, 9, 30, 1, 17, 12, 5]
    parents = [None, 0, 0, None, None, 4, 4]  # two prompts, each continued by two responses
    batch = build_packed_batch(lens, page, 4, parents=parents)
    n, pages = sum(lens), num_pages_needed(batch)
    q, k, v = (torch.randn(n, h, 40, generator=generator, requires_grad=True) for h in (6, 2, 2))
    grad = torch.randn(n, 6, 40, generator=generator)
    out = packed_attention(q, k, v, batch, 0.15, NATIVE_ALL, window)
    out.backward(grad)

    k_pages, v_pages = scratch_pages(k.detach(), v.detach(), batch, pages)
    args = (batch.positions_N, batch.token_seqs(), batch.block_tables_SB)
    want, lse = native.native_attention(q.detach(), k_pages, v_pages, *args, 0.15, window)
    starts = F.pad(batch.query_lens_S.cumsum(0), (1, 0))
    dq, dk_pages, dv_pages = native.native_attention_backward(
        q.detach(), k_pages, v_pages, *args, starts, 0.15, window, want, lse, grad
    )
    assert batch.copy_tokens_C.numel() > 0
    assert torch.equal(out, want) and torch.equal(q.grad, dq)
    assert torch.equal(k.grad, read_tokens(dk_pages, batch)) and torch.equal(v.grad, read_tokens(dv_pages, batch))
    with torch.no_grad():  # the no-grad forward (a reference model's log-probs) reads the rows too
        assert torch.equal(packed_attention(q, k, v, batch, 0.15, NATIVE_ALL, window), want)
