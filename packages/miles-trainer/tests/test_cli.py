"""CLI tier (real `miles-trainer` processes on a tiny model): SFT trains only response / assistant tokens and
lowers their loss, bad rows are errors that name their line, and checkpoints convert both ways bit-exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

import miles_trainer
from miles_kernels import KernelConfig, load_model
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_trainer.cli import COMMANDS, SFTCommand
from miles_trainer.sft import SFTDataError, load_sft_samples

ROWS = [{"prompt": f"What is {a} + {b}? ", "response": str(a + b)} for a in range(2, 8) for b in range(1, 5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(path, tiny_config("dense", vocab_size=len(tokenizer)), seed=1, tokenizer=tokenizer)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def leaf_flags(model: type[BaseModel]) -> list[str]:
    """The flag of every leaf field of a config model (nested models are flattened, as `sft` shows them)."""
    flags = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            flags += leaf_flags(info.annotation)
        else:
            flags.append("--" + name.replace("_", "-"))
    return flags


def test_help_is_generated_from_the_config_models() -> None:
    assert miles_trainer.__doc__
    script = shutil.which("miles-trainer")
    assert script, "console script miles-trainer is not on PATH"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in result.stdout
    result = subprocess.run([script, "sft", "--help"], capture_output=True, text=True, check=True)
    for flag in leaf_flags(SFTCommand):  # SFTConfig, its OptimizerConfig and BackendConfig, KernelConfig
        assert flag in result.stdout, flag
    assert "--chat-template" in result.stdout and "(default: 3)" in result.stdout  # epochs
    assert "{deterministic,fast}" in result.stdout  # allowed values come from the model's Literal
    bad = subprocess.run([script, "sft", "--model-path", "m", "--data", "d", "--out", "o", "--lr", "-1"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "lr" in bad.stderr and "greater than 0" in bad.stderr, bad.stderr
    typo = subprocess.run([script, "sft", "--model-path", "m", "--data", "d", "--out", "o", "--epoch", "2"],
                          capture_output=True, text=True)  # fmt: skip
    assert typo.returncode == 2 and "--epochs" in typo.stderr, typo.stderr  # "perhaps you meant"


def test_loss_masks_cover_only_responses(model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "2 + 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4 + 4"},
        {"role": "assistant", "content": "8"},
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], {"messages": messages}])
    plain, chat = load_sft_samples(data, tokenizer)
    assert tokenizer.decode(plain.prompt_tokens) == ROWS[0]["prompt"]
    assert tokenizer.decode(plain.response_tokens) == ROWS[0]["response"] + "<|im_end|>"
    assert plain.loss_mask == [1] * len(plain.response_tokens)
    full = chat.prompt_tokens + chat.response_tokens
    assert tokenizer.decode(full) == tokenizer.apply_chat_template(messages, tokenize=False)
    trained = [t for t, m in zip(chat.response_tokens, chat.loss_mask, strict=True) if m]
    assert tokenizer.decode(trained) == "5<|im_end|>8<|im_end|>"  # assistant turns only, each with its EOS


@pytest.mark.parametrize(("chat_format", "eos"), [("qwen2.5", "<|im_end|>"), ("qwen3", "<|im_end|>"),
                                                   ("llama3", "<|eot_id|>")])  # fmt: skip
def test_loss_masks_under_each_familys_chat_template(tmp_path, chat_format: str, eos: str) -> None:
    """Qwen2.5's (a default system prompt), Qwen3's and Llama 3.1's (a dated system header, <|eot_id|>) templates:
    the rows' tokens are the template's, and only the assistant turns with their end-of-turn token train."""
    tokenizer = build_tokenizer(vocab_size=300, chat_format=chat_format)
    messages = [
        {"role": "user", "content": "2 + 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4 + 4"},
        {"role": "assistant", "content": "8"},
    ]
    (chat,) = load_sft_samples(write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}]), tokenizer)
    full = chat.prompt_tokens + chat.response_tokens
    assert tokenizer.decode(full) == tokenizer.apply_chat_template(messages, tokenize=False)
    trained = [t for t, m in zip(chat.response_tokens, chat.loss_mask, strict=True) if m]
    # Qwen3 renders the last turn (after the last user query) with an empty think block, which the model generates
    think = "<think>\n\n</think>\n\n" if chat_format == "qwen3" else ""
    assert tokenizer.decode(trained) == f"5{eos}{think}8{eos}"
    assert tokenizer.decode(chat.prompt_tokens).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n" if chat_format == "llama3" else "<|im_start|>assistant\n"
    )


def test_token_rows_in_miles_and_slime_fields(model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    rows = [
        {"prompt_tokens": [5, 6], "response_tokens": [7, 8, 9]},
        {"tokens": [5, 6, 7, 8, 9], "response_length": 3, "loss_mask": [1, 0, 1]},  # slime's Sample fields
    ]
    miles, slime = load_sft_samples(
        write_jsonl(tmp_path / "rows.jsonl", rows), AutoTokenizer.from_pretrained(model_dir)
    )
    assert (miles.prompt_tokens, miles.response_tokens, miles.loss_mask) == ([5, 6], [7, 8, 9], [1, 1, 1])
    assert (slime.prompt_tokens, slime.response_tokens, slime.loss_mask) == ([5, 6], [7, 8, 9], [1, 0, 1])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "rows.jsonl:3: not valid JSON"),
        ({"prompt_tokens": [1], "response_tokens": []}, 'rows.jsonl:3: "response_tokens" is empty'),
        ({"prompt_tokens": [1], "response_tokens": [True]}, 'rows.jsonl:3: "response_tokens" must be a list of token'),
        ({"tokens": [1, 2], "response_length": 2}, 'rows.jsonl:3: "response_length"'),
        ({"prompt": "hi"}, 'rows.jsonl:3: "response" must be a string'),
        ({"messages": [{"role": "user", "content": "hi"}]}, "rows.jsonl:3: no assistant message"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "rows.jsonl:3: messages[0] must be"),
        ({"text": "hi"}, 'rows.jsonl:3: a row needs "prompt" and "response", "messages", "prompt_tokens"'),
    ],
)
def test_bad_row_names_its_line(model_dir, tmp_path, row, message) -> None:
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], ROWS[1], row])
    with pytest.raises(SFTDataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_sft_samples(data, AutoTokenizer.from_pretrained(model_dir))
    if "JSON" not in message:
        return  # one case through the CLI is enough: the rest is the same code path
    result = subprocess.run(
        ["miles-trainer", "sft", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "out")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def response_nll(model_path: Path, samples) -> float:
    """Mean NLL of the response tokens under the Hugging Face implementation (an independent reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_tokens + s.response_tokens])
            logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
            targets = ids[0, 1:]
            rows = range(len(s.prompt_tokens) - 1, ids.shape[1] - 1)
            total -= sum(float(logp[r, targets[r]]) for r in rows)
            count += len(rows)
    return total / count


