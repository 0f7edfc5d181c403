"""Speculative decoding with an online draft, measured: the same RL run several ways, side by side, as JSON.

One bootstrapped policy (a Qwen3 trunk with one MTP module, both trained by SFT on `spec_task.py`'s counting rows)
runs the same RL job with `spec.mode=off` (no speculative decoding), `frozen` (the engine drafts with the MTP module
as bootstrapped) and `online` (it drafts with the MTP module, which trains on every rollout batch), from the same
seeds, on the local cluster, in deterministic mode. The task's RL reward pulls the policy away from the SFT's
distribution (spec_task.py), so a frozen draft falls behind while an online one follows.

The rollout runs where speculative decoding is the right tool: few sequences at a time
(`rollout.engine.max_running_requests`, default 4) and long outputs (~45 tokens). Per step it reports the accept
length (tokens per verify step), the rollout's tokens/s, the reward, the policy's KL to the initial policy on the
rollout tokens (`trainer.log_kl`) and the MTP loss; per mode, the mean rollout tokens/s over the second half of the
run, and the ratios the targets are set on (online / frozen >= 1.25, online / off >= 1.5). It checks that the
three runs' rewards, losses, trained tokens and final trunk weights are identical (speculative decoding changes no
token in deterministic mode), and reports the draft-to-target cost per token (multiply-adds of the MTP module vs
the trunk, LM head included in both). Then it runs the built-in example (`miles-orchestrator run`, shortened to
`--default-example-steps`) with each spec.mode: the fastest one is the example's default.

`--arms all` adds an EAGLE-3 draft (SpecForge's layout, `spec.draft=eagle3`: trained offline at the bootstrap on the
SFT rows with `miles-spec train --draft eagle3`, then frozen or trained online) and tree drafting (`--tree-topk`
branches, `--tree-tokens` verify tokens) beside the MTP chain: MTP vs EAGLE-3, chain vs tree, frozen vs online.
`--rounds R` runs every arm R times, interleaved (round r runs the arms in an order rotated by r, so no arm always
runs first or last on a machine whose speed drifts); each ratio is reported per round and as the median of the
rounds.

    uv run python benchmarks/spec.py --out benchmarks/results/spec.json
    uv run python benchmarks/spec.py --arms all --rounds 3 --rl-steps 40 --default-example-steps 0 \
        --out benchmarks/results/spec_drafts.json
    uv run python benchmarks/spec.py --smoke --out /tmp/spec_smoke.json      # CI's smoke version (< 1 minute)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import spec_task
import torch
from host import host_info
from safetensors.torch import load_file

from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_spec import DraftTrainConfig, MTPLoss, train_draft
from miles_trainer import SFTConfig, run_sft

MODES = ("off", "frozen", "online")
EAGLE3 = ("spec.draft=eagle3", "spec.draft_path={eagle3}")
# each arm's run-config overrides ({eagle3}: the bootstrapped EAGLE-3 draft; TREE: tree drafting)
ARMS: dict[str, tuple[str, ...]] = {
    "off": ("spec.mode=off",),
    "frozen": ("spec.mode=frozen",),
    "online": ("spec.mode=online",),
    "online_tree": ("spec.mode=online", "TREE"),
    "eagle3_frozen": ("spec.mode=frozen", *EAGLE3),
    "eagle3_online": ("spec.mode=online", *EAGLE3),
    "eagle3_online_tree": ("spec.mode=online", *EAGLE3, "TREE"),
}
# (name, numerator arm, denominator arm): the ratios of rollout tokens/s (and of accept length) reported
RATIOS = (
    ("online_vs_frozen", "online", "frozen"), ("online_vs_off", "online", "off"), ("frozen_vs_off", "frozen", "off"),
    ("eagle3_online_vs_eagle3_frozen", "eagle3_online", "eagle3_frozen"),
    ("eagle3_online_vs_off", "eagle3_online", "off"), ("eagle3_online_vs_mtp_online", "eagle3_online", "online"),
    ("online_tree_vs_online", "online_tree", "online"),
    ("eagle3_online_tree_vs_eagle3_online", "eagle3_online_tree", "eagle3_online"),
)  # fmt: skip
PER_STEP = ("step", "reward_mean", "kl", "rollout_tokens_per_s", "rollout_time_s", "spec_accept_length",
            "spec_accept_rate", "mtp_loss", "eagle3_loss", "eagle3_accuracy_0", "response_len_mean")  # fmt: skip
EQUAL_KEYS = ("reward_mean", "loss", "pg_loss", "grad_norm", "entropy", "num_tokens", "kl", "weight_version")
FULL = {"layers": 8, "hidden": 256, "sft_steps": 200, "rl_steps": 50, "prompts": 4, "samples": 4}
SMOKE = {"layers": 2, "hidden": 64, "sft_steps": 5, "rl_steps": 2, "prompts": 2, "samples": 2}


def model_shape(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": hidden // 8, "max_position_embeddings": 512,
        "num_nextn_predict_layers": 1,
    }  # fmt: skip


def multiply_adds_per_token(shape: dict[str, Any]) -> dict[str, float]:
    """Weight multiply-adds per token (attention over the context left out: short contexts here): the trunk (its
    layers + LM head) and one draft step (eh_proj + one decoder layer + the shared LM head)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    trunk = shape["num_hidden_layers"] * layer + h * v
    draft = 2 * h * h + layer + h * v
    return {"trunk": trunk, "draft": draft, "draft_to_target": draft / trunk}


