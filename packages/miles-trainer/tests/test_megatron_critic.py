"""PPO's critic on the Megatron backend (docs/megatron.md, "PPO's critic"), against the FSDP2 backend's critic on the
same batch, advantages and value targets (fsdp_worker.py's, with MILES_TEST_CRITIC; one FSDP2 rank each).

Multi-process tier (real gloo rank processes on the CPU, megatron_worker.py):
- kind="separate" on two pipeline stages, two steps whose first is a warm-up (the critic moves alone): the values
  before the second step (the critic's after the first), its value loss, clip fraction, critic gradient norm, the
  policy's loss and gradient norm, the values after it, and the critic's (model and head) and the policy's parameters
  after both steps agree with FSDP2's; a run that resumes from the checkpoint between the steps (the critic's chunks,
  head and AdamW state in dist_checkpointing) makes the second step bit for bit.
- kind="value_head" on two data-parallel ranks, on the Miles layers (deterministic mode's; the separate critic runs
  megatron-core's modules): two joint steps (the head's loss in the policy's pass, its gradient
  summed over the ranks by hand; the second, after an offload and onload, trains the trunk by the value loss too, the
  head being no longer zero), the same numbers.
Two steps, since a zero head gives the trunk no value gradient in the first. CPU numerics tier (one rank in this
process): offload / onload moves the critic's tensors and brings them back bit for bit, and a step without value
targets is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_kernels import save_model
from miles_kernels.testing import random_model, tiny_config

megatron = pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_worker.py")
SEPARATE = {"MILES_TEST_CRITIC": "separate", "MILES_TEST_CRITIC_WARMUP": "1"}
VALUE_HEAD = {"MILES_TEST_CRITIC": "value_head"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("megatron-critic") / "model"
    save_model(random_model(tiny_config("dense"), seed=4), path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory) -> dict:
    """FSDP2's two steps with each critic on one rank (the separate critic's first a warm-up). They are fsdp_worker's
    `offload` mode (an offload and onload between the steps, which changes no bit), not `two-steps`: its checkpoint
    between them would make FSDP2's AdamW of the policy, which the warm-up did not step, take a step with zero
    gradients (torch.distributed.checkpoint initializes an optimizer without state so), and the policy's first update
    would then use the bias correction of a second step."""
    from test_fsdp import run_ranks

    root = tmp_path_factory.mktemp("megatron-critic-fsdp")
    out = {}
    for name, mode, env in (("separate", "offload", SEPARATE), ("value_head", "offload", VALUE_HEAD)):
        out[name] = outputs(root / name, *run_ranks(model_dir, root / name, 1, mode, extra_env=env))
    return out


def outputs(out_dir: Path, params: dict, metrics: dict) -> dict:
    """A run's policy parameters, metrics, critic tensors and the critic's values before and after the last step."""
    values = json.loads((out_dir / "critic.json").read_text())
    return {"params": params, "metrics": metrics, "critic": load_file(out_dir / "critic.safetensors"), **values}


def assert_matches_fsdp2(run: dict, fsdp: dict, model_atol: float = 2e-6, values_atol: float = 2e-6) -> None:
    """The step's numbers within test_megatron.py's tolerances: losses and norms 1e-6 relative, the head's parameters
    2e-6, the values `values_atol`, the models' (the policy's, a separate critic's) `model_atol`."""
    metrics, expected = run["metrics"], fsdp["metrics"]
    for key in ("vf_loss", "vf_clip_fraction", "value_mean", "critic_grad_norm", "critic_lr", "critic_values_sum",
                "loss", "pg_loss", "grad_norm", "entropy", "num_tokens", "skipped_update"):  # fmt: skip
        assert metrics[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    for when in ("before", "after"):
        for got, want in zip(run[when], fsdp[when], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=values_atol)
    for name in ("params", "critic"):
        assert run[name].keys() == fsdp[name].keys(), name
        for key, tensor in fsdp[name].items():
            atol = 2e-6 if key.startswith("value_head.") else model_atol
            torch.testing.assert_close(run[name][key], tensor, rtol=0, atol=atol, msg=f"{name} {key}")


def test_a_separate_critic_on_two_stages_matches_fsdp2_and_resumes_bit_exact(model_dir, reference, tmp_path) -> None:
    from test_fsdp import run_ranks

    env = SEPARATE | {"MILES_TEST_MEGATRON": json.dumps({"pp": 2})}
    straight = outputs(tmp_path / "two", *run_ranks(model_dir, tmp_path / "two", 2, "two-steps",
                                                    extra_env=env, worker=WORKER))  # fmt: skip
    fsdp = reference["separate"]
    assert any(v != 0.0 for row in straight["before"] for v in row)  # the warm-up step trained the critic
    assert straight["metrics"]["skipped_update"] == 0.0 and "pg_loss" in straight["metrics"]
    # models: 1e-4, for weights whose gradients are near AdamW's eps, where the normalized step magnifies float32
    # rounding (one weight in thousands of a few tensors, after two steps: up to 3e-5 against the torch-tiled GEMMs,
    # 9.2e-5 for one of the critic's 8,192 down_proj weights against the native kernels); values: 1e-5
    # (torch.testing's float32 atol), megatron-core's GEMMs on those weights (up to 2.4e-6 on AVX-512)
    assert_matches_fsdp2(straight, fsdp, model_atol=1e-4, values_atol=1e-5)
    assert {"value_head.score.weight", "model.norm.weight"} <= straight["critic"].keys()
    resumed = outputs(tmp_path / "resume", *run_ranks(model_dir, tmp_path / "resume", 2, "resume",
                                                      extra_env=env, worker=WORKER))  # fmt: skip
    assert resumed["metrics"] == straight["metrics"]
    assert resumed["before"] == straight["before"] and resumed["after"] == straight["after"]
    for name in ("params", "critic"):
        for key, tensor in straight[name].items():
            assert torch.equal(resumed[name][key], tensor), f"{name} {key}"


def test_a_value_head_on_two_data_parallel_ranks_matches_fsdp2(model_dir, reference, tmp_path) -> None:
    from test_fsdp import run_ranks

    env = VALUE_HEAD | {"MILES_TEST_MEGATRON": json.dumps({"layer_spec": "miles"})}
    run = outputs(tmp_path / "dp2", *run_ranks(model_dir, tmp_path / "dp2", 2, "offload", extra_env=env,
                                               worker=WORKER))  # fmt: skip
    assert run["critic"].keys() == {"value_head.score.weight", "value_head.score.bias"}
    assert run["metrics"]["critic_values_sum"] != 0.0
    assert_matches_fsdp2(run, reference["value_head"])


def test_the_critic_offloads_bit_exact_and_needs_value_targets(model_dir, tmp_path) -> None:
    """One rank in this process: a separate critic's chunks, head, AdamW state and DDP buffers leave and come back bit
    for bit; a train step without returns / old_values is refused."""
    from fsdp_worker import KERNEL, batch
    from test_megatron import one_rank_group

    from miles_trainer import BackendConfig, CriticConfig, MegatronBackend, megatron_on_cpu

    samples, advantages = batch()
    with one_rank_group(tmp_path / "pg"), megatron_on_cpu():
        backend = MegatronBackend(model_dir, KERNEL, config=BackendConfig(name="megatron"),
                                  critic=CriticConfig())  # fmt: skip
        values = backend.compute_values(samples)
        assert [len(row) for row in values] == [len(s.response_tokens) for s in samples]
        assert all(v == 0.0 for row in values for v in row)  # a zero head
        with pytest.raises(ValueError, match="returns and old_values"):
            backend.train_step(samples, advantages)
        returns = [[float(s.reward)] * len(s.response_tokens) for s in samples]
        backend.train_step(samples, advantages, returns=returns, old_values=values)
        critic = backend.critic
        assert critic.optimizer is not None and critic.head is not None
        before = [t.detach().clone() for t in critic.params]
        moments = [s["exp_avg"].clone() for s in critic.optimizer.state.values()]

        def stored() -> list[int]:
            tensors = [*critic.params, *(s["exp_avg"] for s in critic.optimizer.state.values())]
            return [t.untyped_storage().nbytes() for t in tensors]

        assert all(stored())
        backend.offload()  # on a CPU device: to a file (host memory on CUDA), the storages emptied in place
        assert not any(stored()) and not any(backend.memory.manager.resident_bytes().values())
        buffers = [b for ddp in critic.ddp_modules for b in ddp.buffers]
        assert buffers and all(b.grad_data.untyped_storage().nbytes() == 0 for b in buffers)
        backend.onload()
        assert all(torch.equal(p, b) for p, b in zip(critic.params, before, strict=True))
        state = critic.optimizer.state.values()
        assert all(torch.equal(s["exp_avg"], m) for s, m in zip(state, moments, strict=True))
        assert backend.compute_values(samples) != values
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
