"""`miles-spec train` as a user runs it (the console script in a real process, and `main` in-process for the error
paths): it trains a checkpoint's MTP draft
on token rows or text rows and writes the trunk back bit for bit; a checkpoint without MTP modules gets new ones
on request, and one saved by transformers (its config.json declares an MTP layer it holds no tensor of) gets
the module it declares; bad input (no such model, a model of another family, malformed rows, a full --out) is a
clear error with exit status 2 and nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import miles_spec
from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import build_tokenizer, random_model, save_transformers_model, tiny_config
from miles_spec.cli import COMMANDS, main


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("miles-spec")
    assert script, "console script miles-spec is not on PATH"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=300)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The CLI in this process (the error paths: no subprocess start-up per case)."""
    code = main(list(args))
    return code, capsys.readouterr().err


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(file)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_cli")
    tokenizer = build_tokenizer(vocab_size=300)
    out = {}
    for name, mtp in (("with_mtp", 1), ("without_mtp", 0)):
        config = tiny_config("dense", vocab_size=len(tokenizer), num_nextn_predict_layers=mtp)
        out[name] = save_model(random_model(config, KernelConfig(), seed=3), root / name, tokenizer=tokenizer)
    rows = root / "rows.jsonl"
    generator = torch.Generator().manual_seed(0)
    with rows.open("w") as f:
        for _ in range(24):  # a learnable pattern: the response counts up from the prompt's last token
            first = int(torch.randint(0, 200, (1,), generator=generator))
            tokens = list(range(first, first + 12))
            f.write(json.dumps({"prompt_tokens": tokens[:3], "response_tokens": tokens[3:]}) + "\n")
    out["rows"] = rows
    return out


