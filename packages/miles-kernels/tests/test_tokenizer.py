"""CPU numerics (no torch math): the test tokenizer round-trips any text, formats chats exactly as Qwen's template
does, is deterministic, and reloads through `AutoTokenizer` (and TRL, where installed) with EOS, pad and template.

The expected chat strings are written out by hand from Qwen's published template, not produced by the code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from miles_kernels.testing import DEFAULT_CORPUS, build_tokenizer
from miles_kernels.testing.tokenizer import MIN_VOCAB_SIZE

MESSAGES = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19"},
    {"role": "user", "content": "And 19 + 1?"},
]
EXPECTED_CHAT = (
    "<|im_start|>system\nYou are a careful math tutor.<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
    "<|im_start|>assistant\n12 + 7 = 19<|im_end|>\n"
    "<|im_start|>user\nAnd 19 + 1?<|im_end|>\n"
)
UNSEEN_TEXTS = [
    "Zebras quietly vex jumping wizards 98765.",
    "  leading and trailing spaces, tabs\tand\nnewlines\r\n  ",
    "Grüße aus Köln — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🙂👍🏽 and combining e\u0301 (not NFC-normalized) and \u200bzero-width",
    "code: def f(x):\n    return x ** 2  # it's fine, isn't it?",
    "",
]


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(DEFAULT_CORPUS, vocab_size=512, save_dir=path)
    return path


@pytest.fixture(scope="module")
def tokenizer(saved_dir: Path) -> transformers.PreTrainedTokenizerBase:
    # Every test below runs against the reloaded copy: what other packages and TRL will actually see.
    return transformers.AutoTokenizer.from_pretrained(saved_dir)


def test_saved_files_and_reload(saved_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    assert (saved_dir / "tokenizer.json").is_file() and (saved_dir / "tokenizer_config.json").is_file()
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.chat_template is not None


def test_eos_and_pad_are_set_and_distinct(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert "<|im_start|>" in tokenizer.all_special_tokens


@pytest.mark.parametrize("text", UNSEEN_TEXTS)
def test_roundtrip_of_unseen_text(tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_merges_are_learned_and_digits_split(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    # " the" is frequent in the corpus, so it is one learned token; numbers are split one digit at a time.
    assert tokenizer.tokenize(" the") == ["Ġthe"]
    assert tokenizer.tokenize("2025") == ["2", "0", "2", "5"]


def test_special_tokens_are_single_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>"), skip_special_tokens=True) == "user\nhi"


def test_chat_template_text(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == EXPECTED_CHAT
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED_CHAT + "<|im_start|>assistant\n"


def test_chat_template_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected: list[int] = []
    for message in MESSAGES:  # build the ids piece by piece, from the special-token ids and the plain text
        expected += [1, *tokenizer.encode(f"{message['role']}\n{message['content']}"), 2]
        expected += tokenizer.encode("\n")
    expected += [1, *tokenizer.encode("assistant\n")]
    assert ids == expected
    assert ids == tokenizer.encode(EXPECTED_CHAT + "<|im_start|>assistant\n")


def test_building_twice_gives_identical_files(tmp_path: Path) -> None:
    build_tokenizer(DEFAULT_CORPUS, vocab_size=400, save_dir=tmp_path / "a")
    build_tokenizer(list(DEFAULT_CORPUS), vocab_size=400, save_dir=tmp_path / "b")
    # A fresh process too: hash-map iteration order differs between processes, so ties must not depend on it.
    code = (
        "import sys; from miles_kernels.testing import build_tokenizer, DEFAULT_CORPUS; "
        "build_tokenizer(DEFAULT_CORPUS, vocab_size=400, save_dir=sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True)

    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert len(json.loads(first)["model"]["merges"]) == 400 - MIN_VOCAB_SIZE
    for other in ("b", "c"):
        assert (tmp_path / other / "tokenizer.json").read_bytes() == first
        assert (tmp_path / other / "tokenizer_config.json").read_bytes() == (
            tmp_path / "a" / "tokenizer_config.json"
        ).read_bytes()


def test_different_corpus_gives_different_vocab() -> None:
    a = build_tokenizer(DEFAULT_CORPUS, vocab_size=290)
    b = build_tokenizer(["lorem ipsum dolor sit amet, consectetur adipiscing elit"] * 5, vocab_size=290)
    assert a.get_vocab() != b.get_vocab()


def test_vocab_size_is_exact() -> None:
    for vocab_size in (MIN_VOCAB_SIZE, 300, 700):
        assert len(build_tokenizer(DEFAULT_CORPUS, vocab_size=vocab_size)) == vocab_size


def test_too_small_vocab_errors() -> None:
    assert MIN_VOCAB_SIZE == 259
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        build_tokenizer(DEFAULT_CORPUS, vocab_size=258)


def test_corpus_too_small_for_vocab_errors() -> None:
    with pytest.raises(ValueError, match="corpus supports only"):
        build_tokenizer(["ab ab ab"], vocab_size=512)


def test_bad_corpus_errors() -> None:
    with pytest.raises(TypeError, match="not a single string"):
        build_tokenizer("one long string of text", vocab_size=300)
    with pytest.raises(ValueError, match="corpus is empty"):
        build_tokenizer([], vocab_size=300)
    with pytest.raises(TypeError, match="must be str"):
        build_tokenizer(["fine", 3], vocab_size=300)  # type: ignore[list-item]


def test_trl_loads_it(saved_dir: Path) -> None:
    trl_data_utils = pytest.importorskip("trl.data_utils")
    # GRPOTrainer loads the processing class with AutoProcessor when given a model path.
    processor = transformers.AutoProcessor.from_pretrained(saved_dir)
    assert processor.eos_token_id == 2 and processor.pad_token_id == 0
    example = {"prompt": [{"role": "user", "content": "What is 12 + 7?"}]}
    out = trl_data_utils.maybe_apply_chat_template(example, processor)
    assert out["prompt"] == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("chat_format", ["qwen2.5", "qwen3", "llama3"])
def test_family_chat_formats_save_and_reload(tmp_path: Path, chat_format: str) -> None:
    """Each family's template and special tokens survive save_pretrained / AutoTokenizer, render a conversation as
    that family does, and the special tokens stay single ids."""
    built = build_tokenizer(vocab_size=300, chat_format=chat_format, save_dir=tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    text = loaded.apply_chat_template(messages, tokenize=False)
    assert text == built.apply_chat_template(messages, tokenize=False)
    assert (loaded.eos_token, loaded.eos_token_id) == (built.eos_token, built.eos_token_id)
    if chat_format == "llama3":
        assert loaded.eos_token == "<|eot_id|>" and loaded.bos_token == "<|begin_of_text|>"
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>")
    else:
        assert loaded.eos_token == "<|im_end|>"
        think = "<think>\n\n</think>\n\n" if chat_format == "qwen3" else ""  # Qwen3: the last turn's empty think
        assert text.endswith(f"<|im_start|>assistant\n{think}5<|im_end|>\n")
        assert text.startswith("<|im_start|>system\nYou are Qwen") == (chat_format == "qwen2.5")
    for token in loaded.all_special_tokens:
        assert len(loaded.encode(token, add_special_tokens=False)) == 1, token
    with pytest.raises(ValueError, match="chat_format='mistral'"):
        build_tokenizer(chat_format="mistral")
