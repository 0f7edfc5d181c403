"""Routing metrics, routing replay and the MoE load-balancing and z losses on the Megatron backend (docs/megatron.md,
"How a step runs"): megatron-core's routers instrumented so that the FSDP2 backend's MoE code (`miles_trainer/moe.py`)
reads them as it reads a miles-kernels MoE layer, with the same definitions and weights.

- Record (`router_records`): each `TopKRouter` of a model chunk gets a `RouterRecord`, keyed by its global layer
  index, whose `last_routing` is its last forward's `Routing` (miles-kernels' layout) on the micro-batch's packed
  rows, so `routing_metrics`, `balance_loss` and `z_loss` take a chunk's records as they take a model's MoE layers.
  The router sees the right-padded (B, S) batch as (S, B) tokens flattened S-major (token s * B + b), padding
  included; `router_index` finds the packed rows there. With EP the router runs before the token dispatch, on each
  rank's own tokens.
- Replay: the record is also the router's `router_replay`, megatron-core's hook inside its top-k
  (`topk_routing_with_score_function`): it takes the router's own top-k, then the recorded experts on the rows that
  carry a record (rows of -1, and padding, keep the router's choice); megatron-core then weighs the experts used by
  its own formula at them (`scores.gather`), so the router still learns through their scores, as ops/moe.py
  replays. Not megatron-core's `RouterReplay`: it replays every row or none, drops the router's own choice (the
  routing-flip metric needs it), and leaves the recompute's second forward to its caller.
- Losses: a router's load-balancing and z losses join the backward where the router runs (`_AddLossGrad`: its
  probabilities pass unchanged, and their backward starts the losses' own, as megatron-core attaches its aux
  losses), so every pipeline stage trains its own layers' terms and the last stage's loss leaves them out
  (`PolicyStep(computes_moe_terms=False)`). Their weight is the FSDP2 step's: coef x the micro-batch's share of the
  rank's rows, over the data-parallel size (megatron-core's DDP sums the ranks' gradients where FSDP2 averages).
- Recompute (`megatron.recompute=full`): megatron-core runs each layer under no_grad in the forward and again, with
  gradients, in the backward. A training pass is queued on each router as its forward starts and taken by the
  recompute (the schedules run a model chunk's backwards in the order of its forwards).
- Stats (`StagePasses`): after a micro-batch's forward through a chunk, the chunk's layers' metrics and loss values
  join the step's StepStats, their means over layers weighted by the chunk's share of the MoE layers, so that the
  backend's all-reduce over the pipeline ranks gives the whole model's (`StepStats.all_reduce` adds weighted means).
Sequence parallelism (each TP rank's router sees its share of the tokens) is not instrumented: no routing metrics,
and replay and the losses are refused (`check_moe_layout`).
Shapes: T router tokens (S x B, padding included), N packed rows, E experts, K experts per token, L layers.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from miles_kernels import ModelConfig, Routing
from miles_trainer.config import MegatronConfig, PolicyLossConfig
from miles_trainer.moe import balance_loss, balance_probs, layer_balance, router_z_loss, routing_metrics, z_loss
from miles_trainer.packing import MicroBatch
from miles_trainer.step import StepStats

LAYER_MEANS = ("moe_load_imbalance", "moe_router_entropy")  # routing_metrics' means over the layers it is given

# run_schedule's wrapper of a micro-batch's forward through a model chunk: (chunk, micro-batch, weight, padded batch)
StagePass = Callable[[Any, MicroBatch, float, Any], contextlib.AbstractContextManager[None]]


class MoEPass(NamedTuple):
    """One micro-batch's forward through a model chunk, as its routers take it."""

    router_index_N: torch.Tensor  # each packed row's token among the router's (`router_index`)
    replay_NLK: torch.Tensor | None = None  # recorded experts to replay (rows of -1: the router's choice)
    sequence_rows: Sequence[Sequence[int]] = ()  # each sample's packed rows (seq_aux_loss)
    aux_loss: str = "none"  # PolicyLossConfig.moe_aux_loss
    aux_scale: float = 0.0  # the load-balancing loss's weight in the backpropagated loss (0: no gradient)
    z_scale: float = 0.0  # the z-loss's