def test_sft_lowers_response_loss_and_writes_a_loadable_model(model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    out = tmp_path / "sft-out"
    result = subprocess.run(
        ["miles-trainer", "sft", "--model", str(model_dir), "--data", str(data), "--out", str(out),
         "--epochs", "4", "--lr", "3e-3", "--batch-size", "8", "--warmup-steps", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    losses = [
        float(line.split("loss ")[1].split(",")[0]) for line in result.stdout.splitlines() if line.startswith("epoch")
    ]
    assert len(losses) == 4 and losses[-1] < losses[0], result.stdout
    samples = load_sft_samples(data, AutoTokenizer.from_pretrained(out))
    before, after = response_nll(model_dir, samples), response_nll(out, samples)
    assert after < 0.7 * before, (before, after)


def test_lora_sft_writes_a_peft_adapter_and_the_merged_model(model_dir, tmp_path) -> None:
    """`miles-trainer sft --rank 8`: adapters on a frozen base; out/ is a PEFT adapter, out/merged the merged model,
    whose response loss fell."""
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    out = tmp_path / "lora-out"
    result = subprocess.run(
        ["miles-trainer", "sft", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--epochs", "4",
         "--lr", "1e-2", "--batch-size", "8", "--warmup-steps", "2", "--rank", "8", "--alpha", "16",
         "--target-modules", "q_proj", "v_proj", "down_proj", "--export-merged"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert not (out / "model.safetensors").exists() and (out / "adapter_model.safetensors").is_file()
    samples = load_sft_samples(data, AutoTokenizer.from_pretrained(out))
    before, after = response_nll(model_dir, samples), response_nll(out / "merged", samples)
    assert after < 0.8 * before, (before, after)


def test_convert_round_trip_is_bit_exact(model_dir, tmp_path) -> None:
    dcp_dir, hf_dir = tmp_path / "ckpt", tmp_path / "hf"
    for src, dst in ((model_dir, dcp_dir), (dcp_dir, hf_dir)):
        result = subprocess.run(
            ["miles-trainer", "convert", "--src", str(src), "--dst", str(dst), "--tokenizer", str(model_dir)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    original, converted = load_model(model_dir, KernelConfig()), load_model(hf_dir, KernelConfig())
    for name, tensor in original.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    assert (hf_dir / "tokenizer.json").is_file()
    result = subprocess.run(["miles-trainer", "convert", "--src", str(tmp_path), "--dst", str(tmp_path / "x")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "neither a trainer checkpoint" in result.stderr
