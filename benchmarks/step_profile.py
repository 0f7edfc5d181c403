"""Benchmark: where the time of Miles' RL step goes on the vs-TRL workload, by phase and by kind of op.

The workload is `vs_trl.py`'s (the same overrides, the SFT-bootstrapped policy, 8 prompts x 8 samples, up to 32 new
tokens, GRPO, one optimizer step per rollout), run as `miles-orchestrator run run.cluster=local run.colocate=false`
in this process. After `--warmup` steps, `torch.profiler` records `--steps` whole steps. Every op is attributed to
its phase, the engine's forward steps (`Scheduler._step`: model, sampling, scheduling) or the trainer's
`train_step` (forward, backward, optimizer), and counted as a GEMM (`aten::mm`, `bmm`, `addmm`, `baddbmm`: the
tiled linear layers, the attention products, the backward's weight and input gradients; `native::native_linear` and
`native::native_mm`: the native backend's) or not. The native kernels (C++ called through ctypes, not aten ops) are
recorded as ops named `native::<function>` (`--set kernel.linear_backend=native` etc. runs them). Engine steps are
also counted by their number of rows.

Each op is also attributed to the part of the model or loop it runs for (`by_part`): the forward ops inside the
model's calls of `linear`, the attention (`attention`, `packed_attention`, `write_kv`), `rms_norm`, RoPE
(`apply_rope`, `rope_cos_sin`), `swiglu`, the MoE routing and experts; the backward ops by the autograd node
that runs them (`_TiledMatmulBackward` is the linear layers', `BlockedAttentionBackward` the attention's, ...);
the engine's sampling (`sample_rows`) and the trainer's optimizer step (clipping + AdamW); the rest as `other`
(embedding, residual adds, the loss, packing, autograd's own nodes for plain ops). Each part's `ms` is the self CPU
time of its ops, `ops` their count; the phase's `unattributed_wall_ms` is its wall time minus all ops' self time
(Python, dispatch and the profiler's own cost).

Profiling adds a fixed cost to every op, so the non-GEMM share reads high; the op counts are exact. This is a
diagnosis, not a speed measurement: `vs_trl.py` and `rollout.py` measure speed.

    uv run python benchmarks/step_profile.py --out benchmarks/results/step_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import host_info
from torch.profiler import ProfilerActivity, profile, record_function

# The native kernels (miles_kernels.native, C++ through ctypes, not aten ops) record each call as a range named
# `native::<function>` under the profiler: counted as one op, its self time the call.
NATIVE_PREFIX = "native::"
GEMMS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "native::native_linear", "native::native_mm"}
PHASES = ("engine_step", "train_step")
# The model's calls (miles_kernels.model's names, and the MoE ops') each profiled as a part, forward.
MODEL_PARTS = {
    "linear": ("linear",),
    "attention": ("attention", "packed_attention", "write_kv"),
    "rms_norm": ("rms_norm",),
    "rope": ("apply_rope", "rope_cos_sin"),
    "swiglu": ("swiglu",),
    "moe": ("experts_forward", "route_softmax", "route_grouped_sigmoid"),
}
# Backward: the autograd node that runs an op names its part (substring of the node's name).
BACKWARD_PARTS = {
    "_TiledMatmulBackward": "linear",
    "_NativeMatmulBackward": "linear",
    "BlockedAttentionBackward": "attention",
    "_NativeAttentionBackward": "attention",
    "_RMSNormBackward": "rms_norm",
    "_NativeRMSNormBackward": "rms_norm",
    "_RopeBackward": "rope",
    "_SwiGLUBackward": "swiglu",
}
PART_PREFIX = "part::"


def _wrap(fn: Any, part: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(PART_PREFIX + part):
            return fn(*args, **kwargs)

    return wrapped


def _part_of(event: Any) -> str | None:
    """The innermost part an event runs for: a `part::` range, or a backward node of a part's Function."""
    parent = event
    while parent is not None:
        if parent.name.startswith(PART_PREFIX):
            return str(parent.name[len(PART_PREFIX) :])
        for node, part in BACKWARD_PARTS.items():
            if node in parent.name:
                return part
        parent = parent.cpu_parent
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/step_profile.json")
    parser.add_argument("--warmup", type=int, default=3, help="RL steps before the profiler starts")
    parser.add_argument("--steps", type=int, default=4, help="RL steps profiled")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="kernel.X=V",
        help="override of the workload, as vs_trl.py takes them (e.g. kernel.linear_backend=native)",
    )
    args = parser.parse_args()

    import miles_kernels.latent_attention as latent_module
    import miles_kernels.layers as layers_module
    import miles_kernels.model as model_module
    import miles_kernels.ops.moe as moe_module
    import miles_rollout.model_runner as runner_module
    import miles_rollout.scheduler as scheduler_module
    import miles_trainer.fsdp as fsdp_module
    from miles_orchestrator.cli import main as cli_main
    from miles_orchestrator.config import load_config
    from miles_orchestrator.data.bootstrap import bootstrap_policy

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_trl import workload_overrides  # the benchmark's own workload, not a copy of it

    workload = workload_overrides(argparse.Namespace(num_eval_prompts=20, set=args.set))
    policy = bootstrap_policy(load_config(None, workload))
    profiler = profile(activities=[ProfilerActivity.CPU])
    state: dict[str, Any] = {"train_steps": 0, "rows": [], "active": False}

    engine_step = scheduler_module.Scheduler._step

    def timed_engine_step(self: Any) -> None:
        rows = len(self._running) + sum(len(g.prompt_ids) - g.num_computed for g in self._prefilling)
        with record_function("engine_step"):
            start = time.perf_counter()
            engine_step(self)
        if state["active"]:
            state["rows"].append((rows, time.perf_counter() - start))

    train_step = fsdp_module.FSDP2Backend.train_step

    def profiled_train_step(self: Any, *a: Any, **kw: Any) -> Any:
        with record_function("train_step"):
            out = train_step(self, *a, **kw)
        state["train_steps"] += 1
        if state["train_steps"] == args.warmup:
            profiler.start()
            state["active"] = True
        elif state["train_steps"] == args.warmup + args.steps:
            profiler.stop()
            state["active"] = False
        return out

    for part, names in MODEL_PARTS.items():
        for name in names:  # wherever the model's modules call it from
            for module in (model_module, layers_module, latent_module, moe_module):
                if hasattr(module, name):
                    setattr(module, name, _wrap(getattr(module, name), part))
    runner_module.sample_rows = _wrap(runner_module.sample_rows, "sampling")
    fsdp_module.FSDP2Backend._finish_step = _wrap(fsdp_module.FSDP2Backend._finish_step, "optimizer")
    scheduler_module.Scheduler._step = timed_engine_step  # type: ignore[method-assign]
    fsdp_module.FSDP2Backend.train_step = profiled_train_step  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*workload, "run.cluster=local", "run.colocate=false", f"run.run_dir={tmp}/run",
                     f"model.path={policy}", "trainer.loss.kl_coef=0.0", f"run.num_steps={args.warmup + args.steps}",
                     "run.eval_every=1000", "run.seed=0"]  # fmt: skip
        if cli_main(["run", "--quiet", *overrides]) != 0:
            raise SystemExit("miles-orchestrator run failed")

    totals: dict[str, collections.Counter[str]] = {phase: collections.Counter() for phase in PHASES}
    counts: dict[str, collections.Counter[str]] = {phase: collections.Counter() for phase in PHASES}
    wall: dict[str, float] = collections.Counter()
    part_ms: dict[str, collections.Counter[str]] = {phase: collections.Counter() for phase in PHASES}
    part_ops: dict[str, collections.Counter[str]] = {phase: collections.Counter() for phase in PHASES}
    part_names: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for event in profiler.events():
        if event.name in PHASES:
            wall[event.name] += event.cpu_time_total / 1e3
            continue
        if event.name.startswith(PART_PREFIX):  # a range, not an op
            continue
        phase, parent = None, event.cpu_parent
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name
            parent = parent.cpu_parent
        if phase is None:
            continue
        totals[phase][event.name] += event.self_cpu_time_total / 1e3
        counts[phase][event.name] += 1
        if event.name.startswith(("aten::", NATIVE_PREFIX)):
            part = _part_of(event) or "other"
            part_ms[phase][part] += event.self_cpu_time_total / 1e3
            part_ops[phase][part] += 1
            part_names[phase, part][event.name] += 1
    by_rows: dict[str, list[float]] = collections.defaultdict(list)
    for rows, seconds in state["rows"]:
        bucket = "1-15" if rows < 16 else "16-63" if rows < 64 else "64" if rows == 64 else "65+"
        by_rows[bucket].append(seconds * 1e3)
    phases = {}
    for phase in PHASES:
        self_ms = sum(totals[phase].values())
        gemm_ms = sum(ms for name, ms in totals[phase].items() if name in GEMMS)
        phases[phase] = {
            "wall_ms_per_rl_step": round(wall[phase] / args.steps, 1),
            "self_cpu_ms_per_rl_step": round(self_ms / args.steps, 1),
            "gemm_ms_per_rl_step": round(gemm_ms / args.steps, 1),
            "gemm_share": round(gemm_ms / self_ms, 3) if self_ms else 0.0,
            "ops_per_rl_step": round(sum(counts[phase].values()) / args.steps),
            "gemm_calls_per_rl_step": round(sum(n for name, n in counts[phase].items() if name in GEMMS) / args.steps),
            "top_ops_ms_per_rl_step": {name: round(ms / args.steps, 2) for name, ms in totals[phase].most_common(12)},
            "top_ops_calls_per_rl_step": {name: round(n / args.steps) for name, n in counts[phase].most_common(12)},
            "by_part": {
                part: {
                    "ms": round(ms / args.steps, 1),
                    "ops": round(part_ops[phase][part] / args.steps),
                    "top_ops": {name: round(n / args.steps) for name, n in part_names[phase, part].most_common(8)},
                }
                for part, ms in part_ms[phase].most_common()
            },
            "unattributed_wall_ms_per_rl_step": round((wall[phase] - self_ms) / args.steps, 1),
        }
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "host": host_info(),
        "policy": policy,
        "workload": {
            "overrides": workload,
            "cluster": "local",
            "colocate": False,
            "warmup_steps": args.warmup,
            "profiled_steps": args.steps,
        },
        "phases": phases,
        "engine_steps_per_rl_step": round(len(state["rows"]) / args.steps, 1),
        "engine_step_ms_by_rows": {
            bucket: {"count": len(ms), "median_ms": round(sorted(ms)[len(ms) // 2], 2)}
            for bucket, ms in sorted(by_rows.items())
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
