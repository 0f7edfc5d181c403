"""`miles-orchestrator mismatch RUN_DIR --step N`: where the trainer's log-probs and the rollout's disagree.

Token level, from the saved step (run.save_rollouts): over every trained response token, |Δlogp| = |trainer −
rollout| — its distribution (quantiles, the share exactly 0, a histogram of log10 |Δ|), the worst tokens with the
text before them, and the mean and max by response position and by response length. The trainer's log-probs are
the ones it recomputed for the step (fast mode, SGLang engines, low precision, tokens of another weight version);
a true on-policy step recomputes none, and its measured mismatch (`train_rollout_logprob_abs_diff_max`) is 0, so
its trainer log-probs are the rollout's.

Layer level (`--layers`, the embedded engine): one batch of the step's sequences through both sides with forward
hooks on the embedding, every decoder layer and the final norm: the engine prefills each sequence (a single
`/generate` of prompt + response, one new token) and the trainer runs its log-prob forward on it; the first layer
whose outputs are not bitwise equal, and the first whose largest difference exceeds `tolerance` relative to the
layer's largest value, say where the two sides part. The engine side is its prefill: in deterministic mode a
prefill row is bitwise the decode row (batch-invariant kernels); in fast mode decode-only differences do not show.

Both write JSON and a PNG beside the run (RUN_DIR/mismatch/step_N.json, .png).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from miles_contracts import GenerateRequest, Sample, SamplingParams
from miles_orchestrator.rollout_dump import SavedStep

QUANTILES = (0.5, 0.9, 0.99, 0.999)
NUM_BINS = 10


def token_pairs(saved: SavedStep) -> list[tuple[list[float], list[float]]]:
    """(rollout, trainer) log-probs of each sample; ValueError when the step holds no trainer log-probs and its
    measured mismatch is not 0."""
    pairs = saved.logprob_pairs
    if pairs is not None:
        return pairs
    measured = (saved.outcome or {}).get("metrics", {}).get("train_rollout_logprob_abs_diff_max")
    if measured == 0.0:  # true on-policy: the trainer's log-probs equal the rollout's, as measured in training
        return [(s.rollout_logprobs or [], s.rollout_logprobs or []) for s in saved.samples]
    raise ValueError(
        f"step {saved.step}: the trainer did not recompute the log-probs (true on-policy) and the step's measured "
        f"mismatch is {measured}, not 0; nothing to compare token by token (use --layers)"
    )


def token_mismatch(
    saved: SavedStep, tokenizer: Any | None = None, num_worst: int = 20, context: int = 12
) -> dict[str, Any]:
    """The token-level report (module docstring) over the step's trained tokens."""
    rows = []  # (|Δ|, Δ, sample, position, rollout log-prob, trainer log-prob)
    for i, ((rollout, trainer), sample) in enumerate(zip(token_pairs(saved), saved.samples, strict=True)):
        mask = sample.effective_loss_mask()
        for t, (r, p) in enumerate(zip(rollout, trainer, strict=True)):
            if mask[t]:
                rows.append((abs(p - r), p - r, i, t, r, p))
    if not rows:
        raise ValueError(f"step {saved.step} has no trained token")
    deltas = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    lengths = [len(s.response_tokens) for s in saved.samples]
    report: dict[str, Any] = {
        "step": saved.step,
        "num_tokens": len(rows),
        "mean": float(deltas.mean()),
        "signed_mean": sum(r[1] for r in rows) / len(rows),
        "max": float(deltas.max()),
        "fraction_exact": float((deltas == 0).double().mean()),
        "quantiles": {f"p{q * 100:g}": float(torch.quantile(deltas, q)) for q in QUANTILES},
        "histogram_log10": _log_histogram(deltas),
        "by_position": _binned([(r[3], r[0]) for r in rows], max(lengths)),
        "by_length": _binned([(lengths[r[2]], r[0]) for r in rows], max(lengths) + 1),
    }
    worst = sorted(rows, key=lambda r: -r[0])[:num_worst]
    report["worst_tokens"] = [{"sample": i} | _token_in_context(saved.samples[i], t, logps, tokenizer, context)
                              for _, _, i, t, *logps in worst]  # fmt: skip
    return report