def test_help_lists_subcommands() -> None:
    assert miles_spec.__doc__
    result = cli("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert name in result.stdout


def test_train_moves_only_the_draft_and_it_learns(checkpoints, tmp_path) -> None:
    out = tmp_path / "out"
    result = cli("train", "--model", str(checkpoints["with_mtp"]), "--data", str(checkpoints["rows"]), "--out",
                 str(out), "--epochs", "6", "--batch-size", "8", "--lr", "3e-3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = tensors(checkpoints["with_mtp"]), tensors(out)
    assert before.keys() == after.keys()
    draft = "model.layers.2."  # the MTP module after the 2 trunk layers
    own = {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}  # trunk copies
    for name, value in before.items():
        if name.startswith(draft) and name not in own:
            continue
        assert torch.equal(after[name], value), f"{name} changed: the trunk must stay as loaded"
    moved = [n for n in before if n.startswith(draft) and n not in own and not torch.equal(before[n], after[n])]
    assert len(moved) > 5
    history = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert history[-1]["skipped_update"] == 1.0  # the policy's optimizer never stepped
    first, last = (float(line.split("mtp_loss ")[1].split(",")[0]) for line in _epoch_lines(result.stdout)[::5])
    assert last < first - 0.5, (first, last)


def _epoch_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("epoch") and "mtp_loss" in line]


def test_a_checkpoint_without_mtp_gets_a_new_module_on_request(checkpoints, tmp_path, capsys) -> None:
    code, err = run_main(capsys, "train", "--model", str(checkpoints["without_mtp"]), "--data",
                         str(checkpoints["rows"]), "--out", str(tmp_path / "refused"))  # fmt: skip
    assert code == 2 and "--num-mtp-layers 1" in err
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "out"
    code, err = run_main(capsys, "train", "--model", str(checkpoints["without_mtp"]), "--data",
                         str(checkpoints["rows"]), "--out", str(out), "--num-mtp-layers", "1")  # fmt: skip
    assert code == 0, err[-3000:]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    before, after = tensors(checkpoints["without_mtp"]), tensors(out)
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert any(name.startswith("model.layers.2.eh_proj") for name in after)


def test_a_checkpoint_saved_by_transformers_gets_the_module_its_config_declares(checkpoints, tmp_path, capsys):
    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("glm", vocab_size=len(tokenizer), num_nextn_predict_layers=1)
    source = save_transformers_model(tmp_path / "hf", config, seed=2, tokenizer=tokenizer)
    out = tmp_path / "out"
    code, err = run_main(capsys, "train", "--model", str(source), "--data", str(checkpoints["rows"]), "--out",
                         str(out))  # fmt: skip
    assert code == 0, err[-3000:]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    before, after = tensors(source), tensors(out)
    assert all(torch.equal(after[name], value) for name, value in before.items())  # the trunk as saved
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias"} <= after.keys()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("not json", "rows.jsonl:2: not valid JSON"),
        ('{"prompt_tokens": [1, 2], "response_tokens": [3, "x"]}', '"response_tokens" must be a list of token ids'),
        ('{"prompt_tokens": [1, 2], "response_tokens": [3, 99999]}', "token id 99999, outside the vocabulary"),
        ('{"tokens": [1, 2, 3], "response_length": 5}', '"response_length"'),
        ('{"prompt_tokens": [1], "response_tokens": [2, 3], "loss_mask": [1]}', '"loss_mask" must be a list of 2'),
        ('{"text": "hello"}', 'a row needs "prompt" and "response"'),
    ],
)
def test_malformed_rows_are_refused_by_line(checkpoints, tmp_path, capsys, row: str, message: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt_tokens": [1, 2], "response_tokens": [3, 4]}\n' + row + "\n")
    code, err = run_main(capsys, "train", "--model", str(checkpoints["with_mtp"]), "--data", str(data), "--out",
                         str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and message in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_bad_models_and_outputs_are_refused(checkpoints, tmp_path, capsys) -> None:
    rows = str(checkpoints["rows"])
    code, err = run_main(capsys, "train", "--model", str(tmp_path / "nowhere"), "--data", rows, "--out",
                         str(tmp_path / "o1"))  # fmt: skip
    assert code == 2 and "no Hugging Face checkpoint" in err
    mistral = tmp_path / "mistral"  # an architecture the kernels do not run
    shutil.copytree(checkpoints["with_mtp"], mistral)
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps(config | {"model_type": "mistral",
                                                              "architectures": ["MistralForCausalLM"]}))  # fmt: skip
    code, err = run_main(capsys, "train", "--model", str(mistral), "--data", rows, "--out", str(tmp_path / "o2"))
    assert code == 2 and "model_type='mistral'" in err, err[-2000:]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, err = run_main(capsys, "train", "--model", str(checkpoints["with_mtp"]), "--data", rows, "--out", str(full))
    assert code == 2 and "is not empty" in err and (full / "keep.txt").read_text() == "mine"
    code, err = run_main(capsys, "train", "--model", str(checkpoints["with_mtp"]), "--data", rows, "--out",
                         str(tmp_path / "o3"), "--num-mtp-layers", "2")  # fmt: skip
    assert code == 2 and "already has 1 MTP module" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--epochs", "0"], "epochs"),
        (["--lr", "-1"], "lr"),
        (["--num-mtp-layers", "0"], "num_mtp_layers"),
        (["--no-such-flag", "1"], "--no-such-flag"),
    ],
)
def test_bad_flags_are_refused_with_the_setting_named(checkpoints, tmp_path, capsys, flags, message) -> None:
    """The flags come from DraftTrainConfig: a value its constraints refuse (or an unknown flag) is exit 2 naming
    the setting, before anything is loaded or written."""
    code, err = run_main(capsys, "train", "--model", str(checkpoints["with_mtp"]), "--data",
                         str(checkpoints["rows"]), "--out", str(tmp_path / "out"), *flags)  # fmt: skip
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_train_eagle3_writes_a_specforge_draft_that_learns_the_policy(checkpoints, tmp_path) -> None:
    """`--draft eagle3`: a new draft whose vocabulary is the rows' 64 most frequent trained tokens, trained on the
    checkpoint's own distributions; only the draft is written, in SpecForge's layout, and it loads for the target."""
    from miles_kernels import load_eagle3, read_model_config

    out = tmp_path / "eagle3"
    result = cli("train", "--model", str(checkpoints["without_mtp"]), "--data", str(checkpoints["rows"]), "--out",
                 str(out), "--draft", "eagle3", "--draft-vocab-size", "64", "--ttt-length", "2", "--epochs", "6",
                 "--batch-size", "8", "--lr", "3e-3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert not any(name.startswith("model.") for name in tensors(out))  # the draft alone, no trunk
    draft = load_eagle3(out, read_model_config(checkpoints["without_mtp"]))
    rows = [json.loads(line) for line in checkpoints["rows"].read_text().splitlines()]
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["response_tokens"]]), minlength=300)
    assert set(draft.target_ids.tolist()) >= set(torch.nonzero(counts >= counts.topk(64).values[-1] + 1).flatten()
                                                 .tolist())  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch") and "eagle3_loss" in line]
    first, last = (float(line.split("eagle3_loss ")[1].split(",")[0]) for line in lines[::5])
    assert last < first, (first, last)
    start, end = (float(line.split("eagle3_accuracy_0 ")[1].split(",")[0]) for line in lines[::5])
    assert end > start + 0.3, (start, end)  # the draft's top token is the policy's far more often
    history = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert history[-1]["skipped_update"] == 1.0  # the policy's optimizer never stepped


def test_eagle3_refuses_mtp_flags(checkpoints, tmp_path, capsys) -> None:
    code, err = run_main(capsys, "train", "--model", str(checkpoints["without_mtp"]), "--data",
                         str(checkpoints["rows"]), "--out", str(tmp_path / "x"), "--draft", "eagle3",
                         "--num-mtp-layers", "1")  # fmt: skip
    assert code == 2 and "drop it" in err and not (tmp_path / "x").exists()
