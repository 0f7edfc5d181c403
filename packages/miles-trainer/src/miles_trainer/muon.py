"""Muon for the policy's matrices, AdamW for the rest (`trainer.optimizer.algorithm=muon`; docs/algorithms.md, "Muon").

Moonlight / Kimi-K2's recipe: the decoder trunk's weight matrices (`CausalLM.trunk_linears`: attention, MLP,
experts, MLA projections) step with Muon -- momentum, Nesterov, then the update orthogonalized by Newton-Schulz
iterations, its learning rate scaled by 0.2 * sqrt(max(fan_out, fan_in)) so that AdamW's learning rate and weight
decay carry over ("match_rms_adamw") -- and every other parameter (embeddings, LM head, norms, biases, routers) with
AdamW, in one optimizer: one state dict (the checkpoint's `optim`), one learning-rate schedule, one offload.

The arithmetic is torch's own: `torch.optim.AdamW(fused=True)` for the AdamW group, and `torch.optim.Muon`'s
update (its Newton-Schulz iteration and learning-rate adjustment) for each matrix, so a single process steps
exactly as `torch.optim.Muon` does. With FSDP2 the Newton-Schulz iteration runs on the full matrix: each rank
gathers the update (`DTensor.full_tensor`, one all-gather per matrix), orthogonalizes it, and keeps its own rows.
Every rank repeats the same iteration on the same matrix, which costs compute (small next to the step's forward and
backward at these sizes) but keeps the update bitwise the one-process update on any number of ranks; orthogonalizing
the shards apart would be another algorithm (a shard's rows are not the matrix's), and a shard-aware iteration would
need collectives inside every one of the iterations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

MUON_NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)  # torch.optim.Muon's (Keller Jordan's quintic iteration)


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer: Muon for `muon_params` (2-D matrices), AdamW for `adamw_params` (see the module docstring).
    Param group 0 is AdamW's, group 1 Muon's; both take the schedule's `lr`."""

    def __init__(
        self, muon_params: Iterable[torch.nn.Parameter], adamw_params: Iterable[torch.nn.Parameter], *, lr: float,
        weight_decay: float, betas: tuple[float, float], eps: float, momentum: float, nesterov: bool, ns_steps: int,
    ) -> None:  # fmt: skip
        muon, adamw = list(muon_params), list(adamw_params)
        bad = [tuple(p.shape) for p in muon if p.ndim != 2]
        if bad:
            raise ValueError(f"Muon steps 2-D matrices only, got parameters of shapes {bad[:3]}")
        self._adamw = torch.optim.AdamW(adamw, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        muon_group = {
            "params": muon, "algorithm": "muon", "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
            "nesterov": nesterov, "ns_steps": ns_steps, "ns_coefficients": MUON_NS_COEFFICIENTS, "eps": EPS,
            "adjust_lr_fn": "match_rms_adamw",
        }  # fmt: skip
        super().__init__([self._adamw.param_groups[0] | {"algorithm": "adamw"}, muon_group], {})
        self._share_with_adamw()

    def _share_with_adamw(self) -> None:
        """The inner AdamW works on group 0 and this optimizer's state (the two never hold the same parameter)."""
        self._adamw.param_groups = [self.param_groups[0]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_with_adamw()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adamw.step()
        group = self.param_groups[1]
        for param in group["params"]:
            if param.grad is not None:
                self._muon_step(param, group)
        return loss

    def _muon_step(self, param: torch.nn.Parameter, group: dict[str, Any]) -> None:
        """`torch.optim.Muon`'s update of one matrix, the Newton-Schulz iteration on the whole matrix."""
        grad = param.grad
        assert grad is not None
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum, lr = group["momentum"], float(group["lr"])
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        full = update.full_tensor() if isinstance(update, DTensor) else update
        ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if isinstance(update, DTensor):  # this rank's rows of the orthogonalized matrix (no communication)
            ortho = distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
        adjusted = _adjust_lr(lr, group["adjust_lr_fn"], full.shape)
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(ortho, alpha=-adjusted)