def _log_histogram(deltas: torch.Tensor) -> dict[str, Any]:
    """Counts of log10 |Δ| in unit bins (from 1e-12), and the count exactly 0."""
    nonzero = deltas[deltas > 0]
    edges = list(range(-12, 2))
    counts = torch.histc(nonzero.log10().clamp(-12, 1), bins=len(edges) - 1, min=-12, max=1).tolist() if len(
        nonzero) else [0.0] * (len(edges) - 1)  # fmt: skip
    return {"edges": edges, "counts": [int(c) for c in counts], "num_exact": int((deltas == 0).sum())}


def _binned(points: list[tuple[int, float]], width: int) -> list[dict[str, float]]:
    """Mean and max of the values in NUM_BINS equal bins of the keys [0, width)."""
    size = max(1, math.ceil(width / NUM_BINS))
    bins: dict[int, list[float]] = {}
    for key, value in points:
        bins.setdefault(key // size, []).append(value)
    return [{"from": b * size, "to": (b + 1) * size - 1, "count": len(v), "mean": sum(v) / len(v), "max": max(v)}
            for b, v in sorted(bins.items())]  # fmt: skip


def _token_in_context(
    sample: Sample, t: int, logps: list[float], tokenizer: Any | None, context: int
) -> dict[str, Any]:
    """One response token: where it is, both log-probs, and (with a tokenizer) its text and the text before it."""
    tokens = sample.prompt_tokens + sample.response_tokens
    at = len(sample.prompt_tokens) + t
    rollout, trainer = logps
    entry: dict[str, Any] = {
        "index": sample.index, "position": t, "token": sample.response_tokens[t], "abs_diff": abs(trainer - rollout),
        "rollout_logprob": rollout, "trainer_logprob": trainer,
    }  # fmt: skip
    if tokenizer is not None:
        entry["text"] = tokenizer.decode([tokens[at]])
        entry["context"] = tokenizer.decode(tokens[max(0, at - context) : at])
    return entry


def plot_token_mismatch(report: dict[str, Any], path: Any) -> None:
    """Three panels: the histogram of log10 |Δ|, |Δ| by response position, |Δ| by response length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hist, position, length) = plt.subplots(1, 3, figsize=(14, 3.8))
    histogram = report["histogram_log10"]
    hist.bar(histogram["edges"][:-1], histogram["counts"], width=0.9, align="edge")
    hist.set_xlabel("log10 |Δlogp|")
    hist.set_ylabel("tokens")
    hist.set_title(f"step {report['step']}: {histogram['num_exact']} of {report['num_tokens']} exactly 0")
    for axis, key, label in ((position, "by_position", "response position"), (length, "by_length", "response length")):
        bins = report[key]
        centers = [(b["from"] + b["to"]) / 2 for b in bins]
        axis.plot(centers, [b["mean"] for b in bins], "o-", label="mean")
        axis.plot(centers, [b["max"] for b in bins], "s--", label="max")
        axis.set_xlabel(label)
        axis.set_ylabel("|Δlogp|")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@contextmanager
def capturing(model: torch.nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Forward hooks on the embedding, each decoder layer of the trunk (not the MTP modules) and the final norm of a
    miles-kernels `CausalLM`: every call's output rows, in call order, under "embed", "layer_<i>", "norm"."""
    backbone: Any = model.model
    trunk: Any = model.trunk_layers
    named = [("embed", backbone.embed_tokens), *((f"layer_{i}", m) for i, m in enumerate(trunk)),
             ("norm", backbone.norm)]  # fmt: skip
    captured: dict[str, list[torch.Tensor]] = {name: [] for name, _ in named}

    def hook(name: str) -> Any:
        def record(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            rows = output.detach().to("cpu", torch.float64)
            captured[name].append(rows.reshape(-1, rows.shape[-1]))

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in named]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


async def layer_divergence(cluster: Any, samples: list[Sample], tolerance: float = 1e-3) -> dict[str, Any]:
    """Each sample through the engine (a prefill) and the trainer (its log-prob forward) of a `LocalCluster`, with
    `capturing` on both models; per layer, the largest |engine − trainer| over the rows both computed."""
    layers: dict[str, dict[str, float]] = {}
    for sample in samples:
        tokens = sample.prompt_tokens + sample.response_tokens
        await cluster.engine.flush_cache()  # the prefix cache would spare the engine rows of a shared prefix
        with capturing(cluster.engine_model) as engine:
            request = GenerateRequest(input_ids=tokens, sampling_params=SamplingParams(max_new_tokens=1))
            await cluster.engine.generate(request)
        with capturing(cluster.trainer_model) as trainer:
            await cluster.compute_logprobs([sample])
        for name in engine:
            if not engine[name] or not trainer[name]:
                raise RuntimeError(
                    f"{name}: the engine's or the trainer's forward did not run it (sample {sample.index})"
                )
            # the engine computed the sequence's rows (a chunked prefill: in order, the prefix cache flushed); the
            # trainer its rows from the start (then maybe padding)
            mine, theirs = torch.cat(engine[name]), torch.cat(trainer[name])[: len(tokens)]
            start = len(tokens) - len(mine)
            overlap = theirs[start:]
            mine = mine[: len(overlap)]
            diff = float((mine - overlap).abs().max()) if len(overlap) else 0.0
            scale = float(overlap.abs().max()) if len(overlap) else 0.0
            entry = layers.setdefault(name, {"max_abs_diff": 0.0, "max_abs_value": 0.0, "num_rows": 0})
            entry["max_abs_diff"] = max(entry["max_abs_diff"], diff)
            entry["max_abs_value"] = max(entry["max_abs_value"], scale)
            entry["num_rows"] += len(overlap)
    for entry in layers.values():
        entry["relative_diff"] = entry["max_abs_diff"] / entry["max_abs_value"] if entry["max_abs_value"] else 0.0
    order = list(layers)
    return {
        "num_samples": len(samples),
        "tolerance": tolerance,
        "first_inexact_layer": next((n for n in order if layers[n]["max_abs_diff"] > 0), None),
        "first_divergent_layer": next((n for n in order if layers[n]["relative_diff"] > tolerance), None),
        "layers": layers,
    }


def plot_layers(report: dict[str, Any], path: Any) -> None:
    """The relative difference of each layer's outputs, log scale, the tolerance dashed; bitwise-equal layers as
    green marks on the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["layers"])
    values = [report["layers"][n]["relative_diff"] for n in names]
    floor = min([v for v in values if v > 0] + [report["tolerance"]]) / 100
    figure, axis = plt.subplots(figsize=(max(6, len(names) * 0.35), 3.8))
    axis.semilogy(range(len(names)), [max(v, floor) for v in values], "-", color="tab:blue", alpha=0.5)
    differing = [(i, v) for i, v in enumerate(values) if v > 0]
    if differing:
        axis.semilogy(*zip(*differing, strict=True), "o", color="tab:blue", label="differs")
    equal = [i for i, v in enumerate(values) if v == 0]
    if equal:
        axis.semilogy(equal, [floor] * len(equal), "o", color="tab:green", label="bitwise equal")
    axis.axhline(report["tolerance"], linestyle="--", color="gray", label=f"tolerance {report['tolerance']:g}")
    axis.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
    axis.set_ylabel("max |engine − trainer| / max |value|")
    first = f"first divergent: {report['first_divergent_layer']}, first inexact: {report['first_inexact_layer']}"
    axis.set_title(first)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
