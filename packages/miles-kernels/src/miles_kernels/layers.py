"""The basic modules of the model (model.py, latent_attention.py): an RMSNorm and a linear layer under Hugging Face's
parameter names, each running miles' kernel op with the model's `KernelConfig`."""

from __future__ import annotations

import torch
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.ops.linear import linear
from miles_kernels.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernel: KernelConfig | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.kernel = eps, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernel)


class Linear(nn.Module):
    """A linear layer (HF `nn.Linear` parameter names) that runs miles' kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernel: KernelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.kernel, self.bias)
