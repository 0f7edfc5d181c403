"""Tokenizers built with `tokenizers` the way Qwen2/3's, Llama 3's and GLM-4.5's tokenizer.json are (byte-level BPE
behind the family's split regex, the special tokens added after the learned vocabulary, the family's
tokenizer_config.json), and tiny models whose embedding is padded past them (Qwen's 151,665 tokens in 151,936 rows
is the usual case). `byte_alphabet=False` leaves the BPE without the characters its corpus never showed."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from miles_kernels.testing.chat_templates import CHAT_FORMATS
from miles_kernels.testing.random_model import save_random_model, tiny_config
from miles_kernels.testing.tokenizer import DEFAULT_CORPUS

MODEL_VOCAB = 512  # the padded embedding; each tokenizer has fewer tokens
# The pre-tokenizer split patterns of the families' tokenizer.json (Qwen2's; Llama 3's, which GLM-4.5's follows).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)
# GLM-4.5's chat format, reduced to plain messages: "[gMASK]<sop>", then "<|role|>\n" before each message.
GLM45_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FAMILIES = {
    # family: (split pattern, special tokens, tokenizer_config fields, the model's EOS ids as special-token indices)
    "qwen3": (QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "chat_template": CHAT_FORMATS["qwen3"][0]}, [0, 2]),
    "llama3": (LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                              "<|eot_id|>"],
               {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "chat_template": CHAT_FORMATS["llama3"][0]}, [1, 4]),
    "glm4_moe": (LLAMA3_SPLIT, ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                                "<|user|>", "<|assistant|>", "<|observation|>"],
                 {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                  "pad_token": "<|endoftext|>", "chat_template": GLM45_TEMPLATE}, [0, 7, 9]),
}  # fmt: skip


def family_tokenizer(
    family: str, directory: Path, *, byte_alphabet: bool = True, corpus: list[str] | None = None
) -> tuple[transformers.PreTrainedTokenizerBase, list[int]]:
    """A `family`-style tokenizer (a key of `FAMILIES`) saved in `directory` (tokenizer.json and
    tokenizer_config.json, as the family's checkpoints ship them), loaded back with AutoTokenizer; and the ids of
    the family's EOS tokens (what its config.json lists as eos_token_id)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: use one of {sorted(FAMILIES)}")
    split, specials, fields, eos = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else []
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)  # type: ignore[no-untyped-call]
    tokenizer.train_from_iterator(corpus or list(DEFAULT_CORPUS), trainer)
    tokenizer.add_special_tokens(specials)  # after the learned vocabulary, as the families' added_tokens are
    if family == "llama3":
        bos = specials[0]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**fields, "model_max_length": 512}))
    loaded = transformers.AutoTokenizer.from_pretrained(directory)
    return loaded, [_token_id(tokenizer, specials[i]) for i in eos]


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"{token!r} is not in the tokenizer")
    return int(found)


def family_model(family: str, directory: Path, *, byte_alphabet: bool = True) -> Path:
    """A tiny random dense model of `MODEL_VOCAB` embedding rows with a `family`-style tokenizer (fewer tokens) and
    the family's EOS ids in its config.json."""
    _, eos = family_tokenizer(family, directory, byte_alphabet=byte_alphabet)
    config = tiny_config("dense", vocab_size=MODEL_VOCAB, max_position_embeddings=512)
    save_random_model(directory, config, seed=0)
    (directory / "tokenizer_config.json").write_text(json.dumps({**FAMILIES[family][2], "model_max_length": 512}))
    written = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**written, "eos_token_id": eos}))
    return directory
