"""The native CPU kernels (miles_kernels/native): the GEMMs' and RMSNorm's numerics against float64, batch invariance
by construction (a row alone or in any batch, any thread count, any operand layout), the same bits from every
instruction-set build this CPU runs (the attention's too), native gradients, the `native` linear, attention and norm
backends and their fingerprint, and the errors a caller gets. The attention's own tests: test_native_attention.py."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_native_attention import TORCH_BACKENDS, attention_case

from miles_kernels import (
    KernelConfig,
    describe_kernel,
    kernel_fingerprint,
    linear,
    native,
    native_matmul,
    resolved_backends,
    rms_norm,
)
from miles_kernels.native import build as native_build
from miles_kernels.native import native_linear, native_mm
from miles_kernels.testing import packed_logits, random_model, tiny_config

# shapes (M, K, N): decode rows, K not a multiple of the 8 x 8 transposes, N not a multiple of any block, empty, tiny
SHAPES = [(1, 256, 256), (7, 300, 33), (130, 96, 70), (5, 1, 3), (4, 17, 1), (0, 8, 8), (3, 0, 4)]


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert native.status() is True, f"the native kernels must build and load on this machine: {native.status()}"


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_float64_and_is_batch_invariant(shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    x, w = operands(m, k, n)
    out = native_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), rtol=0, atol=1e-5 * max(k, 1) ** 0.5)
    if m:
        alone = torch.cat([native_linear(x[i : i + 1], w) for i in range(m)])
        assert torch.equal(alone, out)
        order = torch.randperm(m, generator=torch.Generator().manual_seed(1))
        assert torch.equal(native_linear(x[order], w), out[order])
        padded = torch.cat([torch.randn(9, k), x, torch.randn(2, k)])  # other rows around it
        assert torch.equal(native_linear(padded, w)[9 : 9 + m], out)


def test_threads_and_layouts_do_not_change_bits() -> None:
    x, w = operands(61, 200, 90)
    out = native_linear(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_linear(x, w), out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(native_linear(x.t().contiguous().t(), w), out)  # column-major x: copied, same values
    assert torch.equal(native_linear(x, w.t().contiguous().t()), out)
    wide = torch.randn(61, 400)
    wide[:, ::2] = x  # a strided view
    assert torch.equal(native_linear(wide[:, ::2], w), out)
    assert torch.equal(native_mm(x, w.t()), native_mm(x, w.t().contiguous()))


def held(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight the native linear keeps packed (as an engine's)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    native.hold_packed_weights([weight])
    return weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_the_mm_of_the_transpose_packed_once_or_in_the_call(dtype: torch.dtype) -> None:
    """A held weight's packed copy and the per-call packing give `native_mm(x, w.T)`'s bits at every row count (the
    decode tails run several panels a call), column count (partial panels and panel groups) and thread count."""
    width = native.panel_width()
    for m in (1, 2, 3, 5, 8, 9, 17):
        for n, k in ((1, 33), (width - 1, 300), (3 * width + 5, 64), (4 * width, 17), (9 * width + 3, 1)):
            x = torch.randn(m, k).to(dtype)
            weight = held(n, k, seed=m, dtype=dtype)
            want = native_mm(x, weight.t())
            assert torch.equal(native_linear(x, weight), want), (m, n, k)
            assert len(native.packed_weights([weight])) == 1  # it ran from its packed copy
            assert torch.equal(native_linear(x, weight.clone()), want), (m, n, k)  # not held: packed in the call
            assert torch.equal(torch.cat([native_linear(x[i : i + 1], weight) for i in range(m)]), want)
    x, weight = torch.randn(600, 256), held(300, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(native_linear(x, weight), one)


def test_held_weights_are_packed_once_per_version_and_go_with_the_tensor() -> None:
    x, weight = torch.randn(3, 40), held(70, 40)
    native_linear(x, weight)
    (panels,) = native.packed_weights([weight])
    assert panels.shape == (-(-70 // native.panel_width()), 40, native.panel_width())
    native_linear(x, weight)
    assert native.packed_weights([weight])[0] is panels  # used again, not packed again
    with torch.no_grad():
        weight.mul_(2)  # an in-place update (a weight sync's copy_): packed again, into the same panels
    assert torch.equal(native_linear(x, weight), native_mm(x, weight.t()))
    assert native.packed_weights([weight])[0] is panels and torch.equal(panels, native.pack_weight(weight))
    panels.untyped_storage().resize_(0)  # released with the engine's weights (miles_memory's offload)
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(native_linear(x, weight), native_mm(x, weight.t()))  # packed into new panels
    assert native.packed_weights([weight])[0] is not panels and len(native.packed_weights([weight])) == 1
    experts = torch.randn(4, 24, 40)  # an MoE layer's stacked experts: each one's weight is a view
    native.hold_packed_weights([experts])
    for e in range(4):
        assert torch.equal(native_linear(x, experts[e]), native_mm(x, experts[e].t()))
    assert len(native.packed_weights([experts])) == 4
    experts[1].add_(1)  # views share the version counter: every expert is checked, the changed one right
    assert torch.equal(native_linear(x, experts[1]), native_mm(x, experts[1].t()))
    held_before = len(native.matmul._PACKED)
    del experts
    assert len(native.matmul._PACKED) == held_before - 1  # released with the tensor


def test_mm_matches_float64_and_rows_are_invariant() -> None:
    a, b = torch.randn(37, 150), torch.randn(150, 45)
    out = native_mm(a, b)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=0, atol=1e-4)
    assert torch.equal(torch.cat([native_mm(a[i : i + 1], b) for i in range(37)]), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_round_the_float32_chains_once(dtype: torch.dtype) -> None:
    x, w = operands(9, 70, 20)
    x, w = x.to(dtype), w.to(dtype)
    out = native_linear(x, w)
    assert out.dtype == dtype
    assert torch.equal(out, native_linear(x.float(), w.float()).to(dtype))  # inputs exact in float32
    assert torch.equal(native_mm(x, w.t()), native_mm(x.float(), w.float().t()).to(dtype))
    assert torch.equal(torch.cat([native_linear(x[i : i + 1], w) for i in range(9)]), out)


def test_every_instruction_set_build_gives_the_same_bits(tmp_path) -> None:
    code = (
        "import sys, torch\n"
        "from miles_kernels import native\n"
        "from miles_kernels.native import isa, native_linear, native_mm\n"
        "g = torch.Generator().manual_seed(0)\n"
        "outs = []\n"
        "for m, k, n in [(1, 256, 64), (7, 300, 33), (70, 97, 50)]:\n"
        "    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)\n"
        "    outs += [native_linear(x, w), native_mm(x, w.t()), native_linear(x.bfloat16(), w.bfloat16())]\n"
        "    native.hold_packed_weights([w])\n"
        "    outs += [native_linear(x, w)]\n"
        "from test_native_attention import attention_case\n"
        "for window, page in ((None, 8), (5, 8), (None, 32), (19, 32)):  # chunks of 8 keys, of 16\n"
        "    case = attention_case(seed=1, window=window, page=page)\n"
        "    outs += [*case.forward(), *case.backward()]\n"
        "from miles_kernels.native import native_rms_norm, native_rms_norm_backward\n"
        "x, w, dy = (torch.randn(*shape, generator=g) for shape in ((9, 300), (300,), (9, 300)))\n"
        "outs += [*native_rms_norm(x, w, 1e-6), *native_rms_norm_backward(x, w, dy, 1e-6)]\n"
        "torch.save(outs, sys.argv[1])\n"
        "print(isa())\n"
    )
    results = {}
    for isa in native.ISAS:
        path = tmp_path / f"{isa}.pt"
        env = {**os.environ, "MILES_NATIVE_ISA": isa, "PYTHONPATH": os.path.dirname(__file__)}
        run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                             timeout=120)  # fmt: skip
        if "runs none of the native builds" in run.stderr:
            continue  # this CPU lacks that instruction set
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == isa
        results[isa] = torch.load(path)
    assert "generic" in results and len(results) >= 2, results.keys()
    first, *others = results
    for isa in others:
        for i, (a, b) in enumerate(zip(results[first], results[isa], strict=True)):
            assert torch.equal(a, b), f"output {i}: the {isa} build differs from the {first} build"


def test_gradients_are_native_and_close_to_torch() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=generator, requires_grad=True)
    w = torch.randn(24, 64, generator=generator, requires_grad=True)
    grad = torch.randn(40, 24, generator=generator)
    native_matmul(x, w).backward(grad)
    assert x.grad is not None and w.grad is not None
    assert torch.equal(x.grad, native_mm(grad, w.detach()))  # dX: each element one chain over the outputs
    assert torch.equal(w.grad, native_mm(grad.t(), x.detach()))  # dW: one chain over the tokens, in order
    torch.testing.assert_close(x.grad, grad @ w.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(w.grad, grad.t() @ x.detach(), rtol=1e-5, atol=1e-4)
    first = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    native_matmul(x, w).backward(grad)
    assert torch.equal(x.grad, first[0]) and torch.equal(w.grad, first[1])  # run to run


def test_bad_operands_are_refused_by_name() -> None:
    x, w = operands(2, 8, 4)
    with pytest.raises(ValueError, match=r"\(M, K\) by \(N, K\)"):
        native_linear(x, w.t())
    with pytest.raises(ValueError, match="one dtype"):
        native_linear(x, w.double())
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        native_linear(x.double(), w.double())
    with pytest.raises(ValueError, match=r"\(M, K\) by \(K, N\)"):
        native_mm(x, w)


NATIVE = KernelConfig(linear_backend="native")


def test_backend_is_registered_and_fingerprinted() -> None:
    assert resolved_backends(NATIVE)["linear"] == "native"
    assert resolved_backends(KernelConfig())["linear"] == "native"  # auto picks it where it built
    assert kernel_fingerprint(NATIVE) != kernel_fingerprint(KernelConfig(linear_backend="torch-tiled"))
    assert "native_sources" not in describe_kernel(TORCH_BACKENDS)
    assert describe_kernel(NATIVE)["native_sources"] == native_build.source_hash()
    generator = torch.Generator().manual_seed(4)
    x, w, bias = torch.randn(2, 5, 32, generator=generator), torch.randn(48, 32), torch.randn(48)
    out = linear(x, w, NATIVE, bias)
    assert torch.equal(out, (native_linear(x.reshape(10, 32), w) + bias).reshape(2, 5, 48))
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=0, atol=1e-5)


def test_model_runs_on_the_native_backend() -> None:
    """The whole model on native kernels: other bits than torch-tiled (so they really run), the same values."""
    config = tiny_config("moe")
    seqs = [torch.arange(11) % config.vocab_size, torch.arange(5) + 7]
    tiled = packed_logits(random_model(config, TORCH_BACKENDS, seed=0), seqs)
    ours = packed_logits(random_model(config, NATIVE, seed=0), seqs)
    for a, b in zip(tiled, ours, strict=True):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_a_missing_or_stale_library_is_a_reason_not_a_crash(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native.library, "_STATE", {})
    monkeypatch.setattr(native.library, "library_path", lambda: tmp_path / native_build.LIBRARY)
    assert "python -m miles_kernels.native build" in str(native.status())
    with pytest.raises(RuntimeError, match="was not built"):
        native_linear(*operands(1, 4, 4))
    monkeypatch.setattr(native.library, "_STATE", {})
    built = native_build.build(tmp_path)  # a fresh build loads ...
    assert native.status() is True
    monkeypatch.setattr(native.library, "_STATE", {})
    monkeypatch.setattr(native_build, "source_hash", lambda: "0" * 16)  # ... and one from other sources does not
    assert "built from other sources" in str(native.status())
    assert built.exists()


def test_a_build_without_a_compiler_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="does not run"):
        native_build.build(tmp_path)
    assert not (tmp_path / native_build.LIBRARY).exists()


@pytest.mark.parametrize("hidden", [256, 300, 5])
def test_rms_norm_matches_float64_and_rows_are_invariant(hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(33, hidden, generator=generator), torch.randn(hidden, generator=generator)
    grad = torch.randn(33, hidden, generator=generator)
    out, inverse = native.native_rms_norm(x, w, 1e-6)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = w64 * x64 / (x64.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=0, atol=2e-6)
    for m in range(33):
        alone, alone_inverse = native.native_rms_norm(x[m : m + 1], w, 1e-6)
        assert torch.equal(alone[0], out[m]) and torch.equal(alone_inverse[0], inverse[m])
    dx, dw = native.native_rms_norm_backward(x, w, grad, 1e-6)
    torch.testing.assert_close(dx.double(), x64.grad, rtol=0, atol=2e-5)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=0, atol=2e-5)
    dx_alone, _ = native.native_rms_norm_backward(x[5:6], w, grad[5:6], 1e-6)
    assert torch.equal(dx_alone[0], dx[5])  # dx too is per row
    again = native.native_rms_norm_backward(x, w, grad, 1e-6)
    assert torch.equal(again[0], dx) and torch.equal(again[1], dw)


def test_rms_norm_backend_rounds_once_to_the_dtype() -> None:
    generator = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 64, generator=generator).bfloat16(), torch.randn(64, generator=generator).bfloat16()
    out = rms_norm(x, w, 1e-6, KernelConfig(norm_backend="native"))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, native.native_rms_norm(x, w, 1e-6)[0].bfloat16())
    with pytest.raises(ValueError, match=r"weight \(H,\)"):
        native.native_rms_norm(x, w[:10], 1e-6)


def test_attention_and_norm_backends_are_registered_and_fingerprinted() -> None:
    config = KernelConfig(attention_backend="native", norm_backend="native")
    assert resolved_backends(config)["attention"] == resolved_backends(config)["rms_norm"] == "native"
    fast = resolved_backends(KernelConfig(mode="fast"))  # the fastest attention and norm here, and plain GEMM
    linear = "native" if native.faster_than_mkl() is True else "torch"
    assert fast == {"attention": "native", "linear": linear, "rms_norm": "native"}
    assert describe_kernel(config)["native_sources"] == native_build.source_hash()
    assert kernel_fingerprint(config) != kernel_fingerprint(KernelConfig(attention_backend="torch-blocked"))


def test_every_kernel_gives_the_same_bits_on_one_thread_and_on_two() -> None:
    """Shapes above the kernels' threading threshold (simd.h's MIN_PARALLEL_WORK: two threads share them) give the
    bits of one thread, for every kernel and its gradients; small calls run on one thread either way."""

    def on_threads(threads: int, fn: Any) -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    generator = torch.Generator().manual_seed(11)
    x, w = torch.randn(600, 256, generator=generator), torch.randn(256, generator=generator)
    grad = torch.randn(600, 256, generator=generator)
    b = torch.randn(256, 300, generator=generator)
    held_b = b.t().contiguous()
    native.hold_packed_weights([held_b])
    case = attention_case(seed=4, window=None)
    calls = {
        "rms_norm": lambda: native.native_rms_norm(x, w, 1e-6),
        "rms_norm_backward": lambda: native.native_rms_norm_backward(x, w, grad, 1e-6),
        "mm": lambda: (native_mm(x, b),),
        "linear": lambda: (native_linear(x, b.t().contiguous()),),
        "held linear": lambda: (native_linear(x, held_b),),
        "attention": case.forward,
        "attention_backward": case.backward,
    }
    for name, call in calls.items():
        one, two = on_threads(1, call), on_threads(2, call)
        assert all(torch.equal(a, c) for a, c in zip(one, two, strict=True)), name


@pytest.mark.parametrize(
    ("vendor", "isa", "fast_linear"),
    [("AuthenticAMD", "avx512", "native"), ("GenuineIntel", "avx512", "torch"), ("AuthenticAMD", "avx2", "native"),
     ("GenuineIntel", "avx2", "torch"), ("AuthenticAMD", "generic", "torch"), ("", "avx512", "native")],
)  # fmt: skip
def test_fast_mode_takes_the_native_linear_only_where_mkl_runs_its_avx2_code(
    vendor: str, isa: str, fast_linear: str, monkeypatch
) -> None:
    """Fast mode's `auto` linear: one MKL GEMM on Intel CPUs and wherever the native build has no vector code; the
    native GEMM on other AVX-512 and AVX2 CPUs (MKL takes its AVX2 path there). Naming it where MKL is the faster says
    why."""
    from miles_kernels import registry

    monkeypatch.setattr(native.library, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(native.library, "isa", lambda: isa)
    monkeypatch.setattr(registry, "_AVAILABILITY", {})
    assert resolved_backends(KernelConfig(mode="fast"))["linear"] == fast_linear
    if fast_linear == "torch":
        with pytest.raises(RuntimeError, match="MKL's GEMM is fast mode's faster linear on this CPU"):
            resolved_backends(KernelConfig(mode="fast", linear_backend="native"))
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    out = registry.get_backend("linear:fast", fast_linear).fn(x, w, None, KernelConfig(mode="fast"))
    want = native_linear(x, w) if fast_linear == "native" else F.linear(x, w)
    assert torch.equal(out, want)
