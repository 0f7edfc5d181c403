"""True on-policy with the Megatron backend (docs/true-on-policy.md, "Megatron"): in deterministic mode its layers run
the engine's miles-kernels ops (`megatron_kernels`), so the log-probs it computes equal, bit for bit, the ones the
engine recorded while sampling them with its paged-KV decode (varied batch compositions, chunked prefill): through
pipeline stages, virtual stages, expert parallelism (tokens exchanged between the EP ranks) and data parallelism, in
float32 and bfloat16, at two micro-batch packings, and in a training step's own forward
(`train_rollout_logprob_abs_diff` exactly 0); the trainer reports the engine's kernel fingerprint, so the run's
version-0 check accepts it. Real rank processes over gloo (megatron_on_policy_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_true_on_policy import rollout

from miles_kernels import kernel_fingerprint, save_model
from miles_kernels.testing import random_model, tiny_config

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_on_policy_worker.py")
KINDS = {
    "glm4": {"kind": "glm", "num_hidden_layers": 4},  # a dense first layer, then sigmoid-routed MoE layers
    "moe": {"kind": "moe"},
    "dense6": {"kind": "dense", "num_hidden_layers": 6, "tie_word_embeddings": False},
}


def rolled_out(root: Path, kind: str, dtype: str = "float32") -> list:
    """A tiny model of `kind` in `dtype` saved under root/model and its rollout (root/samples.json): 12 samples of 7
    prompts, each response sampled by the engine's decode path with its log-probs recorded."""
    from megatron_on_policy_worker import kernel

    overrides = dict(KINDS[kind])
    model = random_model(tiny_config(overrides.pop("kind"), **overrides), kernel(dtype), seed=3)
    save_model(model, root / "model")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 17, 9, 30, 1, 12, 16)]
    samples = rollout(model, [prompts[i] for i in (0, 0, 1, 1, 1, 2, 3, 4, 4, 5, 6, 6)], 7, 1.0)
    (root / "samples.json").write_text(json.dumps([s.model_dump() for s in samples]))
    return samples


@pytest.mark.parametrize(
    ("kind", "world", "layout", "dtype"),
    [("glm4", 4, {"pp": 2, "ep": 2}, "float32"), ("moe", 2, {"ep": 2, "recompute": "full"}, "float32"),
     ("dense6", 3, {"pp": 3, "vpp": 2}, "float32"), ("dense6", 4, {"tp": 2, "pp": 2}, "float32"),
     ("glm4", 2, {"ep": 2}, "bfloat16")],
    ids=["glm4-pp2-ep2", "moe-ep2-recompute", "dense6-pp3-vpp2", "dense6-tp2-pp2-exact", "glm4-ep2-bf16"],
)  # fmt: skip
def test_megatron_logprobs_equal_the_engines_bitwise(
    kind: str, world: int, layout: dict, dtype: str, tmp_path: Path
) -> None:
    from megatron_on_policy_worker import kernel
    from test_fsdp import run_ranks

    samples = rolled_out(tmp_path, kind, dtype)
    outputs: list = []
    run_ranks(tmp_path / "model", tmp_path / "out", world=world, worker=WORKER, outputs=outputs,
              extra_env={"MILES_TEST_MEGATRON": json.dumps(layout), "MILES_TEST_DTYPE": dtype})  # fmt: skip
    assert [code for code, _ in outputs] == [0] * world, "\n".join(text[-3000:] for _, text in outputs)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    seen = set()
    for result in results:
        assert result["layers"] == "MilesSelfAttention"
        assert result["fingerprint"] == kernel_fingerprint(kernel(dtype), "cpu")  # the version-0 check passes
        for budget, rows in result["logprobs"].items():
            for index, got in zip(result["indices"], rows, strict=True):
                assert got == samples[index].rollout_logprobs, f"sample {index}, {budget} tokens per micro-batch"
                seen.add(index)
        assert result["metrics"]["train_rollout_logprob_abs_diff"] == 0.0
        assert result["metrics"]["train_rollout_logprob_abs_diff_max"] == 0.0
    assert seen == set(range(len(samples)))
