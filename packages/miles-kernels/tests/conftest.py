"""Shared fixtures for miles-kernels tests: every test starts with torch at 2 threads. Without a CUDA device the
Triton kernels run in Triton's interpreter (test_triton_ops.py): TRITON_INTERPRET must be set before anything
imports Triton (its `@triton.jit` decides at decoration time, for `triton.language`'s own helpers too)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
