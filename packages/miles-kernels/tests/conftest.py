"""Shared fixtures for miles-kernels tests: every test starts with torch at 2 threads. Without a CUDA device the
Triton kernels run in Triton's interpreter (test_triton_ops.py): TRITON_INTERPRET must be set before anything
imports Triton (its `@triton.jit` decides at decoration time, for `triton.language`'s own helpers too). This folder
is on `sys.path` (pytest's importlib mode puts none there): test_native.py takes test_native_attention.py's cases."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _in_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
    """`tl.dot` in the interpreter as a GPU's MMA computes it for the schedule's purposes: each output element its
    own accumulation over k in order, whatever the block's other rows hold. The interpreter's own `np.matmul` runs
    the CPU's BLAS, whose micro-kernels may round a row by its place in the block (OpenBLAS's on an AMD EPYC does):
    that would test the BLAS, not the kernel's schedule."""
    from triton.runtime.interpreter import TensorHandle

    acc = np.array(d.data, copy=True)
    left, right = a.data.astype(acc.dtype), b.data.astype(acc.dtype)
    for k in range(left.shape[-1]):
        acc += left[..., :, k : k + 1] * right[..., k : k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:  # no Triton: test_triton_ops.py skips
        pass
    else:
        _interpreter_dot = InterpreterBuilder.create_dot

        def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
            if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own
                return _interpreter_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            return _in_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        InterpreterBuilder.create_dot = _dot


@pytest.fixture(autouse=True)
def _two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
