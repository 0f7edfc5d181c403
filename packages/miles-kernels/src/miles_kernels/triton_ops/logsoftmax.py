"""Log-softmax over the vocabulary by a Triton kernel, batch-invariant: one program per row walks the vocabulary in
fixed `BLOCK`-wide chunks from token 0, keeping a running maximum and sum of exponentials per lane (the online
softmax), then combines the lanes once. The log-prob contract of `miles_kernels.ops.sampling`: a token's log-prob
is `log_softmax(logits / T)[token]` in float32, `T` the row's temperature.

Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_kernels.triton_ops import interpreting

BLOCK = 1024  # vocabulary entries per chunk; fixed, so a row's sum has one order whatever the batch


@triton.jit
def _logsumexp_kernel(logits_ptr, temperature_ptr, token_ptr, lse_ptr, token_logprob_ptr, V, stride_row,
                      HAS_TOKENS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    running_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = x / temperature
        new_max = tl.maximum(running_max, x)
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)  # a lane that saw only -inf keeps a zero sum
        running_sum = running_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    total = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)
    lse = row_max + tl.log(total)
    tl.store(lse_ptr + row, lse)
    if HAS_TOKENS:
        token = tl.load(token_ptr + row)
        chosen = tl.load(logits_ptr + row * stride_row + token).to(tl.float32) / temperature
        tl.store(token_logprob_ptr + row, chosen - lse)


def _run(logits_MV: torch.Tensor, temperatures_M1: torch.Tensor, tokens_M: torch.Tensor | None) -> tuple[
    torch.Tensor, torch.Tensor | None
]:  # fmt: skip
    if not (logits_MV.is_cuda or interpreting()):
        raise RuntimeError("the Triton log-softmax runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    logits = logits_MV.contiguous()
    num_rows, vocab = logits.shape
    temperatures = temperatures_M1.reshape(num_rows).to(torch.float32).contiguous()
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    chosen = torch.empty(num_rows, dtype=torch.float32, device=logits.device) if tokens_M is not None else lse
    tokens = tokens_M.contiguous() if tokens_M is not None else lse
    if num_rows:
        _logsumexp_kernel[(num_rows,)](logits, temperatures, tokens, lse, chosen, vocab, logits.stride(0),
                                       HAS_TOKENS=tokens_M is not None,
                                       BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))  # fmt: skip
    return lse, (chosen if tokens_M is not None else None)


def logsumexp(logits_MV: torch.Tensor, temperatures_M1: torch.Tensor) -> torch.Tensor:
    """float32 `logsumexp(logits / T)` per row."""
    return _run(logits_MV, temperatures_M1, None)[0]


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperatures_M1: torch.Tensor) -> torch.Tensor:
    """float32 `log_softmax(logits / T)[token]` per row."""
    chosen = _run(logits_MV, temperatures_M1, tokens_M)[1]
    assert chosen is not None
    return chosen


def full_logprobs(logits_MV: torch.Tensor, temperatures_M1: torch.Tensor) -> torch.Tensor:
    """float32 `log_softmax(logits / T)` over the whole vocabulary (the row's logsumexp from the kernel)."""
    lse = logsumexp(logits_MV, temperatures_M1)
    return logits_MV.to(torch.float32) / temperatures_M1.reshape(-1, 1).to(torch.float32) - lse[:, None]
