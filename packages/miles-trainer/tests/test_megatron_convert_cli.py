"""`miles-trainer convert` between Hugging Face directories and megatron-core `dist_checkpointing` directories, and
its `--check` (docs/megatron.md, "HF <-> Megatron conversion").

Tier: CPU, multi-process. Most tests run the command in this process (`cli.main`: one rank inside
`megatron_on_cpu()`); the layout tests run real processes: the console script writing from two gloo ranks, and the
Megatron backend's own two-rank training runs (megatron_worker.py), whose checkpoints must convert to exactly what
those runs' backends gathered (its backend's gather, not this command's loader, is the reference). A round trip must
return the source's tensors bit for bit, MTP modules (`num_nextn_predict_layers`) and the MTP layers' copies of the
trunk's tensors included, and `--check` must fail, naming the tensor and the prompt (and MTP module), on a corrupted
pair.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_kernels import iter_checkpoint, read_model_config
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


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny float32 GLM-4.5 with one MTP layer (its copies of the embedding and LM head stored, as GLM-4.5's
    checkpoints store them) and a tokenizer, and its Megatron checkpoint."""
    root = tmp_path_factory.mktemp("mtp_pair")
    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("glm", vocab_size=len(tokenizer), num_nextn_predict_layers=1)
    save_random_model(root / "hf", config, seed=7, tokenizer=tokenizer)
    assert convert("--src", root / "hf", "--dst", root / "megatron", "--to", "megatron") == 0
    return root / "hf", root / "megatron"


@pytest.mark.parametrize(
    ("kind", "dtype", "overrides"),
    [("dense", "float32", {}), ("dense", "bfloat16", {"tie_word_embeddings": False}), ("moe", "bfloat16", {}),
     ("glm", "float32", {"tie_word_embeddings": False}), ("glm", "float32", {"num_nextn_predict_layers": 1}),
     ("dense", "bfloat16", {"num_nextn_predict_layers": 2, "tie_word_embeddings": False})],
    ids=["dense-fp32-tied", "dense-bf16-untied", "moe-bf16-tied", "glm-fp32-untied", "glm-fp32-tied-mtp1",
         "dense-bf16-untied-mtp2"],
)  # fmt: skip
def test_hf_to_megatron_to_hf_is_bit_exact(kind: str, dtype: str, overrides: dict, tmp_path) -> None:
    from megatron.core import dist_checkpointing

    hf, megatron, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    config = tiny_config(kind, **overrides)
    save_random_model(hf, config, seed=3, dtype=dtype)  # type: ignore[arg-type]
    assert convert("--src", hf, "--dst", megatron, "--to", "megatron") == 0
    assert convert("--src", megatron, "--dst", back) == 0
    assert_same_tensors(back, hf)  # MTP modules and their copies of the embedding / LM head included
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    record = json.loads((megatron / "megatron_convert.json").read_text())
    assert record["dtype"] == dtype and record["num_ranks"] == 1
    saved = dist_checkpointing.load_tensors_metadata(str(megatron))  # megatron-core's own keys, global shapes
    assert saved["embedding.word_embeddings.weight"].dtype == getattr(torch, dtype)
    assert ("output_layer.weight" in saved) == (not config.tie_word_embeddings)
    assert any(key.startswith("decoder.layers.") and "linear_qkv" in key for key in saved)
    num_mtp = config.num_nextn_predict_layers  # the MTP block's keys, as a GPTModel built with one names them
    assert {key.split(".")[2] for key in saved if key.startswith("mtp.layers.")} == {str(i) for i in range(num_mtp)}
    for i in range(num_mtp):
        assert saved[f"mtp.layers.{i}.eh_proj.weight"].global_shape == (config.hidden_size, 2 * config.hidden_size)
        assert saved[f"mtp.layers.{i}.transformer_layer.self_attention.linear_qkv.weight"].dtype == getattr(
            torch, dtype
        )