def bootstrap(work: Path, settings: dict[str, Any], seed: int) -> tuple[Path, dict[str, Any]]:
    """The policy: a random trunk + MTP module with a tokenizer for the task, SFT'd together (MTPLoss); then an
    EAGLE-3 draft for it, trained on the same rows (`miles-spec train --draft eagle3`), in policy/eagle3."""
    rng = random.Random(seed)
    rows = [spec_task.sft_row(rng) for _ in range(settings["sft_steps"] * 32)]
    corpus = [row["prompt"] + " " + row["response"] for row in rows[:2000]]
    tokenizer = build_tokenizer(corpus, vocab_size=269)  # 259 bytes + specials, 10 merges: all the corpus has
    shape = model_shape(settings["layers"], settings["hidden"], len(tokenizer))
    save_random_model(work / "base", tiny_config("dense", **shape), seed=seed, tokenizer=tokenizer)
    data = work / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    optimizer = SFTConfig().optimizer.model_copy(update={"lr": 3e-3})
    config = SFTConfig(epochs=1, batch_size=32, seed=seed, optimizer=optimizer)
    began = time.perf_counter()
    history = run_sft(work / "base", data, work / "policy", config, kernel=KernelConfig(mode="fast", page_size=16),
                      log=lambda message: None, aux_losses=[MTPLoss()])  # fmt: skip
    sft_time = round(time.perf_counter() - began, 1)
    began = time.perf_counter()
    eagle3 = train_draft(
        work / "policy",
        data,
        work / "policy" / "eagle3",
        DraftTrainConfig(draft="eagle3", epochs=1, batch_size=32, lr=3e-3, seed=seed, ttt_length=5),
        log=lambda message: None,
    )
    return work / "policy", {"sft_time_s": sft_time, "sft_loss": history[-1]["loss"], "shape": shape,
                             "eagle3_time_s": round(time.perf_counter() - began, 1),
                             "eagle3_accuracy_0": eagle3[-1]["eagle3_accuracy_0"],
                             "eagle3_loss": eagle3[-1]["eagle3_loss"]}  # fmt: skip


