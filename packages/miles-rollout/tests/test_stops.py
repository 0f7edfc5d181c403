"""Stop strings, stop regexes and per-token text (stops.py, detokenizer.py). Two tiers: pure logic (RE2, the tiny
byte-level test tokenizer; no model), and CPU with an in-process engine (a catastrophic regex while `/health` is
probed through the ASGI app, stops on long outputs, the decode work per token).

References: `tokenizer.decode` of all the ids (what the final text has always been), and the previous matcher:
Python `re` / `str.find` over the whole text after every token."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer
from miles_rollout import Engine, EngineConfig, EngineError, InProcessClient, create_app
from miles_rollout.config import RequestLimits
from miles_rollout.detokenizer import IncrementalDetokenizer
from miles_rollout.stops import StopMatcher, check_stop_patterns

CATASTROPHIC = r"([\s\S]+)+QQQQQ"  # Python's re backtracks 2^n ways over n characters that have no QQQQQ


# -- pure logic ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [(r"(?<=a)b", "(?<="), (r"(?<!a)b", "(?<!"), (r"a(?=b)", "(?="), (r"(a)\1", r"\1"), (r"a{1001}", "{1001}")],
)
def test_patterns_re2_cannot_run_are_refused_naming_them(pattern: str, reason: str) -> None:
    params = SamplingParams(stop_regex=["fine", pattern])
    with pytest.raises(EngineError) as refused:
        check_stop_patterns(params, RequestLimits())
    assert refused.value.status_code == 400
    assert repr(pattern) in refused.value.message and reason in refused.value.message


def test_stop_limits_are_refused_and_linear_time_patterns_accepted() -> None:
    limits = RequestLimits(max_stop_patterns=3, max_stop_chars=8)
    check_stop_patterns(SamplingParams(stop=["a", "b"], stop_regex=r"\d+"), limits)
    check_stop_patterns(SamplingParams(stop_regex=[CATASTROPHIC, r"(?i)^x\b"]), RequestLimits())
    with pytest.raises(EngineError, match="max_stop_patterns"):
        check_stop_patterns(SamplingParams(stop=["a", "b"], stop_regex=["c", "d"]), limits)
    with pytest.raises(EngineError, match=r"sampling_params.stop 'abcdefghi'.*max_stop_chars"):
        check_stop_patterns(SamplingParams(stop=["abcdefghi"]), limits)
    with pytest.raises(EngineError, match=re.escape("sampling_params.stop_regex '.{0,9999}' has 9 characters")):
        check_stop_patterns(SamplingParams(stop_regex=".{0,9999}"), limits)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def random_ids(rng: random.Random, tokenizer, n: int) -> list[int]:
    """Output ids as a random model writes them: any id (special tokens, lone bytes that are no UTF-8), runs of
    byte tokens, and tokenized text with multi-byte characters."""
    vocab = len(tokenizer)
    kind = rng.randrange(3)
    if kind == 0:
        return [rng.randrange(vocab) for _ in range(n)]
    if kind == 1:
        return [rng.choice([0, 1, 2, *range(3, 259)]) for _ in range(n)]
    text = "".join(rng.choice(["a", "é", "中", "😀", " ", "\n", "<|im_end|>", "12"]) for _ in range(n))
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_incremental_text_equals_the_full_decode(tokenizer) -> None:
    """At every token, the text handed out so far is a prefix of `decode(ids so far)`; at the end it is the whole
    decode but at most 3 trailing U+FFFD (a character that may still be completing)."""
    rng = random.Random(0)
    for trial in range(400):
        options = {"skip_special_tokens": trial % 2 == 0, "spaces_between_special_tokens": trial % 4 < 2}
        ids = random_ids(rng, tokenizer, rng.randint(1, 80))
        detokenizer = IncrementalDetokenizer(tokenizer, **options)
        text = ""
        for end in range(1, len(ids) + 1):
            text += detokenizer.step(ids[:end])
            assert tokenizer.decode(ids[:end], **options).startswith(text), (ids[:end], options)
        full = tokenizer.decode(ids, **options)
        assert full[len(text) :] == "\ufffd" * (len(full) - len(text)) and len(full) - len(text) <= 3, (ids, options)


def test_incremental_decoding_reads_a_bounded_window(tokenizer) -> None:
    """Per token, two decodes of a few trailing ids, however long the output (a run of invalid bytes too)."""
    seen: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **options: bool) -> str:
            seen.append(len(ids))
            return str(tokenizer.decode(ids, **options))

    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(3000)] + [131] * 200  # 0x80 alone: never UTF-8
    detokenizer = IncrementalDetokenizer(Counting(), skip_special_tokens=True, spaces_between_special_tokens=True)
    for end in range(1, len(ids) + 1):
        detokenizer.step(ids[:end])
    assert len(seen) <= 4 * len(ids) and max(seen) <= 24


def reference_stop(text_after: list[str], strings: list[str], patterns: list[str]) -> tuple[int, int, str] | None:
    """The previous matcher: after each token, the whole text searched (stop strings first, the earliest; then the
    earliest regex match). Returns (token index, start, matched text)."""
    for k, text in enumerate(text_after):
        hits = [(text.find(s), s) for s in strings if s in text]
        if hits:
            return (k, *min(hits))
        found = [m for p in patterns if (m := re.search(p, text)) is not None]
        if found:
            first = min(found, key=lambda m: m.start())
            return k, first.start(), first.group(0)
    return None


def test_windowed_matching_equals_a_whole_text_search() -> None:
    """Random texts arriving in random pieces: the matcher, seeing only the new text and its context, stops where
    and as the previous whole-text matcher did, for anchors and word boundaries too (matches shorter than the
    window)."""
    rng = random.Random(2)
    cases = [
        (["ab", "ba"], []),
        (["aaa", "b a"], [r"b\s?c"]),
        ([], [r"^b", r"\bcab\b"]),
        ([], [r"(?m)c{3}|^a b$"]),
        (["cc"], [r"a.{0,4}c"]),
    ]
    for trial in range(300):
        strings, patterns = cases[trial % len(cases)]
        pieces = ["".join(rng.choice("abc \n") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(stop=strings or None, stop_regex=patterns or None)
        matcher = StopMatcher(params, window_chars=64)
        text_after, text, tail, found = [], "", "", None
        for k, piece in enumerate(pieces):
            text += piece
            text_after.append(text)
            if not piece:
                continue
            keep = matcher.num_context_chars
            tail = tail[-keep:] + piece
            hit = matcher.find(tail, len(text) - len(tail), len(piece))
            if hit is not None:
                found = (k, *hit)
                break
        assert found == reference_stop(text_after, strings, patterns), (pieces, strings, patterns)


def test_a_match_longer_than_the_window_is_not_found() -> None:
    matcher = StopMatcher(SamplingParams(stop_regex=r"S[a-z]*E"), window_chars=64)
    text = "S" + "x" * 100 + "E"
    assert matcher.find(text, 0, 1) is None
    assert matcher.find("S" + "x" * 50 + "E", 0, 1) == (0, "S" + "x" * 50 + "E")


# -- CPU, in-process engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(dense_dir):
    """An engine with a 64-character regex window, on one thread (its creator's setting) so that tests running
    beside it share the cores (two OpenMP teams on 2 busy cores made decoding ~30x slower)."""
    config = EngineConfig(num_kv_pages=128, limits=RequestLimits(stop_regex_window_chars=64))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(str(dense_dir), KernelConfig(page_size=16), config)
    finally:
        torch.set_num_threads(threads)
    yield engine
    engine.shutdown()


def one(engine: Engine, prompt: list[int], **params) -> object:
    request = GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(**params))
    return asyncio.run(InProcessClient(engine).generate(request))[0]


def test_a_catastrophic_regex_neither_stalls_its_request_nor_the_server(engine) -> None:
    """400 characters under `([\\s\\S]+)+QQQQQ` (Python's re took 87 s for 30 of them, holding the GIL): the sample
    runs to its length, and the server's `/health` answers within a second all the while."""
    letter = engine.tokenizer.encode("a", add_special_tokens=False)
    assert len(letter) == 1
    params = {"max_new_tokens": 400, "ignore_eos": True, "logit_bias": {str(letter[0]): 100.0},
              "stop_regex": CATASTROPHIC}  # fmt: skip
    transport = httpx.ASGITransport(app=create_app(engine))

    async def scenario() -> tuple[object, float, int]:
        request = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(**params))
        task = asyncio.create_task(InProcessClient(engine).generate(request))
        slowest, probes = 0.0, 0
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            try:
                while not task.done():
                    # The probe's wait counts too: a request arriving then would wait as long for its answer.
                    start = time.perf_counter()
                    await asyncio.sleep(0.02)
                    assert (await client.get("/health")).status_code == 200
                    slowest, probes = max(slowest, time.perf_counter() - start - 0.02), probes + 1
                    assert slowest < 1.0, f"/health waited {slowest:.1f} s for an answer while the regex ran"
            finally:
                if not task.done():  # the stall this test exists for: stop the sample, then fail
                    await engine.abort(None)
        return (await task)[0], slowest, probes

    started = time.perf_counter()
    response, slowest, probes = asyncio.run(scenario())
    assert time.perf_counter() - started < 60
    assert response.text == "a" * 400 and response.meta_info.finish_reason.type == "length"
    assert probes > 5 and slowest < 1.0


def test_stops_on_a_long_output_end_where_the_whole_text_search_did(engine) -> None:
    """A 300-token sample's stop string or regexes (one anchored with `^`, never matching) stop it far past the
    64-character window at the token, start and matched text where the previous whole-text matcher stopped,
    trimmed unless no_stop_trim."""
    prompt = [5, 6, 7, 8]
    sampling = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 3}
    free = one(engine, prompt, **sampling)
    ids = free.output_ids
    text_after = [engine.tokenizer.decode(ids[: k + 1], skip_special_tokens=True) for k in range(len(ids))]
    text = text_after[-1]
    assert len(text) > 400 and text == free.text

    esc = re.escape

    def late(make) -> tuple[list[str], list[str], tuple[int, int, str]]:
        """The first stop `make(at)` builds from the text at `at` that the previous matcher meets after token 150."""
        for at in range(len(text_after[200]), len(text) - 4):
            strings, patterns = make(at)
            want = reference_stop(text_after, strings, patterns)
            if want is not None and want[0] > 150:
                return strings, patterns, want
        raise AssertionError("no stop found late in the sample")

    cases = [
        late(lambda at: ([text[at : at + 3]], [])),
        late(lambda at: ([], ["^" + esc(text[at : at + 2]), f"{esc(text[at])}.?{esc(text[at + 2])}"])),
    ]
    for strings, patterns, (k, start, matched) in cases:
        for no_stop_trim in (False, True):
            stopped = one(engine, prompt, **sampling, stop=strings or None, stop_regex=patterns or None,
                          no_stop_trim=no_stop_trim)  # fmt: skip
            assert stopped.output_ids == ids[: k + 1]
            finish = stopped.meta_info.finish_reason
            assert finish.model_dump(exclude_none=True) == {"type": "stop", "matched": matched}
            assert stopped.text == (text_after[k] if no_stop_trim else text_after[k][:start])


def test_the_whole_output_is_decoded_once_per_sample(engine, monkeypatch) -> None:
    """With stops, per token only a few trailing ids are decoded; the whole output once, for the final text (the
    previous code decoded all of it after every token)."""
    lengths: list[int] = []
    decode = engine.tokenizer.decode

    def counting(ids, **options):
        lengths.append(len(ids))
        return decode(ids, **options)

    monkeypatch.setattr(engine.tokenizer, "decode", counting)
    out = one(engine, [9, 9, 9], max_new_tokens=300, ignore_eos=True, n=2, stop=["QQ"], stop_regex="Q{3}")
    assert len(out.output_ids) == 300 and len(lengths) >= 600
    assert sorted(lengths)[-3] <= 24 and sorted(lengths)[-2:] == [300, 300]
