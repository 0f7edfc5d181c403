"""RoPE's gradient and its native kernel: `apply_rope` under autograd against autograd through the torch form, and
native/rope.cpp against the torch form on every instruction-set build, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from miles_kernels import apply_rope, inv_frequencies, native, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_gradient_is_autograds_bit_for_bit(dtype: torch.dtype, rotary: int) -> None:
    """`apply_rope` under autograd (`_Rope`, a hand-written backward; float32 runs the native kernel where it loads)
    gives the forward and the gradient that autograd computes through the torch form's ops, bit for bit; partial
    rotary (8 of 16) included."""
    from miles_kernels.ops.rope import _torch_rotate

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, 16, generator=generator).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(11) * 7, inv_frequencies(rotary, 10_000.0), dtype)
    upstream = torch.randn(11, 3, 16, generator=generator).to(dtype)
    fused, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = apply_rope(fused, cos, sin)
    want = _torch_rotate(plain, cos, sin)
    assert out.grad_fn is not None and "Rope" in type(out.grad_fn).__name__
    assert torch.equal(out, want)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert torch.equal(fused.grad, plain.grad)


@pytest.mark.skipif(native.status() is not True, reason="the native library is not usable here")
@pytest.mark.parametrize("isa", native.ISAS)
def test_native_rope_is_the_bits_of_the_torch_form(isa: str) -> None:
    """native/rope.cpp against the torch form (`x * cos + cat(-x2, x1) * sin` and its backward), bit for bit, on every
    instruction-set build: head sizes with vector tails, partial rotary, one row and enough rows to run threaded, 1
    and 2 threads, values of every magnitude and non-finite ones."""
    script = """
import torch
from miles_kernels import native
from miles_kernels.ops.rope import _torch_rotate, inv_frequencies, rope_cos_sin
assert native.isa() == ISA, native.isa()
def same(a, b):  # every bit, but a NaN's sign (the torch form negates before multiplying)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0).view(torch.int32),
                                                             b.masked_fill(nan, 0).view(torch.int32))
g = torch.Generator().manual_seed(0)
for n, heads, dim, rotary in ((1, 1, 32, 32), (7, 3, 40, 40), (5, 2, 64, 24), (300, 8, 128, 128), (33, 4, 18, 6)):
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-30, 30, dim)
    x[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    cos, sin = rope_cos_sin(torch.randint(0, 40_000, (n,), generator=g), inv_frequencies(rotary, 1e6), torch.float32)
    grad = torch.randn(n, heads, dim, generator=g)
    want = _torch_rotate(x, cos, sin)
    half = rotary // 2
    z = grad[..., :rotary] * sin[:, None, :]
    want_grad = torch.cat((grad[..., :rotary] * cos[:, None, :] + torch.cat((z[..., half:], -z[..., :half]), -1),
                           grad[..., rotary:]), -1)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert same(native.native_rope(x, cos, sin), want), (n, dim)
        assert same(native.native_rope_backward(grad, cos, sin), want_grad), (n, dim)
print("ok")
""".replace("ISA", repr(isa))
    env = os.environ | {"MILES_NATIVE_ISA": isa}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if "runs none of the native builds" in done.stderr:
        pytest.skip(f"this CPU lacks the {isa} instruction set")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["dense", "llama", "deepseek", "glm"])
def test_the_cpu_rope_tables_give_the_bits_of_computing_each_batch(kind: str) -> None:
    """`rotary_cos_sin` gathers the CPU's rows from tables computed once per config and dtype (growing with the
    largest position): each batch's rows are, bit for bit, those computed for that batch alone (default, Llama 3,
    YaRN and partial rotary RoPE; float32 and bfloat16); positions past the table's cap are computed per call."""
    from miles_kernels.model import _ROPE_TABLES, ROPE_TABLE_MAX_POSITIONS, _rotary_cos_sin, rotary_cos_sin
    from miles_kernels.testing import tiny_config

    # a config holding a list (eos_token_id) is not hashable: the tables go by the config's identity
    config, generator = replace(tiny_config(kind), eos_token_id=[1, 2]), torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        like = torch.empty((), dtype=dtype)
        batches = [torch.tensor([0]), torch.arange(40), torch.randint(0, 5000, (300,), generator=generator),
                   torch.tensor([ROPE_TABLE_MAX_POSITIONS + 3, 7])]  # fmt: skip
        for positions in batches:
            got, want = rotary_cos_sin(config, positions, like), _rotary_cos_sin(config, positions, like)
            assert got[0].dtype == dtype and got[0].shape == (len(positions), config.rotary_dim)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (dtype, positions[:4])
        assert _ROPE_TABLES[id(config), dtype][1].shape[0] == 8192  # the rows came from a table (up to 4999)