def start_mode(arm: str, policy: Path, prompts: Path, run_dir: Path, settings: dict[str, Any], args: Any) -> Any:
    """The RL run of one arm (`ARMS`), started as `miles-orchestrator run` in a subprocess."""
    overrides = [
        f"model.path={policy}", f"data.source={prompts}", "data.num_eval_prompts=0", "reward.name=spec_task:reward",
        f"rollout.num_prompts_per_step={settings['prompts']}", f"rollout.n_samples_per_prompt={settings['samples']}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.engine.max_running_requests={args.concurrency}",
        f"trainer.global_batch_size={settings['prompts'] * settings['samples']}", "filter.dynamic_sampling=false",
        f"trainer.optimizer.lr={args.lr}", "trainer.log_kl=true", f"run.num_steps={settings['rl_steps']}",
        "run.eval_every=0", "run.cluster=local", f"run.run_dir={run_dir}",
        f"reward.num_workers={1 if args.smoke else 2}",
        f"spec.num_steps={args.num_draft_steps}", f"spec.optimizer.lr={args.draft_lr}",
    ]  # fmt: skip
    tree = [f"spec.eagle_topk={args.tree_topk}",
            f"spec.num_draft_tokens={args.tree_tokens}"]  # fmt: skip
    for override in ARMS[arm]:
        overrides += tree if override == "TREE" else [override.format(eagle3=policy / "eagle3")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH")]))}  # fmt: skip
    return subprocess.Popen(["miles-orchestrator", "run", "--quiet", *overrides], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def finish(mode: str, process: Any) -> None:
    _, stderr = process.communicate()
    if process.returncode != 0:
        sys.exit(f"spec.mode={mode} failed ({process.returncode}):\n{stderr[-4000:]}")


def default_example(mode: str, steps: int, run_dir: Path) -> dict[str, Any]:
    """The built-in example (`miles-orchestrator run`, its bootstrapped policy from the user cache), shortened to
    `steps` steps without evaluations, with `spec.mode=mode`: its rollout speed decides the default spec.mode."""
    command = ["miles-orchestrator", "run", "--quiet", "run.cluster=local", f"run.num_steps={steps}",
               "run.eval_every=0", f"run.run_dir={run_dir}", f"spec.mode={mode}"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    lines = steps_of(run_dir)
    return {
        "command": " ".join(command),
        "rollout_tokens_per_s": pooled_tokens_per_s(lines),
        "rollout_time_s": sum(s["rollout_time_s"] for s in lines),
        "accept_length": statistics.mean(s["spec_accept_length"] for s in lines) if mode != "off" else None,
        "reward_mean_per_step": [s["reward_mean"] for s in lines],
    }


def pooled_tokens_per_s(steps: list[dict[str, Any]]) -> float:
    """All the steps' rollout tokens over all their rollout time."""
    return sum(s["rollout_tokens_per_s"] * s["rollout_time_s"] for s in steps) / sum(
        s["rollout_time_s"] for s in steps
    )


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if line["step"] > 0]


def _positions(step: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in step.items() if k.startswith("spec_accept_rate_pos")}


def trunk_weights_equal(a: Path, b: Path, num_layers: int) -> bool:
    """Final weights of two runs equal on every tensor but the MTP module's (`model.layers.{num_layers}.*`)."""
    draft = f"model.layers.{num_layers}."
    for file in sorted(a.glob("*.safetensors")):
        x, y = load_file(file), load_file(b / file.name)
        if any(not torch.equal(x[k], y[k]) for k in x if not k.startswith(draft)):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/spec.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks the script runs")
    parser.add_argument("--concurrency", type=int, default=4, help="rollout.engine.max_running_requests")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-steps", type=int, default=5, help="spec.num_steps")
    parser.add_argument("--lr", type=float, default=2e-4, help="the policy's RL learning rate (the run default)")
    parser.add_argument("--draft-lr", type=float, default=1e-3, help="spec.optimizer.lr (online mode)")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the RL steps")
    parser.add_argument("--policy", default=None, help="reuse a policy an earlier run of this script bootstrapped")
    parser.add_argument("--keep", default=None, help="keep the work directory (policy, runs) here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--default-example-steps", type=int, default=30,
                        help="also run the built-in example this many steps per spec.mode (0: skip)")  # fmt: skip
    parser.add_argument(
        "--arms",
        default=",".join(MODES),
        help=f"comma-separated arms of {list(ARMS)}, or all (default: the MTP chain's three modes)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of every arm, interleaved")
    parser.add_argument("--tree-topk", type=int, default=2, help="tree arms: spec.eagle_topk")
    parser.add_argument("--tree-tokens", type=int, default=8,
                        help="tree arms: spec.num_draft_tokens")  # fmt: skip
    args = parser.parse_args()
    arms = list(ARMS) if args.arms == "all" else args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or "off" not in arms:
        sys.exit(f"--arms {args.arms}: arms are {list(ARMS)} or all, and must include off")
    settings = dict(SMOKE if args.smoke else FULL)
    if args.rl_steps:
        settings["rl_steps"] = args.rl_steps
    work = Path(args.keep or tempfile.mkdtemp(prefix="miles-spec-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.policy:
        policy, boot = Path(args.policy), json.loads((Path(args.policy) / "bootstrap.json").read_text())
    else:
        policy, boot = bootstrap(work, settings, args.seed)
        (policy / "bootstrap.json").write_text(json.dumps(boot))
    prompts = work / "prompts.jsonl"
    rows = spec_task.prompt_rows(settings["rl_steps"] * settings["prompts"], seed=args.seed + 1)
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs: dict[str, Any] = {}
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    dirs = {arm: [work / f"{arm}_r{r}" for r in range(args.rounds)] for arm in arms}
    for arm in arms:
        for run_dir in dirs[arm]:
            shutil.rmtree(run_dir, ignore_errors=True)
    if args.smoke:  # all at once: the smoke checks identity, its timings mean nothing
        processes = {arm: start_mode(arm, policy, prompts, dirs[arm][0], settings, args) for arm in arms}
        for arm, process in processes.items():
            finish(arm, process)
    else:  # one at a time, round by round, each round in an order rotated by its index
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                began = time.perf_counter()
                finish(arm, start_mode(arm, policy, prompts, dirs[arm][r], settings, args))
                walls[arm].append(time.perf_counter() - began)
                print(f"round {r} {arm}: {walls[arm][-1]:.0f} s", flush=True)
    for arm in arms:
        rounds = []
        for run_dir in dirs[arm][: 1 if args.smoke else args.rounds]:
            steps = steps_of(run_dir)
            second_half = steps[len(steps) // 2 :]
            rounds.append({
                "rollout_tokens_per_s_second_half": pooled_tokens_per_s(second_half),
                "rollout_time_s_second_half": sum(s["rollout_time_s"] for s in second_half),
                "accept_length_second_half": (
                    statistics.mean(s["spec_accept_length"] for s in second_half) if arm != "off" else None
                ),
            })  # fmt: skip
        runs[arm] = {
            "overrides": list(ARMS[arm]),
            "wall_time_s": [round(w, 1) for w in walls[arm]] or None,
            "rounds": rounds,
            "rollout_tokens_per_s_second_half": statistics.median(
                r["rollout_tokens_per_s_second_half"] for r in rounds
            ),
            "accept_length_second_half": (
                statistics.median(r["accept_length_second_half"] for r in rounds) if arm != "off" else None
            ),
            "per_step": [{k: s.get(k) for k in PER_STEP} | _positions(s) for s in steps_of(dirs[arm][0])],
        }
        print(arm, {k: v for k, v in runs[arm].items() if k not in ("per_step", "rounds")}, flush=True)
    example: dict[str, Any] = {}
    if args.default_example_steps and not args.smoke:
        for mode in MODES:
            example[mode] = default_example(mode, args.default_example_steps, work / f"default_{mode}")
            print("default example", mode, {k: v for k, v in example[mode].items() if k != "reward_mean_per_step"})
    histories = {arm: steps_of(dirs[arm][0]) for arm in arms}
    identical = all(
        [s.get(k) for s in histories[arm]] == [s.get(k) for s in histories["off"]] for arm in arms for k in EQUAL_KEYS
    )
    layers = boot["shape"]["num_hidden_layers"]
    weights = all(trunk_weights_equal(dirs["off"][0] / "final", dirs[arm][0] / "final", layers) for arm in arms)
    speedups, per_round = {}, {}
    for name, top, bottom in RATIOS:
        if top in runs and bottom in runs:
            ratios = [a["rollout_tokens_per_s_second_half"] / b["rollout_tokens_per_s_second_half"]
                      for a, b in zip(runs[top]["rounds"], runs[bottom]["rounds"], strict=True)]  # fmt: skip
            speedups[name], per_round[name] = statistics.median(ratios), ratios
    result = {
        "what": "the same RL run with each arm (spec.mode off / frozen / online; MTP or EAGLE-3; chain or tree): "
        "rollout speed, acceptance, reward, drift",
        "command": " ".join(["python", *sys.argv]),
        "settings": settings | {k: v for k, v in vars(args).items() if k not in ("out", "keep")} | {"arms": arms},
        "model": boot["shape"],
        "multiply_adds_per_token": multiply_adds_per_token(boot["shape"]),
        "bootstrap": {k: v for k, v in boot.items() if k != "shape"},
        "timings_meaningful": not args.smoke,
        "host": host_info(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "identical_rewards_losses_kl_per_step": identical,
        "identical_final_trunk_weights": weights,
        "speedup_second_half": speedups,
        "speedup_second_half_per_round": per_round,
        "runs": runs,
        "default_example": example,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    headline = ("identical_rewards_losses_kl_per_step", "identical_final_trunk_weights", "speedup_second_half",
                "multiply_adds_per_token")  # fmt: skip
    print(json.dumps({k: result[k] for k in headline}, indent=2))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
