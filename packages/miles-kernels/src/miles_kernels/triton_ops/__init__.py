"""Batch-invariant Triton kernels (docs/architecture.md, "Kernels"): a row's result depends on that row and the
weights only, never on how many rows the call carries or where the row sits, because every reduction runs in one
fixed order set by compile-time block sizes that never depend on the batch (no autotuning keyed on it).

- `matmul`: `x @ w.T` by a persistent kernel with a fixed tile schedule (`matmul.py`);
- `rms_norm`: RMSNorm, the sum of squares in fixed blocks (`norm.py`);
- `logsumexp`, `token_logprobs`: log-softmax over the vocabulary in fixed chunks (`logsoftmax.py`).

Triton is imported on first use. The kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, set before Triton is imported), which is how the CPU tests check their schedule: the
interpreter proves the order of the arithmetic, not a GPU's bits (the `gpu` tests run them natively).
"""

from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool | str:
    """True where these kernels can run here (a CUDA device, or Triton's interpreter), else why not: the registry's
    availability check of the `triton` backends."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with torch's Linux CUDA wheels)"
    if interpreting():
        return True
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels in Triton's interpreter on the CPU)"
    return True
