"""How much the default example learns across CPUs and seeds: a matrix of `miles-orchestrator run`s, as JSON.

Runs are bitwise reproducible on one machine, but another CPU takes other kernel code paths (ATen, MKL and oneDNN
dispatch by ISA), which round differently, so the bootstrap SFT and the RL run follow another trajectory. This script
emulates other CPUs on this one by changing the kernels' dispatch, and adds seeds, then runs the example in every
cell of that matrix, each from its own empty bootstrap cache (the bootstrap is part of what differs):

- dispatch `native`: what this CPU picks by itself;
- `avx2`: `ATEN_CPU_CAPABILITY=avx2 MILES_NATIVE_ISA=avx2`, ATen's AVX2 kernels and the native kernels' AVX2 build,
  as on a CPU without AVX-512 (on an AVX-512 CPU this changes softmax / log-softmax bits and torch.randn's, not
  MKL's GEMMs);
- `default`: `ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`, ATen's scalar kernels and MKL's conditional
  numerical reproducibility mode (MKL's GEMMs, softmax and activations round differently);
- seed `s`: `run.seed=s data.seed=s` (another base-model initialization, SFT data, prompt order and samples).

The native kernels (`miles_kernels.native`, the deterministic path's GEMMs, attention and RMSNorm) give the same
bits in every build (`MILES_NATIVE_ISA=avx512|avx2|generic`; the fingerprint hashes them), so `default` keeps their
vector build: the generic one, one float at a time, would only make its cells some 15x slower. What differs
between the settings is the torch ops around them (torch.randn's initialization, softmax, SiLU, ...).

The JSON records, per dispatch setting, the capability torch chose and a fingerprint of a few ops' result bits (so it
shows which settings change the bits on the machine that ran it), and per cell: the bootstrap's probe pass@1 at
every check, where it stopped and whether it reached its target before its cap, held-out greedy pass@1 at every
evaluation, the gain (last evaluation minus the first), the largest train/rollout log-prob mismatch, the median step
time and the wall time; then the gains' min / median / max and whether every cell met the goal. Cells run on the
local cluster (engine and trainer in one process: the same metric lines as on Ray, bit for bit), `--parallel` at a
time, each on `run.num_threads=1` (the bootstrap SFT runs on one thread anyway).

    uv run python benchmarks/robustness.py --out benchmarks/results/robustness.json                 # 9 cells
    uv run python benchmarks/robustness.py --config examples/moe.yaml --min-gain 0.15 \\
        --out benchmarks/results/robustness_moe.json
    uv run python benchmarks/robustness.py --dispatch avx2 --seeds 1 --num-steps 40 --out /tmp/r.json  # one cell
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from default_run import metric_lines
from host import host_info

DISPATCH = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MILES_NATIVE_ISA": "avx2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}
PROBE_LINE = re.compile(r"bootstrap step (\d+): probe pass@1 ([\d.]+)% \(target (\d+)%\)")


def fingerprint() -> dict[str, Any]:
    """Hashes of a few ops' result bits on fixed inputs, at the example's shapes (hidden 256, 8 heads): two
    dispatch settings that give the same hashes run the same bits for these ops."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from miles_kernels import native

    rng = np.random.default_rng(0)  # not torch.randn: its bits change with ATen's dispatch too

    def randn(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

    x, w, scores = randn(64, 256), randn(768, 256), randn(8, 64, 64)
    outputs = {
        "linear": F.linear(x, w),
        "matmul": x @ w.T,
        "softmax": torch.softmax(scores, -1),
        "log_softmax": torch.log_softmax(scores, -1),
        "rms_norm": x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
        "silu": F.silu(x),
        "exp": x.exp(),
    }
    native_isa = None
    if native.status() is True:  # the deterministic path's own kernels (their ISA builds give the same bits)
        native_isa = native.isa()
        q = randn(32, 8, 32)  # one sequence of 32 tokens, 8 heads of 32
        k_pages, v_pages = randn(2, 2, 8, 16, 32)  # 2 pages of 16 slots
        positions, seqs, tables = torch.arange(32), torch.zeros(32, dtype=torch.long), torch.tensor([[0, 1]])
        outputs |= {
            "native_linear": native.native_linear(x, w),
            "native_attention": native.native_attention(q, k_pages, v_pages, positions, seqs, tables, 32**-0.5)[0],
            "native_rms_norm": native.native_rms_norm(x, torch.ones(256), 1e-6)[0],
        }
    hashes = {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:12] for name, t in outputs.items()}
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_isa": native_isa,
            "op_hashes": hashes}  # fmt: skip


def dispatch_env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    return env | DISPATCH[name]


