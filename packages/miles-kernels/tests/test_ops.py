"""CPU numerics: op-level references and invariance (linear, RoPE, attention, MoE routing and experts).

References are independent: `F.linear`, `F.scaled_dot_product_attention`, and the Hugging Face Qwen3-MoE
router/expert formulas written out here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_kernels import (
    KernelConfig,
    apply_rope,
    attention,
    build_attention_batch,
    build_packed_batch,
    experts_forward,
    inv_frequencies,
    linear,
    resolved_backends,
    rope_cos_sin,
    select_experts,
)
from miles_kernels.ops.attention_batch import num_pages_needed
from miles_kernels.ops.linear import fixed_rows_matmul, grouped_bmm, invariant_bmm
from miles_kernels.testing import random_model, tiny_config

DET = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)  # auto: the native kernels
DET_TORCH = DET.model_copy(update={"linear_backend": "torch-tiled", "attention_backend": "torch-blocked",
                                   "norm_backend": "torch"})  # fmt: skip
FAST = DET.model_copy(update={"mode": "fast"})
FAST_HYBRID = FAST.model_copy(update={"attention_backend": "torch-hybrid"})


def test_linear_matches_f_linear_in_both_modes() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 32, generator=generator)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    for config in (DET, FAST):
        torch.testing.assert_close(linear(x, weight, config, bias), F.linear(x, weight, bias), rtol=0, atol=1e-5)
    assert linear(x[:0], weight, DET).shape == (0, 7, 48)


def test_linear_gradients_match_f_linear() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(10, 32, generator=generator, requires_grad=True)
    weight = torch.randn(48, 32, generator=generator, requires_grad=True)
    linear(x, weight, DET).square().sum().backward()
    gx, gw = x.grad, weight.grad
    x.grad = weight.grad = None
    F.linear(x, weight).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-4)


def test_rope_matches_reference_rotation() -> None:
    x = torch.randn(5, 2, 8)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    cos, sin = rope_cos_sin(positions, inv_frequencies(8, 10_000.0), torch.float32)
    got = apply_rope(x, cos, sin)
    # Reference: rotate each (i, i + d/2) pair by angle position * theta^(-2i/d).
    for n, pos in enumerate(positions.tolist()):
        for i in range(4):
            angle = torch.tensor(pos * 10_000.0 ** (-2 * i / 8), dtype=torch.float64)
            a, b = x[n, :, i].double(), x[n, :, i + 4].double()
            torch.testing.assert_close(got[n, :, i].double(), a * angle.cos() - b * angle.sin(), atol=1e-4, rtol=0)
            torch.testing.assert_close(got[n, :, i + 4].double(), b * angle.cos() + a * angle.sin(), atol=1e-4, rtol=0)


def packed_attention(config: KernelConfig, q, k, v, lens: list[int]) -> torch.Tensor:
    batch = build_packed_batch(lens, config.page_size, config.attention_query_tile)
    shape = (num_pages_needed(batch), k.shape[1], config.page_size, k.shape[2])  # head-major pages
    where = (batch.write_pages_N[:, None], torch.arange(k.shape[1])[None, :], batch.write_offsets_N[:, None])
    k_pages = torch.zeros(shape).index_put(where, k)
    v_pages = torch.zeros(shape).index_put(where, v)
    return attention(q, k_pages, v_pages, batch, q.shape[-1] ** -0.5, config)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_matches_sdpa(group: int) -> None:
    generator = torch.Generator().manual_seed(group)
    lens = [1, 9, 30, 8]
    num_kv, dim = 2, 16
    q = torch.randn(sum(lens), num_kv * group, dim, generator=generator)
    k = torch.randn(sum(lens), num_kv, dim, generator=generator)
    v = torch.randn(sum(lens), num_kv, dim, generator=generator)
    reference = []
    for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None],
            ks.transpose(0, 1)[None],
            vs.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        reference.append(out[0].transpose(0, 1))
    for config in (DET, DET_TORCH, FAST, FAST_HYBRID):
        torch.testing.assert_close(packed_attention(config, q, k, v, lens), torch.cat(reference), rtol=0, atol=1e-5)


def sdpa_reference(q, k, v, lens: list[int], parents: list[int | None], window: int | None = None) -> torch.Tensor:
    """Causal attention per sequence in float64, a child sequence attending to its parent's keys first; with a
    `window`, each query sees only its last `window` keys (transformers' sliding-window mask)."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    outs = []
    for s, (start, length) in enumerate(zip(starts, lens, strict=True)):
        own = slice(start, start + length)
        parent = parents[s]
        keys = [slice(starts[parent], starts[parent] + lens[parent])] if parent is not None else []
        ks = torch.cat([k[r] for r in [*keys, own]]).double()
        vs = torch.cat([v[r] for r in [*keys, own]]).double()
        prefix = ks.shape[0] - length
        key_pos, query_pos = torch.arange(ks.shape[0])[None, :], prefix + torch.arange(length)[:, None]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(
            q[own].double().transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=mask, enable_gqa=True,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("det", [DET, DET_TORCH], ids=["native", "torch"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1])
def test_packed_attention_gradients_match_float64_reference(
    det: KernelConfig, group: int, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-written backward of each deterministic attention (per-token K/V, shared prompts' copy writes; the
    blocked one by one chunk of blocks or one block per chunk) against autograd through a float64 SDPA; its forward
    keeps its bits whatever the chunking."""
    import miles_kernels.ops.attention as attention_module
    import miles_kernels.ops.blocked_attention as blocked_attention_module

    generator = torch.Generator().manual_seed(group)
    lens, parents = [11, 3, 7, 1, 20], [None, 0, 0, None, 3]
    num_kv, dim = 2, 16
    inputs = [torch.randn(sum(lens), num_kv * h, dim, generator=generator) for h in (group, 1, 1)]
    weights = torch.randn(sum(lens), num_kv * group, dim, generator=generator)
    batch = build_packed_batch(lens, det.page_size, det.attention_query_tile, parents=parents)
    scale = dim**-0.5
    with torch.no_grad():
        whole = attention_module.packed_attention(*inputs, batch, scale, det)
    monkeypatch.setattr(blocked_attention_module, "MAX_CHUNK_BYTES", chunk_bytes)
    batch = build_packed_batch(lens, det.page_size, det.attention_query_tile, parents=parents)
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    out = attention_module.packed_attention(q, k, v, batch, scale, det)
    assert torch.equal(out.detach(), whole)
    (out * weights).sum().backward()
    q64, k64, v64 = (t.double().requires_grad_() for t in inputs)
    reference = sdpa_reference(q64, k64, v64, lens, parents)
    torch.testing.assert_close(out.double(), reference.detach(), rtol=0, atol=1e-5)
    (reference * weights.double()).sum().backward()
    for got, want in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=1e-4)


@pytest.mark.parametrize("window", [1, 5, 8, 13])
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1])
def test_sliding_window_attention_and_gradients_match_float64_reference(
    window: int, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding-window attention (windows inside one page, exactly one, across several; rows whose first blocks lie
    wholly before their window): both modes' forwards (fast mode's SDPA path too: the 60-token sequence) and the
    deterministic backwards (native, and blocked chunked by many blocks or one), against float64 masked SDPA. The
    window changes the result (the reference without it differs)."""
    import miles_kernels.ops.attention as attention_module
    import miles_kernels.ops.blocked_attention as blocked_attention_module

    monkeypatch.setattr(blocked_attention_module, "MAX_CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(window)
    lens, parents = [11, 3, 60, 1, 20], [None, 0, None, None, 3]
    inputs = [torch.randn(sum(lens), h, 16, generator=generator) for h in (4, 2, 2)]
    weights = torch.randn(sum(lens), 4, 16, generator=generator)
    q64, k64, v64 = (t.double().requires_grad_() for t in inputs)
    reference = sdpa_reference(q64, k64, v64, lens, parents, window)
    assert (reference - sdpa_reference(q64, k64, v64, lens, parents)).abs().max() > 0.1
    (reference * weights.double()).sum().backward()
    for config in (DET, DET_TORCH, FAST, FAST_HYBRID):
        batch = build_packed_batch(lens, config.page_size, config.attention_query_tile, parents=parents)
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = attention_module.packed_attention(q, k, v, batch, 16**-0.5, config, window)
        torch.testing.assert_close(out.double(), reference.detach(), rtol=0, atol=1e-5)
        if config.is_deterministic:
            (out * weights).sum().backward()
            for got, want in ((q, q64), (k, k64), (v, v64)):
                torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=1e-4)


def test_attention_over_pages_is_differentiable() -> None:
    """`attention` over K/V pages that require grad (the op as an engine-side caller would differentiate it)."""
    generator = torch.Generator().manual_seed(3)
    lens = [5, 12]
    q, k, v = (torch.randn(17, 2, 8, generator=generator) for _ in range(3))
    batch = build_packed_batch(lens, DET.page_size, DET.attention_query_tile)
    pages = num_pages_needed(batch)
    where = (batch.write_pages_N[:, None], torch.arange(2)[None, :], batch.write_offsets_N[:, None])
    k64, v64 = k.double().requires_grad_(), v.double().requires_grad_()
    sdpa_reference(q, k64, v64, lens, [None, None]).sum().backward()
    for det in (DET, DET_TORCH):
        k_pages = torch.zeros(pages, 2, DET.page_size, 8).index_put(where, k).requires_grad_()
        v_pages = torch.zeros(pages, 2, DET.page_size, 8).index_put(where, v).requires_grad_()
        attention(q, k_pages, v_pages, batch, 8**-0.5, det).sum().backward()
        torch.testing.assert_close(k_pages.grad[where].double(), k64.grad, rtol=0, atol=1e-4)
        torch.testing.assert_close(v_pages.grad[where].double(), v64.grad, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gradients_match_float64_autograd(dtype: torch.dtype) -> None:
    """`rms_norm`'s hand-written backward against autograd through the formula in float64; its forward is the same
    with and without autograd."""
    from miles_kernels.ops.norm import rms_norm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(64, generator=generator)).to(dtype).requires_grad_()
    upstream = torch.randn(3, 5, 64, generator=generator).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(out, rms_norm(x, weight, 1e-6))
    (out * upstream).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    (reference * upstream.double()).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in ((x.grad, x64.grad), (weight.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("width", [128, 100])
def test_swiglu_gradients_are_autograds_bit_for_bit(width: int) -> None:
    """`swiglu` under autograd (`_SwiGLU`, one node) gives the forward and the gradients autograd
    computes through `silu(gate) * up`, bit for bit, on rows that need no padding (128) and rows that do (100)."""
    from miles_kernels.ops.activation import silu, swiglu

    generator = torch.Generator().manual_seed(0)
    gate, up, upstream = (torch.randn(9, width, generator=generator) for _ in range(3))
    fused = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    plain = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    out = swiglu(*fused)
    want = silu(plain[0]) * plain[1]
    assert out.grad_fn is not None and "SwiGLU" in type(out.grad_fn).__name__
    assert torch.equal(out, want)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    for got, expected in zip(fused, plain, strict=True):
        assert torch.equal(got.grad, expected.grad)
    with torch.no_grad():
        assert torch.equal(swiglu(gate, up), want)


@pytest.mark.parametrize("lens", [[3, 20, 1], [3, 60, 1]])
def test_fast_mode_attention_picks_blocked_for_short_chunks_and_sdpa_for_long(
    lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import miles_kernels.ops.attention as attention_module

    ran = []
    sdpa = attention_module._sdpa_attention
    monkeypatch.setattr(attention_module, "_sdpa_attention", lambda *args: ran.append("sdpa") or sdpa(*args))
    assert resolved_backends(FAST_HYBRID)["attention"] == "torch-hybrid"
    generator = torch.Generator().manual_seed(len(lens))
    q, k, v = (torch.randn(sum(lens), 2, 16, generator=generator) for _ in range(3))
    batch = build_packed_batch(lens, FAST.page_size, FAST.attention_query_tile)
    out = attention_module.packed_attention(q, k, v, batch, 16**-0.5, FAST_HYBRID)
    assert ran == (["sdpa"] if max(lens) >= attention_module.HYBRID_SDPA_FROM_TOKENS else [])
    reference = sdpa_reference(q, k, v, lens, [None] * len(lens))
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)


def test_attention_batch_validates_its_layout() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_batch([9], [0], [[1]], page_size=8, query_tile=4)
    with pytest.raises(ValueError, match="no query tokens"):
        build_attention_batch([0], [0], [[1]], page_size=8, query_tile=4)


def hf_router_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router as Hugging Face writes it: softmax in fp32, torch.topk, optional renormalization."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@pytest.mark.parametrize("normalize", [True, False])
def test_select_experts_matches_hf_router(normalize: bool) -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(5))
    ids, weights = select_experts(logits, 2, normalize, torch.float32)
    ref_ids, ref_weights = hf_router_reference(logits, 2, normalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-7)


def test_select_experts_breaks_ties_by_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    ids, _ = select_experts(logits, 2, True, torch.float32)
    assert ids.tolist() == [[1, 2], [0, 1]]


def make_experts(num_experts: int, hidden: int, inter: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(shape, generator=generator) * 0.2 for _ in range(num_experts)]
        for shape in ((inter, hidden), (inter, hidden), (hidden, inter))
    ]


def test_experts_match_reference_formula() -> None:
    gate, up, down = make_experts(6, 16, 24, seed=6)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(7))
    ids, weights = select_experts(torch.randn(20, 6), 2, True, torch.float32)
    reference = torch.zeros_like(x)
    for n in range(20):
        for slot in range(2):
            e = int(ids[n, slot])
            reference[n] += weights[n, slot] * (down[e] @ (F.silu(gate[e] @ x[n]) * (up[e] @ x[n])))
    for config in (DET, FAST):
        got = experts_forward(x, ids, weights, gate, up, down, config)
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)


def test_expert_output_does_not_depend_on_tokens_per_expert() -> None:
    """A token's MoE output is bitwise the same whether 0 or 200 other tokens chose its experts."""
    gate, up, down = make_experts(4, 32, 48, seed=8)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(201, 32, generator=generator)
    ids = torch.randint(0, 4, (201, 2), generator=generator)
    ids[:, 1] = (ids[:, 0] + 1) % 4
    weights = torch.rand(201, 2, generator=generator)
    everything = experts_forward(x, ids, weights, gate, up, down, DET)
    for n in (0, 5, 77, 200):
        alone = experts_forward(x[n : n + 1], ids[n : n + 1], weights[n : n + 1], gate, up, down, DET)
        assert torch.equal(alone[0], everything[n])
    crowd = ids.clone()
    crowd[:, 0], crowd[:, 1] = ids[0, 0], ids[0, 1]  # every token picks token 0's experts
    crowded = experts_forward(x, crowd, weights, gate, up, down, DET)
    assert torch.equal(crowded[0], everything[0])


def test_cuda_forms_of_the_batch_invariant_products() -> None:
    """The CUDA forms (exercised here on the CPU): `grouped_bmm` (calls of exactly `group` matrices, zero-padded)
    gives torch.bmm's result for every matrix, also for a transposed view and with gradients through the padding;
    `fixed_rows_matmul` (GEMMs of exactly `rows` rows) gives x @ W."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(37, 8, 16, generator=generator, requires_grad=True)
    b = torch.randn(37, 5, 16, generator=generator).transpose(1, 2)  # a strided view: copied to one layout
    for group in (1, 4, 16, 37, 64):
        assert torch.equal(grouped_bmm(a, b, group), torch.bmm(a, b.contiguous())), group
    (grad,) = torch.autograd.grad(grouped_bmm(a, b, 16).square().sum(), a)
    (want,) = torch.autograd.grad(torch.bmm(a, b.contiguous()).square().sum(), a)
    assert torch.equal(grad, want)
    assert invariant_bmm(a, b).shape == (37, 8, 5)
    x, weight = torch.randn(70, 16, generator=generator), torch.randn(5, 16, generator=generator)
    for rows in (1, 16, 64, 70, 128):
        got = fixed_rows_matmul(x, weight.t(), rows)
        assert got.shape == (70, 5)
        torch.testing.assert_close(got, x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_the_native_attention_never_builds_the_query_tiles() -> None:
    """The query tiles are the blocked attention's, built on first use: a forward on the native attention leaves them
    unbuilt (a decode step's batch of 64 sequences spent ~1 ms building them), one on the torch backends builds
    them."""
    config = tiny_config()
    ids = torch.arange(9) % config.vocab_size
    for kernel, builds_tiles in ((DET, False), (DET_TORCH, True)):
        batch = build_packed_batch([5, 4], kernel.page_size, kernel.attention_query_tile)
        random_model(config, kernel, seed=0).forward_hidden(ids, batch)
        assert ("tile_tokens" in batch._derived) is builds_tiles


def test_attention_batch_moves_to_a_device_once() -> None:
    batch = build_packed_batch([5, 3], page_size=4, query_tile=2)
    assert batch.to("cpu") is batch
    tiles = batch.tile_tokens_NT_Tq  # built on first use; a move takes them along
    moved = batch.to("meta")
    assert moved.positions_N.device.type == "meta" and moved.page_size == 4
    assert moved.tile_tokens_NT_Tq.device.type == "meta" and moved.tile_tokens_NT_Tq.shape == tiles.shape
    assert moved.tile_row_of_token_N.shape == batch.tile_row_of_token_N.shape


@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_activations_do_not_depend_on_the_number_of_rows(name: str) -> None:
    """torch's CPU kernels finish a tensor's last partial SIMD chunk with scalar code of other bits
    (ops/activation.py): plain torch.sigmoid / F.silu of (N, 8) rows change with N on this CPU; the padded forms
    never do."""
    from miles_kernels.ops import activation

    ours = getattr(activation, name)
    plain = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu}[name]
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    full = ours(x)
    assert torch.equal(full, plain(x))  # same values as torch for rows on whole vectors
    for rows in range(1, 40):
        assert torch.equal(ours(x[:rows]), full[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_each_row_and_copy_at_its_page_head_and_offset(dtype: torch.dtype) -> None:
    """The K/V write (one index_copy_ per store at the batch's flat slots) against indexing each (page, head,
    offset) directly: the tokens' rows, a draft tree's copy writes, a separate V store and MLA's single latent store;
    a non-contiguous store takes the indexed path and gets the same rows."""
    from dataclasses import replace

    from miles_kernels.ops.attention_batch import build_attention_batch
    from miles_kernels.ops.kv_pages import write_kv

    generator = torch.Generator().manual_seed(0)
    batch = build_attention_batch([3, 1, 5], [10, 4, 0], [[1, 2], [3, 4], [5, 6]], 8, 4, "cpu")
    batch = replace(batch, copy_tokens_C=torch.tensor([0, 2]), copy_pages_C=torch.tensor([7, 7]),
                    copy_offsets_C=torch.tensor([1, 2]))  # fmt: skip
    rows = [(t, int(batch.write_pages_N[t]), int(batch.write_offsets_N[t])) for t in range(9)]
    rows += [
        (int(t), int(p), int(o))
        for t, p, o in zip(batch.copy_tokens_C, batch.copy_pages_C, batch.copy_offsets_C, strict=True)
    ]
    for kv_heads, one_store in ((2, False), (1, True)):
        k = torch.randn(9, kv_heads, 16, generator=generator)
        v = k if one_store else torch.randn(9, kv_heads, 16, generator=generator)
        k_pages = torch.randn(8, kv_heads, 8, 16, generator=generator).to(dtype)
        v_pages = k_pages if one_store else torch.randn(8, kv_heads, 8, 16, generator=generator).to(dtype)
        want_k, want_v = k_pages.clone(), v_pages.clone()
        for t, page, offset in rows:
            want_k[page, :, offset] = k[t].to(dtype)
            want_v[page, :, offset] = v[t].to(dtype)
        strided = torch.empty(8, 8, kv_heads, 16, dtype=dtype).transpose(1, 2)  # the indexed path
        strided.copy_(k_pages)
        write_kv(k_pages, v_pages, k, v, batch)
        assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v if not one_store else want_k)
        write_kv(strided, strided, k, k, batch)
        assert torch.equal(strided, want_k)