def test_the_mtp_layers_copies_come_back_as_the_source_held_them(mtp_pair, tmp_path) -> None:
    """The MTP layers' copies of the embedding and LM head have no Megatron tensor: a source without them converts
    back without them (the record lists the ones it held), and a checkpoint without a record (the backend's) gets
    them all, equal to the trunk's tensors, as `export_hf` writes them."""
    hf, _ = mtp_pair
    config = read_model_config(hf)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    layer = config.num_hidden_layers
    copies = {f"model.layers.{layer}.embed_tokens.weight": "model.embed_tokens.weight",
              f"model.layers.{layer}.shared_head.head.weight": head}  # fmt: skip
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    state = {n: t for n, t in load_file(bare / "model.safetensors").items() if n not in copies}
    save_file(state, bare / "model.safetensors", metadata={"format": "pt"})
    assert convert("--src", bare, "--dst", tmp_path / "megatron", "--to", "megatron") == 0
    assert json.loads((tmp_path / "megatron" / "megatron_convert.json").read_text())["hf_mtp_copies"] == []
    assert convert("--src", tmp_path / "megatron", "--dst", tmp_path / "back") == 0
    assert_same_tensors(tmp_path / "back", bare)
    (tmp_path / "megatron" / "megatron_convert.json").unlink()
    assert convert("--src", tmp_path / "megatron", "--dst", tmp_path / "exported") == 0
    exported = tensors(tmp_path / "exported")
    assert exported.keys() == state.keys() | copies.keys()
    for copy, trunk in copies.items():
        assert torch.equal(exported[copy], state[trunk]), copy


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


def test_check_compares_the_mtp_modules_and_fails_on_a_corrupted_one(mtp_pair, tmp_path, capsys) -> None:
    hf, megatron = mtp_pair
    assert convert("--src", hf, "--dst", megatron, "--check-only") == 0
    out = capsys.readouterr().out
    num = len(tensors(hf))  # the MTP layer's copies of the embedding and LM head against the trunk's tensors too
    assert f"check: {num} of {num} tensors equal bit for bit" in out and "(the MTP modules' too)" in out, out
    diffs = [
        float(line.split("max |logit diff| ")[1].split()[0]) for line in out.splitlines() if ", MTP module" in line
    ]
    assert len(diffs) == 3 and max(diffs) < 1e-5, out  # float32, CPU: megatron-core's MTP block and the miles model
    layer = read_model_config(hf).num_hidden_layers
    corrupted = tmp_path / "corrupted"
    shutil.copytree(hf, corrupted)
    state = load_file(corrupted / "model.safetensors")
    state[f"model.layers.{layer}.eh_proj.weight"] *= 1.01  # one MTP tensor perturbed by 1%
    save_file(state, corrupted / "model.safetensors", metadata={"format": "pt"})
    assert convert("--src", megatron, "--dst", corrupted, "--check-only") == 1
    err = capsys.readouterr().err
    assert f"tensor model.layers.{layer}.eh_proj.weight differs" in err, err
    assert "prompt 0, MTP module 0: max |logit diff|" in err and "prompt 0: max" not in err, err  # the trunk agrees


