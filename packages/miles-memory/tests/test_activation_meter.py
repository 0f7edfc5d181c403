"""CPU tier: the ActivationMeter counts what autograd saves and lets go of it as autograd does: after the backward
that used it, and when a graph that never sees a backward is dropped (a metric computed with grad)."""

from __future__ import annotations

import gc
import weakref

import torch

from miles_memory import ActivationMeter


def test_a_graph_never_backpropagated_frees_what_it_saved() -> None:
    x = torch.randn(64, 256, requires_grad=True)
    meter = ActivationMeter()
    with meter:
        logp = torch.log_softmax(x * 2, dim=-1)  # log_softmax and exp save their own outputs
        entropy = -(logp.exp() * logp).sum(-1)
    assert meter.saved_bytes >= 2 * x.numel() * 4
    outputs = [weakref.ref(logp), weakref.ref(entropy)]
    del logp, entropy
    gc.collect()
    assert [ref() for ref in outputs] == [None, None]  # no cycle through the graph keeps them
    assert meter.saved_bytes == 0


def test_the_backward_frees_what_it_used_and_gets_the_same_gradient() -> None:
    x = torch.randn(32, 128, requires_grad=True)
    loss = (torch.log_softmax(x * 2, dim=-1).exp() ** 2).sum()
    (expected,) = torch.autograd.grad(loss, x)
    meter = ActivationMeter()
    with meter:
        loss = (torch.log_softmax(x * 2, dim=-1).exp() ** 2).sum()
    assert meter.peak_bytes > 0
    (got,) = torch.autograd.grad(loss, x)
    assert torch.equal(got, expected)
    assert meter.saved_bytes == 0
