"""Small, deterministic tokenizers for tests, examples and benchmarks (nothing is downloaded).

In the RL data path the tokenizer sits at both ends of rollout: it turns a prompt (text or chat messages) into
`input_ids` for the engine, and the reward function decodes the returned `output_ids`. The trainer never
re-tokenizes (docs/architecture.md, "One RL step, one sample"). Tests need a tokenizer that behaves like a real chat
model's, so `build_tokenizer` trains one in well under a second, with the `tokenizers` library:

- byte-level BPE, pre-tokenized with Qwen2's split pattern (digits one at a time, which suits arithmetic tasks),
  so any Unicode text encodes and decodes back exactly;
- by default the special tokens ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1) and ``<|im_end|>`` (EOS,
  id 2) and a plain ChatML template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
  ``<|im_start|>assistant\\n`` when ``add_generation_prompt``; `chat_format` gives Qwen2.5's, Qwen3's or Llama
  3.1's template and special tokens instead (testing/chat_templates.py).

Saved with ``save_dir``, it loads with ``transformers.AutoTokenizer.from_pretrained`` (and so with TRL) with its
EOS, pad and chat template intact, next to a random model saved in the same folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from miles_kernels.testing.chat_templates import CHAT_FORMATS, QWEN, QWEN_SPECIALS

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"  # Qwen chat models end a turn, and so a response, with <|im_end|>
SPECIAL_TOKENS = QWEN_SPECIALS  # (pad, <|im_start|>, EOS): ids 0, 1, 2
NUM_BYTE_TOKENS = 256  # byte-level BPE starts from one symbol per byte, so every input is encodable
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
_QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = QWEN  # the built-in example's (chat_format="qwen")

DEFAULT_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns to add numbers one step at a time.",
    "Reinforcement learning rewards the answers that are correct.",
    "The policy writes a response, and the reward model scores it.",
    "Each prompt is sampled several times, and the group shares one baseline.",
    "Please answer the question and put the final number at the end.",
    "What is the sum of the two numbers below?",
    "Let us think about the problem carefully before we answer.",
    "The weather today is sunny with a light breeze from the west.",
    "She opened the window and listened to the birds in the garden.",
    "He wrote a short letter to his friend about the long journey home.",
    "Training runs on many machines, but the results must stay the same.",
    "The teacher asked the students to show their work on the board.",
    "Numbers can be added, subtracted, multiplied and divided.",
    "If you have three apples and buy four more, you have seven apples.",
    "The train leaves the station at nine and arrives at noon.",
    "Good tests check the answer against an independent reference.",
    "The library was quiet, except for the sound of turning pages.",
    "They walked along the river until the sun went down.",
    "Every token in the response carries a log probability.",
    "The assistant replied politely and gave a clear explanation.",
    "Water boils at one hundred degrees at sea level.",
    "Mountains, rivers and forests cover most of the northern region.",
    "The answer is correct only if the final number matches exactly.",
    "Hello! How can I help you today?",
    "Thank you for your question; here is a step by step solution.",
    "Question: how many legs do two dogs have? Answer: eight.",
    "12 + 7 = 19",
    "3 + 5 = 8",
    "45 - 18 = 27",
    "6 * 7 = 42",
    "81 / 9 = 9",
    "100 - 1 = 99",
    "23 + 19 = 42",
    "7 * 8 = 56",
    "250 + 250 = 500",
    "The result of 14 + 28 is 42.",
    "First add 9 and 6 to get 15, then subtract 4 to get 11.",
    "x = 3, y = 4, so x + y = 7 and x * y = 12.",
    "Solve for n: 2n + 6 = 20, so n = 7.",
)


def build_tokenizer(
    corpus: Iterable[str] = DEFAULT_CORPUS,
    *,
    vocab_size: int = 512,
    save_dir: str | os.PathLike[str] | None = None,
    chat_format: str = "qwen",
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with a model family's special tokens and chat template on `corpus`.

    Args:
        corpus: lines of training text. The same corpus always gives the same vocabulary and merges.
        vocab_size: the exact size of the result, ``len(tokenizer)``, *including* the 256 byte symbols and the
            special tokens (3 for the Qwen formats, 5 for llama3), so at least 259 / 261; the rest are BPE merges
            learned from `corpus`. A model built for this tokenizer needs an embedding of at least this many rows.
            If `corpus` has too few distinct pairs to learn that many merges, a ValueError says how many it allows.
        save_dir: when given, the tokenizer is saved there with ``save_pretrained`` (tokenizer.json,
            tokenizer_config.json, chat template), ready for ``AutoTokenizer.from_pretrained(save_dir)``.
        chat_format: the family's chat template and special tokens (`miles_kernels.testing.chat_templates`):
            "qwen" (plain ChatML, the default), "qwen2.5", "qwen3" (EOS ``<|im_end|>``) or "llama3" (Llama 3.1's:
            BOS ``<|begin_of_text|>``, EOS ``<|eot_id|>``).
    """
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format={chat_format!r}: use one of {sorted(CHAT_FORMATS)}")
    template, specials = CHAT_FORMATS[chat_format]
    if isinstance(corpus, str | bytes):
        # A str is an Iterable[str] of characters; training on it would silently learn nothing useful.
        raise TypeError("corpus must be an iterable of lines of text, not a single string; wrap it in a list")
    lines = list(corpus)
    if not lines:
        raise ValueError("corpus is empty; pass some lines of text, e.g. miles_kernels.tokenizer.DEFAULT_CORPUS")
    for line in lines:
        if not isinstance(line, str):
            raise TypeError(f"corpus lines must be str, got {type(line).__name__} {line!r}")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    smallest = NUM_BYTE_TOKENS + len(specials)
    if vocab_size < smallest:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs {NUM_BYTE_TOKENS} byte symbols plus "
            f"{len(specials)} special tokens, so vocab_size >= {smallest}"
        )

    tokenizer = Tokenizer(models.BPE())
    # No normalizer: NFC (which Qwen applies) would change some inputs, and tests rely on decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # type: ignore[no-untyped-call]
        vocab_size=vocab_size,
        special_tokens=list(specials),  # listed first, so they get ids 0, 1, 2, ...
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even those the corpus lacks
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the corpus supports only {tokenizer.get_vocab_size()} tokens ({smallest} fixed + "
            f"{tokenizer.get_vocab_size() - smallest} merges), fewer than vocab_size={vocab_size}; "
            "pass a smaller vocab_size or a larger corpus"
        )

    if specials[0] == PAD_TOKEN:  # the Qwen formats
        family: dict[str, Any] = {
            "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "extra_special_tokens": [IM_START_TOKEN]
        }  # fmt: skip
    else:  # llama3: <|end_of_text|> pads, <|begin_of_text|> begins, <|eot_id|> ends a turn
        named = ("<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>")
        family = {"pad_token": named[0], "bos_token": named[1], "eos_token": named[2],
                  "extra_special_tokens": [t for t in specials if t not in named]}  # fmt: skip
    hf_tokenizer = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        **family,
        chat_template=template,
        # Decoding must give back exactly the text that was encoded; the legacy cleanup rewrites " ." as ".".
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        hf_tokenizer.save_pretrained(os.fspath(save_dir))
    return hf_tokenizer