def router_index(padded: Any) -> torch.Tensor:
    """Each packed row's token among the router's (S, B) tokens, from its place b * S + s in the (B, S) batch."""
    rows, width = padded.ids_BS.shape
    flat_N: torch.Tensor = padded.flat_N
    index_N: torch.Tensor = (flat_N % width) * rows + flat_N // width
    return index_N


class _AddLossGrad(torch.autograd.Function):
    """`probs` unchanged; their backward also backpropagates `loss` (megatron-core's MoEAuxLossAutoScaler, without
    its global scale)."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class RouterRecord:
    """A megatron-core `TopKRouter`'s replay hook and its record of the last forward (see the module docstring)."""

    def __init__(self, router: Any, layer: int) -> None:
        self.router, self.layer = router, layer
        self.score_function: str = router.config.moe_router_score_function  # softmax or sigmoid: ModelConfig.router
        self.last_routing: Routing | None = None
        self.current: MoEPass | None = None  # the pass of the forward under way
        self.queued: deque[MoEPass] = deque()  # training passes whose recompute is still to come
        self._target_TK: torch.Tensor | None = None  # the recorded experts of the call under way
        self._chosen: tuple[torch.Tensor, torch.Tensor] | None = None  # its (router's own, used) experts
        route = router.routing

        def routing(logits: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            return self._route(route, logits, padding_mask)

        router.routing = routing
        router.router_replay = self

    def begin(self, moe_pass: MoEPass) -> None:
        """The pass of the forward about to run; queued too when megatron-core will recompute it in the backward."""
        self.current = moe_pass
        if torch.is_grad_enabled() and self.router.training and self.router.config.recompute_granularity == "full":
            self.queued.append(moe_pass)

    def get_replay_topk(
        self, scores_TE: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """megatron-core's top-k hook: the router's own choice, the recorded experts on the rows that carry them."""
        assert default_compute_topk is not None
        values, own_TK = default_compute_topk(scores_TE, topk, num_groups=num_groups, group_topk=group_topk)
        used_TK = own_TK
        if self._target_TK is not None:
            target = self._target_TK.to(own_TK.device)
            used_TK = torch.where((target >= 0).all(dim=-1, keepdim=True), target, own_TK)
            values = scores_TE.gather(1, used_TK)
        self._chosen = (own_TK, used_TK)
        return values, used_TK

    def _take_pass(self) -> MoEPass | None:
        """The pass of this router call: the next queued training pass in a recompute, else the current one."""
        is_recompute = torch.is_grad_enabled() and bool(self.queued)
        return self.queued.popleft() if is_recompute else self.current

    def _replay_target(self, moe_pass: MoEPass, rows: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        """The recorded experts (T, K) of the router's T tokens (rows of -1 where nothing is recorded)."""
        if moe_pass.replay_NLK is None:
            return None
        recorded_NK = moe_pass.replay_NLK[:, self.layer].to(rows.device, torch.int64)
        target_TK = recorded_NK.new_full((num_tokens, recorded_NK.shape[1]), -1)
        target_TK[rows] = recorded_NK
        return target_TK

    def _losses(
        self, moe_pass: MoEPass, logits_NE: torch.Tensor, scores_NE: torch.Tensor, expert_ids_NK: torch.Tensor
    ) -> torch.Tensor | None:
        """The pass's load-balancing and z losses of this router (weighted), or None when nothing trains them."""
        if not (torch.is_grad_enabled() and (moe_pass.aux_scale or moe_pass.z_scale)):
            return None
        loss = logits_NE.new_zeros(())
        if moe_pass.aux_scale:
            probs_NE = balance_probs(self.score_function, scores_NE)
            balance = layer_balance(moe_pass.aux_loss, probs_NE, expert_ids_NK, moe_pass.sequence_rows)
            loss = loss + moe_pass.aux_scale * balance
        if moe_pass.z_scale:
            loss = loss + moe_pass.z_scale * router_z_loss(logits_NE)
        return loss

    def _route(
        self, route: Callable[..., tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor, padding_mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        moe_pass = self._take_pass()
        if moe_pass is None:  # a forward outside the backend's passes: megatron-core's routing, unrecorded
            return route(logits, padding_mask)
        logits_TE = logits.reshape(-1, logits.shape[-1])
        rows = moe_pass.router_index_N.to(logits_TE.device)
        self._target_TK = self._replay_target(moe_pass, rows, logits_TE.shape[0])
        try:
            probs_TE, routing_map = route(logits, padding_mask)
        finally:
            self._target_TK = None
        assert self._chosen is not None, "megatron-core routed without its top-k hook (fused or sinkhorn routing)"
        (own_TK, used_TK), self._chosen = self._chosen, None
        logits_NE = logits_TE[rows].float()
        scores_NE = torch.softmax(logits_NE, dim=-1) if self.score_function == "softmax" else torch.sigmoid(logits_NE)
        expert_ids_NK = used_TK[rows]
        weights_NK = probs_TE.gather(1, used_TK)[rows].detach()
        self.last_routing = Routing(expert_ids_NK, weights_NK, own_TK[rows], scores_NE.detach(), logits_NE.detach())
        loss = self._losses(moe_pass, logits_NE, scores_NE, expert_ids_NK)
        if loss is not None:
            probs_TE = _AddLossGrad.apply(probs_TE, loss)
        return probs_TE, routing_map

    def observe(self, route: Callable[[torch.Tensor | None], Routing], num_tokens: int) -> Routing:
        """A Miles MoE layer's routing (`megatron_kernels`): `route(replay_TK)` routes the layer's `num_tokens`
        tokens with miles-kernels' ops, replaying `replay_TK` (None: nothing to replay); the record keeps the packed
        rows' routing and its losses join the backward through the combine weights, as `_route` does for
        megatron-core's router."""
        moe_pass = self._take_pass()
        if moe_pass is None:
            return route(None)
        rows = moe_pass.router_index_N.to(self.router.weight.device)
        routing = route(self._replay_target(moe_pass, rows, num_tokens))
        assert routing.logits is not None
        logits_NE, scores_NE, expert_ids_NK = routing.logits[rows], routing.scores[rows], routing.expert_ids[rows]
        self.last_routing = Routing(expert_ids_NK, routing.weights[rows].detach(), routing.router_ids[rows],
                                    scores_NE.detach(), logits_NE.detach())  # fmt: skip
        loss = self._losses(moe_pass, logits_NE, scores_NE, expert_ids_NK)
        if loss is not None:
            routing = routing._replace(weights=_AddLossGrad.apply(routing.weights, loss))
        return routing


def router_records(gpt: Any) -> dict[int, RouterRecord]:
    """Instrument the routers of a GPTModel (one model chunk): {global layer index: its record}; none with sequence
    parallelism. Idempotent."""
    if gpt.config.sequence_parallel or not gpt.config.num_moe_experts:
        return {}
    records: dict[int, RouterRecord] = {}
    for layer in gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        index = layer.layer_number - 1  # megatron-core numbers the layers from 1, over the whole model
        record = router.router_replay
        records[index] = record if isinstance(record, RouterRecord) else RouterRecord(router, index)
    return records


@contextlib.contextmanager
def routed(records: dict[int, RouterRecord], moe_pass: MoEPass) -> Iterator[None]:
    """Run a forward of the records' chunk as `moe_pass`."""
    for record in records.values():
        record.begin(moe_pass)
    try:
        yield
    except BaseException:
        for record in records.values():  # the step is abandoned: no recompute comes
            record.queued.clear()
        raise
    finally:
        for record in records.values():
            record.current = None


class _ChunkLayers(NamedTuple):
    """A model chunk's MoE layers as moe.py's functions take a model."""

    config: ModelConfig
    layers: dict[int, RouterRecord]

    def moe_layers(self) -> dict[int, RouterRecord]:
        return self.layers


class StagePasses:
    """What `run_schedule` runs each micro-batch's forward through a model chunk in (a `StagePass`): the routers'
    pass (replay, the losses' weights), then, for a training step (`stats`), the chunk's routing metrics and loss
    values into the step's stats. `total_rows`: the rows of this rank's micro-batches; `num_dp`: the data-parallel
    size."""

    def __init__(
        self, config: ModelConfig, replay: bool, loss: PolicyLossConfig | None = None, stats: StepStats | None = None,
        total_rows: int = 0, num_dp: int = 1,
    ) -> None:  # fmt: skip
        self.config, self.replay, self.loss, self.stats = config, replay, loss, stats
        self.total_rows, self.num_dp = total_rows, num_dp
        self.num_moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))

    @contextlib.contextmanager
    def __call__(self, chunk: Any, micro: MicroBatch, weight: float, padded: Any) -> Iterator[None]:
        records: dict[int, RouterRecord] = chunk.moe_layers()
        if not records:
            yield
            return
        loss = self.loss or PolicyLossConfig()
        share = micro.num_tokens / max(self.total_rows, 1) / self.num_dp
        aux_coef = loss.moe_aux_loss_coef if loss.moe_aux_loss != "none" and self.stats is not None else 0.0
        z_coef = loss.moe_z_loss_coef if self.stats is not None else 0.0
        moe_pass = MoEPass(
            router_index(padded), micro.routing_NLK if self.replay else None, micro.sequence_rows, loss.moe_aux_loss,
            aux_coef * share * weight, z_coef * share * weight,
        )  # fmt: skip
        with routed(records, moe_pass):
            yield
        if self.stats is not None and weight:
            self._add_stats(self.stats, records, micro, loss, share)

    def _add_stats(
        self, stats: StepStats, records: dict[int, RouterRecord], micro: MicroBatch, loss: PolicyLossConfig,
        share: float,
    ) -> None:  # fmt: skip
        """The chunk's part of the step's MoE stats (PolicyStep's for a whole model: routing metrics, the losses, their
        terms, and the terms in `loss`)."""
        chunk: Any = _ChunkLayers(self.config, records)
        part = len(records) / self.num_moe_layers  # the chunk's share of the model's MoE layers
        for name, (value, count) in routing_metrics(chunk, micro.routing_NLK).items():
            stats.add_mean(name, value, count * part if name in LAYER_MEANS else count)
        values: dict[str, tuple[float, float]] = {}  # loss name -> (its value over the chunk's layers, coef)
        if loss.moe_aux_loss != "none":
            values["moe_aux_loss"] = (float(balance_loss(chunk, loss.moe_aux_loss, micro.sequence_rows)),
                                      loss.moe_aux_loss_coef)  # fmt: skip
        if loss.moe_z_loss_coef > 0:
            values["moe_z_loss"] = (float(z_loss(chunk)), loss.moe_z_loss_coef)
        for name, (value, coef) in values.items():
            stats.add_mean(name, value / part, micro.num_tokens * part)  # a sum over layers: the stages' parts add up
            stats.add(f"{name}_term", coef * value * share)
            stats.add("loss", coef * value * share)


def check_moe_layout(layout: MegatronConfig, replay: bool, loss: PolicyLossConfig) -> None:
    """Refuse what the routers' instrumentation does not cover (sequence parallelism), naming the settings."""
    wanted = [name for name, is_on in (("routing_replay", replay),
                                       (f"loss.moe_aux_loss={loss.moe_aux_loss}", loss.moe_aux_loss != "none"),
                                       ("loss.moe_z_loss_coef > 0", loss.moe_z_loss_coef > 0)) if is_on]  # fmt: skip
    if wanted and layout.sequence_parallel:
        raise ValueError(
            f"the Megatron backend does not support {', '.join(wanted)} with megatron.sequence_parallel yet (each TP "
            "rank's router sees its share of the tokens); split the experts with ep / etp instead, or use fsdp2"
        )
