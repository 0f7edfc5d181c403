"""`miles-trainer convert` between Hugging Face directories and megatron-core `dist_checkpointing` directories, and
its `--check` (docs/megatron.md, "HF <-> Megatron conversion").

Tier: CPU, multi-process. Most tests run the command in this process (`cli.main`: one rank inside
`megatron_on_cpu()`); the layout tests run real processes: the console script writing from two gloo ranks, and the
Megatron backend's own two-rank training run (megatron_worker.py), whose checkpoint must convert to exactly what that
run's `export_hf` wrote (its backend's gather, not this command's loader, is the reference). A round trip must
return the source's tensors bit for bit, and `--check` must fail, naming the tensor and the prompt, on a corrupted
pair.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_kernels import iter_checkpoint
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_trainer.cli import main

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_worker.py")


def convert(*args: object) -> int:
    return main(["convert", *(str(a) for a in args)])


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(directory))


def assert_same_tensors(got: Path, want: Path) -> None:
    a, b = tensors(got), tensors(want)
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for name, tensor in b.items():
        assert a[name].dtype == tensor.dtype and torch.equal(a[name], tensor), name


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny float32 Qwen3 with a tokenizer, and its Megatron checkpoint (written by the command, one rank)."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(root / "hf", tiny_config("dense", vocab_size=len(tokenizer)), seed=2, tokenizer=tokenizer)
    assert convert("--src", root / "hf", "--dst", root / "megatron", "--to", "megatron") == 0
    return root / "hf", root / "megatron"


@pytest.mark.parametrize(
    ("kind", "dtype", "overrides"),
    [("dense", "float32", {}), ("dense", "bfloat16", {"tie_word_embeddings": False}), ("moe", "bfloat16", {}),
     ("glm", "float32", {"tie_word_embeddings": False})],
    ids=["dense-fp32-tied", "dense-bf16-untied", "moe-bf16-tied", "glm-fp32-untied"],
)  # fmt: skip
def test_hf_to_megatron_to_hf_is_bit_exact(kind: str, dtype: str, overrides: dict, tmp_path) -> None:
    from megatron.core import dist_checkpointing

    hf, megatron, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    save_random_model(hf, tiny_config(kind, **overrides), seed=3, dtype=dtype)  # type: ignore[arg-type]
    assert convert("--src", hf, "--dst", megatron, "--to", "megatron") == 0
    assert convert("--src", megatron, "--dst", back) == 0
    assert_same_tensors(back, hf)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    record = json.loads((megatron / "megatron_convert.json").read_text())
    assert record["dtype"] == dtype and record["num_ranks"] == 1
    saved = dist_checkpointing.load_tensors_metadata(str(megatron))  # megatron-core's own keys, global shapes
    assert saved["embedding.word_embeddings.weight"].dtype == getattr(torch, dtype)
    assert ("output_layer.weight" in saved) == (not tiny_config(kind, **overrides).tie_word_embeddings)
    assert any(key.startswith("decoder.layers.") and "linear_qkv" in key for key in saved)


def test_a_megatron_checkpoint_without_config_reads_with_hf_config(dense_pair, tmp_path) -> None:
    """A dist_checkpointing directory that holds no config.json (Megatron-LM's iter_* directories) needs
    --hf-config; with it, the conversion is the same."""
    hf, megatron = dense_pair
    bare = tmp_path / "bare"
    shutil.copytree(megatron, bare, ignore=shutil.ignore_patterns("config.json", "megatron_convert.json"))
    assert convert("--src", bare, "--dst", tmp_path / "no") == 2
    assert convert("--src", bare, "--dst", tmp_path / "back", "--hf-config", hf) == 0
    assert_same_tensors(tmp_path / "back", hf)
    assert (tmp_path / "back" / "tokenizer.json").is_file()  # the checkpoint keeps the source's tokenizer


def test_check_passes_on_a_pair_and_names_what_a_corrupted_pair_breaks(dense_pair, tmp_path, capsys) -> None:
    hf, megatron = dense_pair
    assert convert("--src", hf, "--dst", megatron, "--check-only") == 0
    out = capsys.readouterr().out
    assert "check: 24 of 24 tensors equal bit for bit" in out and "check passed" in out
    diffs = [float(line.split("max |logit diff| ")[1].split()[0]) for line in out.splitlines() if "prompt" in line]
    assert len(diffs) == 3 and max(diffs) < 1e-5, out  # float32, CPU: the GPTModel and the miles model agree
    corrupted = tmp_path / "corrupted"
    shutil.copytree(hf, corrupted)
    state = load_file(corrupted / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] *= 1.01  # one tensor perturbed by 1%
    save_file(state, corrupted / "model.safetensors", metadata={"format": "pt"})
    assert convert("--src", megatron, "--dst", corrupted, "--check-only") == 1  # either way round
    err = capsys.readouterr().err
    assert "--check failed" in err and "tensor model.layers.1.mlp.down_proj.weight differs" in err, err
    assert "prompt 0: max |logit diff|" in err and "> --atol 0.0001" in err, err
    # the tolerance is a flag: the same pair within a loose one still fails on the tensor, not on the logits
    assert convert("--src", megatron, "--dst", corrupted, "--check-only", "--atol", "10") == 1
    err = capsys.readouterr().err
    assert "down_proj.weight differs" in err and "prompt" not in err, err


def test_check_catches_a_wrong_mapping_that_round_trips(dense_pair, tmp_path, monkeypatch, capsys) -> None:
    """A conversion that swaps the key and value heads both ways round-trips bit for bit, so the tensor comparison
    passes: the logits (megatron-core's own forward against the miles model) are what catch it."""
    from miles_trainer import megatron_checkpoint_io, megatron_convert

    fuse, split = megatron_convert._fuse, megatron_convert.megatron_to_hf

    def swapped_fuse(entry, parts, config, size):
        return fuse(entry, [parts[0], parts[2], parts[1]] if entry.fusion == "qkv" else parts, config, size)

    def swapped_split(entry, full, config, size):
        out = split(entry, full, config, size)
        if entry.fusion == "qkv":
            q, k, v = entry.hf_names
            out = {q: out[q], k: out[v], v: out[k]}
        return out

    monkeypatch.setattr(megatron_convert, "_fuse", swapped_fuse)
    monkeypatch.setattr(megatron_checkpoint_io, "megatron_to_hf", swapped_split)
    hf, _ = dense_pair
    assert convert("--src", hf, "--dst", tmp_path / "megatron", "--to", "megatron", "--check") == 1
    captured = capsys.readouterr()
    assert "check: 24 of 24 tensors equal bit for bit" in captured.out, captured.out
    assert "prompt 0: max |logit diff|" in captured.err and "tensor" not in captured.err, captured.err


def test_bad_input_gets_a_message_and_exit_2(dense_pair, tmp_path, capsys, monkeypatch) -> None:
    hf, megatron = dense_pair
    (tmp_path / "empty").mkdir()
    save_random_model(tmp_path / "qwen2", tiny_config("qwen2"))
    save_random_model(tmp_path / "moe", tiny_config("moe"))
    save_random_model(tmp_path / "mtp", tiny_config("glm", num_nextn_predict_layers=1))
    cases = [
        (("--src", tmp_path / "empty", "--dst", tmp_path / "o", "--to", "megatron"), "no config.json"),
        (("--src", tmp_path / "qwen2", "--dst", tmp_path / "o", "--to", "megatron"), "qwen2 runs on fsdp2"),
        (("--src", tmp_path / "mtp", "--dst", tmp_path / "o", "--to", "megatron"), "1 MTP module(s)"),
        (("--src", hf, "--dst", tmp_path / "o", "--to", "megatron", "--tp", "4"), "num_key_value_heads=2"),
        (("--src", hf, "--dst", tmp_path / "o", "--tp", "2"), "apply to Megatron checkpoints"),
        (("--src", hf, "--dst", tmp_path / "o", "--check"), "apply to Megatron checkpoints"),
        (("--src", megatron, "--dst", tmp_path / "o", "--to", "dcp"), "converts to hf, not --to dcp"),
        (("--src", megatron, "--dst", tmp_path / "o", "--pp", "2"), "reading a Megatron checkpoint needs none"),
        (("--src", hf, "--dst", hf, "--check-only"), "the same directory"),
        (("--src", hf, "--dst", tmp_path / "moe", "--check-only"), "mismatched directories"),
        (("--src", tmp_path / "moe", "--dst", megatron, "--check-only"), "describe different models"),
    ]
    for args, message in cases:
        assert convert(*args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron") else real(name, *a)
    )
    assert convert("--src", hf, "--dst", tmp_path / "o", "--to", "megatron") == 2
    assert "--extra megatron" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_writes_from_two_tensor_parallel_ranks(tmp_path) -> None:
    """The console script, TP 2 (two spawned gloo ranks; an odd vocabulary, padded to a multiple of 2 on save),
    with --check; read back on one rank, bit for bit."""
    hf, megatron, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    save_random_model(hf, tiny_config("dense", vocab_size=255, tie_word_embeddings=False), seed=4)
    command = ["miles-trainer", "convert", "--src", hf, "--dst", megatron, "--to", "megatron", "--tp", "2", "--check"]
    result = subprocess.run([str(a) for a in command], capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check passed" in result.stdout and result.stdout.count("max |logit diff|") == 3, result.stdout
    assert json.loads((megatron / "megatron_convert.json").read_text())["num_ranks"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in megatron.iterdir()}  # each rank wrote its shards
    assert convert("--src", megatron, "--dst", back) == 0
    assert_same_tensors(back, hf)


@pytest.mark.slow
def test_a_megatron_backend_checkpoint_converts_to_the_runs_weights(tmp_path) -> None:
    """Two pipeline stages (tied embeddings: the last stage keeps its own copy as the output layer) train a step and
    save a checkpoint (trainer_state.json, backend megatron), then train a second step and export HF. The command's
    conversion of that checkpoint, on one rank, is bit for bit the weights the backend itself gathered after the
    first step (a second run of the same deterministic step, through the backend's `full_state_dict`), in the same
    names and dtype as the run's `export_hf`; --check passes on it."""
    from test_fsdp import run_ranks

    model = tmp_path / "model"
    save_random_model(model, tiny_config("dense"), seed=6)
    env = {"MILES_TEST_MEGATRON": json.dumps({"pp": 2})}
    run_ranks(model, tmp_path / "run", 2, "two-steps", extra_env=env, worker=WORKER)
    first_step, _ = run_ranks(model, tmp_path / "first", 2, "step", extra_env=env, worker=WORKER)
    checkpoint = tmp_path / "checkpoint"  # megatron_worker's save_checkpoint target (after the first step)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["backend"] == "megatron"
    assert convert("--src", checkpoint, "--dst", tmp_path / "hf", "--check") == 0
    converted, exported = tensors(tmp_path / "hf"), tensors(tmp_path / "run" / "hf")
    assert converted.keys() == exported.keys() == first_step.keys()
    for name, tensor in first_step.items():
        assert converted[name].dtype == exported[name].dtype and torch.equal(converted[name], tensor), name
    assert any(not torch.equal(converted[n], exported[n]) for n in exported)  # the export is the second step's