def dispatch_fingerprints(names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        result = subprocess.run([sys.executable, __file__, "--fingerprint"], env=dispatch_env(name),
                                capture_output=True, text=True, check=True)  # fmt: skip
        out[name] = {"env": DISPATCH[name], **json.loads(result.stdout)}
    native = out.get("native", {}).get("op_hashes", {})
    for entry in out.values():
        entry["ops_differing_from_native"] = [op for op, h in entry["op_hashes"].items() if native.get(op) != h]
    return out


def probe_history(log: str) -> list[dict[str, Any]]:
    return [{"step": int(m[1]), "probe_pass_at_1": float(m[2]) / 100} for m in PROBE_LINE.finditer(log)]


def run_cell(dispatch: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cell = work / f"{dispatch}-seed{seed}"
    cell.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cell / "run", ignore_errors=True)
    if not args.bootstrap_caches:
        shutil.rmtree(cell / "cache", ignore_errors=True)  # a cold bootstrap in every cell
    caches = Path(args.bootstrap_caches) if args.bootstrap_caches else work  # reused: the bootstrap is not re-run
    env = dispatch_env(dispatch) | {"MILES_CACHE_DIR": str(caches / cell.name / "cache")}
    overrides = [f"run.run_dir={cell / 'run'}", "run.cluster=local", "run.num_threads=1", f"run.seed={seed}",
                 f"data.seed={seed}", *args.override]  # fmt: skip
    if args.num_steps is not None:
        overrides.append(f"run.num_steps={args.num_steps}")
    command = ["miles-orchestrator", "run", *(["--config", args.config] if args.config else []), *overrides]
    began = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    out: dict[str, Any] = {"dispatch": dispatch, "seed": seed, "command": " ".join(command)}
    if result.returncode != 0:
        return out | {"error": f"exit {result.returncode}: {result.stderr[-2000:]}"}
    run_dir = cell / "run"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    lines = metric_lines(run_dir)
    steps = [line for line in lines if line["step"] > 0]
    evals = {line["step"]: line["eval_pass@1"] for line in lines if "eval_pass@1" in line}
    probes = probe_history((run_dir / "run.log").read_text())
    target = config["model"]["bootstrap_target_pass_rate"]
    reached = bool(probes) and target is not None and probes[-1]["probe_pass_at_1"] >= target
    first, last = evals[min(evals)], evals[max(evals)]
    return out | {
        "wall_time_s": round(wall, 1),
        "bootstrap": {
            "cap_steps": config["model"]["bootstrap_steps"], "target": target, "probes": probes,
            "stopped_at_step": probes[-1]["step"] if reached else config["model"]["bootstrap_steps"],
            "reached_target_before_cap": reached,
        },
        "num_steps": len(steps),
        "eval_pass_at_1": evals,
        "gain": round(last - first, 4),
        "best_gain": round(max(evals.values()) - first, 4),
        "reward_mean_first_5_steps": round(statistics.mean(line["reward_mean"] for line in steps[:5]), 4),
        "reward_mean_last_5_steps": round(statistics.mean(line["reward_mean"] for line in steps[-5:]), 4),
        "reward_mean_per_step": [round(line["reward_mean"], 4) for line in steps],
        "max_train_rollout_logprob_abs_diff": max(line.get("train_rollout_logprob_abs_diff_max", 0.0)
                                                  for line in steps),
        "median_step_time_s": round(statistics.median(line["step_time_s"] for line in steps), 3),
    }  # fmt: skip


def summary(cells: list[dict[str, Any]], min_gain: float) -> dict[str, Any]:
    done = [c for c in cells if "gain" in c]
    gains = sorted(c["gain"] for c in done)
    if not gains:
        return {"cells_done": 0, "cells_failed": len(cells)}
    return {
        "cells_done": len(done),
        "cells_failed": len(cells) - len(done),
        "gain_min": gains[0], "gain_median": statistics.median(gains), "gain_max": gains[-1],
        "start_pass_at_1_min": min(c["eval_pass_at_1"][min(c["eval_pass_at_1"])] for c in done),
        "start_pass_at_1_max": max(c["eval_pass_at_1"][min(c["eval_pass_at_1"])] for c in done),
        "min_gain_goal": min_gain,
        "every_cell_meets_gain": len(done) == len(cells) and gains[0] >= min_gain,
        "every_bootstrap_reached_target": len(done) == len(cells)
        and all(c["bootstrap"]["reached_target_before_cap"] for c in done),
        "max_bootstrap_steps": max(c["bootstrap"]["stopped_at_step"] for c in done),
        "max_mismatch": max(c["max_train_rollout_logprob_abs_diff"] for c in done),
        "max_wall_time_s": max(c["wall_time_s"] for c in done),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/robustness.json", help="JSON output path")
    parser.add_argument("--config", default=None, help="an example config to run instead of the defaults")
    parser.add_argument("--dispatch", nargs="+", default=list(DISPATCH), choices=list(DISPATCH))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-steps", type=int, default=None, help="shorten every run to this many RL steps")
    parser.add_argument("--override", nargs="*", default=[], help="extra section.field=value for every cell")
    parser.add_argument("--parallel", type=int, default=2, help="cells at a time (one thread each)")
    parser.add_argument("--min-gain", type=float, default=0.25, help="the goal: held-out pass@1 gain in every cell")
    parser.add_argument("--keep", default=None, help="keep the cells' run directories and caches under this path")
    parser.add_argument(
        "--bootstrap-caches",
        default=None,
        help="an earlier matrix's --keep path: each cell "
        "reuses its bootstrap cache (to compare RL settings on the same bootstrapped policies)",
    )
    parser.add_argument("--fingerprint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fingerprint:
        print(json.dumps(fingerprint()))
        return

    work = Path(args.keep or tempfile.mkdtemp(prefix="miles-robustness-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "script_command": " ".join(["python", *sys.argv]),
        "host": host_info(),
        "dispatch": dispatch_fingerprints(args.dispatch),
        "config": args.config or "defaults",
        "overrides": args.override,
        "bootstrap_caches": args.bootstrap_caches,
        "num_steps": args.num_steps,
        "cells": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    matrix = [(d, s) for s in args.seeds for d in args.dispatch]
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for cell in pool.map(lambda ds: run_cell(ds[0], ds[1], args, work), matrix):
            result["cells"].append(cell)
            result["summary"] = summary(result["cells"], args.min_gain)
            out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive an interrupted matrix
            print(json.dumps({k: cell.get(k) for k in ("dispatch", "seed", "eval_pass_at_1", "gain", "error")}))
    result["matrix_wall_time_s"] = round(time.perf_counter() - began, 1)
    result["summary"] = summary(result["cells"], args.min_gain)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