def test_check_catches_a_wrong_mtp_mapping_that_round_trips(mtp_pair, tmp_path, monkeypatch, capsys) -> None:
    """An MTP mapping that swaps `enorm` and `hnorm` both ways round-trips bit for bit: the MTP modules' logits
    (megatron-core's block against the miles model) are what catch it."""
    from miles_trainer import megatron_convert

    entries = megatron_convert.mtp_entries

    def swapped(config, layout):
        out = entries(config, layout)
        norms = {e.name.rsplit(".", 2)[-2]: e for e in out if e.name.endswith(("enorm.weight", "hnorm.weight"))}
        swap = {norms["enorm"].name: norms["hnorm"].hf_names, norms["hnorm"].name: norms["enorm"].hf_names}
        return [dataclasses.replace(e, hf_names=swap.get(e.name, e.hf_names)) for e in out]

    monkeypatch.setattr(megatron_convert, "mtp_entries", swapped)
    hf, _ = mtp_pair
    assert convert("--src", hf, "--dst", tmp_path / "megatron", "--to", "megatron", "--check") == 1
    captured = capsys.readouterr()
    assert "tensors equal bit for bit" in captured.out and "tensor" not in captured.err, captured.err
    assert "prompt 0, MTP module 0: max |logit diff|" in captured.err and "prompt 0: max" not in captured.err


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
    without_mtp = tmp_path / "without_mtp"  # its config.json declares an MTP module the checkpoint does not hold
    shutil.copytree(megatron, without_mtp)
    declared = json.loads((without_mtp / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (without_mtp / "config.json").write_text(json.dumps(declared))
    cases = [
        (("--src", tmp_path / "empty", "--dst", tmp_path / "o", "--to", "megatron"), "no config.json"),
        (("--src", tmp_path / "qwen2", "--dst", tmp_path / "o", "--to", "megatron"), "qwen2 runs on fsdp2"),
        (("--src", without_mtp, "--dst", tmp_path / "o"), "does not hold 1 MTP module(s) of the"),
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


@pytest.mark.slow
def test_a_megatron_backend_checkpoint_with_mtp_converts_both_ways(tmp_path) -> None:
    """Two pipeline stages train the trunk and, with miles-spec's MTP loss (MILES_TEST_MTP), its MTP module a step
    and save a checkpoint (the module under "mtp", its AdamW state under "mtp_optimizer"). The command's conversion
    of that checkpoint is bit for bit the weights the backend itself gathered after that step (`step1`, trunk and
    MTP module), with the MTP layer's copies of the embedding as the run's `export_hf` writes them; --check passes on
    it. The other way, HF -> Megatron writes the MTP block under the checkpoint's keys, shapes and dtypes."""
    pytest.importorskip("miles_spec", reason="MILES_TEST_MTP trains with miles-spec's MTPLoss (the workspace)")
    from megatron.core import dist_checkpointing
    from test_fsdp import run_ranks

    model = tmp_path / "model"
    save_random_model(model, tiny_config("dense", num_nextn_predict_layers=1), seed=6)
    env = {"MILES_TEST_MEGATRON": json.dumps({"pp": 2}), "MILES_TEST_MTP": "1"}
    run_ranks(model, tmp_path / "run", 2, "two-steps", extra_env=env, worker=WORKER)
    checkpoint = tmp_path / "checkpoint"  # megatron_worker's save_checkpoint target (after the first step)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["backend"] == "megatron"
    assert convert("--src", checkpoint, "--dst", tmp_path / "hf", "--check") == 0
    first_step, initial = load_file(tmp_path / "run" / "step1.safetensors"), tensors(model)
    converted, exported = tensors(tmp_path / "hf"), tensors(tmp_path / "run" / "hf")
    layer = read_model_config(model).num_hidden_layers
    copies = {f"model.layers.{layer}.embed_tokens.weight", f"model.layers.{layer}.shared_head.head.weight"}
    assert converted.keys() == exported.keys() == first_step.keys() | copies
    for name, tensor in first_step.items():
        assert converted[name].dtype == exported[name].dtype and torch.equal(converted[name], tensor), name
    for copy in copies:  # tied: both are the trunk's embedding
        assert torch.equal(converted[copy], converted["model.embed_tokens.weight"]), copy
    mtp = [name for name in first_step if name.startswith(f"model.layers.{layer}.")]
    assert mtp and all(not torch.equal(converted[n], initial[n]) for n in mtp)  # the step trained the MTP module
    assert convert("--src", tmp_path / "hf", "--dst", tmp_path / "megatron", "--to", "megatron") == 0
    ours, theirs = (dist_checkpointing.load_tensors_metadata(str(d)) for d in (tmp_path / "megatron", checkpoint))
    ours, theirs = (
        {k: (v.global_shape, v.dtype) for k, v in m.items() if k.startswith("mtp.")} for m in (ours, theirs)
    )
    assert ours and ours == theirs
